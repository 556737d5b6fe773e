//! The GGUF reader: files built here round-trip; every kind of malformation is a typed error;
//! truncations and a fixed-seed storm of mutations never panic; and a file written by the `gguf`
//! Python package's `GGUFWriter` reads back as the script that wrote it recorded.

use std::path::PathBuf;

use sha2::{Digest, Sha256};
use strata_model::gguf::{
    GgmlType, Gguf, GgufArray, GgufError, GgufFile, GgufValue, GgufValueType, MAX_ARRAY_DEPTH,
    encode_string,
};

/// One tensor-table entry as written, free to be wrong.
#[derive(Clone)]
struct RawTensor {
    name: String,
    dims: Vec<u64>,
    type_id: u32,
    offset: u64,
}

/// A minimal GGUF writer whose every field can be set to something invalid.
#[derive(Clone)]
struct Builder {
    version: u32,
    alignment: u64,
    metadata: Vec<(String, GgufValue)>,
    tensors: Vec<RawTensor>,
    data: Vec<u8>,
}

impl Builder {
    fn new() -> Self {
        Self {
            version: 3,
            alignment: 32,
            metadata: Vec::new(),
            tensors: Vec::new(),
            data: Vec::new(),
        }
    }

    fn kv(mut self, key: &str, value: GgufValue) -> Self {
        if key == "general.alignment"
            && let GgufValue::U32(a) = value
        {
            self.alignment = u64::from(a.max(1));
        }
        self.metadata.push((key.to_string(), value));
        self
    }

    /// Appends a tensor's bytes at the next aligned offset of the data section.
    fn tensor(mut self, name: &str, dims: &[u64], ty: GgmlType, bytes: &[u8]) -> Self {
        let offset = (self.data.len() as u64).next_multiple_of(self.alignment);
        self.data.resize(offset as usize, 0);
        self.data.extend_from_slice(bytes);
        self.tensors.push(RawTensor {
            name: name.to_string(),
            dims: dims.to_vec(),
            type_id: ty.id(),
            offset,
        });
        self
    }

    fn build(&self) -> Vec<u8> {
        let mut out = b"GGUF".to_vec();
        out.extend(self.version.to_le_bytes());
        out.extend((self.tensors.len() as u64).to_le_bytes());
        out.extend((self.metadata.len() as u64).to_le_bytes());
        for (key, value) in &self.metadata {
            encode_string(&mut out, key);
            out.extend(value.value_type().id().to_le_bytes());
            value.encode(&mut out);
        }
        for t in &self.tensors {
            encode_string(&mut out, &t.name);
            out.extend((t.dims.len() as u32).to_le_bytes());
            for d in &t.dims {
                out.extend(d.to_le_bytes());
            }
            out.extend(t.type_id.to_le_bytes());
            out.extend(t.offset.to_le_bytes());
        }
        out.resize(
            (out.len() as u64).next_multiple_of(self.alignment) as usize,
            0,
        );
        out.extend(&self.data);
        out
    }
}

fn array(element_type: GgufValueType, values: Vec<GgufValue>) -> GgufValue {
    GgufValue::Array(GgufArray {
        element_type,
        values,
    })
}

