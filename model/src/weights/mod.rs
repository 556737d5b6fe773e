//! Checkpoint weights: safetensors files mapped into memory (one file or a sharded set with
//! `model.safetensors.index.json`), or one GGUF file, indexed by tensor name (Hugging Face names
//! for both), checked against the architecture.
//!
//! Nothing is copied at open time; a tensor's bytes are read from the mapping when a backend asks.
//! A GGUF tensor in a ggml block format is widened to f32 the first time it is asked for (exactly:
//! the dequantizers are bit-exact) and kept; so are the q/k projections of `llama` GGUF files,
//! whose rows the converter reordered for llama.cpp's rope and which are put back in Hugging Face
//! order here (see [`crate::gguf`]'s config module). F32, F16 and BF16 tensors are read from the
//! mapping as they are.

mod activations;
mod folding;
mod layout;
mod quant;

use std::collections::HashMap;
use std::fs::File;
use std::ops::Range;
use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use memmap2::Mmap;
use safetensors::{Dtype, SafeTensors};
use serde::Deserialize;

pub use quant::{QuantizedLinear, e2m1_to_f32, e2m1_to_f32_modelopt, e4m3_to_f32};

pub use layout::{
    EMBED, FINAL_NORM, GatedMlp, LM_HEAD, LayerNames, LayerSpec, MlpSpec, Share, SparseMlp, Split,
    TensorSpec, active_parameter_count, embed_spec, expected_read_parameters, expected_tensors,
    final_norm_spec, is_ignorable, lm_head_spec, parameter_count,
};

use crate::config::ModelConfig;
use crate::gguf::{self, GgmlType, Gguf};

pub const SINGLE_FILE: &str = "model.safetensors";
pub const INDEX_FILE: &str = "model.safetensors.index.json";

#[derive(Debug, thiserror::Error)]
pub enum WeightError {
    #[error("{}: {source}", path.display())]
    Io {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("{}: {problem}", path.display())]
    Malformed { path: PathBuf, problem: String },
    #[error("{}: no {SINGLE_FILE} or {INDEX_FILE}", dir.display())]
    NoWeights { dir: PathBuf },
    #[error("{}: tensor {name} is missing", dir.display())]
    Missing { dir: PathBuf, name: String },
    #[error("{}: tensor {name} has shape {found:?}, the architecture expects {expected:?}", path.display())]
    Shape {
        path: PathBuf,
        name: String,
        expected: Vec<usize>,
        found: Vec<usize>,
    },
    #[error("{}: tensor {name} has dtype {dtype:?}; supported: BF16, F16, F32", path.display())]
    Dtype {
        path: PathBuf,
        name: String,
        dtype: Dtype,
    },
    #[error("{}: tensor {name} is not part of the architecture ({arch})", path.display())]
    Unexpected {
        path: PathBuf,
        name: String,
        arch: String,
    },
}

/// The element types a checkpoint's weights may be stored in.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WeightDtype {
    F32,
    F16,
    BF16,
}

impl WeightDtype {
    fn from_safetensors(dtype: Dtype) -> Option<Self> {
        match dtype {
            Dtype::F32 => Some(Self::F32),
            Dtype::F16 => Some(Self::F16),
            Dtype::BF16 => Some(Self::BF16),
            _ => None,
        }
    }

    pub fn size(self) -> usize {
        match self {
            Self::F32 => 4,
            Self::F16 | Self::BF16 => 2,
        }
    }

    /// One element's little-endian bytes (`size()` of them) widened to f32, exactly.
    pub fn widen(self, b: &[u8]) -> f32 {
        match self {
            Self::F32 => f32::from_le_bytes([b[0], b[1], b[2], b[3]]),
            Self::BF16 => half::bf16::from_le_bytes([b[0], b[1]]).to_f32(),
            Self::F16 => half::f16::from_le_bytes([b[0], b[1]]).to_f32(),
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            Self::F32 => "f32",
            Self::F16 => "f16",
            Self::BF16 => "bf16",
        }
    }
}

