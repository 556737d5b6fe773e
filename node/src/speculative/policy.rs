//! How many tokens to propose: per sequence from its measured acceptance, per step from the
//! measured cost of steps by their row count.
//!
//! A decode step reads every weight once whatever its rows, so while the step is bound by
//! memory a verification row costs almost nothing and every accepted token is nearly free; once
//! the step is bound by compute each row costs its share and rejected rows slow everyone. The
//! policy compares, with the costs it has measured, the tokens a step is expected to yield per
//! second with and without the proposals, and keeps them only where they pay.

/// Row-count buckets whose step time is measured: 1, 2, 4, … 2^(BUCKETS-1) rows and above.
const BUCKETS: usize = 14;

/// Weight of a new sample in the moving averages.
const WEIGHT: f64 = 0.2;

/// The forward time of steps by their row count (power-of-two buckets), a moving average each.
#[derive(Debug, Clone)]
pub struct StepCost {
    seconds: [f64; BUCKETS],
}

impl Default for StepCost {
    fn default() -> Self {
        Self {
            seconds: [0.0; BUCKETS],
        }
    }
}

fn bucket(rows: usize) -> usize {
    (usize::BITS - rows.max(1).leading_zeros() - 1).min(BUCKETS as u32 - 1) as usize
}

impl StepCost {
    /// Folds in a step of `rows` rows that took `seconds` in the backend.
    pub fn observe(&mut self, rows: usize, seconds: f64) {
        let s = &mut self.seconds[bucket(rows)];
        *s = if *s == 0.0 {
            seconds
        } else {
            *s * (1.0 - WEIGHT) + seconds * WEIGHT
        };
    }

    /// The expected time of a step of `rows` rows: its bucket's measurement, else the nearest
    /// measured bucket below (unmeasured sizes are assumed as cheap, so they get tried and
    /// measured), else `None`.
    pub fn estimate(&self, rows: usize) -> Option<f64> {
        self.seconds[..=bucket(rows)]
            .iter()
            .rev()
            .copied()
            .find(|&s| s > 0.0)
    }

    /// Whether a step of `base` rows yielding `base_tokens` tokens is outdone by one of
    /// `base + extra` rows expected to yield `with_tokens`, in tokens per second.
    pub fn pays(&self, base: usize, base_tokens: f64, extra: usize, with_tokens: f64) -> bool {
        match (self.estimate(base), self.estimate(base + extra)) {
            (Some(without), Some(with)) => with_tokens * without > base_tokens * with,
            _ => true,
        }
    }
}

/// One sequence's acceptance: a moving average of the share of proposed tokens accepted.
#[derive(Debug, Clone, Copy)]
pub struct Acceptance {
    rate: f64,
}

impl Default for Acceptance {
    /// Optimistic until measured: a new sequence proposes the configured length.
    fn default() -> Self {
        Self { rate: 1.0 }
    }
}

impl Acceptance {
    pub fn observe(&mut self, proposed: usize, accepted: usize) {
        if proposed > 0 {
            let sample = accepted as f64 / proposed as f64;
            self.rate = self.rate * (1.0 - WEIGHT) + sample * WEIGHT;
        }
    }

    /// The draft length for this sequence: the configured `k` scaled by its acceptance, at
    /// least 1 (a proposal of one costs one row and keeps the measurement alive).
    pub fn draft_len(&self, k: usize) -> usize {
        ((k as f64 * self.rate).ceil() as usize).clamp(1, k)
    }

    /// Tokens a verification of `k` proposals is expected to commit, the bonus or corrected
    /// token included: `1 + a + a² + … + a^k` for per-token acceptance `a`.
    pub fn expected_tokens(&self, k: usize) -> f64 {
        let a = self.rate.clamp(0.0, 1.0);
        (0..=k).map(|i| a.powi(i as i32)).sum()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn costs_are_bucketed_and_unmeasured_sizes_borrow_the_size_below() {
        let mut c = StepCost::default();
        assert_eq!(c.estimate(8), None);
        assert!(c.pays(8, 8.0, 8, 9.0), "nothing measured: try it");
        c.observe(8, 0.010);
        assert_eq!(c.estimate(15), Some(0.010));
        assert_eq!(c.estimate(4), None);
        c.observe(16, 0.030);
        assert_eq!(c.estimate(16), Some(0.030));
        // 8 rows give 8 tokens in 10 ms; 16 rows must give more than 24 tokens in 30 ms.
        assert!(!c.pays(8, 8.0, 8, 20.0));
        assert!(c.pays(8, 8.0, 8, 25.0));
        c.observe(16, 0.040);
        assert!((c.estimate(16).unwrap() - 0.032).abs() < 1e-12);
    }

    #[test]
    fn acceptance_scales_the_draft_and_the_expectation() {
        let mut a = Acceptance::default();
        assert_eq!(a.draft_len(5), 5);
        assert_eq!(a.expected_tokens(3), 4.0);
        for _ in 0..40 {
            a.observe(4, 0);
        }
        assert_eq!(a.draft_len(5), 1);
        assert!(a.expected_tokens(5) < 1.01);
        for _ in 0..40 {
            a.observe(4, 2);
        }
        assert_eq!(a.draft_len(4), 2);
        assert!((a.expected_tokens(2) - 1.75).abs() < 0.01);
    }
}
