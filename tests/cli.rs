//! The `strata` binary end to end: synth → inspect → generate, determinism, and bad input.

use std::path::Path;
use std::process::{Command, Output};

fn strata(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_strata"))
        .args(args)
        .output()
        .expect("run strata")
}

fn stdout(o: &Output) -> String {
    assert!(
        o.status.success(),
        "strata failed: {}",
        String::from_utf8_lossy(&o.stderr)
    );
    String::from_utf8(o.stdout.clone()).unwrap()
}

fn synth(dir: &Path, arch: &str) {
    let out = dir.to_str().unwrap();
    let o = strata(&[
        "model",
        "synth",
        "--arch",
        arch,
        "--out",
        out,
        "--layers",
        "2",
        "--hidden",
        "64",
        "--heads",
        "4",
        "--kv-heads",
        "2",
        "--intermediate",
        "128",
        "--seed",
        "5",
    ]);
    stdout(&o);
}

#[test]
fn synth_inspect_and_generate() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("m");
    synth(&dir, "qwen3");
    let m = dir.to_str().unwrap();
    let inspect = stdout(&strata(&["model", "inspect", m]));
    assert!(
        inspect.contains("Qwen3ForCausalLM") && inspect.contains("q/k norm"),
        "{inspect}"
    );

    let greedy = [
        "generate",
        "--model",
        m,
        "--prompt",
        "hello",
        "--max-tokens",
        "12",
    ];
    let a = strata(&greedy);
    let b = strata(&greedy);
    assert_eq!(stdout(&a), stdout(&b), "greedy is deterministic");
    let stats = String::from_utf8_lossy(&a.stderr);
    assert!(
        stats.contains("decode") && stats.contains("tok/s"),
        "{stats}"
    );

    let sampled = |seed: &str| {
        let args = [
            "generate",
            "--model",
            m,
            "--prompt",
            "hello",
            "--max-tokens",
            "24",
            "--temperature",
            "1.0",
            "--seed",
            seed,
        ];
        stdout(&strata(&args))
    };
    assert_eq!(sampled("1"), sampled("1"), "same seed, same text");
    assert_ne!(sampled("1"), sampled("2"), "another seed, other text");

    let chat = strata(&[
        "generate",
        "--model",
        m,
        "--chat",
        "--prompt",
        "hi",
        "--max-tokens",
        "4",
    ]);
    stdout(&chat);
}

#[test]
fn bad_input_is_one_clear_line() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("m");
    synth(&dir, "llama");
    let m = dir.to_str().unwrap();
    std::fs::write(dir.join("tokenizer.json"), "{ nope").unwrap();
    let o = strata(&["generate", "--model", m, "--prompt", "x"]);
    assert!(!o.status.success());
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(
        err.contains("tokenizer.json") && err.lines().count() == 1,
        "{err}"
    );

    let missing = tmp.path().join("absent");
    let o = strata(&["model", "inspect", missing.to_str().unwrap()]);
    assert!(!o.status.success());
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(
        err.contains("config.json") && err.lines().count() == 1,
        "{err}"
    );

    let o = strata(&[
        "model",
        "synth",
        "--arch",
        "llama",
        "--out",
        m,
        "--kv-heads",
        "5",
    ]);
    assert!(!o.status.success());
    assert!(String::from_utf8_lossy(&o.stderr).contains("num_key_value_heads"));
}

/// `--tokenizer`: a real tokenizer (fetched by scripts/fetch-test-data.sh) sizes the vocabulary,
/// and its own chat template drives `--chat`.
#[test]
fn synth_with_a_real_tokenizer() {
    let real = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("target/test-data/tokenizers/qwen3/tokenizer.json");
    assert!(
        real.exists(),
        "missing {}: run scripts/fetch-test-data.sh",
        real.display()
    );
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("q");
    let out = dir.to_str().unwrap();
    stdout(&strata(&[
        "model",
        "synth",
        "--arch",
        "qwen3",
        "--out",
        out,
        "--tokenizer",
        real.to_str().unwrap(),
        "--layers",
        "1",
        "--hidden",
        "32",
        "--heads",
        "2",
        "--kv-heads",
        "1",
        "--intermediate",
        "64",
    ]));
    let config: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("config.json")).unwrap()).unwrap();
    assert_eq!(config["vocab_size"], 151669);
    assert!(
        std::fs::read_to_string(dir.join("tokenizer_config.json"))
            .unwrap()
            .contains("<|im_start|>")
    );
    let o = strata(&[
        "generate",
        "--model",
        out,
        "--chat",
        "--prompt",
        "你好",
        "--max-tokens",
        "3",
    ]);
    let stats = String::from_utf8_lossy(&o.stderr).to_string();
    stdout(&o);
    // The Qwen3 template wraps the message in <|im_start|>user ... <|im_start|>assistant.
    let prompt_tokens: usize = stats.split_whitespace().next().unwrap().parse().unwrap();
    assert!(prompt_tokens > 5, "{stats}");
}
