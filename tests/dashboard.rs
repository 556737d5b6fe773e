//! The operator's dashboard and capacity planner against a live local cluster (issue 23):
//! - in a real headless Chromium (Debian's, driven by playwright-core; tests/dashboard/check.cjs):
//!   the page loads with no console error (the collector's canary must catch a planted one),
//!   shows the cluster's nodes and members, shows one node fewer up after a node is SIGKILLed,
//!   and its planner answers a fixed input with the node count computed here independently from
//!   the receipt the profile cites; the screenshot is kept in target/test-artifacts;
//! - the planner's throughput prediction for a two-node CPU cluster, from a profile measured on
//!   this machine by `strata plan measure`, against the throughput `strata bench serve` measures
//!   through the router.

mod cluster;

use std::io::{BufRead, BufReader, Write};
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use cluster::{complete, deploy_local, deploy_local_env, get, serial, strata};

fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).to_path_buf()
}

/// A Qwen3 big enough that a CPU step is compute, not overhead (4 layers, hidden 512).
fn synth_model(dir: &Path) {
    let out = strata(&[
        "model",
        "synth",
        "--arch",
        "qwen3",
        "--out",
        dir.to_str().unwrap(),
        "--layers",
        "4",
        "--hidden",
        "512",
        "--heads",
        "8",
        "--kv-heads",
        "2",
        "--intermediate",
        "1536",
        "--max-position",
        "4096",
    ]);
    assert!(out.status.success(), "{out:?}");
}

/// The pid up.sh recorded for process `name` (e.g. `node-2`).
fn pid_of(dir: &Path, name: &str) -> i32 {
    let pids = std::fs::read_to_string(dir.join("pids")).unwrap();
    pids.lines()
        .find_map(|l| {
            let (pid, n) = l.split_once(' ')?;
            (n == name).then(|| pid.parse().unwrap())
        })
        .unwrap_or_else(|| panic!("no {name} in {pids}"))
}

/// A JSON value at `pointer` of a receipt under docs/receipts.
fn receipt_value(receipt: &str, pointer: &str) -> f64 {
    let text = std::fs::read_to_string(repo().join(receipt)).unwrap();
    let doc: serde_json::Value = serde_json::from_str(&text).unwrap();
    doc.pointer(pointer).and_then(|v| v.as_f64()).unwrap()
}

#[test]
fn the_dashboard_shows_the_cluster_and_plans_in_a_real_browser() {
    let chromium = std::env::var("CHROMIUM").unwrap_or_else(|_| "/usr/bin/chromium".into());
    let playwright = repo().join("target/test-data/playwright/node_modules");
    assert!(
        Path::new(&chromium).exists() && playwright.join("playwright-core").exists(),
        "this test needs Debian's chromium and playwright-core: run scripts/fetch-test-data.sh \
         (as root it installs both)"
    );
    let _serial = serial();
    let tmp = tempfile::tempdir().unwrap();
    let model = tmp.path().join("m");
    cluster::synth(&model);
    let dir = tmp.path().join("cluster");
    let (_down, base) = deploy_local(&dir, &model, 2);
    let router: SocketAddr = format!("127.0.0.1:{}", base + 101).parse().unwrap();
    // Some traffic, so that the figures are not all empty.
    for i in 0..4 {
        complete(router, &format!("{i} a question for the dashboard"), 8);
    }

    // The planner's fixed input: prefill-bound (4096-token prompts, one output token, no
    // latency target), so the answer is ⌈rate · prompt / prefill rate⌉ nodes, the rate read here
    // from the receipt the shipped profile cites.
    let (rate, prompt) = (20.0, 4096.0);
    let prefill = receipt_value(
        "docs/receipts/cuda-battery-h200.json",
        "/prefill/results/1/tokens_per_s",
    );
    let expected_nodes = (rate * prompt / prefill).ceil() as u64;
    let plan = serde_json::json!({
        "profile": "h200-llama-3.1-8b", "rate": rate, "prompt_tokens": prompt, "output_tokens": 1,
    });

    let artifacts = repo().join("target/test-artifacts");
    std::fs::create_dir_all(&artifacts).unwrap();
    let screenshot = artifacts.join("dashboard.png");
    let _ = std::fs::remove_file(&screenshot);
    let mut script = Command::new("node")
        .arg(repo().join("tests/dashboard/check.cjs"))
        .arg(format!("http://{router}/dashboard"))
        .arg(&screenshot)
        .arg(plan.to_string())
        .env("NODE_PATH", &playwright)
        .env("CHROMIUM", &chromium)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .expect("run node");
    let mut stdin = script.stdin.take().unwrap();
    let mut said = Vec::new();
    for line in BufReader::new(script.stdout.take().unwrap()).lines() {
        let line = line.unwrap();
        eprintln!("browser: {line}");
        if line == "kill?" {
            let pid = pid_of(&dir, "node-2");
            // SAFETY: a plain kill(2) of a process this test's cluster started.
            assert_eq!(unsafe { libc::kill(pid, libc::SIGKILL) }, 0);
            writeln!(stdin, "killed").unwrap();
        }
        said.push(line);
    }
    let status = script.wait().unwrap();
    assert!(status.success(), "the browser check failed: {said:?}");
    let find = |prefix: &str| {
        said.iter()
            .find_map(|l| l.strip_prefix(prefix))
            .unwrap_or_else(|| panic!("no `{prefix}` line in {said:?}"))
            .to_string()
    };
    assert_eq!(find("canary "), "ok");
    let nodes = find("nodes ");
    assert!(nodes.starts_with("2/2 rows "), "{nodes}");
    assert!(nodes.ends_with("members 2"), "{nodes}");
    let down = find("down ");
    assert!(down.starts_with("1/"), "{down}");
    let answer: serde_json::Value = serde_json::from_str(&find("plan ")).unwrap();
    assert_eq!(answer["nodes"].as_u64(), Some(expected_nodes), "{answer}");
    assert_eq!(answer["verdict"], "meets the targets");
    let sources = answer["sources"].as_array().unwrap();
    assert!(
        sources.iter().any(|s| s
            .as_str()
            .unwrap()
            .starts_with("docs/receipts/cuda-battery-h200.json")),
        "{answer}"
    );
    let png = std::fs::read(&screenshot).expect("the screenshot");
    assert!(png.starts_with(b"\x89PNG") && png.len() > 10_000);
}

