//! The operational surface against a live server on 127.0.0.1: `/openapi.json` covers every
//! served route, every answer carries an `x-request-id`, and `/metrics` exports the serving
//! families (surface counts, KV blocks per tier, prefix hit ratio, latency histograms).

use std::collections::BTreeSet;
use std::net::SocketAddr;
use std::path::Path;
use std::time::Duration;

use serde_json::json;
use strata_router::Access;
use strata_router::admission::AdmissionLimits;
use strata_router::auth::KeyStore;

mod support;

use support::http::{self, Answer};

/// A tiny model behind one API key, with a 4 KiB body limit.
async fn start() -> (SocketAddr, String, tempfile::TempDir) {
    let model_dir = tempfile::tempdir().unwrap();
    let state = support::paced_tiny_state(model_dir.path(), Duration::ZERO, Default::default());
    let mut keys = KeyStore::default();
    let (_, key) = keys.add("acme", 1).unwrap();
    let access = Access {
        keys,
        limits: AdmissionLimits {
            max_body_bytes: 4096,
            ..AdmissionLimits::default()
        },
        ..Access::default()
    };
    (http::serve(state, access).await, key, model_dir)
}

async fn request(
    addr: SocketAddr,
    method: &str,
    path: &str,
    headers: &[(&str, &str)],
    body: &str,
) -> Answer {
    let raw = http::request_bytes(method, path, headers, body.as_bytes());
    http::send_raw(addr, &raw)
        .await
        .unwrap_or_else(|e| panic!("{method} {path}: {e}"))
}

/// Every route the router serves: its method, its pattern, and a concrete path to call it by.
/// A route added to the router but not here fails `every_served_route_is_described`.
const ROUTES: &[(&str, &str, &str)] = &[
    ("GET", "/health", "/health"),
    ("GET", "/ping", "/ping"),
    ("POST", "/ping", "/ping"),
    ("GET", "/version", "/version"),
    ("POST", "/tokenize", "/tokenize"),
    ("POST", "/detokenize", "/detokenize"),
    ("GET", "/ready", "/ready"),
    ("GET", "/metrics", "/metrics"),
    ("GET", "/openapi.json", "/openapi.json"),
    ("GET", "/dashboard", "/dashboard"),
    ("GET", "/dashboard/state", "/dashboard/state"),
    ("GET", "/dashboard/profiles", "/dashboard/profiles"),
    ("POST", "/dashboard/plan", "/dashboard/plan"),
    ("GET", "/v1/models", "/v1/models"),
    ("GET", "/v1/models/{id}", "/v1/models/tiny"),
    ("POST", "/v1/chat/completions", "/v1/chat/completions"),
    ("POST", "/v1/completions", "/v1/completions"),
    ("POST", "/v1/embeddings", "/v1/embeddings"),
    ("POST", "/v1/rerank", "/v1/rerank"),
    ("POST", "/v2/rerank", "/v2/rerank"),
    ("POST", "/rerank", "/rerank"),
    ("POST", "/v1/responses", "/v1/responses"),
    ("GET", "/v1/responses/{id}", "/v1/responses/resp_0"),
    ("POST", "/v1/cache", "/v1/cache"),
    ("GET", "/v1/cache", "/v1/cache"),
    ("GET", "/v1/cache/{id}", "/v1/cache/kvcache-0"),
    ("DELETE", "/v1/cache/{id}", "/v1/cache/kvcache-0"),
    ("POST", "/v1/messages", "/v1/messages"),
    (
        "POST",
        "/v1/messages/count_tokens",
        "/v1/messages/count_tokens",
    ),
    ("POST", "/model/{model_id}/converse", "/model/tiny/converse"),
    (
        "POST",
        "/model/{model_id}/converse-stream",
        "/model/tiny/converse-stream",
    ),
];

/// `/v1/models/{id}` and `/v1/models/{model}` name the same route.
fn shape(pattern: &str) -> String {
    let mut out = String::new();
    let mut in_param = false;
    for c in pattern.chars() {
        match c {
            '{' => {
                in_param = true;
                out.push_str("{}");
            }
            '}' => in_param = false,
            _ if in_param => {}
            _ => out.push(c),
        }
    }
    out
}

