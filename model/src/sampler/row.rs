//! The part of sampling that reads a whole vocabulary row, defined so a GPU kernel reproduces it
//! bit for bit.
//!
//! A draw splits in two. [`RowSummary::of`] reads the whole (shaped) row once and keeps what the
//! rest needs: the top logit, how many tokens are finite, the greedy or id-order choice, the
//! weight totals and a prefix of the most likely tokens. [`RowSummary::finish`] then works on that
//! summary alone (tens to hundreds of candidates). The CUDA backend computes the summary where the
//! logits are (`kernels/cuda/sampling.cu`) and ships a few kilobytes instead of the row.
//!
//! Everything the summary holds is exact by construction on both sides:
//! - a token's log-weight is `(f64(logit) − f64(max)) × inv_t`, two correctly rounded f64
//!   operations;
//! - its weight is [`portable_exp`] of that (IEEE add, subtract and multiply in a fixed order, no
//!   fused multiply-add) in fixed point: `floor(e^lw × 2^WEIGHT_BITS)` as an integer, so sums are
//!   integer sums and do not depend on the order a parallel reduction adds them in;
//! - draws and cut-offs compare integers ([`mul_hi`], [`mul_frac32`]).
//!
//! A weight below 2^-40 of the top token's is zero: such a token is never drawn (p < 1e-12).

use std::cmp::Ordering;

use super::{SamplerError, sanitize};

/// Weights are fixed point with this many fractional bits; the top token's weight is exactly
/// `1 << WEIGHT_BITS`.
pub const WEIGHT_BITS: u32 = 40;

/// Vocabularies up to this size keep every integer sum below 2^64 (each weight ≤ 2^40).
pub const MAX_VOCAB: usize = 1 << 23;

/// `top_p` in fixed point (`2^32` = 1.0, off).
pub const TOP_P_ONE: u64 = 1 << 32;

/// Below this log-weight every weight is zero (e^-40 < 2^-40), so [`portable_exp`] need not go
/// further.
const EXP_FLOOR: f64 = -40.0;

/// Taylor coefficients 1/n!, n = 0..=13, as the correctly rounded f64 bit patterns the kernel
/// spells as hex literals.
const EXP_COEFFS: [f64; 14] = [
    f64::from_bits(0x3ff0000000000000),
    f64::from_bits(0x3ff0000000000000),
    f64::from_bits(0x3fe0000000000000),
    f64::from_bits(0x3fc5555555555555),
    f64::from_bits(0x3fa5555555555555),
    f64::from_bits(0x3f81111111111111),
    f64::from_bits(0x3f56c16c16c16c17),
    f64::from_bits(0x3f2a01a01a01a01a),
    f64::from_bits(0x3efa01a01a01a01a),
    f64::from_bits(0x3ec71de3a556c734),
    f64::from_bits(0x3e927e4fb7789f5c),
    f64::from_bits(0x3e5ae64567f544e4),
    f64::from_bits(0x3e21eed8eff8d898),
    f64::from_bits(0x3de6124613a86d09),
];
const LOG2_E: f64 = f64::from_bits(0x3ff71547652b82fe);
/// ln 2 split so `k × LN2_HI` is exact for the small `k` used here.
const LN2_HI: f64 = f64::from_bits(0x3fe62e42fee00000);
const LN2_LO: f64 = f64::from_bits(0x3dea39ef35793c76);

/// `e^x` for `x ≤ 0` (0 below −40 and for NaN), from IEEE add, subtract and multiply only, in
/// the order the CUDA kernel spells out with `__d*_rn` intrinsics: `x = k ln2 + r`, a degree-13
/// Taylor polynomial in `r` (|r| ≤ ln2/2, relative error ~1e-16), scaled by `2^k` exactly.
pub fn portable_exp(x: f64) -> f64 {
    if x.is_nan() || x <= EXP_FLOOR {
        return 0.0;
    }
    let k = (x * LOG2_E).round_ties_even();
    let r = (x - k * LN2_HI) - k * LN2_LO;
    let mut p = EXP_COEFFS[13];
    for &c in EXP_COEFFS[..13].iter().rev() {
        p = p * r + c;
    }
    // k ∈ [-58, 0]: 2^k is a normal f64 and the product only moves the exponent.
    p * f64::from_bits(((1023 + k as i64) as u64) << 52)
}

