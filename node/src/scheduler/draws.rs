//! A step's output drawn row by row: each sequence's rows, as the backend returned them (greedy
//! tokens, row summaries or logits rows), turned into tokens by the sequence's sampler exactly as
//! plain decoding draws them.

use strata_model::sampler::{RowPlan, RowSummary, Sampled, SamplerError};

use super::{Kind, Sequence, stop_tokens};

/// A step's sampled output, consumed row by row in the order rows were asked for.
pub(super) struct Outputs<'a> {
    pub(super) rows: std::slice::ChunksExactMut<'a, f32>,
    pub(super) tokens: std::slice::Iter<'a, Option<u32>>,
    pub(super) summaries: std::vec::Drain<'a, Option<RowSummary>>,
}

impl Outputs<'_> {
    /// The next row of `seq` (returned as `kind`), drawn by its sampler as plain decoding draws
    /// it: the backend's greedy token, the plan's summary, or the logits row masked (stops before
    /// `min_tokens`, the grammar) and sampled on the host.
    pub(super) fn sample(
        &mut self,
        seq: &mut Sequence,
        kind: Kind,
        row_plan: Option<&RowPlan>,
        eos: &[u32],
    ) -> Result<Sampled, String> {
        match kind {
            Kind::Greedy => {
                let token = self
                    .tokens
                    .next()
                    .expect("one token per greedy row wanting logits");
                token
                    .ok_or(SamplerError::NoFiniteLogit)
                    .and_then(|t| seq.sampler.accept(t))
                    .map_err(|e| e.to_string())
            }
            Kind::Summary => {
                let summary = self
                    .summaries
                    .next()
                    .expect("one summary per summarized row wanting logits");
                let row_plan = row_plan.expect("a plan per summarized sequence");
                summary
                    .ok_or(SamplerError::NoFiniteLogit)
                    .and_then(|summary| seq.sampler.finish(row_plan, summary))
                    .map_err(|e| e.to_string())
            }
            Kind::Host | Kind::Hidden(_) => {
                let row = self
                    .rows
                    .next()
                    .expect("one logits row per row wanting logits");
                // Only a grammar whose mask failed in `step` comes back whole: the mask is
                // tried again here and its error ends this sequence.
                let p = &seq.request.sampling;
                if seq.generated < p.min_tokens {
                    for token in stop_tokens(p, eos) {
                        if let Some(logit) = row.get_mut(token as usize) {
                            *logit = f32::NEG_INFINITY;
                        }
                    }
                }
                let masked = match seq.constraint.as_mut() {
                    Some(c) => c.mask(row).map_err(|e| e.to_string()),
                    None => Ok(()),
                };
                masked.and_then(|()| seq.sampler.sample(row).map_err(|e| e.to_string()))
            }
        }
    }

    /// Passes over `n` rows of `kind` that no draw reads (proposals after a rejection).
    pub(super) fn skip(&mut self, kind: Kind, n: usize) {
        for _ in 0..n {
            match kind {
                Kind::Greedy => {
                    self.tokens.next();
                }
                Kind::Summary => {
                    self.summaries.next();
                }
                Kind::Host | Kind::Hidden(_) => {
                    self.rows.next();
                }
            }
        }
    }
}
