//! Allocation: 4 KiB random writes into an empty qcow2 image over a fully written raw backing
//! file, each write to a fresh allocation unit (a cluster, or a subcluster with extended L2),
//! so that every write allocates and copies the rest of the unit from the backing file.
//! The configurations of the subcluster seed: standard L2 with 64 KiB, 128 KiB and 2 MiB
//! clusters, extended L2 with 64K/2K, 128K/4K, 256K/8K and 2M/64K. Throughput is IOPS.
//!
//! In-process, queue depth 1, io_uring with O_DIRECT, files under Cargo's target tmp dir.

mod support;

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use qcow2::engine::{create_file, CacheOptions, CreateOptions, Format, Image};
use qcow2::format::GuestOffset;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};
use storage::AnyStorage;
use support::{block_4k, direct_opener, open_direct, scratch_dir, Runner, SplitMix64};

/// Size of the backing file and of every overlay (env `BENCH_ALLOC_MIB`, default 512 MiB).
fn backing_size() -> u64 {
    std::env::var("BENCH_ALLOC_MIB")
        .ok()
        .and_then(|v| v.parse::<u64>().ok())
        .unwrap_or(512)
        << 20
}

/// (label, cluster size, extended L2)
const CONFIGS: [(&str, u64, bool); 7] = [
    ("std_64k", 64 << 10, false),
    ("std_128k", 128 << 10, false),
    ("std_2m", 2 << 20, false),
    ("ext_64k_2k", 64 << 10, true),
    ("ext_128k_4k", 128 << 10, true),
    ("ext_256k_8k", 256 << 10, true),
    ("ext_2m_64k", 2 << 20, true),
];

/// One overlay being filled: the allocation units not yet written, in random order.
struct Overlay {
    image: Image<AnyStorage>,
    path: PathBuf,
    units: Vec<u64>,
    next: usize,
}

struct Filler<'a> {
    dir: &'a Path,
    cluster: u64,
    extended: bool,
    unit: u64,
    size: u64,
    serial: u32,
    rng: SplitMix64,
    current: Option<Overlay>,
}

impl Filler<'_> {
    async fn fresh_overlay(&mut self) -> Overlay {
        self.serial += 1;
        let path = self.dir.join(format!("overlay-{}.qcow2", self.serial));
        let opts = CreateOptions {
            size: self.size,
            cluster_size: self.cluster,
            extended_l2: self.extended,
            backing: Some(("backing.raw".into(), Format::Raw)),
            ..CreateOptions::default()
        };
        create_file(&direct_opener(), &path, &opts)
            .await
            .expect("create overlay");
        let image = open_direct(&path, false, CacheOptions::default()).await;
        let mut units: Vec<u64> = (0..self.size / self.unit).collect();
        self.rng.shuffle(&mut units);
        Overlay {
            image,
            path,
            units,
            next: 0,
        }
    }

    /// Times `iters` allocating writes; making and removing overlays is not timed.
    async fn timed_writes(&mut self, iters: u64) -> Duration {
        let mut total = Duration::ZERO;
        let mut left = iters;
        while left > 0 {
            let exhausted = self
                .current
                .as_ref()
                .is_none_or(|o| o.next == o.units.len());
            if exhausted {
                if let Some(old) = self.current.take() {
                    old.image.close().await.expect("close overlay");
                    std::fs::remove_file(&old.path).expect("remove overlay");
                }
                self.current = Some(self.fresh_overlay().await);
            }
            let ov = self.current.as_mut().expect("overlay present");
            let n = left.min((ov.units.len() - ov.next) as u64);
            let slots = self.unit / 4096;
            let offsets: Vec<u64> = ov.units[ov.next..ov.next + n as usize]
                .iter()
                .map(|u| u * self.unit + self.rng.below(slots) * 4096)
                .collect();
            ov.next += n as usize;
            let mut buf = block_4k(0xa5);
            let start = Instant::now();
            for off in offsets {
                let (res, back) = ov.image.write(GuestOffset(off), buf, false).await;
                res.expect("allocating write");
                buf = back;
            }
            total += start.elapsed();
            left -= n;
        }
        total
    }

    async fn finish(mut self) {
        if let Some(old) = self.current.take() {
            old.image.close().await.expect("close overlay");
            std::fs::remove_file(&old.path).expect("remove overlay");
        }
    }
}

fn allocation(c: &mut Criterion<support::IoTime>) {
    let dir = scratch_dir("bench-alloc-");
    let size = backing_size();
    support::write_pattern_file(&dir.path().join("backing.raw"), size);
    let runner = Runner::new();
    let mut group = c.benchmark_group("alloc_4k_randwrite_over_backing");
    group
        .sample_size(10)
        .warm_up_time(Duration::from_secs(1))
        .measurement_time(Duration::from_secs(4))
        .throughput(Throughput::Elements(1));
    for (label, cluster, extended) in CONFIGS {
        let subcluster = if extended { cluster / 32 } else { cluster };
        let mut filler = Filler {
            dir: dir.path(),
            cluster,
            extended,
            unit: subcluster.max(4096),
            size,
            serial: 0,
            rng: SplitMix64(cluster ^ u64::from(extended)),
            current: None,
        };
        group.bench_function(BenchmarkId::from_parameter(label), |b| {
            b.iter_custom(|iters| runner.run(filler.timed_writes(iters)))
        });
        runner.run(filler.finish());
    }
    group.finish();
}

criterion_group! {
    name = benches;
    config = Criterion::default().with_measurement(support::IoTime);
    targets = allocation
}
criterion_main!(benches);
