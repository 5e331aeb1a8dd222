//! The OpenAI-compatible routes: request parsing with errors naming the field, completions and
//! chat completions (plain and streamed as server-sent events), models, health and metrics.

use std::convert::Infallible;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Instant, SystemTime, UNIX_EPOCH};

use axum::body::Body;
use axum::extract::State;
use axum::http::{header, StatusCode};
use axum::response::sse::{Event as SseEvent, Sse};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use fp8nsa::models::{tokenizer, Event, FinishReason, Request, Sampling};
use futures_util::stream::{self, Stream, StreamExt};
use serde_json::{json, Value};
use tokenizers::Tokenizer;
use tokio::sync::{mpsc, oneshot};

use crate::metrics::Metrics;
use crate::model::ChatTemplate;
use crate::worker::Cmd;

/// What every handler shares.
pub(crate) struct AppState {
    pub(crate) cmds: Mutex<std::sync::mpsc::Sender<Cmd>>,
    pub(crate) tokenizer: Tokenizer,
    pub(crate) name: String,
    pub(crate) eos: Vec<u32>,
    pub(crate) chat: ChatTemplate,
    pub(crate) max_body_bytes: usize,
    pub(crate) metrics: Arc<Metrics>,
    pub(crate) next_id: AtomicU64,
    pub(crate) created: u64,
}

impl AppState {
    fn send(&self, cmd: Cmd) -> bool {
        self.cmds
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .send(cmd)
            .is_ok()
    }
}

pub(crate) fn router(state: Arc<AppState>) -> Router {
    Router::new()
        .route("/v1/completions", post(completions))
        .route("/v1/chat/completions", post(chat_completions))
        .route("/v1/models", get(models))
        .route("/health", get(health))
        .route("/metrics", get(metrics))
        .fallback(|| async {
            ApiError::new(
                StatusCode::NOT_FOUND,
                "not_found_error",
                None,
                "no such route",
            )
        })
        .with_state(state)
}

/// An OpenAI-style error answer: `{"error": {"message", "type", "param", "code"}}`.
#[derive(Debug)]
pub(crate) struct ApiError {
    status: StatusCode,
    kind: &'static str,
    param: Option<&'static str>,
    message: String,
}

impl ApiError {
    fn new(
        status: StatusCode,
        kind: &'static str,
        param: Option<&'static str>,
        message: impl Into<String>,
    ) -> Self {
        Self {
            status,
            kind,
            param,
            message: message.into(),
        }
    }

    /// 400 naming `param`, in the message too (clients often show only the message).
    fn bad(param: &'static str, message: impl Into<String>) -> Self {
        Self::new(
            StatusCode::BAD_REQUEST,
            "invalid_request_error",
            Some(param),
            format!("{param}: {}", message.into()),
        )
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let body = json!({"error": {
            "message": self.message, "type": self.kind, "param": self.param, "code": null}});
        (self.status, Json(body)).into_response()
    }
}

async fn health() -> Json<Value> {
    Json(json!({"status": "ok"}))
}

async fn models(State(st): State<Arc<AppState>>) -> Json<Value> {
    Json(json!({"object": "list", "data": [
        {"id": st.name, "object": "model", "created": st.created, "owned_by": "fp8nsa"}]}))
}

async fn metrics(State(st): State<Arc<AppState>>) -> Response {
    (
        [(header::CONTENT_TYPE, "text/plain; version=0.0.4")],
        st.metrics.render(),
    )
        .into_response()
}

/// The fields both endpoints share, checked.
struct Params {
    prompt: Vec<u32>,
    max_tokens: usize,
    sampling: Sampling,
    stop: Vec<String>,
    stream: bool,
    include_usage: bool,
    ignore_eos: bool,
}

async fn read_json(st: &AppState, body: Body) -> Result<serde_json::Map<String, Value>, ApiError> {
    let bytes = axum::body::to_bytes(body, st.max_body_bytes)
        .await
        .map_err(|_| {
            ApiError::new(
                StatusCode::PAYLOAD_TOO_LARGE,
                "invalid_request_error",
                None,
                format!("the request body is over {} bytes", st.max_body_bytes),
            )
        })?;
    let v: Value =
        serde_json::from_slice(&bytes).map_err(|e| match non_finite_field(&bytes, &e) {
            Some(k) => ApiError::bad(
                k,
                "must be a finite number (NaN and Infinity are not JSON numbers)",
            ),
            None => ApiError::new(
                StatusCode::BAD_REQUEST,
                "invalid_request_error",
                None,
                format!("the body is not valid JSON: {e}"),
            ),
        })?;
    match v {
        Value::Object(m) => Ok(m),
        _ => Err(ApiError::new(
            StatusCode::BAD_REQUEST,
            "invalid_request_error",
            None,
            "the body must be a JSON object",
        )),
    }
}

