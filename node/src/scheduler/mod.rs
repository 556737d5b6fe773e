//! Continuous batching: which sequences compute what in the next step.
//!
//! Each step takes the running sequences in arrival order (a decode token, or the next prefill
//! chunk), then admits waiting sequences first-come-first-served while the step's token budget
//! and the running-sequence limit allow. Prompts are split into chunks under the budget; a
//! prompt's full blocks already in the prefix cache (any tier) are acquired instead of computed.
//! When blocks run out, the most recently admitted sequence is preempted: its blocks are released
//! (full ones stay cached, so the recompute is mostly prefix hits) and it waits again at its
//! arrival rank, its sampler state intact — so its output is the same as if it never stopped.

mod draws;
mod sequence;
mod speculation;

use std::collections::VecDeque;
use std::time::Instant;

use strata_model::sampler::RowPlan;
use strata_model::stop::is_stop_token;
use strata_protocol::{FinishReason, TokenEvent};

use crate::backend::{Backend, BackendError, HiddenRows, RowSampling, StepOutput, StepSeq};
#[cfg(test)]
use crate::kv::BlockHash;
use crate::kv::{BlockManager, KvError, block_hash, prompt_block_hashes};
use crate::speculative::{SpecCounters, Speculator};
pub use strata_engine_api::load::{EngineLoad, StepTimes};

use draws::Outputs;
pub use sequence::Sequence;

/// Limits of one step.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SchedulerLimits {
    /// Tokens computed per step, prefill chunks and decodes together.
    pub max_batch_tokens: usize,
    pub max_running: usize,
}