/// Metadata of every value type, nested and empty arrays included.
fn every_value() -> Vec<(&'static str, GgufValue)> {
    vec![
        ("general.architecture", GgufValue::String("llama".into())),
        ("v.u8", GgufValue::U8(255)),
        ("v.i8", GgufValue::I8(-128)),
        ("v.u16", GgufValue::U16(65535)),
        ("v.i16", GgufValue::I16(-32768)),
        ("v.u32", GgufValue::U32(u32::MAX)),
        ("v.i32", GgufValue::I32(i32::MIN)),
        ("v.u64", GgufValue::U64(u64::MAX)),
        ("v.i64", GgufValue::I64(i64::MIN)),
        ("v.f32", GgufValue::F32(-1.5e-7)),
        ("v.f64", GgufValue::F64(std::f64::consts::PI)),
        ("v.bool", GgufValue::Bool(true)),
        ("v.string", GgufValue::String("ünïcödé ✓".into())),
        ("v.empty_string", GgufValue::String(String::new())),
        (
            "v.array_u32",
            array(
                GgufValueType::U32,
                (0..5).map(|i| GgufValue::U32(i * 7)).collect(),
            ),
        ),
        (
            "v.array_str",
            array(
                GgufValueType::String,
                vec![
                    GgufValue::String("a".into()),
                    GgufValue::String("bc".into()),
                ],
            ),
        ),
        ("v.array_empty", array(GgufValueType::F64, vec![])),
        (
            "v.array_nested",
            array(
                GgufValueType::Array,
                vec![
                    array(GgufValueType::Bool, vec![GgufValue::Bool(false)]),
                    array(GgufValueType::I16, vec![]),
                ],
            ),
        ),
    ]
}

fn f32_bytes(values: &[f32]) -> Vec<u8> {
    values.iter().flat_map(|v| v.to_le_bytes()).collect()
}

/// A valid file: every value type, and tensors of a plain, a 32-block and a 256-block type, the
/// last ending exactly at the end of the file.
fn valid_builder() -> Builder {
    let mut b = Builder::new();
    for (key, value) in every_value() {
        b = b.kv(key, value);
    }
    let q8: Vec<u8> = (0..2 * 34).map(|i| (i * 37 % 251) as u8 & 0x7b).collect();
    let q4k: Vec<u8> = (0..144).map(|i| (i * 13 % 256) as u8 & 0x3b).collect();
    b.tensor(
        "w.f32",
        &[3, 2],
        GgmlType::F32,
        &f32_bytes(&[1., 2., 3., 4., 5., 6.]),
    )
    .tensor("w.q8_0", &[32, 2], GgmlType::Q8_0, &q8)
    .tensor("w.q4_k", &[256], GgmlType::Q4_K, &q4k)
}

#[test]
fn a_built_file_reads_back_whole() {
    let bytes = valid_builder().build();
    let gguf = Gguf::parse(&bytes).expect("parse");
    let header = gguf.header();
    assert_eq!(header.version(), 3);
    assert_eq!(header.alignment(), 32);
    assert_eq!(header.data_offset() % 32, 0);

    let expected = every_value();
    let read: Vec<_> = header.metadata_entries().collect();
    assert_eq!(read.len(), expected.len());
    for ((key, value), (want_key, want)) in read.iter().zip(&expected) {
        assert_eq!(key, want_key);
        assert_eq!(*value, want, "{key}");
        assert_eq!(gguf.metadata(key), Some(want));
    }
    assert_eq!(header.get_u8("v.u8"), Some(255));
    assert_eq!(header.get_i64("v.i64"), Some(i64::MIN));
    assert_eq!(header.get_f32("v.f32"), Some(-1.5e-7));
    assert_eq!(header.get_bool("v.bool"), Some(true));
    assert_eq!(header.get_str("general.architecture"), Some("llama"));
    assert_eq!(header.get_u32("general.architecture"), None, "strict types");
    assert_eq!(
        header.get_array("v.array_u32").map(|a| a.values.len()),
        Some(5)
    );
    assert_eq!(header.metadata("absent"), None);

    let names: Vec<_> = gguf
        .tensors()
        .map(|t| t.expect("tensor").name().to_string())
        .collect();
    assert_eq!(names, ["w.f32", "w.q8_0", "w.q4_k"]);
    let w = gguf.tensor("w.f32").expect("w.f32");
    assert_eq!(w.dims(), [3, 2]);
    assert_eq!(w.ty(), GgmlType::F32);
    assert_eq!(w.n_elements(), 6);
    assert_eq!(w.dequantize().expect("f32"), [1., 2., 3., 4., 5., 6.]);
    let q = gguf.tensor("w.q4_k").expect("w.q4_k");
    assert_eq!((q.bytes().len(), q.n_elements()), (144, 256));
    assert_eq!(q.dequantize().expect("q4_k").len(), 256);
    assert!(matches!(
        gguf.tensor("w.absent"),
        Err(GgufError::MissingTensor { .. })
    ));
}