/// The planner's prediction against a measurement on this machine: a node's profile measured
/// by `strata plan measure` (one thread per engine), then a two-node cluster of the same model
/// (one thread each) loaded through its router by `strata bench serve` with 8 clients; the
/// predicted output tokens/s must be within 30 % of the measured (the 2-core machine also runs
/// the router, the raft members and the load generator, which the profile does not count).
#[test]
fn the_planner_predicts_a_two_node_cpu_cluster_within_30_percent() {
    let _serial = serial();
    let tmp = tempfile::tempdir().unwrap();
    let model = tmp.path().join("m");
    synth_model(&model);
    let (prompt, output, clients) = (64usize, 32usize, 8usize);
    let profile = tmp.path().join("profile.json");
    let out = Command::new(env!("CARGO_BIN_EXE_strata"))
        .args(["plan", "measure", "--model", model.to_str().unwrap()])
        .args(["--batches", "1,2,4,8", "--steps", "32"])
        .args(["--prompt-tokens", &prompt.to_string()])
        .args(["--out", profile.to_str().unwrap()])
        .env("RAYON_NUM_THREADS", "1")
        .output()
        .unwrap();
    assert!(out.status.success(), "{out:?}");
    let predicted = strata(&[
        "plan",
        "--profile",
        profile.to_str().unwrap(),
        "--concurrency",
        &clients.to_string(),
        "--prompt-tokens",
        &prompt.to_string(),
        "--output-tokens",
        &output.to_string(),
        "--nodes",
        "2",
        "--json",
    ]);
    assert!(predicted.status.success(), "{predicted:?}");
    let predicted: serde_json::Value = serde_json::from_slice(&predicted.stdout).unwrap();
    let predicted = predicted["cluster"]["output_tokens_per_s"]
        .as_f64()
        .unwrap();

    let dir = tmp.path().join("cluster");
    let (_down, base) = deploy_local_env(
        &dir,
        &model,
        (2, 1),
        ("", ""),
        &[("RAYON_NUM_THREADS", "1")],
    );
    let router = format!("http://127.0.0.1:{}", base + 101);
    let report = tmp.path().join("bench.json");
    let out = strata(&[
        "bench",
        "serve",
        "--url",
        &router,
        "--concurrency",
        &clients.to_string(),
        "--num-prompts",
        "48",
        "--warmup",
        "8",
        "--input-len",
        &prompt.to_string(),
        "--output-len",
        &output.to_string(),
        "--vocab-size",
        "320",
        "--json",
        report.to_str().unwrap(),
    ]);
    assert!(out.status.success(), "{out:?}");
    let report: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&report).unwrap()).unwrap();
    let point = &report["points"][0];
    assert_eq!(point["failed"], 0, "{report}");
    let measured = point["output_tok_s"].as_f64().unwrap();
    let ratio = predicted / measured;
    eprintln!(
        "planner: predicted {predicted:.1} output tokens/s, measured {measured:.1} (ratio {ratio:.3})"
    );
    assert!(
        (0.7..=1.3).contains(&ratio),
        "predicted {predicted:.1} vs measured {measured:.1} output tokens/s"
    );
    // Both nodes took a share (the prediction assumes an even split).
    let metrics = get(
        format!("127.0.0.1:{}", base + 101).parse().unwrap(),
        "/metrics",
    );
    let shares: Vec<f64> = metrics
        .lines()
        .filter(|l| l.starts_with("strata_router_node_requests_total{"))
        .filter_map(|l| l.rsplit(' ').next()?.parse().ok())
        .collect();
    assert_eq!(shares.len(), 2, "{metrics}");
    assert!(shares.iter().all(|&n| n >= 8.0), "{shares:?}");
}
