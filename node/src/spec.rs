//! One engine spec (DESIGN.md §3): where the engine runs and with what budgets. Every command
//! that runs an engine (`serve`, `node serve`, `generate`, the GPU checks) builds it from this,
//! through [`crate::launch::start_engine`]; the router receives the engine and knows nothing of
//! devices.

use crate::scheduler::SchedulerLimits;
use crate::speculative::SpeculativeConfig;

/// Where the engine runs: the CPU reference or a CUDA GPU.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Device {
    #[default]
    Cpu,
    Cuda(usize),
}

impl std::str::FromStr for Device {
    type Err = String;

    /// `cpu`, `cuda` (device 0) or `cuda:N`.
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "cpu" => Ok(Device::Cpu),
            "cuda" => Ok(Device::Cuda(0)),
            _ => s
                .strip_prefix("cuda:")
                .and_then(|n| n.parse().ok())
                .map(Device::Cuda)
                .ok_or_else(|| format!("unknown device {s:?}: use cpu, cuda or cuda:N")),
        }
    }
}

impl std::fmt::Display for Device {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Device::Cpu => f.write_str("cpu"),
            Device::Cuda(n) => write!(f, "cuda:{n}"),
        }
    }
}

/// How much memory the KV cache takes.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum KvBudget {
    /// This many bytes over all tensor-parallel ranks.
    Bytes(usize),
    /// On CUDA: the engine may use this fraction of each GPU's memory in all; the KV cache gets
    /// what is left of it after the weights and a reserve for activations (vLLM's
    /// `--gpu-memory-utilization`).
    GpuFraction(f64),
}

/// Default KV budget of the CPU backend.
pub const CPU_KV_CACHE_BYTES: usize = 256 << 20;
/// Default share of a GPU's memory the engine takes.
pub const GPU_MEMORY_FRACTION: f64 = 0.9;

/// The KV tiers below the device: cached blocks evicted from the device are demoted to host
/// memory, and from there to disk, and restored by copy when a prompt needs them again.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct KvTiers {
    /// Bytes of host memory for evicted blocks (0 = no host tier).
    pub host_bytes: usize,
    /// A directory for blocks evicted from the host tier, with its budget in bytes.
    pub disk: Option<DiskTierSpec>,
    /// Whether a cached block in a lower tier is restored always, or only where restoring it is
    /// measured to beat recomputing it (`auto`, the default).
    pub restore: crate::kv::RestorePolicy,
}

/// Where the disk tier keeps its blocks and how many bytes it may take.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DiskTierSpec {
    pub dir: std::path::PathBuf,
    pub bytes: usize,
}

impl KvTiers {
    /// The tiers' capacities in blocks of `block_bytes`: host blocks, and the disk directory
    /// with its blocks. A tier given memory that holds no whole block is refused by name.
    pub fn blocks(
        &self,
        block_bytes: usize,
    ) -> Result<(usize, Option<(std::path::PathBuf, usize)>), String> {
        let whole = |what: &str, bytes: usize| {
            let blocks = bytes / block_bytes.max(1);
            if bytes > 0 && blocks == 0 {
                Err(format!(
                    "the KV {what} tier's {bytes} bytes hold no KV block of {block_bytes} bytes"
                ))
            } else {
                Ok(blocks)
            }
        };
        let host = whole("host", self.host_bytes)?;
        let disk = match &self.disk {
            Some(d) => Some((d.dir.clone(), whole("disk", d.bytes)?)),
            None => None,
        };
        Ok((host, disk))
    }
}

