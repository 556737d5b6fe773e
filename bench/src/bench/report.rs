//! A sweep point's numbers, from its requests' outcomes.
//!
//! Percentiles interpolate linearly between the two nearest ranks of the sorted sample (numpy's
//! default, which vLLM's benchmark reports), so p50 of an even count is the mean of the middle
//! two. ITL pools the gaps of every request of the point; TPOT is one value per request of more
//! than one token, `(e2e - ttft) / (completion_tokens - 1)`. Failed requests count in the
//! duration (first send to last finish) but in no latency or token figure.

use std::collections::HashMap;
use std::time::Duration;

use serde::Serialize;

use super::client::RequestOutcome;
use super::load::Load;
use super::workload::RequestRate;

/// Distinct error messages kept per point; the rest are only in `failed`.
const ERRORS_KEPT: usize = 5;

/// The `p`-th percentile (0..=100) of an ascending sample, linearly interpolated.
pub fn percentile(sorted: &[f64], p: f64) -> Option<f64> {
    let last = sorted.len().checked_sub(1)?;
    let rank = (p / 100.0).clamp(0.0, 1.0) * last as f64;
    let (lo, hi) = (rank.floor() as usize, rank.ceil() as usize);
    Some(sorted[lo] + (sorted[hi] - sorted[lo]) * (rank - lo as f64))
}

/// Mean and percentiles of a latency, in milliseconds.
#[derive(Clone, Copy, Debug, PartialEq, Serialize)]
pub struct Summary {
    pub mean: f64,
    pub p50: f64,
    pub p90: f64,
    pub p99: f64,
}

impl Summary {
    /// `None` for an empty sample.
    pub fn of(durations: impl IntoIterator<Item = Duration>) -> Option<Self> {
        let mut ms: Vec<f64> = durations
            .into_iter()
            .map(|d| d.as_secs_f64() * 1e3)
            .collect();
        ms.sort_by(f64::total_cmp);
        let mean = ms.iter().sum::<f64>() / ms.len() as f64;
        Some(Self {
            mean,
            p50: percentile(&ms, 50.0)?,
            p90: percentile(&ms, 90.0)?,
            p99: percentile(&ms, 99.0)?,
        })
    }
}

#[derive(Clone, Debug, Serialize)]
pub struct ErrorCount {
    pub message: String,
    pub count: u64,
}

/// One point of the sweep, as printed and written to the JSON report.
#[derive(Clone, Debug, Serialize)]
pub struct PointReport {
    #[serde(skip)]
    pub load: Load,
    /// Closed-loop workers, or null for a rate point.
    pub concurrency: Option<u32>,
    /// Requests per second (a number, or "inf"), or null for a concurrency point.
    pub request_rate: Option<serde_json::Value>,
    pub num_prompts: usize,
    pub duration_s: f64,
    pub completed: u64,
    pub failed: u64,
    pub input_tokens: u64,
    pub output_tokens: u64,
    pub output_tok_s: f64,
    pub request_s: f64,
    pub ttft_ms: Option<Summary>,
    pub itl_ms: Option<Summary>,
    pub tpot_ms: Option<Summary>,
    pub e2e_ms: Option<Summary>,
    /// The most frequent distinct error messages, most frequent first.
    pub errors: Vec<ErrorCount>,
    /// The server's speculative decoding during the point (from its /metrics), where it
    /// speculated.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub spec_decode: Option<SpecDecode>,
}

/// Speculative decoding's counters over one point: the change of the server's
/// `strata_spec_decode_*` totals (summed over nodes) from before the point to after it.
#[derive(Debug, Clone, Copy, Default, PartialEq, serde::Serialize)]
pub struct SpecDecode {
    pub drafts: f64,
    pub draft_tokens: f64,
    pub accepted_tokens: f64,
    /// accepted ÷ proposed.
    pub acceptance_rate: f64,
    /// Tokens per verification, the corrected or bonus token included.
    pub mean_accepted_len: f64,
}

impl SpecDecode {
    /// The three counter totals of a /metrics text, summed over their samples.
    pub fn totals(metrics: &str) -> [f64; 3] {
        let sum = |name: &str| -> f64 {
            metrics
                .lines()
                .filter(|l| {
                    l.strip_prefix(name)
                        .is_some_and(|rest| rest.starts_with('{') || rest.starts_with(' '))
                })
                .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
                .sum()
        };
        [
            sum("strata_spec_decode_num_drafts_total"),
            sum("strata_spec_decode_num_draft_tokens_total"),
            sum("strata_spec_decode_num_accepted_tokens_total"),
        ]
    }

