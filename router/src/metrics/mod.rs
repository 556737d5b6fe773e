//! Operational endpoints: `GET /ready` and `GET /metrics` (Prometheus text exposition, written by
//! hand). Counters are atomics updated on the request path; only the per-request counts take a
//! lock, once per request. Per-token observations (first token, inter-token gaps) touch atomics
//! only and allocate nothing.

use std::collections::BTreeMap;
use std::fmt::Write;
use std::sync::Mutex;
use std::sync::atomic::{AtomicI64, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use axum::extract::{MatchedPath, Request, State};
use axum::http::header;
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use axum::{Json, Router};
use serde_json::json;
use strata_engine_api::kv::{KvDump, Tier};

use crate::state::AppState;

mod engine;

use engine::{render_engine_loads, render_step_times};

/// Upper bounds of the time-to-first-token buckets, in seconds.
const TTFT_BUCKETS: &[f64] = &[
    0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0,
];

/// Upper bounds of the inter-token latency buckets, in seconds.
const ITL_BUCKETS: &[f64] = &[
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5,
];

/// Upper bounds of the end-to-end request latency buckets, in seconds.
const E2E_BUCKETS: &[f64] = &[
    0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 30.0, 60.0, 120.0, 300.0, 600.0,
];

/// Upper bounds of the admission queue time buckets, in seconds.
const QUEUE_BUCKETS: &[f64] = &[
    0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
];

/// Upper bounds of the prompt and generation length buckets, in tokens.
const LENGTH_BUCKETS: &[f64] = &[
    1.0, 2.0, 5.0, 10.0, 20.0, 50.0, 100.0, 200.0, 500.0, 1000.0, 2000.0, 5000.0, 10000.0, 20000.0,
    50000.0, 100000.0, 200000.0,
];

/// Seconds the tokens-per-second gauge averages over.
const RATE_WINDOW_SECS: usize = 10;

/// Which API a request spoke, from its path.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Surface {
    OpenAi,
    Anthropic,
    Converse,
    /// Health, readiness, metrics, the API description, unknown paths.
    Other,
}

impl Surface {
    pub fn of(path: &str) -> Self {
        if path.starts_with("/v1/messages") {
            Self::Anthropic
        } else if path.starts_with("/model/") {
            Self::Converse
        } else if path.starts_with("/v1/") {
            Self::OpenAi
        } else {
            Self::Other
        }
    }

    pub fn label(self) -> &'static str {
        match self {
            Self::OpenAi => "openai",
            Self::Anthropic => "anthropic",
            Self::Converse => "converse",
            Self::Other => "other",
        }
    }
}

/// Answered requests, counted two ways under one lock.
#[derive(Default)]
struct RequestCounts {
    /// (route pattern, status) → requests.
    by_route: BTreeMap<(String, u16), u64>,
    /// (surface, status) → requests.
    by_surface: BTreeMap<(Surface, u16), u64>,
}

pub struct Metrics {
    requests: Mutex<RequestCounts>,
    /// Generation requests holding an admission slot.
    pub inflight: AtomicI64,
    /// Generation requests waiting for a slot.
    pub queued: AtomicI64,
    prompt_tokens: AtomicU64,
    cached_prompt_tokens: AtomicU64,
    generated_tokens: AtomicU64,
    ttft: Histogram,
    inter_token: Histogram,
    e2e: Histogram,
    decode_time: Histogram,
    prefill_time: Histogram,
    queue_time: Histogram,
    prompt_lengths: Histogram,
    generation_lengths: Histogram,
    token_rate: TokenRate,
}

impl Default for Metrics {
    fn default() -> Self {
        Self {
            requests: Mutex::default(),
            inflight: AtomicI64::new(0),
            queued: AtomicI64::new(0),
            prompt_tokens: AtomicU64::new(0),
            cached_prompt_tokens: AtomicU64::new(0),
            generated_tokens: AtomicU64::new(0),
            ttft: Histogram::new(TTFT_BUCKETS),
            inter_token: Histogram::new(ITL_BUCKETS),
            e2e: Histogram::new(E2E_BUCKETS),
            decode_time: Histogram::new(E2E_BUCKETS),
            prefill_time: Histogram::new(TTFT_BUCKETS),
            queue_time: Histogram::new(QUEUE_BUCKETS),
            prompt_lengths: Histogram::new(LENGTH_BUCKETS),
            generation_lengths: Histogram::new(LENGTH_BUCKETS),
            token_rate: TokenRate::new(),
        }
    }
}

