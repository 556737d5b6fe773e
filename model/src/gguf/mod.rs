//! GGUF files (versions 2 and 3, little-endian): the metadata, the tensor table and each tensor's
//! bytes, plus CPU dequantizers that widen the ggml block types to f32.
//!
//! Layout: header (magic `GGUF`, version, tensor count, metadata count), metadata entries, the
//! tensor table (name, dims with `dims[0]` fastest-varying, ggml type, offset), padding up to
//! `general.alignment` (default 32), then the data section the offsets point into.
//!
//! Everything the header claims is checked when the file is parsed — counts against the bytes
//! left, every tensor's type, size, alignment and extent against the data section — so a parsed
//! [`Gguf`] or [`GgufFile`] can hand out tensor slices without further failure modes. A malformed
//! file is a [`GgufError`] that says what is wrong and at which byte; it never panics.
//!
//! [`model_config`] reads a [`crate::config::ModelConfig`] from the metadata,
//! [`hf_tensor_name`] maps tensor names to the crate's Hugging Face names, and [`tokenizer`]
//! rebuilds the tokenizer from `tokenizer.ggml.*`.

mod config;
pub mod dequant;
mod ggml_type;
mod reader;
mod tokenizer;
mod value;

use std::collections::HashMap;
use std::fs::File;
use std::path::{Path, PathBuf};

use memmap2::Mmap;

pub use config::{
    ARCHITECTURE_KEY, GgufConfigError, ROPE_FREQS_TENSOR, SUPPORTED_ARCHITECTURES, TOKENS_KEY,
    hf_expert_names, hf_tensor_name, hf_tensor_name_in, model_config, model_config_with_rope_freqs,
};
pub use dequant::{dequantize, dequantize_into};

/// The block types the CUDA backend keeps as stored and dequantizes inside its kernels
/// (strata-kernels' `BlockFormat`; the node crate's tests check the two lists agree). Other
/// types are widened to bf16 at load.
pub const CUDA_BLOCK_TYPES: [GgmlType; 8] = [
    GgmlType::Q4_0,
    GgmlType::Q4_1,
    GgmlType::Q5_0,
    GgmlType::Q5_1,
    GgmlType::Q8_0,
    GgmlType::Q4_K,
    GgmlType::Q5_K,
    GgmlType::Q6_K,
];
pub use ggml_type::{GgmlType, QK_K};
pub use tokenizer::{
    CHAT_TEMPLATE_KEY, GgufTokenizer, GgufTokenizerError, SUPPORTED_PRE_TOKENIZERS, SpecialTokens,
    chat_templates, end_token_ids, special_tokens, tokenizer,
};
pub use value::{GgufArray, GgufValue, GgufValueType, encode_string};

/// Whether `path` is a file that starts with the GGUF magic (how `--model` tells a GGUF file from
/// a checkpoint directory).
pub fn is_gguf_file(path: &Path) -> bool {
    use std::io::Read;
    let mut magic = [0u8; 4];
    path.is_file()
        && File::open(path)
            .and_then(|mut f| f.read_exact(&mut magic))
            .is_ok()
        && &magic == b"GGUF"
}

/// The metadata key that sets the data-section alignment.
pub const ALIGNMENT_KEY: &str = "general.alignment";
/// The alignment when `general.alignment` is absent.
pub const DEFAULT_ALIGNMENT: u64 = 32;
/// Most dimensions a tensor may have (ggml's `GGML_MAX_DIMS`).
pub const MAX_DIMS: usize = 4;
/// Deepest nesting of metadata arrays accepted; bounds the parser's recursion.
pub const MAX_ARRAY_DEPTH: usize = 16;