#[test]
fn version_2_and_custom_alignment_read() {
    let mut b = Builder::new().kv("general.alignment", GgufValue::U32(64));
    b.version = 2;
    let b = b
        .tensor("a", &[3], GgmlType::F16, &[0, 0x3c, 0, 0xc0, 0, 0])
        .tensor("b", &[2], GgmlType::BF16, &[0x80, 0x3f, 0, 0]);
    let bytes = b.build();
    let gguf = Gguf::parse(&bytes).expect("parse");
    assert_eq!(gguf.header().version(), 2);
    assert_eq!(gguf.header().alignment(), 64);
    assert_eq!(gguf.header().data_offset() % 64, 0);
    assert_eq!(gguf.tensor("b").expect("b").info().offset(), 64);
    assert_eq!(
        gguf.tensor("a").expect("a").dequantize().expect("f16"),
        [1.0, -2.0, 0.0]
    );
    assert_eq!(
        gguf.tensor("b").expect("b").dequantize().expect("bf16"),
        [1.0, 0.0]
    );
}

#[test]
fn a_file_with_no_tensors_needs_no_data_section() {
    let bytes = Builder::new().kv("k", GgufValue::U8(1)).build();
    let gguf = Gguf::parse(&bytes[..bytes.len() - 3]).expect("padding is optional");
    assert_eq!(gguf.tensors().count(), 0);
}

fn parse_err(bytes: &[u8]) -> GgufError {
    match Gguf::parse(bytes) {
        Ok(_) => panic!("a malformed file parsed"),
        Err(e) => e,
    }
}

/// Byte offset of the metadata count in the header.
const KV_COUNT_AT: usize = 16;

#[test]
fn header_errors_name_the_problem() {
    let good = valid_builder().build();

    let mut bad = good.clone();
    bad[0] = b'X';
    assert!(matches!(parse_err(&bad), GgufError::BadMagic { .. }));

    for version in [0, 1, 4, u32::MAX] {
        let mut b = valid_builder();
        b.version = version;
        let err = parse_err(&b.build());
        assert!(
            matches!(err, GgufError::UnsupportedVersion { version: v } if v == version),
            "{err}"
        );
    }

    // One entry: key length at 24, key at 32, value type at 35, the u32 value at 39..43.
    let small = Builder::new().kv("key", GgufValue::U32(7)).build();
    let err = parse_err(&small[..41]);
    assert!(
        matches!(
            err,
            GgufError::Truncated {
                offset: 39,
                needed: 4,
                available: 2,
                ..
            }
        ),
        "{err}"
    );
    assert!(err.to_string().contains("truncated at byte 39"), "{err}");

    // A count that lies: checked against the bytes left before anything is allocated.
    let mut bad = good.clone();
    bad[KV_COUNT_AT..KV_COUNT_AT + 8].copy_from_slice(&u64::MAX.to_le_bytes());
    assert!(matches!(
        parse_err(&bad),
        GgufError::CountTooLarge { offset: 16, .. }
    ));
    let mut bad = good.clone();
    bad[8..16].copy_from_slice(&(1u64 << 40).to_le_bytes());
    assert!(matches!(
        parse_err(&bad),
        GgufError::CountTooLarge { offset: 8, .. }
    ));
}