/// A Prometheus histogram over fixed bucket bounds.
struct Histogram {
    bounds: &'static [f64],
    /// Non-cumulative counts per bucket; the last is +Inf.
    buckets: Box<[AtomicU64]>,
    sum_micros: AtomicU64,
    count: AtomicU64,
}

impl Histogram {
    fn new(bounds: &'static [f64]) -> Self {
        Self {
            bounds,
            buckets: (0..=bounds.len()).map(|_| AtomicU64::new(0)).collect(),
            sum_micros: AtomicU64::new(0),
            count: AtomicU64::new(0),
        }
    }

    fn observe(&self, elapsed: Duration) {
        self.observe_value(elapsed.as_secs_f64());
    }

    /// One observation of `value` (seconds, or tokens); the sum is kept in millionths.
    fn observe_value(&self, value: f64) {
        let bucket = self
            .bounds
            .iter()
            .position(|&bound| value <= bound)
            .unwrap_or(self.bounds.len());
        self.buckets[bucket].fetch_add(1, Ordering::Relaxed);
        self.sum_micros
            .fetch_add((value * 1e6) as u64, Ordering::Relaxed);
        self.count.fetch_add(1, Ordering::Relaxed);
    }

    /// The `q` quantile as Prometheus' `histogram_quantile` estimates it: linear inside the
    /// bucket it falls in (the last finite bound when it falls in +Inf); `None` before any
    /// observation.
    fn quantile(&self, q: f64) -> Option<f64> {
        let counts: Vec<u64> = self
            .buckets
            .iter()
            .map(|b| b.load(Ordering::Relaxed))
            .collect();
        let total: u64 = counts.iter().sum();
        if total == 0 {
            return None;
        }
        let rank = q * total as f64;
        let mut below = 0u64;
        for (i, &n) in counts.iter().enumerate() {
            if (below + n) as f64 >= rank && n > 0 {
                let Some(&upper) = self.bounds.get(i) else {
                    return self.bounds.last().copied();
                };
                let lower = if i == 0 { 0.0 } else { self.bounds[i - 1] };
                return Some(lower + (upper - lower) * (rank - below as f64) / n as f64);
            }
            below += n;
        }
        self.bounds.last().copied()
    }

    fn render(&self, out: &mut String, name: &str, help: &str) {
        let load = |a: &AtomicU64| a.load(Ordering::Relaxed);
        let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} histogram");
        let mut cumulative = 0;
        for (i, bucket) in self.buckets.iter().enumerate() {
            cumulative += load(bucket);
            let le = self
                .bounds
                .get(i)
                .map_or_else(|| "+Inf".to_string(), |b| b.to_string());
            let _ = writeln!(out, "{name}_bucket{{le=\"{le}\"}} {cumulative}");
        }
        let sum = load(&self.sum_micros) as f64 / 1e6;
        let _ = writeln!(out, "{name}_sum {sum}");
        let _ = writeln!(out, "{name}_count {}", load(&self.count));
    }
}

/// Tokens per second over the last [`RATE_WINDOW_SECS`] whole seconds: one slot per second of
/// a ring, each stamped with the second it counts. A slot reused for a new second is reset by
/// whoever stamps it first; a token counted by a racing thread in that instant may be lost,
/// which a gauge can afford.
struct TokenRate {
    start: Instant,
    seconds: [AtomicU64; RATE_WINDOW_SECS],
    counts: [AtomicU64; RATE_WINDOW_SECS],
}

impl TokenRate {
    fn new() -> Self {
        Self {
            start: Instant::now(),
            // Stamp u64::MAX: no slot holds a second yet.
            seconds: std::array::from_fn(|_| AtomicU64::new(u64::MAX)),
            counts: std::array::from_fn(|_| AtomicU64::new(0)),
        }
    }

    fn now(&self) -> u64 {
        self.start.elapsed().as_secs()
    }

