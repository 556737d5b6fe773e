#!/usr/bin/env python3
"""Oracle fixtures for strata-model's GGUF reader and dequantizers.

Run with the `gguf` package (gguf-py 0.19.0) importable, from the repository root:

    PYTHONPATH=/path/to/gguf-py python3 scripts/gguf_fixtures.py

Writes under model/tests/fixtures/gguf/:

- `<type>.bin` for every dequantized type: random blocks (fixed seed) plus edge blocks, and what
  `gguf.quants.dequantize` makes of them. Layout, little-endian:
  magic b"GQDQ", u32 ggml type id, u32 element count, u32 byte count, the input bytes, then one
  u32 (the f32 bits) per element. The f16 scale fields of quantized blocks are finite so results
  are finite; the plain F32/F16/BF16 fixtures cover every bit pattern class, NaNs included.
- `writer.gguf` and `writer.json`: a small file written by `gguf.GGUFWriter`, and what it holds
  (metadata with types, tensor table, a sha256 of each tensor's bytes and of its dequantized f32s).

The output is deterministic; rerunning it must leave the committed fixtures unchanged.
"""

from __future__ import annotations

import hashlib
import json
import struct
import sys
from pathlib import Path

import numpy as np
from gguf import GGUFWriter, GGUFValueType
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType as T
from gguf.quants import dequantize

OUT = Path(__file__).resolve().parent.parent / "model" / "tests" / "fixtures" / "gguf"

# Byte ranges of each block type's f16 scale fields (kept finite in the fixtures).
SCALE_FIELDS: dict[T, list[int]] = {
    T.Q4_0: [0],
    T.Q4_1: [0, 2],
    T.Q5_0: [0],
    T.Q5_1: [0, 2],
    T.Q8_0: [0],
    T.Q2_K: [80, 82],
    T.Q3_K: [108],
    T.Q4_K: [0, 2],
    T.Q5_K: [0, 2],
    T.Q6_K: [208],
}

RANDOM_BLOCKS = 8
PLAIN_ELEMENTS = 512


def finite_f16(rng: np.random.Generator, n: int) -> np.ndarray:
    """Random f16 bit patterns with the all-ones exponent (inf/NaN) excluded."""
    bits = rng.integers(0, 1 << 16, size=n, dtype=np.uint16)
    exp_all_ones = (bits & 0x7C00) == 0x7C00
    bits[exp_all_ones] &= np.uint16(0xBFFF)  # clear the exponent's top bit
    return bits


def quant_blocks(qtype: T, rng: np.random.Generator) -> np.ndarray:
    _, type_size = GGML_QUANT_SIZES[qtype]
    blocks = rng.integers(0, 256, size=(RANDOM_BLOCKS, type_size), dtype=np.uint8)
    for at in SCALE_FIELDS[qtype]:
        blocks[:, at:at + 2] = finite_f16(rng, RANDOM_BLOCKS).view(np.uint8).reshape(-1, 2)
    edges = []
    # (scale bits, fill byte): zero block, all-ones quants with the largest and smallest
    # magnitudes, negative zero, the smallest subnormal, the largest subnormal, one.
    for scale, fill in [
        (0x0000, 0x00),
        (0x7BFF, 0xFF),
        (0xFBFF, 0xFF),
        (0x8000, 0xA5),
        (0x0001, 0xFF),
        (0x83FF, 0x5A),
        (0x3C00, 0x0F),
    ]:
        block = np.full(type_size, fill, dtype=np.uint8)
        for at in SCALE_FIELDS[qtype]:
            block[at:at + 2] = np.array([scale], dtype=np.uint16).view(np.uint8)
        edges.append(block)
    return np.concatenate([blocks, np.stack(edges)]).reshape(-1)


def plain_bytes(qtype: T, rng: np.random.Generator) -> np.ndarray:
    _, width = GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, size=PLAIN_ELEMENTS * width, dtype=np.uint8)
    # Edge patterns: zeros, infinities, quiet and signalling NaNs with payloads, subnormals, max.
    if width == 4:
        edges = [0x00000000, 0x80000000, 0x7F800000, 0xFF800000, 0x7FC00000, 0x7F800001,
                 0xFFBFFFFF, 0x00000001, 0x807FFFFF, 0x7F7FFFFF, 0x3F800000]
        edge = np.array(edges, dtype=np.uint32).view(np.uint8)
    else:
        edges = [0x0000, 0x8000, 0x7C00, 0xFC00, 0x7E00, 0x7C01, 0xFDFF, 0x0001, 0x83FF,
                 0x7BFF, 0x3C00, 0x7F80, 0xFF81, 0x0080, 0x007F]
        edge = np.array(edges, dtype=np.uint16).view(np.uint8)
    return np.concatenate([raw, edge])