#[test]
fn metadata_errors_name_the_problem() {
    let count_lie = Builder::new()
        .kv("a", array(GgufValueType::U64, vec![GgufValue::U64(1); 2]))
        .build();
    // The array's count sits after key (8 + 1), value type (4) and element type (4).
    let at = 24 + 9 + 4 + 4;
    let mut bad = count_lie.clone();
    bad[at..at + 8].copy_from_slice(&(u64::MAX / 2).to_le_bytes());
    assert!(matches!(parse_err(&bad), GgufError::CountTooLarge { .. }));

    let mut bad = count_lie.clone();
    bad[24..32].copy_from_slice(&(1u64 << 50).to_le_bytes());
    assert!(matches!(
        parse_err(&bad),
        GgufError::Truncated { offset: 32, .. }
    ));

    let mut bad = count_lie.clone();
    bad[24 + 9..24 + 13].copy_from_slice(&13u32.to_le_bytes());
    assert!(matches!(
        parse_err(&bad),
        GgufError::UnknownValueType { id: 13, offset: 33 }
    ));

    // A one-letter key puts its value at byte 24 + 8 + 1 + 4 = 37.
    let mut bad = Builder::new().kv("k", GgufValue::Bool(true)).build();
    bad[37] = 2;
    assert!(matches!(
        parse_err(&bad),
        GgufError::InvalidBool { byte: 2, .. }
    ));

    let mut bad = Builder::new()
        .kv("k", GgufValue::String("ab".into()))
        .build();
    bad[37 + 8 + 1] = 0xff;
    assert!(matches!(parse_err(&bad), GgufError::InvalidUtf8 { .. }));

    let dup = Builder::new()
        .kv("k", GgufValue::U8(1))
        .kv("k", GgufValue::U8(2))
        .build();
    assert!(matches!(parse_err(&dup), GgufError::DuplicateKey { .. }));

    let mut deep = GgufValue::U8(0);
    for _ in 0..=MAX_ARRAY_DEPTH {
        deep = array(deep.value_type(), vec![deep]);
    }
    let err = parse_err(&Builder::new().kv("deep", deep).build());
    assert!(matches!(err, GgufError::NestingTooDeep { .. }), "{err}");

    for bad_alignment in [GgufValue::U32(0), GgufValue::U32(48), GgufValue::U64(32)] {
        let bytes = Builder::new()
            .kv("general.alignment", bad_alignment)
            .build();
        assert!(matches!(parse_err(&bytes), GgufError::BadAlignment { .. }));
    }
}

#[test]
fn tensor_errors_name_the_problem() {
    let with = |edit: &dyn Fn(&mut RawTensor)| {
        let mut b = valid_builder();
        edit(&mut b.tensors[1]);
        parse_err(&b.build())
    };
    assert!(matches!(
        with(&|t| t.type_id = 4),
        GgufError::UnknownGgmlType { id: 4, .. }
    ));
    assert!(matches!(
        with(&|t| t.dims = vec![1 << 32, 1 << 32]),
        GgufError::DimsOverflow { .. }
    ));
    assert!(matches!(
        with(&|t| t.dims = vec![1, 2, 3, 4, 5]),
        GgufError::TooManyDims { n_dims: 5, .. }
    ));
    assert!(matches!(
        with(&|t| t.dims = vec![31, 2]),
        GgufError::PartialBlock { n_elements: 62, .. }
    ));
    assert!(matches!(
        with(&|t| t.offset += 16),
        GgufError::MisalignedOffset { offset: 48, .. }
    ));
    assert!(matches!(
        with(&|t| t.offset += 1 << 20),
        GgufError::OutOfBounds { .. }
    ));
    assert!(matches!(
        with(&|t| t.offset = u64::MAX - 31),
        GgufError::OutOfBounds { .. }
    ));
    assert!(matches!(
        with(&|t| t.dims = vec![1 << 62]),
        GgufError::OutOfBounds { .. }
    ));
    assert!(matches!(
        with(&|t| t.dims = vec![u64::MAX - 31]),
        GgufError::SizeOverflow { .. } | GgufError::OutOfBounds { .. }
    ));
    assert!(matches!(
        with(&|t| t.name = "w.f32".into()),
        GgufError::DuplicateTensor { .. }
    ));
    let bytes = valid_builder().build();
    let err = parse_err(&bytes[..bytes.len() - 1]);
    assert!(matches!(err, GgufError::OutOfBounds { .. }), "{err}");
}