/// Everything an engine is built from.
#[derive(Debug, Clone, PartialEq)]
pub struct EngineSpec {
    pub device: Device,
    /// Tensor-parallel ranks (1 = none).
    pub tp: usize,
    /// Tokens per KV block.
    pub block_size: usize,
    pub kv: KvBudget,
    /// The scheduler's per-step token budget and running-sequence limit.
    pub limits: SchedulerLimits,
    /// CUDA: widen a GGUF checkpoint's block-quantized projections to bf16 at load instead of
    /// keeping them in their formats (the same outputs bit for bit; about 2-3.5x the weight
    /// memory, faster decode where the block kernels are slower than bf16:
    /// docs/receipts/gguf-blocks-h200.json).
    pub widen_gguf: bool,
    /// CUDA: keep an FP8 or NVFP4 safetensors checkpoint's quantized projections on the device
    /// instead of widening them to bf16 at load: about 1.9x (FP8) and 3.2x (NVFP4) less weight
    /// memory. On one GPU NVFP4 goes into fragment-ordered tiles (its own arithmetic, the tensor
    /// scale once per output; 2.06x bf16's decode at batch 1: docs/receipts/tiles-nvfp4.json),
    /// and so does FP8 with a scale per tensor or per channel with `fp8_tiles`; elsewhere, or
    /// with `quant_blocks`, they stay in strata's blocks (the widened model's bits, slower decode
    /// than bf16: docs/receipts/quant-blocks-h100.json). The CPU reference (one rank) then
    /// computes the tiles' arithmetic too, their oracle.
    pub keep_quantized: bool,
    /// With `keep_quantized`: NVFP4 and FP8 in blocks (the widened model's bits) even where
    /// tiles could hold them, and the widened arithmetic on the CPU reference.
    pub quant_blocks: bool,
    /// With `keep_quantized`: FP8 with a scale per tensor or per channel in fragment-ordered
    /// tiles too (its own arithmetic: the e4m3 values exact in bf16, the scale once per output),
    /// on the CPU reference as well. Off until its GPU gate and speed are measured (issue 36).
    pub fp8_tiles: bool,
    /// CPU: compute a quantized checkpoint's activation quantization (W8A8 / W4A4: each
    /// projection's input quantized as its config asks) instead of weight-only arithmetic — the
    /// reference the FP8 / FP4 activation kernels are gated against.
    pub quantize_activations: bool,
    /// CUDA: every row of a step — decode and prompt rows alike — through the run-order kernels,
    /// one weight read a step and each row's bits independent of the rows beside it, but not
    /// the default kernels' bits; bf16 weights and one GPU only (docs/DECISIONS.md, the run
    /// order).
    pub run_order: bool,
    /// Host and disk tiers under the device's KV cache.
    pub tiers: KvTiers,
    /// Speculative decoding: what proposes tokens and how many a step verifies.
    pub speculative: Option<SpeculativeConfig>,
}

impl EngineSpec {
    /// The defaults for `device`: on the CPU a 256 MiB KV cache and small steps (512 tokens,
    /// 64 sequences: a CPU step is slow, so a long prefill would stall every stream); on CUDA
    /// 90 % of the GPU's memory, 2 048-token steps and 256 sequences (what keeps a GPU busy
    /// under load while a prefill chunk costs running streams tens of milliseconds at most).
    pub fn for_device(device: Device) -> Self {
        let (kv, limits) = match device {
            Device::Cpu => (
                KvBudget::Bytes(CPU_KV_CACHE_BYTES),
                SchedulerLimits::default(),
            ),
            Device::Cuda(_) => (
                KvBudget::GpuFraction(GPU_MEMORY_FRACTION),
                SchedulerLimits {
                    max_batch_tokens: 2048,
                    max_running: 256,
                },
            ),
        };
        Self {
            device,
            tp: 1,
            block_size: 16,
            kv,
            limits,
            widen_gguf: false,
            keep_quantized: false,
            quant_blocks: false,
            fp8_tiles: false,
            quantize_activations: false,
            run_order: false,
            tiers: KvTiers::default(),
            speculative: None,
        }
    }