struct ShardFile {
    path: PathBuf,
    mmap: Mmap,
    /// Offset of the data section (after the 8-byte length and the JSON header).
    data_start: usize,
}

impl ShardFile {
    /// The stored bytes at `offsets` of the data section.
    fn data(&self, (start, end): (usize, usize)) -> &[u8] {
        &self.mmap[self.data_start + start..self.data_start + end]
    }
}

struct TensorEntry {
    file: usize,
    shape: Vec<usize>,
    /// Byte range in the file's data section.
    offsets: (usize, usize),
    data: TensorData,
}

enum TensorData {
    /// Read from the mapping as stored.
    Mapped(Dtype),
    /// A GGUF tensor widened to f32 on first use (little-endian bytes), its rows put back in
    /// Hugging Face order when `unpermute_heads` is set.
    Widened {
        ty: GgmlType,
        unpermute_heads: Option<usize>,
        f32_bytes: OnceLock<Result<Vec<u8>, String>>,
    },
    /// A quantized Linear (FP8 or NVFP4, see [`quant`]) folded from its stored parts, dequantized
    /// to f32 on first use.
    Dequantized {
        kind: quant::QuantKind,
        parts: Vec<quant::Part>,
        f32_bytes: OnceLock<Result<Vec<u8>, String>>,
    },
}

impl TensorEntry {
    /// The element type as stored, for histograms and messages.
    fn stored_type(&self) -> String {
        match &self.data {
            TensorData::Mapped(dtype) => format!("{dtype:?}"),
            TensorData::Widened { ty, .. } => ty.name().to_string(),
            TensorData::Dequantized {
                kind: quant::QuantKind::Fp8 { .. },
                ..
            } => "F8_E4M3 (scaled)".to_string(),
            TensorData::Dequantized {
                kind: quant::QuantKind::Nvfp4 { .. },
                ..
            } => "NVFP4".to_string(),
        }
    }
}

/// An opened checkpoint: every tensor of every shard, by name.
pub struct Checkpoint {
    dir: PathBuf,
    files: Vec<ShardFile>,
    tensors: HashMap<String, TensorEntry>,
    /// What the quantization config asks of each Linear's input, with its static scales.
    activations: activations::ActivationSchemes,
}

/// A borrowed view of one tensor's bytes in the mapping.
#[derive(Clone, Copy)]
pub struct TensorRef<'a> {
    pub name: &'a str,
    pub path: &'a Path,
    pub dtype: WeightDtype,
    pub shape: &'a [usize],
    pub bytes: &'a [u8],
}

#[derive(Deserialize)]
struct ShardIndex {
    weight_map: HashMap<String, String>,
}