    fn add_at(&self, second: u64, tokens: u64) {
        let slot = (second % RATE_WINDOW_SECS as u64) as usize;
        let stamped = self.seconds[slot].load(Ordering::Acquire);
        if stamped != second
            && self.seconds[slot]
                .compare_exchange(stamped, second, Ordering::AcqRel, Ordering::Acquire)
                .is_ok()
        {
            self.counts[slot].store(0, Ordering::Release);
        }
        self.counts[slot].fetch_add(tokens, Ordering::AcqRel);
    }

    /// The mean over the whole seconds before `now` (the current one is still filling).
    fn per_second_at(&self, now: u64) -> f64 {
        let window = RATE_WINDOW_SECS as u64;
        let oldest = now.saturating_sub(window);
        let total: u64 = (0..RATE_WINDOW_SECS)
            .filter(|&slot| {
                let second = self.seconds[slot].load(Ordering::Acquire);
                second >= oldest && second < now
            })
            .map(|slot| self.counts[slot].load(Ordering::Acquire))
            .sum();
        total as f64 / window as f64
    }
}

/// Percentiles of a latency histogram, milliseconds (estimated inside buckets).
#[derive(Debug, Clone, Copy, PartialEq, serde::Serialize)]
pub struct Quantiles {
    pub p50: Option<f64>,
    pub p90: Option<f64>,
    pub p99: Option<f64>,
}

/// Counters and latency percentiles since the server started ([`Metrics::summary`]).
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct MetricsSummary {
    /// Requests answered (every route, the dashboard's own included), and those answered
    /// with an error status.
    pub requests: u64,
    pub failed_requests: u64,
    pub inflight: i64,
    pub queued: i64,
    /// Generations finished (what the token counts below add up over).
    pub generations: u64,
    pub prompt_tokens: u64,
    pub cached_prompt_tokens: u64,
    pub generated_tokens: u64,
    pub prefix_hit_ratio: f64,
    /// Tokens streamed per second over the last seconds.
    pub tokens_per_s: f64,
    pub ttft_ms: Quantiles,
    pub itl_ms: Quantiles,
}

/// Cached KV blocks on each tier, from the engine's dump.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct TierCounts {
    pub device: u64,
    pub host: u64,
    pub disk: u64,
}

impl TierCounts {
    pub fn of(dump: &KvDump) -> Self {
        let mut counts = Self::default();
        for (_, _, tier) in &dump.blocks {
            match tier {
                Tier::Device => counts.device += 1,
                Tier::Host => counts.host += 1,
                Tier::Disk => counts.disk += 1,
            }
        }
        counts
    }
}

impl Metrics {
    /// An answered request: its route pattern, the surface its path belongs to, its status.
    pub fn record_request(&self, route: &str, surface: Surface, status: u16) {
        let mut requests = self.requests.lock().unwrap_or_else(|e| e.into_inner());
        *requests
            .by_route
            .entry((route.to_string(), status))
            .or_insert(0) += 1;
        *requests.by_surface.entry((surface, status)).or_insert(0) += 1;
    }

    /// A finished generation's token counts.
    pub fn record_usage(&self, prompt: u32, cached: u32, generated: u32) {
        self.prompt_tokens
            .fetch_add(u64::from(prompt), Ordering::Relaxed);
        self.cached_prompt_tokens
            .fetch_add(u64::from(cached), Ordering::Relaxed);
        self.generated_tokens
            .fetch_add(u64::from(generated), Ordering::Relaxed);
        self.prompt_lengths.observe_value(f64::from(prompt));
        self.generation_lengths.observe_value(f64::from(generated));
    }

    /// A request's first token arrived `elapsed` after submission; it counts in the token rate.
    pub fn observe_ttft(&self, elapsed: Duration) {
        self.ttft.observe(elapsed);
        self.token_rate.add_at(self.token_rate.now(), 1);
    }

    /// A token after the first arrived `gap` after the one before it, in the same request; it
    /// counts in the token rate.
    /// A finished generation's time from submission to its last event.
    pub fn observe_e2e(&self, elapsed: Duration) {
        self.e2e.observe(elapsed);
    }

    /// A finished generation's prefill: its time to first token less its wait in the engine.
    pub fn observe_prefill_time(&self, elapsed: Duration) {
        self.prefill_time.observe(elapsed);
    }

    /// A finished generation's time from its first token to its last event.
    pub fn observe_decode_time(&self, elapsed: Duration) {
        self.decode_time.observe(elapsed);
    }

