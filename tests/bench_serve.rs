//! `strata bench serve` as a process against a real `strata serve` on 127.0.0.1 (a tiny
//! synthesized model): a two-point concurrency sweep's JSON report, an open-loop sweep on fresh
//! connections, a point where every request fails exiting non-zero, and bad flags refused.

mod cluster;

use std::net::SocketAddr;
use std::path::Path;
use std::process::Output;
use std::time::Instant;

use cluster::{Process, START, strata, synth};
use serde_json::Value;

/// `strata serve` on port 0 with a synthesized model; the address it announced.
fn serve(model: &Path) -> (Process, SocketAddr) {
    let process = Process::start(&["serve", "--model", model.to_str().unwrap(), "--port", "0"]);
    let deadline = Instant::now() + START;
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        let line = process
            .log
            .recv_timeout(left)
            .expect("`strata serve` announced no address");
        if line.contains("serving `")
            && let Some((_, rest)) = line.split_once("on http://")
        {
            let addr = rest.split_whitespace().next().unwrap().parse().unwrap();
            return (process, addr);
        }
    }
}

fn bench(args: &[&str]) -> Output {
    let all: Vec<&str> = ["bench", "serve"].iter().chain(args).copied().collect();
    strata(&all)
}

fn report(out: &Output, json: &Path) -> Value {
    assert!(
        out.status.success(),
        "bench failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_str(&std::fs::read_to_string(json).unwrap()).unwrap()
}

/// Positive, ordered percentiles of a latency summary.
fn assert_ordered(point: &Value, name: &str) {
    let s = &point[name];
    let (p50, p90, p99) = (s["p50"].as_f64(), s["p90"].as_f64(), s["p99"].as_f64());
    let (Some(p50), Some(p90), Some(p99)) = (p50, p90, p99) else {
        panic!("{name} has no percentiles: {point}");
    };
    assert!(p50 > 0.0 && p50 <= p90 && p90 <= p99, "{name}: {s}");
}

#[test]
fn a_sweep_against_strata_serve_reports_every_point() {
    let tmp = tempfile::tempdir().unwrap();
    let model = tmp.path().join("m");
    synth(&model);
    let (_server, addr) = serve(&model);
    let url = format!("http://{addr}");
    let json = tmp.path().join("closed.json");
    let small = [
        "--num-prompts",
        "4",
        "--input-len",
        "16",
        "--output-len",
        "8",
        "--vocab-size",
        "300",
    ];

    let mut args = vec!["--url", &url, "--concurrency", "1,2"];
    args.extend(small);
    args.extend(["--json", json.to_str().unwrap(), "--label", "ci"]);
    let out = bench(&args);
    let r = report(&out, &json);
    assert_eq!(r["tool"], "strata bench serve");
    assert_eq!(r["label"], "ci");
    assert!(r["started_at"].is_string());
    assert_eq!(r["args"]["concurrency"], serde_json::json!([1, 2]));
    assert_eq!(r["args"]["connection"], "reuse");
    let points = r["points"].as_array().unwrap();
    assert_eq!(points.len(), 2, "{r}");
    for (point, concurrency) in points.iter().zip([1, 2]) {
        assert_eq!(point["concurrency"], concurrency);
        assert_eq!(point["failed"], 0, "{point}");
        assert_eq!(point["completed"], 4, "{point}");
        assert_eq!(point["input_tokens"], 4 * 16, "{point}");
        // ignore_eos and min_tokens make every request generate exactly --output-len tokens.
        assert_eq!(point["output_tokens"], 4 * 8, "{point}");
        assert!(point["duration_s"].as_f64().unwrap() > 0.0);
        assert!(point["output_tok_s"].as_f64().unwrap() > 0.0);
        assert_ordered(point, "ttft_ms");
        assert_ordered(point, "itl_ms");
        assert_ordered(point, "e2e_ms");
    }
    let table = String::from_utf8_lossy(&out.stdout);
    assert!(
        table.contains("TTFT p50") && table.contains("concurrency 2"),
        "{table}"
    );

    // Open loop on a new connection per request.
    let json = tmp.path().join("open.json");
    let mut args = vec!["--url", &url, "--request-rate", "50,inf"];
    args.extend(small);
    args.extend(["--connection", "fresh", "--json", json.to_str().unwrap()]);
    let r = report(&bench(&args), &json);
    let points = r["points"].as_array().unwrap();
    assert_eq!(points.len(), 2, "{r}");
    assert_eq!(points[0]["request_rate"], 50.0);
    assert_eq!(points[1]["request_rate"], "inf");
    for point in points {
        assert_eq!(point["completed"], 4, "{point}");
        assert_ordered(point, "ttft_ms");
    }

    // The canary: a model the server does not serve fails every request, and the run says so.
    let mut args = vec!["--url", &url, "--concurrency", "1", "--model", "nope"];
    args.extend(small);
    let out = bench(&args);
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("every request failed") && stderr.contains("HTTP 404"),
        "{stderr}"
    );
}

#[test]
fn bad_flags_are_refused_with_a_clear_message() {
    let refused = |args: &[&str], says: &str| {
        let out = bench(args);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "{args:?} was accepted");
        assert!(stderr.contains(says), "{args:?}: {stderr}");
    };
    refused(&["--concurrency", "0"], "concurrency must be at least 1");
    refused(
        &["--concurrency", "1,0,4"],
        "concurrency must be at least 1",
    );
    refused(
        &["--url", "https://127.0.0.1:8443", "--concurrency", "1"],
        "https is not supported",
    );
    refused(&[], "--concurrency");
    refused(
        &["--concurrency", "1", "--request-rate", "inf"],
        "cannot be used with",
    );
    refused(&["--request-rate", "0"], "positive number");
    refused(
        &["--concurrency", "1", "--range-ratio", "1.5"],
        "--range-ratio must be in [0, 1)",
    );
}