#[test]
fn every_truncation_is_an_error() {
    let bytes = valid_builder().build();
    assert!(Gguf::parse(&bytes).is_ok());
    for len in 0..bytes.len() {
        assert!(Gguf::parse(&bytes[..len]).is_err(), "truncated to {len}");
    }
}

/// xorshift64*: a fixed-seed source for the mutation storm.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }

    fn below(&mut self, n: usize) -> usize {
        (self.next() % n as u64) as usize
    }
}

/// Exercises everything a parsed file offers; must never panic whatever the bytes were.
fn use_fully(gguf: &Gguf<'_>) -> usize {
    let mut touched = gguf.header().metadata_entries().count();
    for tensor in gguf.tensors() {
        let tensor = tensor.expect("a parsed tensor table yields its tensors");
        assert_eq!(tensor.bytes().len() as u64, tensor.info().byte_len());
        if let Ok(values) = tensor.dequantize() {
            touched += values.len();
        }
    }
    touched
}

#[test]
fn mutations_are_ok_or_typed_errors_never_panics() {
    let written = std::fs::read(fixture("writer.gguf")).expect("writer.gguf");
    for (base, seed) in [(valid_builder().build(), 1), (written, 2)] {
        mutation_storm(&base, 0x5eed_6775_6600_0000 + seed, 2500);
    }
}

/// `rounds` mutations of `good`'s header (random bytes, flipped bits, edge-valued u64 counts,
/// lengths, dims and offsets, small u32 type ids, truncations), each parsed and, when it parses,
/// used fully.
fn mutation_storm(good: &[u8], seed: u64, rounds: usize) {
    let header_len = Gguf::parse(good).expect("parse").header().data_offset() as usize;
    let interesting: [u64; 8] = [
        0,
        1,
        31,
        u32::MAX as u64,
        u64::MAX,
        1 << 63,
        good.len() as u64,
        header_len as u64,
    ];
    let mut rng = Rng(seed);
    let (mut ok, mut errors) = (0, 0);
    let mut kinds = std::collections::HashSet::new();
    for round in 0..rounds {
        let mut bytes = good.to_vec();
        for _ in 0..1 + rng.below(3) {
            match rng.below(4) {
                0 => bytes[rng.below(header_len)] = rng.next() as u8,
                1 => bytes[rng.below(header_len)] ^= 1 << rng.below(8),
                2 => {
                    let at = rng.below(header_len - 8);
                    let value = interesting[rng.below(interesting.len())];
                    bytes[at..at + 8].copy_from_slice(&value.to_le_bytes());
                }
                _ => {
                    let at = rng.below(header_len - 4);
                    bytes[at..at + 4].copy_from_slice(&(rng.below(48) as u32).to_le_bytes());
                }
            }
        }
        if round % 3 == 0 {
            bytes.truncate(rng.below(bytes.len() + 1));
        }
        match Gguf::parse(&bytes) {
            Ok(gguf) => {
                use_fully(&gguf);
                ok += 1;
            }
            Err(e) => {
                assert!(!e.to_string().is_empty());
                kinds.insert(std::mem::discriminant(&e));
                errors += 1;
            }
        }
    }
    eprintln!("{ok} parsed, {errors} errors of {} kinds", kinds.len());
    assert!(ok > 20 && errors > rounds / 2, "ok {ok}, errors {errors}");
    assert!(
        kinds.len() >= 8,
        "the mutations reach {} error kinds",
        kinds.len()
    );
}

fn fixture(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures/gguf")
        .join(name)
}

