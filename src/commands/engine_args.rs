//! The engine's settings as flags and TOML keys, defined once: `serve`, `node serve` and
//! `generate` flatten [`EngineSettings`] into their own and build the engine from
//! [`EngineSettings::spec`].

use anyhow::Result;
use clap::Args;
use serde::Deserialize;
use strata_node::speculative::SpeculativeConfig;
use strata_node::{Device, DiskTierSpec, EngineSpec, KvBudget};

/// Every engine setting, each optional so a flag, a config file and the device's default can be
/// told apart (`EngineSpec::for_device` holds the defaults).
#[derive(Args, Deserialize, Default, Clone, Debug, PartialEq)]
pub struct EngineSettings {
    /// Where the engine runs: cpu, cuda or cuda:N [default: cpu].
    #[arg(long)]
    pub device: Option<String>,
    /// Tensor-parallel ranks: the model's heads and MLP split over this many workers (threads
    /// on the CPU; on CUDA one GPU each, cuda:N .. N+tp-1, over NCCL), with output
    /// byte-identical to 1 [default: 1].
    #[arg(long)]
    pub tp: Option<usize>,
    /// Tokens per KV block [default: 16].
    #[arg(long)]
    pub block_size: Option<usize>,
    /// Memory for the KV cache, in MiB, over all ranks [default on the CPU: 256; on CUDA the
    /// cache is sized by --gpu-memory-utilization].
    #[arg(long, conflicts_with = "gpu_memory_utilization")]
    pub kv_cache_mib: Option<usize>,
    /// CUDA: the fraction of each GPU's memory the engine may take; the KV cache gets what the
    /// weights and a reserve for activations leave of it [default: 0.9].
    #[arg(long)]
    pub gpu_memory_utilization: Option<f64>,
    /// Tokens one engine step computes, prompt chunks and decode tokens together: longer
    /// prompts are prefilled in chunks beside running streams [default: 512 on the CPU, 2048 on
    /// CUDA].
    #[arg(long)]
    pub max_batch_tokens: Option<usize>,
    /// Sequences decoding at once; more wait [default: 64 on the CPU, 256 on CUDA].
    #[arg(long)]
    pub max_running: Option<usize>,
    /// CUDA: widen a GGUF file's block-quantized weights to bf16 at load instead of keeping
    /// them in their formats: the same outputs, 2-3.5x the weight memory, faster decode for
    /// k-quants today (docs/MODELS.md) [default: false].
    #[arg(long, num_args = 0..=1, default_missing_value = "true")]
    pub widen_gguf: Option<bool>,
    /// CUDA: keep an FP8 or NVFP4 safetensors checkpoint's weights quantized on the device:
    /// about 1.9x / 3.2x less weight memory; on one GPU NVFP4 and FP8 (a scale per tensor or
    /// per channel) in fragment-ordered tiles (their own arithmetic, the scale once per output;
    /// NVFP4 about 2x bf16's decode at batch 1), elsewhere in strata's blocks (the widened
    /// model's outputs, slower decode); the CPU reference then computes the tiles' arithmetic
    /// too (docs/MODELS.md) [default: false, widened to bf16].
    #[arg(long, num_args = 0..=1, default_missing_value = "true")]
    pub keep_quantized: Option<bool>,
    /// With --keep-quantized: NVFP4 and FP8 in strata's blocks (the widened model's outputs,
    /// slower) instead of tiles, and the widened arithmetic on the CPU; `--nvfp4-blocks` is the
    /// earlier spelling [default: false].
    #[arg(long, alias = "nvfp4-blocks", num_args = 0..=1, default_missing_value = "true")]
    #[serde(alias = "nvfp4_blocks")]
    pub quant_blocks: Option<bool>,
    /// With --keep-quantized: FP8 with a scale per tensor or per channel in fragment-ordered
    /// tiles too (its own arithmetic: the e4m3 values, the scale once per output; on the CPU
    /// reference as well) instead of blocks. Off until its GPU gate and speed are measured
    /// [default: false].
    #[arg(long, num_args = 0..=1, default_missing_value = "true")]
    pub fp8_tiles: Option<bool>,
    /// CPU: compute a quantized checkpoint's activation quantization (W8A8 / W4A4, as its
    /// config asks) instead of weight-only arithmetic: the reference for activation-quantized
    /// kernels and for quality comparisons (docs/MODELS.md) [default: false].
    #[arg(long, num_args = 0..=1, default_missing_value = "true")]
    pub quantize_activations: Option<bool>,
    /// CUDA: every row of a step, decode and prompt rows alike, through the run-order kernels:
    /// one read of the weights a step where prompts and decode share it (the default reads them
    /// twice), batch-invariant, but other bits than the default; bf16 weights and one GPU only
    /// [default: false].
    #[arg(long, num_args = 0..=1, default_missing_value = "true")]
    pub run_order: Option<bool>,
    /// Host memory, in MiB, for KV blocks evicted from the device: a later prompt with the
    /// same prefix restores them by copy instead of recomputing [default: 0, no host tier].
    #[arg(long)]
    pub kv_host_mib: Option<usize>,
    /// A directory for KV blocks evicted from the host tier (needs --kv-disk-mib); what it
    /// holds outlives the process: a restarted engine serves it again.
    #[arg(long, requires = "kv_disk_mib")]
    pub kv_disk_dir: Option<std::path::PathBuf>,
    /// Disk space, in MiB, the disk tier may take (needs --kv-disk-dir).
    #[arg(long, requires = "kv_disk_dir")]
    pub kv_disk_mib: Option<usize>,
    /// Restore cached KV from the host and disk tiers `always`, or only where the tier's
    /// measured restore rate beats recomputing at the engine's measured prefill rate (`auto`:
    /// a lower tier never makes a first token slower than no tier) [default: auto].
    #[arg(long)]
    pub kv_restore: Option<strata_node::kv::RestorePolicy>,
    /// Speculative decoding, as JSON in vLLM's spelling: '{"method": "ngram",
    /// "num_speculative_tokens": 5, "prompt_lookup_max": 4, "prompt_lookup_min": 2}'. Output is
    /// byte-identical to decoding without it, greedy and seeded; the scheduler proposes fewer
    /// tokens where acceptance or the step's cost says so (docs/SERVING.md) [default: off].
    /// In the TOML file, a table.
    #[arg(long, value_parser = SpeculativeConfig::from_json)]
    pub speculative_config: Option<SpeculativeConfig>,
}