impl Checkpoint {
    /// Opens `dir/model.safetensors`, or every shard named by `dir/model.safetensors.index.json`;
    /// or, when `dir` is a GGUF file, that file.
    pub fn open(dir: &Path) -> Result<Self, WeightError> {
        if gguf::is_gguf_file(dir) {
            return Self::open_gguf(dir);
        }
        let index_path = dir.join(INDEX_FILE);
        let single = dir.join(SINGLE_FILE);
        let mut checkpoint = Self {
            dir: dir.to_path_buf(),
            files: Vec::new(),
            tensors: HashMap::new(),
            activations: activations::ActivationSchemes::default(),
        };
        if index_path.exists() {
            let text = std::fs::read_to_string(&index_path).map_err(|source| WeightError::Io {
                path: index_path.clone(),
                source,
            })?;
            let index: ShardIndex =
                serde_json::from_str(&text).map_err(|e| WeightError::Malformed {
                    path: index_path.clone(),
                    problem: format!("malformed shard index: {e}"),
                })?;
            let mut shards: Vec<&String> = index.weight_map.values().collect();
            shards.sort();
            shards.dedup();
            for shard in shards {
                if shard.contains('/') || shard.contains("..") {
                    return Err(WeightError::Malformed {
                        path: index_path,
                        problem: format!(
                            "shard name {shard:?} must be a file name in the checkpoint directory"
                        ),
                    });
                }
                checkpoint.add_file(&dir.join(shard))?;
            }
            for (name, shard) in &index.weight_map {
                let entry = checkpoint
                    .tensors
                    .get(name)
                    .ok_or_else(|| WeightError::Malformed {
                        path: index_path.clone(),
                        problem: format!(
                            "names tensor {name} in {shard}, which does not contain it"
                        ),
                    })?;
                if !checkpoint.files[entry.file].path.ends_with(shard) {
                    return Err(WeightError::Malformed {
                        path: index_path,
                        problem: format!(
                            "names tensor {name} in {shard}, but it is in another shard"
                        ),
                    });
                }
            }
        } else if single.exists() {
            checkpoint.add_file(&single)?;
        } else {
            return Err(WeightError::NoWeights {
                dir: dir.to_path_buf(),
            });
        }
        let config = std::fs::read_to_string(dir.join("config.json"))
            .ok()
            .and_then(|t| serde_json::from_str::<serde_json::Value>(&t).ok());
        checkpoint.fold_quantized(config.as_ref().and_then(|c| c.get("quantization_config")))?;
        Ok(checkpoint)
    }

    fn add_file(&mut self, path: &Path) -> Result<(), WeightError> {
        let io = |source| WeightError::Io {
            path: path.to_path_buf(),
            source,
        };
        let file = File::open(path).map_err(io)?;
        // SAFETY: the mapping is read-only; a checkpoint modified while strata runs is outside the
        // contract (as it is for every mmap-based loader).
        let mmap = unsafe { Mmap::map(&file) }.map_err(io)?;
        let (header_len, metadata) =
            SafeTensors::read_metadata(&mmap).map_err(|e| WeightError::Malformed {
                path: path.to_path_buf(),
                problem: format!("not a valid safetensors file (truncated or corrupt): {e}"),
            })?;
        let file_index = self.files.len();
        for (name, info) in metadata.tensors() {
            if self.tensors.contains_key(&name) {
                return Err(WeightError::Malformed {
                    path: path.to_path_buf(),
                    problem: format!("tensor {name} appears in more than one shard"),
                });
            }
            let entry = TensorEntry {
                file: file_index,
                shape: info.shape.clone(),
                offsets: info.data_offsets,
                data: TensorData::Mapped(info.dtype),
            };
            self.tensors.insert(name, entry);
        }
        self.files.push(ShardFile {
            path: path.to_path_buf(),
            mmap,
            data_start: 8 + header_len,
        });
        Ok(())
    }