/// The numeric field whose value is a bare `NaN`, `Infinity` or `-Infinity` where the body
/// stops parsing: what Python's `json.dumps(float("nan"))` writes, which is not JSON. The
/// answer then names the field, as it does for the string "NaN".
fn non_finite_field(body: &[u8], e: &serde_json::Error) -> Option<&'static str> {
    const NUMERIC: [&str; 6] = [
        "temperature",
        "top_p",
        "max_tokens",
        "max_completion_tokens",
        "seed",
        "n",
    ];
    let text = std::str::from_utf8(body).ok()?;
    // serde's line and column are 1-based; the column points at (or just past) the bad token
    let line_start: usize = text
        .split_inclusive('\n')
        .take(e.line().saturating_sub(1))
        .map(str::len)
        .sum();
    let at = (line_start + e.column()).min(text.len());
    let colon = text.get(..at)?.rfind(':')?;
    let value = text[colon + 1..].trim_start();
    if !["NaN", "Infinity", "-Infinity"]
        .iter()
        .any(|t| value.starts_with(t))
    {
        return None;
    }
    // the key: the last string before the colon, which must sit in the top-level object (a
    // nested object's field of the same name is not the request's)
    let (mut depth, mut in_str, mut escaped) = (0usize, false, false);
    let mut last = (0, 0);
    for (i, c) in text[..colon].char_indices() {
        if in_str {
            match (escaped, c) {
                (true, _) => escaped = false,
                (false, '\\') => escaped = true,
                (false, '"') => {
                    in_str = false;
                    last.1 = i;
                }
                _ => {}
            }
            continue;
        }
        match c {
            '"' => {
                in_str = true;
                last = (i + 1, i + 1);
            }
            '{' | '[' => depth += 1,
            '}' | ']' => depth = depth.saturating_sub(1),
            _ => {}
        }
    }
    if depth != 1 || in_str || text[last.1..colon].trim() != "\"" {
        return None;
    }
    let key = &text[last.0..last.1];
    NUMERIC.into_iter().find(|k| *k == key)
}

fn opt<'a>(m: &'a serde_json::Map<String, Value>, k: &str) -> Option<&'a Value> {
    m.get(k).filter(|v| !v.is_null())
}

