//! The tensor-parallel CUDA backend: one [`CudaBackend`] rank per GPU (DESIGN.md §5), each
//! holding its slices of the weights and its kv heads' paged cache, driven by the node's one
//! scheduler through [`Backend`]: a step goes to every rank's thread, all compute, rank 0's
//! logits come back. In the shard order every rank's logits equal TP = 1's bit for bit.
//!
//! The ranks' collectives go through NCCL when every rank has its own GPU, or through the
//! host-staged communicator ([`TpTransport::Staged`]) when ranks share a GPU — how the sharded
//! path is checked on a one-GPU machine (NCCL refuses a device twice), at the cost of a stream
//! synchronization per collective and no CUDA graphs.

use std::sync::mpsc::{Receiver, Sender, channel};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::thread::JoinHandle;

use strata_collective::{DeviceCommunicator, NcclGroup, StagedGroup};
use strata_model::ModelConfig;
use strata_model::cpu::PartialsFault;

use super::{CudaBackend, CudaError, CudaOptions, WeightSource};
use crate::backend::{Backend, BackendError, OwnedSeq, RankResult, StepSeq, join_ranks};
use crate::kv::{BlockId, HostMemory, KvBlockIo, KvError};

/// How the ranks of a [`CudaTpBackend`] communicate.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TpTransport {
    /// NCCL over the ranks' streams (distinct GPUs; captured into the decode graphs).
    Nccl,
    /// Through host memory (any GPUs, a GPU twice included; eager steps only).
    Staged,
}

impl TpTransport {
    /// NCCL when every device is distinct, else staged.
    pub fn for_devices(devices: &[usize]) -> Self {
        let mut sorted = devices.to_vec();
        sorted.sort_unstable();
        sorted.dedup();
        if sorted.len() == devices.len() {
            TpTransport::Nccl
        } else {
            TpTransport::Staged
        }
    }
}

type Shared = Arc<Mutex<CudaBackend>>;

struct Rank {
    jobs: Sender<Arc<[OwnedSeq]>>,
    results: Receiver<RankResult>,
    backend: Shared,
    thread: Option<JoinHandle<()>>,
}

pub struct CudaTpBackend {
    config: ModelConfig,
    ranks: Vec<Rank>,
    block_size: usize,
    num_blocks: usize,
    transport: TpTransport,
}

/// A rank is held by one step or one block copy at a time; a panic inside leaves device
/// buffers behind that the next step overwrites, so a poisoned lock is still usable.
fn lock(backend: &Shared) -> MutexGuard<'_, CudaBackend> {
    backend.lock().unwrap_or_else(PoisonError::into_inner)
}

impl CudaTpBackend {
    /// Rank `r` on `devices[r]`, each loading its slices from `source` with `options` (whose
    /// `device`, `tp_rank` and `tp_world` are set per rank); the KV budget is per rank.
    pub fn new(
        config: &ModelConfig,
        source: WeightSource<'_>,
        options: &CudaOptions,
        devices: &[usize],
        transport: TpTransport,
    ) -> Result<Self, CudaError> {
        let world = devices.len();
        if world == 0 {
            return Err(CudaError::Unsupported(
                "tensor parallelism needs at least one device".into(),
            ));
        }
        if transport == TpTransport::Nccl && TpTransport::for_devices(devices) != transport {
            return Err(CudaError::Unsupported(format!(
                "NCCL needs a distinct GPU per rank; devices {devices:?} repeat one \
                 (the staged transport runs ranks on a shared GPU)"
            )));
        }
        let mut backends = Vec::with_capacity(world);
        for (rank, &device) in devices.iter().enumerate() {
            let rank_options = CudaOptions {
                device,
                tp_rank: rank,
                tp_world: world,
                ..options.clone()
            };
            backends.push(CudaBackend::new(config, source, &rank_options)?);
        }
        let streams = backends.iter().map(|b| b.stream().clone()).collect();
        let comms: Vec<Box<dyn DeviceCommunicator>> = match transport {
            TpTransport::Nccl => NcclGroup::on_streams(streams)?
                .into_iter()
                .map(|c| Box::new(c) as Box<dyn DeviceCommunicator>)
                .collect(),
            TpTransport::Staged => StagedGroup::on_streams(streams)
                .into_iter()
                .map(|c| Box::new(c) as Box<dyn DeviceCommunicator>)
                .collect(),
        };
        let num_blocks = backends.iter().map(|b| b.num_blocks()).min().unwrap_or(0);
        let block_size = options.block_size;
        let mut ranks = Vec::with_capacity(world);
        for (mut backend, comm) in backends.into_iter().zip(comms) {
            backend.attach_communicator(comm)?;
            let backend: Shared = Arc::new(Mutex::new(backend));
            let (jobs, job_rx) = channel::<Arc<[OwnedSeq]>>();
            let (result_tx, results) = channel();
            let worker = Arc::clone(&backend);
            let thread = std::thread::Builder::new()
                .name(format!("cuda-tp-rank-{}", ranks.len()))
                .spawn(move || {
                    while let Ok(seqs) = job_rx.recv() {
                        let steps: Vec<StepSeq<'_>> = seqs.iter().map(OwnedSeq::step).collect();
                        let result = lock(&worker).step(&steps);
                        if result_tx.send(result).is_err() {
                            break;
                        }
                    }
                })
                .map_err(|e| CudaError::Driver(format!("spawning a rank thread: {e}")))?;
            ranks.push(Rank {
                jobs,
                results,
                backend,
                thread: Some(thread),
            });
        }
        Ok(CudaTpBackend {
            config: config.clone(),
            ranks,
            block_size,
            num_blocks,
            transport,
        })
    }