impl EngineSettings {
    /// Each setting from `self`, else from `fallback`.
    pub fn or(self, fallback: Self) -> Self {
        Self {
            device: self.device.or(fallback.device),
            tp: self.tp.or(fallback.tp),
            block_size: self.block_size.or(fallback.block_size),
            kv_cache_mib: self.kv_cache_mib.or(fallback.kv_cache_mib),
            gpu_memory_utilization: self
                .gpu_memory_utilization
                .or(fallback.gpu_memory_utilization),
            max_batch_tokens: self.max_batch_tokens.or(fallback.max_batch_tokens),
            max_running: self.max_running.or(fallback.max_running),
            widen_gguf: self.widen_gguf.or(fallback.widen_gguf),
            keep_quantized: self.keep_quantized.or(fallback.keep_quantized),
            quant_blocks: self.quant_blocks.or(fallback.quant_blocks),
            fp8_tiles: self.fp8_tiles.or(fallback.fp8_tiles),
            quantize_activations: self.quantize_activations.or(fallback.quantize_activations),
            run_order: self.run_order.or(fallback.run_order),
            kv_host_mib: self.kv_host_mib.or(fallback.kv_host_mib),
            kv_disk_dir: self.kv_disk_dir.or(fallback.kv_disk_dir),
            kv_disk_mib: self.kv_disk_mib.or(fallback.kv_disk_mib),
            kv_restore: self.kv_restore.or(fallback.kv_restore),
            speculative_config: self.speculative_config.or(fallback.speculative_config),
        }
    }