    /// Opens one GGUF file: every tensor under its Hugging Face name (a name with no counterpart
    /// keeps its GGUF name, so [`Self::validate`] reports it), in HF shape (GGUF lists dimensions
    /// fastest first).
    fn open_gguf(path: &Path) -> Result<Self, WeightError> {
        let io = |source| WeightError::Io {
            path: path.to_path_buf(),
            source,
        };
        let malformed = |problem: String| WeightError::Malformed {
            path: path.to_path_buf(),
            problem,
        };
        let file = File::open(path).map_err(io)?;
        // SAFETY: as for safetensors files above.
        let mmap = unsafe { Mmap::map(&file) }.map_err(io)?;
        let parsed = Gguf::parse(&mmap).map_err(|e| malformed(e.to_string()))?;
        let header = parsed.header();
        let arch = header.get_str(gguf::ARCHITECTURE_KEY).unwrap_or_default();
        // llama.cpp reorders the q/k rows of `llama` files only (see the gguf config module).
        let permuted = arch == "llama";
        let heads = |key: &str| header.get_u32(&format!("{arch}.{key}")).map(|h| h as usize);
        let (q_heads, kv_heads) = if permuted {
            let q = heads("attention.head_count").ok_or_else(|| {
                malformed(format!(
                    "metadata key {arch}.attention.head_count is missing"
                ))
            })?;
            (q, heads("attention.head_count_kv").unwrap_or(q))
        } else {
            (0, 0)
        };
        let mut tensors = HashMap::new();
        let data_start = usize::try_from(header.data_offset())
            .map_err(|_| malformed("the data section starts beyond the address space".into()))?;
        // A `llama` file with experts is Mixtral: its tensors take Mixtral's names.
        let experts = heads("expert_count").unwrap_or(0);
        let names_arch = if permuted && experts > 0 {
            "mixtral"
        } else {
            arch
        };
        for info in header.tensor_infos() {
            let gguf_name = info.name();
            let name = gguf::hf_tensor_name_in(names_arch, gguf_name)
                .unwrap_or_else(|| gguf_name.to_string());
            // Parsing proved every extent lies inside the file.
            let start = info.offset() as usize;
            let offsets = (start, start + info.byte_len() as usize);
            let mut shape: Vec<usize> = info.dims().iter().rev().map(|&d| d as usize).collect();
            let unpermute_heads = if !permuted {
                None
            } else if gguf_name.ends_with(".attn_q.weight") || gguf_name.ends_with(".attn_q.bias") {
                Some(q_heads)
            } else if gguf_name.ends_with(".attn_k.weight") || gguf_name.ends_with(".attn_k.bias") {
                Some(kv_heads)
            } else {
                None
            };
            let mapped = match info.ty() {
                GgmlType::F32 => Some(Dtype::F32),
                GgmlType::F16 => Some(Dtype::F16),
                GgmlType::BF16 => Some(Dtype::BF16),
                _ => None,
            };
            let data = || match (mapped, unpermute_heads) {
                (Some(dtype), None) => Ok(TensorData::Mapped(dtype)),
                _ if gguf::dequant::is_supported(info.ty()) => Ok(TensorData::Widened {
                    ty: info.ty(),
                    unpermute_heads,
                    f32_bytes: OnceLock::new(),
                }),
                _ => Err(malformed(format!(
                    "tensor {gguf_name} is {}, a type strata cannot read yet",
                    info.ty().name()
                ))),
            };
            if let Some(heads) = unpermute_heads {
                let rows = shape.first().copied().unwrap_or(0);
                if heads == 0 || rows % (2 * heads) != 0 {
                    return Err(malformed(format!(
                        "tensor {gguf_name} has {rows} rows, not a whole number of {heads} heads \
                         of even width"
                    )));
                }
            }
            // Qwen2-MoE's shared-expert gate is a vector in the file, a `[1, hidden]` matrix in
            // the Hugging Face layout.
            if gguf_name.ends_with(".ffn_gate_inp_shexp.weight") && shape.len() == 1 {
                shape.insert(0, 1);
            }
            // A stacked expert tensor is one matrix per expert, one after the other.
            let pieces = gguf_pieces(names_arch, gguf_name, experts, name, shape, offsets)
                .map_err(malformed)?;
            for (name, shape, offsets) in pieces {
                if tensors.contains_key(&name) {
                    return Err(malformed(format!("two tensors map to {name}")));
                }
                let data = data()?;
                tensors.insert(
                    name,
                    TensorEntry {
                        file: 0,
                        shape,
                        offsets,
                        data,
                    },
                );
            }
        }
        Ok(Self {
            dir: path.to_path_buf(),
            files: vec![ShardFile {
                path: path.to_path_buf(),
                mmap,
                data_start,
            }],
            tensors,
            activations: activations::ActivationSchemes::default(),
        })
    }

    pub fn dir(&self) -> &Path {
        &self.dir
    }

    pub fn names(&self) -> impl Iterator<Item = &str> {
        self.tensors.keys().map(String::as_str)
    }

    /// Total bytes of tensor data across shards.
    pub fn data_bytes(&self) -> usize {
        self.tensors
            .values()
            .map(|t| t.offsets.1 - t.offsets.0)
            .sum()
    }