fn parse_params(
    st: &AppState,
    m: &serde_json::Map<String, Value>,
    prompt: Vec<u32>,
    default_max: usize,
    max_keys: &[&'static str],
) -> Result<Params, ApiError> {
    if let Some(v) = opt(m, "model") {
        if !v.is_string() {
            return Err(ApiError::bad("model", "must be a string"));
        }
    }
    let mut max_tokens = default_max;
    for &k in max_keys {
        if let Some(v) = opt(m, k) {
            max_tokens = match v.as_i64() {
                Some(n) if n >= 1 => n as usize,
                Some(n) => return Err(ApiError::bad(k, format!("must be at least 1, got {n}"))),
                None => return Err(ApiError::bad(k, "must be an integer")),
            };
        }
    }
    let number = |k: &'static str, default: f64| -> Result<f64, ApiError> {
        match opt(m, k) {
            None => Ok(default),
            Some(v) => v
                .as_f64()
                .filter(|x| x.is_finite())
                .ok_or_else(|| ApiError::bad(k, "must be a finite number")),
        }
    };
    let temperature = number("temperature", 1.0)?;
    if temperature < 0.0 {
        return Err(ApiError::bad(
            "temperature",
            format!("must be >= 0, got {temperature}"),
        ));
    }
    let top_p = number("top_p", 1.0)?;
    if !(top_p > 0.0 && top_p <= 1.0) {
        return Err(ApiError::bad(
            "top_p",
            format!("must be in (0, 1], got {top_p}"),
        ));
    }
    let seed = match opt(m, "seed") {
        None => st.next_id.load(Ordering::Relaxed) ^ 0x9e37_79b9_7f4a_7c15,
        Some(v) => v
            .as_u64()
            .or_else(|| v.as_i64().map(|x| x as u64))
            .ok_or_else(|| ApiError::bad("seed", "must be an integer"))?,
    };
    if let Some(v) = opt(m, "n") {
        if v.as_i64() != Some(1) {
            return Err(ApiError::bad("n", "only n = 1 is supported"));
        }
    }
    let stop = match opt(m, "stop") {
        None => Vec::new(),
        Some(Value::String(s)) => vec![s.clone()],
        Some(Value::Array(a)) if a.len() <= 4 => a
            .iter()
            .map(|x| x.as_str().map(String::from))
            .collect::<Option<Vec<_>>>()
            .ok_or_else(|| ApiError::bad("stop", "must be a string or a list of strings"))?,
        Some(_) => {
            return Err(ApiError::bad(
                "stop",
                "must be a string or a list of at most 4 strings",
            ))
        }
    };
    if stop.iter().any(|s| s.is_empty()) {
        return Err(ApiError::bad("stop", "stop strings must not be empty"));
    }
    let flag = |k: &'static str| -> Result<bool, ApiError> {
        match opt(m, k) {
            None => Ok(false),
            Some(v) => v
                .as_bool()
                .ok_or_else(|| ApiError::bad(k, "must be true or false")),
        }
    };
    let stream = flag("stream")?;
    let ignore_eos = flag("ignore_eos")?;
    let include_usage = match opt(m, "stream_options") {
        None => false,
        Some(Value::Object(o)) => match o.get("include_usage").filter(|v| !v.is_null()) {
            None => false,
            Some(v) => v.as_bool().ok_or_else(|| {
                ApiError::bad("stream_options", "include_usage must be true or false")
            })?,
        },
        Some(_) => return Err(ApiError::bad("stream_options", "must be an object")),
    };
    let sampling = if temperature == 0.0 {
        Sampling::Greedy
    } else {
        Sampling::TopP {
            p: top_p,
            temperature,
            seed,
        }
    };
    Ok(Params {
        prompt,
        max_tokens,
        sampling,
        stop,
        stream,
        include_usage,
        ignore_eos,
    })
}

fn encode(st: &AppState, text: &str, param: &'static str) -> Result<Vec<u32>, ApiError> {
    tokenizer::encode(&st.tokenizer, text).map_err(|e| ApiError::bad(param, e.to_string()))
}

async fn completions(State(st): State<Arc<AppState>>, body: Body) -> Response {
    let arrived = Instant::now();
    let m = match read_json(&st, body).await {
        Ok(m) => m,
        Err(e) => return refuse(&st, e),
    };
    let prompt = match opt(&m, "prompt") {
        Some(Value::String(s)) => encode(&st, s, "prompt"),
        Some(Value::Array(a)) if a.len() == 1 && a[0].is_string() => {
            encode(&st, a[0].as_str().unwrap_or_default(), "prompt")
        }
        Some(Value::Array(a)) if !a.is_empty() && a.iter().all(|x| x.is_u64()) => a
            .iter()
            .map(|x| {
                x.as_u64()
                    .and_then(|t| u32::try_from(t).ok())
                    .ok_or_else(|| ApiError::bad("prompt", "token ids must fit in u32"))
            })
            .collect(),
        Some(_) => Err(ApiError::bad(
            "prompt",
            "must be a string, a list of one string, or a list of token ids",
        )),
        None => Err(ApiError::bad("prompt", "is required")),
    };
    let params = match prompt.and_then(|p| parse_params(&st, &m, p, 16, &["max_tokens"])) {
        Ok(p) => p,
        Err(e) => return refuse(&st, e),
    };
    generate(st, params, Kind::Completion, arrived).await
}

async fn chat_completions(State(st): State<Arc<AppState>>, body: Body) -> Response {
    let arrived = Instant::now();
    let m = match read_json(&st, body).await {
        Ok(m) => m,
        Err(e) => return refuse(&st, e),
    };
    let prompt = chat_prompt(&st, &m);
    // without max_tokens a chat reply runs to its end-of-turn or the context
    let params = match prompt.and_then(|p| {
        parse_params(
            &st,
            &m,
            p,
            usize::MAX / 2,
            &["max_tokens", "max_completion_tokens"],
        )
    }) {
        Ok(p) => p,
        Err(e) => return refuse(&st, e),
    };
    generate(st, params, Kind::Chat, arrived).await
}