impl Default for SchedulerLimits {
    fn default() -> Self {
        Self {
            max_batch_tokens: 512,
            max_running: 64,
        }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum StepError {
    #[error(transparent)]
    Backend(#[from] BackendError),
    #[error(transparent)]
    Kv(#[from] KvError),
    #[error(
        "the backend returned {got} logits, {tokens} greedy tokens and {summaries} row summaries \
         for {rows} rows of {vocab}, {greedy} greedy rows and {summary_rows} summarized rows"
    )]
    Logits {
        got: usize,
        rows: usize,
        vocab: usize,
        tokens: usize,
        greedy: usize,
        summaries: usize,
        summary_rows: usize,
    },
    #[error("the backend returned {got} hidden values for {rows} rows of {hidden}")]
    Hidden {
        got: usize,
        rows: usize,
        hidden: usize,
    },
}

/// Faults a gate's canary arm injects to prove the gate can fail.
#[cfg(test)]
#[derive(Debug, Clone, Copy, Default)]
pub struct Faults {
    /// Hash a block without its last token: prompts that differ only there share a stale block.
    pub hash_skips_last_token: bool,
    /// Resume a preempted sequence from its prompt alone, forgetting the tokens it generated.
    pub forget_generated_on_preempt: bool,
    /// Take a waiting sequence without checking that its first chunk's blocks can be had.
    pub admit_without_room: bool,
    /// After a rejected proposal, read its row next as if its K/V held the token drawn instead
    /// (a rollback that leaves one stale slot).
    pub stale_slot_on_reject: bool,
    /// Send verification rows as prompt rows (the prompt path's arithmetic, on CUDA the GEMM).
    pub verify_as_prompt: bool,
}

pub struct Scheduler {
    limits: SchedulerLimits,
    pub(crate) blocks: BlockManager,
    eos: Vec<u32>,
    context_window: usize,
    waiting: VecDeque<Sequence>,
    running: Vec<Sequence>,
    steps: u64,
    preemptions: u64,
    times: StepTimes,
    /// Speculative decoding, when configured.
    speculator: Option<Speculator>,
    #[cfg(test)]
    pub(crate) faults: Faults,
}

/// One sequence's share of the step being built.
struct Planned {
    index: usize,
    chunk: usize,
}

impl Scheduler {
    pub fn new(
        limits: SchedulerLimits,
        blocks: BlockManager,
        eos: Vec<u32>,
        context_window: usize,
    ) -> Self {
        Self {
            limits,
            blocks,
            eos,
            context_window,
            waiting: VecDeque::new(),
            running: Vec::new(),
            steps: 0,
            preemptions: 0,
            times: StepTimes::default(),
            speculator: None,
            #[cfg(test)]
            faults: Faults::default(),
        }
    }

    /// Decodes with speculation: each step verifies `speculator`'s proposals.
    pub fn with_speculation(mut self, speculator: Option<Speculator>) -> Self {
        self.speculator = speculator;
        self
    }

    /// Speculation's counters (zero without speculation).
    pub fn spec_counters(&self) -> SpecCounters {
        self.speculator
            .as_ref()
            .map(Speculator::counters)
            .unwrap_or_default()
    }

    pub fn add(&mut self, seq: Sequence) {
        let at = self.waiting.partition_point(|s| s.arrival < seq.arrival);
        self.waiting.insert(at, seq);
    }

    /// Ends the sequence `id` wherever it is, freeing its blocks at once.
    pub fn cancel(&mut self, id: u64, reason: FinishReason) -> Result<(), KvError> {
        if let Some(i) = self.running.iter().position(|s| s.id == id) {
            let seq = self.running.remove(i);
            self.finish(seq, reason)?;
        } else if let Some(i) = self.waiting.iter().position(|s| s.id == id) {
            let seq = self.waiting.remove(i).expect("index from position");
            self.finish(seq, reason)?;
        }
        Ok(())
    }

    pub fn is_idle(&self) -> bool {
        self.running.is_empty() && self.waiting.is_empty()
    }

    /// What this node is carrying now, as its load reports say it to routers.
    pub fn load(&self) -> EngineLoad {
        let unprefilled = |s: &Sequence| s.tokens.len().saturating_sub(s.computed) as u64;
        let traffic = self.blocks.tier_traffic();
        EngineLoad {
            waiting: self.waiting.len() as u64,
            running: self.running.len() as u64,
            queued_prefill_tokens: self
                .waiting
                .iter()
                .chain(&self.running)
                .map(unprefilled)
                .sum(),
            active_blocks: self.blocks.referenced_blocks() as u64,
            capacity_blocks: self.blocks.device_blocks() as u64,
            tokens_per_s: 0,
            fetch_bytes_per_s: 0,
            preemptions: self.preemptions,
            host_capacity_blocks: self.blocks.lower_capacity().0 as u64,
            disk_capacity_blocks: self.blocks.lower_capacity().1 as u64,
            block_bytes: self.blocks.block_bytes() as u64,
            restored_blocks: traffic.restored,
            restore_ns: traffic.restore_ns,
            declined_restores: self.blocks.declined_restores(),
            demoted_blocks: traffic.demoted,
            tier_copy_failures: self.blocks.lower_tier_failures(),
            cached_blocks: self.blocks.cached_by_tier().map(|n| n as u64),
            pinned_blocks: self.blocks.held_by_pins() as u64,
            spec: self.spec_counters(),
        }
    }

    pub fn block_manager_mut(&mut self) -> &mut BlockManager {
        &mut self.blocks
    }

    pub fn block_manager(&self) -> &BlockManager {
        &self.blocks
    }

    pub fn steps(&self) -> u64 {
        self.steps
    }

    pub fn preemptions(&self) -> u64 {
        self.preemptions
    }

    /// The time of every step so far, by phase.
    pub fn times(&self) -> StepTimes {
        self.times
    }

    /// Plans and runs one step. Returns the number of tokens computed (0 when there was nothing
    /// to do or nothing could be scheduled).
    pub fn step(&mut self, backend: &mut dyn Backend) -> Result<usize, StepError> {
        let started = Instant::now();
        self.expire()?;
        let mut plan = self.plan(backend)?;
        if plan.is_empty() {
            return Ok(0);
        }
        self.speculate(&mut plan, backend)?;
        let vocab = backend.model_config().vocab_size;
        let plans = self.row_plans(&plan, vocab);
        let steps = self.step_seqs(&plan);
        let sampling = self.row_sampling(&plan, &plans);
        let hidden = backend.model_config().hidden_size;
        // Steps of decode rows alone are what the speculation policy prices.
        let decode_only = steps.iter().all(|s| s.first_position >= s.prompt_len);
        let planned = Instant::now();
        let mut output = backend.step_sampling(&steps, &sampling)?;
        let forwarded = Instant::now();
        check_output(&output, &plan, &steps, &sampling, (vocab, hidden))?;
        let computed: usize = plan.iter().map(|p| p.chunk).sum();
        self.steps += 1;
        // One row (or token) per sequence wanting logits, checked just above.
        let kinds: Vec<Kind> = sampling.iter().map(Kind::of).collect();
        drop(sampling);
        self.apply(&plan, &kinds, plans, &mut output, (vocab, hidden))?;
        // What a row costs the step is what it costs from the forward to its draw: logits read
        // back and drawn on the host count as much as the kernels.
        if let Some(spec) = self.speculator.as_mut()
            && decode_only
        {
            spec.cost.observe(computed, planned.elapsed().as_secs_f64());
        }
        let nanos = |d: std::time::Duration| u64::try_from(d.as_nanos()).unwrap_or(u64::MAX);
        let t = &mut self.times;
        t.steps += 1;
        t.tokens += computed as u64;
        t.plan_ns += nanos(planned - started);
        t.forward_ns += nanos(forwarded - planned);
        t.sample_ns += nanos(forwarded.elapsed());
        Ok(computed)
    }

    /// How each planned row wanting logits is sampled: rows that need nothing but the argmax
    /// of the raw logits, and rows a sampling plan describes (grammar masks included), are
    /// reduced by the backend (on the GPU, where the logits are). A non-greedy plan takes its
    /// random word from the sequence's stream here; `None` leaves the row to the host.
    fn row_plans(&mut self, plan: &[Planned], vocab: usize) -> Vec<Option<RowPlan>> {
        let mut plans: Vec<Option<RowPlan>> = Vec::with_capacity(plan.len());
        for p in plan {
            let s = &self.running[p.index];
            let wants = s.computed + p.chunk == s.tokens.len() && s.request.embed.is_none();
            let masks_stops = self.masks_stops(s);
            // A verification draws row by row on the host (or takes the device's greedy tokens):
            // a plan draws its random word now, for one row.
            if !wants
                || s.draft > 0
                || (s.sampler.is_plain_greedy() && !masks_stops && s.constraint.is_none())
            {
                plans.push(None);
                continue;
            }
            let masked = if masks_stops {
                stop_tokens(&s.request.sampling, &self.eos)
            } else {
                Vec::new()
            };
            let seq = &mut self.running[p.index];
            // A grammar's mask that cannot be computed leaves the row to the host path, which
            // reports the error for this sequence alone.
            let allowed = match seq.constraint.as_mut().map(|c| c.allowed(vocab)) {
                Some(Err(_)) => {
                    plans.push(None);
                    continue;
                }
                Some(Ok(bits)) => Some(bits),
                None => None,
            };
            let mut row_plan = seq.sampler.plan(masked);
            row_plan.allowed = allowed;
            plans.push(Some(row_plan));
        }
        plans
    }

    /// The backend's view of each planned sequence: its tokens this step and their rows.
    fn step_seqs(&self, plan: &[Planned]) -> Vec<StepSeq<'_>> {
        plan.iter()
            .map(|p| {
                let s = &self.running[p.index];
                let wants = s.computed + p.chunk == s.tokens.len() && s.request.embed.is_none();
                #[cfg(test)]
                let prompt_len = if self.faults.verify_as_prompt && s.draft > 0 {
                    s.tokens.len()
                } else {
                    s.request.prompt.len()
                };
                #[cfg(not(test))]
                let prompt_len = s.request.prompt.len();
                StepSeq {
                    tokens: &s.tokens[s.computed..s.computed + p.chunk],
                    first_position: s.computed,
                    prompt_len,
                    block_table: &s.blocks,
                    logit_rows: if wants { 1 + s.draft } else { 0 },
                }
            })
            .collect()
    }

    /// How the backend reduces each planned sequence's rows (`plans` from [`Self::row_plans`]).
    fn row_sampling<'a>(
        &self,
        plan: &[Planned],
        plans: &'a [Option<RowPlan>],
    ) -> Vec<RowSampling<'a>> {
        plan.iter()
            .zip(plans)
            .map(|(p, row_plan)| {
                let s = &self.running[p.index];
                if s.request.embed.is_some() {
                    return match s.hidden_rows(p.chunk) {
                        Some(rows) => RowSampling::Hidden(rows),
                        None => RowSampling::Host,
                    };
                }
                match row_plan {
                    Some(row_plan) => RowSampling::Summary(row_plan),
                    None if s.constraint.is_none()
                        && s.sampler.is_plain_greedy()
                        && (s.draft == 0 || !self.masks_stops(s)) =>
                    {
                        RowSampling::Greedy
                    }
                    None => RowSampling::Host,
                }
            })
            .collect()
    }

    /// Whether `seq`'s stop tokens must be masked before sampling: it has not reached its
    /// `min_tokens`, and it has stop tokens.
    fn masks_stops(&self, seq: &Sequence) -> bool {
        let p = &seq.request.sampling;
        seq.generated < p.min_tokens
            && (!p.stop_token_ids.is_empty() || (!p.ignore_eos && !self.eos.is_empty()))
    }

    fn expire(&mut self) -> Result<(), KvError> {
        let now = Instant::now();
        self.blocks.expire_pins(now);
        let expired: Vec<u64> = self
            .running
            .iter()
            .chain(self.waiting.iter())
            .filter(|s| s.deadline.is_some_and(|d| d <= now) || s.events.is_closed())
            .map(|s| s.id)
            .collect();
        for id in expired {
            let closed = self
                .running
                .iter()
                .chain(self.waiting.iter())
                .any(|s| s.id == id && s.events.is_closed());
            let reason = if closed {
                FinishReason::Cancelled
            } else {
                FinishReason::Timeout
            };
            self.cancel(id, reason)?;
        }
        Ok(())
    }

    fn plan(&mut self, backend: &mut dyn Backend) -> Result<Vec<Planned>, KvError> {
        let mut budget = self.limits.max_batch_tokens;
        let mut plan: Vec<Planned> = Vec::new();
        let mut i = 0;
        while i < self.running.len() && budget > 0 {
            let chunk = self.running[i].pending().min(budget);
            if self.reserve(i, chunk, backend)? {
                plan.push(Planned { index: i, chunk });
                budget -= chunk;
                i += 1;
            } else {
                // Out of blocks: preempt the newest running sequence and retry. If that is this
                // one, it waits again and the step goes on without it.
                let victim = self.running.len() - 1;
                self.preempt(victim)?;
                plan.retain(|p| p.index != victim);
            }
        }
        while budget > 0 && self.running.len() < self.limits.max_running {
            let Some(next) = self.waiting.front() else {
                break;
            };
            // Admission by memory: the oldest waiting request starts when its first chunk's
            // blocks can be had, its cached prefix's restores included; until then it waits
            // (and nothing is restored for it), in order.
            #[cfg(test)]
            let check = !self.faults.admit_without_room;
            #[cfg(not(test))]
            let check = true;
            if check && !self.fits(next, budget) {
                if self.running.is_empty() {
                    // Nothing running will free blocks: what it lacks is held by pins.
                    self.refuse_front();
                    continue;
                }
                break;
            }
            let Some(mut seq) = self.waiting.pop_front() else {
                break;
            };
            match self.acquire_cached_prefix(&mut seq, backend) {
                Ok(()) => {}
                // Its cached prefix could not be copied back to the device: this request fails
                // (holding nothing), the others go on.
                Err(e @ KvError::Copy { .. }) => {
                    let _ = seq.events.send(TokenEvent::Failed {
                        message: format!("restoring the cached prompt prefix failed: {e}"),
                    });
                    continue;
                }
                Err(e) => return Err(e),
            }
            // A preempted sequence comes back through here: its first start counts.
            seq.started.get_or_insert_with(Instant::now);
            self.running.push(seq);
            let index = self.running.len() - 1;
            let chunk = self.running[index].pending().min(budget);
            if !self.reserve(index, chunk, backend)? {
                self.preempt(index)?;
                break;
            }
            plan.push(Planned { index, chunk });
            budget -= chunk;
        }
        Ok(plan)
    }

    /// Ends the oldest waiting request, which cannot start with nothing running because pinned
    /// prefixes hold the blocks it needs (no lower tier to move them to): a request that had
    /// generated tokens before a preemption ends at its length, as at the cache's capacity; a
    /// prompt that never started fails, naming the numbers. Waiting for the pins to expire
    /// would stall every request behind it.
    fn refuse_front(&mut self) {
        let Some(seq) = self.waiting.pop_front() else {
            return;
        };
        if seq.generated > seq.resumed {
            let _ = seq.events.send(TokenEvent::Finished {
                reason: FinishReason::Length,
                usage: seq.usage(),
            });
            return;
        }
        let bs = self.blocks.block_size();
        let _ = seq.events.send(TokenEvent::Failed {
            message: format!(
                "the prompt of {} tokens needs {} KV blocks of {bs} tokens; {} of the device's \
                 {} blocks are held by pinned cached prefixes, leaving {} (unpin them, wait for \
                 their TTL, or give the engine a host KV tier)",
                seq.tokens.len(),
                seq.tokens.len().div_ceil(bs),
                self.blocks.held_by_pins(),
                self.blocks.device_blocks(),
                self.blocks.obtainable(),
            ),
        });
    }

    /// Whether the blocks `seq`'s next chunk of at most `budget` tokens needs can be had now
    /// (free or evictable): one for each block it will hold after the chunk, less those of its
    /// cached prefix already on the device and held by other sequences (a block restored from
    /// host or disk takes one like a computed block).
    fn fits(&self, seq: &Sequence, budget: usize) -> bool {
        let bs = self.blocks.block_size();
        let usable = (seq.tokens.len() - 1) / bs;
        let hashes = prompt_block_hashes(&seq.tokens[..usable * bs], bs, seq.request.cache_salt);
        let (shared, cached) = if seq.reads_cache() {
            self.blocks.admission_view(&hashes)
        } else {
            (0, 0)
        };
        let prefix = cached * bs;
        let chunk = (seq.tokens.len() - prefix).min(budget);
        let blocks = (prefix + chunk).div_ceil(bs);
        blocks.saturating_sub(shared) <= self.blocks.obtainable()
    }

    /// Acquires the prompt's cached full blocks (never the block holding the last token, whose
    /// logits must be computed).
    fn acquire_cached_prefix(
        &mut self,
        seq: &mut Sequence,
        backend: &mut dyn Backend,
    ) -> Result<(), KvError> {
        let bs = self.blocks.block_size();
        let usable = if seq.reads_cache() {
            (seq.tokens.len() - 1) / bs
        } else {
            0
        };
        #[cfg(test)]
        if self.faults.hash_skips_last_token {
            let salt = seq.request.cache_salt;
            let mut hashes: Vec<BlockHash> = Vec::new();
            for block in seq.tokens[..usable * bs].chunks_exact(bs) {
                hashes.push(block_hash(hashes.last().copied(), &block[..bs - 1], salt));
            }
            let acquired = self.blocks.acquire_prefix(&hashes, backend)?;
            seq.computed = acquired.len() * bs;
            seq.hashes = hashes[..acquired.len()].to_vec();
            seq.blocks = acquired;
            return Ok(());
        }
        let hashes = prompt_block_hashes(&seq.tokens[..usable * bs], bs, seq.request.cache_salt);
        let acquired = self.blocks.acquire_prefix(&hashes, backend)?;
        seq.computed = acquired.len() * bs;
        seq.hashes = hashes[..acquired.len()].to_vec();
        seq.blocks = acquired;
        if seq.generated == seq.resumed {
            seq.cached_tokens = seq.computed.min(seq.request.prompt.len()) as u32;
        }
        Ok(())
    }

    /// Makes `running[index]` hold blocks for `chunk` more tokens; false when blocks ran out.
    fn reserve(
        &mut self,
        index: usize,
        chunk: usize,
        backend: &mut dyn Backend,
    ) -> Result<bool, KvError> {
        let bs = self.blocks.block_size();
        let needed = (self.running[index].computed + chunk).div_ceil(bs);
        while self.running[index].blocks.len() < needed {
            match self.blocks.allocate(backend) {
                Ok(id) => self.running[index].blocks.push(id),
                Err(KvError::OutOfBlocks { .. }) => return Ok(false),
                Err(e) => return Err(e),
            }
        }
        Ok(true)
    }

    fn preempt(&mut self, index: usize) -> Result<(), KvError> {
        let mut seq = self.running.remove(index);
        self.preemptions += 1;
        seq.tokens.truncate(seq.tokens.len() - seq.draft);
        seq.draft = 0;
        if let Some(spec) = self.speculator.as_mut() {
            spec.proposer.forget(seq.id);
        }
        for id in seq.blocks.drain(..).rev() {
            self.blocks.release(id)?;
        }
        seq.computed = 0;
        seq.hashes.clear();
        seq.pooled = (Vec::new(), 0);
        #[cfg(test)]
        if self.faults.forget_generated_on_preempt {
            seq.tokens.truncate(seq.request.prompt.len());
        }
        self.add(seq);
        Ok(())
    }

    /// After the backend ran: sample, advance, register full blocks, finish.
    fn apply(
        &mut self,
        plan: &[Planned],
        kinds: &[Kind],
        plans: Vec<Option<RowPlan>>,
        output: &mut StepOutput,
        (vocab, hidden): (usize, usize),
    ) -> Result<(), KvError> {
        let bs = self.blocks.block_size();
        // Blocks a sequence can grow into: the device's, less those only pins hold (counted
        // once a step, not per row: it walks the pins).
        let usable = self.blocks.device_blocks() - self.blocks.held_by_pins();
        let mut out = Outputs {
            rows: output.logits.chunks_exact_mut(vocab),
            tokens: output.tokens.iter(),
            summaries: output.summaries.drain(..),
        };
        let mut hidden_rows = &output.hidden[..];
        let mut finished: Vec<(u64, FinishReason)> = Vec::new();
        for ((p, kind), row_plan) in plan.iter().zip(kinds).zip(plans) {
            let seq = &mut self.running[p.index];
            // Proposed tokens leave the sequence until their draws accept them.
            let draft = seq.tokens.split_off(seq.tokens.len() - seq.draft);
            seq.draft = 0;
            seq.computed += p.chunk - draft.len();
            if let Kind::Hidden(how) = kind {
                let (these, rest) = hidden_rows.split_at(how.count(p.chunk) * hidden);
                seq.pool(these, hidden);
                hidden_rows = rest;
            }
            let reason = if seq.computed < seq.tokens.len() {
                None
            } else if seq.request.embed.is_some() {
                let vector = seq.pooled_vector();
                let _ = seq.events.send(TokenEvent::Embedding { vector });
                Some(FinishReason::Stop)
            } else {
                // Row j's draw decides position computed + j: it accepts proposal j when they
                // are equal, and each accepted proposal's row (computed with it as input) is
                // then committed K/V.
                let mut reason = None;
                let mut accepted = 0;
                let mut keep_stale = self.keeps_a_stale_slot();
                for j in 0..=draft.len() {
                    let seq = &mut self.running[p.index];
                    let sampled = out.sample(seq, *kind, row_plan.as_ref(), &self.eos);
                    let token = sampled.as_ref().ok().map(|s| s.token);
                    reason = self.emit(p.index, sampled, usable);
                    let seq = &mut self.running[p.index];
                    if j > 0 {
                        seq.computed += 1;
                    }
                    let rejected = j < draft.len() && token != Some(draft[j]);
                    if rejected && keep_stale && reason.is_none() {
                        // The canary's broken rollback: the rejected proposal's row is read
                        // next, as if its K/V held the token just drawn.
                        keep_stale = false;
                        continue;
                    }
                    if reason.is_some() || j == draft.len() || rejected {
                        // Rows not read past here are skipped in the output.
                        out.skip(*kind, draft.len() - j);
                        break;
                    }
                    accepted += 1;
                }
                if !draft.is_empty() {
                    let seq = &mut self.running[p.index];
                    if let Some(spec) = self.speculator.as_mut() {
                        seq.acceptance
                            .observe(draft.len(), accepted, spec.counters.prior());
                        spec.counters.record(draft.len(), accepted);
                    }
                }
                reason
            };
            let seq = &mut self.running[p.index];
            while seq.hashes.len() < seq.computed / bs {
                let i = seq.hashes.len();
                let parent = seq.hashes.last().copied();
                #[cfg(test)]
                let end = (i + 1) * bs - usize::from(self.faults.hash_skips_last_token);
                #[cfg(not(test))]
                let end = (i + 1) * bs;
                let hash = block_hash(parent, &seq.tokens[i * bs..end], seq.request.cache_salt);
                self.blocks.commit(seq.blocks[i], hash, parent)?;
                seq.hashes.push(hash);
            }
            // Rollback: blocks that hold only rejected proposals' slots go back.
            while seq.blocks.len() > seq.tokens.len().div_ceil(bs) {
                let id = seq.blocks.pop().expect("more blocks than needed");
                self.blocks.release(id)?;
            }
            if let Some(reason) = reason {
                finished.push((seq.id, reason));
            }
        }
        for (id, reason) in finished {
            self.cancel(id, reason)?;
        }
        Ok(())
    }

    /// Whether the canary's broken rollback is on (never outside tests).
    fn keeps_a_stale_slot(&self) -> bool {
        #[cfg(test)]
        return self.faults.stale_slot_on_reject;
        #[cfg(not(test))]
        false
    }

    /// Records one drawn token of `running[index]` (or its failure): a stop, the grammar's end,
    /// or a generated token streamed out; the reason the sequence ends, if it does.
    fn emit(
        &mut self,
        index: usize,
        sampled: Result<strata_model::sampler::Sampled, String>,
        usable: usize,
    ) -> Option<FinishReason> {
        let bs = self.blocks.block_size();
        let seq = &mut self.running[index];
        match sampled {
            Err(message) => {
                let _ = seq.events.send(TokenEvent::Failed { message });
                Some(FinishReason::Cancelled)
            }
            Ok(s) if is_stop_token(s.token, &seq.request.sampling, &self.eos) => {
                Some(FinishReason::Stop)
            }
            // The grammar is complete and the model chose to end it.
            Ok(s)
                if seq
                    .constraint
                    .as_mut()
                    .is_some_and(|c| c.ends_with(s.token)) =>
            {
                Some(FinishReason::Stop)
            }
            Ok(s) => {
                if let Some(Err(e)) = seq.constraint.as_mut().map(|c| c.advance(s.token)) {
                    let _ = seq.events.send(TokenEvent::Failed {
                        message: e.to_string(),
                    });
                    return Some(FinishReason::Cancelled);
                }
                seq.generated += 1;
                seq.tokens.push(s.token);
                let _ = seq.events.send(TokenEvent::Token {
                    id: s.token,
                    logprobs: s.logprobs,
                    rng_pos: seq.sampler.rng_pos(),
                });
                (seq.generated >= seq.request.sampling.max_tokens
                    || seq.tokens.len() >= self.context_window
                    || seq.tokens.len().div_ceil(bs) > usable)
                    .then_some(FinishReason::Length)
            }
        }
    }

    /// Ends every request with `message` (after an unrecoverable step error), releasing what can
    /// be released.
    pub fn fail_all(&mut self, message: &str) {
        let all: Vec<Sequence> = self
            .running
            .drain(..)
            .chain(self.waiting.drain(..))
            .collect();
        for mut seq in all {
            let _ = seq.events.send(TokenEvent::Failed {
                message: message.to_string(),
            });
            for id in seq.blocks.drain(..).rev() {
                let _ = self.blocks.release(id);
            }
        }
    }

    fn finish(&mut self, mut seq: Sequence, reason: FinishReason) -> Result<(), KvError> {
        if let Some(spec) = self.speculator.as_mut() {
            spec.proposer.forget(seq.id);
        }
        for id in seq.blocks.drain(..).rev() {
            self.blocks.release(id)?;
        }
        let _ = seq.events.send(TokenEvent::Finished {
            reason,
            usage: seq.usage(),
        });
        Ok(())
    }
}

