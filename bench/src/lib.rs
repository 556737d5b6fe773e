//! The benchmark and check harnesses behind `strata bench`, `strata gpu` and `strata kernels`:
//! the serving load generator (any OpenAI-compatible endpoint), speculative decoding beside plain
//! decoding, the CUDA backend's parity / invariance / decode / prefill / NCCL / TP checks, and the
//! kernels' self-test and microbenchmarks. The binary only parses its command line and calls
//! these; the device batteries (scripts/device) drive them.

pub mod bench;
pub mod gpu;
pub mod kernels;

/// A GPU command's `--device`: the engine's spelling, `cuda` or `cuda:N` (a bare ordinal `N` is
/// read as `cuda:N`); `cpu` is refused by name.
pub fn cuda_ordinal(s: &str) -> Result<usize, String> {
    if let Ok(n) = s.parse::<usize>() {
        return Ok(n);
    }
    match s.parse::<strata_node::Device>()? {
        strata_node::Device::Cuda(n) => Ok(n),
        strata_node::Device::Cpu => {
            Err("this command runs on a GPU: --device cuda or cuda:N".into())
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn gpu_commands_take_the_engines_device_spelling() {
        assert_eq!(cuda_ordinal("cuda:1"), Ok(1));
        assert_eq!(cuda_ordinal("cuda"), Ok(0));
        assert_eq!(cuda_ordinal("2"), Ok(2));
        assert!(cuda_ordinal("cpu").unwrap_err().contains("GPU"));
        assert!(cuda_ordinal("gpu0").is_err());
    }
}
