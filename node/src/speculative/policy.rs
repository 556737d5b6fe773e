//! How many tokens to propose: per sequence from its measured acceptance, per step from the
//! measured cost of steps by their row count.
//!
//! A decode step reads every weight once whatever its rows, so while the step is bound by
//! memory a verification row costs almost nothing and every accepted token is nearly free; once
//! the step is bound by compute each row costs its share and rejected rows slow everyone. The
//! policy compares, with the costs it has measured, the tokens a step is expected to yield per
//! second with and without the proposals, and keeps them only where they pay.

/// Row-count buckets whose step time is measured: 1, 2, 3, 4, 6, 8, 12, 16, … (each power of two
/// and one and a half times it) up to 2^19 rows and above.
const BUCKETS: usize = 40;

/// Weight of a new sample in the moving averages.
const WEIGHT: f64 = 0.2;

/// The time of decode steps by their row count, a moving average per bucket of the time and of
/// the row count it was measured at. Where the backend reads the weights once per group of rows
/// ([`Backend::decode_rows_per_weight_read`]), a step counts as that many groups of equal rows
/// and the averages are per group, so a step one row past a group is priced as the extra read it
/// costs.
///
/// [`Backend::decode_rows_per_weight_read`]: crate::backend::Backend::decode_rows_per_weight_read
#[derive(Debug, Clone)]
pub struct StepCost {
    /// (rows, seconds) per group, per bucket of rows per group; rows 0 = not measured.
    samples: [(f64, f64); BUCKETS],
    group: Option<usize>,
}

impl Default for StepCost {
    fn default() -> Self {
        Self {
            samples: [(0.0, 0.0); BUCKETS],
            group: None,
        }
    }
}

fn bucket(rows: usize) -> usize {
    let rows = rows.max(1);
    let log = (usize::BITS - rows.leading_zeros() - 1) as usize;
    // Above 2^log, the upper half starts at 1.5 × 2^log.
    let upper = log > 0 && rows >= 3 << (log - 1);
    (2 * log + usize::from(upper)).min(BUCKETS - 1)
}

fn fold(avg: f64, sample: f64) -> f64 {
    if avg == 0.0 {
        sample
    } else {
        avg * (1.0 - WEIGHT) + sample * WEIGHT
    }
}

impl StepCost {
    /// Rows of a step that share one read of the weights (`None`: all of them); what was
    /// measured under another group is dropped.
    pub fn set_group(&mut self, group: Option<usize>) {
        if self.group != group {
            *self = Self {
                group,
                ..Self::default()
            };
        }
    }

    /// Groups of a step of `rows` rows, and its rows per group.
    fn split(&self, rows: usize) -> (f64, f64) {
        let groups = self.group.map_or(1, |g| rows.div_ceil(g.max(1)).max(1));
        (groups as f64, rows as f64 / groups as f64)
    }

    /// Folds in a decode step of `rows` rows that took `seconds`.
    pub fn observe(&mut self, rows: usize, seconds: f64) {
        let (groups, per) = self.split(rows);
        let (r, s) = &mut self.samples[bucket(per.ceil() as usize)];
        *r = fold(*r, per);
        *s = fold(*s, seconds / groups);
    }

    /// The expected time of a decode step of `rows` rows: per group, interpolated between the
    /// measured row counts around it; below the smallest, the smallest's; above the largest, the
    /// largest's (a step larger than any measured gets tried, and measured). `None` before any
    /// measurement.
    pub fn estimate(&self, rows: usize) -> Option<f64> {
        let (groups, rows) = self.split(rows);
        let measured = self.samples.iter().copied().filter(|&(r, _)| r > 0.0);
        let mut below: Option<(f64, f64)> = None;
        for (r, s) in measured {
            if r <= rows {
                below = Some((r, s));
            } else {
                return Some(
                    groups
                        * match below {
                            // Between two measurements: interpolate.
                            Some((r0, s0)) => s0 + (s - s0) * (rows - r0) / (r - r0),
                            None => s,
                        },
                );
            }
        }
        below.map(|(_, s)| groups * s)
    }
}

/// Proposals a verification of `n` is expected to have accepted at per-token acceptance `a`:
/// `a + a² + … + aⁿ` (a proposal counts only if every one before it was accepted).
pub fn expected_accepted(n: usize, a: f64) -> f64 {
    (1..=n).map(|i| a.powi(i as i32)).sum()
}

