//! API keys (the keys file's and the server's own, `--api-key`), tenants' cache salts, CORS
//! (`--allowed-origins`), admission limits and the operational endpoints, against a live server
//! on 127.0.0.1 driven with raw HTTP/1.1.

use std::net::SocketAddr;
use std::time::Duration;

use serde_json::{Value, json};
use strata_router::admission::AdmissionLimits;
use strata_router::auth::{ApiKey, KeyStore};
use strata_router::cors::AllowedOrigins;
use strata_router::{Access, serve_on_with};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

mod support;

/// Serves a tiny synthesized model (no end-of-sequence ids: it runs to `max_tokens`) behind
/// `access`; returns its address.
async fn start(access: Access, step_delay: Duration) -> SocketAddr {
    let model_dir = tempfile::tempdir().unwrap();
    let state = support::paced_tiny_state(model_dir.path(), step_delay, Default::default());
    let listener = tokio::net::TcpListener::bind(SocketAddr::from(([127, 0, 0, 1], 0)))
        .await
        .unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(
        async move { serve_on_with(listener, state, &access, std::future::pending()).await },
    );
    addr
}

struct Answer {
    status: u16,
    head: String,
    body: String,
}

impl Answer {
    fn json(&self) -> Value {
        serde_json::from_str(&self.body)
            .unwrap_or_else(|e| panic!("not JSON ({e}): {}\n{}", self.head, self.body))
    }

    fn header(&self, name: &str) -> Option<&str> {
        self.head.lines().find_map(|line| {
            let (k, v) = line.split_once(':')?;
            k.eq_ignore_ascii_case(name).then(|| v.trim())
        })
    }
}