/// A log-weight's fixed-point weight: `floor(e^lw × 2^WEIGHT_BITS)`, ≤ `1 << WEIGHT_BITS`.
pub fn weight(log_weight: f64) -> u64 {
    (portable_exp(log_weight) * (1u64 << WEIGHT_BITS) as f64) as u64
}

/// `floor(a × b / 2^64)`: where a uniform 64-bit word lands in `[0, b)`.
pub fn mul_hi(a: u64, b: u64) -> u64 {
    ((u128::from(a) * u128::from(b)) >> 64) as u64
}

/// `floor(p × total / 2^32)` for a fixed-point fraction `p ≤ 2^32`.
pub fn mul_frac32(p: u64, total: u64) -> u64 {
    ((u128::from(p) * u128::from(total)) >> 32) as u64
}

/// `ln(total × 2^-WEIGHT_BITS)`: the log of a weight sum (the top token's weight is 1.0).
fn ln_total(total: u64) -> f64 {
    (total as f64 / (1u64 << WEIGHT_BITS) as f64).ln()
}

/// The order keys of sanitized finite logits: a larger logit has a larger key (`-0` was made
/// `+0` by sanitizing, so equal logits have equal keys).
pub fn order_key(logit: f32) -> u32 {
    let bits = logit.to_bits();
    if bits & 0x8000_0000 != 0 {
        !bits
    } else {
        bits | 0x8000_0000
    }
}

/// Most likely first, the lower id first among equal logits: the total order of ranking.
pub fn rank(a: &(u32, f32), b: &(u32, f32)) -> Ordering {
    b.1.total_cmp(&a.1).then(a.0.cmp(&b.0))
}

/// The draw's parameters as the row pass needs them (the GPU kernel's per-row input).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct DrawParams {
    /// `1 / temperature` in f64; 0 means greedy.
    pub inv_t: f64,
    /// 0 = off.
    pub top_k: u32,
    /// Fixed point, [`TOP_P_ONE`] = off.
    pub top_p: u64,
    /// `ln(min_p)`; `-inf` = off.
    pub min_p_ln: f64,
    /// `Some(k)`: the chosen token's log-probability and the `k` most likely are reported.
    pub logprobs: Option<u32>,
    /// The uniform 64-bit word this draw consumes (0 under greedy, which consumes none).
    pub random: u64,
}

/// Which filter decides the candidates, given how many tokens are finite.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mode {
    /// Argmax, lowest id on ties.
    Greedy,
    /// Top-k cuts first (then top-p and min-p over the k): the finish walks the rank order.
    TopK,
    /// Top-p over every finite token: the finish walks the rank order.
    Nucleus,
    /// Only temperature (and min-p): one walk over the row in id order.
    Direct,
}

impl DrawParams {
    pub fn mode(&self, finite: u32) -> Mode {
        if self.inv_t == 0.0 {
            Mode::Greedy
        } else if self.top_k > 0 && self.top_k < finite {
            Mode::TopK
        } else if self.top_p < TOP_P_ONE {
            Mode::Nucleus
        } else {
            Mode::Direct
        }
    }

    fn log_weight(&self, logit: f32, max: f32) -> f64 {
        (f64::from(logit) - f64::from(max)) * self.inv_t
    }

    /// How many of the most likely tokens the prefix must hold (ties at the last one included).
    pub fn prefix_rank(&self, mode: Mode) -> u32 {
        let k = if mode == Mode::TopK { self.top_k } else { 0 };
        k.max(self.logprobs.unwrap_or(0))
    }
}

/// Every token whose weight exceeds this is in the prefix under top-p: a nucleus token outweighs
/// `(1 − top_p) × total / n` (the tail from the cut-off on holds more than `1 − top_p` of the mass
/// over at most `n` tokens, and the cut-off token is its heaviest); half of that absorbs the
/// truncations.
pub fn nucleus_floor(top_p: u64, total: u64, finite: u32) -> u64 {
    let tail = ((u128::from(TOP_P_ONE - top_p) * u128::from(total)) >> 33) as u64;
    tail / u64::from(finite.max(1))
}