    /// An admitted request's wait for its slot (zero when one was free).
    pub fn observe_queue_time(&self, waited: Duration) {
        self.queue_time.observe(waited);
    }

    pub fn observe_inter_token(&self, gap: Duration) {
        self.inter_token.observe(gap);
        self.token_rate.add_at(self.token_rate.now(), 1);
    }

    /// The figures the dashboard shows, read now.
    pub fn summary(&self) -> MetricsSummary {
        let requests = self.requests.lock().unwrap_or_else(|e| e.into_inner());
        let (mut total, mut failed) = (0, 0);
        for ((_, status), n) in &requests.by_surface {
            total += n;
            if *status >= 400 {
                failed += n;
            }
        }
        drop(requests);
        let ms = |h: &Histogram| Quantiles {
            p50: h.quantile(0.5).map(|s| s * 1e3),
            p90: h.quantile(0.9).map(|s| s * 1e3),
            p99: h.quantile(0.99).map(|s| s * 1e3),
        };
        MetricsSummary {
            requests: total,
            failed_requests: failed,
            inflight: self.inflight.load(Ordering::Relaxed),
            queued: self.queued.load(Ordering::Relaxed),
            generations: self.generation_lengths.count.load(Ordering::Relaxed),
            prompt_tokens: self.prompt_tokens.load(Ordering::Relaxed),
            cached_prompt_tokens: self.cached_prompt_tokens.load(Ordering::Relaxed),
            generated_tokens: self.generated_tokens.load(Ordering::Relaxed),
            prefix_hit_ratio: self.prefix_hit_ratio(),
            tokens_per_s: self.token_rate.per_second_at(self.token_rate.now()),
            ttft_ms: ms(&self.ttft),
            itl_ms: ms(&self.inter_token),
        }
    }

    /// cached / prompt tokens of finished generations; 0 before any.
    pub fn prefix_hit_ratio(&self) -> f64 {
        let prompt = self.prompt_tokens.load(Ordering::Relaxed);
        let cached = self.cached_prompt_tokens.load(Ordering::Relaxed);
        if prompt == 0 {
            0.0
        } else {
            cached as f64 / prompt as f64
        }
    }

    /// The Prometheus text exposition (format 0.0.4). `kv` is left out when the engine could
    /// not be asked (it has stopped).
    pub fn render(&self, kv: Option<TierCounts>) -> String {
        let mut out = String::new();
        self.render_requests(&mut out);
        let gauges = [
            (
                "strata_requests_inflight",
                "Generation requests running.",
                self.inflight.load(Ordering::Relaxed).to_string(),
            ),
            (
                "strata_requests_queued",
                "Generation requests waiting for a slot.",
                self.queued.load(Ordering::Relaxed).to_string(),
            ),
            (
                "strata_prefix_cache_hit_ratio",
                "Cached prompt tokens / prompt tokens, over finished generations.",
                self.prefix_hit_ratio().to_string(),
            ),
            (
                "strata_generated_tokens_per_second",
                "Tokens generated per second, mean over the last 10 whole seconds.",
                self.token_rate
                    .per_second_at(self.token_rate.now())
                    .to_string(),
            ),
        ];
        for (name, help, value) in gauges {
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
                value.load(Ordering::Relaxed)
            );
        }
        if let Some(kv) = kv {
            let name = "strata_kv_cached_blocks";
            let _ = writeln!(
                out,
                "# HELP {name} KV blocks held by the prefix cache, by tier.\n# TYPE {name} gauge"
            );
            for (tier, n) in [("device", kv.device), ("host", kv.host), ("disk", kv.disk)] {
                let _ = writeln!(out, "{name}{{tier=\"{tier}\"}} {n}");
            }
        }
        self.ttft.render(
            &mut out,
            "strata_time_to_first_token_seconds",
            "Time from submission to the first generated token.",
        );
        self.inter_token.render(
            &mut out,
            "strata_inter_token_latency_seconds",
            "Time between consecutive generated tokens of one request.",
        );
        self.e2e.render(
            &mut out,
            "strata_e2e_request_latency_seconds",
            "Time from submission to the end of a finished generation.",
        );
        self.prefill_time.render(
            &mut out,
            "strata_request_prefill_time_seconds",
            "A finished generation's time to first token less its wait in the engine's queue.",
        );
        self.decode_time.render(
            &mut out,
            "strata_request_decode_time_seconds",
            "Time from a finished generation's first token to its end.",
        );
        self.queue_time.render(
            &mut out,
            "strata_request_queue_time_seconds",
            "Time an admitted generation request waited for a slot.",
        );
        self.prompt_lengths.render(
            &mut out,
            "strata_request_prompt_tokens",
            "Prompt tokens per finished generation.",
        );
        self.generation_lengths.render(
            &mut out,
            "strata_request_generation_tokens",
            "Generated tokens per finished generation.",
        );
        out
    }

    fn render_requests(&self, out: &mut String) {
        let requests = self.requests.lock().unwrap_or_else(|e| e.into_inner());
        out.push_str("# HELP strata_requests_total HTTP requests answered, by route and status.\n");
        out.push_str("# TYPE strata_requests_total counter\n");
        for ((route, status), n) in &requests.by_route {
            let route = route.replace('\\', "\\\\").replace('"', "\\\"");
            let _ = writeln!(
                out,
                "strata_requests_total{{route=\"{route}\",status=\"{status}\"}} {n}"
            );
        }
        let name = "strata_surface_requests_total";
        let _ = writeln!(
            out,
            "# HELP {name} HTTP requests answered, by API surface and status.\n\
             # TYPE {name} counter"
        );
        for ((surface, status), n) in &requests.by_surface {
            let surface = surface.label();
            let _ = writeln!(
                out,
                "{name}{{surface=\"{surface}\",status=\"{status}\"}} {n}"
            );
        }
    }
}

