//! Parsing a GGUF header: magic, version, metadata, tensor table, data-section start.
//!
//! Every read goes through [`Cursor`], which checks the remaining length before it slices, and
//! every count is checked against the bytes left before anything is allocated for it: a file that
//! lies about a count fails with [`GgufError::CountTooLarge`] instead of asking for gigabytes.
//! Parsing never panics and never reads outside the buffer.

use std::collections::HashMap;

use super::value::{GgufArray, GgufValue, GgufValueType};
use super::{
    DEFAULT_ALIGNMENT, GgmlType, GgufError, GgufHeader, GgufTensorInfo, MAX_ARRAY_DEPTH, MAX_DIMS,
};

const MAGIC: [u8; 4] = *b"GGUF";

/// Elements reserved up front for a counted list; longer lists grow as their elements are
/// actually read, so the memory follows the bytes present, never the count claimed.
const PREALLOC_LIMIT: usize = 4096;

/// Fewest bytes of a metadata entry: key length, value type, a one-byte value.
const MIN_KV_LEN: u64 = 8 + 4 + 1;
/// Fewest bytes of a tensor-table entry: name length, n_dims, type, offset.
const MIN_TENSOR_INFO_LEN: u64 = 8 + 4 + 4 + 8;

/// A bounds-checked little-endian reader over the file's bytes.
struct Cursor<'a> {
    bytes: &'a [u8],
    pos: usize,
}

impl<'a> Cursor<'a> {
    fn offset(&self) -> u64 {
        self.pos as u64
    }

    fn remaining(&self) -> u64 {
        self.bytes.len().saturating_sub(self.pos) as u64
    }

    fn truncated(&self, what: &'static str, needed: u64) -> GgufError {
        GgufError::Truncated {
            offset: self.offset(),
            what,
            needed,
            available: self.remaining(),
        }
    }

