//! A client that hangs up mid-stream takes its generation with it: the SSE body is dropped,
//! which drops the engine stream, which cancels the request before it runs to `max_tokens`.

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use strata_router::serve_on;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

mod support;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hanging_up_mid_stream_cancels_the_generation() {
    let model_dir = tempfile::tempdir().unwrap();
    let steps = Arc::new(AtomicUsize::new(0));
    let state =
        support::paced_tiny_state(model_dir.path(), Duration::from_millis(10), steps.clone());
    let listener = tokio::net::TcpListener::bind(SocketAddr::from(([127, 0, 0, 1], 0)))
        .await
        .unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(serve_on(listener, state, std::future::pending()));

    // No eos ids and 200 tokens at 10 ms a step: left alone this runs for two seconds.
    let body =
        r#"{"model":"tiny","prompt":"Hello","max_tokens":200,"temperature":0,"stream":true}"#;
    let mut conn = tokio::net::TcpStream::connect(addr).await.unwrap();
    let request = format!(
        "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n\
         Content-Length: {}\r\n\r\n{body}",
        body.len()
    );
    conn.write_all(request.as_bytes()).await.unwrap();
    let mut received = Vec::new();
    let mut buf = [0u8; 4096];
    while !String::from_utf8_lossy(&received).contains("data: {") {
        let n = conn.read(&mut buf).await.unwrap();
        assert!(n > 0, "the server closed before the first chunk");
        received.extend_from_slice(&buf[..n]);
    }
    drop(conn);

    // Wait until the engine goes quiet, then check it stopped well short of max_tokens.
    let mut last = usize::MAX;
    loop {
        tokio::time::sleep(Duration::from_millis(200)).await;
        let now = steps.load(Ordering::Relaxed);
        if now == last {
            break;
        }
        last = now;
    }
    assert!(
        last < 100,
        "the engine ran {last} steps for a client that hung up after the first chunk"
    );
}
