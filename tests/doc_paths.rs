//! Every source path the docs cite exists (issue 37): a path in README.md or docs/*.md that names
//! a file by its extension must be a file of the repository — from the root, from the doc's
//! folder, or as the tail of a tracked path (docs write `cuda/forward.rs` within a paragraph about
//! `node/src/backend/`). `path/to/…` is a placeholder. A file moved without its docs fails here.

use std::path::{Path, PathBuf};
use std::process::Command;

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

fn tracked() -> Vec<String> {
    let out = Command::new("git")
        .args(["ls-files"])
        .current_dir(root())
        .output()
        .expect("git ls-files");
    String::from_utf8(out.stdout)
        .expect("utf-8 paths")
        .lines()
        .map(str::to_string)
        .collect()
}

/// The paths `text` cites: at least one folder, a file name with a source or data extension.
fn cited(text: &str) -> Vec<String> {
    let re = regex::Regex::new(
        r"(?:^|[^\w./-])((?:[a-z_][\w-]*/)+[\w.-]+\.(?:rs|md|sh|py|cuh|cu|json|toml|yaml|yml|txt))(?:[^\w]|$)",
    )
    .expect("a valid pattern");
    re.captures_iter(text).map(|c| c[1].to_string()).collect()
}

fn missing(doc: &Path, tracked: &[String]) -> Vec<String> {
    let text = std::fs::read_to_string(doc).expect("a doc");
    let dir = doc.parent().expect("a folder");
    cited(&text)
        .into_iter()
        .filter(|p| !p.starts_with("path/to/"))
        .filter(|p| {
            !root().join(p).exists()
                && !dir.join(p).exists()
                && !tracked.iter().any(|t| t.ends_with(&format!("/{p}")))
        })
        .collect()
}

#[test]
fn every_path_the_docs_cite_exists() {
    let tracked = tracked();
    let mut docs = vec![root().join("README.md")];
    for entry in std::fs::read_dir(root().join("docs")).expect("docs/") {
        let path = entry.expect("an entry").path();
        if path.extension().is_some_and(|e| e == "md") {
            docs.push(path);
        }
    }
    let mut problems = Vec::new();
    for doc in &docs {
        for p in missing(doc, &tracked) {
            problems.push(format!(
                "{}: {p}",
                doc.strip_prefix(root()).unwrap().display()
            ));
        }
    }
    assert!(
        problems.is_empty(),
        "docs cite paths that do not exist:\n{}",
        problems.join("\n")
    );
}

#[test]
fn a_moved_file_is_caught() {
    // The canary: a doc citing a file that is not there.
    let dir = tempfile::tempdir().unwrap();
    let doc = dir.path().join("X.md");
    std::fs::write(
        &doc,
        "See `node/src/scheduler.rs` and `node/src/scheduler/mod.rs`, `path/to/model.json`.",
    )
    .unwrap();
    assert_eq!(missing(&doc, &tracked()), vec!["node/src/scheduler.rs"]);
    assert_eq!(
        cited("`kernels/cuda/blocks.cuh`"),
        vec!["kernels/cuda/blocks.cuh"]
    );
}
