//! Cost of a hit and of a miss, and the hit ratio of each eviction policy on L2 access traces
//! of a 64 GiB disk (64 KiB clusters, 4 KiB slices: 2048 slices) with a 1 MiB cache (256
//! slices): random 4 KiB reads, uniform or skewed, with a sequential scan mixed in.
//!
//! The backend does no I/O (a load fills the slice from memory), so the numbers are the
//! cache's own overhead; every future completes in one poll and is driven without a runtime.
//! Hit ratios are printed before the timings.

use std::future::Future;
use std::hint::black_box;
use std::io;
use std::pin::pin;
use std::task::{Context, Poll, Waker};

use cache::{Backend, Cache, CacheConfig, EvictionPolicy};
use criterion::{criterion_group, BenchmarkId, Criterion, Throughput};

const SLICE: usize = 4096;
const GIB: u64 = 1 << 30;
const MIB: u64 = 1 << 20;
/// Guest bytes one 4 KiB slice of 8-byte L2 entries maps with 64 KiB clusters.
const SLICE_COVERS: u64 = (SLICE as u64 / 8) * 64 * 1024;
const DISK: u64 = 64 * GIB;
const SLICES: u64 = DISK / SLICE_COVERS;

const POLICIES: [(EvictionPolicy, &str); 3] = [
    (EvictionPolicy::Lru, "lru"),
    (EvictionPolicy::Clock, "clock"),
    (EvictionPolicy::TwoQueue, "2q"),
];

/// A backend in memory: loads write the key into the slice, the rest is free.
struct Memory;

impl Backend<u64> for Memory {
    async fn load(&self, key: u64, buf: &mut [u8]) -> io::Result<()> {
        buf[..8].copy_from_slice(&key.to_le_bytes());
        Ok(())
    }
    type Snapshot = ();
    fn snapshot(&self, _data: &[u8]) {}
    async fn write_back(&self, _key: u64, _at: usize, _data: ()) -> io::Result<()> {
        Ok(())
    }
    async fn flush(&self) -> io::Result<()> {
        Ok(())
    }
}

/// Run a future that never waits (the in-memory backend never does).
fn now<F: Future>(f: F) -> F::Output {
    let mut f = pin!(f);
    match f.as_mut().poll(&mut Context::from_waker(Waker::noop())) {
        Poll::Ready(v) => v,
        Poll::Pending => panic!("an in-memory cache operation had to wait"),
    }
}

fn new_cache(policy: EvictionPolicy, capacity: u64) -> Cache<u64, Memory> {
    Cache::new(
        CacheConfig::new("l2", SLICE, capacity).with_policy(policy),
        Memory,
    )
    .expect("cache")
}

fn read(cache: &Cache<u64, Memory>, key: u64) -> u8 {
    now(cache.read(key, |b| b[0])).expect("read")
}

/// xorshift64*: reproducible and cheap.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }

    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }

    fn unit(&mut self) -> f64 {
        (self.next() >> 11) as f64 / (1u64 << 53) as f64
    }
}

/// Where random reads go.
#[derive(Clone, Copy)]
enum Spread {
    /// Anywhere on the disk.
    Uniform,
    /// 90% of them within the first 6 GiB (192 slices), the rest anywhere.
    HotSpot,
    /// Zipf(0.9) over slices in a shuffled order.
    Zipf,
}

/// Slice keys touched by `n` requests: random 4 KiB reads spread as given, and with
/// probability `scan` instead the next 1 MiB of a sequential scan of the whole disk.
fn trace(spread: Spread, scan: f64, n: usize, seed: u64) -> Vec<u64> {
    let mut rng = Rng(seed | 1);
    let mut order: Vec<u64> = (0..SLICES).collect();
    for i in (1..order.len()).rev() {
        let j = rng.below(i as u64 + 1) as usize;
        order.swap(i, j);
    }
    let zipf_cdf: Vec<f64> = {
        let weights: Vec<f64> = (1..=SLICES).map(|r| 1.0 / (r as f64).powf(0.9)).collect();
        let total: f64 = weights.iter().sum();
        let mut acc = 0.0;
        weights
            .iter()
            .map(|w| {
                acc += w / total;
                acc
            })
            .collect()
    };
    let mut cursor = 0u64;
    (0..n)
        .map(|_| {
            let offset = if rng.unit() < scan {
                cursor = (cursor + MIB) % DISK;
                cursor
            } else {
                match spread {
                    Spread::Uniform => rng.below(DISK / 4096) * 4096,
                    Spread::HotSpot if rng.unit() < 0.9 => rng.below(6 * GIB / 4096) * 4096,
                    Spread::HotSpot => rng.below(DISK / 4096) * 4096,
                    Spread::Zipf => {
                        let u = rng.unit();
                        let rank = zipf_cdf.partition_point(|&c| c < u);
                        let slice = order[rank.min(order.len() - 1)];
                        slice * SLICE_COVERS + rng.below(SLICE_COVERS / 4096) * 4096
                    }
                }
            };
            offset / SLICE_COVERS
        })
        .collect()
}

