//! Continuous batching: requests join the running batch at the next step and leave when they
//! finish; prompts are prefilled in chunks under a per-step token budget; KV pages are admitted
//! against and, under pressure, taken back from the most recently admitted sequence, which is
//! recomputed when it resumes (vLLM's recompute preemption).
//!
//! The engine is the scheduler and the model runner; it knows nothing of HTTP or text. A server
//! drives it from one thread: [`Engine::add`] and [`Engine::cancel`] between steps,
//! [`Engine::step`] while [`Engine::has_work`], forwarding the [`Event`]s.

use std::collections::VecDeque;

use candle_core::DType;
use rand::SeedableRng;

use crate::error::{invalid, Error, Result};
use crate::generate::{pick, Sampling};
use crate::llama::{BatchSeq, Llama, Logits};
use crate::paged::{KvPool, SeqKv};

/// Sizes of the engine.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct EngineConfig {
    /// KV pages (per layer). On the CPU the pool's memory is committed when the engine is
    /// made (written once, as llama.cpp clears its cache), not page by page while serving.
    pub kv_pages: usize,
    /// Tokens per page.
    pub page_size: usize,
    /// Element type of the KV pages: F32 (the default: the same numbers as
    /// [`Llama::forward`]), or F16 / BF16 for half the bytes per decode step
    /// ([`Llama::new_kv_pool`]).
    pub kv_dtype: DType,
    /// Tokens one step runs at most (decode tokens plus prefill chunks).
    pub max_batch_tokens: usize,
    /// Sequences one step runs at most.
    pub max_running: usize,
    /// Requests waiting for admission at most; [`Engine::add`] refuses more.
    pub max_waiting: usize,
}

impl Default for EngineConfig {
    fn default() -> Self {
        Self {
            kv_pages: 2048,
            page_size: 16,
            kv_dtype: DType::F32,
            max_batch_tokens: 512,
            max_running: 64,
            max_waiting: 256,
        }
    }
}

/// What a request asks for, in tokens.
#[derive(Clone, Debug, PartialEq)]
pub struct Request {
    pub prompt: Vec<u32>,
    /// New tokens at most.
    pub max_tokens: usize,
    pub sampling: Sampling,
    /// Tokens that end the completion (the model's end-of-sequence ids unless the client
    /// asked to ignore them); the stop token is part of the output.
    pub stop_tokens: Vec<u32>,
}

/// Why a sequence ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FinishReason {
    /// A stop token.
    Stop,
    /// `max_tokens`, or the context (or KV capacity) is full.
    Length,
}

/// What a step produced for one request.
#[derive(Clone, Debug, PartialEq)]
pub enum Event {
    /// The next token of request `id`.
    Token { id: u64, token: u32 },
    /// Request `id` is done (after its last `Token`).
    Finished {
        id: u64,
        reason: FinishReason,
        prompt_tokens: usize,
        completion_tokens: usize,
    },
    /// Request `id` failed; its pages are free.
    Failed { id: u64, error: String },
}

/// A snapshot for metrics.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct EngineStats {
    pub running: usize,
    pub waiting: usize,
    pub pages_used: usize,
    pub pages_free: usize,
    /// Sequences preempted so far.
    pub preemptions: u64,
}

#[derive(Debug)]
struct Seq {
    id: u64,
    req: Request,
    /// Prompt, then every token generated.
    tokens: Vec<u32>,
    /// `None` while waiting.
    kv: Option<SeqKv>,
    rng: rand::rngs::StdRng,
    /// Tokens this sequence may reach (context and KV capacity).
    max_len: usize,
}

impl Seq {
    fn computed(&self) -> usize {
        self.kv.as_ref().map_or(0, |k| k.len())
    }

    fn generated(&self) -> usize {
        self.tokens.len() - self.req.prompt.len()
    }
}

