//! One rank's share of the reference forward pass under tensor parallelism (DESIGN.md §5).
//!
//! Megatron layout over `world` ranks, every rank holding the full residual stream:
//! - q/k/v and gate/up are column-parallel: a rank holds the rows of its query heads (and the kv
//!   heads they read), and its `intermediate / world` rows of gate and up;
//! - o and down are row-parallel: a rank holds the K-columns matching its heads / intermediate
//!   rows, computes the [`ROW_PARALLEL_SHARDS`]` / world` shard partials of those columns
//!   *unsummed*, and an all-gather (rank order = shard order) lets every rank add all shards in
//!   shard order — the very additions [`CpuModel`](super::CpuModel) makes, so TP=N is
//!   byte-identical to TP=1;
//! - the embedding and LM head are vocab-parallel: a token outside a rank's vocab rows embeds as
//!   `-0.0` (the exact additive identity) and the all-reduce sums one real row with identities;
//!   logits are all-gathered in rank order.
//!
//! - a mixture of experts is expert-parallel: each rank holds an equal run of every sparse
//!   layer's experts whole (the router and Qwen2-MoE's shared expert on every rank), writes the
//!   weighted outputs of its experts into each token's slots (`-0.0` in the others) and an
//!   all-reduce completes them, adding one real value to identities; every rank then sums a
//!   token's slots in ascending expert order, as one rank does.
//!
//! Norms (including the per-head q/k norm) are replicated. Each rank reads only its slices from
//! the mapped checkpoint, so all ranks together hold the model once.

use std::ops::Range;

use super::ops::{self, Matrix, ROW_PARALLEL_SHARDS};
use super::weights::CpuWeights;
use super::{
    ForwardError, Group, KvAccess, LayerHeads, LayerWeights, Ropes, SeqChunk, decoder_layer,
    linear, rms_norm, scale_embeddings,
};
use crate::config::ModelConfig;
use crate::weights::{Checkpoint, Share, Split, TensorSpec, WeightError};

/// The collectives a rank's forward pass issues; every rank issues the same ones in the same
/// order. Implemented over `strata-collective` by the node, which this crate does not depend on.
pub trait TpCollectives {
    /// Element-wise sum over ranks, added in rank order; the same bits on every rank.
    fn all_reduce_sum(&self, buf: &mut [f32]) -> Result<(), String>;
    /// Rank `r`'s `input` lands at `output[r * input.len()..]` on every rank.
    fn all_gather(&self, input: &[f32], output: &mut [f32]) -> Result<(), String>;
}

#[derive(Debug, thiserror::Error)]
pub enum TpError {
    #[error(
        "tensor parallelism of {world} needs a degree dividing {ROW_PARALLEL_SHARDS}, \
         {world} | num_heads ({heads}), {world} | intermediate ({inter}), \
         8 | q_dim ({q_dim}) and 8 | intermediate, and kv heads ({kv_heads}) divisible by \
         or dividing {world}"
    )]
    Unsupported {
        world: usize,
        heads: usize,
        kv_heads: usize,
        q_dim: usize,
        inter: usize,
    },
    #[error(
        "tensor parallelism of {world} places an equal run of experts on each rank: {world} must \
         divide the {experts} experts"
    )]
    Experts { world: usize, experts: usize },
    #[error(transparent)]
    Forward(#[from] ForwardError),
    #[error(transparent)]
    Weights(#[from] WeightError),
    #[error("collective failed: {0}")]
    Collective(String),
}

/// A deliberately wrong reduction of the row-parallel partials, for canaries that prove the
/// byte-identity tests can fail. Never set outside tests.
#[doc(hidden)]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum PartialsFault {
    #[default]
    None,
    /// Skip the all-gather: each rank adds only its own shards (and its own experts' outputs).
    LocalSumOnly,
    /// Sum the own shards, then all-reduce the per-rank sums (the plain Megatron order).
    SumThenAllReduce,
    /// Reduce the partials honestly but keep only the outputs of the experts this rank holds.
    OwnExpertsOnly,
}