def write_dequant_fixture(qtype: T, data: np.ndarray) -> int:
    expected = np.asarray(dequantize(data, qtype), dtype=np.float32).reshape(-1)
    bits = expected.view(np.uint32).astype("<u4")
    path = OUT / f"{qtype.name.lower()}.bin"
    with path.open("wb") as f:
        f.write(b"GQDQ")
        f.write(struct.pack("<III", int(qtype), expected.size, data.size))
        f.write(data.tobytes())
        f.write(bits.tobytes())
    return expected.size


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def json_value(value, vtype: GGUFValueType, sub_type: GGUFValueType | None = None) -> dict:
    """A metadata value as the Rust test reads it back: its type name and a JSON value
    (floats as their bit patterns so comparison is exact)."""
    if vtype == GGUFValueType.ARRAY:
        element = sub_type if sub_type is not None else GGUFValueType.get_type(value[0])
        items = []
        for item in value:
            inner = None
            if element == GGUFValueType.ARRAY:
                inner = GGUFValueType.get_type(item[0])
            items.append(json_value(item, element, inner))
        return {"type": "ARRAY", "element": element.name, "items": items}
    if vtype == GGUFValueType.FLOAT32:
        return {"type": vtype.name, "bits": int(np.array(value, dtype=np.float32).view(np.uint32))}
    if vtype == GGUFValueType.FLOAT64:
        return {"type": vtype.name, "bits": int(np.array(value, dtype=np.float64).view(np.uint64))}
    return {"type": vtype.name, "value": value}


def write_gguf_fixture(rng: np.random.Generator) -> None:
    path = OUT / "writer.gguf"
    writer = GGUFWriter(path, arch="strata-test")
    entries: list[tuple[str, object, GGUFValueType, GGUFValueType | None]] = [
        ("test.u8", 200, GGUFValueType.UINT8, None),
        ("test.i8", -100, GGUFValueType.INT8, None),
        ("test.u16", 60000, GGUFValueType.UINT16, None),
        ("test.i16", -30000, GGUFValueType.INT16, None),
        ("test.u32", 4000000000, GGUFValueType.UINT32, None),
        ("test.i32", -2000000000, GGUFValueType.INT32, None),
        ("test.u64", 18000000000000000000, GGUFValueType.UINT64, None),
        ("test.i64", -9000000000000000000, GGUFValueType.INT64, None),
        ("test.f32", 3.14159, GGUFValueType.FLOAT32, None),
        ("test.f64", -2.718281828459045, GGUFValueType.FLOAT64, None),
        ("test.bool", True, GGUFValueType.BOOL, None),
        ("test.string", "héllo, ✓ gguf", GGUFValueType.STRING, None),
        ("test.array.i32", [1, -2, 3], GGUFValueType.ARRAY, GGUFValueType.INT32),
        ("test.array.f32", [0.5, -1.25], GGUFValueType.ARRAY, GGUFValueType.FLOAT32),
        ("test.array.str", ["a", "", "ünï"], GGUFValueType.ARRAY, GGUFValueType.STRING),
        ("test.array.nested", [["x", "y"], ["z"]], GGUFValueType.ARRAY, GGUFValueType.ARRAY),
    ]
    for key, value, vtype, sub_type in entries:
        writer.add_key_value(key, value, vtype, sub_type)

    tensors = []
    f32 = rng.standard_normal((3, 5)).astype(np.float32)
    f16 = rng.standard_normal((2, 7)).astype(np.float16)
    writer.add_tensor("t.f32", f32)
    writer.add_tensor("t.f16", f16)
    tensors += [("t.f32", f32.view(np.uint8).reshape(-1), T.F32, list(f32.shape)[::-1]),
                ("t.f16", f16.view(np.uint8).reshape(-1), T.F16, list(f16.shape)[::-1])]
    for name, qtype, rows in [("t.q8_0", T.Q8_0, 2), ("t.q4_k", T.Q4_K, 2), ("t.bf16", T.BF16, 3)]:
        block, type_size = GGML_QUANT_SIZES[qtype]
        raw = rng.integers(0, 256, size=(rows, 2 * type_size), dtype=np.uint8)
        for at in SCALE_FIELDS.get(qtype, []):
            for r in range(rows):
                for b in range(2):
                    o = b * type_size + at
                    raw[r, o:o + 2] = finite_f16(rng, 1).view(np.uint8)
        writer.add_tensor(name, raw, raw_dtype=qtype)
        tensors.append((name, raw.reshape(-1), qtype, [2 * block, rows]))

    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()

    metadata = {"general.architecture": {"type": "STRING", "value": "strata-test"}}
    for key, value, vtype, sub_type in entries:
        metadata[key] = json_value(value, vtype, sub_type)
    record = {
        "version": 3,
        "alignment": 32,
        "metadata": metadata,
        "tensors": [
            {
                "name": name,
                "dims": dims,
                "type": int(qtype),
                "bytes_sha256": sha256(raw.tobytes()),
                "f32_sha256": sha256(
                    np.asarray(dequantize(raw, qtype), dtype=np.float32).astype("<f4").tobytes()
                ),
            }
            for name, raw, qtype, dims in tensors
        ],
    }
    (OUT / "writer.json").write_text(json.dumps(record, indent=1, ensure_ascii=False) + "\n")


def main() -> int:
    OUT.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0x6767_7566)
    for qtype in [T.F32, T.F16, T.BF16]:
        n = write_dequant_fixture(qtype, plain_bytes(qtype, rng))
        print(f"{qtype.name}: {n} elements")
    for qtype in SCALE_FIELDS:
        n = write_dequant_fixture(qtype, quant_blocks(qtype, rng))
        print(f"{qtype.name}: {n} elements")
    write_gguf_fixture(rng)
    total = sum(p.stat().st_size for p in OUT.iterdir())
    print(f"{OUT}: {total} bytes")
    return 0


if __name__ == "__main__":
    sys.exit(main())