    /// The device's defaults with every given setting applied, checked.
    pub fn spec(&self) -> Result<EngineSpec> {
        let device: Device = match &self.device {
            Some(d) => d.parse().map_err(anyhow::Error::msg)?,
            None => Device::Cpu,
        };
        let mut spec = EngineSpec::for_device(device);
        if let Some(tp) = self.tp {
            spec.tp = tp;
        }
        if let Some(block_size) = self.block_size {
            spec.block_size = block_size;
        }
        match (self.kv_cache_mib, self.gpu_memory_utilization) {
            (Some(_), Some(_)) => {
                anyhow::bail!("give kv_cache_mib or gpu_memory_utilization, not both")
            }
            (Some(mib), None) => {
                spec.kv = KvBudget::Bytes(mib_bytes("kv_cache_mib", mib)?);
            }
            (None, Some(fraction)) => spec.kv = KvBudget::GpuFraction(fraction),
            (None, None) => {}
        }
        if let Some(tokens) = self.max_batch_tokens {
            spec.limits.max_batch_tokens = tokens;
        }
        if let Some(running) = self.max_running {
            spec.limits.max_running = running;
        }
        if let Some(widen) = self.widen_gguf {
            spec.widen_gguf = widen;
        }
        if let Some(keep) = self.keep_quantized {
            spec.keep_quantized = keep;
        }
        if let Some(tiles) = self.fp8_tiles {
            spec.fp8_tiles = tiles;
        }
        if let Some(blocks) = self.quant_blocks {
            spec.quant_blocks = blocks;
        }
        if let Some(quantize) = self.quantize_activations {
            spec.quantize_activations = quantize;
        }
        if let Some(run_order) = self.run_order {
            if run_order && device == Device::Cpu {
                anyhow::bail!(
                    "run_order is a CUDA setting (the CPU reference has one order); give \
                     --device cuda"
                );
            }
            spec.run_order = run_order;
        }
        if let Some(mib) = self.kv_host_mib {
            spec.tiers.host_bytes = mib_bytes("kv_host_mib", mib)?;
        }
        spec.tiers.disk = match (&self.kv_disk_dir, self.kv_disk_mib) {
            (Some(dir), Some(mib)) => Some(DiskTierSpec {
                dir: dir.clone(),
                bytes: mib_bytes("kv_disk_mib", mib)?,
            }),
            (None, None) => None,
            (Some(_), None) => anyhow::bail!("kv_disk_dir needs kv_disk_mib, the tier's size"),
            (None, Some(_)) => anyhow::bail!("kv_disk_mib needs kv_disk_dir, where the tier lives"),
        };
        if let Some(policy) = self.kv_restore {
            spec.tiers.restore = policy;
        }
        spec.speculative = self.speculative_config.clone();
        spec.validate().map_err(anyhow::Error::msg)?;
        Ok(spec)
    }
}