fn chat_prompt(st: &AppState, m: &serde_json::Map<String, Value>) -> Result<Vec<u32>, ApiError> {
    let msgs = match opt(m, "messages") {
        Some(Value::Array(a)) if !a.is_empty() => a,
        Some(Value::Array(_)) => return Err(ApiError::bad("messages", "must not be empty")),
        Some(_) => return Err(ApiError::bad("messages", "must be a list of messages")),
        None => return Err(ApiError::bad("messages", "is required")),
    };
    let mut turns: Vec<(String, String)> = Vec::with_capacity(msgs.len());
    for (i, msg) in msgs.iter().enumerate() {
        let role = msg.get("role").and_then(|r| r.as_str()).ok_or_else(|| {
            ApiError::bad("messages", format!("message {i} needs a string `role`"))
        })?;
        let content = match msg.get("content") {
            Some(Value::String(s)) => s.clone(),
            // content parts: the text ones, concatenated
            Some(Value::Array(parts)) => parts
                .iter()
                .map(
                    |p| match (p.get("type").and_then(|t| t.as_str()), p.get("text")) {
                        (Some("text"), Some(Value::String(t))) => Ok(t.as_str()),
                        _ => Err(ApiError::bad(
                            "messages",
                            format!("message {i}: only text content parts are supported"),
                        )),
                    },
                )
                .collect::<Result<Vec<_>, _>>()?
                .concat(),
            Some(Value::Null) | None => String::new(),
            Some(_) => {
                return Err(ApiError::bad(
                    "messages",
                    format!("message {i}: `content` must be a string or a list of parts"),
                ))
            }
        };
        turns.push((role.to_string(), content));
    }
    match st.chat {
        ChatTemplate::ChatMl => {
            let refs: Vec<(&str, &str)> = turns
                .iter()
                .map(|(r, c)| (r.as_str(), c.as_str()))
                .collect();
            tokenizer::chatml(&st.tokenizer, &refs)
                .map_err(|e| ApiError::bad("messages", e.to_string()))
        }
        ChatTemplate::Unsupported => Err(ApiError::bad(
            "messages",
            "this model's chat template is not one this server builds (ChatML); use \
             /v1/completions with the prompt formatted by the client",
        )),
    }
}