/// What a draw needs from a whole row; equal whether the host or the GPU computed it (after
/// [`RowSummary::sort_prefix`]).
#[derive(Debug, Clone, PartialEq)]
pub struct RowSummary {
    /// The top sanitized logit.
    pub max: f32,
    /// Tokens whose sanitized logit is finite.
    pub finite: u32,
    /// Greedy: the argmax; direct: the token drawn. With its shaped logit.
    pub chosen: Option<(u32, f32)>,
    /// Direct: the weight sum over the min-p survivors; nucleus: over every finite token.
    pub total: u64,
    /// With log-probabilities: the weight sum at temperature 1 over every finite token.
    pub total_unit: u64,
    /// Every finite token ranked at or above the [`DrawParams::prefix_rank`]-th, and under
    /// top-p every token above the [`nucleus_floor`]: `(id, sanitized logit)`, any order.
    pub prefix: Vec<(u32, f32)>,
}

impl RowSummary {
    /// The reference: reads a shaped row of logits.
    pub fn of(row: &[f32], draw: &DrawParams) -> Result<Self, SamplerError> {
        let mut max = f32::NEG_INFINITY;
        let mut finite = 0u32;
        for &raw in row {
            let l = sanitize(raw);
            if l > f32::NEG_INFINITY {
                finite += 1;
                max = max.max(l);
            }
        }
        if finite == 0 {
            return Err(SamplerError::NoFiniteLogit);
        }
        let finite_logits = || {
            (0u32..)
                .zip(row)
                .map(|(id, &raw)| (id, sanitize(raw)))
                .filter(|&(_, l)| l > f32::NEG_INFINITY)
        };
        let mode = draw.mode(finite);
        let mut summary = Self {
            max,
            finite,
            chosen: None,
            total: 0,
            total_unit: 0,
            prefix: Vec::new(),
        };
        match mode {
            Mode::Greedy => summary.chosen = finite_logits().find(|&(_, l)| l == max),
            Mode::Direct => {
                // Each weight once (the exponential is most of a row's cost on the host).
                let weights: Vec<(u32, f32, u64)> = finite_logits()
                    .map(|(id, l)| {
                        let lw = draw.log_weight(l, max);
                        (id, l, if lw >= draw.min_p_ln { weight(lw) } else { 0 })
                    })
                    .collect();
                summary.total = weights.iter().map(|w| w.2).sum();
                let target = mul_hi(draw.random, summary.total);
                let mut mass = 0u64;
                summary.chosen = weights
                    .iter()
                    .find(|w| {
                        mass += w.2;
                        mass > target
                    })
                    .map(|&(id, l, _)| (id, l));
            }
            Mode::Nucleus => {
                summary.total = finite_logits()
                    .map(|(_, l)| weight(draw.log_weight(l, max)))
                    .sum();
            }
            Mode::TopK => {}
        }
        if draw.logprobs.is_some() {
            summary.total_unit = finite_logits()
                .map(|(_, l)| weight(f64::from(l) - f64::from(max)))
                .sum();
        }
        let k = draw.prefix_rank(mode);
        let threshold = (k > 0).then(|| {
            let mut keys: Vec<u32> = finite_logits().map(|(_, l)| order_key(l)).collect();
            let k = (k as usize).min(keys.len());
            *keys.select_nth_unstable_by(k - 1, |a, b| b.cmp(a)).1
        });
        let floor =
            (mode == Mode::Nucleus).then(|| nucleus_floor(draw.top_p, summary.total, finite));
        summary.prefix = finite_logits()
            .filter(|&(_, l)| {
                threshold.is_some_and(|t| order_key(l) >= t)
                    || floor.is_some_and(|f| weight(draw.log_weight(l, max)) > f)
            })
            .collect();
        Ok(summary)
    }

    /// Puts the prefix in rank order (the order the finish walks, and a canonical form for
    /// comparing summaries).
    pub fn sort_prefix(&mut self) {
        self.prefix.sort_unstable_by(rank);
    }

