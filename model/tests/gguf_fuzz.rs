//! Bad GGUF files never crash strata: a bounded, seeded fuzz run over mutations of a real file's
//! header (SmolLM2-135M-Instruct, fetched by `scripts/fetch-test-data.sh`).
//!
//! Each case flips bits, overwrites bytes or little-endian integers with extreme values, or
//! truncates — in the first kilobyte (magic, version, counts, the first keys), in the tensor table
//! at the end of the header, or anywhere in the metadata — then parses the result and, when it
//! parses, reads everything strata would read from it: the model config, the tokenizer, the chat
//! templates, the end tokens and a few tensors dequantized. Every outcome must be a value or an
//! error; a panic fails the test with the seed and case that caused it. The run is bounded by a
//! case count and a wall-clock budget so CI time stays fixed.

#[path = "../../tests/fuzz/mod.rs"]
mod fuzz;

use std::panic::{AssertUnwindSafe, catch_unwind};
use std::path::Path;
use std::time::{Duration, Instant};

use rand_chacha::ChaCha8Rng;
use rand_core::{Rng, SeedableRng};
use strata_model::gguf::{self, Gguf};

const SEED: u64 = 0x5eed_6767;
const MAX_CASES: usize = 4_000;
const BUDGET: Duration = Duration::from_secs(40);
/// Bytes near the end of the header that hold the tensor table (272 entries of ~40 bytes).
const TABLE_SPAN: usize = 16 << 10;

fn model_bytes() -> Vec<u8> {
    let path = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../target/test-data/models/SmolLM2-135M-Instruct.Q4_1.gguf");
    std::fs::read(&path).unwrap_or_else(|e| {
        panic!(
            "{}: {e}; run scripts/fetch-test-data.sh from the repository root",
            path.display()
        )
    })
}

/// Everything strata reads from a parsed file; the results are dropped, only panics matter.
fn exercise(file: &Gguf<'_>, deep: bool) {
    let header = file.header();
    let _ = gguf::model_config(header);
    let _ = gguf::special_tokens(header);
    let _ = gguf::chat_templates(header);
    let _ = gguf::end_token_ids(header);
    if deep {
        let _ = gguf::tokenizer(header);
    }
    for tensor in file.tensors().take(3) {
        if let Ok(t) = tensor
            && t.bytes().len() <= 1 << 20
        {
            let _ = t.dequantize();
        }
    }
}

/// One campaign of at most `max_cases` cases within `budget`, from `seed`.
fn campaign(seed: u64, max_cases: usize, budget: Duration) -> fuzz::Report {
    let original = model_bytes();
    let data_offset = Gguf::parse(&original)
        .expect("the real file parses")
        .header()
        .data_offset() as usize;
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    let mut buf = original.clone();
    let started = Instant::now();
    let (mut cases, mut parsed) = (0usize, 0usize);
    while cases < max_cases && started.elapsed() < budget {
        cases += 1;
        let region = match rng.next_u32() % 10 {
            0..=3 => 0..1024,
            4..=6 => data_offset.saturating_sub(TABLE_SPAN)..data_offset,
            _ => 0..data_offset,
        };
        let at = |rng: &mut ChaCha8Rng| region.start + rng.next_u32() as usize % region.len();
        let mut touched = Vec::new();
        let mut len = buf.len();
        for _ in 0..1 + rng.next_u32() % 4 {
            match rng.next_u32() % 5 {
                0 => {
                    let i = at(&mut rng);
                    touched.push(i);
                    buf[i] ^= 1 << (rng.next_u32() % 8);
                }
                1 => {
                    let i = at(&mut rng);
                    touched.push(i);
                    buf[i] = rng.next_u32() as u8;
                }
                2 | 3 => {
                    // A count, length, type or offset field made extreme.
                    let i = at(&mut rng).min(data_offset - 8);
                    let value: u64 = match rng.next_u32() % 6 {
                        0 => 0,
                        1 => u64::MAX,
                        2 => u32::MAX as u64,
                        3 => 1 << 63,
                        4 => rng.next_u64() % 64,
                        _ => rng.next_u64(),
                    };
                    let width = if rng.next_u32() % 2 == 0 { 4 } else { 8 };
                    buf[i..i + width].copy_from_slice(&value.to_le_bytes()[..width]);
                    touched.extend(i..i + width);
                }
                _ => len = at(&mut rng),
            }
        }
        let case = &buf[..len];
        let outcome = catch_unwind(AssertUnwindSafe(|| {
            if let Ok(file) = Gguf::parse(case) {
                exercise(&file, cases % 25 == 0);
                true
            } else {
                false
            }
        }));
        match outcome {
            Ok(ok) => parsed += usize::from(ok),
            Err(_) => panic!(
                "case {cases} (seed {seed:#x}) panicked: bytes {touched:?}, length {len} of {}",
                buf.len()
            ),
        }
        for i in touched {
            buf[i] = original[i];
        }
    }
    fuzz::Report::of(
        "gguf header",
        seed,
        started,
        cases,
        &[("parsed", parsed), ("refused", cases - parsed)],
    )
}

#[test]
fn mutated_real_headers_never_panic() {
    let report = campaign(SEED, MAX_CASES, BUDGET);
    let (cases, parsed) = (report.cases, report.count("parsed"));
    assert!(cases >= 200, "too few cases ran ({cases}) to mean anything");
    assert!(
        parsed > 0 && parsed < cases,
        "both outcomes must occur: {parsed} of {cases} parsed"
    );
}

#[test]
#[ignore = "a recorded ten-minute run: scripts/fuzz-long.sh"]
fn gguf_headers_for_ten_minutes() {
    campaign(SEED + 1, usize::MAX, fuzz::LONG);
}