/// The path of every `.route("...")` in the router's sources: what it actually serves.
fn routes_in_source() -> BTreeSet<String> {
    fn walk(dir: &Path, found: &mut BTreeSet<String>) {
        for entry in std::fs::read_dir(dir).unwrap() {
            let path = entry.unwrap().path();
            if path.is_dir() {
                walk(&path, found);
            } else if path.extension().is_some_and(|e| e == "rs") {
                let text = std::fs::read_to_string(&path).unwrap();
                for (at, _) in text.match_indices(".route(") {
                    let rest = text[at + ".route(".len()..].trim_start();
                    if let Some(literal) = rest.strip_prefix('"') {
                        found.insert(literal[..literal.find('"').unwrap()].to_string());
                    }
                }
            }
        }
    }
    let mut found = BTreeSet::new();
    walk(
        &Path::new(env!("CARGO_MANIFEST_DIR")).join("src"),
        &mut found,
    );
    found
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_served_route_is_described() {
    let (addr, key, _model) = start().await;

    // Public: no key needed, like /health.
    let answer = request(addr, "GET", "/openapi.json", &[], "").await;
    assert_eq!(answer.status, 200, "{}", answer.describe());
    let doc = answer.json();
    let version = doc["openapi"].as_str().unwrap_or_default();
    assert!(version.starts_with("3.1."), "openapi: {version:?}");
    let described: BTreeSet<String> = doc["paths"]
        .as_object()
        .unwrap()
        .keys()
        .map(|p| shape(p))
        .collect();

    let listed: BTreeSet<String> = ROUTES.iter().map(|(_, p, _)| shape(p)).collect();
    let served: BTreeSet<String> = routes_in_source().iter().map(|p| shape(p)).collect();
    assert!(served.contains("/v1/chat/completions"), "{served:?}");
    let unlisted: Vec<_> = served.difference(&listed).collect();
    assert!(
        unlisted.is_empty(),
        "served but missing from ROUTES (add them, and to router/api/openapi.json): {unlisted:?}"
    );
    let undescribed: Vec<_> = listed.difference(&described).collect();
    assert!(
        undescribed.is_empty(),
        "missing from router/api/openapi.json: {undescribed:?}"
    );
    let stale: Vec<_> = described.difference(&listed).collect();
    assert!(stale.is_empty(), "described but not served: {stale:?}");

    // Each is really served: the router's fallback (`no route for`) or a 405 means it is not.
    let auth = format!("Bearer {key}");
    for (method, pattern, path) in ROUTES {
        let answer = request(addr, method, path, &[("Authorization", &auth)], "{}").await;
        let fallback = answer.status == 404 && answer.text().contains("no route for");
        assert!(
            !fallback && answer.status != 405,
            "{method} {path} ({pattern}) is not served:\n{}",
            answer.describe()
        );
    }
    let unknown = request(addr, "GET", "/v1/nothing", &[("Authorization", &auth)], "").await;
    assert!(unknown.text().contains("no route for"), "the canary");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_answer_carries_a_request_id() {
    let (addr, key, _model) = start().await;
    let auth = format!("Bearer {key}");

    let echoed = request(
        addr,
        "GET",
        "/v1/models",
        &[("Authorization", &auth), ("x-request-id", "client-42 a")],
        "",
    )
    .await;
    assert_eq!(echoed.status, 200, "{}", echoed.describe());
    assert_eq!(echoed.header("x-request-id"), Some("client-42 a"));

    let long = "x".repeat(129);
    let replaced = request(addr, "GET", "/health", &[("x-request-id", &long)], "").await;
    let id = replaced.header("x-request-id").unwrap();
    assert!(id != long && id.len() == 24, "{id}");

    // Refusals and errors, before and after the handlers, all carry one, each its own.
    let oversize = format!(r#"{{"prompt":"{}"}}"#, "a".repeat(8192));
    let answers = [
        request(addr, "GET", "/v1/models", &[], "").await,
        request(addr, "GET", "/nowhere", &[("Authorization", &auth)], "").await,
        request(
            addr,
            "POST",
            "/v1/completions",
            &[("Authorization", &auth)],
            &oversize,
        )
        .await,
        request(
            addr,
            "POST",
            "/v1/completions",
            &[("Authorization", &auth)],
            "{",
        )
        .await,
    ];
    let statuses: Vec<u16> = answers.iter().map(|a| a.status).collect();
    assert_eq!(statuses, [401, 404, 413, 400]);
    let ids: BTreeSet<&str> = answers
        .iter()
        .map(|a| {
            a.header("x-request-id")
                .unwrap_or_else(|| panic!("no x-request-id:\n{}", a.describe()))
        })
        .collect();
    assert_eq!(ids.len(), answers.len(), "ids repeat: {ids:?}");

    // A stream carries it in its head.
    let body = json!({"model": "tiny", "prompt": "hi", "max_tokens": 3, "stream": true});
    let stream = request(
        addr,
        "POST",
        "/v1/completions",
        &[("Authorization", &auth), ("x-request-id", "stream-1")],
        &body.to_string(),
    )
    .await;
    assert_eq!(stream.status, 200, "{}", stream.describe());
    assert_eq!(stream.header("x-request-id"), Some("stream-1"));
    assert_eq!(stream.sse_data().last().map(String::as_str), Some("[DONE]"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn metrics_export_the_serving_families() {
    let (addr, key, _model) = start().await;
    let auth = format!("Bearer {key}");
    // 40 prompt tokens, twice: the repeat hits the prefix cache.
    let prompt: Vec<u32> = (5..45).collect();
    let body = json!({"model": "tiny", "prompt": prompt, "max_tokens": 4, "temperature": 0});
    for _ in 0..2 {
        let answer = request(
            addr,
            "POST",
            "/v1/completions",
            &[("Authorization", &auth)],
            &body.to_string(),
        )
        .await;
        assert_eq!(answer.status, 200, "{}", answer.describe());
    }
    let anthropic = request(addr, "POST", "/v1/messages", &[], "{}").await;
    assert_eq!(anthropic.status, 401);

    let labelled = request(addr, "GET", "/metrics", &[], "").await.text();
    // Every strata_ sample names the model it serves (what a Grafana board groups by).
    for line in labelled.lines().filter(|l| l.starts_with("strata_")) {
        assert!(line.contains("model_name=\"tiny\""), "{line}");
    }
    assert!(labelled.contains("# TYPE strata_request_decode_time_seconds histogram"));
    let text = support::unlabelled(&labelled);
    let value = |name: &str| -> f64 {
        text.lines()
            .find_map(|l| l.strip_prefix(name)?.strip_prefix(' '))
            .unwrap_or_else(|| panic!("no {name}:\n{text}"))
            .parse()
            .unwrap()
    };
    assert_eq!(
        value("strata_surface_requests_total{surface=\"openai\",status=\"200\"}"),
        2.0
    );
    assert_eq!(
        value("strata_surface_requests_total{surface=\"anthropic\",status=\"401\"}"),
        1.0
    );
    let ratio = value("strata_prefix_cache_hit_ratio");
    let cached = value("strata_cached_prompt_tokens_total");
    let prompt = value("strata_prompt_tokens_total");
    assert!(cached > 0.0, "{text}");
    assert!((ratio - cached / prompt).abs() < 1e-9, "{text}");
    assert!(
        value("strata_kv_cached_blocks{tier=\"device\"}") >= 2.0,
        "{text}"
    );
    assert_eq!(value("strata_kv_cached_blocks{tier=\"host\"}"), 0.0);
    assert_eq!(value("strata_kv_cached_blocks{tier=\"disk\"}"), 0.0);
    value("strata_inter_token_latency_seconds_count");
    value("strata_generated_tokens_per_second");
    // The first request's prefill and 3 decode steps at least (the engine publishes its times
    // between steps, so the second request's last step may not be in yet).
    assert!(value("strata_engine_steps_total") >= 4.0, "{text}");
    assert!(
        value("strata_engine_step_tokens_total") >= 40.0 + 3.0,
        "{text}"
    );
    for phase in ["plan", "forward", "sample"] {
        let seconds = value(&format!(
            "strata_engine_step_seconds_total{{phase=\"{phase}\"}}"
        ));
        assert!(seconds > 0.0, "{phase}: {text}");
    }
    // Per-request histograms: two finished generations of 40 prompt tokens and 4 generated.
    assert_eq!(
        value("strata_e2e_request_latency_seconds_count"),
        2.0,
        "{text}"
    );
    assert!(
        value("strata_e2e_request_latency_seconds_sum") > 0.0,
        "{text}"
    );
    // Both generations' prefill (time to first token less the engine's queue) and decode.
    for family in [
        "strata_request_prefill_time_seconds",
        "strata_request_decode_time_seconds",
    ] {
        assert_eq!(value(&format!("{family}_count")), 2.0, "{family}: {text}");
    }
    assert!(
        value("strata_request_prefill_time_seconds_sum")
            <= value("strata_time_to_first_token_seconds_sum"),
        "{text}"
    );
    // Admitted generations (the two above and the refused one's 401 never reach admission).
    assert!(
        value("strata_request_queue_time_seconds_count") >= 2.0,
        "{text}"
    );
    assert_eq!(value("strata_request_prompt_tokens_count"), 2.0, "{text}");
    assert_eq!(value("strata_request_prompt_tokens_sum"), 80.0, "{text}");
    assert_eq!(
        value("strata_request_prompt_tokens_bucket{le=\"20\"}"),
        0.0,
        "{text}"
    );
    assert_eq!(
        value("strata_request_prompt_tokens_bucket{le=\"50\"}"),
        2.0,
        "{text}"
    );
    assert_eq!(value("strata_request_generation_tokens_sum"), 8.0, "{text}");
    // The engine's own gauges, the model's name and the process.
    let usage = value("strata_kv_usage_ratio");
    assert!((0.0..=1.0).contains(&usage), "{text}");
    assert_eq!(value("strata_engine_requests_running"), 0.0, "{text}");
    assert_eq!(value("strata_preemptions_total"), 0.0, "{text}");
    assert!(
        labelled
            .lines()
            .any(|l| l == "strata_model_info{model_name=\"tiny\"} 1"),
        "{labelled}"
    );
    assert!(value("process_resident_memory_bytes") > 0.0, "{text}");
    assert!(value("process_open_fds") > 0.0, "{text}");
}

#[test]
fn route_shapes_ignore_parameter_names() {
    assert_eq!(shape("/model/{modelId}/converse"), "/model/{}/converse");
    assert_eq!(
        shape("/model/{model_id}/converse"),
        shape("/model/{modelId}/converse")
    );
}

/// `--served-model-name a b c`: every name is listed (the served one first, as vLLM lists them)
/// and retrieved as itself, each naming the model it serves as `root`; another name is a 404.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_served_name_is_listed_and_retrieved_as_itself() {
    let model_dir = tempfile::tempdir().unwrap();
    let mut state = support::paced_tiny_state(model_dir.path(), Duration::ZERO, Default::default());
    std::sync::Arc::get_mut(&mut state).unwrap().aliases = vec!["b".into(), "c".into()];
    let addr = http::serve(state, strata_router::Access::default()).await;
    let listed = request(addr, "GET", "/v1/models", &[], "").await.json();
    let ids: Vec<&str> = listed["data"]
        .as_array()
        .unwrap()
        .iter()
        .map(|m| m["id"].as_str().unwrap())
        .collect();
    assert_eq!(ids, ["tiny", "b", "c"], "{listed}");
    assert!(
        listed["data"]
            .as_array()
            .unwrap()
            .iter()
            .all(|m| m["root"] == "tiny")
    );
    let one = request(addr, "GET", "/v1/models/c", &[], "").await.json();
    assert_eq!(
        (one["id"].as_str(), one["root"].as_str()),
        (Some("c"), Some("tiny"))
    );
    assert_eq!(
        request(addr, "GET", "/v1/models/d", &[], "").await.status,
        404
    );
}

/// A prompt whose bytes alone prove it longer than the context window is refused before it is
/// tokenized (a 3.9 MB prompt once took seconds and hundreds of MB to be refused), as a
/// context_length_exceeded naming the field; a prompt below the bound is tokenized and refused
/// by its token count as before.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_prompt_too_long_by_its_bytes_is_refused_untokenized() {
    let model_dir = tempfile::tempdir().unwrap();
    let state = support::paced_tiny_state(model_dir.path(), Duration::ZERO, Default::default());
    let access = strata_router::Access {
        limits: AdmissionLimits {
            max_body_bytes: 8 << 20,
            ..AdmissionLimits::default()
        },
        ..strata_router::Access::default()
    };
    let addr = http::serve(state, access).await;
    let huge = "word ".repeat(800_000);
    for (path, body, param) in [
        (
            "/v1/chat/completions",
            json!({"model": "tiny", "max_tokens": 1,
                   "messages": [{"role": "user", "content": huge}]}),
            "messages",
        ),
        (
            "/v1/completions",
            json!({"model": "tiny", "max_tokens": 1, "prompt": huge}),
            "prompt",
        ),
    ] {
        let answer = http::post(addr, path, &body).await;
        assert_eq!(answer.status, 400, "{path}: {}", answer.describe());
        let error = &answer.json()["error"];
        assert_eq!(error["code"], "context_length_exceeded", "{path}: {error}");
        assert_eq!(error["param"], param, "{path}: {error}");
        assert!(
            error["message"].as_str().unwrap().contains("bytes"),
            "{error}"
        );
    }
    // Under the bound: tokenized, and refused by its tokens.
    let long = json!({"model": "tiny", "max_tokens": 1, "prompt": "word ".repeat(400)});
    let answer = http::post(addr, "/v1/completions", &long).await;
    assert_eq!(answer.status, 400, "{}", answer.describe());
    let error = &answer.json()["error"];
    assert_eq!(error["code"], "context_length_exceeded", "{error}");
    assert!(
        !error["message"].as_str().unwrap().contains("bytes"),
        "{error}"
    );
}
