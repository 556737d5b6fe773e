//! Every GPU battery parses on the CPU machine before a GPU minute is spent on it: `bash -n` on
//! each `scripts/device/*.sh` and Python's compiler on each `scripts/device/*.py`. The batteries
//! whose plumbing runs end to end without a GPU are tested on their own (`spec_battery.rs`,
//! `battery_summaries.rs`); this catches the syntax slips of the rest (quant_engine.sh,
//! gguf_blocks.sh, the PyTorch peers), and runs `common.sh`'s model synthesis, which most of them
//! start with.

use std::path::PathBuf;
use std::process::Command;

fn scripts(ext: &str) -> Vec<PathBuf> {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("scripts/device");
    let mut found: Vec<PathBuf> = std::fs::read_dir(&dir)
        .expect("scripts/device")
        .map(|e| e.expect("an entry").path())
        .filter(|p| p.extension().is_some_and(|e| e == ext))
        .collect();
    found.sort();
    found
}

/// The scripts `check` refuses, with what it printed.
fn refused(paths: &[PathBuf], check: impl Fn(&PathBuf) -> Command) -> Vec<String> {
    paths
        .iter()
        .filter_map(|p| {
            let out = check(p).output().expect("the checker runs");
            (!out.status.success())
                .then(|| format!("{}: {}", p.display(), String::from_utf8_lossy(&out.stderr)))
        })
        .collect()
}

fn bash_n(p: &PathBuf) -> Command {
    let mut c = Command::new("bash");
    c.arg("-n").arg(p);
    c
}

fn py_compile(p: &PathBuf) -> Command {
    // Compiled in memory: nothing written beside the script.
    let mut c = Command::new("python3");
    c.arg("-c")
        .arg("import sys; compile(open(sys.argv[1]).read(), sys.argv[1], 'exec')")
        .arg(p);
    c
}

#[test]
fn every_battery_parses() {
    let (sh, py) = (scripts("sh"), scripts("py"));
    assert!(sh.len() >= 10 && !py.is_empty(), "{sh:?} {py:?}");
    let bad: Vec<String> = refused(&sh, bash_n)
        .into_iter()
        .chain(refused(&py, py_compile))
        .collect();
    assert!(bad.is_empty(), "{}", bad.join("\n"));
}

#[test]
fn a_broken_script_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let sh = dir.path().join("broken.sh");
    std::fs::write(&sh, "if true; then\n  echo unclosed\n").unwrap();
    let py = dir.path().join("broken.py");
    std::fs::write(&py, "def f(:\n    pass\n").unwrap();
    assert_eq!(refused(std::slice::from_ref(&sh), bash_n).len(), 1);
    assert_eq!(refused(std::slice::from_ref(&py), py_compile).len(), 1);
}

/// `common.sh`'s `synth_bench_model` on the CPU machine, as the batteries call it: the shape of
/// `BENCH_CONFIG` synthesized by the real binary, cut to `LAYERS` when it is set (the profile
/// part of quant_engine.sh), else with the config's own layers (the canary: the cut is seen).
#[test]
fn synth_bench_model_writes_the_configs_shape_cut_to_layers() {
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR"));
    let tokenizer = root.join("target/test-data/tokenizers/llama3_1/tokenizer.json");
    assert!(
        tokenizer.is_file(),
        "{} missing (scripts/fetch-test-data.sh)",
        tokenizer.display()
    );
    let dir = tempfile::tempdir().unwrap();
    let config = dir.path().join("shape.json");
    std::fs::write(
        &config,
        r#"{"num_hidden_layers": 3, "hidden_size": 64, "num_attention_heads": 4,
            "num_key_value_heads": 2, "intermediate_size": 128}"#,
    )
    .unwrap();
    std::fs::create_dir_all(dir.path().join("logs")).unwrap();
    let layers_of = |layers: Option<&str>| -> u64 {
        let model = dir
            .path()
            .join(format!("model-{}", layers.unwrap_or("all")));
        let mut c = Command::new("bash");
        c.arg("-c")
            .arg(". scripts/device/common.sh && synth_bench_model")
            .current_dir(&root)
            .env("BIN", env!("CARGO_BIN_EXE_strata"))
            .env("OUT", dir.path())
            .env("MODEL", &model)
            .env("BENCH_CONFIG", &config)
            .env("TOKENIZER", &tokenizer)
            .env("MAX_POSITION", "256")
            .env_remove("LAYERS");
        if let Some(n) = layers {
            c.env("LAYERS", n);
        }
        let out = c.output().expect("bash");
        assert!(
            out.status.success(),
            "synth_bench_model failed:\n{}",
            String::from_utf8_lossy(&out.stdout)
        );
        let written: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(model.join("config.json")).unwrap())
                .unwrap();
        assert_eq!(written["hidden_size"], 64);
        written["num_hidden_layers"].as_u64().unwrap()
    };
    assert_eq!(layers_of(Some("2")), 2);
    assert_eq!(layers_of(None), 3);
}