/// The proposals a step keeps. `drafts[i]` is a sequence's proposal length and its acceptance
/// rate; on return the lengths kept (0: none). Proposals are taken in order of expected tokens
/// per row, and the step keeps the prefix of that order that yields the most tokens per second
/// by `cost`, if any beats the step without proposals (`base_rows` rows yielding `base_tokens`);
/// when none does, the lengths are halved and tried again. Proposing itself costs `round`
/// seconds per token of the longest proposal kept (a draft model's steps; 0 once the proposals
/// are made, or for a proposer whose cost is negligible).
pub fn choose(
    cost: &StepCost,
    base_rows: usize,
    base_tokens: f64,
    drafts: &mut [(usize, f64)],
    round: f64,
) {
    let gain = |(n, a): (usize, f64)| expected_accepted(n, a);
    let Some(without) = cost.estimate(base_rows) else {
        return; // nothing measured yet: try them all
    };
    let mut order: Vec<usize> = (0..drafts.len()).collect();
    while drafts.iter().any(|d| d.0 > 0) {
        let per_row = |i: usize| gain(drafts[i]) / drafts[i].0.max(1) as f64;
        order.sort_by(|&a, &b| per_row(b).total_cmp(&per_row(a)));
        let mut best = (base_tokens / without, 0);
        let (mut rows, mut tokens, mut longest) = (base_rows, base_tokens, 0);
        for (taken, &i) in order.iter().enumerate() {
            if drafts[i].0 == 0 {
                break;
            }
            rows += drafts[i].0;
            tokens += gain(drafts[i]);
            longest = longest.max(drafts[i].0);
            let seconds = cost.estimate(rows).unwrap_or(without) + round * longest as f64;
            let rate = tokens / seconds;
            if rate > best.0 {
                best = (rate, taken + 1);
            }
        }
        if best.1 > 0 {
            for &i in &order[best.1..] {
                drafts[i].0 = 0;
            }
            return;
        }
        drafts.iter_mut().for_each(|d| d.0 /= 2);
    }
}

/// One sequence's acceptance: a moving average of the share of proposed tokens accepted.
#[derive(Debug, Clone, Copy, Default)]
pub struct Acceptance {
    /// `None` until this sequence's first verification: the engine's rate stands in.
    rate: Option<f64>,
}

impl Acceptance {
    /// Folds in a verification; the first one starts from `prior` (the engine's rate), so one
    /// unlucky verification does not end a sequence's speculation.
    pub fn observe(&mut self, proposed: usize, accepted: usize, prior: f64) {
        if proposed > 0 {
            let sample = accepted as f64 / proposed as f64;
            let rate = self.rate.unwrap_or(prior);
            self.rate = Some(rate * (1.0 - WEIGHT) + sample * WEIGHT);
        }
    }

    /// The share accepted: this sequence's, or `prior` (the engine's so far) before it has one.
    pub fn rate(&self, prior: f64) -> f64 {
        self.rate.unwrap_or(prior).clamp(0.0, 1.0)
    }

