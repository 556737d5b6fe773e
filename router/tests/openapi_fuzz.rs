//! Schemathesis against `/openapi.json` on a live server (a tiny model, a 32-token window, an API
//! key): every schema-valid request it generates must be accepted, every schema-violating one
//! refused, and every answer must match the document. The refusals a static document cannot
//! state (the window, the vocabulary, grammars, cross-field rules) are named in
//! router/tests/openapi_fuzz_hooks.py. Schemathesis is installed by `scripts/fetch-test-data.sh`
//! in its own folder; without it the test fails (it never skips), as the SDK tests do.
//!
//! A canary serves the run a copy of the document loosened by one keyword (chat's `messages`
//! without `minItems`) and requires the run to fail: the gate can catch a looser document.

mod support;

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use strata_model::Architecture;
use strata_model::synth::{SynthSpec, synthesize};
use strata_node::{EngineSpec, KvBudget};
use strata_router::auth::ApiKey;
use strata_router::openapi::DOCUMENT;
use strata_router::{Access, ServeConfig, ServingOptions};

const API_KEY: &str = "sk-openapi-fuzz-test-key";

/// The schemathesis checkout under target/test-data/schemathesis.
fn schemathesis_dir() -> PathBuf {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../target/test-data/schemathesis");
    assert!(
        dir.join("bin/st").is_file(),
        "schemathesis is missing from {}: run scripts/fetch-test-data.sh from the repository root",
        dir.display()
    );
    dir
}

/// Serves a tiny Llama as `tiny` behind [`API_KEY`], with a 32-token window so that every
/// generation is short, and runs `st` with `args` against it (`{base}` in an argument becomes
/// `http://127.0.0.1:PORT`).
fn run_schemathesis(args: &[&str]) -> Output {
    let st = schemathesis_dir();
    let model_dir = tempfile::tempdir().unwrap();
    synthesize(
        &SynthSpec::tiny(Architecture::Llama, 1),
        model_dir.path(),
        None,
    )
    .unwrap();
    let config = ServeConfig {
        model_dir: model_dir.path().to_path_buf(),
        model_name: "tiny".into(),
        owned_by: "strata (test)".into(),
        addr: SocketAddr::from(([127, 0, 0, 1], 0)),
        engine: std::sync::Arc::new(EngineSpec {
            kv: KvBudget::Bytes(16 << 20),
            ..EngineSpec::default()
        }),
        options: ServingOptions {
            max_model_len: Some(32),
            ..ServingOptions::default()
        },
    };
    let access = Access {
        api_key: Some(ApiKey::new(API_KEY).unwrap()),
        ..Access::default()
    };
    // Schemathesis keeps its example database in the working directory: a fresh one each run.
    let work = tempfile::tempdir().unwrap();
    let hooks = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests");
    let python_path = std::env::join_paths([&st, &hooks]).unwrap();
    support::serve_while(&config, access, |port| {
        let base = format!("http://127.0.0.1:{port}");
        Command::new(st.join("bin/st"))
            .arg("run")
            .args(args.iter().map(|a| a.replace("{base}", &base)))
            .args(["-H", &format!("Authorization: Bearer {API_KEY}")])
            // ST202 through the hooks' version of it (see router/tests/openapi_fuzz_hooks.py).
            .args([
                "--checks",
                "all",
                "--exclude-checks",
                "positive_data_acceptance",
            ])
            .args([
                "--generation-deterministic",
                "--request-timeout",
                "60",
                "-w",
                "2",
            ])
            .current_dir(work.path())
            .env("PYTHONPATH", python_path)
            .env("SCHEMATHESIS_HOOKS", "openapi_fuzz_hooks")
            .env("NO_COLOR", "1")
            .output()
            .unwrap_or_else(|e| panic!("cannot run {} ({e})", st.join("bin/st").display()))
    })
}

/// Whether a failed run reported no finding, only schemathesis' own CPython crash.
fn crashed_inside_schemathesis(output: &Output) -> bool {
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    );
    text.contains("AST constructor recursion depth mismatch") && !text.contains("= FAILURES =")
}

fn printed(output: &Output) -> String {
    format!(
        "({})\n--- stdout\n{}\n--- stderr\n{}",
        output.status,
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr),
    )
}

#[test]
fn the_document_is_as_strict_as_the_server() {
    // Examples and the coverage phase's boundary values for every operation, then fuzzing until
    // the time budget (about a minute and a half on two cores) is spent.
    let run = || {
        run_schemathesis(&[
            "{base}/openapi.json",
            "--phases",
            "examples,coverage,fuzzing,stateful",
            "--max-examples",
            "10",
            "--max-time",
            "90",
        ])
    };
    let mut output = run();
    if !output.status.success() && crashed_inside_schemathesis(&output) {
        // One more run when the tool itself crashed and found nothing: its coverage phase now and
        // then trips a CPython error while it builds a case ("AST constructor recursion depth
        // mismatch"), which says nothing about the server. A disagreement is never retried.
        eprintln!(
            "schemathesis crashed inside itself; running it once more {}",
            printed(&output)
        );
        output = run();
    }
    assert!(
        output.status.success(),
        "schemathesis found the document and the server disagree {}",
        printed(&output)
    );
    // What ran, phase by phase (schemathesis' summary), for the log of a passing run.
    let stdout = String::from_utf8_lossy(&output.stdout);
    let summary: Vec<&str> = stdout.lines().rev().take(40).collect();
    eprintln!(
        "{}",
        summary.into_iter().rev().collect::<Vec<_>>().join("\n")
    );
}

#[test]
fn a_looser_document_fails_the_run() {
    // Chat's `messages` loses its `minItems`; its `model` is pinned to the served name so that
    // the generated requests get past the model check to the messages.
    let strict = r##""model": {"type": "string"},
          "messages": {"type": "array", "minItems": 1, "items": {"$ref": "#/components/schemas/ChatMessage"}}"##;
    let loose = r##""model": {"const": "tiny"},
          "messages": {"type": "array", "items": {"$ref": "#/components/schemas/ChatMessage"}}"##;
    assert_eq!(
        DOCUMENT.matches(strict).count(),
        1,
        "chat's `messages` moved"
    );
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("openapi.json");
    std::fs::write(&path, DOCUMENT.replace(strict, loose)).unwrap();
    let output = run_schemathesis(&[
        path.to_str().unwrap(),
        "--url",
        "{base}",
        "--include-operation-id",
        "createChatCompletion",
        "--phases",
        "examples,coverage,fuzzing",
        "--max-examples",
        "5",
    ]);
    let stdout = String::from_utf8_lossy(&output.stdout);
    assert!(
        !output.status.success() && stdout.contains("must hold at least one message"),
        "the loosened document passed {}",
        printed(&output)
    );
}