fn refuse(st: &AppState, e: ApiError) -> Response {
    st.metrics.requests_refused.fetch_add(1, Ordering::Relaxed);
    e.into_response()
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum Kind {
    Completion,
    Chat,
}

/// Turns a request's token events into text, holding back what could be the start of a stop
/// string, and what is an incomplete UTF-8 sequence, until it is known.
struct Detok {
    ids: Vec<u32>,
    text: String,
    sent: usize,
    stops: Vec<String>,
    /// Set once a stop string was found (the text is cut before it).
    stopped: bool,
}

impl Detok {
    fn push(&mut self, tok: &Tokenizer, id: u32) {
        self.ids.push(id);
        let Ok(t) = tokenizer::decode(tok, &self.ids) else {
            return;
        };
        self.text = t;
        let from = self
            .sent
            .saturating_sub(self.stops.iter().map(|s| s.len()).max().unwrap_or(0));
        let from = floor_char(&self.text, from);
        if let Some(at) = self
            .stops
            .iter()
            .filter_map(|s| self.text[from..].find(s.as_str()).map(|i| from + i))
            .min()
        {
            self.text.truncate(at);
            self.stopped = true;
        }
    }

    /// Text not yet sent that is final.
    fn take(&mut self, finished: bool) -> String {
        let mut end = self.text.len();
        if !finished {
            // an incomplete UTF-8 sequence decodes as U+FFFD until its last byte comes
            end = self.text.trim_end_matches('\u{FFFD}').len();
            let hold = self.stops.iter().map(|s| s.len()).max().unwrap_or(1) - 1;
            end = floor_char(&self.text, end.saturating_sub(hold));
        }
        if end <= self.sent {
            return String::new();
        }
        let out = self.text[self.sent..end].to_string();
        self.sent = end;
        out
    }
}

fn floor_char(s: &str, mut i: usize) -> usize {
    i = i.min(s.len());
    while !s.is_char_boundary(i) {
        i -= 1;
    }
    i
}

/// The life of one request after its parameters are checked: queue it, then follow its events.
struct Job {
    st: Arc<AppState>,
    id: u64,
    kind: Kind,
    events: mpsc::UnboundedReceiver<Event>,
    detok: Detok,
    prompt_tokens: usize,
    completion_tokens: usize,
    arrived: Instant,
    last_token: Option<Instant>,
    finish: Option<&'static str>,
    include_usage: bool,
    created: u64,
}

impl Job {
    /// The next piece of text and whether the request is done; `Err` when it failed.
    async fn next(&mut self) -> Result<(String, bool), String> {
        loop {
            if self.finish.is_some() {
                return Ok((self.detok.take(true), true));
            }
            let Some(e) = self.events.recv().await else {
                return Err("the engine stopped".into());
            };
            match e {
                Event::Token { token, .. } => {
                    let now = Instant::now();
                    match self.last_token {
                        None => self
                            .st
                            .metrics
                            .time_to_first_token((now - self.arrived).as_secs_f64()),
                        Some(t) => self.st.metrics.inter_token((now - t).as_secs_f64()),
                    }
                    self.last_token = Some(now);
                    self.completion_tokens += 1;
                    self.detok.push(&self.st.tokenizer, token);
                    if self.detok.stopped {
                        // a stop string: this request is done, its sequence can go
                        self.st.send(Cmd::Cancel(self.id));
                        self.finish = Some("stop");
                        return Ok((self.detok.take(true), true));
                    }
                    let piece = self.detok.take(false);
                    if !piece.is_empty() {
                        return Ok((piece, false));
                    }
                }
                Event::Finished { reason, .. } => {
                    self.finish = Some(match reason {
                        FinishReason::Stop => "stop",
                        FinishReason::Length => "length",
                    });
                }
                Event::Failed { error, .. } => return Err(error),
            }
        }
    }

    fn usage(&self) -> Value {
        json!({"prompt_tokens": self.prompt_tokens, "completion_tokens": self.completion_tokens,
               "total_tokens": self.prompt_tokens + self.completion_tokens})
    }

    fn ids(&self) -> (String, &'static str) {
        match self.kind {
            Kind::Completion => (format!("cmpl-{}", self.id), "text_completion"),
            Kind::Chat => (format!("chatcmpl-{}", self.id), "chat.completion.chunk"),
        }
    }

    fn chunk(&self, text: &str, finish: Option<&str>, first: bool) -> Value {
        let (id, object) = self.ids();
        let choice = match self.kind {
            Kind::Completion => {
                json!({"index": 0, "text": text, "logprobs": null, "finish_reason": finish})
            }
            Kind::Chat => {
                let delta = match (first, finish) {
                    (true, _) => json!({"role": "assistant", "content": text}),
                    (false, Some(_)) if text.is_empty() => json!({}),
                    _ => json!({"content": text}),
                };
                json!({"index": 0, "delta": delta, "logprobs": null, "finish_reason": finish})
            }
        };
        json!({"id": id, "object": object, "created": self.created,
               "model": self.st.name, "choices": [choice]})
    }

    fn finish_metrics(&self, ok: bool) {
        let c = if ok {
            &self.st.metrics.requests_ok
        } else {
            &self.st.metrics.requests_failed
        };
        c.fetch_add(1, Ordering::Relaxed);
    }
}

async fn generate(st: Arc<AppState>, p: Params, kind: Kind, arrived: Instant) -> Response {
    let id = st.next_id.fetch_add(1, Ordering::Relaxed);
    let (etx, erx) = mpsc::unbounded_channel();
    let (rtx, rrx) = oneshot::channel();
    let req = Request {
        prompt: p.prompt.clone(),
        max_tokens: p.max_tokens,
        sampling: p.sampling,
        stop_tokens: if p.ignore_eos {
            Vec::new()
        } else {
            st.eos.clone()
        },
    };
    let prompt_tokens = req.prompt.len();
    if !st.send(Cmd::Add {
        id,
        req,
        events: etx,
        reply: rtx,
    }) {
        return ApiError::new(
            StatusCode::SERVICE_UNAVAILABLE,
            "server_error",
            None,
            "the server is shutting down",
        )
        .into_response();
    }
    match rrx.await {
        Ok(Ok(())) => {}
        Ok(Err(fp8nsa::models::Error::Invalid { arg: "queue", msg })) => {
            return refuse(
                &st,
                ApiError::new(
                    StatusCode::TOO_MANY_REQUESTS,
                    "rate_limit_error",
                    None,
                    format!("the server is busy ({msg}); retry later"),
                ),
            )
        }
        Ok(Err(fp8nsa::models::Error::Invalid { arg, msg })) => {
            let param = match (arg, kind) {
                ("prompt", Kind::Chat) => "messages",
                ("prompt", _) => "prompt",
                ("max_tokens", _) => "max_tokens",
                ("sampling", _) => "temperature",
                _ => "request",
            };
            return refuse(&st, ApiError::bad(param, msg));
        }
        Ok(Err(e)) => return refuse(&st, ApiError::bad("request", e.to_string())),
        Err(_) => {
            return ApiError::new(
                StatusCode::SERVICE_UNAVAILABLE,
                "server_error",
                None,
                "the engine stopped",
            )
            .into_response()
        }
    }
    let created = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs());
    let job = Job {
        st: st.clone(),
        id,
        kind,
        events: erx,
        detok: Detok {
            ids: Vec::new(),
            text: String::new(),
            sent: 0,
            stops: p.stop.clone(),
            stopped: false,
        },
        prompt_tokens,
        completion_tokens: 0,
        arrived,
        last_token: None,
        finish: None,
        include_usage: p.include_usage,
        created,
    };
    if p.stream {
        Sse::new(sse(job)).into_response()
    } else {
        whole(job).await
    }
}

