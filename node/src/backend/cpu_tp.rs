//! The tensor-parallel CPU backend: `tp` rank threads, each running its [`TpShard`] of the
//! reference forward pass over its own paged KV pool, joined by an in-process communicator
//! (DESIGN.md §5). The node's scheduler drives it through [`Backend`] like any other backend: a
//! step goes to every rank, all compute, and rank 0's logits come back — byte-identical to
//! [`CpuBackend`](super::CpuBackend), by the canonical row-parallel order of the reference.

use std::sync::mpsc::{Receiver, Sender, channel};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::thread::JoinHandle;

use strata_collective::{Communicator, LocalCommunicator, LocalGroup};
use strata_model::ModelConfig;
use strata_model::cpu::{LogitRows, PartialsFault, SeqChunk, TpCollectives, TpError, TpShard};
use strata_model::weights::Checkpoint;

use super::cpu::PagedView;
use super::{Backend, BackendError, OwnedSeq, RankResult, StepSeq, join_ranks};
use crate::kv::{BlockId, KvBlockIo, KvError};

/// A rank's KV pool, laid out like [`CpuBackend`](super::CpuBackend)'s with the rank's kv heads
/// only: `[block][layer][k|v][slot][rank kv_dim]`.
type Pool = Arc<Mutex<Vec<f32>>>;

struct Rank {
    jobs: Sender<Arc<[OwnedSeq]>>,
    results: Receiver<RankResult>,
    pool: Pool,
    /// Floats of one block in this rank's pool.
    block_floats: usize,
    thread: Option<JoinHandle<()>>,
}

pub struct CpuTpBackend {
    config: ModelConfig,
    ranks: Vec<Rank>,
    block_size: usize,
    num_blocks: usize,
}

impl CpuTpBackend {
    /// Splits the model over `tp` ranks, each loading only its slices of `ckpt`, with as many
    /// blocks as `kv_budget_bytes` holds summed over the ranks (at least one).
    pub fn new(
        config: &ModelConfig,
        ckpt: &Checkpoint,
        tp: usize,
        block_size: usize,
        kv_budget_bytes: usize,
    ) -> Result<Self, TpError> {
        let blocks = Blocks::Budget(kv_budget_bytes);
        Self::build(config, ckpt, tp, block_size, blocks, PartialsFault::None)
    }

    pub fn with_blocks(
        config: &ModelConfig,
        ckpt: &Checkpoint,
        tp: usize,
        block_size: usize,
        num_blocks: usize,
    ) -> Result<Self, TpError> {
        let blocks = Blocks::Count(num_blocks);
        Self::build(config, ckpt, tp, block_size, blocks, PartialsFault::None)
    }

    /// Makes every rank reduce the row-parallel partials the wrong way, for canaries.
    #[doc(hidden)]
    pub fn with_partials_fault(
        config: &ModelConfig,
        ckpt: &Checkpoint,
        tp: usize,
        block_size: usize,
        num_blocks: usize,
        fault: PartialsFault,
    ) -> Result<Self, TpError> {
        let blocks = Blocks::Count(num_blocks);
        Self::build(config, ckpt, tp, block_size, blocks, fault)
    }

    fn build(
        config: &ModelConfig,
        ckpt: &Checkpoint,
        tp: usize,
        block_size: usize,
        blocks: Blocks,
        fault: PartialsFault,
    ) -> Result<Self, TpError> {
        TpShard::check(config, tp)?;
        let mut shards = (0..tp)
            .map(|rank| TpShard::load(config, ckpt, rank, tp))
            .collect::<Result<Vec<_>, _>>()?;
        let config = config.clone();
        let per_position: usize = shards.iter().map(|s| s.kv_dim()).sum();
        let block_floats_all = config.num_layers * 2 * block_size * per_position;
        let num_blocks = match blocks {
            Blocks::Count(n) => n,
            Blocks::Budget(bytes) => (bytes / (block_floats_all * 4)).max(1),
        };
        let comms = LocalGroup::new(tp);
        let mut ranks = Vec::with_capacity(tp);
        for (mut shard, comm) in shards.drain(..).zip(comms) {
            shard.inject_partials_fault(fault);
            let block_floats = config.num_layers * 2 * block_size * shard.kv_dim();
            let pool: Pool = Arc::new(Mutex::new(vec![0.0; block_floats * num_blocks]));
            let (jobs, job_rx) = channel();
            let (result_tx, results) = channel();
            let worker = RankWorker {
                shard,
                comm: RankComm(comm),
                pool: Arc::clone(&pool),
                block_size,
            };
            let thread = std::thread::Builder::new()
                .name(format!("cpu-tp-rank-{}", ranks.len()))
                .spawn(move || worker.run(job_rx, result_tx))
                .map_err(|e| TpError::Collective(format!("spawning a rank thread: {e}")))?;
            ranks.push(Rank {
                jobs,
                results,
                pool,
                block_floats,
                thread: Some(thread),
            });
        }
        Ok(Self {
            config,
            ranks,
            block_size,
            num_blocks,
        })
    }