    /// The tensor called `name`, if present and of a supported dtype.
    pub fn get(&self, name: &str) -> Result<TensorRef<'_>, WeightError> {
        let (key, entry) =
            self.tensors
                .get_key_value(name)
                .ok_or_else(|| WeightError::Missing {
                    dir: self.dir.clone(),
                    name: name.to_string(),
                })?;
        let file = &self.files[entry.file];
        let stored = file.data(entry.offsets);
        let (dtype, bytes) = match &entry.data {
            TensorData::Mapped(dtype) => {
                let dtype =
                    WeightDtype::from_safetensors(*dtype).ok_or_else(|| WeightError::Dtype {
                        path: file.path.clone(),
                        name: name.to_string(),
                        dtype: *dtype,
                    })?;
                (dtype, stored)
            }
            TensorData::Widened {
                ty,
                unpermute_heads,
                f32_bytes,
            } => {
                let widened = f32_bytes
                    .get_or_init(|| widen(*ty, stored, &entry.shape, *unpermute_heads))
                    .as_ref()
                    .map_err(|problem| WeightError::Malformed {
                        path: file.path.clone(),
                        problem: format!("tensor {name}: {problem}"),
                    })?;
                (WeightDtype::F32, widened.as_slice())
            }
            TensorData::Dequantized {
                kind,
                parts,
                f32_bytes,
            } => {
                let dequantized = f32_bytes
                    .get_or_init(|| {
                        let bytes: Vec<&[u8]> = parts
                            .iter()
                            .map(|p| self.files[p.file].data(p.offsets))
                            .collect();
                        let shape = (entry.shape[0], entry.shape[1]);
                        quant::dequantize(kind, shape, parts, &bytes)
                    })
                    .as_ref()
                    .map_err(|problem| WeightError::Malformed {
                        path: file.path.clone(),
                        problem: format!("tensor {name}: {problem}"),
                    })?;
                (WeightDtype::F32, dequantized.as_slice())
            }
        };
        Ok(TensorRef {
            name: key,
            path: &file.path,
            dtype,
            shape: &entry.shape,
            bytes,
        })
    }

    /// The tensor called `name` as its stored GGUF blocks, when it is stored in a block type
    /// (`None` for a plain type, which [`Checkpoint::get`] reads as it is): for a backend that
    /// keeps quantized weights quantized. Rows come in Hugging Face order (see
    /// [`BlockTensor::row`]).
    pub fn blocks(&self, name: &str) -> Result<Option<BlockTensor<'_>>, WeightError> {
        let entry = self.tensors.get(name).ok_or_else(|| WeightError::Missing {
            dir: self.dir.clone(),
            name: name.to_string(),
        })?;
        let TensorData::Widened {
            ty,
            unpermute_heads,
            ..
        } = &entry.data
        else {
            return Ok(None);
        };
        if ty.block_size() == 1 {
            return Ok(None);
        }
        let file = &self.files[entry.file];
        let rows = entry.shape.first().copied().unwrap_or(1).max(1);
        Ok(Some(BlockTensor {
            ty: *ty,
            shape: &entry.shape,
            bytes: file.data(entry.offsets),
            row_bytes: (entry.offsets.1 - entry.offsets.0) / rows,
            unpermute_heads: *unpermute_heads,
        }))
    }

    /// The tensor called `name`, checked to have `shape`.
    pub fn get_shaped(&self, name: &str, shape: &[usize]) -> Result<TensorRef<'_>, WeightError> {
        let t = self.get(name)?;
        if t.shape != shape {
            return Err(WeightError::Shape {
                path: t.path.to_path_buf(),
                name: name.to_string(),
                expected: shape.to_vec(),
                found: t.shape.to_vec(),
            });
        }
        Ok(t)
    }

    /// Checks every expected tensor (presence, shape, dtype) and that nothing unexpected is there.
    pub fn validate(&self, config: &ModelConfig) -> Result<(), WeightError> {
        let expected = expected_tensors(config);
        for spec in &expected {
            self.get_shaped(&spec.name, &spec.shape)?;
        }
        let known: std::collections::HashSet<&str> =
            expected.iter().map(|s| s.name.as_str()).collect();
        let mut names: Vec<&str> = self.names().collect();
        names.sort_unstable();
        if let Some(extra) = names
            .into_iter()
            .find(|n| !known.contains(n) && !is_ignorable(n, config))
        {
            let entry = &self.tensors[extra];
            return Err(WeightError::Unexpected {
                path: self.files[entry.file].path.clone(),
                name: extra.to_string(),
                arch: config.architecture.to_string(),
            });
        }
        Ok(())
    }

    /// Whether any tensor is widened at load (a GGUF block type, or q/k rows reordered).
    pub fn widens(&self) -> bool {
        self.tensors
            .values()
            .any(|t| !matches!(t.data, TensorData::Mapped(_)))
    }

    /// Bytes of the tensors as the CUDA backend holds them: a matrix in one of
    /// [`gguf::CUDA_BLOCK_TYPES`] as stored, everything else as bf16.
    pub fn cuda_bytes(&self) -> usize {
        self.tensors
            .values()
            .map(|t| match &t.data {
                TensorData::Widened { ty, .. }
                    if t.shape.len() == 2 && gguf::CUDA_BLOCK_TYPES.contains(ty) =>
                {
                    t.offsets.1 - t.offsets.0
                }
                _ => t.shape.iter().product::<usize>() * 2,
            })
            .sum()
    }

    /// The dtypes present (as stored: a GGUF block type by its ggml name), with the number of
    /// tensors of each and their bytes in the file.
    pub fn dtype_histogram(&self) -> Vec<(String, usize, usize)> {
        let mut counts: HashMap<String, (usize, usize)> = HashMap::new();
        for t in self.tensors.values() {
            let entry = counts.entry(t.stored_type()).or_default();
            entry.0 += 1;
            entry.1 += t.offsets.1 - t.offsets.0;
        }
        let mut out: Vec<_> = counts
            .into_iter()
            .map(|(name, (count, bytes))| (name, count, bytes))
            .collect();
        out.sort();
        out
    }
}