/// Why a GGUF file could not be read, or a tensor not dequantized.
#[derive(Debug, thiserror::Error)]
pub enum GgufError {
    #[error("{}: {source}", path.display())]
    Io {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("{}: {source}", path.display())]
    InFile {
        path: PathBuf,
        source: Box<GgufError>,
    },
    #[error("not a GGUF file: the magic is {found:02x?}, expected \"GGUF\"")]
    BadMagic { found: [u8; 4] },
    #[error("GGUF version {version} is not supported (2 and 3 are)")]
    UnsupportedVersion { version: u32 },
    #[error(
        "truncated at byte {offset} while reading {what}: {needed} bytes needed, {available} left"
    )]
    Truncated {
        offset: u64,
        what: &'static str,
        needed: u64,
        available: u64,
    },
    #[error("{what} at byte {offset} is {count}, more than the {available} bytes left can hold")]
    CountTooLarge {
        offset: u64,
        what: &'static str,
        count: u64,
        available: u64,
    },
    #[error("unknown metadata value type {id} at byte {offset}")]
    UnknownValueType { offset: u64, id: u32 },
    #[error("{what} at byte {offset} is not valid UTF-8")]
    InvalidUtf8 { offset: u64, what: &'static str },
    #[error("a bool at byte {offset} is {byte}, neither 0 nor 1")]
    InvalidBool { offset: u64, byte: u8 },
    #[error("metadata arrays nest deeper than {MAX_ARRAY_DEPTH} at byte {offset}")]
    NestingTooDeep { offset: u64 },
    #[error("metadata key {key:?} at byte {offset} repeats an earlier key")]
    DuplicateKey { key: String, offset: u64 },
    #[error("{ALIGNMENT_KEY} must be a nonzero power-of-two uint32, found {found}")]
    BadAlignment { found: String },
    #[error("tensor {name:?} has {n_dims} dimensions; at most {MAX_DIMS} are supported")]
    TooManyDims { name: String, n_dims: u32 },
    #[error("tensor {name:?} has unknown ggml type id {id}")]
    UnknownGgmlType { name: String, id: u32 },
    #[error("tensor {name:?} has dimensions {dims:?} whose product overflows u64")]
    DimsOverflow { name: String, dims: Vec<u64> },
    #[error(
        "tensor {name:?} has {n_elements} elements, not a whole number of {ty} blocks of {}",
        ty.block_size()
    )]
    PartialBlock {
        name: String,
        ty: GgmlType,
        n_elements: u64,
    },
    #[error("tensor {name:?}: its size in bytes overflows u64")]
    SizeOverflow { name: String },
    #[error("tensor {name:?}: offset {offset} is not a multiple of the alignment {alignment}")]
    MisalignedOffset {
        name: String,
        offset: u64,
        alignment: u64,
    },
    #[error(
        "tensor {name:?}: {len} bytes at offset {offset} of the data section lie beyond its end \
         ({data_len} bytes)"
    )]
    OutOfBounds {
        name: String,
        offset: u64,
        len: u64,
        data_len: u64,
    },
    #[error("tensor {name:?} at byte {offset} repeats an earlier tensor name")]
    DuplicateTensor { name: String, offset: u64 },
    #[error("no tensor named {name:?}")]
    MissingTensor { name: String },
    #[error("dequantizing {ty} is not supported")]
    UnsupportedDequant { ty: GgmlType },
    #[error(
        "{ty}: {n_bytes} bytes do not hold {n_elements} elements (blocks of {} elements in {} bytes)",
        ty.block_size(),
        ty.type_size()
    )]
    DequantLength {
        ty: GgmlType,
        n_elements: u64,
        n_bytes: u64,
    },
}

/// One entry of the tensor table, checked: its type is known, its element count is a whole number
/// of blocks, and its bytes lie aligned inside the data section.
#[derive(Debug, Clone, PartialEq)]
pub struct GgufTensorInfo {
    name: String,
    dims: Vec<u64>,
    ty: GgmlType,
    offset: u64,
    n_elements: u64,
    byte_len: u64,
}

impl GgufTensorInfo {
    /// The tensor's name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// Dimensions in GGUF order: `dims()[0]` varies fastest (the reverse of a row-major shape).
    pub fn dims(&self) -> &[u64] {
        &self.dims
    }

    /// The element type.
    pub fn ty(&self) -> GgmlType {
        self.ty
    }

    /// Offset of the tensor's bytes from the start of the data section.
    pub fn offset(&self) -> u64 {
        self.offset
    }

    /// The product of the dimensions.
    pub fn n_elements(&self) -> u64 {
        self.n_elements
    }

    /// The tensor's size in bytes.
    pub fn byte_len(&self) -> u64 {
        self.byte_len
    }
}

/// Everything before the data section: version, metadata in file order, the tensor table.
#[derive(Debug, Clone)]
pub struct GgufHeader {
    version: u32,
    alignment: u64,
    data_offset: u64,
    metadata: Vec<(String, GgufValue)>,
    metadata_index: HashMap<String, usize>,
    tensors: Vec<GgufTensorInfo>,
    tensor_index: HashMap<String, usize>,
}

impl GgufHeader {
    /// The GGUF version (2 or 3).
    pub fn version(&self) -> u32 {
        self.version
    }

