//! The router's latency and length histograms, and the token-rate gauge: what the request path
//! updates per token, so atomics only and no allocation (prometheus-client's own histogram takes a
//! lock per observation). They are exposed through the library's encoder like its own metrics.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use prometheus_client::encoding::{EncodeMetric, MetricEncoder, NoLabelSet};
use prometheus_client::metrics::MetricType;

/// A Prometheus histogram over fixed bucket bounds; clones share the counts.
#[derive(Clone, Debug)]
pub struct Histogram(Arc<Buckets>);

#[derive(Debug)]
struct Buckets {
    bounds: &'static [f64],
    /// Non-cumulative counts per bucket; the last is +Inf.
    counts: Box<[AtomicU64]>,
    sum_micros: AtomicU64,
    count: AtomicU64,
}

impl Histogram {
    pub fn new(bounds: &'static [f64]) -> Self {
        Self(Arc::new(Buckets {
            bounds,
            counts: (0..=bounds.len()).map(|_| AtomicU64::new(0)).collect(),
            sum_micros: AtomicU64::new(0),
            count: AtomicU64::new(0),
        }))
    }

    pub fn observe(&self, elapsed: Duration) {
        self.observe_value(elapsed.as_secs_f64());
    }

    /// One observation of `value` (seconds, or tokens); the sum is kept in millionths.
    pub fn observe_value(&self, value: f64) {
        let b = &self.0;
        let bucket = b
            .bounds
            .iter()
            .position(|&bound| value <= bound)
            .unwrap_or(b.bounds.len());
        b.counts[bucket].fetch_add(1, Ordering::Relaxed);
        b.sum_micros
            .fetch_add((value * 1e6) as u64, Ordering::Relaxed);
        b.count.fetch_add(1, Ordering::Relaxed);
    }

    pub fn count(&self) -> u64 {
        self.0.count.load(Ordering::Relaxed)
    }

    /// The `q` quantile as Prometheus' `histogram_quantile` estimates it: linear inside the
    /// bucket it falls in (the last finite bound when it falls in +Inf); `None` before any
    /// observation.
    pub fn quantile(&self, q: f64) -> Option<f64> {
        let bounds = self.0.bounds;
        let counts: Vec<u64> = self
            .0
            .counts
            .iter()
            .map(|b| b.load(Ordering::Relaxed))
            .collect();
        let total: u64 = counts.iter().sum();
        if total == 0 {
            return None;
        }
        let rank = q * total as f64;
        let mut below = 0u64;
        for (i, &n) in counts.iter().enumerate() {
            if (below + n) as f64 >= rank && n > 0 {
                let Some(&upper) = bounds.get(i) else {
                    return bounds.last().copied();
                };
                let lower = if i == 0 { 0.0 } else { bounds[i - 1] };
                return Some(lower + (upper - lower) * (rank - below as f64) / n as f64);
            }
            below += n;
        }
        bounds.last().copied()
    }
}

impl EncodeMetric for Histogram {
    fn encode(&self, mut encoder: MetricEncoder) -> Result<(), std::fmt::Error> {
        let b = &self.0;
        let buckets: Vec<(f64, u64)> = b
            .counts
            .iter()
            .enumerate()
            .map(|(i, n)| {
                let bound = b.bounds.get(i).copied().unwrap_or(f64::INFINITY);
                (bound, n.load(Ordering::Relaxed))
            })
            .collect();
        let sum = b.sum_micros.load(Ordering::Relaxed) as f64 / 1e6;
        encoder.encode_histogram::<NoLabelSet>(sum, self.count(), &buckets, None)
    }

    fn metric_type(&self) -> MetricType {
        MetricType::Histogram
    }
}

/// Seconds the tokens-per-second gauge averages over.
pub const RATE_WINDOW_SECS: usize = 10;

/// Tokens per second over the last [`RATE_WINDOW_SECS`] whole seconds: one slot per second of
/// a ring, each stamped with the second it counts. A slot reused for a new second is reset by
/// whoever stamps it first; a token counted by a racing thread in that instant may be lost,
/// which a gauge can afford.
pub struct TokenRate {
    start: Instant,
    seconds: [AtomicU64; RATE_WINDOW_SECS],
    counts: [AtomicU64; RATE_WINDOW_SECS],
}

impl TokenRate {
    pub fn new() -> Self {
        Self {
            start: Instant::now(),
            // Stamp u64::MAX: no slot holds a second yet.
            seconds: std::array::from_fn(|_| AtomicU64::new(u64::MAX)),
            counts: std::array::from_fn(|_| AtomicU64::new(0)),
        }
    }

    /// One token now.
    pub fn add(&self) {
        self.add_at(self.now(), 1);
    }

    /// The mean over the last whole seconds.
    pub fn per_second(&self) -> f64 {
        self.per_second_at(self.now())
    }

    fn now(&self) -> u64 {
        self.start.elapsed().as_secs()
    }

    fn add_at(&self, second: u64, tokens: u64) {
        let slot = (second % RATE_WINDOW_SECS as u64) as usize;
        let stamped = self.seconds[slot].load(Ordering::Acquire);
        if stamped != second
            && self.seconds[slot]
                .compare_exchange(stamped, second, Ordering::AcqRel, Ordering::Acquire)
                .is_ok()
        {
            self.counts[slot].store(0, Ordering::Release);
        }
        self.counts[slot].fetch_add(tokens, Ordering::AcqRel);
    }

    /// The mean over the whole seconds before `now` (the current one is still filling).
    fn per_second_at(&self, now: u64) -> f64 {
        let window = RATE_WINDOW_SECS as u64;
        let oldest = now.saturating_sub(window);
        let total: u64 = (0..RATE_WINDOW_SECS)
            .filter(|&slot| {
                let second = self.seconds[slot].load(Ordering::Acquire);
                second >= oldest && second < now
            })
            .map(|slot| self.counts[slot].load(Ordering::Acquire))
            .sum();
        total as f64 / window as f64
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn quantiles_interpolate_inside_buckets_as_prometheus_does() {
        let h = Histogram::new(&[1.0, 2.0, 4.0]);
        assert_eq!(h.quantile(0.5), None);
        // 2 in (0, 1], 6 in (1, 2], 2 in (2, 4]: rank 5 of 10 is 3 into the second bucket.
        for v in [0.5, 0.5, 1.5, 1.5, 1.5, 1.5, 1.5, 1.5, 3.0, 3.0] {
            h.observe_value(v);
        }
        assert_eq!(h.quantile(0.5), Some(1.0 + 3.0 / 6.0));
        assert_eq!(h.quantile(0.9), Some(2.0 + 2.0 * 1.0 / 2.0));
        assert_eq!(h.quantile(0.1), Some(0.5));
        // Beyond the last finite bound: that bound.
        h.observe_value(100.0);
        assert_eq!(h.quantile(1.0), Some(4.0));
    }

    #[test]
    fn the_token_rate_averages_whole_seconds_in_the_window() {
        let rate = TokenRate::new();
        rate.add_at(0, 50);
        rate.add_at(3, 30);
        rate.add_at(5, 1000); // the current second: not yet counted
        assert_eq!(rate.per_second_at(5), 8.0);
        // Second 0 leaves the window at 11; slot 0 is reused for second 10.
        rate.add_at(10, 20);
        assert_eq!(rate.per_second_at(11), (30.0 + 1000.0 + 20.0) / 10.0);
        assert_eq!(rate.per_second_at(100), 0.0);
    }
}
