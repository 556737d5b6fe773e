//! The synthetic workload: prompts as token-id arrays and the open-loop arrival schedule.
//!
//! Prompts are token ids, not text, so input lengths are exact without the model's tokenizer.
//! Ids are drawn in `[FIRST_TOKEN, vocab_size)`: the low ids are where tokenizers keep special
//! tokens. Every draw comes from a ChaCha8 stream keyed by (seed, purpose, index), so a run is
//! reproducible from its seed, and request `i` is the same prompt whatever came before it unless
//! it had to be redrawn. Every prompt is distinct from every other of the run except for a shared
//! prefix by design: a server's prefix cache would otherwise turn a repeated prompt into a cache
//! hit and flatter its TTFT; a prompt that repeats an earlier one is drawn again from its stream.

use std::collections::HashSet;
use std::fmt;
use std::hash::{DefaultHasher, Hash, Hasher};
use std::str::FromStr;
use std::time::Duration;

use rand_chacha::ChaCha8Rng;
use rand_core::{Rng, SeedableRng};

/// The lowest token id a prompt uses.
pub const FIRST_TOKEN: u32 = 10;

/// Redraws allowed for one prompt that repeats an earlier one before giving up.
const DISTINCT_TRIES: u32 = 64;

#[derive(Debug, thiserror::Error, PartialEq)]
pub enum WorkloadError {
    #[error("--range-ratio must be in [0, 1); got {0}")]
    RangeRatio(f64),
    #[error("--vocab-size must be above {FIRST_TOKEN}; got {0}")]
    VocabSize(u32),
    #[error("--input-len and --output-len must be at least 1")]
    ZeroLength,
    #[error("--prefix-groups must be at least 1")]
    ZeroGroups,
    #[error(
        "request {0}: no prompt distinct from the earlier ones after {DISTINCT_TRIES} draws; \
         raise --input-len or --vocab-size"
    )]
    NotDistinct(u64),
}

/// The shape of the prompts (the `--input-len`, `--output-len`, ... flags).
#[derive(Clone, Debug)]
pub struct WorkloadSpec {
    pub input_len: u32,
    pub output_len: u32,
    pub range_ratio: f64,
    pub prefix_len: u32,
    pub prefix_groups: u32,
    pub vocab_size: u32,
    pub seed: u64,
}

/// One request's prompt and the number of tokens it asks for.
#[derive(Clone, Debug, PartialEq)]
pub struct Prompt {
    pub tokens: Vec<u32>,
    pub output_len: u32,
}

/// What each ChaCha stream is for: distinct streams never share draws.
#[derive(Clone, Copy)]
enum Purpose {
    Prompt = 1,
    Prefix = 2,
    Arrivals = 3,
}

fn rng(seed: u64, purpose: Purpose, index: u64) -> ChaCha8Rng {
    let mut key = [0u8; 32];
    key[..8].copy_from_slice(&seed.to_le_bytes());
    key[8] = purpose as u8;
    key[16..24].copy_from_slice(&index.to_le_bytes());
    ChaCha8Rng::from_seed(key)
}

/// Uniform in `[lo, hi]`; the modulo bias is below 2^-32 for any span a flag can give.
fn uniform(rng: &mut ChaCha8Rng, lo: u32, hi: u32) -> u32 {
    let span = u64::from(hi - lo) + 1;
    lo + (rng.next_u64() % span) as u32
}

/// Uniform in `[0, 1)` from the top 53 bits.
fn unit(rng: &mut ChaCha8Rng) -> f64 {
    (rng.next_u64() >> 11) as f64 / (1u64 << 53) as f64
}

/// Generates the prompts of a run, remembering what it gave out to keep them distinct.
pub struct Workload {
    spec: WorkloadSpec,
    prefixes: Vec<Vec<u32>>,
    /// Hashes of the per-request parts given out; a hash collision only costs a redraw.
    seen: HashSet<u64>,
}

impl Workload {
    pub fn new(spec: WorkloadSpec) -> Result<Self, WorkloadError> {
        if !(0.0..1.0).contains(&spec.range_ratio) {
            return Err(WorkloadError::RangeRatio(spec.range_ratio));
        }
        if spec.vocab_size <= FIRST_TOKEN {
            return Err(WorkloadError::VocabSize(spec.vocab_size));
        }
        if spec.input_len == 0 || spec.output_len == 0 {
            return Err(WorkloadError::ZeroLength);
        }
        if spec.prefix_groups == 0 {
            return Err(WorkloadError::ZeroGroups);
        }
        let prefixes = (0..spec.prefix_groups)
            .map(|g| {
                let mut rng = rng(spec.seed, Purpose::Prefix, u64::from(g));
                draw_tokens(&mut rng, spec.prefix_len, spec.vocab_size)
            })
            .collect();
        Ok(Self {
            spec,
            prefixes,
            seen: HashSet::new(),
        })
    }