/// The scheduler and model runner of a server. See the module docs.
///
/// ```
/// use fp8nsa_models::{Engine, EngineConfig, Event, Llama, LlamaConfig, ModelOptions, Request,
///                     Sampling, Weights};
///
/// let cfg = LlamaConfig::tiny();
/// let model = Llama::new(&cfg, &Weights::random(&cfg, 1)?, &ModelOptions::default())?;
/// let mut engine = Engine::new(model, EngineConfig { kv_pages: 32, ..EngineConfig::default() })?;
/// for id in 0..3 {
///     let prompt = vec![1, 2, 3 + id as u32];
///     engine.add(id, Request { prompt, max_tokens: 4, sampling: Sampling::Greedy, stop_tokens: vec![] })?;
/// }
/// let mut tokens = 0;
/// while engine.has_work() {
///     for e in engine.step() {
///         if let Event::Token { .. } = e { tokens += 1; }
///     }
/// }
/// assert_eq!((tokens, engine.stats().pages_used), (12, 0));
/// # Ok::<(), fp8nsa_models::Error>(())
/// ```
#[derive(Debug)]
pub struct Engine {
    model: Llama,
    pool: KvPool,
    cfg: EngineConfig,
    waiting: VecDeque<Seq>,
    /// In admission order: the last is the first to be preempted.
    running: Vec<Seq>,
    preemptions: u64,
}

impl Engine {
    pub fn new(model: Llama, cfg: EngineConfig) -> Result<Self> {
        for (arg, v) in [
            ("max_batch_tokens", cfg.max_batch_tokens),
            ("max_running", cfg.max_running),
        ] {
            if v == 0 {
                return Err(invalid(arg, "must be at least 1"));
            }
        }
        let pool = model.new_kv_pool(cfg.kv_pages, cfg.page_size, cfg.kv_dtype)?;
        Ok(Self {
            model,
            pool,
            cfg,
            waiting: VecDeque::new(),
            running: Vec::new(),
            preemptions: 0,
        })
    }

    pub fn model(&self) -> &Llama {
        &self.model
    }

    pub fn config(&self) -> &EngineConfig {
        &self.cfg
    }

    /// Tokens the KV pages hold when full.
    pub fn kv_capacity_tokens(&self) -> usize {
        self.pool.capacity_tokens()
    }

    /// The longest prompt [`Self::add`] takes: one token must still fit after it.
    pub fn max_prompt_tokens(&self) -> usize {
        self.max_len().saturating_sub(1)
    }

    fn max_len(&self) -> usize {
        self.model
            .config()
            .max_position_embeddings
            .min(self.pool.capacity_tokens())
    }

    /// Queues request `id` (ids are the caller's; one in use is refused). Refused, typed:
    /// an empty prompt, `max_tokens` 0, bad sampling, a token outside the vocabulary
    /// (`prompt`), a prompt longer than [`Self::max_prompt_tokens`] (`prompt`), a full queue
    /// (`queue`).
    pub fn add(&mut self, id: u64, req: Request) -> Result<()> {
        if req.prompt.is_empty() {
            return Err(invalid("prompt", "needs at least one token"));
        }
        if req.max_tokens == 0 {
            return Err(invalid("max_tokens", "must be at least 1"));
        }
        req.sampling.validate()?;
        let vocab = self.model.config().vocab_size;
        if let Some(&bad) = req.prompt.iter().find(|&&t| t as usize >= vocab) {
            return Err(invalid(
                "prompt",
                format!("token id {bad} is outside the vocabulary of {vocab}"),
            ));
        }
        if req.prompt.len() > self.max_prompt_tokens() {
            return Err(invalid(
                "prompt",
                format!(
                    "{} tokens; this server takes at most {} (context {}, KV capacity {})",
                    req.prompt.len(),
                    self.max_prompt_tokens(),
                    self.model.config().max_position_embeddings,
                    self.pool.capacity_tokens()
                ),
            ));
        }
        if self.waiting.len() >= self.cfg.max_waiting {
            return Err(invalid(
                "queue",
                format!("{} requests are waiting already", self.waiting.len()),
            ));
        }
        if self.running.iter().chain(&self.waiting).any(|s| s.id == id) {
            return Err(invalid("id", format!("request {id} is already queued")));
        }
        let seed = match req.sampling {
            Sampling::TopP { seed, .. } => seed,
            Sampling::Greedy => 0,
        };
        self.waiting.push_back(Seq {
            id,
            tokens: req.prompt.clone(),
            req,
            kv: None,
            rng: rand::rngs::StdRng::seed_from_u64(seed),
            max_len: self.max_len(),
        });
        Ok(())
    }