    /// The spec's own consistency; the message names the setting.
    pub fn validate(&self) -> Result<(), String> {
        if self.tp == 0 {
            return Err("tp must be at least 1".into());
        }
        if self.block_size == 0 {
            return Err("block size must be at least 1".into());
        }
        if self.quantize_activations && (self.device != Device::Cpu || self.tp > 1) {
            return Err(
                "quantize_activations runs on the CPU reference alone (one rank): the CUDA \
                 activation-quantized kernels are not written yet"
                    .into(),
            );
        }
        if self.fp8_tiles && (!self.keep_quantized || self.quant_blocks) {
            return Err(
                "fp8_tiles keeps FP8 in tiles, which needs keep_quantized and contradicts \
                 quant_blocks"
                    .into(),
            );
        }
        if self.keep_quantized && !self.quant_blocks && self.device == Device::Cpu && self.tp > 1 {
            return Err(
                "keep_quantized on the CPU reference computes the tiles' arithmetic on one rank \
                 (tp = 1); quant_blocks keeps the widened weights' arithmetic at any tp"
                    .into(),
            );
        }
        if let Some(speculative) = &self.speculative {
            speculative.validate()?;
        }
        if self.limits.max_batch_tokens == 0 {
            return Err("max_batch_tokens must be at least 1".into());
        }
        if self.limits.max_running == 0 {
            return Err("max_running must be at least 1".into());
        }
        if let Some(disk) = &self.tiers.disk
            && disk.bytes == 0
        {
            return Err(format!(
                "the KV disk tier in {} needs a size",
                disk.dir.display()
            ));
        }
        match self.kv {
            KvBudget::Bytes(0) => Err("the KV cache needs some memory".into()),
            KvBudget::GpuFraction(f) if !(f > 0.0 && f <= 1.0) => {
                Err(format!("gpu memory utilization must be in (0, 1]; got {f}"))
            }
            KvBudget::GpuFraction(_) if self.device == Device::Cpu => Err(
                "gpu memory utilization applies to CUDA devices; give the CPU a KV cache size"
                    .into(),
            ),
            _ => Ok(()),
        }
    }
}

impl Default for EngineSpec {
    fn default() -> Self {
        Self::for_device(Device::Cpu)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn devices_parse_and_print() {
        for (text, device) in [
            ("cpu", Device::Cpu),
            ("cuda", Device::Cuda(0)),
            ("cuda:3", Device::Cuda(3)),
        ] {
            assert_eq!(text.parse::<Device>(), Ok(device));
        }
        assert_eq!(Device::Cuda(3).to_string(), "cuda:3");
        assert!(
            "gpu"
                .parse::<Device>()
                .unwrap_err()
                .contains("cpu, cuda or cuda:N")
        );
    }

    #[test]
    fn defaults_follow_the_device_and_bad_settings_are_named() {
        assert_eq!(
            EngineSpec::default().kv,
            KvBudget::Bytes(CPU_KV_CACHE_BYTES)
        );
        let cuda = EngineSpec::for_device(Device::Cuda(0));
        assert_eq!(cuda.kv, KvBudget::GpuFraction(GPU_MEMORY_FRACTION));
        assert!(cuda.limits.max_batch_tokens > SchedulerLimits::default().max_batch_tokens);
        assert_eq!(cuda.validate(), Ok(()));
        let bad = |f: fn(&mut EngineSpec)| {
            let mut spec = EngineSpec::for_device(Device::Cuda(0));
            f(&mut spec);
            spec.validate().unwrap_err()
        };
        assert!(bad(|s| s.tp = 0).contains("tp"));
        assert!(bad(|s| s.limits.max_batch_tokens = 0).contains("max_batch_tokens"));
        assert!(bad(|s| s.kv = KvBudget::GpuFraction(1.5)).contains("(0, 1]"));
        assert!(
            bad(|s| s.device = Device::Cpu).contains("CUDA devices"),
            "a fraction of GPU memory means nothing on the CPU"
        );
        // Kept NVFP4's arithmetic on the CPU reference is one rank's; the widened one is not.
        let cpu_kept = |tp, quant_blocks| EngineSpec {
            tp,
            keep_quantized: true,
            quant_blocks,
            ..EngineSpec::default()
        };
        assert_eq!(cpu_kept(1, false).validate(), Ok(()));
        assert!(
            cpu_kept(2, false)
                .validate()
                .unwrap_err()
                .contains("one rank")
        );
        assert_eq!(cpu_kept(2, true).validate(), Ok(()));
        let fp8_tiles = |keep_quantized, quant_blocks| EngineSpec {
            keep_quantized,
            quant_blocks,
            fp8_tiles: true,
            ..EngineSpec::default()
        };
        assert_eq!(fp8_tiles(true, false).validate(), Ok(()));
        assert!(
            fp8_tiles(false, false)
                .validate()
                .unwrap_err()
                .contains("fp8_tiles")
        );
        assert!(
            fp8_tiles(true, true)
                .validate()
                .unwrap_err()
                .contains("fp8_tiles")
        );
    }
}
