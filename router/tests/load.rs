//! Bounded loopback load: 200 concurrent streaming chats through admission's slots and queue
//! must all finish cleanly, and an overloaded server must refuse the excess with 429 +
//! `Retry-After` in each surface's shape, never fail otherwise, and then serve normally.
//! Latency and throughput are printed, not asserted: the machine running the tests is shared.

mod support;

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use serde_json::{Value, json};
use strata_router::Access;
use strata_router::admission::AdmissionLimits;
use support::http::{self, Answer};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

const CLIENTS: usize = 200;
const MAX_TOKENS: u64 = 12;

async fn start(limits: AdmissionLimits, step_delay: Duration) -> (SocketAddr, tempfile::TempDir) {
    let model_dir = tempfile::tempdir().unwrap();
    let state = support::paced_tiny_state(model_dir.path(), step_delay, Default::default());
    let access = Access {
        limits,
        ..Access::default()
    };
    (http::serve(state, access).await, model_dir)
}

fn stream_request(i: usize) -> Vec<u8> {
    // Distinct prompts, so the prefix cache does not turn the load into one request.
    let body = json!({
        "model": "tiny",
        "messages": [{"role": "user", "content": format!("request {i}: tell me something")}],
        "max_tokens": MAX_TOKENS, "temperature": 0, "stream": true,
        "stream_options": {"include_usage": true},
    });
    http::request_bytes(
        "POST",
        "/v1/chat/completions",
        &[],
        body.to_string().as_bytes(),
    )
}

/// One streamed chat: time to the first text delta, generated tokens.
struct Streamed {
    ttft: Duration,
    tokens: u64,
}

/// The parsed `data:` chunks of a (possibly partial) raw answer.
fn chunks_so_far(raw: &[u8]) -> Vec<String> {
    let Some(split) = http::find(raw, b"\r\n\r\n") else {
        return Vec::new();
    };
    let (body, _) = http::dechunk(&raw[split + 4..]);
    let text = String::from_utf8_lossy(&body);
    // Only whole events: the text after the last blank line may still be arriving.
    let whole = text.rfind("\n\n").map_or("", |end| &text[..end + 2]);
    http::sse_data(whole)
}

fn has_text(chunk: &str) -> bool {
    serde_json::from_str::<Value>(chunk).is_ok_and(|c| {
        c["choices"][0]["delta"]["content"]
            .as_str()
            .is_some_and(|t| !t.is_empty())
    })
}

/// Runs one streaming chat to its end; the reason it went wrong, if it did.
async fn one_stream(addr: SocketAddr, i: usize) -> Result<Streamed, String> {
    let sent = Instant::now();
    let mut conn = TcpStream::connect(addr)
        .await
        .map_err(|e| format!("connect: {e}"))?;
    conn.write_all(&stream_request(i))
        .await
        .map_err(|e| format!("write: {e}"))?;
    let mut raw = Vec::new();
    let mut buf = [0u8; 8192];
    let mut ttft = None;
    loop {
        let n = conn
            .read(&mut buf)
            .await
            .map_err(|e| format!("read: {e}"))?;
        if n == 0 {
            break;
        }
        raw.extend_from_slice(&buf[..n]);
        if ttft.is_none() && chunks_so_far(&raw).iter().any(|c| has_text(c)) {
            ttft = Some(sent.elapsed());
        }
    }
    let answer = http::parse_answer(&raw)?;
    if answer.status != 200 {
        return Err(format!("status {}: {}", answer.status, answer.describe()));
    }
    let data = answer.sse_data();
    if data.last().map(String::as_str) != Some("[DONE]") {
        return Err(format!("no [DONE] at the end: {data:?}"));
    }
    let chunks: Vec<Value> = data[..data.len() - 1]
        .iter()
        .map(|d| serde_json::from_str(d).map_err(|e| format!("{e}: {d}")))
        .collect::<Result<_, _>>()?;
    if let Some(error) = chunks.iter().find(|c| c.get("error").is_some()) {
        return Err(format!("an error chunk: {error}"));
    }
    let finishes: Vec<&Value> = chunks
        .iter()
        .map(|c| &c["choices"][0]["finish_reason"])
        .filter(|r| !r.is_null())
        .collect();
    if finishes != [&json!("length")] {
        return Err(format!("finish reasons {finishes:?}, want one \"length\""));
    }
    let tokens = chunks.last().unwrap()["usage"]["completion_tokens"]
        .as_u64()
        .ok_or("no usage chunk")?;
    if tokens != MAX_TOKENS {
        return Err(format!("{tokens} tokens, want {MAX_TOKENS}"));
    }
    Ok(Streamed {
        ttft: ttft.ok_or("no text delta")?,
        tokens,
    })
}

