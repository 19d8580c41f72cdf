//! L2 cache: 4 KiB random reads over a fully allocated image whose L2 tables need about 5 MiB
//! (40 GiB with 64 KiB clusters, `preallocation=metadata`), with 1, 3 and 5 MiB caches and
//! 4, 16 and 64 KiB slices: the shape of QEMU's measurements in qcow2-cache.txt, where small slices win when the cache
//! cannot hold every table (a miss then reads 4 KiB, not 64 KiB). Throughput is IOPS.
//!
//! In-process, queue depth 1, io_uring with O_DIRECT, files under Cargo's target tmp dir.

mod support;

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use qcow2::engine::{create_file, CacheOptions, CreateOptions, Preallocation};
use qcow2::format::GuestOffset;
use std::time::{Duration, Instant};
use storage::IoBuf;
use support::{direct_opener, open_direct, scratch_dir, Runner, SplitMix64};

/// Virtual size (env `BENCH_L2_GIB`, default 40 GiB: 5 MiB of L2 tables at 64 KiB clusters).
fn image_size() -> u64 {
    std::env::var("BENCH_L2_GIB")
        .ok()
        .and_then(|v| v.parse::<u64>().ok())
        .unwrap_or(40)
        << 30
}

fn l2_cache(c: &mut Criterion<support::IoTime>) {
    let dir = scratch_dir("bench-l2-");
    let path = dir.path().join("allocated.qcow2");
    let size = image_size();
    let runner = Runner::new();
    runner.run(async {
        let opts = CreateOptions {
            size,
            preallocation: Preallocation::Metadata,
            ..CreateOptions::default()
        };
        create_file(&direct_opener(), &path, &opts)
            .await
            .expect("create preallocated image");
    });
    let mut group = c.benchmark_group("l2_cache_4k_randread");
    group
        .sample_size(10)
        .warm_up_time(Duration::from_secs(1))
        .measurement_time(Duration::from_secs(3))
        .throughput(Throughput::Elements(1));
    for cache_mib in [1u64, 3, 5] {
        for slice_kib in [4u64, 16, 64] {
            let image = runner.run(open_direct(
                &path,
                true,
                CacheOptions {
                    l2_cache_size: Some(cache_mib << 20),
                    l2_cache_entry_size: Some(slice_kib << 10),
                    ..CacheOptions::default()
                },
            ));
            let mut rng = SplitMix64(cache_mib << 8 | slice_kib);
            let blocks = size / 4096;
            let label = format!("cache_{cache_mib}m_slice_{slice_kib}k");
            group.bench_function(BenchmarkId::from_parameter(label), |b| {
                b.iter_custom(|iters| {
                    runner.run(async {
                        let mut buf = IoBuf::zeroed(4096);
                        let start = Instant::now();
                        for _ in 0..iters {
                            let off = rng.below(blocks) * 4096;
                            let (res, back) = image.read_into(GuestOffset(off), buf).await;
                            res.expect("random read");
                            buf = back;
                        }
                        start.elapsed()
                    })
                })
            });
            runner.run(image.close()).expect("close image");
        }
    }
    group.finish();
}

criterion_group! {
    name = benches;
    config = Criterion::default().with_measurement(support::IoTime);
    targets = l2_cache
}
criterion_main!(benches);