    /// The draft length for this sequence: the configured `k` scaled by its acceptance, at
    /// least 1 (a proposal of one costs one row and keeps the measurement alive).
    pub fn draft_len(&self, k: usize, prior: f64) -> usize {
        ((k as f64 * self.rate(prior)).ceil() as usize).clamp(1, k)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn buckets_split_each_power_of_two_at_one_and_a_half() {
        let b: Vec<usize> = [1, 2, 3, 4, 5, 6, 7, 8, 12, 16, 64, 96, 127, 128]
            .map(bucket)
            .to_vec();
        assert_eq!(b, vec![0, 2, 3, 4, 4, 5, 5, 6, 7, 8, 12, 13, 13, 14]);
        assert_eq!(bucket(usize::MAX), BUCKETS - 1);
    }

    #[test]
    fn costs_are_interpolated_and_held_flat_past_the_largest() {
        let mut c = StepCost::default();
        assert_eq!(c.estimate(8), None);
        c.observe(8, 0.010);
        assert_eq!(c.estimate(4), Some(0.010));
        assert_eq!(
            c.estimate(200),
            Some(0.010),
            "past the largest: tried as the largest"
        );
        c.observe(64, 0.024);
        // Between 8 and 64 rows: linear.
        assert!((c.estimate(36).unwrap() - 0.017).abs() < 1e-12);
        assert_eq!(c.estimate(192), Some(0.024));
        c.observe(64, 0.034);
        assert!((c.estimate(64).unwrap() - 0.026).abs() < 1e-12);
    }

    #[test]
    fn a_step_past_a_weight_read_group_costs_another_read() {
        let mut c = StepCost::default();
        c.set_group(Some(64));
        // Memory-bound groups: 8 and 64 rows both about one read.
        c.observe(8, 0.0100);
        c.observe(64, 0.0110);
        assert!((c.estimate(64).unwrap() - 0.011).abs() < 1e-12);
        // 65 rows are two reads of 32.5 rows each.
        let two = c.estimate(65).unwrap();
        assert!((two - 2.0 * (0.010 + 0.001 * (32.5 - 8.0) / 56.0)).abs() < 1e-12);
        assert!(two > 1.8 * c.estimate(64).unwrap());
        // A measured 128-row step folds in as two groups of 64.
        c.observe(128, 0.030);
        assert!((c.estimate(64).unwrap() - (0.011 * 0.8 + 0.015 * 0.2)).abs() < 1e-12);
        // Another group size drops what was measured.
        c.set_group(None);
        assert_eq!(c.estimate(64), None);
    }

    #[test]
    fn sixty_four_sequences_do_not_speculate_into_a_second_weight_read() {
        // What the H100 run showed at concurrency 64 (8B shape): 64 decode rows cost 11 ms and
        // every 64 more another read; acceptance about 0.55.
        let mut c = StepCost::default();
        c.set_group(Some(64));
        c.observe(1, 0.0059);
        c.observe(64, 0.0110);
        let mut drafts = vec![(2, 0.55); 64];
        choose(&c, 64, 64.0, &mut drafts, 0.0);
        assert!(drafts.iter().all(|d| d.0 == 0), "{drafts:?}");
        // Eight sequences have 56 rows free in their read: they speculate.
        let mut drafts = vec![(2, 0.55); 8];
        choose(&c, 8, 8.0, &mut drafts, 0.0);
        assert!(drafts.iter().all(|d| d.0 == 2), "{drafts:?}");
    }

    #[test]
    fn a_step_keeps_the_proposals_that_pay_best_first() {
        let mut c = StepCost::default();
        let mut drafts = [(4, 0.9), (4, 0.1)];
        choose(&c, 2, 2.0, &mut drafts, 0.0);
        assert_eq!(drafts, [(4, 0.9), (4, 0.1)], "nothing measured: all tried");
        // Memory-bound: rows nearly free up to 16, then a quarter of a millisecond per row.
        c.observe(2, 0.010);
        c.observe(16, 0.0105);
        c.observe(64, 0.0225);
        c.observe(128, 0.0385);
        let mut drafts = [(4, 0.9), (4, 0.1)];
        choose(&c, 2, 2.0, &mut drafts, 0.0);
        assert_eq!(
            drafts,
            [(4, 0.9), (4, 0.1)],
            "free rows: even the poor one pays"
        );
        // 60 sequences already in the step: the rows cost their share, the poor draft never
        // pays, the good one does.
        let mut drafts = [(4, 0.1), (4, 0.95)];
        choose(&c, 60, 60.0, &mut drafts, 0.0);
        assert_eq!(drafts, [(0, 0.1), (4, 0.95)]);
        // Nothing pays when every extra row costs more than it brings: all dropped.
        let mut drafts = [(4, 0.2), (2, 0.3)];
        choose(&c, 64, 64.0, &mut drafts, 0.0);
        assert_eq!(drafts.map(|d| d.0), [0, 0]);
    }

    #[test]
    fn a_costly_proposer_keeps_proposals_only_where_they_pay_for_its_rounds() {
        let mut c = StepCost::default();
        c.observe(2, 0.010);
        c.observe(16, 0.0105);
        // Free verification rows, and a draft model at a tenth of the target's step per round:
        // a good draft pays its rounds.
        let mut drafts = [(4, 0.9), (4, 0.9)];
        choose(&c, 2, 2.0, &mut drafts, 0.001);
        assert_eq!(drafts.map(|d| d.0), [4, 4]);
        // Rounds at 0.8 of a target step: four of them for about 3.1 accepted tokens per
        // sequence lose to plain decoding; halved to two, they pay. A poor draft does not, at
        // any length.
        let mut drafts = [(4, 0.9), (4, 0.9)];
        choose(&c, 2, 2.0, &mut drafts, 0.008);
        assert_eq!(drafts.map(|d| d.0), [2, 2]);
        let mut drafts = [(4, 0.3), (4, 0.3)];
        choose(&c, 2, 2.0, &mut drafts, 0.008);
        assert_eq!(drafts.map(|d| d.0), [0, 0]);
    }

    #[test]
    fn acceptance_scales_the_draft_and_the_expectation() {
        let mut a = Acceptance::default();
        assert_eq!(a.draft_len(5, 1.0), 5);
        assert_eq!(a.draft_len(5, 0.2), 1, "the engine's rate stands in");
        assert_eq!(expected_accepted(3, a.rate(1.0)), 3.0);
        a.observe(4, 0, 0.5);
        assert_eq!(
            a.draft_len(5, 1.0),
            2,
            "its own rate, from the prior, once measured"
        );
        for _ in 0..40 {
            a.observe(4, 0, 0.5);
        }
        assert!(expected_accepted(5, a.rate(1.0)) < 0.01);
        for _ in 0..40 {
            a.observe(4, 2, 0.5);
        }
        assert_eq!(a.draft_len(4, 0.0), 2);
        assert!((expected_accepted(2, a.rate(0.0)) - 0.75).abs() < 0.01);
    }
}