    pub fn tp(&self) -> usize {
        self.ranks.len()
    }
}

enum Blocks {
    Count(usize),
    Budget(usize),
}

/// The node's communicator as the collectives the model's sharded pass issues.
struct RankComm(LocalCommunicator);

impl TpCollectives for RankComm {
    fn all_reduce_sum(&self, buf: &mut [f32]) -> Result<(), String> {
        self.0.all_reduce_sum_f32(buf).map_err(|e| e.to_string())
    }

    fn all_gather(&self, input: &[f32], output: &mut [f32]) -> Result<(), String> {
        self.0
            .all_gather_f32(input, output)
            .map_err(|e| e.to_string())
    }
}

struct RankWorker {
    shard: TpShard,
    comm: RankComm,
    pool: Pool,
    block_size: usize,
}

impl RankWorker {
    /// Serves steps until the backend drops its sender.
    fn run(self, jobs: Receiver<Arc<[OwnedSeq]>>, results: Sender<RankResult>) {
        while let Ok(seqs) = jobs.recv() {
            if results.send(self.step(&seqs)).is_err() {
                break;
            }
        }
    }

    fn step(&self, seqs: &[OwnedSeq]) -> RankResult {
        let steps: Vec<StepSeq<'_>> = seqs.iter().map(OwnedSeq::step).collect();
        let chunks: Vec<SeqChunk<'_>> = steps
            .iter()
            .map(|s| SeqChunk {
                tokens: s.tokens,
                first_position: s.first_position,
                logits: match s.logit_rows {
                    0 => LogitRows::None,
                    1 => LogitRows::Last,
                    n => LogitRows::Tail(n),
                },
            })
            .collect();
        let mut pool = lock(&self.pool);
        let mut view = PagedView {
            pool: &mut pool,
            tables: steps.iter().map(|s| s.block_table).collect(),
            block_size: self.block_size,
            layers: self.shard.config().num_layers,
            kv_dim: self.shard.kv_dim(),
        };
        self.shard
            .forward_batch(&chunks, &mut view, &self.comm)
            .map_err(|e| match e {
                TpError::Forward(e) => BackendError::Forward(e),
                other => BackendError::Device(other.to_string()),
            })
    }
}

/// A pool is only ever held by one step or one block copy at a time, and a panic while holding
/// it leaves plain floats behind, so a poisoned lock is still usable.
fn lock(pool: &Pool) -> MutexGuard<'_, Vec<f32>> {
    pool.lock().unwrap_or_else(PoisonError::into_inner)
}

/// A block's bytes are the ranks' parts of it, concatenated in rank order.
impl KvBlockIo for CpuTpBackend {
    fn block_bytes(&self) -> usize {
        self.ranks.iter().map(|r| r.block_floats * 4).sum()
    }

    fn export_block(&self, id: BlockId, out: &mut [u8]) -> Result<(), KvError> {
        let mut at = 0;
        for rank in &self.ranks {
            let n = rank.block_floats;
            let pool = lock(&rank.pool);
            super::to_le_bytes(
                &pool[id as usize * n..(id as usize + 1) * n],
                &mut out[at..at + n * 4],
            );
            at += n * 4;
        }
        Ok(())
    }

    fn import_block(&mut self, id: BlockId, data: &[u8]) -> Result<(), KvError> {
        let mut at = 0;
        for rank in &self.ranks {
            let n = rank.block_floats;
            let mut pool = lock(&rank.pool);
            super::from_le_bytes(
                &data[at..at + n * 4],
                &mut pool[id as usize * n..(id as usize + 1) * n],
            );
            at += n * 4;
        }
        Ok(())
    }
}

impl Backend for CpuTpBackend {
    fn kv_layout(&self) -> String {
        format!("cpu f32 tp{} rank-major", self.ranks.len())
    }

    fn model_config(&self) -> &ModelConfig {
        &self.config
    }

    fn block_size(&self) -> usize {
        self.block_size
    }

    fn num_blocks(&self) -> usize {
        self.num_blocks
    }

    fn step(&mut self, seqs: &[StepSeq<'_>]) -> Result<Vec<f32>, BackendError> {
        for s in seqs {
            let last = s.first_position + s.tokens.len().max(1) - 1;
            if last / self.block_size >= s.block_table.len() {
                return Err(BackendError::BlockTable {
                    blocks: s.block_table.len(),
                    position: last,
                    block_size: self.block_size,
                });
            }
        }
        let owned: Arc<[OwnedSeq]> = seqs.iter().map(OwnedSeq::from_step).collect();
        for rank in &self.ranks {
            rank.jobs
                .send(Arc::clone(&owned))
                .map_err(|_| BackendError::Device("a tensor-parallel rank thread ended".into()))?;
        }
        join_ranks(self.ranks.iter().map(|r| &r.results))
    }
}

impl Drop for CpuTpBackend {
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