fn percentile(sorted: &[Duration], p: f64) -> Duration {
    let at = ((sorted.len() - 1) as f64 * p).round() as usize;
    sorted[at]
}

/// The value of an unlabelled metric.
async fn metric(addr: SocketAddr, name: &str) -> String {
    let metrics = http::send(addr, "GET", "/metrics", b"").await;
    support::unlabelled(&metrics.text())
        .lines()
        .find_map(|l| l.strip_prefix(&format!("{name} ")).map(str::to_string))
        .unwrap_or_else(|| panic!("{name} missing from /metrics"))
}

/// Slots are released as response bodies are dropped, a moment after the client has read the
/// end: wait (bounded) for the gauges to reach zero.
async fn assert_drained(addr: SocketAddr) {
    for _ in 0..50 {
        if metric(addr, "strata_requests_inflight").await == "0"
            && metric(addr, "strata_requests_queued").await == "0"
        {
            return;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    panic!(
        "slots still held after every client finished: inflight {}, queued {}",
        metric(addr, "strata_requests_inflight").await,
        metric(addr, "strata_requests_queued").await
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_hundred_concurrent_streams_all_finish() {
    // 64 run at once and the rest wait in line: the queue is exercised, nothing is refused.
    let limits = AdmissionLimits {
        max_inflight: 64,
        max_queued: CLIENTS,
        ..AdmissionLimits::default()
    };
    let (addr, _model) = start(limits, Duration::ZERO).await;
    let started = Instant::now();
    let tasks: Vec<_> = (0..CLIENTS)
        .map(|i| tokio::spawn(one_stream(addr, i)))
        .collect();
    let mut ttfts = Vec::new();
    let mut tokens = 0;
    let mut failures = Vec::new();
    for (i, task) in tasks.into_iter().enumerate() {
        match tokio::time::timeout(Duration::from_secs(60), task).await {
            Ok(Ok(Ok(s))) => {
                ttfts.push(s.ttft);
                tokens += s.tokens;
            }
            Ok(Ok(Err(e))) => failures.push(format!("stream {i}: {e}")),
            Ok(Err(e)) => failures.push(format!("stream {i}: the task failed: {e}")),
            Err(_) => failures.push(format!("stream {i}: not finished within 60 s")),
        }
    }
    let wall = started.elapsed();
    assert!(
        failures.is_empty(),
        "{} of {CLIENTS} streams failed:\n{}",
        failures.len(),
        failures.join("\n")
    );
    ttfts.sort();
    eprintln!(
        "{CLIENTS} concurrent streams of {MAX_TOKENS} tokens in {wall:.2?}: TTFT p50 {:.1?}, \
         p99 {:.1?}; {:.0} tokens/s aggregate",
        percentile(&ttfts, 0.5),
        percentile(&ttfts, 0.99),
        tokens as f64 / wall.as_secs_f64()
    );
    assert_drained(addr).await;
    assert_eq!(
        metric(addr, "strata_generated_tokens_total").await,
        (CLIENTS as u64 * MAX_TOKENS).to_string()
    );
}

/// One request of `surface` for the overload test: chat, Anthropic, Converse, streamed chat.
fn overload_request(surface: usize, max_tokens: u64) -> (&'static str, Value) {
    match surface % 4 {
        3 => (
            "/v1/chat/completions",
            json!({"model": "tiny", "messages": [{"role": "user", "content": "hi"}],
                   "max_tokens": max_tokens, "temperature": 0, "stream": true}),
        ),
        0 => (
            "/v1/chat/completions",
            json!({"model": "tiny", "messages": [{"role": "user", "content": "hi"}],
                   "max_tokens": max_tokens, "temperature": 0}),
        ),
        1 => (
            "/v1/messages",
            json!({"model": "tiny", "messages": [{"role": "user", "content": "hi"}],
                   "max_tokens": max_tokens, "temperature": 0}),
        ),
        _ => (
            "/model/tiny/converse",
            json!({"messages": [{"role": "user", "content": [{"text": "hi"}]}],
                   "inferenceConfig": {"maxTokens": max_tokens, "temperature": 0}}),
        ),
    }
}

/// A 429 or 503 in the shape of the surface `path` belongs to, with `Retry-After`.
fn check_refusal(path: &str, answer: &Answer) -> Result<(), String> {
    if answer.header("retry-after") != Some("1") {
        return Err("no Retry-After: 1".into());
    }
    let body = answer.try_json().ok_or("the body is not JSON")?;
    let busy = answer.status == 429;
    let ok = if path.starts_with("/model/") {
        let want = if busy {
            "ThrottlingException"
        } else {
            "ServiceUnavailableException"
        };
        answer.header("x-amzn-errortype") == Some(want) && body["message"].is_string()
    } else if path.starts_with("/v1/messages") {
        let want = if busy {
            "rate_limit_error"
        } else {
            "overloaded_error"
        };
        body["type"] == "error" && body["error"]["type"] == want
    } else {
        let code_ok = !busy || body["error"]["code"] == "rate_limit_exceeded";
        let want = if busy {
            "rate_limit_error"
        } else {
            "server_error"
        };
        body["error"]["type"] == want && code_ok && body["error"]["message"].is_string()
    };
    if ok {
        Ok(())
    } else {
        Err("not the surface's error shape".into())
    }
}

/// A held slot: a streaming completion of `max_tokens` tokens whose first chunk has arrived.
async fn hold_slot(addr: SocketAddr, max_tokens: u64) -> TcpStream {
    let body = json!({"model": "tiny", "prompt": "hold", "max_tokens": max_tokens,
                      "temperature": 0, "stream": true});
    let mut conn = TcpStream::connect(addr).await.unwrap();
    let raw = http::request_bytes("POST", "/v1/completions", &[], body.to_string().as_bytes());
    conn.write_all(&raw).await.unwrap();
    let mut received = Vec::new();
    let mut buf = [0u8; 4096];
    while chunks_so_far(&received).is_empty() {
        let n = conn.read(&mut buf).await.unwrap();
        assert!(n > 0, "the server closed before the first chunk");
        received.extend_from_slice(&buf[..n]);
    }
    conn
}

/// Waits (bounded) until an unlabelled metric reads `want`.
async fn wait_for_metric(addr: SocketAddr, name: &str, want: &str) {
    for _ in 0..100 {
        if metric(addr, name).await == want {
            return;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    panic!("{name} never reached {want}: {}", metric(addr, name).await);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_that_hangs_up_in_line_leaves_it() {
    let limits = AdmissionLimits {
        max_inflight: 1,
        max_queued: 1,
        ..AdmissionLimits::default()
    };
    let (addr, _model) = start(limits, Duration::from_millis(25)).await;
    // 200 tokens at 25 ms a step: the slot stays taken for five seconds.
    let running = hold_slot(addr, 200).await;
    let (path, body) = overload_request(0, 4);
    let mut waiting = TcpStream::connect(addr).await.unwrap();
    let raw = http::request_bytes("POST", path, &[], body.to_string().as_bytes());
    waiting.write_all(&raw).await.unwrap();
    wait_for_metric(addr, "strata_requests_queued", "1").await;
    let refused = http::post(addr, path, &body).await;
    assert_eq!(refused.status, 429, "{}", refused.describe());

    drop(waiting);
    wait_for_metric(addr, "strata_requests_queued", "0").await;
    drop(running);
    assert_drained(addr).await;
    let served = http::post(addr, path, &body).await;
    assert_eq!(served.status, 200, "{}", served.describe());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_overloaded_server_refuses_with_429_and_recovers() {
    // One slot, one place in line, 10 ms a step: most of a burst of 30 finds the line full.
    let limits = AdmissionLimits {
        max_inflight: 1,
        max_queued: 1,
        ..AdmissionLimits::default()
    };
    let (addr, _model) = start(limits, Duration::from_millis(10)).await;
    let tasks: Vec<_> = (0..30)
        .map(|i| {
            tokio::spawn(async move {
                let (path, body) = overload_request(i, 10);
                (path, http::post(addr, path, &body).await)
            })
        })
        .collect();
    let mut served = 0;
    let mut refused = 0;
    let mut failures = Vec::new();
    for task in tasks {
        let (path, answer) = task.await.unwrap();
        match answer.status {
            200 => {
                served += 1;
                let streamed = answer.header("content-type") == Some("text/event-stream");
                if streamed && answer.sse_data().last().map(String::as_str) != Some("[DONE]") {
                    failures.push(format!(
                        "{path}: a stream without [DONE]\n{}",
                        answer.describe()
                    ));
                }
            }
            // A 503 is documented only for a stopped engine; it must still be well formed.
            429 | 503 => {
                refused += 1;
                if let Err(e) = check_refusal(path, &answer) {
                    failures.push(format!("{path}: {e}\n{}", answer.describe()));
                }
            }
            _ => failures.push(format!("{path}: unexpected\n{}", answer.describe())),
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n\n"));
    assert!(
        served >= 2,
        "only {served} served: the slot and the line hold two"
    );
    assert!(refused >= 1, "nothing refused out of 30 with room for two");
    eprintln!("overload: {served} served, {refused} refused with 429");

    // Every slot and place in line comes back, and each surface serves again.
    assert_drained(addr).await;
    for surface in 0..4 {
        let (path, body) = overload_request(surface, 3);
        let answer = http::post(addr, path, &body).await;
        assert_eq!(answer.status, 200, "{path}: {}", answer.describe());
    }
    let health = http::send(addr, "GET", "/health", b"").await;
    assert_eq!(health.status, 200);
}
