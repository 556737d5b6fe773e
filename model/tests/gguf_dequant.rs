//! The dequantizers against the `gguf` Python package's own (`gguf.quants.dequantize`, 0.19.0):
//! every element of every fixture must match bit for bit. The fixtures are written by
//! `scripts/gguf_fixtures.py`; a canary flips one input bit and checks the comparison notices.

use std::path::PathBuf;

use strata_model::gguf::{GgmlType, dequantize, dequantize_into};

/// One oracle fixture: the input bytes and the f32 bits the oracle produced from them.
struct Fixture {
    ty: GgmlType,
    input: Vec<u8>,
    expected: Vec<u32>,
}

/// (file stem, type, byte offset of an f16 scale in the first block whose sign flip must change
/// the output, or of the first element's high byte for the plain types).
const FIXTURES: [(&str, GgmlType, usize); 13] = [
    ("f32", GgmlType::F32, 3),
    ("f16", GgmlType::F16, 1),
    ("bf16", GgmlType::BF16, 1),
    ("q4_0", GgmlType::Q4_0, 1),
    ("q4_1", GgmlType::Q4_1, 1),
    ("q5_0", GgmlType::Q5_0, 1),
    ("q5_1", GgmlType::Q5_1, 1),
    ("q8_0", GgmlType::Q8_0, 1),
    ("q2_k", GgmlType::Q2_K, 81),
    ("q3_k", GgmlType::Q3_K, 109),
    ("q4_k", GgmlType::Q4_K, 1),
    ("q5_k", GgmlType::Q5_K, 1),
    ("q6_k", GgmlType::Q6_K, 209),
];

fn fixture_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/gguf")
}

fn u32_at(bytes: &[u8], at: usize) -> u32 {
    u32::from_le_bytes(bytes[at..at + 4].try_into().expect("4 bytes"))
}

fn load(stem: &str) -> Fixture {
    let path = fixture_dir().join(format!("{stem}.bin"));
    let bytes = std::fs::read(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    assert_eq!(&bytes[..4], b"GQDQ", "{stem}: magic");
    let ty = GgmlType::from_id(u32_at(&bytes, 4)).expect("known type id");
    let n_elements = u32_at(&bytes, 8) as usize;
    let n_bytes = u32_at(&bytes, 12) as usize;
    let input = bytes[16..16 + n_bytes].to_vec();
    let expected: Vec<u32> = bytes[16 + n_bytes..]
        .chunks_exact(4)
        .map(|c| u32::from_le_bytes(c.try_into().expect("4 bytes")))
        .collect();
    assert_eq!(expected.len(), n_elements, "{stem}: element count");
    Fixture {
        ty,
        input,
        expected,
    }
}

/// Elements whose bits differ from the oracle's.
fn mismatches(fixture: &Fixture, input: &[u8]) -> usize {
    let got = dequantize(fixture.ty, input, fixture.expected.len() as u64).expect("dequantize");
    assert_eq!(got.len(), fixture.expected.len());
    got.iter()
        .zip(&fixture.expected)
        .filter(|(g, e)| g.to_bits() != **e)
        .count()
}

#[test]
fn every_type_is_bit_exact_against_gguf_py() {
    let mut total = 0;
    for (stem, ty, _) in FIXTURES {
        let fixture = load(stem);
        assert_eq!(fixture.ty, ty, "{stem}: type id");
        assert!(
            fixture.expected.len() >= 4 * ty.block_size(),
            "{stem}: at least a few blocks"
        );
        let bad = mismatches(&fixture, &fixture.input);
        assert_eq!(
            bad,
            0,
            "{stem}: {bad} of {} elements differ",
            fixture.expected.len()
        );
        total += fixture.expected.len();
    }
    assert!(total > 20_000, "{total} elements compared");
}

#[test]
fn the_into_form_agrees_and_checks_the_output_length() {
    for (stem, ty, _) in FIXTURES {
        let fixture = load(stem);
        let mut out = vec![f32::NAN; fixture.expected.len()];
        dequantize_into(ty, &fixture.input, &mut out).expect("dequantize_into");
        assert!(
            out.iter()
                .zip(&fixture.expected)
                .all(|(g, e)| g.to_bits() == *e),
            "{stem}"
        );
        let mut short = vec![0.0; fixture.expected.len() - 1];
        assert!(
            dequantize_into(ty, &fixture.input, &mut short).is_err(),
            "{stem}"
        );
    }
}

#[test]
fn canary_one_flipped_input_bit_is_noticed() {
    for (stem, _, sign_byte) in FIXTURES {
        let fixture = load(stem);
        let mut input = fixture.input.clone();
        input[sign_byte] ^= 0x80;
        let bad = mismatches(&fixture, &input);
        assert!(bad > 0, "{stem}: flipping a sign bit changed nothing");
    }
}

#[test]
fn quantized_fixtures_are_finite() {
    // The oracle's scales were drawn finite, so a NaN or infinity here would be a kernel bug the
    // bit comparison already rejects; this keeps the fixtures honest about what they cover.
    for (stem, ty, _) in FIXTURES {
        if ty.block_size() == 1 {
            continue;
        }
        let fixture = load(stem);
        assert!(
            fixture
                .expected
                .iter()
                .all(|&bits| f32::from_bits(bits).is_finite()),
            "{stem}"
        );
    }
}
