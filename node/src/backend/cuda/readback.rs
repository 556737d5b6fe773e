//! A step's results back to the host: the greedy tokens reduced on the device (4 bytes a row),
//! and the logits rows the host still samples from, through the page-locked buffer.

use super::{CudaBackend, CudaError, mark};

impl CudaBackend {
    /// The greedy token of each of the first `logits` rows of this (single) rank's logits,
    /// reduced on the device; only the tokens cross to the host.
    pub(super) fn greedy_tokens(&mut self, logits: usize) -> Result<Vec<u32>, CudaError> {
        let (v, per) = (self.config.vocab_size, self.shard.vocab_per_rank);
        let s = &mut self.scratch;
        if s.tokens.as_ref().is_none_or(|t| t.len() < logits) {
            s.tokens = Some(self.stream.alloc_zeros::<u32>(logits)?);
        }
        let tokens = s.tokens.as_mut().expect("allocated just above");
        let device = s.logits.as_ref().expect("scratch allocated");
        let mut view = tokens.slice_mut(..logits);
        self.kernels.argmax(
            &self.stream,
            &mut view,
            &device.slice(..logits * per),
            logits,
            v,
            per,
        )?;
        mark(&mut self.profile, &self.stream, "greedy")?;
        let mut host = vec![0u32; logits];
        self.stream
            .memcpy_dtoh(&tokens.slice(..logits), &mut host)?;
        self.stream.synchronize()?;
        Ok(host)
    }

    /// The logits rows of `order` (sequence, device row) that `skip` does not name, in order,
    /// through the page-locked buffer: every row in one copy when all are wanted, else row by
    /// row.
    pub(super) fn download_logits(
        &mut self,
        order: &[(usize, usize)],
        logits: usize,
        skip: impl Fn(usize) -> bool,
    ) -> Result<Vec<f32>, CudaError> {
        let v = self.config.vocab_size;
        let (world, per) = (self.shard.world, self.shard.vocab_per_rank);
        let kept: Vec<usize> = order
            .iter()
            .filter(|&&(seq, _)| !skip(seq))
            .map(|&(_, j)| j)
            .collect();
        if kept.is_empty() {
            // The greedy tokens' copy already waited for the stream.
            return Ok(Vec::new());
        }
        let s = &mut self.scratch;
        let logits_host = s.logits_host.as_mut().expect("scratch allocated");
        let device = if world > 1 { &s.logits_all } else { &s.logits };
        let device = device.as_ref().expect("scratch allocated");
        if kept.len() == order.len() || world > 1 {
            self.stream
                .memcpy_dtoh(&device.slice(..world * logits * per), logits_host)?;
        } else {
            // One rank: row `j` sits at `j * per`; copy just the kept rows to the same places.
            let host = logits_host.as_mut_slice()?;
            for &j in &kept {
                self.stream.memcpy_dtoh(
                    &device.slice(j * per..(j + 1) * per),
                    &mut host[j * per..(j + 1) * per],
                )?;
            }
        }
        // Event tracking is off, so the pinned slice cannot wait for its own copy: wait for the
        // stream before reading it.
        self.stream.synchronize()?;
        let host = logits_host.as_slice()?;
        // Rank `q`'s vocabulary columns of row `j` sit at `(q * logits + j) * per`.
        let mut out = Vec::with_capacity(kept.len() * v);
        for j in kept {
            for q in 0..world {
                let cols = (q * per).min(v)..((q + 1) * per).min(v);
                let at = (q * logits + j) * per;
                out.extend_from_slice(&host[at..at + cols.len()]);
            }
        }
        Ok(out)
    }
}
