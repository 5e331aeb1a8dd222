//! Counters and latency histograms, rendered in Prometheus' text format for `GET /metrics`.

use std::fmt::Write;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;

use fp8nsa::models::EngineStats;

/// Upper bounds (seconds) of the latency buckets.
const BUCKETS: [f64; 14] = [
    0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56, 5.12, 10.24, 20.48, 40.96,
];

#[derive(Debug, Default)]
struct Histogram {
    counts: [u64; BUCKETS.len()],
    count: u64,
    sum: f64,
}

impl Histogram {
    fn observe(&mut self, s: f64) {
        for (c, b) in self.counts.iter_mut().zip(BUCKETS) {
            if s <= b {
                *c += 1;
            }
        }
        self.count += 1;
        self.sum += s;
    }

    fn render(&self, out: &mut String, name: &str, help: &str) {
        let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} histogram");
        for (c, b) in self.counts.iter().zip(BUCKETS) {
            let _ = writeln!(out, "{name}_bucket{{le=\"{b}\"}} {c}");
        }
        let _ = writeln!(out, "{name}_bucket{{le=\"+Inf\"}} {}", self.count);
        let _ = writeln!(out, "{name}_sum {}\n{name}_count {}", self.sum, self.count);
    }
}

/// Shared between the engine thread (which publishes its stats after every change) and the
/// HTTP handlers (which time tokens and count requests).
#[derive(Debug, Default)]
pub struct Metrics {
    stats: Mutex<EngineStats>,
    pub generated_tokens: AtomicU64,
    pub prompt_tokens: AtomicU64,
    pub requests_ok: AtomicU64,
    pub requests_failed: AtomicU64,
    pub requests_cancelled: AtomicU64,
    pub requests_refused: AtomicU64,
    ttft: Mutex<Histogram>,
    itl: Mutex<Histogram>,
}

impl Metrics {
    pub fn publish(&self, s: EngineStats) {
        *self.stats.lock().unwrap_or_else(|e| e.into_inner()) = s;
    }

    pub fn stats(&self) -> EngineStats {
        *self.stats.lock().unwrap_or_else(|e| e.into_inner())
    }

    pub fn time_to_first_token(&self, s: f64) {
        self.ttft
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .observe(s);
    }

    pub fn inter_token(&self, s: f64) {
        self.itl
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .observe(s);
    }

    pub fn render(&self) -> String {
        let s = self.stats();
        let mut out = String::new();
        let gauge = |out: &mut String, name: &str, help: &str, v: u64| {
            let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} gauge\n{name} {v}");
        };
        gauge(
            &mut out,
            "fp8nsa_requests_running",
            "Sequences in the running batch.",
            s.running as u64,
        );
        gauge(
            &mut out,
            "fp8nsa_requests_waiting",
            "Requests waiting for admission.",
            s.waiting as u64,
        );
        gauge(
            &mut out,
            "fp8nsa_kv_pages_used",
            "KV pages held by sequences.",
            s.pages_used as u64,
        );
        gauge(
            &mut out,
            "fp8nsa_kv_pages_free",
            "KV pages free.",
            s.pages_free as u64,
        );
        let counter = |out: &mut String, name: &str, help: &str, v: u64| {
            let _ = writeln!(
                out,
                "# HELP {name} {help}\n# TYPE {name} counter\n{name} {v}"
            );
        };
        let load = |a: &AtomicU64| a.load(Ordering::Relaxed);
        counter(
            &mut out,
            "fp8nsa_generated_tokens_total",
            "Tokens generated.",
            load(&self.generated_tokens),
        );
        counter(
            &mut out,
            "fp8nsa_prompt_tokens_total",
            "Prompt tokens admitted.",
            load(&self.prompt_tokens),
        );
        counter(
            &mut out,
            "fp8nsa_preemptions_total",
            "Sequences preempted (recomputed later).",
            s.preemptions,
        );
        let _ = writeln!(
            out,
            "# HELP fp8nsa_requests_total Requests by outcome.\n# TYPE fp8nsa_requests_total counter"
        );
        for (label, a) in [
            ("ok", &self.requests_ok),
            ("failed", &self.requests_failed),
            ("cancelled", &self.requests_cancelled),
            ("refused", &self.requests_refused),
        ] {
            let _ = writeln!(
                out,
                "fp8nsa_requests_total{{outcome=\"{label}\"}} {}",
                load(a)
            );
        }
        self.ttft.lock().unwrap_or_else(|e| e.into_inner()).render(
            &mut out,
            "fp8nsa_time_to_first_token_seconds",
            "From the request's arrival to its first token.",
        );
        self.itl.lock().unwrap_or_else(|e| e.into_inner()).render(
            &mut out,
            "fp8nsa_inter_token_latency_seconds",
            "Between consecutive tokens of a request.",
        );
        out
    }
}
