//! `strata serve` as a process on 127.0.0.1: the config file (unknown keys refused, settings
//! applied, flags winning), keys revoked while it runs, and SIGTERM draining a stream before a
//! clean exit.

mod cluster;

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::process::{Command, Output};
use std::time::{Duration, Instant};

use cluster::{Process, document, metric, synth, without_model_label};

fn strata(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_strata"))
        .args(args)
        .output()
        .expect("run strata")
}

fn success(o: &Output) -> String {
    assert!(
        o.status.success(),
        "strata failed: {}",
        String::from_utf8_lossy(&o.stderr)
    );
    String::from_utf8(o.stdout.clone()).unwrap()
}

/// A running `strata serve`, killed when dropped.
struct Server {
    process: Process,
    addr: SocketAddr,
    seen: Vec<String>,
}

impl Server {
    /// Starts `strata serve ARGS` and waits for the address it announces.
    fn start(args: &[&str]) -> Self {
        let serve: Vec<&str> = std::iter::once("serve")
            .chain(args.iter().copied())
            .collect();
        let mut server = Self {
            process: Process::start(&serve),
            addr: SocketAddr::from(([0, 0, 0, 0], 0)),
            seen: Vec::new(),
        };
        let line = server.wait_for_log("serving `", Duration::from_secs(120));
        let at = line.find("on http://").expect("an address") + "on http://".len();
        let addr = line[at..].split_whitespace().next().unwrap();
        server.addr = addr.parse().unwrap();
        server
    }

