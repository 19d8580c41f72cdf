//! 4 KiB random reads and writes with O_DIRECT on a 1 GiB file, at queue depth 1 and 32:
//! our io_uring reactor (batched and unbatched submission) against the thread-pool backend.
//! Criterion's "elements per second" is IOPS.
//!
//! The file lives in the target directory (a real disk; O_DIRECT does not work on tmpfs) and is
//! filled with data once, so reads hit allocated blocks.

use std::path::{Path, PathBuf};
use std::rc::Rc;
use std::time::{Duration, Instant};

use criterion::{criterion_group, criterion_main, Criterion, Throughput};
use storage::{IoBuf, OpenOptions, Reactor, Storage, ThreadsStorage, UringStorage};

const FILE_SIZE: u64 = 1 << 30;
const BLOCK: usize = 4096;

fn bench_file() -> PathBuf {
    let path = Path::new(env!("CARGO_TARGET_TMPDIR")).join("randio-1g.img");
    let ok = std::fs::metadata(&path).is_ok_and(|m| m.len() == FILE_SIZE);
    if !ok {
        use std::io::Write;
        let mut f = std::fs::File::create(&path).expect("creating bench file");
        let chunk: Vec<u8> = (0..1 << 20)
            .map(|i: u32| (i.wrapping_mul(2_654_435_761) >> 13) as u8)
            .collect();
        for _ in 0..FILE_SIZE / (1 << 20) {
            f.write_all(&chunk).expect("filling bench file");
        }
        f.sync_all().expect("syncing bench file");
    }
    path
}

#[derive(Clone, Copy, PartialEq)]
enum Backend {
    UringBatched,
    UringUnbatched,
    Threads,
}

enum Disk {
    Uring(UringStorage),
    Threads(ThreadsStorage),
}

impl Disk {
    async fn io(&self, write: bool, buf: IoBuf, offset: u64) -> IoBuf {
        let slice = buf.into();
        let (res, slice) = match (self, write) {
            (Disk::Uring(s), false) => s.read_at(slice, offset).await,
            (Disk::Uring(s), true) => s.write_at(slice, offset).await,
            (Disk::Threads(s), false) => s.read_at(slice, offset).await,
            (Disk::Threads(s), true) => s.write_at(slice, offset).await,
        };
        res.expect("bench I/O failed");
        slice.into_inner()
    }
}

struct Rng(u64);
impl Rng {
    fn block(&mut self) -> u64 {
        // xorshift64*: cheap enough not to show up in the measurement.
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        (self.0.wrapping_mul(0x2545_F491_4F6C_DD1D) % (FILE_SIZE / BLOCK as u64)) * BLOCK as u64
    }
}

/// Run `ops` random 4 KiB operations with `qd` in flight; returns the elapsed time.
async fn run(disk: Rc<Disk>, write: bool, qd: usize, ops: u64) -> Duration {
    let start = Instant::now();
    let mut workers = tokio::task::JoinSet::new();
    for w in 0..qd {
        let disk = Rc::clone(&disk);
        let n = ops / qd as u64 + u64::from((w as u64) < ops % qd as u64);
        workers.spawn_local(async move {
            let mut rng = Rng(0x9E37_79B9_7F4A_7C15 ^ ((w as u64 + 1) * 0x1234_5678));
            let mut buf = IoBuf::zeroed(BLOCK);
            for _ in 0..n {
                buf = disk.io(write, buf, rng.block()).await;
            }
        });
    }
    while let Some(r) = workers.join_next().await {
        r.expect("bench worker panicked");
    }
    start.elapsed()
}

fn randio(c: &mut Criterion) {
    let path = bench_file();
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("runtime");
    let local = tokio::task::LocalSet::new();
    let opts = OpenOptions::read_write().with_direct(true);
    for (name, backend) in [
        ("uring-batched", Backend::UringBatched),
        ("uring-unbatched", Backend::UringUnbatched),
        ("threads", Backend::Threads),
    ] {
        let disk = Rc::new(local.block_on(&rt, async {
            match backend {
                Backend::Threads => Disk::Threads(ThreadsStorage::open(&path, opts).await.unwrap()),
                _ => {
                    let reactor = Reactor::new(256, backend == Backend::UringBatched).unwrap();
                    Disk::Uring(UringStorage::open_with(reactor, &path, opts).await.unwrap())
                }
            }
        }));
        let mut group = c.benchmark_group(format!("randio/{name}"));
        group.throughput(Throughput::Elements(1));
        group.sample_size(10);
        group.measurement_time(Duration::from_secs(5));
        for write in [false, true] {
            for qd in [1usize, 32] {
                let id = format!("{}-qd{qd}", if write { "randwrite" } else { "randread" });
                group.bench_function(id, |b| {
                    b.iter_custom(|iters| {
                        local.block_on(&rt, run(Rc::clone(&disk), write, qd, iters))
                    })
                });
            }
        }
        group.finish();
    }
}

criterion_group!(benches, randio);
criterion_main!(benches);