    /// The data-section alignment in bytes.
    pub fn alignment(&self) -> u64 {
        self.alignment
    }

    /// Absolute file offset of the data section.
    pub fn data_offset(&self) -> u64 {
        self.data_offset
    }

    /// Every metadata entry, in file order.
    pub fn metadata_entries(&self) -> impl ExactSizeIterator<Item = (&str, &GgufValue)> {
        self.metadata.iter().map(|(k, v)| (k.as_str(), v))
    }

    /// The value under `key`.
    pub fn metadata(&self, key: &str) -> Option<&GgufValue> {
        let &at = self.metadata_index.get(key)?;
        self.metadata.get(at).map(|(_, value)| value)
    }

    /// The value under `key` if it is a `uint8`.
    pub fn get_u8(&self, key: &str) -> Option<u8> {
        self.metadata(key)?.as_u8()
    }

    /// The value under `key` if it is an `int8`.
    pub fn get_i8(&self, key: &str) -> Option<i8> {
        self.metadata(key)?.as_i8()
    }

    /// The value under `key` if it is a `uint16`.
    pub fn get_u16(&self, key: &str) -> Option<u16> {
        self.metadata(key)?.as_u16()
    }

    /// The value under `key` if it is an `int16`.
    pub fn get_i16(&self, key: &str) -> Option<i16> {
        self.metadata(key)?.as_i16()
    }

    /// The value under `key` if it is a `uint32`.
    pub fn get_u32(&self, key: &str) -> Option<u32> {
        self.metadata(key)?.as_u32()
    }

    /// The value under `key` if it is an `int32`.
    pub fn get_i32(&self, key: &str) -> Option<i32> {
        self.metadata(key)?.as_i32()
    }

    /// The value under `key` if it is a `uint64`.
    pub fn get_u64(&self, key: &str) -> Option<u64> {
        self.metadata(key)?.as_u64()
    }

    /// The value under `key` if it is an `int64`.
    pub fn get_i64(&self, key: &str) -> Option<i64> {
        self.metadata(key)?.as_i64()
    }

    /// The value under `key` if it is a `float32`.
    pub fn get_f32(&self, key: &str) -> Option<f32> {
        self.metadata(key)?.as_f32()
    }

    /// The value under `key` if it is a `float64`.
    pub fn get_f64(&self, key: &str) -> Option<f64> {
        self.metadata(key)?.as_f64()
    }

    /// The value under `key` if it is a `bool`.
    pub fn get_bool(&self, key: &str) -> Option<bool> {
        self.metadata(key)?.as_bool()
    }

    /// The value under `key` if it is a `string`.
    pub fn get_str(&self, key: &str) -> Option<&str> {
        self.metadata(key)?.as_str()
    }

    /// The value under `key` if it is an `array`.
    pub fn get_array(&self, key: &str) -> Option<&GgufArray> {
        self.metadata(key)?.as_array()
    }

    /// The tensor table, in file order.
    pub fn tensor_infos(&self) -> &[GgufTensorInfo] {
        &self.tensors
    }

    /// The table entry of the tensor called `name`.
    pub fn tensor_info(&self, name: &str) -> Result<&GgufTensorInfo, GgufError> {
        self.tensor_index
            .get(name)
            .and_then(|&at| self.tensors.get(at))
            .ok_or_else(|| GgufError::MissingTensor {
                name: name.to_string(),
            })
    }

    /// `info`'s bytes within `file` (the whole file this header was parsed from).
    fn tensor_in<'a>(
        &self,
        file: &'a [u8],
        info: &'a GgufTensorInfo,
    ) -> Result<GgufTensor<'a>, GgufError> {
        // Parsing proved the range lies inside the file; `get` keeps that a checked fact.
        let bytes = self
            .data_offset
            .checked_add(info.offset)
            .and_then(|start| usize::try_from(start).ok())
            .zip(usize::try_from(info.byte_len).ok())
            .and_then(|(start, len)| file.get(start..start.checked_add(len)?))
            .ok_or_else(|| GgufError::OutOfBounds {
                name: info.name.clone(),
                offset: info.offset,
                len: info.byte_len,
                data_len: (file.len() as u64).saturating_sub(self.data_offset),
            })?;
        Ok(GgufTensor { info, bytes })
    }
}

impl GgufError {
    /// The problem without the file's path, for a caller whose own error names the file.
    pub fn problem(&self) -> String {
        match self {
            Self::InFile { source, .. } => source.to_string(),
            Self::Io { source, .. } => source.to_string(),
            other => other.to_string(),
        }
    }
}