    /// The range lengths are drawn from: `[len * (1 - r), len * (1 + r)]`, at least 1.
    fn length_range(&self, len: u32) -> (u32, u32) {
        let r = self.spec.range_ratio;
        let lo = (f64::from(len) * (1.0 - r)).floor().max(1.0) as u32;
        let hi = (f64::from(len) * (1.0 + r)).floor() as u32;
        (lo, hi.max(lo))
    }

    /// Request `index`'s prompt: prefix group `index % groups`, then its own tokens.
    pub fn prompt(&mut self, index: u64) -> Result<Prompt, WorkloadError> {
        let mut rng = rng(self.spec.seed, Purpose::Prompt, index);
        let (in_lo, in_hi) = self.length_range(self.spec.input_len);
        let (out_lo, out_hi) = self.length_range(self.spec.output_len);
        let input_len = uniform(&mut rng, in_lo, in_hi);
        let output_len = uniform(&mut rng, out_lo, out_hi);
        for _ in 0..DISTINCT_TRIES {
            let own = draw_tokens(&mut rng, input_len, self.spec.vocab_size);
            let mut hasher = DefaultHasher::new();
            own.hash(&mut hasher);
            if self.seen.insert(hasher.finish()) {
                let group = (index % u64::from(self.spec.prefix_groups)) as usize;
                let mut tokens = Vec::with_capacity(self.prefixes[group].len() + own.len());
                tokens.extend_from_slice(&self.prefixes[group]);
                tokens.extend_from_slice(&own);
                return Ok(Prompt { tokens, output_len });
            }
        }
        Err(WorkloadError::NotDistinct(index))
    }
}

fn draw_tokens(rng: &mut ChaCha8Rng, len: u32, vocab_size: u32) -> Vec<u32> {
    (0..len)
        .map(|_| uniform(rng, FIRST_TOKEN, vocab_size - 1))
        .collect()
}

/// An open-loop arrival rate: requests per second, or all at once.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum RequestRate {
    PerSecond(f64),
    Unlimited,
}

impl FromStr for RequestRate {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        if s.trim().eq_ignore_ascii_case("inf") {
            return Ok(Self::Unlimited);
        }
        match s.trim().parse::<f64>() {
            Ok(r) if r.is_finite() && r > 0.0 => Ok(Self::PerSecond(r)),
            _ => Err(format!(
                "a request rate is a positive number of requests per second, or `inf`; got `{s}`"
            )),
        }
    }
}

impl fmt::Display for RequestRate {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::PerSecond(r) => write!(f, "{r}"),
            Self::Unlimited => f.write_str("inf"),
        }
    }
}