/// Which rows and columns of each weight rank `rank` of `world` holds (see the module docs);
/// shared by the CPU ranks and the CUDA backend's sharded upload.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TpLayout {
    pub rank: usize,
    pub world: usize,
    /// Query heads of this rank.
    pub heads: usize,
    /// Kv heads this rank holds: its own when they shard, else the one its query heads share.
    pub kv_heads: usize,
    /// Rows of q (and of o's columns) of this rank's heads.
    pub q_rows: Range<usize>,
    /// Rows of k and v of this rank's kv heads.
    pub kv_rows: Range<usize>,
    /// Rows of gate and up (and columns of down).
    pub inter_rows: Range<usize>,
    /// Vocabulary rows of the embedding and LM head; every rank's range starts at
    /// `rank * vocab_per_rank`, the last one may be shorter (or empty).
    pub vocab: Range<usize>,
    pub vocab_per_rank: usize,
    /// The experts of every sparse layer this rank holds whole (expert parallel: an equal run
    /// of them per rank, in rank order); empty for a dense model.
    pub experts: Range<usize>,
}

impl TpLayout {
    /// The layout of rank `rank` of `world`, vocabulary ranges rounded up to multiples of
    /// `vocab_align` rows (1 for the CPU; the GPU's tensor-core kernels want 8).
    pub fn new(
        config: &ModelConfig,
        rank: usize,
        world: usize,
        vocab_align: usize,
    ) -> Result<Self, TpError> {
        TpShard::check(config, world)?;
        if rank >= world {
            return Err(TpError::Collective(format!(
                "rank {rank} is outside a group of {world}"
            )));
        }
        let c = config;
        let hd = c.head_dim;
        let heads = c.num_heads / world;
        let kv_heads = if c.num_kv_heads.is_multiple_of(world) {
            c.num_kv_heads / world
        } else {
            1
        };
        // The kv heads this rank's query heads read: its own when they shard, else the one
        // shared by all its query heads (kv heads dividing `world` puts them in one group).
        let first_kv = rank * heads / (c.num_heads / c.num_kv_heads);
        let inter = c.intermediate_size / world;
        let per = c
            .vocab_size
            .div_ceil(world)
            .next_multiple_of(vocab_align.max(1));
        Ok(TpLayout {
            rank,
            world,
            heads,
            kv_heads,
            q_rows: rank * heads * hd..(rank + 1) * heads * hd,
            kv_rows: first_kv * hd..(first_kv + kv_heads) * hd,
            inter_rows: rank * inter..(rank + 1) * inter,
            vocab: (rank * per).min(c.vocab_size)..((rank + 1) * per).min(c.vocab_size),
            vocab_per_rank: per,
            experts: c.moe.as_ref().map_or(0..0, |m| {
                let per = m.experts / world;
                rank * per..(rank + 1) * per
            }),
        })
    }

    /// What this rank holds of `share`.
    pub fn part(&self, share: Share) -> Range<usize> {
        match share {
            Share::Heads => self.q_rows.clone(),
            Share::KvHeads => self.kv_rows.clone(),
            Share::Intermediate => self.inter_rows.clone(),
            Share::Vocab => self.vocab.clone(),
        }
    }

    /// The rows and columns of `t` that `rank` holds (by the tensor's [`Split`]); all of it
    /// without a rank.
    pub fn slice(rank: Option<&Self>, t: &TensorSpec) -> (Range<usize>, Range<usize>) {
        let [rows, cols] = t.dims();
        match (rank, t.split) {
            (Some(l), Split::Rows(share)) => (l.part(share), 0..cols),
            (Some(l), Split::Cols(share)) => (0..rows, l.part(share)),
            _ => (0..rows, 0..cols),
        }
    }
}

/// A rank's view of its group for one pass.
struct RankGroup<'a> {
    shard: &'a TpShard,
    comm: &'a dyn TpCollectives,
}

impl Group<TpError> for RankGroup<'_> {
    fn row_parallel(
        &self,
        x: &[f32],
        w: &Matrix,
        bias: Option<&[f32]>,
        k: usize,
        y: &mut [f32],
    ) -> Result<(), TpError> {
        self.shard.row_parallel(x, w, bias, k, self.comm, y)
    }

    /// Each expert's outputs come from the one rank holding it; the others add `-0.0`.
    fn expert_outputs(&self, slots: &mut [f32]) -> Result<(), TpError> {
        if matches!(
            self.shard.fault,
            PartialsFault::LocalSumOnly | PartialsFault::OwnExpertsOnly
        ) {
            return Ok(());
        }
        self.comm.all_reduce_sum(slots).map_err(TpError::Collective)
    }
}