    /// The point's counters from the totals before and after it; `None` when nothing was
    /// proposed.
    pub fn between(before: [f64; 3], after: [f64; 3]) -> Option<Self> {
        let [drafts, draft_tokens, accepted_tokens] =
            [0, 1, 2].map(|i| (after[i] - before[i]).max(0.0));
        (drafts > 0.0).then(|| Self {
            drafts,
            draft_tokens,
            accepted_tokens,
            acceptance_rate: accepted_tokens / draft_tokens.max(1.0),
            mean_accepted_len: 1.0 + accepted_tokens / drafts,
        })
    }
}

impl PointReport {
    pub fn new(load: Load, outcomes: &[RequestOutcome]) -> Self {
        let first_send = outcomes.iter().map(|o| o.sent).min();
        let last_finish = outcomes.iter().map(|o| o.finished).max();
        let duration = match (first_send, last_finish) {
            (Some(a), Some(b)) => b.saturating_duration_since(a),
            _ => Duration::ZERO,
        };
        let done: Vec<_> = outcomes
            .iter()
            .filter_map(|o| o.result.as_ref().ok())
            .collect();
        let output_tokens: u64 = done.iter().map(|c| c.completion_tokens).sum();
        let per_second = |count: u64| {
            let s = duration.as_secs_f64();
            if s > 0.0 { count as f64 / s } else { 0.0 }
        };
        let (concurrency, request_rate) = match load {
            Load::Concurrency(c) => (Some(c), None),
            Load::Rate(RequestRate::PerSecond(r)) => (None, Some(r.into())),
            Load::Rate(RequestRate::Unlimited) => (None, Some("inf".into())),
        };
        Self {
            load,
            concurrency,
            request_rate,
            num_prompts: outcomes.len(),
            duration_s: duration.as_secs_f64(),
            completed: done.len() as u64,
            failed: (outcomes.len() - done.len()) as u64,
            input_tokens: done.iter().map(|c| c.prompt_tokens).sum(),
            output_tokens,
            output_tok_s: per_second(output_tokens),
            request_s: per_second(done.len() as u64),
            ttft_ms: Summary::of(done.iter().filter_map(|c| c.ttft)),
            itl_ms: Summary::of(done.iter().flat_map(|c| c.itls.iter().copied())),
            tpot_ms: Summary::of(done.iter().filter_map(|c| c.tpot())),
            e2e_ms: Summary::of(done.iter().map(|c| c.e2e)),
            errors: error_counts(outcomes),
            spec_decode: None,
        }
    }

    /// Every request of the point failed.
    pub fn all_failed(&self) -> bool {
        self.completed == 0
    }
}

fn error_counts(outcomes: &[RequestOutcome]) -> Vec<ErrorCount> {
    let mut counts: HashMap<String, u64> = HashMap::new();
    for error in outcomes.iter().filter_map(|o| o.result.as_ref().err()) {
        *counts.entry(error.to_string()).or_default() += 1;
    }
    let mut errors: Vec<ErrorCount> = counts
        .into_iter()
        .map(|(message, count)| ErrorCount { message, count })
        .collect();
    errors.sort_by(|a, b| {
        b.count
            .cmp(&a.count)
            .then_with(|| a.message.cmp(&b.message))
    });
    errors.truncate(ERRORS_KEPT);
    errors
}

#[cfg(test)]
mod tests {
    use std::time::Instant;

    use super::super::client::RequestError;
    use super::super::stream::{Completion, StreamError};
    use super::*;

    const MS: Duration = Duration::from_millis(1);

    #[test]
    fn percentiles_interpolate_between_ranks() {
        let s = [1.0, 2.0, 3.0, 4.0];
        assert_eq!(percentile(&s, 0.0), Some(1.0));
        assert_eq!(percentile(&s, 50.0), Some(2.5));
        assert_eq!(percentile(&s, 100.0), Some(4.0));
        assert!((percentile(&s, 90.0).unwrap() - 3.7).abs() < 1e-12);
        assert_eq!(percentile(&[5.0], 99.0), Some(5.0));
        assert_eq!(percentile(&[], 50.0), None);
        let hundred: Vec<f64> = (1..=100).map(f64::from).collect();
        assert!((percentile(&hundred, 99.0).unwrap() - 99.01).abs() < 1e-9);
    }

    #[test]
    fn summaries_are_ordered_and_in_milliseconds() {
        let s = Summary::of([30 * MS, 10 * MS, 20 * MS]).unwrap();
        assert_eq!((s.mean, s.p50), (20.0, 20.0));
        assert!(s.p50 <= s.p90 && s.p90 <= s.p99 && s.p99 <= 30.0);
        assert_eq!(Summary::of([]), None);
    }

