//! Engine assembly: a checkpoint directory and an [`EngineSpec`] in, a running [`Engine`] and
//! the pieces the front door keeps (tokenizer, chat template, decoding defaults) out. The one
//! place that knows how devices, tensor-parallel ranks and KV budgets become a backend.

use std::path::Path;
use std::sync::Arc;

use strata_collective::nccl::NcclGroup;
use strata_model::chat::{ChatTemplate, TemplateError};
use strata_model::cpu::{CpuModel, LoadError, PartialsFault};
use strata_model::grammar::GrammarCompiler;
use strata_model::tokenizer::{Tokenizer, TokenizerError};
use strata_model::weights::Checkpoint;
use strata_model::{ConfigError, EmbeddingConfig, GenerationConfig, ModelConfig};

use crate::backend::{
    Backend, CpuBackend, CpuTpBackend, CudaBackend, CudaOptions, CudaTpBackend, TpTransport,
    WeightSource,
};
use crate::kv::KvError;
use crate::spec::{Device, EngineSpec, KvBudget};
use crate::speculative::{DraftModelProposer, Speculator};
use crate::{Engine, EngineConfig};
pub use strata_engine_api::client::ServingParts;
use strata_engine_api::client::{EngineClient, StartEngine, StartError};

/// Why a checkpoint could not be made ready to serve.
#[derive(Debug, thiserror::Error)]
pub enum ModelLoadError {
    #[error(transparent)]
    Weights(#[from] LoadError),
    #[error(transparent)]
    Tokenizer(#[from] TokenizerError),
    #[error(transparent)]
    GenerationConfig(#[from] ConfigError),
    #[error(transparent)]
    Template(#[from] TemplateError),
    #[error("cannot start the engine: {0}")]
    Engine(#[from] KvError),
    #[error("block size must be at least 1")]
    BlockSize,
    #[error("{0}")]
    Device(String),
}

/// Starts the engine `spec` describes for the checkpoint in `dir`; the rest of the checkpoint
/// (tokenizer, chat template, decoding defaults) is kept for the front door.
pub fn start_engine(
    dir: &Path,
    spec: &EngineSpec,
) -> Result<(Engine, ServingParts), ModelLoadError> {
    // A draft model loads first: on a GPU the target's KV cache takes what is left.
    let draft = draft_backend(spec)?;
    let built = build_backend(dir, spec)?;
    start_parts(built, spec, dir, draft)
}

/// The draft model's backend, when `spec` speculates with one: the same device, one rank, a KV
/// cache of its own (a quarter of the CPU's budget, 2 GiB on a GPU).
fn draft_backend(spec: &EngineSpec) -> Result<Option<BuiltBackend>, ModelLoadError> {
    let Some(speculative) = &spec.speculative else {
        return Ok(None);
    };
    let Some(model) = speculative
        .model
        .as_ref()
        .filter(|_| speculative.method == crate::speculative::SpecMethod::DraftModel)
    else {
        return Ok(None);
    };
    if spec.tp > 1 {
        return Err(ModelLoadError::Device(format!(
            "speculative method draft_model runs beside a one-rank target; the target has tp {} \
             (TP degrees that do not match are refused)",
            spec.tp
        )));
    }
    let kv = match spec.kv {
        KvBudget::Bytes(bytes) => KvBudget::Bytes((bytes / 4).max(1 << 20)),
        KvBudget::GpuFraction(_) => KvBudget::Bytes(2 << 30),
    };
    let draft = EngineSpec {
        kv,
        speculative: None,
        tiers: Default::default(),
        ..spec.clone()
    };
    build_backend(model, &draft)
        .map(Some)
        .map_err(|e| ModelLoadError::Device(format!("the draft model {}: {e}", model.display())))
}

/// Refuses a draft whose tokenizer is not the target's: a proposal must mean the same text.
fn check_draft_tokenizer(target: &ServingParts, draft: &ServingParts) -> Result<(), String> {
    let (t, d) = (&target.tokenizer, &draft.tokenizer);
    if t.vocab_size() != d.vocab_size() {
        return Err(format!(
            "the draft model's tokenizer has {} tokens, the target's {}: a draft must share the \
             target's tokenizer",
            d.vocab_size(),
            t.vocab_size()
        ));
    }
    let differs = (0..t.vocab_size() as u32).find(|&id| t.id_to_token(id) != d.id_to_token(id));
    match differs {
        Some(id) => Err(format!(
            "the draft model's tokenizer differs from the target's at token {id} ({:?} vs {:?}): \
             a draft must share the target's tokenizer",
            d.id_to_token(id),
            t.id_to_token(id)
        )),
        None => Ok(()),
    }
}

/// A backend with what the front door keeps of its checkpoint.
pub struct BuiltBackend {
    pub backend: Box<dyn Backend>,
    pub parts: ServingParts,
    /// Every id that ends a sequence ([`eos_ids`]).
    pub eos_token_ids: Vec<u32>,
}

/// The backend `spec` describes for the checkpoint in `dir`, without an engine around it (for
/// tools that drive steps themselves, such as `strata eval`), with the front door's parts and
/// the end-of-sequence ids.
pub fn build_backend(dir: &Path, spec: &EngineSpec) -> Result<BuiltBackend, ModelLoadError> {
    spec.validate().map_err(ModelLoadError::Device)?;
    let cpu_bytes = || match spec.kv {
        KvBudget::Bytes(bytes) => Ok(bytes),
        KvBudget::GpuFraction(_) => Err(ModelLoadError::Device(
            "the CPU backend needs a KV cache size in bytes".into(),
        )),
    };
    let placement = match (spec.device, spec.tp) {
        (Device::Cpu, 1) => {
            if spec.block_size == 0 {
                return Err(ModelLoadError::BlockSize);
            }
            let mut loaded = LoadedModel::load(dir)?;
            if spec.quantize_activations {
                let quantized = Checkpoint::open(dir)
                    .and_then(|ckpt| loaded.model.quantize_activations(&ckpt))
                    .map_err(LoadError::from)?;
                tracing::info!("{quantized} projections quantize their inputs (W8A8 / W4A4)");
            }
            if spec.keep_quantized && !spec.quant_blocks {
                let kept = Checkpoint::open(dir)
                    .and_then(|ckpt| loaded.model.keep_tiled(&ckpt, spec.fp8_tiles))
                    .map_err(LoadError::from)?;
                tracing::info!("{kept} NVFP4 / FP8 projections compute the tiles' arithmetic");
            }
            let backend = CpuBackend::new(loaded.model, spec.block_size, cpu_bytes()?);
            let parts = ServingParts {
                tokenizer: loaded.tokenizer,
                template: loaded.template,
                generation_config: loaded.generation_config,
                embedding: loaded.embedding,
            };
            return Ok(BuiltBackend {
                backend: Box::new(backend),
                parts,
                eos_token_ids: loaded.eos_token_ids,
            });
        }
        (Device::Cpu, tp) => {
            // Each rank reads only its slices of the mapped checkpoint.
            let (config, checkpoint, parts, eos_token_ids) = serving_parts(dir)?;
            let backend =
                CpuTpBackend::new(&config, &checkpoint, tp, spec.block_size, cpu_bytes()?)
                    .map_err(|e| ModelLoadError::Device(format!("--tp {tp}: {e}")))?;
            return Ok(BuiltBackend {
                backend: Box::new(backend),
                parts,
                eos_token_ids,
            });
        }
        (Device::Cuda(first), tp) => CudaPlacement {
            devices: (first..first + tp).collect(),
            ..CudaPlacement::single(first)
        },
    };
    build_cuda_backend(dir, &placement, spec)
}

/// How the CUDA engine lays out its tensor-parallel ranks (DESIGN.md §5).
#[derive(Debug, Clone)]
pub struct CudaPlacement {
    /// Rank `r` runs on `devices[r]`; one device runs alone.
    pub devices: Vec<usize>,
    /// Alone: run as the one rank of an NCCL group on its own stream, the o and down outputs
    /// all-reduced through it (the TP = 1 path through the communicator; same bits as without).
    pub through_nccl: bool,
    /// Compute o and down in the shard order, byte-identical at every TP degree; always so with
    /// several ranks.
    pub sharded_reduction: bool,
    /// Several ranks: NCCL, or host-staged; by default NCCL when every device is distinct.
    pub transport: Option<TpTransport>,
    /// A deliberately wrong reduction of the partials, for the canary of `strata gpu tp`.
    #[doc(hidden)]
    pub fault: PartialsFault,
}

impl CudaPlacement {
    /// One rank on `ordinal`, the fused order.
    pub fn single(ordinal: usize) -> Self {
        CudaPlacement {
            devices: vec![ordinal],
            through_nccl: false,
            sharded_reduction: false,
            transport: None,
            fault: PartialsFault::None,
        }
    }
}

/// The engine on the CUDA devices of `placement`.
/// `spec`'s device and TP degree give way to the placement's devices.
pub fn start_cuda_engine(
    dir: &Path,
    placement: &CudaPlacement,
    spec: &EngineSpec,
) -> Result<(Engine, ServingParts), ModelLoadError> {
    // The draft runs on the placement's (one) device, beside its target.
    let draft_spec = EngineSpec {
        device: Device::Cuda(placement.devices.first().copied().unwrap_or(0)),
        tp: placement.devices.len().max(1),
        ..spec.clone()
    };
    let draft = draft_backend(&draft_spec)?;
    let built = build_cuda_backend(dir, placement, spec)?;
    start_parts(built, spec, dir, draft)
}

/// The CUDA backend of [`start_cuda_engine`], without the engine.
fn build_cuda_backend(
    dir: &Path,
    placement: &CudaPlacement,
    spec: &EngineSpec,
) -> Result<BuiltBackend, ModelLoadError> {
    if spec.block_size == 0 {
        return Err(ModelLoadError::BlockSize);
    }
    let devices = &placement.devices;
    let (Some(&first), Some(&last)) = (devices.first(), devices.iter().max()) else {
        return Err(ModelLoadError::Device("no CUDA device given".into()));
    };
    let device = Device::Cuda(first);
    let label = if devices.len() == 1 {
        device.to_string()
    } else {
        format!("cuda:{devices:?} (tensor parallel {})", devices.len())
    };
    if let Ok(inventory) = strata_collective::inventory::inspect()
        && last >= inventory.gpus.len()
    {
        let count = inventory.gpus.len();
        return Err(ModelLoadError::Device(format!(
            "{label}: device {last} does not exist; this machine has {count} GPU(s)"
        )));
    }
    let (config, checkpoint, parts, eos_token_ids) = serving_parts(dir)?;
    let (kv_cache_bytes, kv_memory_fraction) = match spec.kv {
        // Over all ranks, as on the CPU.
        KvBudget::Bytes(bytes) => (bytes / devices.len(), None),
        KvBudget::GpuFraction(f) => (0, Some(f)),
    };
    let options = CudaOptions {
        device: first,
        block_size: spec.block_size,
        kv_cache_bytes,
        kv_memory_fraction,
        kernel_cache: None,
        max_positions: None,
        graphs: true,
        tp_rank: 0,
        tp_world: 1,
        sharded_reduction: placement.sharded_reduction,
        widen_blocks: spec.widen_gguf,
        keep_quantized: spec.keep_quantized,
        quant_blocks: spec.quant_blocks,
        fp8_tiles: spec.fp8_tiles,
        run_order: spec.run_order,
    };
    let source = WeightSource::Checkpoint(&checkpoint);
    let failed = |e: &dyn std::fmt::Display| ModelLoadError::Device(format!("{label}: {e}"));
    let backend: Box<dyn Backend> = if devices.len() > 1 {
        let transport = placement
            .transport
            .unwrap_or_else(|| TpTransport::for_devices(devices));
        let mut backend = CudaTpBackend::new(&config, source, &options, devices, transport)
            .map_err(|e| failed(&e))?;
        if placement.fault != PartialsFault::None {
            backend.inject_partials_fault(placement.fault);
        }
        Box::new(backend)
    } else {
        let mut backend = CudaBackend::new(&config, source, &options).map_err(|e| failed(&e))?;
        if placement.through_nccl {
            let comm = NcclGroup::on_streams(vec![backend.stream().clone()])
                .map_err(|e| ModelLoadError::Device(format!("{label}: NCCL: {e}")))?
                .pop()
                .expect("one communicator per stream");
            backend
                .attach_communicator(Box::new(comm))
                .map_err(|e| failed(&e))?;
        }
        Box::new(backend)
    };
    Ok(BuiltBackend {
        backend,
        parts,
        eos_token_ids,
    })
}

/// What a sharded backend starts from: the config and the mapped checkpoint (weights not yet
/// read), and what the front door keeps.
fn serving_parts(
    dir: &Path,
) -> Result<(ModelConfig, Checkpoint, ServingParts, Vec<u32>), ModelLoadError> {
    let (config, parts, eos_token_ids) = front_door_parts(dir)?;
    let checkpoint = Checkpoint::open(dir).map_err(LoadError::from)?;
    Ok((config, checkpoint, parts, eos_token_ids))
}

/// The engine over `backend`, with a grammar compiler from the parts' tokenizer.
fn start_parts(
    built: BuiltBackend,
    spec: &EngineSpec,
    model: &Path,
    draft: Option<BuiltBackend>,
) -> Result<(Engine, ServingParts), ModelLoadError> {
    let BuiltBackend {
        backend,
        parts,
        eos_token_ids,
    } = built;
    let speculator = match (&spec.speculative, draft) {
        (Some(config), Some(draft)) => {
            check_draft_tokenizer(&parts, &draft.parts).map_err(ModelLoadError::Device)?;
            Some(Speculator::with_proposer(
                config.clone(),
                Box::new(DraftModelProposer::new(draft.backend)),
            ))
        }
        (Some(config), None) => {
            Some(Speculator::new(config.clone()).map_err(ModelLoadError::Device)?)
        }
        (None, _) => None,
    };
    let vocab = backend.model_config().vocab_size;
    let grammar = grammar_compiler(&parts.tokenizer, vocab, &eos_token_ids);
    let mut tiers = spec.tiers.clone();
    if let Some(disk) = &mut tiers.disk {
        disk.dir = disk.dir.join(kv_disk_namespace(model, backend.as_ref()));
    }
    let engine = Engine::start_with(
        backend,
        EngineConfig {
            limits: spec.limits,
            tiers,
            eos_token_ids,
            grammar,
            speculative: None,
        },
        speculator,
    )?;
    Ok((engine, parts))
}

/// The disk tier's subdirectory for this model and KV layout. A block's hash names its tokens,
/// not the weights that computed its bytes, so blocks a restarted engine takes back must come
/// from the same checkpoint (its files' names, sizes and modification times) in the same byte
/// layout (backend, shape, block size, TP ranks): anything else finds another directory.
pub fn kv_disk_namespace(model: &Path, backend: &dyn Backend) -> String {
    let mut identity = format!(
        "{}|{}|{}|{}",
        backend.kv_layout(),
        backend.block_size(),
        backend.block_bytes(),
        backend.model_config().architecture.model_type()
    );
    let mut files: Vec<(String, u64, u128)> = Vec::new();
    let mut note = |path: &Path| {
        if let Ok(meta) = std::fs::metadata(path) {
            let modified = meta
                .modified()
                .ok()
                .and_then(|t| t.duration_since(std::time::UNIX_EPOCH).ok())
                .map_or(0, |d| d.as_nanos());
            let name = path.file_name().map(|n| n.to_string_lossy().into_owned());
            files.push((name.unwrap_or_default(), meta.len(), modified));
        }
    };
    match std::fs::read_dir(model) {
        Ok(entries) => entries.flatten().for_each(|e| note(&e.path())),
        Err(_) => note(model),
    }
    files.sort();
    for (name, len, modified) in files {
        identity.push_str(&format!("|{name}:{len}:{modified}"));
    }
    format!("{:016x}", xxhash_rust::xxh3::xxh3_64(identity.as_bytes()))
}

/// A checkpoint directory read into memory: weights, tokenizer, chat template, decoding defaults.
pub struct LoadedModel {
    pub model: CpuModel,
    pub tokenizer: Tokenizer,
    /// `None` when the checkpoint ships no chat template.
    pub template: Option<ChatTemplate>,
    pub generation_config: GenerationConfig,
    pub eos_token_ids: Vec<u32>,
    pub embedding: EmbeddingConfig,
}

impl LoadedModel {
    pub fn load(dir: &Path) -> Result<Self, ModelLoadError> {
        let model = CpuModel::load(dir)?;
        let tokenizer = Tokenizer::from_dir(dir)?;
        let template = ChatTemplate::from_dir(dir)?;
        let generation_config = GenerationConfig::from_dir(dir)?;
        let eos_token_ids = eos_ids(model.config(), &generation_config, &tokenizer);
        Ok(Self {
            model,
            tokenizer,
            template,
            generation_config,
            eos_token_ids,
            embedding: EmbeddingConfig::from_dir(dir)?,
        })
    }
}

/// The front door's pieces of the checkpoint in `dir`, without its weights (a router's machine
/// need not hold them), with the model's config and end-of-sequence ids.
pub fn front_door_parts(
    dir: &Path,
) -> Result<(ModelConfig, ServingParts, Vec<u32>), ModelLoadError> {
    let config = ModelConfig::from_dir(dir)?;
    let tokenizer = Tokenizer::from_dir(dir)?;
    let template = ChatTemplate::from_dir(dir)?;
    let generation_config = GenerationConfig::from_dir(dir)?;
    let eos_token_ids = eos_ids(&config, &generation_config, &tokenizer);
    let parts = ServingParts {
        tokenizer,
        template,
        generation_config,
        embedding: EmbeddingConfig::from_dir(dir)?,
    };
    Ok((config, parts, eos_token_ids))
}

/// A server starts its engine through the spec ([`start_engine`]).
impl StartEngine for EngineSpec {
    fn start(&self, dir: &Path) -> Result<(Arc<dyn EngineClient>, ServingParts), StartError> {
        let (engine, parts) = start_engine(dir, self)?;
        Ok((Arc::new(engine), parts))
    }
}

/// Every id that ends a sequence: config.json, generation_config.json and the tokenizer's eos.
pub fn eos_ids(config: &ModelConfig, g: &GenerationConfig, tokenizer: &Tokenizer) -> Vec<u32> {
    let mut ids: Vec<u32> = config
        .eos_token_ids
        .iter()
        .chain(&g.eos_token_ids)
        .copied()
        .collect();
    ids.extend(tokenizer.eos_token_id());
    ids.sort_unstable();
    ids.dedup();
    ids
}

/// The grammar compiler for structured output, ending grammars with `eos` (or, when the model
/// names none, the tokenizer's end-of-sequence token). `None`, with the reason on stderr, when
/// the tokenizer's vocabulary cannot be mapped to bytes: constrained requests are then refused.
pub fn grammar_compiler(
    tokenizer: &Tokenizer,
    model_vocab: usize,
    eos: &[u32],
) -> Option<Arc<GrammarCompiler>> {
    let fallback: Vec<u32> = tokenizer.eos_token_id().into_iter().collect();
    let eos = if eos.is_empty() { &fallback } else { eos };
    match GrammarCompiler::new(tokenizer, model_vocab, eos) {
        Ok(compiler) => Some(Arc::new(compiler)),
        Err(e) => {
            eprintln!("structured output is off: {e}");
            None
        }
    }
}
