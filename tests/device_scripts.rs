//! Every GPU battery parses on the CPU machine before a GPU minute is spent on it: `bash -n` on
//! each `scripts/device/*.sh` and Python's compiler on each `scripts/device/*.py`. The batteries
//! whose plumbing runs end to end without a GPU are tested on their own (`spec_battery.rs`,
//! `battery_summaries.rs`); this catches the syntax slips of the rest (quant_engine.sh,
//! gguf_blocks.sh, the PyTorch peers).

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