    pub fn tp(&self) -> usize {
        self.ranks.len()
    }

    pub fn transport(&self) -> TpTransport {
        self.transport
    }

    /// Turns decode graphs on or off on every rank (the staged transport keeps them off).
    pub fn set_graphs(&mut self, enabled: bool) {
        for rank in &self.ranks {
            lock(&rank.backend).set_graphs(enabled && self.transport == TpTransport::Nccl);
        }
    }

    /// Makes every rank reduce the row-parallel partials the wrong way, for canaries.
    #[doc(hidden)]
    pub fn inject_partials_fault(&mut self, fault: PartialsFault) {
        for rank in &self.ranks {
            lock(&rank.backend).inject_partials_fault(fault);
        }
    }

    /// The device name of rank 0's GPU.
    pub fn device_name(&self) -> String {
        self.ranks
            .first()
            .map(|r| lock(&r.backend).device_name())
            .unwrap_or_default()
    }
}

/// A block's bytes are the ranks' parts of it, concatenated in rank order.
impl KvBlockIo for CudaTpBackend {
    fn block_bytes(&self) -> usize {
        self.ranks
            .iter()
            .map(|r| lock(&r.backend).block_bytes())
            .sum()
    }

    fn export_block(&self, id: BlockId, out: &mut [u8]) -> Result<(), KvError> {
        let mut at = 0;
        for rank in &self.ranks {
            let backend = lock(&rank.backend);
            let n = backend.block_bytes();
            backend.export_block(id, &mut out[at..at + n])?;
            at += n;
        }
        Ok(())
    }

    fn export_block_queued(&self, id: BlockId, out: &mut [u8]) -> Result<(), KvError> {
        let mut at = 0;
        for rank in &self.ranks {
            let backend = lock(&rank.backend);
            let n = backend.block_bytes();
            backend.export_block_queued(id, &mut out[at..at + n])?;
            at += n;
        }
        Ok(())
    }

    fn settle(&self) -> Result<(), KvError> {
        self.ranks
            .iter()
            .try_for_each(|rank| lock(&rank.backend).settle())
    }

    /// Page-locked on rank 0's context, portable: every rank copies its part of a block from it.
    fn host_memory(&mut self, bytes: usize) -> Result<Box<dyn HostMemory>, KvError> {
        let context = lock(&self.ranks[0].backend).stream().context().clone();
        super::pinned_host_memory(&context, bytes)
    }

    fn import_block(&mut self, id: BlockId, data: &[u8]) -> Result<(), KvError> {
        let mut at = 0;
        for rank in &self.ranks {
            let mut backend = lock(&rank.backend);
            let n = backend.block_bytes();
            backend.import_block(id, &data[at..at + n])?;
            at += n;
        }
        Ok(())
    }
}

impl Backend for CudaTpBackend {
    fn kv_layout(&self) -> String {
        format!("cuda bf16 tp{} rank-major", self.ranks.len())
    }

    fn model_config(&self) -> &ModelConfig {
        &self.config
    }

    fn decode_rows_per_weight_read(&self) -> Option<usize> {
        Some(strata_kernels::GEMV_MAX_M)
    }

    fn block_size(&self) -> usize {
        self.block_size
    }

    fn num_blocks(&self) -> usize {
        self.num_blocks
    }

    fn step(&mut self, seqs: &[StepSeq<'_>]) -> Result<Vec<f32>, BackendError> {
        let owned: Arc<[OwnedSeq]> = seqs.iter().map(OwnedSeq::from_step).collect();
        for rank in &self.ranks {
            rank.jobs
                .send(Arc::clone(&owned))
                .map_err(|_| BackendError::Device("a tensor-parallel rank thread ended".into()))?;
        }
        join_ranks(self.ranks.iter().map(|r| &r.results))
    }
}

impl Drop for CudaTpBackend {
    fn drop(&mut self) {
        let threads: Vec<_> = self
            .ranks
            .drain(..)
            .filter_map(|mut r| r.thread.take())
            .collect();
        // The job senders went with the ranks: every worker's `recv` now fails and it returns.
        for thread in threads {
            let _ = thread.join();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nccl_only_when_every_rank_has_its_own_gpu() {
        assert_eq!(TpTransport::for_devices(&[0, 1]), TpTransport::Nccl);
        assert_eq!(TpTransport::for_devices(&[3, 1, 2, 0]), TpTransport::Nccl);
        assert_eq!(TpTransport::for_devices(&[0, 0]), TpTransport::Staged);
        assert_eq!(TpTransport::for_devices(&[0, 1, 0, 1]), TpTransport::Staged);
    }
}
