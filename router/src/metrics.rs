//! Operational endpoints: `GET /ready` and `GET /metrics` (Prometheus text exposition, written by
//! hand). Counters are atomics updated on the request path; only the per-route request counts
//! take a lock, once per request.

use std::collections::BTreeMap;
use std::fmt::Write;
use std::sync::Mutex;
use std::sync::atomic::{AtomicI64, AtomicU64, Ordering};
use std::time::Duration;

use axum::extract::{MatchedPath, Request, State};
use axum::http::header;
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use axum::{Json, Router};
use serde_json::json;

use crate::state::AppState;

/// Upper bounds of the time-to-first-token buckets, in seconds.
const TTFT_BUCKETS: [f64; 12] = [
    0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0,
];

#[derive(Default)]
pub struct Metrics {
    /// (route, status) → requests answered.
    requests: Mutex<BTreeMap<(String, u16), u64>>,
    /// Generation requests holding an admission slot.
    pub inflight: AtomicI64,
    /// Generation requests waiting for a slot.
    pub queued: AtomicI64,
    prompt_tokens: AtomicU64,
    cached_prompt_tokens: AtomicU64,
    generated_tokens: AtomicU64,
    ttft: Histogram,
}

#[derive(Default)]
struct Histogram {
    /// Non-cumulative counts per bucket; the last is +Inf.
    buckets: [AtomicU64; TTFT_BUCKETS.len() + 1],
    sum_micros: AtomicU64,
    count: AtomicU64,
}

impl Metrics {
    pub fn record_request(&self, route: &str, status: u16) {
        let mut requests = self.requests.lock().unwrap_or_else(|e| e.into_inner());
        *requests.entry((route.to_string(), status)).or_insert(0) += 1;
    }

    /// A finished generation's token counts.
    pub fn record_usage(&self, prompt: u32, cached: u32, generated: u32) {
        self.prompt_tokens
            .fetch_add(u64::from(prompt), Ordering::Relaxed);
        self.cached_prompt_tokens
            .fetch_add(u64::from(cached), Ordering::Relaxed);
        self.generated_tokens
            .fetch_add(u64::from(generated), Ordering::Relaxed);
    }

    pub fn observe_ttft(&self, elapsed: Duration) {
        let secs = elapsed.as_secs_f64();
        let bucket = TTFT_BUCKETS
            .iter()
            .position(|&bound| secs <= bound)
            .unwrap_or(TTFT_BUCKETS.len());
        let h = &self.ttft;
        h.buckets[bucket].fetch_add(1, Ordering::Relaxed);
        h.sum_micros
            .fetch_add(elapsed.as_micros() as u64, Ordering::Relaxed);
        h.count.fetch_add(1, Ordering::Relaxed);
    }

    /// The Prometheus text exposition (format 0.0.4).
    pub fn render(&self) -> String {
        let mut out = String::new();
        let load = |a: &AtomicU64| a.load(Ordering::Relaxed);
        out.push_str("# HELP strata_requests_total HTTP requests answered, by route and status.\n");
        out.push_str("# TYPE strata_requests_total counter\n");
        {
            let requests = self.requests.lock().unwrap_or_else(|e| e.into_inner());
            for ((route, status), n) in requests.iter() {
                let route = route.replace('\\', "\\\\").replace('"', "\\\"");
                let _ = writeln!(
                    out,
                    "strata_requests_total{{route=\"{route}\",status=\"{status}\"}} {n}"
                );
            }
        }
        let gauges = [
            (
                "strata_requests_inflight",
                "Generation requests running.",
                &self.inflight,
            ),
            (
                "strata_requests_queued",
                "Generation requests waiting for a slot.",
                &self.queued,
            ),
        ];
        for (name, help, value) in gauges {
            let value = value.load(Ordering::Relaxed);
            let _ = writeln!(
                out,
                "# HELP {name} {help}\n# TYPE {name} gauge\n{name} {value}"
            );
        }
        let counters = [
            (
                "strata_prompt_tokens_total",
                "Prompt tokens of finished generations.",
                &self.prompt_tokens,
            ),
            (
                "strata_cached_prompt_tokens_total",
                "Prompt tokens served from the prefix cache.",
                &self.cached_prompt_tokens,
            ),
            (
                "strata_generated_tokens_total",
                "Tokens generated.",
                &self.generated_tokens,
            ),
        ];
        for (name, help, value) in counters {
            let _ = writeln!(
                out,
                "# HELP {name} {help}\n# TYPE {name} counter\n{name} {}",
                load(value)
            );
        }
        let name = "strata_time_to_first_token_seconds";
        let _ = writeln!(
            out,
            "# HELP {name} Time from submission to the first generated token.\n\
             # TYPE {name} histogram"
        );
        let mut cumulative = 0;
        for (i, bucket) in self.ttft.buckets.iter().enumerate() {
            cumulative += load(bucket);
            let le = TTFT_BUCKETS
                .get(i)
                .map_or_else(|| "+Inf".to_string(), |b| b.to_string());
            let _ = writeln!(out, "{name}_bucket{{le=\"{le}\"}} {cumulative}");
        }
        let sum = load(&self.ttft.sum_micros) as f64 / 1e6;
        let _ = writeln!(out, "{name}_sum {sum}");
        let _ = writeln!(out, "{name}_count {}", load(&self.ttft.count));
        out
    }
}

pub fn routes() -> Router<AppState> {
    Router::new()
        .route("/ready", get(ready))
        .route("/metrics", get(metrics))
}

/// The server binds only after the model is loaded and its engine started, so answering at all
/// means ready.
async fn ready(State(state): State<AppState>) -> Response {
    Json(json!({"status": "ready", "model": state.name})).into_response()
}

async fn metrics(State(state): State<AppState>) -> Response {
    (
        [(header::CONTENT_TYPE, "text/plain; version=0.0.4")],
        state.metrics.render(),
    )
        .into_response()
}

/// Middleware: counts every answered request by its route pattern and status.
pub async fn count_requests(
    State(state): State<AppState>,
    request: Request,
    next: Next,
) -> Response {
    let route = request
        .extensions()
        .get::<MatchedPath>()
        .map_or_else(|| "unmatched".to_string(), |p| p.as_str().to_string());
    let response = next.run(request).await;
    state
        .metrics
        .record_request(&route, response.status().as_u16());
    response
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn exposition_holds_every_family() {
        let m = Metrics::default();
        m.record_request("/v1/completions", 200);
        m.record_usage(40, 32, 5);
        m.observe_ttft(Duration::from_millis(30));
        let text = m.render();
        for line in [
            "strata_requests_total{route=\"/v1/completions\",status=\"200\"} 1",
            "strata_prompt_tokens_total 40",
            "strata_cached_prompt_tokens_total 32",
            "strata_generated_tokens_total 5",
            "strata_time_to_first_token_seconds_bucket{le=\"0.025\"} 0",
            "strata_time_to_first_token_seconds_bucket{le=\"0.05\"} 1",
            "strata_time_to_first_token_seconds_bucket{le=\"+Inf\"} 1",
            "strata_time_to_first_token_seconds_count 1",
            "strata_requests_inflight 0",
        ] {
            assert!(text.lines().any(|l| l == line), "missing {line}:\n{text}");
        }
    }
}
