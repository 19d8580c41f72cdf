//! Chains: a full sequential read of the same guest data through a chain of depth 1 (one image
//! holding everything) and depth 300 (every layer holds every 300th cluster): the shape of the
//! published long-backing-chain study of QEMU. Throughput is guest bytes.
//!
//! In-process, 1 MiB requests at queue depth 1, io_uring with O_DIRECT. Each iteration opens
//! the chain afresh (not timed), so every read starts with cold caches, as after a VM start.

mod support;

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use qcow2::engine::{create_file, CacheOptions, CreateOptions, Format};
use qcow2::format::GuestOffset;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};
use storage::IoBuf;
use support::{direct_opener, open_direct, scratch_dir, Runner};

/// Guest size (env `BENCH_CHAIN_MIB`, default 64 MiB).
fn guest_size() -> u64 {
    std::env::var("BENCH_CHAIN_MIB")
        .ok()
        .and_then(|v| v.parse::<u64>().ok())
        .unwrap_or(64)
        << 20
}

const CLUSTER: u64 = 64 << 10;
const REQUEST: usize = 1 << 20;

/// Builds a chain of `depth` layers in `dir` where layer k (0 = bottom) holds every cluster
/// i with i % depth == k; returns the top image.
async fn build_chain(dir: &Path, depth: u64, size: u64) -> PathBuf {
    let mut below: Option<String> = None;
    let mut top = PathBuf::new();
    for k in 0..depth {
        let name = format!("layer{k:03}.qcow2");
        let path = dir.join(&name);
        let opts = CreateOptions {
            size,
            backing: below.take().map(|b| (b, Format::Qcow2)),
            ..CreateOptions::default()
        };
        create_file(&direct_opener(), &path, &opts)
            .await
            .expect("create layer");
        let img = qcow2::engine::Image::open(
            &direct_opener(),
            &path,
            &qcow2::engine::OpenOptions {
                no_backing: true,
                direct: true,
                ..Default::default()
            },
        )
        .await
        .expect("open layer");
        let mut i = k;
        while i * CLUSTER < size {
            let byte = u8::try_from(i % 251).expect("below 251") + 1;
            let (res, _) = img
                .write(
                    GuestOffset(i * CLUSTER),
                    IoBuf::from_slice(&[byte; CLUSTER as usize]),
                    false,
                )
                .await;
            res.expect("write layer data");
            i += depth;
        }
        img.close().await.expect("close layer");
        below = Some(name);
        top = path;
    }
    top
}

fn chains(c: &mut Criterion) {
    let size = guest_size();
    let runner = Runner::new();
    let mut group = c.benchmark_group("chain_full_read");
    group
        .sample_size(10)
        .warm_up_time(Duration::from_secs(1))
        .measurement_time(Duration::from_secs(5))
        .throughput(Throughput::Bytes(size));
    for depth in [1u64, 300] {
        let dir = scratch_dir("bench-chain-");
        let top = runner.run(build_chain(dir.path(), depth, size));
        group.bench_function(BenchmarkId::new("depth", depth), |b| {
            b.iter_custom(|iters| {
                runner.run(async {
                    let mut total = Duration::ZERO;
                    for _ in 0..iters {
                        let image = open_direct(&top, true, CacheOptions::default()).await;
                        let mut buf = IoBuf::zeroed(REQUEST);
                        let start = Instant::now();
                        let mut pos = 0;
                        while pos < size {
                            let (res, back) = image.read_into(GuestOffset(pos), buf).await;
                            res.expect("chain read");
                            buf = back;
                            pos += REQUEST as u64;
                        }
                        total += start.elapsed();
                        image.close().await.expect("close chain");
                    }
                    total
                })
            })
        });
    }
    group.finish();
}

criterion_group!(benches, chains);
criterion_main!(benches);
