//! Helpers for the cluster's process tests and benchmarks: `strata` processes with their logs,
//! plain HTTP/1.1 calls, SSE streams and Prometheus metrics.
// Each user (tests/cluster_serving.rs, tests/cluster_deploy.rs, tests/serve_process.rs,
// benches/cluster_routing.rs) takes a subset.
#![allow(dead_code)]

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

pub const START: Duration = Duration::from_secs(120);

/// A running strata process, SIGKILLed when dropped; its stderr lines arrive on `log`.
pub struct Process {
    pub child: Child,
    pub log: mpsc::Receiver<String>,
}

impl Process {
    pub fn start(args: &[&str]) -> Self {
        Self::start_with(Command::new(env!("CARGO_BIN_EXE_strata")), args)
    }

    /// [`Process::start`] through `command` (the binary run by a wrapper: another network
    /// namespace, say), with `args` after it.
    pub fn start_with(mut command: Command, args: &[&str]) -> Self {
        let mut child = command
            .args(args)
            .env("RUST_LOG", "info")
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .expect("run strata");
        let (tx, log) = mpsc::channel();
        let stderr = child.stderr.take().unwrap();
        std::thread::spawn(move || {
            for line in BufReader::new(stderr).lines() {
                let Ok(line) = line else { return };
                if tx.send(line).is_err() {
                    return;
                }
            }
        });
        Self { child, log }
    }

    /// The address after `marker` in the first log line containing it.
    pub fn address(&self, marker: &str) -> SocketAddr {
        let deadline = Instant::now() + START;
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            let line = self
                .log
                .recv_timeout(left)
                .unwrap_or_else(|_| panic!("no line with {marker:?} within {START:?}"));
            if let Some(at) = line.find(marker) {
                let rest = &line[at + marker.len()..];
                let addr = rest.split(|c: char| c.is_whitespace() || c == ')').next();
                return addr.unwrap().parse().expect("an address");
            }
        }
    }

    pub fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Drop for Process {
    fn drop(&mut self) {
        self.kill();
    }
}

pub fn strata(args: &[&str]) -> std::process::Output {
    Command::new(env!("CARGO_BIN_EXE_strata"))
        .args(args)
        .output()
        .expect("run strata")
}

/// A tiny Qwen3 with a window of 4096 tokens.
pub fn synth(dir: &Path) {
    synth_sized(dir, 2, 64, 4, 2, 128);
}

/// A Qwen3 of `layers` layers, `hidden` wide, `heads` / `kv_heads` heads and an MLP of
/// `intermediate`, with a window of 4096 tokens.
pub fn synth_sized(
    dir: &Path,
    layers: usize,
    hidden: usize,
    heads: usize,
    kv_heads: usize,
    intermediate: usize,
) {
    let out = strata(&[
        "model",
        "synth",
        "--arch",
        "qwen3",
        "--out",
        dir.to_str().unwrap(),
        "--layers",
        &layers.to_string(),
        "--hidden",
        &hidden.to_string(),
        "--heads",
        &heads.to_string(),
        "--kv-heads",
        &kv_heads.to_string(),
        "--intermediate",
        &intermediate.to_string(),
        "--max-position",
        "4096",
    ]);
    assert!(out.status.success(), "{out:?}");
}

/// A prompt of about 780 tokens of the synthesized model (49 KV blocks of 16), distinct per
/// `topic`: long enough that a few of them fill a 1 MiB KV cache.
pub fn document(topic: usize) -> String {
    (0..40)
        .map(|i| format!("note {topic} {i} holds {}", (i * 7 + topic) % 13))
        .collect::<Vec<_>>()
        .join("; ")
}

/// The raw response (status line, headers, body) of one POST on a fresh connection.
pub fn post_raw(addr: SocketAddr, path: &str, body: &str) -> String {
    send_raw(addr, "POST", path, body)
}