/// A value recorded by `scripts/gguf_fixtures.py`, as the reader should have decoded it.
fn expected_value(record: &serde_json::Value) -> GgufValue {
    let ty = record["type"].as_str().expect("type");
    let int = || record["value"].as_i64().expect("integer");
    match ty {
        "UINT8" => GgufValue::U8(int() as u8),
        "INT8" => GgufValue::I8(int() as i8),
        "UINT16" => GgufValue::U16(int() as u16),
        "INT16" => GgufValue::I16(int() as i16),
        "UINT32" => GgufValue::U32(int() as u32),
        "INT32" => GgufValue::I32(int() as i32),
        "UINT64" => GgufValue::U64(record["value"].as_u64().expect("u64")),
        "INT64" => GgufValue::I64(int()),
        "FLOAT32" => GgufValue::F32(f32::from_bits(record["bits"].as_u64().expect("bits") as u32)),
        "FLOAT64" => GgufValue::F64(f64::from_bits(record["bits"].as_u64().expect("bits"))),
        "BOOL" => GgufValue::Bool(record["value"].as_bool().expect("bool")),
        "STRING" => GgufValue::String(record["value"].as_str().expect("str").to_string()),
        "ARRAY" => {
            let element = record["element"].as_str().expect("element");
            let element_type = (0..13)
                .filter_map(GgufValueType::from_id)
                .find(|t| format!("{t:?}").eq_ignore_ascii_case(short_name(element)))
                .expect("element type");
            let values = record["items"]
                .as_array()
                .expect("items")
                .iter()
                .map(expected_value)
                .collect();
            array(element_type, values)
        }
        other => panic!("unknown type {other}"),
    }
}

/// gguf-py's value type names, as this crate spells them.
fn short_name(python: &str) -> &str {
    match python {
        "UINT8" => "U8",
        "INT8" => "I8",
        "UINT16" => "U16",
        "INT16" => "I16",
        "UINT32" => "U32",
        "INT32" => "I32",
        "UINT64" => "U64",
        "INT64" => "I64",
        "FLOAT32" => "F32",
        "FLOAT64" => "F64",
        other => other,
    }
}

fn sha256_hex(bytes: &[u8]) -> String {
    Sha256::digest(bytes)
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}

#[test]
fn a_file_from_gguf_py_writer_reads_back_as_recorded() {
    let text = std::fs::read_to_string(fixture("writer.json")).expect("writer.json");
    let record: serde_json::Value = serde_json::from_str(&text).expect("json");
    let file = GgufFile::open(&fixture("writer.gguf")).expect("open");
    let header = file.header();
    assert_eq!(
        u64::from(header.version()),
        record["version"].as_u64().expect("v")
    );
    assert_eq!(header.alignment(), record["alignment"].as_u64().expect("a"));

    let metadata = record["metadata"].as_object().expect("metadata");
    assert_eq!(header.metadata_entries().len(), metadata.len());
    for (key, value) in metadata {
        assert_eq!(file.metadata(key), Some(&expected_value(value)), "{key}");
    }

    let tensors = record["tensors"].as_array().expect("tensors");
    assert_eq!(file.tensors().count(), tensors.len());
    for (tensor, want) in file.tensors().zip(tensors) {
        let tensor = tensor.expect("tensor");
        assert_eq!(tensor.name(), want["name"].as_str().expect("name"));
        let dims: Vec<u64> = want["dims"]
            .as_array()
            .expect("dims")
            .iter()
            .map(|d| d.as_u64().expect("dim"))
            .collect();
        assert_eq!(tensor.dims(), dims, "{}", tensor.name());
        assert_eq!(
            u64::from(tensor.ty().id()),
            want["type"].as_u64().expect("type")
        );
        assert_eq!(
            sha256_hex(tensor.bytes()),
            want["bytes_sha256"],
            "{}",
            tensor.name()
        );
        let values = tensor.dequantize().expect("dequantize");
        let le: Vec<u8> = values.iter().flat_map(|v| v.to_le_bytes()).collect();
        assert_eq!(sha256_hex(&le), want["f32_sha256"], "{}", tensor.name());
    }
}

#[test]
fn open_reports_the_path() {
    let missing = fixture("no-such-file.gguf");
    let err = GgufFile::open(&missing).err().expect("missing file");
    assert!(matches!(err, GgufError::Io { .. }));
    let not_gguf = fixture("q4_0.bin");
    let err = GgufFile::open(&not_gguf).err().expect("not a GGUF file");
    assert!(matches!(err, GgufError::InFile { .. }));
    assert!(err.to_string().contains("q4_0.bin"), "{err}");
}