/// Rank `rank` of `world`: its weight shards and the shapes they imply.
pub struct TpShard {
    config: ModelConfig,
    rank: usize,
    world: usize,
    ropes: Ropes,
    embed: Matrix,
    /// `None` when tied to the embedding shard.
    lm_head: Option<Matrix>,
    final_norm: Vec<f32>,
    layers: Vec<LayerWeights>,
    heads: usize,
    kv_heads: usize,
    inter: usize,
    /// This rank's vocabulary rows; every rank's range is `vocab_per_rank` long except the last.
    vocab: Range<usize>,
    vocab_per_rank: usize,
    fault: PartialsFault,
}

impl TpShard {
    /// Whether `config` can be split over `world` ranks byte-identically.
    pub fn check(config: &ModelConfig, world: usize) -> Result<(), TpError> {
        let (heads, kv_heads, inter) = (
            config.num_heads,
            config.num_kv_heads,
            config.intermediate_size,
        );
        if let Some(m) = &config.moe
            && (world == 0 || !m.experts.is_multiple_of(world))
        {
            return Err(TpError::Experts {
                world,
                experts: m.experts,
            });
        }
        let ok = world > 0
            && ROW_PARALLEL_SHARDS.is_multiple_of(world)
            && heads.is_multiple_of(world)
            && inter.is_multiple_of(world)
            && ops::row_parallel_shards(config.q_dim()) == ROW_PARALLEL_SHARDS
            && ops::row_parallel_shards(inter) == ROW_PARALLEL_SHARDS
            && (kv_heads.is_multiple_of(world) || world.is_multiple_of(kv_heads));
        if ok {
            Ok(())
        } else {
            Err(TpError::Unsupported {
                world,
                heads,
                kv_heads,
                q_dim: config.q_dim(),
                inter,
            })
        }
    }

    /// Loads rank `rank` of `world`'s shard: only its slices are read from the mapped
    /// checkpoint (see [`TpLayout`]), so the ranks together hold one copy of the model.
    pub fn load(
        config: &ModelConfig,
        ckpt: &Checkpoint,
        rank: usize,
        world: usize,
    ) -> Result<Self, TpError> {
        let layout = TpLayout::new(config, rank, world, 1)?;
        let w = CpuWeights::load_part(config, ckpt, Some(&layout))?;
        Ok(Self {
            config: config.clone(),
            rank,
            world,
            ropes: Ropes::new(config),
            embed: w.embed,
            lm_head: w.lm_head,
            final_norm: w.final_norm,
            layers: w.layers,
            heads: layout.heads,
            kv_heads: layout.kv_heads,
            inter: layout.inter_rows.len(),
            vocab: layout.vocab,
            vocab_per_rank: layout.vocab_per_rank,
            fault: PartialsFault::None,
        })
    }

    pub fn config(&self) -> &ModelConfig {
        &self.config
    }

    pub fn rank(&self) -> usize {
        self.rank
    }

    /// K/V floats per position in this rank's cache: its kv heads only.
    pub fn kv_dim(&self) -> usize {
        self.kv_heads * self.config.head_dim
    }

    #[doc(hidden)]
    pub fn inject_partials_fault(&mut self, fault: PartialsFault) {
        self.fault = fault;
    }