/// The raw response of one `method` request with a JSON `body` on a fresh connection.
pub fn send_raw(addr: SocketAddr, method: &str, path: &str, body: &str) -> String {
    let mut conn = TcpStream::connect(addr).expect("connect");
    conn.set_read_timeout(Some(Duration::from_secs(120)))
        .unwrap();
    let request = format!(
        "{method} {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\
         Content-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    );
    conn.write_all(request.as_bytes()).unwrap();
    let mut raw = String::new();
    conn.read_to_string(&mut raw).unwrap();
    raw
}

/// Status and body of one POST on a fresh connection.
pub fn post(addr: SocketAddr, path: &str, body: &str) -> (u16, String) {
    post_with(addr, "POST", path, body)
}

/// Status and body of one `method` request on a fresh connection.
pub fn post_with(addr: SocketAddr, method: &str, path: &str, body: &str) -> (u16, String) {
    let raw = send_raw(addr, method, path, body);
    let status = raw.split(' ').nth(1).unwrap().parse().unwrap();
    let body = raw
        .split_once("\r\n\r\n")
        .map_or("", |(_, b)| b)
        .to_string();
    (status, body)
}

pub fn get(addr: SocketAddr, path: &str) -> String {
    let mut conn = TcpStream::connect(addr).expect("connect");
    let request = format!("GET {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n");
    conn.write_all(request.as_bytes()).unwrap();
    let mut raw = String::new();
    conn.read_to_string(&mut raw).unwrap();
    raw
}

/// The value of the metric line starting with `name` (labels included; the `model_name` label
/// every `strata_` sample carries left out).
pub fn metric(text: &str, name: &str) -> f64 {
    text.lines()
        .map(without_model_label)
        .find(|l| l.starts_with(name))
        .and_then(|l| l.rsplit(' ').next()?.parse().ok())
        .unwrap_or_else(|| panic!("no metric {name} in\n{text}"))
}

/// `line` without its `model_name="…"` label.
pub fn without_model_label(line: &str) -> String {
    const LABEL: &str = "model_name=\"";
    let Some(at) = line.find(LABEL) else {
        return line.to_string();
    };
    let (before, rest) = (&line[..at], &line[at + LABEL.len()..]);
    let after = rest.split_once('"').map_or("", |(_, after)| after);
    match (before.strip_suffix('{'), after.strip_prefix('}')) {
        (Some(name), Some(value)) => format!("{name}{value}"),
        _ => format!("{before}{}", after.strip_prefix(',').unwrap_or(after)),
    }
}

/// Greedy unless `seed` is given: then sampled at temperature 0.9 with penalties.
pub fn completion_body(prompt: &str, max_tokens: u32, stream: bool, seed: Option<u64>) -> String {
    let mut body = serde_json::json!({
        "model": "m", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
        "ignore_eos": true, "stream": stream,
    });
    if let Some(seed) = seed {
        body["temperature"] = 0.9.into();
        body["seed"] = seed.into();
        body["presence_penalty"] = 0.3.into();
        body["frequency_penalty"] = 0.2.into();
    }
    body.to_string()
}

/// The text of a non-streamed completion (greedy).
pub fn complete(addr: SocketAddr, prompt: &str, max_tokens: u32) -> String {
    complete_with(addr, prompt, max_tokens, None)
}

pub fn complete_with(addr: SocketAddr, prompt: &str, max_tokens: u32, seed: Option<u64>) -> String {
    let body = completion_body(prompt, max_tokens, false, seed);
    let (status, body) = post(addr, "/v1/completions", &body);
    assert_eq!(status, 200, "{body}");
    let v: serde_json::Value = serde_json::from_str(&body).unwrap();
    v["choices"][0]["text"].as_str().unwrap().to_string()
}

/// An HTTP/1.1 chunked body's payload.
pub fn dechunk(body: &str) -> String {
    let mut out = String::new();
    let mut rest = body;
    while let Some((size, tail)) = rest.split_once("\r\n") {
        let size = usize::from_str_radix(size.trim(), 16).expect("a chunk size");
        if size == 0 {
            break;
        }
        out.push_str(&tail[..size]);
        rest = &tail[size + 2..];
    }
    out
}

/// The text of a streamed completion (a chunked body), its chunks joined; panics on an error
/// event.
pub fn stream_text(body: &str) -> String {
    let body = dechunk(body);
    let mut text = String::new();
    for line in body.lines() {
        let Some(data) = line.strip_prefix("data: ") else {
            continue;
        };
        if data == "[DONE]" {
            return text;
        }
        let v: serde_json::Value = serde_json::from_str(data).unwrap();
        assert!(v.get("error").is_none(), "error in stream: {data}");
        text.push_str(v["choices"][0]["text"].as_str().unwrap_or(""));
    }
    panic!("stream ended without [DONE]: {body}");
}

/// A streamed completion as a client saw it.
pub struct Timed {
    /// From sending the request to the first chunk carrying text.
    pub ttft: Duration,
    pub text: String,
    /// The usage chunk's `prompt_tokens` and `prompt_tokens_details.cached_tokens`, when the
    /// request asked for it (`stream_options.include_usage`).
    pub prompt_tokens: Option<(u64, u64)>,
}

/// The `(prompt_tokens, cached_tokens)` of a streamed body's usage chunk.
fn stream_usage(body: &str) -> Option<(u64, u64)> {
    dechunk(body).lines().find_map(|line| {
        let v: serde_json::Value = serde_json::from_str(line.strip_prefix("data: ")?).ok()?;
        let usage = v.get("usage").filter(|u| !u.is_null())?;
        Some((
            usage["prompt_tokens"].as_u64()?,
            usage["prompt_tokens_details"]["cached_tokens"].as_u64()?,
        ))
    })
}

/// POSTs a streamed completion `body` and reads it to the end.
pub fn stream_timed(addr: SocketAddr, body: &str) -> Timed {
    let mut conn = TcpStream::connect(addr).expect("connect");
    conn.set_read_timeout(Some(Duration::from_secs(600)))
        .unwrap();
    let request = format!(
        "POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\
         Content-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    );
    let sent = Instant::now();
    conn.write_all(request.as_bytes()).unwrap();
    let mut raw = Vec::new();
    let mut buf = [0u8; 4096];
    let mut first = None;
    loop {
        let n = conn.read(&mut buf).unwrap();
        if n == 0 {
            break;
        }
        raw.extend_from_slice(&buf[..n]);
        if first.is_none() && String::from_utf8_lossy(&raw).contains("\"text\"") {
            first = Some(sent.elapsed());
        }
    }
    let raw = String::from_utf8(raw).unwrap();
    let body = raw.split_once("\r\n\r\n").unwrap().1;
    Timed {
        ttft: first.expect("a chunk with text"),
        text: stream_text(body),
        prompt_tokens: stream_usage(body),
    }
}

/// One cluster at a time: each test runs several processes, and a 2-core machine running them all
/// at once starves the raft members' heartbeats.
pub fn serial() -> std::sync::MutexGuard<'static, ()> {
    static SERIAL: std::sync::Mutex<()> = std::sync::Mutex::new(());
    SERIAL
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// A base port `b` with `b .. b + count` free on 127.0.0.1 for both UDP and TCP right now and
/// outside the system's ephemeral range, so no socket bound to port 0 afterwards (a CLI's QUIC
/// dial endpoint, an outbound TCP connection, another test's probe) can take one before the
/// process meant to listen there binds it. Calls within one test binary never overlap.
pub fn free_ports(count: u16) -> u16 {
    use std::sync::atomic::{AtomicU32, Ordering};
    let (low, high) = std::fs::read_to_string("/proc/sys/net/ipv4/ip_local_port_range")
        .ok()
        .and_then(|t| {
            let mut it = t.split_whitespace().map(|v| v.parse::<u32>().ok());
            Some((it.next()??, it.next()??))
        })
        .unwrap_or((32_768, 60_999));
    // The span below the ephemeral range when it is wide enough, else the one above it.
    let (start, end) = if low >= 12_000 {
        (10_000, low)
    } else {
        (high + 1, 65_536)
    };
    static NEXT: AtomicU32 = AtomicU32::new(u32::MAX);
    let span = end - start - u32::from(count);
    // Successive test binaries start at different places (a port a previous one used may still
    // be held by a process that is going down).
    let _ = NEXT.compare_exchange(
        u32::MAX,
        std::process::id().wrapping_mul(7_919) % span,
        Ordering::SeqCst,
        Ordering::SeqCst,
    );
    let free = |port: u32| {
        let addr = format!("127.0.0.1:{port}");
        std::net::UdpSocket::bind(&addr).is_ok() && std::net::TcpListener::bind(&addr).is_ok()
    };
    for _ in 0..1_000 {
        let offset = NEXT.fetch_add(u32::from(count), Ordering::SeqCst) % span;
        let base = start + offset;
        if (base..base + u32::from(count)).all(free) {
            return base as u16;
        }
    }
    panic!("no {count} consecutive free ports in {start}..{end}");
}

/// `deploy/local/up.sh` in `dir` (members, nodes beside them, one router), stopped by `down.sh`
/// when the returned guard drops; the base port it used.
pub fn deploy_local(dir: &Path, model: &Path, nodes: usize) -> (impl Drop, u16) {
    deploy_local_with(dir, model, (nodes, 1), "", "")
}

/// [`deploy_local`] with `routers` routers (HTTP ports base + 101, base + 102, ...) started with
/// `router_args` (up.sh's `--router-args`), and `init_args` for member 1's `cluster init`.
pub fn deploy_local_with(
    dir: &Path,
    model: &Path,
    (nodes, routers): (usize, usize),
    router_args: &str,
    init_args: &str,
) -> (impl Drop, u16) {
    deploy_local_env(dir, model, (nodes, routers), (router_args, init_args), &[])
}

/// [`deploy_local_with`] with `env` set for every process of the cluster.
pub fn deploy_local_env(
    dir: &Path,
    model: &Path,
    (nodes, routers): (usize, usize),
    (router_args, init_args): (&str, &str),
    env: &[(&str, &str)],
) -> (impl Drop, u16) {
    // up.sh's ports: members, joins and nodes at base + 10i (+1, +2), routers at base + 101..
    let base = free_ports(101 + routers as u16);
    let up = std::process::Command::new(
        Path::new(env!("CARGO_MANIFEST_DIR")).join("deploy/local/up.sh"),
    )
    .args([
        "--nodes",
        &nodes.to_string(),
        "--routers",
        &routers.to_string(),
    ])
    .args(["--router-args", router_args])
    .args(["--init-args", init_args])
    .args(["--model", model.to_str().unwrap()])
    .args([
        "--dir",
        dir.to_str().unwrap(),
        "--base-port",
        &base.to_string(),
    ])
    .env("STRATA", env!("CARGO_BIN_EXE_strata"))
    .envs(env.iter().copied())
    .output()
    .unwrap();
    struct Down(std::path::PathBuf);
    impl Drop for Down {
        fn drop(&mut self) {
            let _ = std::process::Command::new(
                Path::new(env!("CARGO_MANIFEST_DIR")).join("deploy/local/down.sh"),
            )
            .args(["--dir", self.0.to_str().unwrap()])
            .output();
        }
    }
    let down = Down(dir.to_path_buf());
    assert!(
        up.status.success(),
        "{}{}",
        String::from_utf8_lossy(&up.stdout),
        String::from_utf8_lossy(&up.stderr)
    );
    (down, base)
}

/// Streams the completion `body` through `addr` on a thread: sends on `started` at its first
/// text, counts itself in `finished` when it ends, and returns the streamed text.
pub fn spawn_stream(
    addr: SocketAddr,
    body: String,
    started: mpsc::Sender<()>,
    finished: std::sync::Arc<std::sync::atomic::AtomicUsize>,
) -> std::thread::JoinHandle<String> {
    std::thread::spawn(move || {
        let mut conn = TcpStream::connect(addr).expect("connect");
        conn.set_read_timeout(Some(Duration::from_secs(300)))
            .unwrap();
        let request = format!(
            "POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\
             Content-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
            body.len()
        );
        conn.write_all(request.as_bytes()).unwrap();
        let (mut raw, mut buf, mut signalled) = (Vec::new(), [0u8; 4096], false);
        loop {
            let n = conn.read(&mut buf).unwrap();
            if n == 0 {
                break;
            }
            raw.extend_from_slice(&buf[..n]);
            if !signalled && String::from_utf8_lossy(&raw).contains("\"text\"") {
                signalled = true;
                let _ = started.send(());
            }
        }
        finished.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let raw = String::from_utf8(raw).unwrap();
        stream_text(raw.split_once("\r\n\r\n").unwrap().1)
    })
}

/// Runs `count` long completions (odd ones sampled with seed `seed_base + i`) as streams through
/// `router`, calls `fault` once every stream has its first text, and returns per stream whether
/// it ended with the text `reference` (a fault-free `strata serve`) gives for it.
pub fn streams_across_a_fault(
    router: SocketAddr,
    reference: SocketAddr,
    (tag, count, seed_base): (&str, usize, u64),
    fault: impl FnOnce(),
) -> Vec<bool> {
    const TOKENS: u32 = 600;
    let prompts: Vec<String> = (0..count)
        .map(|i| format!("{tag} {i}: {}", "tell a long story. ".repeat(1 + i % 5)))
        .collect();
    let seed = |i: usize| (i % 2 == 1).then_some(seed_base + i as u64);
    let want: Vec<String> = prompts
        .iter()
        .enumerate()
        .map(|(i, p)| complete_with(reference, p, TOKENS, seed(i)))
        .collect();
    let (started_tx, started) = mpsc::channel();
    let handles: Vec<_> = prompts
        .iter()
        .enumerate()
        .map(|(i, prompt)| {
            let body = completion_body(prompt, TOKENS, true, seed(i));
            spawn_stream(router, body, started_tx.clone(), Default::default())
        })
        .collect();
    for _ in 0..prompts.len() {
        started.recv_timeout(START).expect("every stream starts");
    }
    fault();
    handles
        .into_iter()
        .zip(&want)
        .map(|(h, want)| h.join().ok().is_some_and(|got| &got == want))
        .collect()
}
