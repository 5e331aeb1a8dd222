//! The engine's thread: it owns the [`Engine`], takes requests and cancellations between
//! steps, runs steps while there is work, and hands each request's events to its HTTP task.
//! A request whose task is gone (the client disconnected) is cancelled before the next step,
//! whether it is decoding, prefilling or still waiting, so its pages are free by then.

use std::collections::HashMap;
use std::panic::AssertUnwindSafe;
use std::sync::mpsc::{Receiver, TryRecvError};
use std::sync::Arc;

use fp8nsa::models::{Engine, Event, Request};
use tokio::sync::{mpsc, oneshot};

use crate::metrics::Metrics;

pub(crate) enum Cmd {
    Add {
        id: u64,
        req: Request,
        events: mpsc::UnboundedSender<Event>,
        reply: oneshot::Sender<fp8nsa::models::Result<()>>,
    },
    Cancel(u64),
    /// Shutdown past its grace period: every request still in the engine fails, the thread
    /// ends.
    Stop,
}

pub(crate) fn run(mut engine: Engine, rx: Receiver<Cmd>, metrics: Arc<Metrics>) {
    let mut subs: HashMap<u64, mpsc::UnboundedSender<Event>> = HashMap::new();
    let mut open = true;
    metrics.publish(engine.stats());
    loop {
        // idle: sleep until a command comes; busy: take whatever has come in, then step
        if !engine.has_work() {
            if !open {
                return;
            }
            match rx.recv() {
                Ok(Cmd::Stop) | Err(_) => return stop(&mut engine, &mut subs, &metrics),
                Ok(cmd) => handle(&mut engine, &mut subs, &metrics, cmd),
            }
        }
        while open {
            match rx.try_recv() {
                Ok(Cmd::Stop) => return stop(&mut engine, &mut subs, &metrics),
                Ok(cmd) => handle(&mut engine, &mut subs, &metrics, cmd),
                Err(TryRecvError::Empty) => break,
                // the server is gone: finish what is running (its tasks may still listen)
                Err(TryRecvError::Disconnected) => open = false,
            }
        }
        // clients that left since the last step: their requests go before it runs (one that
        // waits or prefills sends no event that would tell)
        let gone: Vec<u64> = subs
            .iter()
            .filter(|(_, tx)| tx.is_closed())
            .map(|(&id, _)| id)
            .collect();
        for id in gone {
            cancel_gone(&mut engine, &mut subs, &metrics, id);
        }
        if engine.has_work() {
            match std::panic::catch_unwind(AssertUnwindSafe(|| engine.step())) {
                Ok(events) => {
                    // the stats first: a client that reads /metrics after its answer came sees
                    // its sequence gone
                    metrics.publish(engine.stats());
                    for e in events {
                        dispatch(&mut engine, &mut subs, &metrics, e);
                    }
                }
                Err(_) => {
                    // a bug, not an input: fail the step's requests (the running sequences,
                    // whose state it may have left half-written) rather than the server; their
                    // pages go back, the waiting requests go on
                    let ids = engine.drop_running();
                    tracing::error!("engine step panicked; failing its {} requests", ids.len());
                    for id in ids {
                        if let Some(tx) = subs.remove(&id) {
                            let _ = tx.send(Event::Failed {
                                id,
                                error: "internal error in the engine step".into(),
                            });
                        }
                    }
                }
            }
        }
        metrics.publish(engine.stats());
    }
}

/// Fails every request still in the engine (their sequences and pages dropped).
fn stop(
    engine: &mut Engine,
    subs: &mut HashMap<u64, mpsc::UnboundedSender<Event>>,
    metrics: &Metrics,
) {
    for (id, tx) in subs.drain() {
        engine.cancel(id);
        let _ = tx.send(Event::Failed {
            id,
            error: "the server is shutting down".into(),
        });
    }
    metrics.publish(engine.stats());
}

fn handle(
    engine: &mut Engine,
    subs: &mut HashMap<u64, mpsc::UnboundedSender<Event>>,
    metrics: &Metrics,
    cmd: Cmd,
) {
    match cmd {
        Cmd::Add {
            id,
            req,
            events,
            reply,
        } => {
            let prompt = req.prompt.len() as u64;
            let r = engine.add(id, req);
            if r.is_ok() {
                subs.insert(id, events);
                metrics
                    .prompt_tokens
                    .fetch_add(prompt, std::sync::atomic::Ordering::Relaxed);
            }
            if reply.send(r).is_err() {
                // the client left before the answer
                engine.cancel(id);
                subs.remove(&id);
            }
        }
        Cmd::Cancel(id) => {
            engine.cancel(id);
            subs.remove(&id);
        }
        // taken by `run` before it gets here
        Cmd::Stop => {}
    }
    metrics.publish(engine.stats());
}

fn dispatch(
    engine: &mut Engine,
    subs: &mut HashMap<u64, mpsc::UnboundedSender<Event>>,
    metrics: &Metrics,
    e: Event,
) {
    let (id, last) = match &e {
        Event::Token { id, .. } => {
            metrics
                .generated_tokens
                .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            (*id, false)
        }
        Event::Finished { id, .. } | Event::Failed { id, .. } => (*id, true),
    };
    let Some(tx) = subs.get(&id) else {
        return;
    };
    if tx.send(e).is_err() {
        // nobody listens: the client disconnected
        cancel_gone(engine, subs, metrics, id);
    } else if last {
        subs.remove(&id);
    }
}

/// Drops request `id`, whose client disconnected: its sequence and pages go, it is counted as
/// cancelled.
fn cancel_gone(
    engine: &mut Engine,
    subs: &mut HashMap<u64, mpsc::UnboundedSender<Event>>,
    metrics: &Metrics,
    id: u64,
) {
    engine.cancel(id);
    subs.remove(&id);
    metrics
        .requests_cancelled
        .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
}