/// The backend's output has the rows the step asked for: logits of host rows, tokens of greedy
/// rows, summaries of planned rows, hidden states of embedding rows.
fn check_output(
    output: &StepOutput,
    plan: &[Planned],
    steps: &[StepSeq<'_>],
    sampling: &[RowSampling<'_>],
    (vocab, hidden): (usize, usize),
) -> Result<(), StepError> {
    let mut counts = [0usize; 3];
    for (step, how) in steps.iter().zip(sampling) {
        counts[match how {
            RowSampling::Host => 0,
            RowSampling::Greedy => 1,
            RowSampling::Summary(_) => 2,
            RowSampling::Hidden(_) => continue,
        }] += step.logit_rows;
    }
    let [rows, greedy_rows, summary_rows] = counts;
    let hidden_rows: usize = plan
        .iter()
        .zip(sampling)
        .map(|(p, how)| match how {
            RowSampling::Hidden(rows) => rows.count(p.chunk),
            _ => 0,
        })
        .sum();
    if output.logits.len() != rows * vocab
        || output.tokens.len() != greedy_rows
        || output.summaries.len() != summary_rows
    {
        return Err(StepError::Logits {
            got: output.logits.len(),
            rows,
            vocab,
            tokens: output.tokens.len(),
            greedy: greedy_rows,
            summaries: output.summaries.len(),
            summary_rows,
        });
    }
    if output.hidden.len() != hidden_rows * hidden {
        return Err(StepError::Hidden {
            got: output.hidden.len(),
            rows: hidden_rows,
            hidden,
        });
    }
    Ok(())
}

/// The tokens `params` stops on, masked before `min_tokens`: the request's stop token ids and,
/// unless it ignores them, the model's end-of-sequence ids.
fn stop_tokens(params: &strata_protocol::SamplingParams, eos: &[u32]) -> Vec<u32> {
    let eos = if params.ignore_eos { &[][..] } else { eos };
    params.stop_token_ids.iter().chain(eos).copied().collect()
}

/// How a step's row came back (see [`RowSampling`]), kept past the backend call.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kind {
    Host,
    Greedy,
    Summary,
    Hidden(HiddenRows),
}

impl Kind {
    fn of(sampling: &RowSampling<'_>) -> Self {
        match sampling {
            RowSampling::Host => Kind::Host,
            RowSampling::Greedy => Kind::Greedy,
            RowSampling::Summary(_) => Kind::Summary,
            RowSampling::Hidden(rows) => Kind::Hidden(*rows),
        }
    }
}