/// `kv_tiers.sh` starts `strata serve` four ways (host, disk, restarted, long), each with the
/// restore policy `KV_RESTORE` picks: every one of those command lines, read from the script
/// itself, must get past the binary's flag parsing (the run then stops at the missing model),
/// so a renamed or misspelt flag fails here rather than on the GPU machine.
#[test]
fn kv_tiers_serve_lines_parse() {
    let script = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("scripts/device/kv_tiers.sh");
    let text = std::fs::read_to_string(&script).unwrap();
    let common = text
        .lines()
        .find(|l| l.contains("\"$BIN\" serve --model"))
        .expect("the serve function");
    assert!(
        common.contains("--kv-restore \"${KV_RESTORE:-auto}\""),
        "{common}"
    );
    let servers: Vec<Vec<String>> = text
        .lines()
        .filter_map(|l| l.trim().strip_prefix("serve "))
        .filter_map(|l| l.strip_suffix(" || exit 1"))
        .map(|l| {
            l.split_whitespace()
                .skip(1) // the server's name
                .map(|a| {
                    if a.contains('$') {
                        "/tmp/unused".into()
                    } else {
                        a.to_string()
                    }
                })
                .collect()
        })
        .collect();
    assert_eq!(servers.len(), 4, "host, disk, disk-restarted, long");
    let tmp = tempfile::tempdir().unwrap();
    let model = tmp.path().join("missing");
    for restore in ["auto", "always", "sometimes"] {
        for args in &servers {
            let out = Command::new(env!("CARGO_BIN_EXE_strata"))
                .args(["serve", "--model", model.to_str().unwrap(), "--port", "0"])
                .args(["--kv-restore", restore])
                .args(args)
                .output()
                .unwrap();
            let stderr = String::from_utf8_lossy(&out.stderr);
            assert!(!out.status.success(), "{stderr}");
            // The canary: a value the flag does not take must be refused by the parser.
            let parsed = stderr.contains("config.json");
            assert_eq!(
                parsed,
                restore != "sometimes",
                "{restore} {args:?}: {stderr}"
            );
        }
    }
}

/// `moe.sh`'s `strata gpu decode` and `strata gpu prefill` command lines, read from the script
/// with each arm's flags (`--moe-grouped` or none), must get past the binary's flag parsing (on
/// this machine they then stop for want of a GPU); the canary: a misspelt flag is refused by the
/// parser.
#[test]
fn moe_gpu_lines_parse() {
    let script = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("scripts/device/moe.sh");
    let text = std::fs::read_to_string(&script)
        .unwrap()
        .replace("\\\n", " ");
    let lines: Vec<Vec<String>> = text
        .lines()
        .filter_map(|l| l.split_once("\"$BIN\" gpu ").map(|(_, rest)| rest))
        .filter(|rest| rest.starts_with("decode") || rest.starts_with("prefill"))
        .map(|rest| {
            rest.split_whitespace()
                .take_while(|a| !a.starts_with('>') && !a.starts_with("2>") && *a != "|")
                .map(str::to_string)
                .collect()
        })
        .collect();
    assert_eq!(
        lines.len(),
        3,
        "decode, profiled decode and prefill: {lines:?}"
    );
    let parses = |args: &[String]| {
        let out = Command::new(env!("CARGO_BIN_EXE_strata"))
            .arg("gpu")
            .args(args)
            .output()
            .unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
        (out.status.code() != Some(2), stderr)
    };
    for arm in [None, Some("--moe-grouped")] {
        for line in &lines {
            let args: Vec<String> = line
                .iter()
                .filter_map(|a| match a.as_str() {
                    "\"${flag[@]}\"" => arm.map(str::to_string),
                    "\"$BENCH_CONFIG\"" => Some("configs/qwen3-30b-a3b.json".into()),
                    "\"$BATCHES\"" => Some("1,8".into()),
                    "\"${PROMPTS:-512,4096}\"" => Some("512".into()),
                    a if a.contains('$') => Some("/tmp/unused.json".into()),
                    a => Some(a.to_string()),
                })
                .collect();
            let (parsed, stderr) = parses(&args);
            assert!(parsed, "{args:?}: {stderr}");
        }
    }
    let mut misspelt = lines[0].clone();
    misspelt.push("--moe-groupd".into());
    let (parsed, stderr) = parses(&misspelt);
    assert!(!parsed, "a misspelt flag got past the parser: {stderr}");
}