/// When each of `n` requests is sent, from the start of the point: a Poisson process (exponential
/// gaps of mean 1/rate, the first request at 0), or all at 0 for `Unlimited`. Seeded by
/// (seed, point) so each point of a sweep has its own reproducible schedule.
pub fn arrival_offsets(rate: RequestRate, n: usize, seed: u64, point: u64) -> Vec<Duration> {
    let RequestRate::PerSecond(rate) = rate else {
        return vec![Duration::ZERO; n];
    };
    let mut rng = rng(seed, Purpose::Arrivals, point);
    let mut at = 0.0f64;
    (0..n)
        .map(|i| {
            if i > 0 {
                at += -(1.0 - unit(&mut rng)).ln() / rate;
            }
            Duration::from_secs_f64(at)
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec() -> WorkloadSpec {
        WorkloadSpec {
            input_len: 100,
            output_len: 20,
            range_ratio: 0.25,
            prefix_len: 0,
            prefix_groups: 1,
            vocab_size: 300,
            seed: 7,
        }
    }

    fn prompts(spec: WorkloadSpec, n: u64) -> Vec<Prompt> {
        let mut w = Workload::new(spec).unwrap();
        (0..n).map(|i| w.prompt(i).unwrap()).collect()
    }

    #[test]
    fn lengths_and_ids_stay_in_range_and_spread_over_it() {
        let all = prompts(spec(), 400);
        let inputs: Vec<usize> = all.iter().map(|p| p.tokens.len()).collect();
        let outputs: Vec<u32> = all.iter().map(|p| p.output_len).collect();
        assert!(inputs.iter().all(|&l| (75..=125).contains(&l)));
        assert!(outputs.iter().all(|&l| (15..=25).contains(&l)));
        // The range is used, not just its middle.
        assert!(inputs.iter().any(|&l| l < 85) && inputs.iter().any(|&l| l > 115));
        let ids = all.iter().flat_map(|p| p.tokens.iter().copied());
        assert!(ids.clone().all(|t| (FIRST_TOKEN..300).contains(&t)));
        assert_eq!(ids.clone().min(), Some(FIRST_TOKEN));
        assert_eq!(ids.max(), Some(299));
    }

    #[test]
    fn ratio_zero_gives_exact_lengths() {
        let all = prompts(
            WorkloadSpec {
                range_ratio: 0.0,
                ..spec()
            },
            50,
        );
        assert!(
            all.iter()
                .all(|p| p.tokens.len() == 100 && p.output_len == 20)
        );
    }

    #[test]
    fn prompts_are_distinct_and_reproducible_from_the_seed() {
        let a = prompts(spec(), 200);
        let distinct: HashSet<&Vec<u32>> = a.iter().map(|p| &p.tokens).collect();
        assert_eq!(distinct.len(), a.len());
        assert_eq!(a, prompts(spec(), 200));
        let other = prompts(WorkloadSpec { seed: 8, ..spec() }, 200);
        assert_ne!(a, other);
        // Request i is the same prompt whether or not earlier ones were drawn.
        let mut w = Workload::new(spec()).unwrap();
        assert_eq!(w.prompt(150).unwrap(), a[150]);
    }

    #[test]
    fn a_tiny_space_refuses_rather_than_repeating() {
        let tiny = WorkloadSpec {
            input_len: 1,
            range_ratio: 0.0,
            vocab_size: 12,
            ..spec()
        };
        let mut w = Workload::new(tiny).unwrap();
        let results: Vec<_> = (0..3).map(|i| w.prompt(i)).collect();
        assert!(results[..2].iter().all(Result::is_ok));
        assert_eq!(results[2], Err(WorkloadError::NotDistinct(2)));
    }

    #[test]
    fn shared_prefixes_are_identical_within_a_group_and_differ_across_groups() {
        let shared = WorkloadSpec {
            prefix_len: 32,
            prefix_groups: 3,
            input_len: 8,
            range_ratio: 0.0,
            ..spec()
        };
        let all = prompts(shared, 12);
        for (i, p) in all.iter().enumerate() {
            assert_eq!(p.tokens.len(), 40);
            let same_group = &all[i % 3];
            assert_eq!(p.tokens[..32], same_group.tokens[..32]);
        }
        assert_ne!(all[0].tokens[..32], all[1].tokens[..32]);
        assert_ne!(all[1].tokens[..32], all[2].tokens[..32]);
        let suffixes: HashSet<&[u32]> = all.iter().map(|p| &p.tokens[32..]).collect();
        assert_eq!(suffixes.len(), 12);
    }

    #[test]
    fn bad_specs_are_refused() {
        let bad = |s: WorkloadSpec| Workload::new(s).err();
        assert_eq!(
            bad(WorkloadSpec {
                range_ratio: 1.0,
                ..spec()
            }),
            Some(WorkloadError::RangeRatio(1.0))
        );
        assert_eq!(
            bad(WorkloadSpec {
                vocab_size: 10,
                ..spec()
            }),
            Some(WorkloadError::VocabSize(10))
        );
        assert_eq!(
            bad(WorkloadSpec {
                output_len: 0,
                ..spec()
            }),
            Some(WorkloadError::ZeroLength)
        );
    }

    #[test]
    fn poisson_arrivals_have_the_asked_mean_rate_and_are_seeded() {
        let n = 4000;
        let offsets = arrival_offsets(RequestRate::PerSecond(50.0), n, 0, 0);
        assert_eq!(offsets[0], Duration::ZERO);
        assert!(offsets.windows(2).all(|w| w[0] <= w[1]));
        let rate = (n - 1) as f64 / offsets[n - 1].as_secs_f64();
        assert!((45.0..55.0).contains(&rate), "rate {rate}");
        assert_eq!(
            offsets,
            arrival_offsets(RequestRate::PerSecond(50.0), n, 0, 0)
        );
        assert_ne!(
            offsets,
            arrival_offsets(RequestRate::PerSecond(50.0), n, 0, 1)
        );
        let burst = arrival_offsets(RequestRate::Unlimited, 5, 0, 0);
        assert_eq!(burst, vec![Duration::ZERO; 5]);
    }

    #[test]
    fn rates_parse_with_inf_and_refuse_nonsense() {
        assert_eq!("inf".parse(), Ok(RequestRate::Unlimited));
        assert_eq!("2.5".parse(), Ok(RequestRate::PerSecond(2.5)));
        assert!("0".parse::<RequestRate>().is_err());
        assert!("-1".parse::<RequestRate>().is_err());
        assert!("fast".parse::<RequestRate>().is_err());
    }
}