    /// Drops request `id` wherever it is; its pages are free at once. Whether it was there.
    pub fn cancel(&mut self, id: u64) -> bool {
        let before = self.running.len() + self.waiting.len();
        self.running.retain(|s| s.id != id);
        self.waiting.retain(|s| s.id != id);
        before != self.running.len() + self.waiting.len()
    }

    /// Drops every running sequence (their pages go back at once) and returns their ids; the
    /// waiting requests stay. For a server that caught a panic around [`Engine::step`]: the
    /// step's sequences may hold half-written state and must go, the waiting ones were not
    /// touched by it.
    ///
    /// ```
    /// use fp8nsa_models::{Engine, EngineConfig, Llama, LlamaConfig, ModelOptions, Request, Sampling, Weights};
    ///
    /// let cfg = LlamaConfig::tiny();
    /// let model = Llama::new(&cfg, &Weights::random(&cfg, 1)?, &ModelOptions::default())?;
    /// let mut engine = Engine::new(model, EngineConfig { max_running: 1, ..EngineConfig::default() })?;
    /// let req = Request { prompt: vec![3, 4], max_tokens: 4, sampling: Sampling::Greedy, stop_tokens: vec![] };
    /// engine.add(1, req.clone())?;
    /// engine.add(2, req)?;
    /// engine.step(); // 1 runs, 2 waits (one running sequence at most)
    /// assert_eq!(engine.drop_running(), vec![1]);
    /// assert_eq!((engine.stats().running, engine.stats().waiting, engine.stats().pages_used), (0, 1, 0));
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn drop_running(&mut self) -> Vec<u64> {
        self.running.drain(..).map(|s| s.id).collect()
    }

    pub fn has_work(&self) -> bool {
        !self.running.is_empty() || !self.waiting.is_empty()
    }

    pub fn stats(&self) -> EngineStats {
        let free = self.pool.free_pages();
        EngineStats {
            running: self.running.len(),
            waiting: self.waiting.len(),
            pages_used: self.pool.total_pages() - free,
            pages_free: free,
            preemptions: self.preemptions,
        }
    }

    /// One step: schedule (admit, preempt), run the batch, sample. Empty when idle.
    pub fn step(&mut self) -> Vec<Event> {
        let plan = self.schedule();
        if plan.is_empty() {
            return Vec::new();
        }
        let mut events = Vec::new();
        let out = {
            let mut batch: Vec<BatchSeq<'_>> = Vec::with_capacity(plan.len());
            let mut rest: &mut [Seq] = &mut self.running;
            let mut at = 0;
            // the plan is in running order; split disjoint borrows of each planned sequence
            for &(i, n) in &plan {
                let (_, tail) = std::mem::take(&mut rest).split_at_mut(i - at);
                let (s, tail) = tail.split_first_mut().expect("planned index in range");
                rest = tail;
                at = i + 1;
                let from = s.kv.as_ref().map_or(0, |k| k.len());
                batch.push(BatchSeq {
                    tokens: &s.tokens[from..from + n],
                    kv: s.kv.as_mut().expect("running sequences hold KV"),
                });
            }
            self.model
                .forward_batch(&self.pool, &mut batch, Logits::Last)
        };
        match out {
            Ok(logits) => {
                let mut done = Vec::new();
                for (&(i, _), l) in plan.iter().zip(&logits) {
                    let s = &mut self.running[i];
                    if s.computed() < s.tokens.len() {
                        continue; // a prefill chunk short of the end: nothing to sample yet
                    }
                    let token = match l
                        .squeeze(0)
                        .map_err(Error::from)
                        .and_then(|row| pick(&row, s.req.sampling, &mut s.rng))
                    {
                        Ok(t) => t,
                        Err(e) => {
                            events.push(Event::Failed {
                                id: s.id,
                                error: e.to_string(),
                            });
                            done.push(i);
                            continue;
                        }
                    };
                    s.tokens.push(token);
                    events.push(Event::Token { id: s.id, token });
                    let reason = if s.req.stop_tokens.contains(&token) {
                        Some(FinishReason::Stop)
                    } else if s.generated() >= s.req.max_tokens || s.tokens.len() >= s.max_len {
                        Some(FinishReason::Length)
                    } else {
                        None
                    };
                    if let Some(reason) = reason {
                        events.push(Event::Finished {
                            id: s.id,
                            reason,
                            prompt_tokens: s.req.prompt.len(),
                            completion_tokens: s.generated(),
                        });
                        done.push(i);
                    }
                }
                self.remove(&done);
            }
            Err(e) => {
                // the step's own requests fail; the others (waiting) go on
                let msg = e.to_string();
                let ids: Vec<usize> = plan.iter().map(|&(i, _)| i).collect();
                for &i in &ids {
                    events.push(Event::Failed {
                        id: self.running[i].id,
                        error: msg.clone(),
                    });
                }
                self.remove(&ids);
            }
        }
        events
    }

