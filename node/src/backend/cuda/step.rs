//! One step on the device: the rows in device order (every prompt row, then every decode row),
//! the plan and its packed inputs, the launch (a captured graph for a decode-only bucket, eager
//! otherwise) and the read-back of logits, greedy tokens, row summaries and hidden states.

use strata_kernels::cudarc::driver::sys::{CUgraphInstantiate_flags, CUstreamCaptureMode};
use strata_kernels::{DECODE_SPLIT_TOKENS, NO_TOKEN};
use strata_model::sampler::RowPlan;

use super::{
    CudaBackend, CudaError, GRAPH_BUCKETS, Layout, Plan, Segment, SendGraph, StepOutput,
    StepProfile, mark,
};
use crate::backend::{RowSampling, StepSeq};

/// One row of a step, in device order (prompt rows first).
#[derive(Debug, Clone, Copy)]
struct Row {
    seq: usize,
    token: u32,
    position: usize,
    slot: u32,
}

/// The step's rows in device order, how many are prompt rows, and per prompt segment
/// `(sequence, first row, rows)`.
type DeviceRows = (Vec<Row>, usize, Vec<(usize, usize, usize)>);

impl CudaBackend {
    pub(super) fn run(
        &mut self,
        seqs: &[StepSeq<'_>],
        sampling: &[RowSampling<'_>],
    ) -> Result<StepOutput, CudaError> {
        let (mut rows, p, segment_rows) = self.device_rows(seqs)?;
        let t = rows.len();
        if t == 0 {
            return Ok(StepOutput::default());
        }
        let wanted = logit_rows(seqs, &rows, p);
        // A decode-only step replays a graph captured for its bucket: padded to the bucket's
        // rows, logits for every row, block tables as wide as the context's power-of-two split
        // count. Otherwise the step runs eagerly at its own shape.
        let bucket = (self.graphs_enabled && p == 0 && self.profile.is_none())
            .then(|| GRAPH_BUCKETS.iter().copied().find(|&b| b >= t))
            .flatten();
        let plan = self.pack(seqs, &mut rows, (p, &segment_rows), &wanted, bucket)?;
        self.launch(bucket, &plan)?;
        self.read_back(seqs, sampling, &rows[..t], &wanted, (bucket, plan.logits))
    }

    /// Every sequence's rows, checked against the backend's positions and blocks.
    fn device_rows(&self, seqs: &[StepSeq<'_>]) -> Result<DeviceRows, CudaError> {
        let bs = self.block_size;
        let mut prompt_rows = Vec::new();
        let mut decode_rows = Vec::new();
        let mut segment_rows: Vec<(usize, usize, usize)> = Vec::new();
        for (i, s) in seqs.iter().enumerate() {
            let start = prompt_rows.len();
            for (j, &token) in s.tokens.iter().enumerate() {
                let position = s.first_position + j;
                if position >= self.max_positions {
                    return Err(CudaError::Unsupported(format!(
                        "position {position} is beyond the {} positions this backend was \
                         started for",
                        self.max_positions
                    )));
                }
                let block = *s.block_table.get(position / bs).ok_or_else(|| {
                    CudaError::Unsupported(format!(
                        "block table of {} blocks cannot hold position {position}",
                        s.block_table.len()
                    ))
                })?;
                if block as usize >= self.num_blocks {
                    return Err(CudaError::Unsupported(format!(
                        "block {block} is beyond the {} blocks of this backend",
                        self.num_blocks
                    )));
                }
                let row = Row {
                    seq: i,
                    token,
                    position,
                    slot: block * bs as u32 + (position % bs) as u32,
                };
                if position < s.prompt_len {
                    prompt_rows.push(row);
                } else {
                    decode_rows.push(row);
                }
            }
            if prompt_rows.len() > start {
                segment_rows.push((i, start, prompt_rows.len() - start));
            }
        }
        let p = prompt_rows.len();
        let rows = prompt_rows.into_iter().chain(decode_rows).collect();
        Ok((rows, p, segment_rows))
    }

    /// The step's plan: `rows` padded to the bucket's rows, every index array packed into one
    /// upload and copied to the device.
    fn pack(
        &mut self,
        seqs: &[StepSeq<'_>],
        rows: &mut Vec<Row>,
        (p, segment_rows): (usize, &[(usize, usize, usize)]),
        wanted: &[(usize, usize)],
        bucket: Option<usize>,
    ) -> Result<Plan, CudaError> {
        let bs = self.block_size;
        let t = rows.len();
        let max_context = rows[p..].iter().map(|r| r.position + 1).max().unwrap_or(1);
        let (device_rows, max_context, width) = match bucket {
            Some(b) => {
                let splits = max_context
                    .div_ceil(DECODE_SPLIT_TOKENS)
                    .next_power_of_two();
                let context = (splits * DECODE_SPLIT_TOKENS).min(self.max_positions);
                (b, context, context.div_ceil(bs))
            }
            None => (t, max_context, max_context.div_ceil(bs)),
        };
        let scratch_slot = (self.num_blocks * bs) as u32;
        rows.extend((t..device_rows).map(|_| Row {
            seq: usize::MAX,
            token: 0,
            position: 0,
            slot: scratch_slot,
        }));
        let logits = if bucket.is_some() {
            device_rows
        } else {
            wanted.len()
        };
        let logits_prompt = wanted.iter().filter(|&&(_, row)| row < p).count();

        // Pack every index array into one upload.
        let decode = device_rows - p;
        let prefill_blocks: usize = segment_rows
            .iter()
            .map(|&(_, first, n)| rows[first + n - 1].position / bs + 1)
            .sum();
        let layout = Layout::new(device_rows, decode, width, logits, prefill_blocks);
        let host = &mut self.host_inputs;
        host.clear();
        host.resize(layout.len, 0);
        for (i, r) in rows.iter().enumerate() {
            host[layout.ids + i] = r.token;
            host[layout.positions + i] = r.position as u32;
            host[layout.slots + i] = r.slot;
        }
        for (d, r) in rows[p..].iter().enumerate() {
            host[layout.context_lens + d] = r.position as u32 + 1;
            let table = &mut host[layout.decode_tables + d * width..][..width];
            if r.seq == usize::MAX {
                table.fill(self.num_blocks as u32);
            } else {
                let n = r.position / bs + 1;
                table[..n].copy_from_slice(&seqs[r.seq].block_table[..n]);
            }
        }
        if bucket.is_some() {
            for (j, g) in host[layout.gather..][..logits].iter_mut().enumerate() {
                *g = j as u32;
            }
        } else {
            for (j, &(_, row)) in wanted.iter().enumerate() {
                host[layout.gather + j] = row as u32;
            }
        }
        let mut segments = Vec::with_capacity(segment_rows.len());
        let mut at = layout.prefill_tables;
        for &(i, first, n) in segment_rows {
            let blocks = rows[first + n - 1].position / bs + 1;
            host[at..at + blocks].copy_from_slice(&seqs[i].block_table[..blocks]);
            segments.push(Segment {
                first,
                rows: n,
                start: rows[first].position,
                table: (at, blocks),
            });
            at += blocks;
        }
        let plan = Plan {
            rows: device_rows,
            prompt: p,
            segments,
            width,
            max_context,
            logits,
            logits_prompt,
            layout,
        };
        self.ensure_scratch(&plan)?;
        let inputs =
            self.scratch.inputs.as_mut().ok_or_else(|| {
                CudaError::Unsupported("the step inputs were not sized".to_string())
            })?;
        self.stream
            .memcpy_htod(&self.host_inputs, &mut inputs.slice_mut(..layout.len))?;
        Ok(plan)
    }

    /// Runs the forward pass: the bucket's graph (captured on first use), or eagerly.
    fn launch(&mut self, bucket: Option<usize>, plan: &Plan) -> Result<(), CudaError> {
        match bucket {
            Some(b) => {
                let key = (b, plan.width);
                if !self.graphs.contains_key(&key) {
                    let stream = self.stream.clone();
                    stream
                        .begin_capture(CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)?;
                    let forward = self.forward(plan);
                    // End the capture whatever happened, so the stream is usable again.
                    let graph = stream.end_capture(CUgraphInstantiate_flags(0));
                    forward?;
                    let graph = graph?.ok_or_else(|| {
                        CudaError::Driver("stream capture produced no graph".into())
                    })?;
                    self.graphs.insert(key, SendGraph(graph));
                }
                self.graphs[&key].0.launch()?;
            }
            None => {
                if self.profile.is_some() {
                    self.mark("inputs")?;
                }
                self.forward(plan)?;
            }
        }
        Ok(())
    }

    /// Logits of the wanted rows, back in the order of `seqs`, reduced on the device where the
    /// sampling allows; the hidden rows asked for. `rows` are the step's rows without padding.
    fn read_back(
        &mut self,
        seqs: &[StepSeq<'_>],
        sampling: &[RowSampling<'_>],
        rows: &[Row],
        wanted: &[(usize, usize)],
        (bucket, logits): (Option<usize>, usize),
    ) -> Result<StepOutput, CudaError> {
        // The hidden rows asked for (prompt rows: eager steps only), sequence by sequence.
        let mut hidden_rows = Vec::new();
        for (i, s) in seqs.iter().enumerate() {
            let RowSampling::Hidden(how) = sampling.get(i).copied().unwrap_or_default() else {
                continue;
            };
            let mine = rows.iter().enumerate().filter(|(_, r)| r.seq == i);
            let skip = mine.clone().count() - how.count(s.tokens.len());
            hidden_rows.extend(mine.skip(skip).map(|(row, _)| row));
        }
        let hidden = self.hidden_states(&hidden_rows)?;
        if wanted.is_empty() {
            self.finish_profile()?;
            return Ok(StepOutput {
                hidden,
                ..StepOutput::default()
            });
        }
        // Device logits row of each wanted entry, in the order of `seqs`.
        let mut order: Vec<(usize, usize)> = wanted
            .iter()
            .enumerate()
            .map(|(j, &(seq, row))| (seq, if bucket.is_some() { row } else { j }))
            .collect();
        order.sort_unstable();
        let how = |seq: usize| sampling.get(seq).copied().unwrap_or_default();
        let is_greedy = |seq: usize| matches!(how(seq), RowSampling::Greedy);
        // Greedy and summarized rows are reduced where the logits are; only one rank's logits
        // are whole rows.
        if self.shard.world > 1 {
            let logits = self.download_logits(&order, logits, |_| false)?;
            self.finish_profile()?;
            let mut out = StepOutput::split(logits, seqs, sampling, self.config.vocab_size);
            out.hidden = hidden;
            return Ok(out);
        }
        let tokens = if order.iter().any(|&(seq, _)| is_greedy(seq)) {
            self.greedy_tokens(logits)?
        } else {
            Vec::new()
        };
        let summarized: Vec<(usize, &RowPlan)> = order
            .iter()
            .filter_map(|&(seq, j)| match how(seq) {
                RowSampling::Summary(plan) => Some((j, plan)),
                _ => None,
            })
            .collect();
        let summaries = if summarized.is_empty() {
            Vec::new()
        } else {
            self.row_summaries(&summarized)?
        };
        let out =
            self.download_logits(&order, logits, |seq| !matches!(how(seq), RowSampling::Host))?;
        let tokens = order
            .iter()
            .filter(|&&(seq, _)| is_greedy(seq))
            .map(|&(_, j)| (tokens[j] != NO_TOKEN).then_some(tokens[j]))
            .collect();
        self.finish_profile()?;
        Ok(StepOutput {
            logits: out,
            tokens,
            summaries,
            hidden,
        })
    }

    /// Records a profiling event after the launches of `family` (when profiling).
    fn mark(&mut self, family: &'static str) -> Result<(), CudaError> {
        mark(&mut self.profile, &self.stream, family)
    }

    fn finish_profile(&mut self) -> Result<(), CudaError> {
        let Some(events) = self.profile.take() else {
            return Ok(());
        };
        self.stream.synchronize()?;
        let mut profile = StepProfile::default();
        for pair in events.windows(2) {
            let ms = f64::from(pair[0].1.elapsed_ms(&pair[1].1)?);
            let family = pair[1].0;
            match profile.families.iter_mut().find(|f| f.0 == family) {
                Some(f) => {
                    f.1 += ms;
                    f.2 += 1;
                }
                None => profile.families.push((family, ms, 1)),
            }
        }
        self.last_profile = Some(profile);
        Ok(())
    }
}

/// The logits rows: each sequence's last `logit_rows` rows as `(sequence, device row)`,
/// prompt-path rows first.
fn logit_rows(seqs: &[StepSeq<'_>], rows: &[Row], p: usize) -> Vec<(usize, usize)> {
    let mut wanted = Vec::new();
    for (i, s) in seqs.iter().enumerate() {
        let n = s.logit_rows.min(s.tokens.len());
        for position in s.first_position + s.tokens.len() - n..s.first_position + s.tokens.len() {
            let row = rows
                .iter()
                .position(|r| r.seq == i && r.position == position)
                .expect("every token has a row");
            wanted.push((i, row));
        }
    }
    wanted.sort_by_key(|&(_, row)| (row >= p, row));
    wanted
}
