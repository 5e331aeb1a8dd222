//! The values of one field of the `tracing` events a closure emits (`backend` and `kernel` for
//! both layers), captured by a thread-local subscriber: for tests of what the logs say. Which
//! path ran is asserted from the layers' returned `Fp8Path` / `NsaPath`.

use std::fmt::Debug;
use std::sync::{Arc, Mutex};

use tracing::field::{Field, Visit};
use tracing_subscriber::layer::{Context, SubscriberExt};

struct Capture {
    field: &'static str,
    seen: Arc<Mutex<Vec<String>>>,
}

struct Values<'a>(&'static str, &'a mut Vec<String>);

impl Visit for Values<'_> {
    fn record_str(&mut self, f: &Field, v: &str) {
        if f.name() == self.0 {
            self.1.push(v.to_string());
        }
    }

    fn record_debug(&mut self, f: &Field, v: &dyn Debug) {
        if f.name() == self.0 {
            self.1.push(format!("{v:?}"));
        }
    }
}

impl<S: tracing::Subscriber> tracing_subscriber::Layer<S> for Capture {
    fn on_event(&self, e: &tracing::Event<'_>, _: Context<'_, S>) {
        e.record(&mut Values(self.field, &mut self.seen.lock().unwrap()));
    }
}

/// `f`'s result and the values `field` took in its events, in order.
pub fn logged<R>(field: &'static str, f: impl FnOnce() -> R) -> (R, Vec<String>) {
    let seen = Arc::new(Mutex::new(Vec::new()));
    let sub = tracing_subscriber::registry().with(Capture {
        field,
        seen: seen.clone(),
    });
    let r = tracing::subscriber::with_default(sub, f);
    let seen = seen.lock().unwrap().clone();
    (r, seen)
}