/// One tensor: its table entry and its bytes.
#[derive(Debug, Clone, Copy)]
pub struct GgufTensor<'a> {
    info: &'a GgufTensorInfo,
    bytes: &'a [u8],
}

impl<'a> GgufTensor<'a> {
    /// The table entry (name, dims, type, offset).
    pub fn info(&self) -> &'a GgufTensorInfo {
        self.info
    }

    /// The tensor's name.
    pub fn name(&self) -> &'a str {
        &self.info.name
    }

    /// Dimensions in GGUF order: `dims()[0]` varies fastest.
    pub fn dims(&self) -> &'a [u64] {
        &self.info.dims
    }

    /// The element type.
    pub fn ty(&self) -> GgmlType {
        self.info.ty
    }

    /// The product of the dimensions.
    pub fn n_elements(&self) -> u64 {
        self.info.n_elements
    }

    /// The tensor's bytes, exactly `info().byte_len()` of them.
    pub fn bytes(&self) -> &'a [u8] {
        self.bytes
    }

    /// The tensor widened to f32, in storage order.
    pub fn dequantize(&self) -> Result<Vec<f32>, GgufError> {
        dequantize(self.ty(), self.bytes, self.n_elements())
    }
}

/// A GGUF file parsed from bytes in memory.
#[derive(Debug, Clone)]
pub struct Gguf<'a> {
    bytes: &'a [u8],
    header: GgufHeader,
}

impl<'a> Gguf<'a> {
    /// Parses and checks `bytes` as a whole GGUF file.
    pub fn parse(bytes: &'a [u8]) -> Result<Self, GgufError> {
        let header = reader::parse_header(bytes)?;
        Ok(Self { bytes, header })
    }

    /// Metadata and tensor table.
    pub fn header(&self) -> &GgufHeader {
        &self.header
    }

    /// The metadata value under `key`; typed lookups are on [`GgufHeader`].
    pub fn metadata(&self, key: &str) -> Option<&GgufValue> {
        self.header.metadata(key)
    }

    /// Every tensor, in file order.
    pub fn tensors(&self) -> impl Iterator<Item = Result<GgufTensor<'_>, GgufError>> {
        self.header
            .tensors
            .iter()
            .map(|info| self.header.tensor_in(self.bytes, info))
    }

    /// The tensor called `name`.
    pub fn tensor(&self, name: &str) -> Result<GgufTensor<'_>, GgufError> {
        let info = self.header.tensor_info(name)?;
        self.header.tensor_in(self.bytes, info)
    }
}

/// A GGUF file on disk, mapped into memory and parsed; tensor bytes are read from the mapping.
pub struct GgufFile {
    path: PathBuf,
    mmap: Mmap,
    header: GgufHeader,
}

impl GgufFile {
    /// Maps and parses the file at `path`.
    pub fn open(path: &Path) -> Result<Self, GgufError> {
        let io = |source| GgufError::Io {
            path: path.to_path_buf(),
            source,
        };
        let file = File::open(path).map_err(io)?;
        // SAFETY: the mapping is read-only; a file modified while strata runs is outside the
        // contract (as it is for every mmap-based loader).
        let mmap = unsafe { Mmap::map(&file) }.map_err(io)?;
        let header = reader::parse_header(&mmap).map_err(|source| GgufError::InFile {
            path: path.to_path_buf(),
            source: Box::new(source),
        })?;
        Ok(Self {
            path: path.to_path_buf(),
            mmap,
            header,
        })
    }

    /// The path the file was opened from.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Metadata and tensor table.
    pub fn header(&self) -> &GgufHeader {
        &self.header
    }

    /// The metadata value under `key`; typed lookups are on [`GgufHeader`].
    pub fn metadata(&self, key: &str) -> Option<&GgufValue> {
        self.header.metadata(key)
    }

    /// Every tensor, in file order.
    pub fn tensors(&self) -> impl Iterator<Item = Result<GgufTensor<'_>, GgufError>> {
        self.header
            .tensors
            .iter()
            .map(|info| self.header.tensor_in(&self.mmap, info))
    }

    /// The tensor called `name`.
    pub fn tensor(&self, name: &str) -> Result<GgufTensor<'_>, GgufError> {
        let info = self.header.tensor_info(name)?;
        self.header.tensor_in(&self.mmap, info)
    }
}