/// A checkpoint entry: its name, shape and byte range in the file.
type Piece = (String, Vec<usize>, (usize, usize));

/// The checkpoint entries one GGUF tensor becomes: itself, or, for a stacked expert tensor
/// (`[experts, rows, cols]`, whole rows of blocks), one matrix per expert under its Hugging Face
/// name.
fn gguf_pieces(
    arch: &str,
    gguf_name: &str,
    experts: usize,
    name: String,
    shape: Vec<usize>,
    offsets: (usize, usize),
) -> Result<Vec<Piece>, String> {
    let Some(names) = gguf::hf_expert_names(arch, gguf_name, experts) else {
        return Ok(vec![(name, shape, offsets)]);
    };
    let whole = offsets.1 - offsets.0;
    if shape.len() != 3 || shape[0] != experts || !whole.is_multiple_of(experts) {
        return Err(format!(
            "tensor {gguf_name} of shape {shape:?} does not stack {experts} experts"
        ));
    }
    let per = whole / experts;
    Ok(names
        .into_iter()
        .enumerate()
        .map(|(e, n)| {
            let at = offsets.0 + e * per;
            (n, shape[1..].to_vec(), (at, at + per))
        })
        .collect())
}

/// A GGUF tensor of HF shape `shape` stored as `ty`, as little-endian f32 bytes; with
/// `unpermute_heads`, its rows put back from llama.cpp's rope order (per head of `2r` rows, row
/// `2j + t` in the file is row `t·r + j` in Hugging Face's).
fn widen(
    ty: GgmlType,
    stored: &[u8],
    shape: &[usize],
    unpermute_heads: Option<usize>,
) -> Result<Vec<u8>, String> {
    let numel: usize = shape.iter().product();
    let values = gguf::dequantize(ty, stored, numel as u64).map_err(|e| e.to_string())?;
    let values = match unpermute_heads {
        None => values,
        Some(heads) => {
            let rows = shape.first().copied().unwrap_or(1);
            let cols = numel / rows.max(1);
            let half = rows / heads / 2;
            let mut out = vec![0.0f32; numel];
            for h in 0..heads {
                for j in 0..half {
                    for t in 0..2 {
                        let from = (h * 2 * half + 2 * j + t) * cols;
                        let to = (h * 2 * half + t * half + j) * cols;
                        out[to..to + cols].copy_from_slice(&values[from..from + cols]);
                    }
                }
            }
            out
        }
    };
    Ok(values.iter().flat_map(|v| v.to_le_bytes()).collect())
}