    /// The first log line (from now on) containing `needle`.
    fn wait_for_log(&mut self, needle: &str, limit: Duration) -> String {
        let deadline = Instant::now() + limit;
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            match self.process.log.recv_timeout(left) {
                Ok(line) => {
                    self.seen.push(line.clone());
                    if line.contains(needle) {
                        return line;
                    }
                }
                Err(_) => panic!(
                    "no log line with {needle:?} within {limit:?}; the log:\n{}",
                    self.seen.join("\n")
                ),
            }
        }
    }

    fn signal(&self, name: &str) {
        let status = Command::new("kill")
            .args([&format!("-{name}"), &self.process.child.id().to_string()])
            .status()
            .expect("run kill");
        assert!(status.success());
    }

    /// Waits for the process to exit on its own.
    fn wait(&mut self, limit: Duration) -> std::process::ExitStatus {
        let deadline = Instant::now() + limit;
        loop {
            if let Some(status) = self.process.child.try_wait().unwrap() {
                return status;
            }
            assert!(Instant::now() < deadline, "still running after {limit:?}");
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

/// Status, head and body of one request on a fresh connection (bodies read to the close).
fn http(
    addr: SocketAddr,
    method: &str,
    path: &str,
    key: Option<&str>,
    body: &str,
) -> (u16, String) {
    let mut conn = TcpStream::connect(addr).expect("connect");
    conn.set_read_timeout(Some(Duration::from_secs(30)))
        .unwrap();
    conn.write_all(request(method, path, key, body).as_bytes())
        .unwrap();
    let mut raw = String::new();
    conn.read_to_string(&mut raw).unwrap();
    let status = raw.split(' ').nth(1).unwrap().parse().unwrap();
    (status, raw)
}

fn request(method: &str, path: &str, key: Option<&str>, body: &str) -> String {
    let auth = key.map_or(String::new(), |k| format!("Authorization: Bearer {k}\r\n"));
    format!(
        "{method} {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n{auth}\
         Content-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    )
}

#[test]
fn a_config_file_with_an_unknown_key_is_refused_by_name() {
    let tmp = tempfile::tempdir().unwrap();
    let config = tmp.path().join("serve.toml");
    std::fs::write(&config, "port = 0\nmax_inflights = 4\n").unwrap();
    let o = strata(&["serve", "--config", config.to_str().unwrap()]);
    assert!(!o.status.success());
    let stderr = String::from_utf8_lossy(&o.stderr);
    assert!(
        stderr.contains("max_inflights") && stderr.contains("serve.toml"),
        "{stderr}"
    );
}

#[test]
fn a_config_file_sets_serve_and_flags_win_over_it() {
    let tmp = tempfile::tempdir().unwrap();
    synth(&tmp.path().join("m"));
    let config = tmp.path().join("serve.toml");
    // Relative paths are the file's; port 1 would fail to bind unless --port wins.
    std::fs::write(
        &config,
        "model = \"m\"\nhost = \"127.0.0.1\"\nport = 1\nkv_cache_mib = 8\nblock_size = 16\n\
         cache_dir = \"cache\"\nkeys_file = \"keys.json\"\nmax_inflight = 2\nmax_queued = 2\n\
         max_body_bytes = 1000\n",
    )
    .unwrap();
    let server = Server::start(&["--config", config.to_str().unwrap(), "--port", "0"]);
    let (status, raw) = http(server.addr, "GET", "/health", None, "");
    assert_eq!(status, 200, "{raw}");
    assert!(raw.to_ascii_lowercase().contains("x-request-id: "), "{raw}");
    let (status, raw) = http(server.addr, "GET", "/v1/models", None, "");
    assert_eq!(status, 200, "{raw}");
    assert!(
        raw.contains("\"id\":\"m\""),
        "the file's model is served: {raw}"
    );
    // max_body_bytes from the file.
    let big = format!(r#"{{"model":"m","prompt":"{}"}}"#, "a".repeat(2000));
    let (status, raw) = http(server.addr, "POST", "/v1/completions", None, &big);
    assert_eq!(status, 413, "{raw}");
}

#[test]
fn a_revoked_key_is_refused_within_seconds_without_a_restart() {
    let tmp = tempfile::tempdir().unwrap();
    let model = tmp.path().join("m");
    synth(&model);
    let keys_file = tmp.path().join("keys.json");
    let keys = |args: &[&str]| {
        let mut all = vec!["keys"];
        all.extend_from_slice(args);
        all.extend_from_slice(&["--keys-file", keys_file.to_str().unwrap()]);
        success(&strata(&all))
    };
    let key = keys(&["add", "--tenant", "acme"]).trim().to_string();
    let id = key["sk-strata-".len()..][..8].to_string();
    let server = Server::start(&[
        "--model",
        model.to_str().unwrap(),
        "--port",
        "0",
        "--keys-file",
        keys_file.to_str().unwrap(),
    ]);
    let models = |key: &str| http(server.addr, "GET", "/v1/models", Some(key), "").0;
    assert_eq!(models(&key), 200);

    keys(&["revoke", &id]);
    let revoked_at = Instant::now();
    while models(&key) != 401 {
        assert!(
            revoked_at.elapsed() < Duration::from_secs(5),
            "the revoked key still works after 5 s"
        );
        std::thread::sleep(Duration::from_millis(100));
    }

    // The last key gone: the server refuses everyone rather than opening; a new key works.
    let (status, _) = http(server.addr, "GET", "/v1/models", None, "");
    assert_eq!(status, 401);
    let fresh = keys(&["add", "--tenant", "acme"]).trim().to_string();
    let added_at = Instant::now();
    while models(&fresh) != 200 {
        assert!(
            added_at.elapsed() < Duration::from_secs(5),
            "a new key is not accepted after 5 s"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
}

#[test]
fn sigterm_finishes_the_stream_in_flight_then_exits_cleanly() {
    let tmp = tempfile::tempdir().unwrap();
    let model = tmp.path().join("m");
    synth(&model);
    let mut server = Server::start(&[
        "--model",
        model.to_str().unwrap(),
        "--port",
        "0",
        "--keys-file",
        tmp.path().join("keys.json").to_str().unwrap(),
        "--drain-delay-s",
        "2",
    ]);
    let addr = server.addr;

    // A long greedy stream that cannot end early: the end-of-sequence ids are biased away.
    let max_tokens = 3000;
    let body = serde_json::json!({
        "model": "m", "prompt": "hello", "max_tokens": max_tokens, "temperature": 0,
        "stream": true, "stream_options": {"include_usage": true},
        "logit_bias": {"257": -100, "259": -100},
    })
    .to_string();
    let mut stream = TcpStream::connect(addr).unwrap();
    stream
        .set_read_timeout(Some(Duration::from_secs(60)))
        .unwrap();
    stream
        .write_all(request("POST", "/v1/completions", None, &body).as_bytes())
        .unwrap();
    let mut received = Vec::new();
    let mut buf = [0u8; 4096];
    while !String::from_utf8_lossy(&received).contains("data: {") {
        let n = stream.read(&mut buf).unwrap();
        assert!(n > 0, "closed before the first chunk");
        received.extend_from_slice(&buf[..n]);
    }

    server.signal("TERM");
    server.wait_for_log("SIGTERM", Duration::from_secs(10));
    // First the drain: still accepting, but no longer ready.
    let (status, ready) = http(addr, "GET", "/ready", None, "");
    assert_eq!(status, 503, "{ready}");
    assert!(ready.contains("draining"), "{ready}");
    // Then new connections are refused, while the stream goes on.
    let refused_at = Instant::now();
    while TcpStream::connect_timeout(&addr, Duration::from_millis(200)).is_ok() {
        assert!(
            refused_at.elapsed() < Duration::from_secs(5),
            "still accepting connections 5 s after SIGTERM"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    let before_refusal = received.len();
    stream.read_to_end(&mut received).unwrap();
    let text = String::from_utf8_lossy(&received);
    assert!(
        received.len() > before_refusal,
        "the stream had already ended before the drain began: make it longer"
    );
    assert!(text.contains("data: [DONE]"), "the stream was cut: {text}");
    let usage = text
        .split("data: ")
        .filter_map(|d| serde_json::from_str::<serde_json::Value>(d.lines().next()?).ok())
        .find_map(|chunk| chunk["usage"]["completion_tokens"].as_u64());
    assert_eq!(usage, Some(max_tokens), "{text}");

    let status = server.wait(Duration::from_secs(30));
    assert!(status.success(), "exit status {status}");
    assert!(TcpStream::connect_timeout(&addr, Duration::from_millis(200)).is_err());
}

#[test]
fn serve_tp_ranks_answer_like_one_rank_and_a_bad_degree_is_refused() {
    let tmp = tempfile::tempdir().unwrap();
    let model = tmp.path().join("m");
    synth(&model);
    let model = model.to_str().unwrap();
    let body = r#"{"model":"m","prompt":"tensor parallel ranks","max_tokens":24,"temperature":0,"ignore_eos":true,"logprobs":2}"#;
    let answer = |tp: &str| {
        let server = Server::start(&["--model", model, "--port", "0", "--tp", tp]);
        let (status, raw) = http(server.addr, "POST", "/v1/completions", None, body);
        assert_eq!(status, 200, "--tp {tp}: {raw}");
        let json = raw.split_once("\r\n\r\n").unwrap().1;
        let v: serde_json::Value = serde_json::from_str(json).unwrap();
        (
            v["choices"][0]["text"].clone(),
            v["choices"][0]["logprobs"].clone(),
        )
    };
    let one = answer("1");
    assert!(one.0.as_str().is_some_and(|t| !t.is_empty()), "{one:?}");
    for tp in ["2", "4"] {
        assert_eq!(answer(tp), one, "--tp {tp} differs from one rank");
    }
    // 4 heads cannot split over 3 ranks: refused by name, before serving.
    let o = strata(&["serve", "--model", model, "--port", "0", "--tp", "3"]);
    assert!(!o.status.success());
    let stderr = String::from_utf8_lossy(&o.stderr);
    assert!(stderr.contains("--tp 3"), "{stderr}");
}

/// The README's main command and its curl: `strata serve` with no `--model` serves the default
/// model (here from the test data's copy, so the test needs no network beyond the fetch script),
/// and the README's own request body gets an answer naming Paris.
#[test]
fn the_readme_request_to_the_default_model_answers_paris() {
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR"));
    let readme = std::fs::read_to_string(root.join("README.md")).unwrap();
    let curl = readme
        .find("curl -s http://127.0.0.1:8080/v1/chat/completions")
        .expect("the README shows a chat completion curl");
    let body_at = curl + readme[curl..].find("-d '").expect("a -d body") + 4;
    let body = &readme[body_at..body_at + readme[body_at..].find('\'').unwrap()];
    assert!(body.contains("capital of France"), "{body}");

    let cache = root.join("target/test-data");
    assert!(
        cache
            .join("models/SmolLM2-135M-Instruct.Q4_1.gguf")
            .is_file(),
        "missing the default model: run scripts/fetch-test-data.sh from the repository root"
    );
    let tmp = tempfile::tempdir().unwrap();
    let keys = tmp.path().join("keys.json");
    let server = Server::start(&[
        "--cache-dir",
        cache.to_str().unwrap(),
        "--keys-file",
        keys.to_str().unwrap(),
        "--port",
        "0",
    ]);
    let (status, raw) = http(server.addr, "POST", "/v1/chat/completions", None, body);
    assert_eq!(status, 200, "{raw}");
    let json: serde_json::Value =
        serde_json::from_str(raw.split("\r\n\r\n").nth(1).unwrap()).unwrap();
    let answer = json["choices"][0]["message"]["content"].as_str().unwrap();
    assert!(answer.contains("Paris"), "the answer: {answer:?}");

    // Anthropic's prefill: a final assistant turn is continued, not answered anew.
    let prefill = r#"{"model": "SmolLM2-135M-Instruct", "max_tokens": 12, "temperature": 0,
        "messages": [{"role": "user", "content": "What is the capital of France?"},
                     {"role": "assistant", "content": "The capital of France is"}]}"#;
    let (status, raw) = http(server.addr, "POST", "/v1/messages", None, prefill);
    assert_eq!(status, 200, "{raw}");
    let json: serde_json::Value =
        serde_json::from_str(raw.split("\r\n\r\n").nth(1).unwrap()).unwrap();
    let continued = json["content"][0]["text"].as_str().unwrap();
    assert!(
        continued.contains("Paris") && !continued.contains("capital"),
        "the continuation: {continued:?}"
    );

    // A tool conversation as OpenAI's SDKs send it back (the call's turn has `content: null`)
    // through this model's own template, which concatenates content.
    let tools = r#"{"model": "SmolLM2-135M-Instruct", "max_tokens": 4, "messages": [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": null, "tool_calls": [{"id": "call_1", "type": "function",
            "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]}"#;
    let (status, raw) = http(server.addr, "POST", "/v1/chat/completions", None, tools);
    assert_eq!(status, 200, "{raw}");

    // A required tool call at temperature 0 with room to spare ends on its own: the model's
    // next token after a call is a newline, which the forced grammar once allowed only before
    // another call (nine identical calls, then `length` at 300 tokens). Now the output may end
    // after it (SmolLM2 writes its call twice, then ends). Anthropic's `any` likewise.
    let weather = r#"[{"type": "function", "function": {"name": "get_weather", "parameters":
        {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]"#;
    let forced = format!(
        r#"{{"model": "SmolLM2-135M-Instruct", "max_tokens": 300, "temperature": 0,
            "tool_choice": "required", "tools": {weather},
            "messages": [{{"role": "user", "content": "What is the weather in Paris?"}}]}}"#
    );
    let (status, raw) = http(server.addr, "POST", "/v1/chat/completions", None, &forced);
    assert_eq!(status, 200, "{raw}");
    let json: serde_json::Value =
        serde_json::from_str(raw.split("\r\n\r\n").nth(1).unwrap()).unwrap();
    let choice = &json["choices"][0];
    assert_eq!(choice["finish_reason"], "tool_calls", "{json}");
    assert!(
        json["usage"]["completion_tokens"].as_u64().unwrap() < 100,
        "{json}"
    );
    let calls = choice["message"]["tool_calls"].as_array().unwrap();
    assert!((1..=2).contains(&calls.len()), "{json}");
    assert!(
        calls.iter().all(|c| c["function"]["name"] == "get_weather"),
        "{json}"
    );
    let any = r#"{"model": "SmolLM2-135M-Instruct", "max_tokens": 300, "temperature": 0,
        "tool_choice": {"type": "any"}, "tools": [{"name": "get_weather", "input_schema":
        {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}],
        "messages": [{"role": "user", "content": "What is the weather in Paris?"}]}"#;
    let (status, raw) = http(server.addr, "POST", "/v1/messages", None, any);
    assert_eq!(status, 200, "{raw}");
    let json: serde_json::Value =
        serde_json::from_str(raw.split("\r\n\r\n").nth(1).unwrap()).unwrap();
    assert_eq!(json["stop_reason"], "tool_use", "{json}");
    assert!(
        json["usage"]["output_tokens"].as_u64().unwrap() < 100,
        "{json}"
    );
    let uses = json["content"].as_array().unwrap().iter();
    assert!(
        (1..=2).contains(&uses.filter(|b| b["type"] == "tool_use").count()),
        "{json}"
    );
}

/// Startup failures say each cause once, and the port is taken before the model loads: with the
/// port already in use, a checkpoint that cannot load is never reached (the error names the
/// port, not the checkpoint); on a free port the checkpoint's one problem is named once.
#[test]
fn startup_errors_name_the_port_before_the_model_and_each_cause_once() {
    let tmp = tempfile::tempdir().unwrap();
    let model = tmp.path().join("m");
    synth(&model);
    let config = model.join("config.json");
    let mut c: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&config).unwrap()).unwrap();
    c["mlp_bias"] = true.into();
    std::fs::write(&config, c.to_string()).unwrap();

    let taken = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = taken.local_addr().unwrap().port().to_string();
    let m = model.to_str().unwrap();
    let o = strata(&["serve", "--model", m, "--port", &port]);
    assert!(!o.status.success());
    let stderr = String::from_utf8_lossy(&o.stderr);
    assert!(stderr.contains("cannot listen on"), "{stderr}");
    assert!(
        !stderr.contains("mlp_bias"),
        "the model loaded first: {stderr}"
    );
    let in_use = stderr.matches("in use").count();
    assert_eq!(in_use, 1, "the cause said {in_use} times: {stderr}");

    let o = strata(&["serve", "--model", m, "--port", "0"]);
    assert!(!o.status.success());
    let stderr = String::from_utf8_lossy(&o.stderr);
    let said = stderr.matches("mlp_bias = true is not supported").count();
    assert_eq!(said, 1, "the cause said {said} times: {stderr}");
}

/// A raw request with extra header lines (each ending in CRLF), answered whole.
fn http_with(addr: SocketAddr, method: &str, path: &str, headers: &str, body: &str) -> String {
    let mut conn = TcpStream::connect(addr).expect("connect");
    conn.set_read_timeout(Some(Duration::from_secs(30)))
        .unwrap();
    let request = format!(
        "{method} {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n{headers}\
         Content-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    );
    conn.write_all(request.as_bytes()).unwrap();
    let mut raw = String::new();
    conn.read_to_string(&mut raw).unwrap();
    raw
}

fn json_body(raw: &str) -> serde_json::Value {
    let body = raw.split_once("\r\n\r\n").map_or("", |(_, b)| b);
    serde_json::from_str(body).unwrap_or_else(|e| panic!("not JSON ({e}): {raw}"))
}

/// vLLM's serving flags reach the server, from the config file and from the command line:
/// served names, a smaller window, a template file, the server's own key, CORS origins.
#[test]
fn vllm_serving_flags_and_their_config_keys_apply() {
    let tmp = tempfile::tempdir().unwrap();
    synth(&tmp.path().join("m"));
    let template = "{% for m in messages %}<{{ m.content }}>{% endfor %}";
    std::fs::write(tmp.path().join("t.jinja"), template).unwrap();
    let config = tmp.path().join("serve.toml");
    std::fs::write(
        &config,
        "model = \"m\"\nkeys_file = \"keys.json\"\nserved_model_name = [\"served\", \"alias\"]\n\
         api_key = \"sk-from-the-file\"\nchat_template = \"t.jinja\"\n",
    )
    .unwrap();
    let server = Server::start(&[
        "--config",
        config.to_str().unwrap(),
        "--port",
        "0",
        "--max-model-len",
        "100",
        "--allowed-origins",
        "https://app.example",
    ]);
    let key = Some("sk-from-the-file");
    assert_eq!(http(server.addr, "GET", "/health", None, "").0, 200);
    assert_eq!(http(server.addr, "GET", "/v1/models", None, "").0, 401);
    let (status, raw) = http(server.addr, "GET", "/v1/models", key, "");
    assert_eq!(status, 200, "{raw}");
    let models = json_body(&raw);
    assert_eq!(models["data"][0]["id"], "served", "{raw}");
    assert_eq!(models["data"][0]["max_model_len"], 100, "{raw}");

    // The alias is accepted and the template file renders the prompt.
    let tokenize = r#"{"model":"alias","messages":[{"role":"user","content":"hi"}]}"#;
    let (status, raw) = http(server.addr, "POST", "/tokenize", key, tokenize);
    assert_eq!(status, 200, "{raw}");
    let tokens = json_body(&raw)["tokens"].clone();
    let detokenize = serde_json::json!({ "tokens": tokens }).to_string();
    let (_, raw) = http(server.addr, "POST", "/detokenize", key, &detokenize);
    assert_eq!(json_body(&raw)["prompt"], "<hi>", "{raw}");
    let chat = r#"{"model":"alias","messages":[{"role":"user","content":"hi"}],"max_tokens":2}"#;
    let (status, raw) = http(server.addr, "POST", "/v1/chat/completions", key, chat);
    assert_eq!(status, 200, "{raw}");
    assert_eq!(json_body(&raw)["model"], "served", "{raw}");
    let over = r#"{"model":"served","prompt":"hello","max_tokens":200}"#;
    let (status, raw) = http(server.addr, "POST", "/v1/completions", key, over);
    assert_eq!(status, 400, "{raw}");
    assert_eq!(json_body(&raw)["error"]["code"], "context_length_exceeded");

    // A browser's preflight, without the key, is answered for the listed origin only.
    let preflight = |origin: &str| {
        let headers = format!(
            "Origin: {origin}\r\nAccess-Control-Request-Method: POST\r\n\
             Access-Control-Request-Headers: authorization\r\n"
        );
        http_with(server.addr, "OPTIONS", "/v1/chat/completions", &headers, "").to_ascii_lowercase()
    };
    let listed = preflight("https://app.example");
    assert!(listed.starts_with("http/1.1 200"), "{listed}");
    assert!(
        listed.contains("access-control-allow-origin: https://app.example"),
        "{listed}"
    );
    let other = preflight("https://elsewhere.example");
    assert!(!other.contains("access-control-allow-origin"), "{other}");
}

/// A serving option the model cannot take stops the start with the flag named: a window of 0
/// or above the model's (4096), a template file missing or broken, an origin that is not one,
/// an empty key; `strata router` checks the window before it dials anything.
#[test]
fn bad_serving_options_stop_the_start_and_name_the_flag() {
    let tmp = tempfile::tempdir().unwrap();
    let model = tmp.path().join("m");
    synth(&model);
    let m = model.to_str().unwrap();
    let broken = tmp.path().join("broken.jinja");
    std::fs::write(&broken, "{% for m in messages %}never closed").unwrap();
    let missing = tmp.path().join("missing.jinja");
    let keys = tmp.path().join("keys.json");
    let serve = |extra: &[&str]| {
        let mut args = vec!["serve", "--model", m, "--port", "0"];
        args.extend_from_slice(&["--keys-file", keys.to_str().unwrap()]);
        args.extend_from_slice(extra);
        strata(&args)
    };
    for (extra, needles) in [
        (
            vec!["--max-model-len", "0"],
            vec!["--max-model-len must be at least 1"],
        ),
        (
            vec!["--max-model-len", "5000"],
            vec!["--max-model-len 5000", "4096"],
        ),
        (
            vec!["--chat-template", missing.to_str().unwrap()],
            vec!["--chat-template", "missing.jinja"],
        ),
        (
            vec!["--chat-template", broken.to_str().unwrap()],
            vec!["broken.jinja", "does not compile"],
        ),
        (
            vec!["--allowed-origins", "app.example"],
            vec!["--allowed-origins", "app.example"],
        ),
        (vec!["--api-key", ""], vec!["--api-key"]),
    ] {
        let o = serve(&extra);
        let stderr = String::from_utf8_lossy(&o.stderr);
        assert!(!o.status.success(), "{extra:?} was accepted: {stderr}");
        for needle in needles {
            assert!(
                stderr.contains(needle),
                "{extra:?}: no {needle:?} in {stderr}"
            );
        }
    }
    let o = strata(&[
        "router",
        "--model",
        m,
        "--nodes",
        "127.0.0.1:9",
        "--identity",
        tmp.path().join("no-identity").to_str().unwrap(),
        "--max-model-len",
        "5000",
    ]);
    let stderr = String::from_utf8_lossy(&o.stderr);
    assert!(!o.status.success());
    assert!(stderr.contains("--max-model-len 5000"), "{stderr}");
}

/// The KV tiers from the command line: with a 1 MiB device cache, a 1 MiB host tier and a disk
/// tier, other traffic pushes a long prompt's KV down to disk; the server is SIGKILLed and
/// started again with the same flags, and the same prompt is answered from the blocks the disk
/// kept (reported as cached tokens) with the text it got cold.
#[test]
fn a_prompt_parked_on_disk_survives_a_sigkilled_server() {
    let tmp = tempfile::tempdir().unwrap();
    let model = tmp.path().join("m");
    synth(&model);
    let disk = tmp.path().join("kv");
    let args = [
        "--model",
        model.to_str().unwrap(),
        "--port",
        "0",
        "--kv-cache-mib",
        "1",
        "--kv-host-mib",
        "1",
        "--kv-disk-dir",
        disk.to_str().unwrap(),
        "--kv-disk-mib",
        "64",
    ];
    let ask = |addr: SocketAddr, prompt: &str| {
        let body = serde_json::json!({
            "model": "m", "prompt": prompt, "max_tokens": 8, "temperature": 0, "ignore_eos": true,
        });
        let (status, raw) = http(addr, "POST", "/v1/completions", None, &body.to_string());
        assert_eq!(status, 200, "{raw}");
        let v = json_body(&raw);
        let usage = &v["usage"];
        (
            v["choices"][0]["text"].as_str().unwrap().to_string(),
            usage["prompt_tokens"].as_u64().unwrap(),
            usage["prompt_tokens_details"]["cached_tokens"]
                .as_u64()
                .unwrap_or(0),
        )
    };
    let mut first = Server::start(&args);
    let (text, prompt_tokens, cached) = ask(first.addr, &document(0));
    assert_eq!(cached, 0);
    assert!(prompt_tokens > 600, "a long prompt: {prompt_tokens} tokens");
    // 1 MiB holds 128 blocks of this model on each of device and host: other documents push
    // the first one's blocks through host to disk.
    for topic in 1..=8 {
        ask(first.addr, &document(topic));
    }
    let metrics = |addr: SocketAddr| {
        let (status, raw) = http(addr, "GET", "/metrics", None, "");
        assert_eq!(status, 200, "{raw}");
        raw
    };
    // The sample of `name` exactly (labels but the model's name included).
    let series = |text: &str, name: &str| -> f64 {
        let line = text
            .lines()
            .map(without_model_label)
            .find(|l| l.strip_prefix(name).is_some_and(|v| v.starts_with(' ')));
        let line = line.unwrap_or_else(|| panic!("no {name} in:\n{text}"));
        metric(&line, name)
    };
    let scraped = metrics(first.addr);
    let host_capacity = "strata_kv_tier_capacity_blocks{tier=\"host\"}";
    assert_eq!(series(&scraped, host_capacity), 128.0);
    assert!(series(&scraped, "strata_kv_demoted_bytes_total{tier=\"host\"}") > 0.0);
    assert!(series(&scraped, "strata_kv_demoted_bytes_total{tier=\"disk\"}") > 0.0);
    // The restore chooser's declines are exported per lower tier (how many depends on rates).
    for tier in ["host", "disk"] {
        let declined = format!("strata_kv_restores_declined_total{{tier=\"{tier}\"}}");
        assert!(series(&scraped, &declined) >= 0.0, "{declined}");
    }
    first.signal("KILL");
    first.wait(Duration::from_secs(10));
    let parked = std::fs::read_dir(&disk)
        .unwrap()
        .flatten()
        .flat_map(|d| std::fs::read_dir(d.path()).unwrap().flatten())
        .count();
    assert!(parked > 0, "blocks were written to the disk tier");

    let second = Server::start(&args);
    let (again, tokens, cached) = ask(second.addr, &document(0));
    assert_eq!(tokens, prompt_tokens);
    assert!(
        cached >= prompt_tokens / 2,
        "restored from disk: {cached} of {prompt_tokens} prompt tokens"
    );
    assert_eq!(again, text, "restored from disk equals cold");
    let scraped = metrics(second.addr);
    assert!(series(&scraped, "strata_kv_restored_bytes_total{tier=\"disk\"}") > 0.0);
    assert_eq!(series(&scraped, "strata_kv_tier_copy_failures_total"), 0.0);
}

/// `/v1/cache`: a primed context is pinned, so traffic that evicts an unprimed prompt of the
/// same length (the canary) leaves it cached: a later request starting with it reports its
/// tokens as cached and answers as a cold server does. It is listed and read with where its
/// blocks are, deleted (then 404), and bad requests are refused by name.
#[test]
fn a_primed_context_is_pinned_listed_restored_and_deleted() {
    let tmp = tempfile::tempdir().unwrap();
    let model = tmp.path().join("m");
    synth(&model);
    let model = model.to_str().unwrap();
    let call = |addr: SocketAddr, method: &str, path: &str, body: serde_json::Value| {
        let body = if body.is_null() {
            String::new()
        } else {
            body.to_string()
        };
        let (status, raw) = http(addr, method, path, None, &body);
        let value = json_body(&raw);
        (status, value)
    };
    let ask = |addr: SocketAddr, prompt: &str| {
        let body = serde_json::json!({
            "model": "m", "prompt": prompt, "max_tokens": 6, "temperature": 0, "ignore_eos": true,
        });
        let (status, v) = call(addr, "POST", "/v1/completions", body);
        assert_eq!(status, 200, "{v}");
        (
            v["choices"][0]["text"].as_str().unwrap().to_string(),
            v["usage"]["prompt_tokens_details"]["cached_tokens"]
                .as_u64()
                .unwrap_or(0),
        )
    };
    // 1 MiB: 128 device blocks of this model, no lower tier (pins may hold half of them).
    let server = Server::start(&["--model", model, "--port", "0", "--kv-cache-mib", "1"]);
    let (status, primed) = call(
        server.addr,
        "POST",
        "/v1/cache",
        serde_json::json!({"prompt": document(0), "ttl_seconds": 600}),
    );
    assert_eq!(status, 200, "{primed}");
    let id = primed["id"].as_str().unwrap().to_string();
    let pinned = primed["cached_tokens"].as_u64().unwrap();
    assert!(pinned >= 600, "{primed}");
    assert_eq!(primed["blocks"]["device"].as_u64(), Some(pinned / 16));
    assert_eq!(primed["object"], "kv_cache");
    // The canary: the same kind of prompt, only computed (not primed).
    ask(server.addr, &document(9));
    for topic in 1..=8 {
        ask(server.addr, &document(topic));
    }
    let question = |topic: usize| format!("{}; and what does note {topic} 3 hold", document(topic));
    let (answer, cached) = ask(server.addr, &question(0));
    assert!(
        cached >= pinned,
        "the primed context restored: {cached} < {pinned}"
    );
    let (_, cached) = ask(server.addr, &question(9));
    assert_eq!(
        cached, 0,
        "the canary: an unprimed prompt was evicted by the same traffic"
    );
    let cold = Server::start(&["--model", model, "--port", "0"]);
    assert_eq!(
        ask(cold.addr, &question(0)).0,
        answer,
        "restored equals cold"
    );

    let (status, list) = call(server.addr, "GET", "/v1/cache", serde_json::Value::Null);
    assert_eq!(status, 200, "{list}");
    assert_eq!(list["data"].as_array().map(Vec::len), Some(1), "{list}");
    assert_eq!(list["data"][0]["id"], id.as_str());
    let path = format!("/v1/cache/{id}");
    let (status, one) = call(server.addr, "GET", &path, serde_json::Value::Null);
    assert_eq!(
        (status, one["cached_tokens"].as_u64()),
        (200, Some(pinned)),
        "{one}"
    );
    let (status, deleted) = call(server.addr, "DELETE", &path, serde_json::Value::Null);
    assert_eq!(status, 200, "{deleted}");
    assert_eq!(deleted["deleted"], true);
    for method in ["GET", "DELETE"] {
        let (status, gone) = call(server.addr, method, &path, serde_json::Value::Null);
        assert_eq!(status, 404, "{method}: {gone}");
        assert!(gone["error"]["message"].as_str().unwrap().contains(&id));
    }
    let refusals = [
        (serde_json::json!({"prompt": "too short"}), "whole KV block"),
        (
            serde_json::json!({"prompt": document(0), "ttl_seconds": 0}),
            "ttl_seconds",
        ),
        (
            serde_json::json!({"prompt": "a", "messages": []}),
            "not several",
        ),
        (serde_json::json!({}), "is required"),
        (
            serde_json::json!({"prompt": document(0), "model": "other"}),
            "other",
        ),
        (
            serde_json::json!({"prompt": document(0), "seed": 1}),
            "seed",
        ),
    ];
    for (body, words) in refusals {
        let (status, refused) = call(server.addr, "POST", "/v1/cache", body.clone());
        assert!((400..500).contains(&status), "{body}: {refused}");
        let message = refused["error"]["message"].as_str().unwrap_or_default();
        assert!(message.contains(words), "{body}: {message}");
    }
}

/// SIGTERM parks what the device caches on the disk tier: a prompt asked once (its KV only on
/// the device) is served from disk by the server started again on the same directory.
#[test]
fn sigterm_parks_the_device_cache_on_disk_for_the_next_start() {
    let tmp = tempfile::tempdir().unwrap();
    let model = tmp.path().join("m");
    synth(&model);
    let disk = tmp.path().join("kv");
    let args = [
        "--model",
        model.to_str().unwrap(),
        "--port",
        "0",
        "--kv-disk-dir",
        disk.to_str().unwrap(),
        "--kv-disk-mib",
        "16",
        "--drain-delay-s",
        "0",
    ];
    let document = document(0);
    let body = serde_json::json!({
        "model": "m", "prompt": document, "max_tokens": 6, "temperature": 0, "ignore_eos": true,
    })
    .to_string();
    let ask = |addr: SocketAddr| {
        let (status, raw) = http(addr, "POST", "/v1/completions", None, &body);
        assert_eq!(status, 200, "{raw}");
        let v = json_body(&raw);
        let cached = v["usage"]["prompt_tokens_details"]["cached_tokens"].as_u64();
        (v["choices"][0]["text"].clone(), cached.unwrap_or(0))
    };
    let mut first = Server::start(&args);
    let (text, cached) = ask(first.addr);
    assert_eq!(cached, 0);
    first.signal("TERM");
    assert!(first.wait(Duration::from_secs(30)).success());
    first.wait_for_log("parked on the disk tier", Duration::from_secs(5));
    let second = Server::start(&args);
    let (again, cached) = ask(second.addr);
    assert!(cached >= 640, "served from the parked disk tier: {cached}");
    assert_eq!(again, text);
}