    fn remove(&mut self, idx: &[usize]) {
        let mut i = 0;
        self.running.retain(|_| {
            let keep = !idx.contains(&i);
            i += 1;
            keep
        });
    }

    /// Which running sequences run this step and how many tokens each: `(index in running,
    /// tokens)`, in running order. Admits waiting requests while the token budget and the
    /// pages allow, and preempts the most recently admitted sequences when the running ones
    /// need pages the pool does not have.
    fn schedule(&mut self) -> Vec<(usize, usize)> {
        let ps = self.pool.page_size();
        let mut free = self.pool.free_pages();
        // 1. running sequences, oldest first, until the budget is spent; pages for each,
        //    preempting from the newest end when short
        let mut budget = self.cfg.max_batch_tokens;
        let mut plan: Vec<(usize, usize)> = Vec::new();
        let mut i = 0;
        while i < self.running.len() && budget > 0 {
            let s = &self.running[i];
            let computed = s.computed();
            let n = (s.tokens.len() - computed).min(budget);
            let held = s.kv.as_ref().map_or(0, |k| k.pages());
            let need = (computed + n).div_ceil(ps).saturating_sub(held);
            if need > free {
                // take pages back from the newest sequence that is not this one; if this one
                // is the newest, it waits (preempted itself)
                let victim = self.running.len() - 1;
                let freed = self.preempt(victim);
                if victim == i {
                    break;
                }
                // planned sequences are older than `i`, so the victim was not planned
                free += freed;
                continue;
            }
            free -= need;
            budget -= n;
            plan.push((i, n));
            i += 1;
        }
        // 2. waiting requests, first come first served, while the budget, the batch size and
        //    the pages allow: a request is admitted only when the pages for its whole prompt
        //    (and its first new token) are free, so that one admitted now is not preempted as
        //    soon as its next chunk needs pages
        while budget > 0 && self.running.len() < self.cfg.max_running {
            let Some(s) = self.waiting.front() else {
                break;
            };
            let whole = (s.tokens.len() + 1).div_ceil(ps);
            if whole > free {
                break;
            }
            let mut s = self.waiting.pop_front().expect("front exists");
            let n = s.tokens.len().min(budget);
            s.kv = Some(self.pool.new_seq());
            free -= whole;
            budget -= n;
            self.running.push(s);
            plan.push((self.running.len() - 1, n));
        }
        plan
    }

    /// Moves running sequence `i` back to the front of the queue, its pages freed (its tokens
    /// are recomputed when it resumes). The pages it gave back.
    fn preempt(&mut self, i: usize) -> usize {
        let mut s = self.running.remove(i);
        let freed = s.kv.take().map_or(0, |k| k.pages());
        self.preemptions += 1;
        self.waiting.push_front(s);
        freed
    }
}