/// A GGUF tensor's stored blocks (see [`Checkpoint::blocks`]): `shape` in Hugging Face order
/// (`[rows, cols]` for a matrix), each row a whole number of blocks.
#[derive(Clone, Copy)]
pub struct BlockTensor<'a> {
    pub ty: GgmlType,
    pub shape: &'a [usize],
    bytes: &'a [u8],
    row_bytes: usize,
    unpermute_heads: Option<usize>,
}

impl<'a> BlockTensor<'a> {
    /// The stored bytes of Hugging Face row `r`: llama q/k rows are put back from llama.cpp's
    /// rope order as [`Checkpoint::get`] does (within each head of `2h` rows, row `t·h + j`
    /// is stored as row `2j + t`).
    pub fn row(&self, r: usize) -> &'a [u8] {
        let stored = match self.unpermute_heads {
            None => r,
            Some(heads) => {
                let per_head = self.shape[0] / heads;
                let half = per_head / 2;
                let (head, within) = (r / per_head, r % per_head);
                head * per_head + 2 * (within % half) + within / half
            }
        };
        &self.bytes[stored * self.row_bytes..(stored + 1) * self.row_bytes]
    }

    /// Bytes per row.
    pub fn row_bytes(&self) -> usize {
        self.row_bytes
    }

    /// A tensor of `shape` stored as `bytes` in file order, for tests of its consumers.
    #[doc(hidden)]
    pub fn for_test(ty: GgmlType, shape: &'a [usize], bytes: &'a [u8]) -> Self {
        BlockTensor {
            ty,
            shape,
            bytes,
            row_bytes: bytes.len() / shape.first().copied().unwrap_or(1).max(1),
            unpermute_heads: None,
        }
    }
}

impl<'a> TensorRef<'a> {
    /// The bytes of rows `rows`, columns `cols` of this tensor read as `[_, width]` (a 1-D
    /// tensor is one column wide), one run of `cols.len()` elements per row: how a
    /// tensor-parallel rank reads only its slice of the mapping.
    pub fn runs(
        &self,
        width: usize,
        rows: Range<usize>,
        cols: Range<usize>,
    ) -> impl Iterator<Item = &'a [u8]> + use<'a> {
        let (bytes, size) = (self.bytes, self.dtype.size());
        rows.map(move |r| &bytes[(r * width + cols.start) * size..(r * width + cols.end) * size])
    }

    pub fn numel(&self) -> usize {
        self.shape.iter().product()
    }

    /// Widens the tensor to f32 (exact for every supported dtype).
    pub fn to_f32(&self) -> Vec<f32> {
        let mut out = vec![0.0; self.numel()];
        self.read_f32_into(&mut out);
        out
    }

    /// Widens the tensor into `out`, which must hold exactly `numel()` values.
    pub fn read_f32_into(&self, out: &mut [f32]) {
        assert_eq!(
            out.len(),
            self.numel(),
            "destination size for tensor {}",
            self.name
        );
        let size = self.dtype.size();
        for (o, b) in out.iter_mut().zip(self.bytes.chunks_exact(size)) {
            *o = self.dtype.widen(b);
        }
    }
}