    /// [`CpuModel::forward_batch`](super::CpuModel::forward_batch) over this rank's shard: every rank of the group calls it with
    /// the same chunks (and its own cache of its kv heads); every rank returns the same logits.
    pub fn forward_batch(
        &self,
        chunks: &[SeqChunk<'_>],
        kv: &mut dyn KvAccess,
        comm: &dyn TpCollectives,
    ) -> Result<Vec<f32>, TpError> {
        let c = &self.config;
        let (tokens, queries) = super::validate_chunks(c, chunks)?;
        let h = c.hidden_size;
        let mut x = vec![-0.0; tokens.len() * h];
        for (&t, row) in tokens.iter().zip(x.chunks_exact_mut(h)) {
            let t = t as usize;
            if self.vocab.contains(&t) {
                self.embed.row_into(t - self.vocab.start, h, row);
            }
        }
        comm.all_reduce_sum(&mut x).map_err(TpError::Collective)?;
        scale_embeddings(c, &mut x);
        let tables = self.ropes.tables(c.head_dim, &queries);
        let heads = LayerHeads {
            heads: self.heads,
            kv_heads: self.kv_heads,
            inter: self.inter,
        };
        let group = RankGroup { shard: self, comm };
        for (i, layer) in self.layers.iter().enumerate() {
            let rope = tables.for_layer(c, i);
            decoder_layer(
                c,
                heads,
                i,
                layer,
                &mut x,
                &queries,
                kv,
                rope,
                &group,
                &mut |_, _| {},
            )?;
        }

        let keep = super::logit_rows(chunks, &x, h);
        let mut normed = vec![0.0; keep.len()];
        rms_norm(&keep, &self.final_norm, c.rms_norm_eps as f32, &mut normed);
        let rows = keep.len() / h;
        let per = self.vocab_per_rank;
        let mut local = vec![0.0; rows * per];
        let head = self.lm_head.as_ref().unwrap_or(&self.embed);
        let own = self.vocab.len();
        let mut own_logits = vec![0.0; rows * own];
        linear(&normed, head, None, h, &mut own_logits);
        for (dst, src) in local
            .chunks_exact_mut(per)
            .zip(own_logits.chunks_exact(own.max(1)))
        {
            dst[..own].copy_from_slice(src);
        }
        let mut gathered = vec![0.0; self.world * rows * per];
        comm.all_gather(&local, &mut gathered)
            .map_err(TpError::Collective)?;
        let vocab = c.vocab_size;
        let mut logits = vec![0.0; rows * vocab];
        for (r, part) in gathered.chunks_exact(rows * per).enumerate() {
            let start = r * per;
            let len = per.min(vocab.saturating_sub(start));
            for (dst, src) in logits.chunks_exact_mut(vocab).zip(part.chunks_exact(per)) {
                dst[start..start + len].copy_from_slice(&src[..len]);
            }
        }
        Ok(logits)
    }

    /// This rank's shard partials of a row-parallel projection, gathered from every rank and
    /// added in shard order (then the bias): the canonical reduction of `ops`.
    fn row_parallel(
        &self,
        x: &[f32],
        w: &Matrix,
        bias: Option<&[f32]>,
        k: usize,
        comm: &dyn TpCollectives,
        y: &mut [f32],
    ) -> Result<(), TpError> {
        let local = ROW_PARALLEL_SHARDS / self.world;
        let mut partials = vec![0.0; local * y.len()];
        ops::linear_partials(x, w, k, local, &mut partials);
        match self.fault {
            PartialsFault::None | PartialsFault::OwnExpertsOnly => {
                let mut all = vec![0.0; ROW_PARALLEL_SHARDS * y.len()];
                comm.all_gather(&partials, &mut all)
                    .map_err(TpError::Collective)?;
                ops::sum_partials(&all, ROW_PARALLEL_SHARDS, bias, y);
            }
            PartialsFault::LocalSumOnly => ops::sum_partials(&partials, local, bias, y),
            PartialsFault::SumThenAllReduce => {
                ops::sum_partials(&partials, local, None, y);
                comm.all_reduce_sum(y).map_err(TpError::Collective)?;
                if let Some(b) = bias {
                    for row in y.chunks_exact_mut(b.len()) {
                        ops::add_in_place(row, b);
                    }
                }
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod layout_tests {
    use super::*;

    fn config() -> ModelConfig {
        ModelConfig::from_json(
            r#"{"model_type": "llama", "vocab_size": 1001, "hidden_size": 512,
                "intermediate_size": 1024, "num_hidden_layers": 2, "num_attention_heads": 8,
                "num_key_value_heads": 2, "head_dim": 64, "max_position_embeddings": 256,
                "rms_norm_eps": 1e-6, "rope_theta": 10000.0}"#,
        )
        .expect("valid config")
    }

    #[test]
    fn ranks_cover_every_row_once_and_share_kv_heads_when_they_must() {
        let c = config();
        for world in [1, 2, 4, 8] {
            let ranks: Vec<TpLayout> = (0..world)
                .map(|r| TpLayout::new(&c, r, world, 8).expect("supported degree"))
                .collect();
            // Vocabulary: contiguous, in rank order, covering 0..vocab, padded to 8 rows.
            let mut next = 0;
            for l in &ranks {
                assert_eq!(l.vocab.start, next.min(c.vocab_size));
                assert!(l.vocab.len() <= l.vocab_per_rank);
                assert_eq!(l.vocab_per_rank % 8, 0);
                next = l.vocab.end;
            }
            assert_eq!(next, c.vocab_size);
            // Query rows and intermediate rows: disjoint slices in rank order.
            for (r, l) in ranks.iter().enumerate() {
                assert_eq!(l.q_rows, r * 512 / world..(r + 1) * 512 / world);
                assert_eq!(l.inter_rows, r * 1024 / world..(r + 1) * 1024 / world);
            }
        }
        // 2 kv heads over 4 ranks: each rank holds the one its two query heads read.
        let kv: Vec<_> = (0..4)
            .map(|r| TpLayout::new(&c, r, 4, 8).expect("supported").kv_rows)
            .collect();
        assert_eq!(kv, vec![0..64, 0..64, 64..128, 64..128]);
        assert_eq!(
            TpLayout::new(&c, 1, 2, 8).expect("supported").kv_rows,
            64..128
        );
    }

    /// A matrix's values as f32 bits, whatever its storage.
    fn bits(m: &Matrix) -> Vec<u32> {
        match m {
            Matrix::F32(v) => v.iter().map(|x| x.to_bits()).collect(),
            Matrix::Bf16(v) | Matrix::Scaled { weights: v, .. } => {
                v.iter().map(|&x| u32::from(x)).collect()
            }
        }
    }

    /// Rows `rows`, columns `cols` of the `[_, width]` matrix `m`, as bits.
    fn block(m: &Matrix, width: usize, rows: Range<usize>, cols: Range<usize>) -> Vec<u32> {
        let all = bits(m);
        rows.flat_map(|r| all[r * width + cols.start..r * width + cols.end].to_vec())
            .collect()
    }

    #[test]
    fn each_rank_loads_exactly_its_slices_of_the_checkpoint() {
        use crate::synth::{SynthSpec, synthesize};
        let spec = SynthSpec {
            layers: 1,
            hidden: 128,
            heads: 4,
            kv_heads: 2,
            intermediate: 256,
            max_position: 64,
            ..SynthSpec::demo(crate::config::Architecture::Qwen2, 3)
        };
        let dir = tempfile::tempdir().expect("temp dir");
        synthesize(&spec, dir.path(), None).expect("synthesized");
        let config = ModelConfig::from_dir(dir.path()).expect("config");
        let ckpt = Checkpoint::open(dir.path()).expect("checkpoint");
        let whole = CpuWeights::load(&config, &ckpt).expect("whole model");
        let (h, q, inter, vocab) = (128, config.q_dim(), 256, config.vocab_size);
        let (full, all_rows) = (&whole.layers[0], |n: usize| 0..n);
        let mut q_total = 0;
        for rank in 0..4 {
            let shard = TpShard::load(&config, &ckpt, rank, 4).expect("rank shard");
            let l = TpLayout::new(&config, rank, 4, 1).expect("layout");
            let w = &shard.layers[0];
            assert_eq!(bits(&w.q), block(&full.q, h, l.q_rows.clone(), 0..h));
            assert_eq!(bits(&w.k), block(&full.k, h, l.kv_rows.clone(), 0..h));
            assert_eq!(bits(&w.o), block(&full.o, q, all_rows(h), l.q_rows.clone()));
            let (fm, m) = (full.mlp.dense().unwrap(), w.mlp.dense().unwrap());
            let gate = block(&fm.gate, h, l.inter_rows.clone(), 0..h);
            assert_eq!(bits(&m.gate), gate);
            let down = block(&fm.down, inter, all_rows(h), l.inter_rows.clone());
            assert_eq!(bits(&m.down), down);
            let [qb, kb, _] = w.qkv_bias.as_ref().expect("qwen2 has qkv biases");
            let [fq, fk, _] = full.qkv_bias.as_ref().expect("qwen2 has qkv biases");
            assert_eq!(qb, &fq[l.q_rows.clone()]);
            assert_eq!(kb, &fk[l.kv_rows.clone()]);
            assert_eq!(
                bits(&shard.embed),
                block(&whole.embed, h, l.vocab.clone(), 0..h)
            );
            q_total += w.q.len();
        }
        // Together the ranks hold each query row once; none holds the whole vocabulary.
        assert_eq!(q_total, whole.layers[0].q.len());
        assert!(vocab > TpLayout::new(&config, 0, 4, 1).expect("layout").vocab.len());
    }

    #[test]
    fn unsupported_degrees_and_ranks_are_refused() {
        let c = config();
        assert!(matches!(
            TpLayout::new(&c, 0, 3, 8),
            Err(TpError::Unsupported { world: 3, .. })
        ));
        assert!(TpLayout::new(&c, 2, 2, 8).is_err());
    }
}
