//! Request latency in fixed, log-spaced buckets: powers of two from 16 µs to about 4 s, one
//! counter each, so recording is an index computation and an increment (no allocation, no
//! search), and two histograms add up bucket by bucket.

use std::cell::Cell;
use std::time::Duration;

/// Upper bound of the first bucket, in nanoseconds (16 µs).
const FIRST_BOUND_NS: u64 = 16_000;

/// Buckets with a finite upper bound: 16 µs · 2^k for k in 0..19, the last 4.194304 s.
pub const FINITE_BUCKETS: usize = 19;

/// All buckets: the finite ones and the one above the last bound (`+Inf`).
pub const BUCKETS: usize = FINITE_BUCKETS + 1;

/// The upper bound of finite bucket `index`, in seconds (as Prometheus' `le` label).
pub fn bound_seconds(index: usize) -> f64 {
    // Exact in f64: 16e-6 times a power of two up to 2^18.
    (FIRST_BOUND_NS << index.min(FINITE_BUCKETS - 1)) as f64 / 1e9
}

/// The bucket of a request that took `elapsed`: the first whose bound it does not exceed.
pub fn bucket_of(elapsed: Duration) -> usize {
    let ns = u64::try_from(elapsed.as_nanos()).unwrap_or(u64::MAX);
    // In units of the first bound, rounded up: bucket k holds (2^(k-1), 2^k] units.
    let units = ns.div_ceil(FIRST_BOUND_NS);
    if units <= 1 {
        return 0;
    }
    let index = (u64::BITS - (units - 1).leading_zeros()) as usize;
    index.min(FINITE_BUCKETS)
}

/// The counts of a histogram at one moment, per bucket (not cumulative).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct HistogramCounts {
    /// Requests per bucket; the last is above every finite bound.
    pub buckets: [u64; BUCKETS],
    /// Total time of every request recorded, in nanoseconds.
    pub sum_ns: u64,
}

impl HistogramCounts {
    /// Requests recorded.
    pub fn count(&self) -> u64 {
        self.buckets.iter().fold(0u64, |a, &b| a.saturating_add(b))
    }

    /// Adds `other`'s requests to these.
    pub fn add(&mut self, other: &HistogramCounts) {
        for (a, b) in self.buckets.iter_mut().zip(other.buckets) {
            *a = a.saturating_add(b);
        }
        self.sum_ns = self.sum_ns.saturating_add(other.sum_ns);
    }

    /// Requests at or below each finite bound (Prometheus' cumulative `le` buckets).
    pub fn cumulative(&self) -> [u64; FINITE_BUCKETS] {
        let mut out = [0; FINITE_BUCKETS];
        let mut running = 0u64;
        for (o, b) in out.iter_mut().zip(self.buckets) {
            running = running.saturating_add(b);
            *o = running;
        }
        out
    }
}

/// A live histogram, written on the thread that owns the export.
#[derive(Debug, Default)]
pub struct Histogram {
    buckets: [Cell<u64>; BUCKETS],
    sum_ns: Cell<u64>,
}

impl Histogram {
    /// Counts one request that took `elapsed`.
    pub fn record(&self, elapsed: Duration) {
        let b = &self.buckets[bucket_of(elapsed)];
        b.set(b.get().wrapping_add(1));
        let ns = u64::try_from(elapsed.as_nanos()).unwrap_or(u64::MAX);
        self.sum_ns.set(self.sum_ns.get().saturating_add(ns));
    }

    /// The counts now.
    pub fn counts(&self) -> HistogramCounts {
        HistogramCounts {
            buckets: std::array::from_fn(|i| self.buckets[i].get()),
            sum_ns: self.sum_ns.get(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn us(n: u64) -> Duration {
        Duration::from_micros(n)
    }

    #[test]
    fn a_duration_lands_in_the_first_bucket_whose_bound_it_does_not_exceed() {
        assert_eq!(bucket_of(Duration::ZERO), 0);
        assert_eq!(bucket_of(Duration::from_nanos(1)), 0);
        assert_eq!(bucket_of(us(16)), 0);
        assert_eq!(bucket_of(Duration::from_nanos(16_001)), 1);
        assert_eq!(bucket_of(us(32)), 1);
        assert_eq!(bucket_of(us(33)), 2);
        assert_eq!(bucket_of(us(1000)), 6); // 1 ms <= 1.024 ms
        assert_eq!(bucket_of(us(4_194_304)), 18);
        assert_eq!(bucket_of(us(4_194_305)), FINITE_BUCKETS);
        assert_eq!(
            bucket_of(Duration::from_secs(3600 * 24 * 365)),
            FINITE_BUCKETS
        );
        assert_eq!(bucket_of(Duration::MAX), FINITE_BUCKETS);
        // Every bound belongs to its own bucket, and just above it to the next.
        for i in 0..FINITE_BUCKETS {
            let bound = Duration::from_secs_f64(bound_seconds(i));
            assert_eq!(bucket_of(bound), i, "bound {i}");
            assert_eq!(
                bucket_of(bound + Duration::from_nanos(1)),
                i + 1,
                "above {i}"
            );
        }
    }

    #[test]
    fn bounds_double_from_16_microseconds() {
        assert_eq!(bound_seconds(0), 16e-6);
        assert_eq!(bound_seconds(1), 32e-6);
        assert_eq!(bound_seconds(FINITE_BUCKETS - 1), 4.194304);
        for i in 1..FINITE_BUCKETS {
            assert_eq!(bound_seconds(i), 2.0 * bound_seconds(i - 1));
        }
    }

    #[test]
    fn counts_are_cumulative_and_add_up() {
        let h = Histogram::default();
        for d in [us(1), us(10), us(20), us(5000), Duration::from_secs(10)] {
            h.record(d);
        }
        let c = h.counts();
        assert_eq!(c.count(), 5);
        assert_eq!(c.buckets[0], 2);
        assert_eq!(c.buckets[1], 1);
        assert_eq!(c.buckets[FINITE_BUCKETS], 1);
        let cum = c.cumulative();
        assert_eq!(cum[0], 2);
        assert_eq!(cum[1], 3);
        assert_eq!(cum[FINITE_BUCKETS - 1], 4);
        assert_eq!(
            c.sum_ns,
            1_000 + 10_000 + 20_000 + 5_000_000 + 10_000_000_000
        );
        let mut total = c;
        total.add(&c);
        assert_eq!(total.count(), 10);
        assert_eq!(total.sum_ns, 2 * c.sum_ns);
    }
}