    fn ok(sent: Instant, ttft_ms: u32, e2e_ms: u32, tokens: u64) -> RequestOutcome {
        let completion = Completion {
            ttft: Some(ttft_ms * MS),
            e2e: e2e_ms * MS,
            itls: vec![MS; tokens.saturating_sub(1) as usize],
            prompt_tokens: 16,
            completion_tokens: tokens,
        };
        RequestOutcome {
            sent,
            finished: sent + e2e_ms * MS,
            result: Ok(completion),
        }
    }

    #[test]
    fn a_point_counts_tokens_rates_and_errors() {
        let t0 = Instant::now();
        let failed = |at: Instant| RequestOutcome {
            sent: at,
            finished: at + 5 * MS,
            result: Err(RequestError::Stream(StreamError::NoDone)),
        };
        let outcomes = [
            ok(t0, 10, 100, 10),
            ok(t0 + 100 * MS, 20, 400, 4),
            failed(t0 + 200 * MS),
            failed(t0 + 300 * MS),
        ];
        let r = PointReport::new(Load::Concurrency(2), &outcomes);
        assert_eq!((r.completed, r.failed, r.num_prompts), (2, 2, 4));
        assert_eq!((r.input_tokens, r.output_tokens), (32, 14));
        assert!((r.duration_s - 0.5).abs() < 1e-9);
        assert!((r.output_tok_s - 28.0).abs() < 1e-6);
        assert!((r.request_s - 4.0).abs() < 1e-6);
        assert_eq!(r.ttft_ms.unwrap().p50, 15.0);
        // TPOT: (100 - 10) / 9 = 10 ms and (400 - 20) / 3 ms.
        let tpot = r.tpot_ms.unwrap().mean;
        assert!((tpot - (10.0 + 380.0 / 3.0) / 2.0).abs() < 1e-5, "{tpot}");
        assert_eq!(r.itl_ms.unwrap().p99, 1.0);
        assert_eq!(r.errors.len(), 1);
        assert_eq!(r.errors[0].count, 2);
        assert!(!r.all_failed());
        let json = serde_json::to_value(&r).unwrap();
        assert_eq!(json["concurrency"], 2);
        assert!(json["request_rate"].is_null());
    }

    #[test]
    fn a_point_where_everything_failed_has_no_latencies() {
        let t0 = Instant::now();
        let outcomes = [RequestOutcome {
            sent: t0,
            finished: t0 + MS,
            result: Err(RequestError::Status {
                status: 404,
                body: "no such model".into(),
            }),
        }];
        let r = PointReport::new(Load::Rate(RequestRate::Unlimited), &outcomes);
        assert!(r.all_failed());
        assert!(r.ttft_ms.is_none() && r.itl_ms.is_none());
        assert_eq!(r.errors[0].message, "HTTP 404: no such model");
        let json = serde_json::to_value(&r).unwrap();
        assert_eq!(json["request_rate"], "inf");
        assert!(json["ttft_ms"].is_null());
    }
}

#[cfg(test)]
mod spec_decode_tests {
    use super::SpecDecode;

    #[test]
    fn spec_counters_are_summed_over_nodes_and_taken_between_points() {
        let before = "# TYPE strata_spec_decode_num_drafts_total counter\n\
            strata_spec_decode_num_drafts_total{model_name=\"m\",node=\"a\"} 10\n\
            strata_spec_decode_num_drafts_total{model_name=\"m\",node=\"b\"} 5\n\
            strata_spec_decode_num_draft_tokens_total{model_name=\"m\"} 40\n\
            strata_spec_decode_num_accepted_tokens_total{model_name=\"m\"} 20\n\
            strata_spec_decode_num_drafts_totalx 99\n";
        assert_eq!(SpecDecode::totals(before), [15.0, 40.0, 20.0]);
        let after = "strata_spec_decode_num_drafts_total 25\n\
            strata_spec_decode_num_draft_tokens_total 80\n\
            strata_spec_decode_num_accepted_tokens_total 50\n";
        let s = SpecDecode::between(SpecDecode::totals(before), SpecDecode::totals(after)).unwrap();
        assert_eq!(
            (s.drafts, s.draft_tokens, s.accepted_tokens),
            (10.0, 40.0, 30.0)
        );
        assert_eq!(s.acceptance_rate, 0.75);
        assert_eq!(s.mean_accepted_len, 4.0);
        assert!(SpecDecode::between([1.0, 2.0, 3.0], [1.0, 2.0, 3.0]).is_none());
        assert_eq!(SpecDecode::totals("strata_other 3\n"), [0.0; 3]);
    }
}
