//! The surfaces are siblings (issue 37): no surface module reaches into another — what they share
//! lives in the serving core (`src/serving/`) — and the checkpoint's sampling defaults are
//! resolved in one place (`src/sampling.rs`). An import across surfaces fails here; should one
//! ever have to stay for a while, it is listed below, and the list only shrinks (a listed one
//! that is gone fails too).

use std::path::{Path, PathBuf};

const SURFACES: [&str; 3] = ["openai", "anthropic", "converse"];

/// (file, the other surface's module it uses), still to move under the serving core
/// (`src/serving/`).
const NOT_YET_MOVED: [(&str, &str); 0] = [];

fn src() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("src")
}

fn rust_files(dir: &Path, out: &mut Vec<PathBuf>) {
    for entry in std::fs::read_dir(dir).expect("a source folder") {
        let path = entry.expect("an entry").path();
        if path.is_dir() {
            rust_files(&path, out);
        } else if path.extension().is_some_and(|e| e == "rs") {
            out.push(path);
        }
    }
}

/// Every `use` of another surface's module: (file relative to src/, `crate::<surface>::<module>`).
fn cross_imports() -> Vec<(String, String)> {
    let mut found = Vec::new();
    for surface in SURFACES {
        let mut files = Vec::new();
        rust_files(&src().join(surface), &mut files);
        for file in files {
            let text = std::fs::read_to_string(&file).expect("a source file");
            let rel = file.strip_prefix(src()).unwrap().display().to_string();
            for line in text.lines().filter(|l| l.trim_start().starts_with("use ")) {
                for other in SURFACES.iter().filter(|&&o| o != surface) {
                    let prefix = format!("crate::{other}::");
                    if let Some(at) = line.find(&prefix) {
                        let rest = &line[at + prefix.len()..];
                        let module: String = rest
                            .chars()
                            .take_while(|c| c.is_alphanumeric() || *c == '_')
                            .collect();
                        found.push((rel.clone(), format!("crate::{other}::{module}")));
                    }
                }
            }
        }
    }
    found.sort();
    found.dedup();
    found
}

#[test]
fn no_surface_imports_another_beyond_what_is_listed() {
    let found = cross_imports();
    let listed: Vec<(String, String)> = NOT_YET_MOVED
        .iter()
        .map(|(f, m)| (f.to_string(), m.to_string()))
        .collect();
    let new: Vec<_> = found.iter().filter(|f| !listed.contains(f)).collect();
    assert!(new.is_empty(), "a surface imports another: {new:?}");
    let gone: Vec<_> = listed.iter().filter(|l| !found.contains(l)).collect();
    assert!(
        gone.is_empty(),
        "no longer imported, take off NOT_YET_MOVED: {gone:?}"
    );
}

#[test]
fn the_checkpoints_sampling_defaults_are_resolved_in_one_place() {
    let mut files = Vec::new();
    rust_files(&src(), &mut files);
    let users: Vec<String> = files
        .iter()
        .filter(|f| {
            std::fs::read_to_string(f)
                .expect("a source file")
                .contains(".sampling_defaults()")
        })
        .map(|f| f.strip_prefix(src()).unwrap().display().to_string())
        .collect();
    assert_eq!(users, vec!["sampling.rs".to_string()]);
}