pub fn routes() -> Router<AppState> {
    Router::new()
        .route("/ready", get(ready))
        .route("/metrics", get(metrics))
}

/// Ready to take requests: the server binds only after the model is loaded and its engine
/// started, so a local engine is ready once it answers; a router is ready while some node is
/// reachable. Otherwise, and while draining before a shutdown ([`crate::drain`]), it answers 503
/// (with `Retry-After`, which the admission layer adds to every 503) so a load balancer sends its
/// traffic to another router.
async fn ready(State(state): State<AppState>) -> Response {
    if state.draining.is_draining() {
        return (
            axum::http::StatusCode::SERVICE_UNAVAILABLE,
            Json(json!({"status": "draining", "model": state.name,
                        "reason": "shutting down: finishing the requests in flight"})),
        )
            .into_response();
    }
    if let crate::state::EngineHandle::Cluster(cluster) = &state.engine
        && !cluster.has_available_node()
    {
        return (
            axum::http::StatusCode::SERVICE_UNAVAILABLE,
            Json(json!({"status": "not_ready", "model": state.name,
                        "reason": "no node is reachable from this router"})),
        )
            .into_response();
    }
    Json(json!({"status": "ready", "model": state.name})).into_response()
}

async fn metrics(State(state): State<AppState>) -> Response {
    // The dump waits for the engine thread's next loop turn (at most one step): off the
    // async workers.
    let engine_state = state.clone();
    let kv = tokio::task::spawn_blocking(move || engine_state.engine.kv_dump())
        .await
        .ok()
        .flatten()
        .and_then(Result::ok)
        .map(|dump| TierCounts::of(&dump));
    let mut text = state.metrics.render(kv);
    if let Some(times) = state.engine.step_times() {
        render_step_times(&mut text, &times);
    }
    let loads = match (&state.engine, state.engine.load()) {
        (_, Some(load)) => vec![(String::new(), load)],
        (crate::state::EngineHandle::Cluster(cluster), None) => cluster.node_loads(),
        _ => Vec::new(),
    };
    render_engine_loads(&mut text, &loads);
    let _ = writeln!(
        text,
        "# HELP strata_model_info The model served (its name as requests give it).\n\
         # TYPE strata_model_info gauge\nstrata_model_info{{model_name=\"{}\"}} 1",
        state.name.replace('\\', "\\\\").replace('"', "\\\"")
    );
    if let crate::state::EngineHandle::Cluster(cluster) = &state.engine {
        text.push_str(&cluster.render_metrics());
    }
    let mut text = with_model_label(&text, &state.name);
    crate::process_metrics::render(&mut text);
    ([(header::CONTENT_TYPE, "text/plain; version=0.0.4")], text).into_response()
}

