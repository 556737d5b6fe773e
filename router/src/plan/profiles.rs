//! The profiles shipped in the binary: each figure copied from a receipt under docs/receipts
//! and naming it (a test reads every figure back from its receipt).

use super::Profile;

/// `(name, JSON)` of every shipped profile.
const BUILTIN: &[(&str, &str)] = &[(
    "h200-llama-3.1-8b",
    include_str!("../../profiles/h200-llama-3.1-8b.json"),
)];

/// The names of the shipped profiles.
pub fn builtin_names() -> Vec<&'static str> {
    BUILTIN.iter().map(|(name, _)| *name).collect()
}

/// The shipped profile `name`.
pub fn builtin(name: &str) -> Option<Profile> {
    let (_, text) = BUILTIN.iter().find(|(n, _)| *n == name)?;
    // A shipped profile that does not parse is caught by the tests, not at run time.
    serde_json::from_str(text).ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn value_at(receipt: &str, pointer: &str) -> f64 {
        let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("..")
            .join(receipt);
        let text =
            std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
        let doc: serde_json::Value = serde_json::from_str(&text).unwrap();
        doc.pointer(pointer)
            .and_then(serde_json::Value::as_f64)
            .unwrap_or_else(|| panic!("{receipt}: nothing at {pointer}"))
    }

    fn close(a: f64, b: f64) -> bool {
        (a - b).abs() <= 1e-4 * b.abs()
    }

    #[test]
    fn every_shipped_figure_is_its_receipts() {
        for name in builtin_names() {
            let profile = builtin(name).unwrap_or_else(|| panic!("{name} does not parse"));
            assert_eq!(profile.name, name);
            profile.check().unwrap();
            for p in &profile.decode {
                let value = value_at(&p.source.receipt, &p.source.pointer);
                assert!(
                    close(p.step_ms, value),
                    "{name} batch {}: {} vs {value}",
                    p.batch,
                    p.step_ms
                );
            }
            let pre = &profile.prefill;
            let value = value_at(&pre.source.receipt, &pre.source.pointer);
            assert!(
                close(pre.tokens_per_s, value),
                "{name} prefill {} vs {value}",
                pre.tokens_per_s
            );
        }
    }

    #[test]
    fn a_figure_off_its_receipt_is_caught() {
        // The canary: the same comparison on a changed figure must fail.
        let profile = builtin("h200-llama-3.1-8b").unwrap();
        let p = &profile.decode[0];
        let value = value_at(&p.source.receipt, &p.source.pointer);
        assert!(!close(p.step_ms * 1.01, value));
    }
}
