//! Operational endpoints: `GET /ready` and `GET /metrics` (the Prometheus text exposition, 0.0.4,
//! written by the `prometheus-client` library). The request path updates atomics only (the
//! library's counters and gauges, and the router's own histograms, [`histogram`]); what the
//! engine and the cluster report is read when `/metrics` is asked ([`EngineSnapshot`],
//! [`crate::cluster::Cluster::metrics`]). Every `strata_` sample carries the served model's
//! name as `model_name` (what a Grafana board filters and groups by, as vLLM's metrics carry it).

use std::borrow::Cow;
use std::fmt;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use axum::extract::{MatchedPath, Request, State};
use axum::http::header;
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use axum::{Json, Router};
use prometheus_client::encoding::{
    DescriptorEncoder, EncodeCounterValue, EncodeGaugeValue, EncodeLabelSet, NoLabelSet,
    prometheus_text,
};
use prometheus_client::metrics::MetricType;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::{ConstGauge, Gauge};
use prometheus_client::registry::Registry;
use serde_json::json;

use crate::state::AppState;

mod engine;
mod histogram;

pub use engine::{EngineSnapshot, TierCounts};
use histogram::{Histogram, RATE_WINDOW_SECS, TokenRate};

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

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct RouteLabels {
    route: String,
    status: u16,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct SurfaceLabels {
    surface: &'static str,
    status: u16,
}

/// A sample's labels, beside the `model_name` every `strata_` sample carries.
pub(crate) type Labels = Vec<(&'static str, String)>;

/// One gauge family written at scrape time, a sample per label set.
pub(crate) fn gauges<V: EncodeGaugeValue>(
    encoder: &mut DescriptorEncoder,
    name: &str,
    help: &str,
    samples: impl IntoIterator<Item = (Labels, V)>,
) -> fmt::Result {
    let mut metric = encoder.encode_descriptor(name, help, None, MetricType::Gauge)?;
    for (labels, value) in samples {
        metric.encode_family(&labels)?.encode_gauge(&value)?;
    }
    Ok(())
}

/// One counter family written at scrape time: `name` is the exported name, ending in `_total`
/// (the library adds the suffix to counters).
pub(crate) fn counters<V: EncodeCounterValue>(
    encoder: &mut DescriptorEncoder,
    name: &str,
    help: &str,
    samples: impl IntoIterator<Item = (Labels, V)>,
) -> fmt::Result {
    let family = name.strip_suffix("_total").ok_or(fmt::Error)?;
    let mut metric = encoder.encode_descriptor(family, help, None, MetricType::Counter)?;
    for (labels, value) in samples {
        metric
            .encode_family(&labels)?
            .encode_counter::<NoLabelSet, V, u64>(&value, None)?;
    }
    Ok(())
}

/// What the router measures of its requests.
pub struct Metrics {
    requests: Family<RouteLabels, Counter>,
    surface_requests: Family<SurfaceLabels, Counter>,
    /// Requests answered, and those answered with an error status (the dashboard's totals).
    answered: AtomicU64,
    failed: AtomicU64,
    /// Generation requests holding an admission slot.
    pub inflight: Gauge,
    /// Generation requests waiting for a slot.
    pub queued: Gauge,
    prompt_tokens: Counter,
    cached_prompt_tokens: Counter,
    generated_tokens: Counter,
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
            requests: Family::default(),
            surface_requests: Family::default(),
            answered: AtomicU64::new(0),
            failed: AtomicU64::new(0),
            inflight: Gauge::default(),
            queued: Gauge::default(),
            prompt_tokens: Counter::default(),
            cached_prompt_tokens: Counter::default(),
            generated_tokens: Counter::default(),
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

impl Metrics {
    /// An answered request: its route pattern, the surface its path belongs to, its status.
    pub fn record_request(&self, route: &str, surface: Surface, status: u16) {
        self.requests
            .get_or_create(&RouteLabels {
                route: route.to_string(),
                status,
            })
            .inc();
        self.surface_requests
            .get_or_create(&SurfaceLabels {
                surface: surface.label(),
                status,
            })
            .inc();
        self.answered.fetch_add(1, Ordering::Relaxed);
        if status >= 400 {
            self.failed.fetch_add(1, Ordering::Relaxed);
        }
    }

    /// A finished generation's token counts.
    pub fn record_usage(&self, prompt: u32, cached: u32, generated: u32) {
        self.prompt_tokens.inc_by(u64::from(prompt));
        self.cached_prompt_tokens.inc_by(u64::from(cached));
        self.generated_tokens.inc_by(u64::from(generated));
        self.prompt_lengths.observe_value(f64::from(prompt));
        self.generation_lengths.observe_value(f64::from(generated));
    }

    /// A request's first token arrived `elapsed` after submission; it counts in the token rate.
    pub fn observe_ttft(&self, elapsed: Duration) {
        self.ttft.observe(elapsed);
        self.token_rate.add();
    }

    /// A token after the first arrived `gap` after the one before it, in the same request; it
    /// counts in the token rate.
    pub fn observe_inter_token(&self, gap: Duration) {
        self.inter_token.observe(gap);
        self.token_rate.add();
    }

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

    /// The figures the dashboard shows, read now.
    pub fn summary(&self) -> MetricsSummary {
        let ms = |h: &Histogram| Quantiles {
            p50: h.quantile(0.5).map(|s| s * 1e3),
            p90: h.quantile(0.9).map(|s| s * 1e3),
            p99: h.quantile(0.99).map(|s| s * 1e3),
        };
        MetricsSummary {
            requests: self.answered.load(Ordering::Relaxed),
            failed_requests: self.failed.load(Ordering::Relaxed),
            inflight: self.inflight.get(),
            queued: self.queued.get(),
            generations: self.generation_lengths.count(),
            prompt_tokens: self.prompt_tokens.get(),
            cached_prompt_tokens: self.cached_prompt_tokens.get(),
            generated_tokens: self.generated_tokens.get(),
            prefix_hit_ratio: self.prefix_hit_ratio(),
            tokens_per_s: self.token_rate.per_second(),
            ttft_ms: ms(&self.ttft),
            itl_ms: ms(&self.inter_token),
        }
    }

    /// cached / prompt tokens of finished generations; 0 before any.
    pub fn prefix_hit_ratio(&self) -> f64 {
        let prompt = self.prompt_tokens.get();
        if prompt == 0 {
            0.0
        } else {
            self.cached_prompt_tokens.get() as f64 / prompt as f64
        }
    }

    /// Registers the router's families in `registry` (clones share the values; the computed
    /// gauges hold what they compute now, as a registry is built per scrape).
    pub fn register(&self, registry: &mut Registry) {
        // The library adds the counters' `_total` suffix and each help text's full stop.
        registry.register(
            "strata_requests",
            "HTTP requests answered, by route and status",
            self.requests.clone(),
        );
        registry.register(
            "strata_surface_requests",
            "HTTP requests answered, by API surface and status",
            self.surface_requests.clone(),
        );
        registry.register(
            "strata_requests_inflight",
            "Generation requests running",
            self.inflight.clone(),
        );
        registry.register(
            "strata_requests_queued",
            "Generation requests waiting for a slot",
            self.queued.clone(),
        );
        registry.register(
            "strata_prefix_cache_hit_ratio",
            "Cached prompt tokens / prompt tokens, over finished generations",
            ConstGauge::new(self.prefix_hit_ratio()),
        );
        registry.register(
            "strata_generated_tokens_per_second",
            format!(
                "Tokens generated per second, mean over the last {RATE_WINDOW_SECS} whole seconds"
            ),
            ConstGauge::new(self.token_rate.per_second()),
        );
        for (name, help, counter) in [
            (
                "strata_prompt_tokens",
                "Prompt tokens of finished generations",
                &self.prompt_tokens,
            ),
            (
                "strata_cached_prompt_tokens",
                "Prompt tokens served from the prefix cache",
                &self.cached_prompt_tokens,
            ),
            (
                "strata_generated_tokens",
                "Tokens generated",
                &self.generated_tokens,
            ),
        ] {
            registry.register(name, help, counter.clone());
        }
        for (name, help, histogram) in [
            (
                "strata_time_to_first_token_seconds",
                "Time from submission to the first generated token",
                &self.ttft,
            ),
            (
                "strata_inter_token_latency_seconds",
                "Time between consecutive generated tokens of one request",
                &self.inter_token,
            ),
            (
                "strata_e2e_request_latency_seconds",
                "Time from submission to the end of a finished generation",
                &self.e2e,
            ),
            (
                "strata_request_prefill_time_seconds",
                "A finished generation's time to first token less its wait in the engine's queue",
                &self.prefill_time,
            ),
            (
                "strata_request_decode_time_seconds",
                "Time from a finished generation's first token to its end",
                &self.decode_time,
            ),
            (
                "strata_request_queue_time_seconds",
                "Time an admitted generation request waited for a slot",
                &self.queue_time,
            ),
            (
                "strata_request_prompt_tokens",
                "Prompt tokens per finished generation",
                &self.prompt_lengths,
            ),
            (
                "strata_request_generation_tokens",
                "Generated tokens per finished generation",
                &self.generation_lengths,
            ),
        ] {
            registry.register(name, help, histogram.clone());
        }
    }
}

/// The whole exposition: the router's families, `snapshot` (the engine's), `extra` (a cluster's
/// routing families), all labelled with `model`; then the process families, unlabelled as every
/// client library writes them.
pub fn exposition(
    metrics: &Metrics,
    model: &str,
    snapshot: EngineSnapshot,
    extra: Option<Box<dyn prometheus_client::collector::Collector>>,
) -> String {
    let label = [(Cow::Borrowed("model_name"), Cow::Owned(model.to_string()))];
    let mut registry = Registry::with_labels(label.into_iter());
    metrics.register(&mut registry);
    registry.register_collector(Box::new(snapshot));
    registry.register(
        "strata_model_info",
        "The model served (its name as requests give it)",
        ConstGauge::new(1),
    );
    if let Some(extra) = extra {
        registry.register_collector(extra);
    }
    let mut process = Registry::default();
    process.register_collector(Box::new(crate::process_metrics::Process));
    let mut text = String::new();
    // Writing into a String fails only where a collector says so (a counter named without
    // `_total`, a programming error the tests catch): the families before it stay.
    let _ = prometheus_text::encode(&mut text, &registry);
    let _ = prometheus_text::encode(&mut text, &process);
    text
}

pub fn routes() -> Router<AppState> {
    Router::new()
        .route("/ready", get(ready))
        .route("/metrics", get(metrics))
}

/// Ready to take requests: the server answers only once the model is loaded and its engine
/// started (connections made during the load wait), so a local engine is ready once it answers; a router is ready while some node is
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
    if !state.engine.available() {
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
    let kv = match state.engine.kv_dump().await {
        Ok(Some(dump)) => Some(TierCounts::of(&dump)),
        _ => None,
    };
    let snapshot = EngineSnapshot {
        kv,
        step_times: state.engine.step_times(),
        loads: state.engine.loads(),
    };
    let routing = state.engine.cluster().map(|cluster| cluster.metrics());
    let text = exposition(&state.metrics, &state.name, snapshot, routing);
    (
        [(header::CONTENT_TYPE, prometheus_text::CONTENT_TYPE)],
        text,
    )
        .into_response()
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
    use strata_engine_api::load::EngineLoad;

    #[test]
    fn the_summary_reads_the_counters_and_estimates_percentiles() {
        let m = Metrics::default();
        m.observe_ttft(Duration::from_millis(30));
        m.record_usage(10, 4, 3);
        m.record_request("/v1/completions", Surface::OpenAi, 200);
        m.record_request("/v1/messages", Surface::Anthropic, 429);
        let s = m.summary();
        assert_eq!(
            (s.generations, s.prompt_tokens, s.generated_tokens),
            (1, 10, 3)
        );
        assert_eq!((s.requests, s.failed_requests), (2, 1));
        // 30 ms lies in (25, 50] ms: the median is interpolated inside it.
        let p50 = s.ttft_ms.p50.unwrap();
        assert!((p50 - 37.5).abs() < 1e-9, "{p50}");
    }

    fn scrape(m: &Metrics, snapshot: EngineSnapshot) -> String {
        exposition(m, "m", snapshot, None)
    }

    #[test]
    fn exposition_holds_every_family() {
        let m = Metrics::default();
        m.record_request("/v1/completions", Surface::OpenAi, 200);
        m.record_request("/v1/messages", Surface::Anthropic, 429);
        m.record_usage(40, 30, 5);
        m.observe_ttft(Duration::from_millis(30));
        m.observe_inter_token(Duration::from_millis(3));
        m.inflight.inc();
        let kv = TierCounts {
            device: 7,
            host: 2,
            disk: 0,
        };
        let text = scrape(
            &m,
            EngineSnapshot {
                kv: Some(kv),
                ..Default::default()
            },
        );
        for line in [
            "strata_requests_total{model_name=\"m\",route=\"/v1/completions\",status=\"200\"} 1",
            "strata_surface_requests_total{model_name=\"m\",surface=\"openai\",status=\"200\"} 1",
            "strata_surface_requests_total{model_name=\"m\",surface=\"anthropic\",status=\"429\"} 1",
            "# TYPE strata_prompt_tokens_total counter",
            "strata_prompt_tokens_total{model_name=\"m\"} 40",
            "strata_cached_prompt_tokens_total{model_name=\"m\"} 30",
            "strata_generated_tokens_total{model_name=\"m\"} 5",
            "strata_prefix_cache_hit_ratio{model_name=\"m\"} 0.75",
            "strata_kv_cached_blocks{model_name=\"m\",tier=\"device\"} 7",
            "strata_kv_cached_blocks{model_name=\"m\",tier=\"host\"} 2",
            "strata_kv_cached_blocks{model_name=\"m\",tier=\"disk\"} 0",
            "# TYPE strata_time_to_first_token_seconds histogram",
            "strata_time_to_first_token_seconds_bucket{model_name=\"m\",le=\"0.025\"} 0",
            "strata_time_to_first_token_seconds_bucket{model_name=\"m\",le=\"0.05\"} 1",
            "strata_time_to_first_token_seconds_bucket{model_name=\"m\",le=\"+Inf\"} 1",
            "strata_time_to_first_token_seconds_count{model_name=\"m\"} 1",
            "strata_inter_token_latency_seconds_bucket{model_name=\"m\",le=\"0.0025\"} 0",
            "strata_inter_token_latency_seconds_bucket{model_name=\"m\",le=\"0.005\"} 1",
            "strata_inter_token_latency_seconds_count{model_name=\"m\"} 1",
            "strata_request_prompt_tokens_bucket{model_name=\"m\",le=\"50\"} 1",
            "strata_requests_inflight{model_name=\"m\"} 1",
            "# HELP strata_requests_queued Generation requests waiting for a slot.",
            "# TYPE strata_generated_tokens_per_second gauge",
            "strata_model_info{model_name=\"m\"} 1",
        ] {
            assert!(text.lines().any(|l| l == line), "missing {line}:\n{text}");
        }
        assert!(!scrape(&m, EngineSnapshot::default()).contains("strata_kv_cached_blocks"));
        // Every strata sample carries the model's name, escaped; the process families do not.
        let text = exposition(&m, "my \"model\"", EngineSnapshot::default(), None);
        for line in text.lines().filter(|l| !l.starts_with('#')) {
            assert_eq!(
                line.starts_with("strata_"),
                line.contains("model_name=\"my \\\"model\\\"\""),
                "{line}"
            );
        }
        assert!(text.contains("\nprocess_open_fds ") || !cfg!(target_os = "linux"));
    }

    #[test]
    fn spec_decode_families_appear_once_an_engine_speculates() {
        let mut load = EngineLoad::default();
        let snapshot = |addr: &str, load| EngineSnapshot {
            loads: vec![(addr.to_string(), load)],
            ..Default::default()
        };
        let text = scrape(&Metrics::default(), snapshot("", load));
        assert!(
            text.contains("strata_engine_requests_running{model_name=\"m\"} 0"),
            "{text}"
        );
        assert!(!text.contains("spec_decode"), "{text}");
        for (proposed, accepted) in [(4, 4), (4, 1), (3, 0)] {
            load.spec.record(proposed, accepted);
        }
        let text = scrape(&Metrics::default(), snapshot("10.0.0.2:7000", load));
        let node = "model_name=\"m\",node=\"10.0.0.2:7000\"";
        for line in [
            format!("strata_spec_decode_num_drafts_total{{{node}}} 3"),
            format!("strata_spec_decode_num_draft_tokens_total{{{node}}} 11"),
            format!("strata_spec_decode_num_accepted_tokens_total{{{node}}} 5"),
            format!("strata_spec_decode_accepted_length_bucket{{{node},le=\"0\"}} 1"),
            format!("strata_spec_decode_accepted_length_bucket{{{node},le=\"1\"}} 2"),
            format!("strata_spec_decode_accepted_length_bucket{{{node},le=\"3\"}} 2"),
            format!("strata_spec_decode_accepted_length_bucket{{{node},le=\"4\"}} 3"),
            format!("strata_spec_decode_accepted_length_bucket{{{node},le=\"+Inf\"}} 3"),
            format!("strata_spec_decode_accepted_length_sum{{{node}}} 5.0"),
            format!("strata_spec_decode_accepted_length_count{{{node}}} 3"),
            format!("strata_kv_tier_capacity_blocks{{{node},tier=\"host\"}} 0"),
            format!("strata_kv_restore_seconds_total{{{node},tier=\"disk\"}} 0.0"),
        ] {
            assert!(text.lines().any(|l| l == line), "missing {line}:\n{text}");
        }
    }

    #[test]
    fn a_counter_family_must_be_named_with_its_suffix() {
        // The canary of the helper every scrape-time counter goes through: a name without
        // `_total` would be exported with the suffix doubled or lost; it is refused.
        #[derive(Debug)]
        struct Misnamed;
        impl prometheus_client::collector::Collector for Misnamed {
            fn encode(&self, mut e: DescriptorEncoder) -> fmt::Result {
                counters(&mut e, "strata_things", "Things.", [(Labels::new(), 1u64)])
            }
        }
        let mut registry = Registry::default();
        registry.register_collector(Box::new(Misnamed));
        assert!(prometheus_text::encode(&mut String::new(), &registry).is_err());
    }

    #[test]
    fn surfaces_follow_the_path() {
        assert_eq!(Surface::of("/v1/chat/completions"), Surface::OpenAi);
        assert_eq!(Surface::of("/v1/messages/count_tokens"), Surface::Anthropic);
        assert_eq!(Surface::of("/model/m/converse-stream"), Surface::Converse);
        assert_eq!(Surface::of("/metrics"), Surface::Other);
    }
}