/// `text` with a `model_name` label on every `strata_` sample (what a Grafana board filters
/// and groups by, as vLLM's metrics carry it); comments and other families unchanged.
fn with_model_label(text: &str, model: &str) -> String {
    let label = format!(
        "model_name=\"{}\"",
        model
            .replace('\\', "\\\\")
            .replace('"', "\\\"")
            .replace('\n', "\\n")
    );
    let mut out = String::with_capacity(text.len() + text.len() / 4);
    for line in text.lines() {
        match line.find([' ', '{']) {
            Some(at) if line.starts_with("strata_") && !line.contains("model_name=") => {
                let (name, rest) = line.split_at(at);
                match rest.strip_prefix('{') {
                    Some(labels) => {
                        let _ = writeln!(out, "{name}{{{label},{labels}");
                    }
                    None => {
                        let _ = writeln!(out, "{name}{{{label}}}{rest}");
                    }
                }
            }
            _ => {
                out.push_str(line);
                out.push('\n');
            }
        }
    }
    out
}

/// Middleware: counts every answered request by its route pattern, its surface and status.
pub async fn count_requests(
    State(state): State<AppState>,
    request: Request,
    next: Next,
) -> Response {
    let route = request
        .extensions()
        .get::<MatchedPath>()
        .map_or_else(|| "unmatched".to_string(), |p| p.as_str().to_string());
    let surface = Surface::of(request.uri().path());
    let response = next.run(request).await;
    state
        .metrics
        .record_request(&route, surface, response.status().as_u16());
    response
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn quantiles_interpolate_inside_buckets_as_prometheus_does() {
        let h = Histogram::new(&[1.0, 2.0, 4.0]);
        assert_eq!(h.quantile(0.5), None);
        // 2 in (0, 1], 6 in (1, 2], 2 in (2, 4]: rank 5 of 10 is 3 into the second bucket.
        for v in [0.5, 0.5, 1.5, 1.5, 1.5, 1.5, 1.5, 1.5, 3.0, 3.0] {
            h.observe_value(v);
        }
        assert_eq!(h.quantile(0.5), Some(1.0 + 3.0 / 6.0));
        assert_eq!(h.quantile(0.9), Some(2.0 + 2.0 * 1.0 / 2.0));
        assert_eq!(h.quantile(0.1), Some(0.5));
        // Beyond the last finite bound: that bound.
        h.observe_value(100.0);
        assert_eq!(h.quantile(1.0), Some(4.0));
        let m = Metrics::default();
        m.observe_ttft(Duration::from_millis(30));
        m.record_usage(10, 4, 3);
        let s = m.summary();
        assert_eq!(
            (s.generations, s.prompt_tokens, s.generated_tokens),
            (1, 10, 3)
        );
        // 30 ms lies in (25, 50] ms: the median is interpolated inside it.
        let p50 = s.ttft_ms.p50.unwrap();
        assert!((p50 - 37.5).abs() < 1e-9, "{p50}");
    }

    #[test]
    fn exposition_holds_every_family() {
        let m = Metrics::default();
        m.record_request("/v1/completions", Surface::OpenAi, 200);
        m.record_request("/v1/messages", Surface::Anthropic, 429);
        m.record_usage(40, 30, 5);
        m.observe_ttft(Duration::from_millis(30));
        m.observe_inter_token(Duration::from_millis(3));
        let kv = TierCounts {
            device: 7,
            host: 2,
            disk: 0,
        };
        let text = m.render(Some(kv));
        for line in [
            "strata_requests_total{route=\"/v1/completions\",status=\"200\"} 1",
            "strata_surface_requests_total{surface=\"openai\",status=\"200\"} 1",
            "strata_surface_requests_total{surface=\"anthropic\",status=\"429\"} 1",
            "strata_prompt_tokens_total 40",
            "strata_cached_prompt_tokens_total 30",
            "strata_generated_tokens_total 5",
            "strata_prefix_cache_hit_ratio 0.75",
            "strata_kv_cached_blocks{tier=\"device\"} 7",
            "strata_kv_cached_blocks{tier=\"host\"} 2",
            "strata_kv_cached_blocks{tier=\"disk\"} 0",
            "strata_time_to_first_token_seconds_bucket{le=\"0.025\"} 0",
            "strata_time_to_first_token_seconds_bucket{le=\"0.05\"} 1",
            "strata_time_to_first_token_seconds_bucket{le=\"+Inf\"} 1",
            "strata_time_to_first_token_seconds_count 1",
            "strata_inter_token_latency_seconds_bucket{le=\"0.0025\"} 0",
            "strata_inter_token_latency_seconds_bucket{le=\"0.005\"} 1",
            "strata_inter_token_latency_seconds_count 1",
            "strata_requests_inflight 0",
            "# TYPE strata_generated_tokens_per_second gauge",
        ] {
            assert!(text.lines().any(|l| l == line), "missing {line}:\n{text}");
        }
        assert!(!m.render(None).contains("strata_kv_cached_blocks"));
    }

    #[test]
    fn spec_decode_families_appear_once_an_engine_speculates() {
        let mut load = strata_engine_api::load::EngineLoad::default();
        let mut text = String::new();
        render_engine_loads(&mut text, &[(String::new(), load)]);
        assert!(!text.contains("spec_decode"), "{text}");
        for (proposed, accepted) in [(4, 4), (4, 1), (3, 0)] {
            load.spec.record(proposed, accepted);
        }
        let mut text = String::new();
        render_engine_loads(&mut text, &[("10.0.0.2:7000".into(), load)]);
        for line in [
            "strata_spec_decode_num_drafts_total{node=\"10.0.0.2:7000\"} 3",
            "strata_spec_decode_num_draft_tokens_total{node=\"10.0.0.2:7000\"} 11",
            "strata_spec_decode_num_accepted_tokens_total{node=\"10.0.0.2:7000\"} 5",
            "strata_spec_decode_accepted_length_bucket{node=\"10.0.0.2:7000\",le=\"0\"} 1",
            "strata_spec_decode_accepted_length_bucket{node=\"10.0.0.2:7000\",le=\"1\"} 2",
            "strata_spec_decode_accepted_length_bucket{node=\"10.0.0.2:7000\",le=\"3\"} 2",
            "strata_spec_decode_accepted_length_bucket{node=\"10.0.0.2:7000\",le=\"4\"} 3",
            "strata_spec_decode_accepted_length_bucket{node=\"10.0.0.2:7000\",le=\"+Inf\"} 3",
            "strata_spec_decode_accepted_length_sum{node=\"10.0.0.2:7000\"} 5",
            "strata_spec_decode_accepted_length_count{node=\"10.0.0.2:7000\"} 3",
        ] {
            assert!(text.lines().any(|l| l == line), "missing {line}:\n{text}");
        }
    }

    #[test]
    fn every_strata_sample_carries_the_model_name() {
        let text = "# HELP strata_x X.\n# TYPE strata_x counter\nstrata_x 3\n\
                    strata_y{tier=\"host\"} 2\nstrata_model_info{model_name=\"m\"} 1\n\
                    process_cpu_seconds_total 1.5\n";
        let labelled = with_model_label(text, "my \"model\"");
        let want = "# HELP strata_x X.\n# TYPE strata_x counter\n\
                    strata_x{model_name=\"my \\\"model\\\"\"} 3\n\
                    strata_y{model_name=\"my \\\"model\\\"\",tier=\"host\"} 2\n\
                    strata_model_info{model_name=\"m\"} 1\nprocess_cpu_seconds_total 1.5\n";
        assert_eq!(labelled, want);
    }

    #[test]
    fn surfaces_follow_the_path() {
        assert_eq!(Surface::of("/v1/chat/completions"), Surface::OpenAi);
        assert_eq!(Surface::of("/v1/messages/count_tokens"), Surface::Anthropic);
        assert_eq!(Surface::of("/model/m/converse-stream"), Surface::Converse);
        assert_eq!(Surface::of("/metrics"), Surface::Other);
    }

    #[test]
    fn the_token_rate_averages_whole_seconds_in_the_window() {
        let rate = TokenRate::new();
        rate.add_at(0, 50);
        rate.add_at(3, 30);
        rate.add_at(5, 1000); // the current second: not yet counted
        assert_eq!(rate.per_second_at(5), 8.0);
        // Second 0 leaves the window at 11; slot 0 is reused for second 10.
        rate.add_at(10, 20);
        assert_eq!(rate.per_second_at(11), (30.0 + 1000.0 + 20.0) / 10.0);
        assert_eq!(rate.per_second_at(100), 0.0);
    }
}