async fn whole(mut job: Job) -> Response {
    let mut text = String::new();
    let finish = loop {
        match job.next().await {
            Ok((piece, done)) => {
                text.push_str(&piece);
                if done {
                    break job.finish.unwrap_or("stop");
                }
            }
            Err(e) => {
                job.finish_metrics(false);
                return ApiError::new(StatusCode::INTERNAL_SERVER_ERROR, "server_error", None, e)
                    .into_response();
            }
        }
    };
    job.finish_metrics(true);
    let (id, _) = job.ids();
    let choice = match job.kind {
        Kind::Completion => {
            json!({"index": 0, "text": text, "logprobs": null, "finish_reason": finish})
        }
        Kind::Chat => json!({"index": 0, "logprobs": null, "finish_reason": finish,
                             "message": {"role": "assistant", "content": text}}),
    };
    let object = match job.kind {
        Kind::Completion => "text_completion",
        Kind::Chat => "chat.completion",
    };
    Json(
        json!({"id": id, "object": object, "created": job.created, "model": job.st.name,
                "choices": [choice], "usage": job.usage()}),
    )
    .into_response()
}

/// The streamed answer: a chunk per piece of text, the last with its finish reason, the usage
/// when asked for, then `[DONE]`. Dropped with its connection, it drops the event receiver, and
/// the engine thread cancels the sequence at its next token.
fn sse(job: Job) -> impl Stream<Item = Result<SseEvent, Infallible>> {
    enum St {
        Run(Box<Job>, bool),
        Done,
    }
    stream::unfold(St::Run(Box::new(job), true), |s| async move {
        let St::Run(mut job, first) = s else {
            return None;
        };
        let data = |v: Value| SseEvent::default().data(v.to_string());
        match job.next().await {
            Ok((piece, false)) => {
                let ev = data(job.chunk(&piece, None, first));
                Some((vec![ev], St::Run(job, false)))
            }
            Ok((piece, true)) => {
                job.finish_metrics(true);
                let mut evs = Vec::new();
                if first && job.kind == Kind::Chat {
                    evs.push(data(job.chunk("", None, true)));
                }
                evs.push(data(job.chunk(&piece, job.finish, false)));
                if job.include_usage {
                    let (id, object) = job.ids();
                    evs.push(data(
                        json!({"id": id, "object": object, "created": job.created,
                        "model": job.st.name, "choices": [], "usage": job.usage()}),
                    ));
                }
                evs.push(SseEvent::default().data("[DONE]"));
                Some((evs, St::Done))
            }
            Err(e) => {
                job.finish_metrics(false);
                let err = json!({"error": {"message": e, "type": "server_error",
                                           "param": null, "code": null}});
                Some((
                    vec![data(err), SseEvent::default().data("[DONE]")],
                    St::Done,
                ))
            }
        }
    })
    .flat_map(|evs| stream::iter(evs.into_iter().map(Ok)))
}