const TRACES: [(Spread, f64, &str); 4] = [
    (Spread::Uniform, 0.2, "uniform+scan"),
    (Spread::HotSpot, 0.0, "hotspot"),
    (Spread::HotSpot, 0.2, "hotspot+scan"),
    (Spread::Zipf, 0.2, "zipf+scan"),
];

fn hit_ratio(policy: EvictionPolicy, keys: &[u64]) -> f64 {
    let cache = new_cache(policy, MIB);
    // Warm up on the first fifth, measure the rest.
    let warm = keys.len() / 5;
    for &k in &keys[..warm] {
        read(&cache, k);
    }
    let before = cache.stats();
    for &k in &keys[warm..] {
        read(&cache, k);
    }
    let after = cache.stats();
    let hits = after.hits - before.hits;
    let misses = after.misses - before.misses;
    hits as f64 / (hits + misses) as f64
}

fn print_hit_ratios() {
    println!("hit ratio, 1 MiB cache of 4 KiB slices, 64 GiB disk (2048 slices), 1M requests:");
    print!("{:>14}", "");
    for (_, name) in POLICIES {
        print!("{name:>9}");
    }
    println!();
    for (spread, scan, name) in TRACES {
        let keys = trace(spread, scan, 1_000_000, 42);
        print!("{name:>14}");
        for (policy, _) in POLICIES {
            print!("{:>8.2}%", 100.0 * hit_ratio(policy, &keys));
        }
        println!();
    }
}

fn hits(c: &mut Criterion) {
    // A full 32 MiB cache (the default maximum): 8192 slices, every read a hit.
    const N: u64 = 8192;
    let mut group = c.benchmark_group("hit");
    group.throughput(Throughput::Elements(1));
    for (policy, name) in POLICIES {
        let cache = new_cache(policy, N * SLICE as u64);
        for k in 0..N {
            read(&cache, k);
        }
        let mut i = 0u64;
        group.bench_function(BenchmarkId::from_parameter(name), |b| {
            b.iter(|| {
                i = (i + 7919) % N;
                black_box(read(&cache, black_box(i)))
            })
        });
        assert_eq!(cache.stats().misses, N, "{name}: all hits");
    }
    group.finish();
}

fn misses(c: &mut Criterion) {
    // Every key new: each read evicts a clean slice and loads another.
    let mut group = c.benchmark_group("miss");
    group.throughput(Throughput::Elements(1));
    for (policy, name) in POLICIES {
        let cache = new_cache(policy, MIB);
        let mut key = 0u64;
        group.bench_function(BenchmarkId::from_parameter(name), |b| {
            b.iter(|| {
                key += 1;
                black_box(read(&cache, black_box(key)))
            })
        });
        assert_eq!(cache.stats().hits, 0, "{name}: all misses");
    }
    group.finish();
}

fn replay(c: &mut Criterion) {
    // The zipf+scan trace, 100k requests per iteration: hits and misses in realistic mix.
    let keys = trace(Spread::Zipf, 0.2, 100_000, 7);
    let mut group = c.benchmark_group("trace-zipf+scan");
    group.throughput(Throughput::Elements(keys.len() as u64));
    group.sample_size(20);
    for (policy, name) in POLICIES {
        let cache = new_cache(policy, MIB);
        group.bench_function(BenchmarkId::from_parameter(name), |b| {
            b.iter(|| {
                for &k in &keys {
                    black_box(read(&cache, k));
                }
            })
        });
    }
    group.finish();
}

criterion_group!(benches, hits, misses, replay);

fn main() {
    print_hit_ratios();
    benches();
    Criterion::default().configure_from_args().final_summary();
}
