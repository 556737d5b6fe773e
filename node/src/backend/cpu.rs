//! The CPU backend: the reference forward pass over a paged KV pool.

use strata_model::ModelConfig;
use strata_model::cpu::{CpuModel, KvAccess, LogitRows, PassRows, SeqChunk};

use super::{Backend, BackendError, HiddenRows, RowSampling, StepOutput, StepSeq};
use crate::kv::{BlockId, KvBlockIo, KvError};

/// Device memory of the CPU backend: `num_blocks` blocks, each holding every layer's K and V for
/// `block_size` positions, laid out `[block][layer][k|v][slot][kv_dim]` so one block is one
/// contiguous range (a tier copy is one memcpy).
pub struct CpuBackend {
    model: CpuModel,
    pool: Vec<f32>,
    block_size: usize,
    num_blocks: usize,
}

impl CpuBackend {
    /// A pool of as many blocks as `kv_budget_bytes` holds (at least one).
    pub fn new(model: CpuModel, block_size: usize, kv_budget_bytes: usize) -> Self {
        let per_block = Self::floats_per_block(model.config(), block_size) * 4;
        let num_blocks = (kv_budget_bytes / per_block).max(1);
        Self::with_blocks(model, block_size, num_blocks)
    }

    pub fn with_blocks(model: CpuModel, block_size: usize, num_blocks: usize) -> Self {
        let floats = Self::floats_per_block(model.config(), block_size) * num_blocks;
        Self {
            model,
            pool: vec![0.0; floats],
            block_size,
            num_blocks,
        }
    }

    fn floats_per_block(config: &ModelConfig, block_size: usize) -> usize {
        config.num_layers * 2 * block_size * config.kv_dim()
    }

    pub fn model(&self) -> &CpuModel {
        &self.model
    }
}

/// A pool laid out `[block][layer][k|v][slot][kv_dim]`, seen through the block tables of one
/// step's sequences (the TP backend's ranks use it over their own pools).
pub(super) struct PagedView<'a> {
    pub(super) pool: &'a mut [f32],
    pub(super) tables: Vec<&'a [BlockId]>,
    pub(super) block_size: usize,
    pub(super) layers: usize,
    pub(super) kv_dim: usize,
}

impl PagedView<'_> {
    fn offset(&self, seq: usize, layer: usize, kind: usize, position: usize) -> usize {
        let block = self.tables[seq][position / self.block_size] as usize;
        let slot = position % self.block_size;
        (((block * self.layers + layer) * 2 + kind) * self.block_size + slot) * self.kv_dim
    }
}

impl KvAccess for PagedView<'_> {
    fn key(&self, seq: usize, layer: usize, position: usize) -> &[f32] {
        let o = self.offset(seq, layer, 0, position);
        &self.pool[o..o + self.kv_dim]
    }

    fn value(&self, seq: usize, layer: usize, position: usize) -> &[f32] {
        let o = self.offset(seq, layer, 1, position);
        &self.pool[o..o + self.kv_dim]
    }

    /// The rest of `position`'s block: slots are contiguous within a block's layer.
    fn key_run(&self, seq: usize, layer: usize, position: usize) -> &[f32] {
        let o = self.offset(seq, layer, 0, position);
        let slots = self.block_size - position % self.block_size;
        &self.pool[o..o + slots * self.kv_dim]
    }

    fn value_run(&self, seq: usize, layer: usize, position: usize) -> &[f32] {
        let o = self.offset(seq, layer, 1, position);
        let slots = self.block_size - position % self.block_size;
        &self.pool[o..o + slots * self.kv_dim]
    }

    fn write(&mut self, seq: usize, layer: usize, position: usize, key: &[f32], value: &[f32]) {
        let k = self.offset(seq, layer, 0, position);
        self.pool[k..k + self.kv_dim].copy_from_slice(key);
        let v = self.offset(seq, layer, 1, position);
        self.pool[v..v + self.kv_dim].copy_from_slice(value);
    }
}

impl KvBlockIo for CpuBackend {
    fn block_bytes(&self) -> usize {
        Self::floats_per_block(self.model.config(), self.block_size) * 4
    }

    fn export_block(&self, id: BlockId, out: &mut [u8]) -> Result<(), KvError> {
        let n = Self::floats_per_block(self.model.config(), self.block_size);
        super::to_le_bytes(&self.pool[id as usize * n..(id as usize + 1) * n], out);
        Ok(())
    }

    fn import_block(&mut self, id: BlockId, data: &[u8]) -> Result<(), KvError> {
        let n = Self::floats_per_block(self.model.config(), self.block_size);
        super::from_le_bytes(data, &mut self.pool[id as usize * n..(id as usize + 1) * n]);
        Ok(())
    }
}

impl Backend for CpuBackend {
    fn kv_layout(&self) -> String {
        "cpu f32 [layer][k|v][slot][kv_dim]".into()
    }

    fn model_config(&self) -> &ModelConfig {
        self.model.config()
    }

    fn block_size(&self) -> usize {
        self.block_size
    }

    fn num_blocks(&self) -> usize {
        self.num_blocks
    }

    fn step(&mut self, seqs: &[StepSeq<'_>]) -> Result<Vec<f32>, BackendError> {
        Ok(self.forward(seqs, &[])?.logits)
    }

    fn embeds(&self) -> bool {
        true
    }

    fn step_sampling(
        &mut self,
        seqs: &[StepSeq<'_>],
        sampling: &[RowSampling<'_>],
    ) -> Result<StepOutput, BackendError> {
        let hidden: Vec<LogitRows> = (0..seqs.len())
            .map(|i| match RowSampling::of(sampling, i) {
                RowSampling::Hidden(HiddenRows::Last) => LogitRows::Last,
                RowSampling::Hidden(HiddenRows::All) => LogitRows::All,
                _ => LogitRows::None,
            })
            .collect();
        let rows = self.forward(seqs, &hidden)?;
        let mut out =
            StepOutput::split(rows.logits, seqs, sampling, self.model.config().vocab_size);
        out.hidden = rows.hidden;
        Ok(out)
    }
}

impl CpuBackend {
    /// One pass over `seqs`: the logits of those wanting them, and the hidden rows `hidden`
    /// asks per sequence.
    fn forward(
        &mut self,
        seqs: &[StepSeq<'_>],
        hidden: &[LogitRows],
    ) -> Result<PassRows, BackendError> {
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
        let chunks: Vec<SeqChunk<'_>> = seqs
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
        let config = self.model.config();
        let mut view = PagedView {
            pool: &mut self.pool,
            tables: seqs.iter().map(|s| s.block_table).collect(),
            block_size: self.block_size,
            layers: config.num_layers,
            kv_dim: config.kv_dim(),
        };
        Ok(self.model.forward_batch_rows(&chunks, hidden, &mut view)?)
    }
}
