//! The operator's dashboard and capacity planner against a live local cluster (issue 23):
//! - in a real headless Chromium (Debian's, driven by playwright-core; tests/dashboard/check.cjs):
//!   the page loads with no console error (the collector's canary must catch a planted one),
//!   shows the cluster's nodes and members, shows one node fewer up after a node is SIGKILLed,
//!   and its planner answers a fixed input with the node count computed here independently from
//!   the receipt the profile cites; the screenshot is kept in target/test-artifacts;
//! - the planner's throughput prediction for CPU clusters of one and two nodes, from a profile
//!   measured on this machine by `strata plan measure`, against the throughput `strata bench
//!   serve` measures through the router.

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
    cluster::synth_sized(dir, 4, 512, 8, 2, 1536);
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

/// The planner's prediction against measurements on this machine: a node's profile measured by
/// `strata plan measure` (one engine thread), then clusters of one and of two nodes of the same
/// model (one engine thread each) loaded through their router by `strata bench serve` with 4
/// clients per node. For one node the predicted output tokens/s must be within 25 % of the
/// measured (it read 0.89 and 0.94). Two nodes are measured and printed, not held to a bound: on a
/// 2-core machine their two engine threads share the cores with the router, the raft members and
/// the load generator, which a profile measured with a core to spare does not count, and the ratio
/// swung from 1.01 to 1.60 over four runs with the machine's other load.
#[test]
fn the_planner_predicts_cpu_clusters_of_one_and_two_nodes() {
    let _serial = serial();
    let tmp = tempfile::tempdir().unwrap();
    let model = tmp.path().join("m");
    synth_model(&model);
    let profile = tmp.path().join("profile.json");
    let out = Command::new(env!("CARGO_BIN_EXE_strata"))
        .args(["plan", "measure", "--model", model.to_str().unwrap()])
        .args(["--batches", "1,2,4,8", "--steps", "32"])
        .args(["--prompt-tokens", &PROMPT.to_string()])
        .args(["--out", profile.to_str().unwrap()])
        .env("RAYON_NUM_THREADS", "1")
        .output()
        .unwrap();
    assert!(out.status.success(), "{out:?}");
    for nodes in [1usize, 2] {
        let (predicted, measured) = predicted_and_measured(tmp.path(), &model, &profile, nodes);
        let ratio = predicted / measured;
        eprintln!(
            "planner, {nodes} node(s): predicted {predicted:.1} output tokens/s, measured \
             {measured:.1} (ratio {ratio:.3})"
        );
        if nodes == 1 {
            assert!(
                (0.75..=1.25).contains(&ratio),
                "one node: predicted {predicted:.1} vs measured {measured:.1} output tokens/s"
            );
        }
    }
}

const PROMPT: usize = 64;
const OUTPUT: usize = 32;
const CLIENTS_PER_NODE: usize = 4;

/// The planner's output tokens/s for `nodes` nodes of `profile`, and the measured one.
fn predicted_and_measured(tmp: &Path, model: &Path, profile: &Path, nodes: usize) -> (f64, f64) {
    let clients = (CLIENTS_PER_NODE * nodes).to_string();
    let predicted = strata(&[
        "plan",
        "--profile",
        profile.to_str().unwrap(),
        "--concurrency",
        &clients,
        "--prompt-tokens",
        &PROMPT.to_string(),
        "--output-tokens",
        &OUTPUT.to_string(),
        "--nodes",
        &nodes.to_string(),
        "--json",
    ]);
    assert!(predicted.status.success(), "{predicted:?}");
    let predicted: serde_json::Value = serde_json::from_slice(&predicted.stdout).unwrap();
    let predicted = predicted["cluster"]["output_tokens_per_s"]
        .as_f64()
        .unwrap();

    let dir = tmp.join(format!("cluster-{nodes}"));
    let (_down, base) = deploy_local_env(
        &dir,
        model,
        (nodes, 1),
        ("", ""),
        &[("RAYON_NUM_THREADS", "1")],
    );
    let router = format!("http://127.0.0.1:{}", base + 101);
    let report = tmp.join(format!("bench-{nodes}.json"));
    let out = strata(&[
        "bench",
        "serve",
        "--url",
        &router,
        "--concurrency",
        &clients,
        "--num-prompts",
        &(24 * nodes).to_string(),
        "--warmup",
        &(4 * nodes).to_string(),
        "--input-len",
        &PROMPT.to_string(),
        "--output-len",
        &OUTPUT.to_string(),
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
    // Every node took a share (the prediction assumes an even split).
    let metrics = get(
        format!("127.0.0.1:{}", base + 101).parse().unwrap(),
        "/metrics",
    );
    let shares: Vec<f64> = metrics
        .lines()
        .filter(|l| l.starts_with("strata_router_node_requests_total{"))
        .filter_map(|l| l.rsplit(' ').next()?.parse().ok())
        .collect();
    assert_eq!(shares.len(), nodes, "{metrics}");
    assert!(shares.iter().all(|&n| n >= 8.0), "{shares:?}");
    (predicted, point["output_tok_s"].as_f64().unwrap())
}