    fn take(&mut self, len: u64, what: &'static str) -> Result<&'a [u8], GgufError> {
        let end = usize::try_from(len)
            .ok()
            .and_then(|len| self.pos.checked_add(len))
            .filter(|&end| end <= self.bytes.len())
            .ok_or_else(|| self.truncated(what, len))?;
        let slice = self
            .bytes
            .get(self.pos..end)
            .ok_or_else(|| self.truncated(what, len))?;
        self.pos = end;
        Ok(slice)
    }

    fn array<const N: usize>(&mut self, what: &'static str) -> Result<[u8; N], GgufError> {
        let chunk = self
            .bytes
            .get(self.pos..)
            .and_then(|rest| rest.first_chunk::<N>())
            .copied()
            .ok_or_else(|| self.truncated(what, N as u64))?;
        self.pos += N;
        Ok(chunk)
    }

    fn u32(&mut self, what: &'static str) -> Result<u32, GgufError> {
        self.array(what).map(u32::from_le_bytes)
    }

    fn u64(&mut self, what: &'static str) -> Result<u64, GgufError> {
        self.array(what).map(u64::from_le_bytes)
    }

    /// A count of items that each occupy at least `min_item_len` bytes, rejected when the rest of
    /// the file could not hold that many.
    fn count(&mut self, what: &'static str, min_item_len: u64) -> Result<usize, GgufError> {
        let offset = self.offset();
        let count = self.u64(what)?;
        check_count(count, min_item_len, offset, self, what)
    }

    fn string(&mut self, what: &'static str) -> Result<String, GgufError> {
        let len = self.u64(what)?;
        let start = self.offset();
        let bytes = self.take(len, what)?;
        String::from_utf8(bytes.to_vec()).map_err(|_| GgufError::InvalidUtf8 {
            offset: start,
            what,
        })
    }

    fn value_type(&mut self, what: &'static str) -> Result<GgufValueType, GgufError> {
        let offset = self.offset();
        let id = self.u32(what)?;
        GgufValueType::from_id(id).ok_or(GgufError::UnknownValueType { offset, id })
    }

    fn value(&mut self, ty: GgufValueType, depth: usize) -> Result<GgufValue, GgufError> {
        const WHAT: &str = "a metadata value";
        Ok(match ty {
            GgufValueType::U8 => GgufValue::U8(u8::from_le_bytes(self.array(WHAT)?)),
            GgufValueType::I8 => GgufValue::I8(i8::from_le_bytes(self.array(WHAT)?)),
            GgufValueType::U16 => GgufValue::U16(u16::from_le_bytes(self.array(WHAT)?)),
            GgufValueType::I16 => GgufValue::I16(i16::from_le_bytes(self.array(WHAT)?)),
            GgufValueType::U32 => GgufValue::U32(u32::from_le_bytes(self.array(WHAT)?)),
            GgufValueType::I32 => GgufValue::I32(i32::from_le_bytes(self.array(WHAT)?)),
            GgufValueType::U64 => GgufValue::U64(u64::from_le_bytes(self.array(WHAT)?)),
            GgufValueType::I64 => GgufValue::I64(i64::from_le_bytes(self.array(WHAT)?)),
            GgufValueType::F32 => GgufValue::F32(f32::from_le_bytes(self.array(WHAT)?)),
            GgufValueType::F64 => GgufValue::F64(f64::from_le_bytes(self.array(WHAT)?)),
            GgufValueType::Bool => {
                let offset = self.offset();
                match self.array::<1>(WHAT)? {
                    [0] => GgufValue::Bool(false),
                    [1] => GgufValue::Bool(true),
                    [byte] => return Err(GgufError::InvalidBool { offset, byte }),
                }
            }
            GgufValueType::String => GgufValue::String(self.string("a metadata string")?),
            GgufValueType::Array => {
                if depth >= MAX_ARRAY_DEPTH {
                    return Err(GgufError::NestingTooDeep {
                        offset: self.offset(),
                    });
                }
                let element_type = self.value_type("an array's element type")?;
                let count = self.count("an array's length", element_type.min_encoded_len())?;
                let mut values = Vec::with_capacity(count.min(PREALLOC_LIMIT));
                for _ in 0..count {
                    values.push(self.value(element_type, depth + 1)?);
                }
                GgufValue::Array(GgufArray {
                    element_type,
                    values,
                })
            }
        })
    }

    fn tensor_info(&mut self) -> Result<GgufTensorInfo, GgufError> {
        let name = self.string("a tensor name")?;
        let n_dims = self.u32("a tensor's dimension count")?;
        if n_dims as usize > MAX_DIMS {
            return Err(GgufError::TooManyDims { name, n_dims });
        }
        let mut dims = Vec::with_capacity(n_dims as usize);
        for _ in 0..n_dims {
            dims.push(self.u64("a tensor's dimensions")?);
        }
        let type_id = self.u32("a tensor's type")?;
        let offset = self.u64("a tensor's offset")?;
        let ty = GgmlType::from_id(type_id).ok_or_else(|| GgufError::UnknownGgmlType {
            name: name.clone(),
            id: type_id,
        })?;
        let n_elements = dims
            .iter()
            .try_fold(1u64, |acc, &d| acc.checked_mul(d))
            .ok_or_else(|| GgufError::DimsOverflow {
                name: name.clone(),
                dims: dims.clone(),
            })?;
        if !n_elements.is_multiple_of(ty.block_size() as u64) {
            return Err(GgufError::PartialBlock {
                name,
                ty,
                n_elements,
            });
        }
        let byte_len = ty
            .byte_len(n_elements)
            .ok_or_else(|| GgufError::SizeOverflow { name: name.clone() })?;
        Ok(GgufTensorInfo {
            name,
            dims,
            ty,
            offset,
            n_elements,
            byte_len,
        })
    }
}

/// Parses everything up to the data section and checks every tensor's place inside it.
pub(super) fn parse_header(bytes: &[u8]) -> Result<GgufHeader, GgufError> {
    let mut cursor = Cursor { bytes, pos: 0 };
    let magic = cursor.array::<4>("the magic")?;
    if magic != MAGIC {
        return Err(GgufError::BadMagic { found: magic });
    }
    let version = cursor.u32("the version")?;
    if !matches!(version, 2 | 3) {
        return Err(GgufError::UnsupportedVersion { version });
    }
    let tensor_count = cursor.u64("the tensor count")?;
    let kv_count_offset = cursor.offset();
    let kv_count = cursor.u64("the metadata count")?;
    let kv_count = check_count(kv_count, MIN_KV_LEN, kv_count_offset, &cursor, "metadata")?;

    let mut metadata = Vec::with_capacity(kv_count.min(PREALLOC_LIMIT));
    let mut metadata_index = HashMap::with_capacity(kv_count.min(PREALLOC_LIMIT));
    for _ in 0..kv_count {
        let key_offset = cursor.offset();
        let key = cursor.string("a metadata key")?;
        let ty = cursor.value_type("a metadata value type")?;
        let value = cursor.value(ty, 0)?;
        if metadata_index.contains_key(&key) {
            return Err(GgufError::DuplicateKey {
                key,
                offset: key_offset,
            });
        }
        metadata_index.insert(key.clone(), metadata.len());
        metadata.push((key, value));
    }

    let tensor_count = check_count(
        tensor_count,
        MIN_TENSOR_INFO_LEN,
        8,
        &cursor,
        "the tensor table",
    )?;
    let mut tensors = Vec::with_capacity(tensor_count.min(PREALLOC_LIMIT));
    let mut tensor_index = HashMap::with_capacity(tensor_count.min(PREALLOC_LIMIT));
    for _ in 0..tensor_count {
        let info_offset = cursor.offset();
        let info = cursor.tensor_info()?;
        if tensor_index.contains_key(&info.name) {
            return Err(GgufError::DuplicateTensor {
                name: info.name,
                offset: info_offset,
            });
        }
        tensor_index.insert(info.name.clone(), tensors.len());
        tensors.push(info);
    }

    let alignment = alignment(&metadata, &metadata_index)?;
    let data_offset =
        cursor
            .offset()
            .checked_next_multiple_of(alignment)
            .ok_or(GgufError::BadAlignment {
                found: alignment.to_string(),
            })?;
    let file_len = bytes.len() as u64;
    for info in &tensors {
        check_placement(info, alignment, data_offset, file_len)?;
    }
    Ok(GgufHeader {
        version,
        alignment,
        data_offset,
        metadata,
        metadata_index,
        tensors,
        tensor_index,
    })
}

/// Accepts `count` items of at least `min_item_len` bytes each only when the rest of the file
/// could hold them. (The tensor count is read before the metadata and checked after it.)
fn check_count(
    count: u64,
    min_item_len: u64,
    offset: u64,
    cursor: &Cursor<'_>,
    what: &'static str,
) -> Result<usize, GgufError> {
    let available = cursor.remaining();
    let fits = count
        .checked_mul(min_item_len)
        .is_some_and(|needed| needed <= available);
    match usize::try_from(count) {
        Ok(count) if fits => Ok(count),
        _ => Err(GgufError::CountTooLarge {
            offset,
            what,
            count,
            available,
        }),
    }
}

/// `general.alignment`, if present, must be a nonzero power-of-two `uint32`.
fn alignment(
    metadata: &[(String, GgufValue)],
    index: &HashMap<String, usize>,
) -> Result<u64, GgufError> {
    let Some(&at) = index.get(super::ALIGNMENT_KEY) else {
        return Ok(DEFAULT_ALIGNMENT);
    };
    match metadata.get(at).map(|(_, value)| value) {
        Some(GgufValue::U32(a)) if a.is_power_of_two() => Ok(u64::from(*a)),
        Some(other) => Err(GgufError::BadAlignment {
            found: format!("{other:?}"),
        }),
        None => Ok(DEFAULT_ALIGNMENT),
    }
}

fn check_placement(
    info: &GgufTensorInfo,
    alignment: u64,
    data_offset: u64,
    file_len: u64,
) -> Result<(), GgufError> {
    if !info.offset.is_multiple_of(alignment) {
        return Err(GgufError::MisalignedOffset {
            name: info.name.clone(),
            offset: info.offset,
            alignment,
        });
    }
    let end = data_offset
        .checked_add(info.offset)
        .and_then(|start| start.checked_add(info.byte_len));
    if end.is_none_or(|end| end > file_len) {
        return Err(GgufError::OutOfBounds {
            name: info.name.clone(),
            offset: info.offset,
            len: info.byte_len,
            data_len: file_len.saturating_sub(data_offset),
        });
    }
    Ok(())
}