/// `mib` MiB in bytes, or why not.
fn mib_bytes(setting: &str, mib: usize) -> Result<usize> {
    mib.checked_mul(1 << 20)
        .ok_or_else(|| anyhow::anyhow!("{setting} {mib} is more memory than can be addressed"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn settings_apply_over_the_device_defaults() {
        let spec = EngineSettings::default().spec().unwrap();
        assert_eq!(spec, EngineSpec::default());
        let cuda = EngineSettings {
            device: Some("cuda:1".into()),
            max_running: Some(128),
            ..Default::default()
        };
        let spec = cuda.spec().unwrap();
        assert_eq!(spec.device, Device::Cuda(1));
        assert_eq!(spec.limits.max_running, 128);
        assert_eq!(spec.kv, KvBudget::GpuFraction(0.9));
        let fixed = EngineSettings {
            kv_cache_mib: Some(64),
            ..cuda
        };
        assert_eq!(fixed.spec().unwrap().kv, KvBudget::Bytes(64 << 20));
        assert!(!fixed.spec().unwrap().widen_gguf);
        let widened = EngineSettings {
            widen_gguf: Some(true),
            ..fixed
        };
        assert!(widened.spec().unwrap().widen_gguf);
    }

    #[test]
    fn widen_gguf_is_a_flag_a_value_and_a_toml_key() {
        let parse = |args: &[&str]| settings_of_flags(args).widen_gguf;
        assert_eq!(parse(&[]), None);
        assert_eq!(parse(&["--widen-gguf"]), Some(true));
        assert_eq!(parse(&["--widen-gguf", "false"]), Some(false));
        let toml: EngineSettings = toml::from_str("widen_gguf = true").unwrap();
        assert_eq!(toml.widen_gguf, Some(true));
    }

    /// The engine settings a command line of engine flags gives.
    fn settings_of_flags(args: &[&str]) -> EngineSettings {
        #[derive(clap::Parser)]
        struct Cli {
            #[command(flatten)]
            engine: EngineSettings,
        }
        use clap::Parser;
        Cli::try_parse_from(std::iter::once("strata").chain(args.iter().copied()))
            .unwrap()
            .engine
    }

    #[test]
    fn the_run_order_is_a_cuda_flag_and_toml_key_off_by_default() {
        let spec = |args: &[&str]| settings_of_flags(args).spec();
        assert!(!spec(&["--device", "cuda"]).unwrap().run_order);
        assert!(
            spec(&["--device", "cuda:1", "--run-order"])
                .unwrap()
                .run_order
        );
        let toml: EngineSettings = toml::from_str("device = \"cuda\"\nrun_order = true").unwrap();
        assert!(toml.spec().unwrap().run_order);
        let refused = spec(&["--run-order"]).unwrap_err().to_string();
        assert!(refused.contains("CUDA setting"), "{refused}");
        assert!(!spec(&["--run-order", "false"]).unwrap().run_order);
    }

    #[test]
    fn speculative_config_is_vllm_json_a_toml_table_and_refused_by_name() {
        let spec = settings_of_flags(&[
            "--speculative-config",
            r#"{"method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_max": 4}"#,
        ])
        .spec()
        .unwrap();
        let s = spec.speculative.unwrap();
        assert_eq!(s.num_speculative_tokens, 5);
        assert_eq!(s.lookup(), (2, 4));
        assert!(
            EngineSettings::default()
                .spec()
                .unwrap()
                .speculative
                .is_none()
        );
        let toml: EngineSettings =
            toml::from_str("[speculative_config]\nmethod = \"ngram\"\nnum_speculative_tokens = 3")
                .unwrap();
        assert_eq!(
            toml.spec()
                .unwrap()
                .speculative
                .unwrap()
                .num_speculative_tokens,
            3
        );
        let bad: EngineSettings =
            toml::from_str("[speculative_config]\nmethod = \"ngram\"\nnum_speculative_tokens = 12")
                .unwrap();
        let refused = bad.spec().unwrap_err().to_string();
        assert!(refused.contains("num_speculative_tokens"), "{refused}");
        #[derive(clap::Parser, Debug)]
        struct Cli {
            #[command(flatten)]
            _engine: EngineSettings,
        }
        use clap::Parser;
        let refused = Cli::try_parse_from([
            "strata",
            "--speculative-config",
            r#"{"method": "medusa", "num_speculative_tokens": 2}"#,
        ])
        .unwrap_err()
        .to_string();
        assert!(refused.contains("medusa"), "{refused}");
    }

    #[test]
    fn keep_quantized_and_quantize_activations_are_flags_toml_keys_and_off_by_default() {
        let spec = |args: &[&str]| settings_of_flags(args).spec().unwrap();
        assert!(!spec(&[]).keep_quantized);
        assert!(spec(&["--keep-quantized"]).keep_quantized);
        assert!(!spec(&[]).quant_blocks);
        assert!(spec(&["--keep-quantized", "--quant-blocks"]).quant_blocks);
        assert!(spec(&["--keep-quantized", "--nvfp4-blocks"]).quant_blocks);
        assert!(!spec(&["--keep-quantized"]).fp8_tiles);
        assert!(spec(&["--keep-quantized", "--fp8-tiles"]).fp8_tiles);
        assert!(!spec(&[]).quantize_activations);
        assert!(spec(&["--quantize-activations"]).quantize_activations);
        let toml: EngineSettings = toml::from_str("keep_quantized = true").unwrap();
        assert!(toml.spec().unwrap().keep_quantized);
        let toml: EngineSettings = toml::from_str("quantize_activations = true").unwrap();
        assert!(toml.spec().unwrap().quantize_activations);
        // The blocks' key in both spellings, FP8's tiles by their key.
        for text in [
            "keep_quantized = true\nquant_blocks = true",
            "keep_quantized = true\nnvfp4_blocks = true",
        ] {
            let toml: EngineSettings = toml::from_str(text).unwrap();
            assert!(toml.spec().unwrap().quant_blocks, "{text}");
        }
        let toml: EngineSettings =
            toml::from_str("keep_quantized = true\nfp8_tiles = true").unwrap();
        assert!(toml.spec().unwrap().fp8_tiles);
        // Tiles without keeping the weights quantized mean nothing: refused by name.
        let refused = settings_of_flags(&["--fp8-tiles"]).spec().unwrap_err();
        assert!(refused.to_string().contains("fp8_tiles"), "{refused}");
    }

    #[test]
    fn bad_settings_are_named() {
        let err = |s: EngineSettings| s.spec().unwrap_err().to_string();
        assert!(
            err(EngineSettings {
                device: Some("tpu".into()),
                ..Default::default()
            })
            .contains("cpu, cuda or cuda:N")
        );
        assert!(
            err(EngineSettings {
                gpu_memory_utilization: Some(0.5),
                ..Default::default()
            })
            .contains("CUDA devices")
        );
        assert!(
            err(EngineSettings {
                max_batch_tokens: Some(0),
                ..Default::default()
            })
            .contains("max_batch_tokens")
        );
        assert!(
            err(EngineSettings {
                device: Some("cuda".into()),
                kv_cache_mib: Some(1),
                gpu_memory_utilization: Some(0.5),
                ..Default::default()
            })
            .contains("not both")
        );
        for (device, tp) in [("cuda", None), ("cpu", Some(2))] {
            assert!(
                err(EngineSettings {
                    device: Some(device.into()),
                    tp,
                    quantize_activations: Some(true),
                    ..Default::default()
                })
                .contains("CPU reference alone")
            );
        }
        let cpu = EngineSettings {
            quantize_activations: Some(true),
            ..Default::default()
        };
        assert!(cpu.spec().unwrap().quantize_activations);
    }

    #[test]
    fn kv_tiers_are_flags_and_toml_keys_and_a_half_given_disk_tier_is_refused() {
        #[derive(clap::Parser, Debug)]
        struct Cli {
            #[command(flatten)]
            engine: EngineSettings,
        }
        use clap::Parser;
        let parse = |args: &[&str]| {
            Cli::try_parse_from(std::iter::once("strata").chain(args.iter().copied()))
                .map(|cli| cli.engine)
        };
        let flags = parse(&[
            "--kv-host-mib",
            "64",
            "--kv-disk-dir",
            "kv",
            "--kv-disk-mib",
            "8",
        ])
        .unwrap();
        let spec = flags.spec().unwrap();
        assert_eq!(spec.tiers.host_bytes, 64 << 20);
        let disk = spec.tiers.disk.unwrap();
        assert_eq!((disk.dir.to_str(), disk.bytes), (Some("kv"), 8 << 20));
        assert!(
            parse(&["--kv-disk-dir", "kv"]).is_err(),
            "a directory without a size"
        );
        assert!(
            parse(&["--kv-disk-mib", "8"]).is_err(),
            "a size without a directory"
        );
        let toml: EngineSettings =
            toml::from_str("kv_host_mib = 16\nkv_disk_dir = \"kv\"\nkv_disk_mib = 4").unwrap();
        assert_eq!(toml.spec().unwrap().tiers.host_bytes, 16 << 20);
        let half: EngineSettings = toml::from_str("kv_disk_dir = \"kv\"").unwrap();
        assert!(half.spec().unwrap_err().to_string().contains("kv_disk_mib"));
        let empty: EngineSettings =
            toml::from_str("kv_disk_dir = \"kv\"\nkv_disk_mib = 0").unwrap();
        assert!(
            empty
                .spec()
                .unwrap_err()
                .to_string()
                .contains("needs a size")
        );
        assert_eq!(
            EngineSettings::default().spec().unwrap().tiers,
            Default::default()
        );
    }

    #[test]
    fn the_fields_are_the_flags() {
        let flags: EngineSettings = toml::from_str("max_batch_tokens = 4096\ntp = 2\n").unwrap();
        assert_eq!(flags.max_batch_tokens, Some(4096));
        assert_eq!(flags.tp, Some(2));
    }
}
