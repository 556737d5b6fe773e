//! One description of each architecture's decoder layer (issue 37): which tensors a family holds,
//! their shapes and how a tensor-parallel rank slices them are written once, in
//! `model/src/weights/layout.rs` (`LayerSpec`), and read by checkpoint validation, the CPU
//! reference (and its TP ranks), the CUDA upload and the quantizer. This test keeps it so: no
//! other source builds layer tensor names or spells one, and each reader goes through the spec.

use std::path::PathBuf;
use std::process::Command;

/// The one description.
const DESCRIPTION: &str = "model/src/weights/layout.rs";
/// llama.cpp's names mapped to the Hugging Face names the description uses.
const GGUF_NAME_MAP: &str = "model/src/gguf/config/mod.rs";
/// Everything that reads a layer's tensors from a checkpoint.
const READERS: [&str; 3] = [
    "model/src/cpu/weights.rs",
    "node/src/backend/cuda/weights.rs",
    "model/src/quantize/mod.rs",
];
/// How a per-layer tensor name ends in a checkpoint.
const NAME_TAILS: [&str; 4] = [
    "_proj.weight",
    "_proj.bias",
    "layernorm.weight",
    "_norm.weight",
];

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

/// Tracked non-test Rust sources and their text.
fn sources() -> Vec<(String, String)> {
    let out = Command::new("git")
        .args(["ls-files", "*.rs"])
        .current_dir(root())
        .output()
        .expect("git ls-files");
    String::from_utf8(out.stdout)
        .expect("utf-8 paths")
        .lines()
        .filter(|f| {
            !f.starts_with("tests/")
                && !f.starts_with("benches/")
                && !f.contains("/tests/")
                && !f.ends_with("/tests.rs")
        })
        .map(|f| {
            let text = std::fs::read_to_string(root().join(f)).expect("a tracked source");
            // A file's own `#[cfg(test)]` module is tests, not a reader.
            let code = text.split("#[cfg(test)]\nmod tests").next().unwrap_or("");
            (f.to_string(), code.to_string())
        })
        .collect()
}

fn problems(files: &[(String, String)]) -> Vec<String> {
    let mut out = Vec::new();
    for (file, code) in files {
        if file == DESCRIPTION {
            continue;
        }
        if code.contains("LayerNames::new(") {
            out.push(format!("{file}: builds layer tensor names (use LayerSpec)"));
        }
        if file != GGUF_NAME_MAP {
            for tail in NAME_TAILS {
                if code.contains(&format!("{tail}\"")) {
                    out.push(format!("{file}: spells a layer tensor name (…{tail})"));
                }
            }
        }
    }
    for reader in READERS {
        match files.iter().find(|(f, _)| f == reader) {
            Some((_, code)) if code.contains("LayerSpec::new(") => {}
            Some(_) => out.push(format!("{reader}: reads layers without LayerSpec")),
            None => out.push(format!("{reader}: gone (update this test's READERS)")),
        }
    }
    out
}

#[test]
fn one_layer_description_is_read_by_every_backend() {
    let files = sources();
    let found = problems(&files);
    assert!(found.is_empty(), "{}", found.join("\n"));
}

#[test]
fn the_check_sees_a_second_description() {
    let mut files = sources();
    // Canaries: a reader that names tensors itself, another source that spells a name.
    let (_, cpu) = files
        .iter_mut()
        .find(|(f, _)| f == READERS[0])
        .expect("the CPU reader");
    *cpu = cpu.replace("LayerSpec::new(", "LayerNames::new(");
    files.push((
        "node/src/elsewhere.rs".into(),
        "let n = format!(\"{p}.mlp.down_proj.weight\");".into(),
    ));
    let found = problems(&files);
    assert_eq!(found.len(), 3, "{found:#?}");
}