fn request_text(method: &str, path: &str, key: Option<&str>, body: &str) -> String {
    let auth = key.map_or(String::new(), |k| format!("Authorization: Bearer {k}\r\n"));
    format!(
        "{method} {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n{auth}\
         Content-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    )
}

/// One request on a fresh connection, read to the end (bodies here are never chunked: the
/// requests are not streaming).
async fn http(addr: SocketAddr, method: &str, path: &str, key: Option<&str>, body: &str) -> Answer {
    let mut conn = TcpStream::connect(addr).await.unwrap();
    conn.write_all(request_text(method, path, key, body).as_bytes())
        .await
        .unwrap();
    let mut raw = Vec::new();
    conn.read_to_end(&mut raw).await.unwrap();
    let raw = String::from_utf8_lossy(&raw).into_owned();
    let (head, body) = raw.split_once("\r\n\r\n").expect("an HTTP response");
    let status = head.split(' ').nth(1).unwrap().parse().unwrap();
    Answer {
        status,
        head: head.to_string(),
        body: body.to_string(),
    }
}

/// 40 prompt tokens: more than two blocks of 16, so a repeat can hit the prefix cache.
fn completion(max_tokens: u32, stream: bool) -> String {
    let prompt: Vec<u32> = (5..45).collect();
    json!({"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
           "stream": stream})
    .to_string()
}

fn keys(tenants: &[&str]) -> (KeyStore, Vec<String>) {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("keys.json");
    let mut store = KeyStore::default();
    let keys = tenants.iter().map(|t| store.add(t, 0).unwrap().1).collect();
    store.save(&path).unwrap();
    (KeyStore::load(&path).unwrap(), keys)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn keys_gate_the_api_and_tenants_keep_their_own_prefix_cache() {
    let (store, keys) = keys(&["acme", "globex"]);
    let access = Access {
        keys: store,
        ..Access::default()
    };
    let addr = start(access, Duration::ZERO).await;
    let body = completion(1, false);

    let missing = http(addr, "POST", "/v1/completions", None, &body).await;
    assert_eq!(missing.status, 401, "{}", missing.body);
    let error = &missing.json()["error"];
    assert_eq!(error["type"], "authentication_error");
    assert!(error["message"].as_str().unwrap().contains("missing"));
    let wrong = http(addr, "GET", "/v1/models", Some("sk-strata-0000"), "").await;
    assert_eq!(wrong.status, 401, "{}", wrong.body);
    assert_eq!(wrong.json()["error"]["type"], "authentication_error");

    let cached = |a: &Answer| a.json()["usage"]["prompt_tokens_details"]["cached_tokens"].clone();
    let first = http(addr, "POST", "/v1/completions", Some(&keys[0]), &body).await;
    assert_eq!(first.status, 200, "{}", first.body);
    assert_eq!(cached(&first), 0);
    let again = http(addr, "POST", "/v1/completions", Some(&keys[0]), &body).await;
    assert_eq!(again.status, 200, "{}", again.body);
    assert!(
        cached(&again).as_u64().unwrap() >= 16,
        "the same tenant's repeat should hit its prefix cache: {}",
        again.body
    );
    let other = http(addr, "POST", "/v1/completions", Some(&keys[1]), &body).await;
    assert_eq!(other.status, 200, "{}", other.body);
    assert_eq!(
        cached(&other),
        0,
        "another tenant must not share the cache: {}",
        other.body
    );

    // x-api-key (Anthropic's header) works as well; /health, /ready and /metrics need no key.
    let mut conn = TcpStream::connect(addr).await.unwrap();
    let request = format!(
        "GET /v1/models HTTP/1.1\r\nHost: x\r\nConnection: close\r\nx-api-key: {}\r\n\r\n",
        keys[1]
    );
    conn.write_all(request.as_bytes()).await.unwrap();
    let mut raw = String::new();
    conn.read_to_string(&mut raw).await.unwrap();
    assert!(raw.starts_with("HTTP/1.1 200"), "{raw}");

    let ready = http(addr, "GET", "/ready", None, "").await;
    assert_eq!(ready.status, 200, "{}", ready.body);
    let metrics = http(addr, "GET", "/metrics", None, "").await;
    assert_eq!(metrics.status, 200);
    let text = &support::unlabelled(&metrics.body);
    for line in [
        "strata_requests_total{route=\"/v1/completions\",status=\"200\"} 3",
        "strata_requests_total{route=\"/v1/completions\",status=\"401\"} 1",
        "strata_generated_tokens_total 3",
        "strata_prompt_tokens_total 120",
        "strata_requests_inflight 0",
        "strata_time_to_first_token_seconds_count 3",
    ] {
        assert!(text.lines().any(|l| l == line), "missing {line}:\n{text}");
    }
    let cached_total = text
        .lines()
        .find_map(|l| l.strip_prefix("strata_cached_prompt_tokens_total "))
        .unwrap();
    assert_ne!(cached_total, "0", "{text}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_full_queue_is_a_429_with_retry_after_and_oversize_bodies_a_413() {
    let access = Access {
        keys: KeyStore::default(),
        limits: AdmissionLimits {
            max_inflight: 1,
            max_queued: 0,
            max_body_bytes: 1024,
        },
        ..Access::default()
    };
    let addr = start(access, Duration::from_millis(20)).await;

    // 200 tokens at 20 ms a step: the one slot stays taken for seconds.
    let mut long = TcpStream::connect(addr).await.unwrap();
    long.write_all(
        request_text("POST", "/v1/completions", None, &completion(200, true)).as_bytes(),
    )
    .await
    .unwrap();
    let mut received = Vec::new();
    let mut buf = [0u8; 4096];
    while !String::from_utf8_lossy(&received).contains("data: {") {
        let n = long.read(&mut buf).await.unwrap();
        assert!(n > 0, "the server closed before the first chunk");
        received.extend_from_slice(&buf[..n]);
    }

    let refused = http(addr, "POST", "/v1/completions", None, &completion(1, false)).await;
    assert_eq!(refused.status, 429, "{}", refused.body);
    assert_eq!(refused.header("retry-after"), Some("1"), "{}", refused.head);
    assert_eq!(refused.json()["error"]["code"], "rate_limit_exceeded");
    // Reads are not generations: they are not queued behind it.
    let models = http(addr, "GET", "/v1/models", None, "").await;
    assert_eq!(models.status, 200, "{}", models.body);

    // Hanging up frees the slot.
    drop(long);
    let mut admitted = None;
    for _ in 0..50 {
        tokio::time::sleep(Duration::from_millis(100)).await;
        let answer = http(addr, "POST", "/v1/completions", None, &completion(1, false)).await;
        if answer.status != 429 {
            admitted = Some(answer);
            break;
        }
    }
    let admitted = admitted.expect("the slot was never freed after the client hung up");
    assert_eq!(admitted.status, 200, "{}", admitted.body);

    let oversize = format!(r#"{{"model":"tiny","prompt":"{}"}}"#, "a".repeat(4096));
    let too_large = http(addr, "POST", "/v1/completions", None, &oversize).await;
    assert_eq!(too_large.status, 413, "{}", too_large.body);
    let error = &too_large.json()["error"];
    assert_eq!(error["type"], "invalid_request_error");
    assert!(
        error["message"].as_str().unwrap().contains("1024"),
        "{error}"
    );
}

/// One request with `headers` on a fresh connection (the shared raw-HTTP helper).
async fn with_headers(
    addr: SocketAddr,
    method: &str,
    path: &str,
    headers: &[(&str, &str)],
    body: &str,
) -> support::http::Answer {
    let raw = support::http::request_bytes(method, path, headers, body.as_bytes());
    support::http::send_raw(addr, &raw).await.unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_servers_own_key_is_required_beside_the_files_keys() {
    let (store, keys) = keys(&["acme"]);
    let own = "sk-own-key-of-this-server";
    let access = Access {
        keys: store,
        api_key: Some(ApiKey::new(own).unwrap()),
        ..Access::default()
    };
    let addr = start(access, Duration::ZERO).await;
    let body = completion(1, false);

    let missing = http(addr, "POST", "/v1/completions", None, &body).await;
    assert_eq!(missing.status, 401, "{}", missing.body);
    let wrong = http(
        addr,
        "POST",
        "/v1/completions",
        Some("sk-own-key-of-this-serve"),
        &body,
    );
    assert_eq!(wrong.await.status, 401);
    let with_own = http(addr, "POST", "/v1/completions", Some(own), &body).await;
    assert_eq!(with_own.status, 200, "{}", with_own.body);
    let with_file_key = http(addr, "POST", "/v1/completions", Some(&keys[0]), &body).await;
    assert_eq!(with_file_key.status, 200, "{}", with_file_key.body);

    // Anthropic clients send x-api-key; a refusal there is in Anthropic's shape.
    let messages = json!({"model": "tiny", "max_tokens": 1,
                          "messages": [{"role": "user", "content": "hi"}]})
    .to_string();
    let own_header = [("x-api-key", own)];
    let anthropic = with_headers(addr, "POST", "/v1/messages", &own_header, &messages).await;
    assert_eq!(anthropic.status, 200, "{}", anthropic.describe());
    let wrong_header = [("x-api-key", "no")];
    let refused = with_headers(addr, "POST", "/v1/messages", &wrong_header, &messages).await;
    let refused = refused.json();
    assert_eq!(refused["type"], "error", "{refused}");
    assert_eq!(
        refused["error"]["type"], "authentication_error",
        "{refused}"
    );

    // Liveness stays public.
    for (method, path) in [("GET", "/health"), ("GET", "/ping"), ("POST", "/ping")] {
        let answer = http(addr, method, path, None, "").await;
        assert_eq!(answer.status, 200, "{method} {path}: {}", answer.body);
    }

    // The server's key alone closes an otherwise open server.
    let access = Access {
        api_key: Some(ApiKey::new(own).unwrap()),
        ..Access::default()
    };
    let addr = start(access, Duration::ZERO).await;
    assert_eq!(http(addr, "GET", "/v1/models", None, "").await.status, 401);
    assert_eq!(
        http(addr, "GET", "/v1/models", Some(own), "").await.status,
        200
    );
}

/// A browser's preflight for a keyed POST from `origin`.
async fn preflight(addr: SocketAddr, origin: &str) -> support::http::Answer {
    let headers = [
        ("Origin", origin),
        ("Access-Control-Request-Method", "POST"),
        (
            "Access-Control-Request-Headers",
            "authorization, content-type",
        ),
    ];
    with_headers(addr, "OPTIONS", "/v1/chat/completions", &headers, "").await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cors_answers_listed_origins_only_and_is_off_by_default() {
    let listed = "https://app.example";
    let own = "sk-browser-key";
    let access = Access {
        api_key: Some(ApiKey::new(own).unwrap()),
        cors: AllowedOrigins::parse(&[listed]).unwrap(),
        ..Access::default()
    };
    let addr = start(access, Duration::ZERO).await;

    // The preflight carries no key and is answered all the same, for the listed origin.
    let answer = preflight(addr, listed).await;
    assert_eq!(answer.status, 200, "{}", answer.describe());
    assert_eq!(answer.header("access-control-allow-origin"), Some(listed));
    let allowed = answer.header("access-control-allow-headers").unwrap_or("");
    assert!(allowed.contains("authorization"), "{}", answer.describe());
    assert!(
        answer
            .header("access-control-allow-methods")
            .unwrap_or("")
            .contains("POST")
    );
    let other = preflight(addr, "https://elsewhere.example").await;
    assert_eq!(
        other.header("access-control-allow-origin"),
        None,
        "{}",
        other.describe()
    );

    // The request itself: the origin echoed on the answer and on a refusal.
    let bearer = format!("Bearer {own}");
    let models = [("Origin", listed), ("Authorization", bearer.as_str())];
    let answer = with_headers(addr, "GET", "/v1/models", &models, "").await;
    assert_eq!(answer.status, 200, "{}", answer.describe());
    assert_eq!(answer.header("access-control-allow-origin"), Some(listed));
    let keyless = with_headers(addr, "GET", "/v1/models", &[("Origin", listed)], "").await;
    assert_eq!(keyless.status, 401);
    assert_eq!(keyless.header("access-control-allow-origin"), Some(listed));
    let stranger = [
        ("Origin", "https://elsewhere.example"),
        ("Authorization", bearer.as_str()),
    ];
    let answer = with_headers(addr, "GET", "/v1/models", &stranger, "").await;
    assert_eq!(answer.header("access-control-allow-origin"), None);

    // `*` allows any origin.
    let access = Access {
        cors: AllowedOrigins::parse(&["*"]).unwrap(),
        ..Access::default()
    };
    let addr = start(access, Duration::ZERO).await;
    let answer = preflight(addr, "https://anywhere.example").await;
    assert_eq!(answer.header("access-control-allow-origin"), Some("*"));

    // The canary: by default no CORS header at all, and no preflight answer.
    let addr = start(Access::default(), Duration::ZERO).await;
    let answer = preflight(addr, listed).await;
    assert_ne!(answer.status, 200, "{}", answer.describe());
    assert_eq!(answer.header("access-control-allow-origin"), None);
    let answer = with_headers(addr, "GET", "/v1/models", &[("Origin", listed)], "").await;
    assert_eq!(answer.status, 200);
    assert_eq!(answer.header("access-control-allow-origin"), None);
}