    /// The rest of the draw, from the summary alone: the token, its log-probability under the
    /// distribution it was drawn from (`None` under greedy), and the reported log-probabilities.
    pub fn finish(mut self, draw: &DrawParams) -> Result<Finished, SamplerError> {
        self.sort_prefix();
        let max = self.max;
        let mode = draw.mode(self.finite);
        let (token, logit, logprob) = match mode {
            Mode::Greedy => {
                let (token, logit) = self.chosen.ok_or(SamplerError::NoFiniteLogit)?;
                (token, logit, None)
            }
            Mode::Direct => {
                let (token, logit) = self.chosen.ok_or(SamplerError::NoFiniteLogit)?;
                let logprob = draw.log_weight(logit, max) - ln_total(self.total);
                (token, logit, Some(logprob))
            }
            Mode::TopK | Mode::Nucleus => {
                let mut candidates: Vec<(u32, f32, u64)> = self
                    .prefix
                    .iter()
                    .map(|&(id, l)| (id, l, weight(draw.log_weight(l, max))))
                    .collect();
                let mut total = self.total;
                if mode == Mode::TopK {
                    if candidates.len() < draw.top_k as usize {
                        return Err(SamplerError::IncompleteSummary("top-k"));
                    }
                    candidates.truncate(draw.top_k as usize);
                    total = candidates.iter().map(|c| c.2).sum();
                }
                if draw.top_p < TOP_P_ONE {
                    let target = mul_frac32(draw.top_p, total);
                    let mut mass = 0u64;
                    let keep = candidates.iter().position(|c| {
                        mass += c.2;
                        mass >= target
                    });
                    // The whole row sums to `total >= target`, so only a prefix that stops
                    // short of the nucleus can fail to reach it.
                    let keep = keep.ok_or(SamplerError::IncompleteSummary("top-p"))?;
                    candidates.truncate(keep + 1);
                }
                // p / p_max >= min_p  <=>  log-weight >= ln(min_p); the top token (0) stays.
                candidates.retain(|c| draw.log_weight(c.1, max) >= draw.min_p_ln);
                let total: u64 = candidates.iter().map(|c| c.2).sum();
                let target = mul_hi(draw.random, total);
                let mut mass = 0u64;
                let &(token, logit, _) = candidates
                    .iter()
                    .find(|c| {
                        mass += c.2;
                        mass > target
                    })
                    .ok_or(SamplerError::NoFiniteLogit)?;
                let logprob = draw.log_weight(logit, max) - ln_total(total);
                (token, logit, Some(logprob))
            }
        };
        let logprobs = match draw.logprobs {
            None => None,
            Some(k) => {
                let ln_unit = ln_total(self.total_unit);
                let logprob = |l: f32| (f64::from(l) - f64::from(max) - ln_unit) as f32;
                if self.prefix.len() < (k as usize).min(self.finite as usize) {
                    return Err(SamplerError::IncompleteSummary("top log-probabilities"));
                }
                Some(strata_protocol::TokenLogprobs {
                    logprob: logprob(logit),
                    top: self
                        .prefix
                        .iter()
                        .take(k as usize)
                        .map(|&(id, l)| (id, logprob(l)))
                        .collect(),
                })
            }
        };
        Ok(Finished {
            token,
            logprob: logprob.map(|l| l as f32),
            logprobs,
        })
    }
}

/// What [`RowSummary::finish`] decides.
#[derive(Debug, Clone, PartialEq)]
pub struct Finished {
    pub token: u32,
    pub logprob: Option<f32>,
    pub logprobs: Option<strata_protocol::TokenLogprobs>,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn portable_exp_is_exp() {
        assert_eq!(portable_exp(0.0), 1.0);
        assert_eq!(portable_exp(-40.0), 0.0);
        assert_eq!(portable_exp(f64::NAN), 0.0);
        let mut x = -39.99;
        while x < 0.0 {
            let (got, want) = (portable_exp(x), x.exp());
            assert!(((got - want) / want).abs() < 4e-16, "{x}: {got} vs {want}");
            assert!(got <= 1.0);
            x += 0.01234;
        }
        assert_eq!(weight(0.0), 1 << WEIGHT_BITS);
        assert_eq!(weight(-28.0), 0); // e^-28 < 2^-40
        assert!(weight(-27.0) > 0);
    }

    #[test]
    fn order_keys_follow_the_logits() {
        let values = [f32::MIN, -3.5, -1e-30, 0.0, 1e-30, 2.0, f32::MAX];
        for pair in values.windows(2) {
            assert!(order_key(pair[0]) < order_key(pair[1]), "{pair:?}");
        }
    }

    #[test]
    fn integer_helpers() {
        assert_eq!(mul_hi(u64::MAX, 10), 9);
        assert_eq!(mul_hi(0, 10), 0);
        assert_eq!(mul_frac32(TOP_P_ONE, 12345), 12345);
        assert_eq!(mul_frac32(TOP_P_ONE / 2, 1000), 500);
        assert_eq!(nucleus_floor(TOP_P_ONE, 1 << 40, 3), 0);
        assert_eq!(nucleus_floor(0, 4 << 40, 2), 1 << 40);
    }
}
