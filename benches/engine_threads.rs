//! Scaling of `serve --threads N` at the engine seam: 4 KiB random reads and overwrites of a
//! fully allocated 256 MiB qcow2 image in memory (`MemFs`, no disk, no sockets), queue depth
//! 16 per client thread.
//!
//! - `direct`: the engine called on its own thread, as a connection on thread 0 calls it:
//!   the engine's cost per request, the part of every request that stays serial.
//! - `remote/N`: N client threads, each on its own runtime, calling through `nbd_server::remote`
//!   as worker-thread connections do: what the image's thread can serve when fed from N
//!   threads, channel and wake-ups included.
//!
//! Throughput is requests per second. At the end of each group the bench prints the CPU time
//! the image's thread spent per remote request: the serial part that bounds how far more
//! threads can go, from which `benches/RESULTS.md` extrapolates.

mod support;

use qcow2::format::GuestOffset;
use std::rc::Rc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use nbd_proto::Errno;
use nbd_server::remote::{dispatch, Remote, RemoteHandle};
use nbd_server::{Buffer, Export, ExportFeatures, Extent, ReadChunk, WriteZeroesFlags};
use qcow2::engine::{create, CreateOptions, Image, OpenOptions, ReadPart};
use storage::{IoBuf, MemFs, MemStorage};
use tokio::task::{JoinSet, LocalSet};

const SIZE: u64 = 256 << 20;
const QD: usize = 16;
const BLOCK: usize = 4096;

/// A payload buffer that crosses threads.
struct Buf(IoBuf);

impl AsRef<[u8]> for Buf {
    fn as_ref(&self) -> &[u8] {
        &self.0
    }
}

impl AsMut<[u8]> for Buf {
    fn as_mut(&mut self) -> &mut [u8] {
        &mut self.0
    }
}

impl Buffer for Buf {
    fn zeroed(len: usize) -> Self {
        Buf(IoBuf::zeroed(len))
    }
}

/// The image as an export: reads and writes only, which is all the bench sends.
struct Engine(Image<MemStorage>);

impl Export for Engine {
    type Buf = Buf;

    fn size(&self) -> u64 {
        self.0.size()
    }

    fn features(&self) -> ExportFeatures {
        ExportFeatures::default()
    }

    async fn read(&self, offset: u64, len: usize) -> Result<Vec<ReadChunk<Buf>>, Errno> {
        let parts = self
            .0
            .read_sparse(GuestOffset(offset), len)
            .await
            .map_err(|_| Errno::Io)?;
        Ok(parts
            .into_iter()
            .map(|p| match p {
                ReadPart::Data(b) => ReadChunk::Data(Buf(b)),
                ReadPart::Hole(n) => ReadChunk::Hole(n),
            })
            .collect())
    }

    async fn write(&self, offset: u64, data: Buf, fua: bool) -> Result<(), Errno> {
        self.0
            .write(GuestOffset(offset), data.0, fua)
            .await
            .0
            .map_err(|_| Errno::Io)
    }

    async fn write_zeroes(&self, _: u64, _: u64, _: WriteZeroesFlags) -> Result<(), Errno> {
        Err(Errno::NotSup)
    }

    async fn trim(&self, _: u64, _: u64, _: bool) -> Result<(), Errno> {
        Err(Errno::NotSup)
    }

    async fn flush(&self) -> Result<(), Errno> {
        self.0.flush().await.map_err(|_| Errno::Io)
    }

    async fn cache(&self, _: u64, _: u64) -> Result<(), Errno> {
        Ok(())
    }

    async fn block_status(&self, _: u64, len: u64) -> Result<Vec<Extent>, Errno> {
        Ok(vec![Extent {
            len,
            hole: false,
            zero: false,
            depth: 1,
        }])
    }
}

fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("runtime")
}

/// A fully written image in memory.
async fn engine() -> Rc<Engine> {
    let file = MemStorage::new();
    let opts = CreateOptions {
        size: SIZE,
        ..CreateOptions::default()
    };
    create(&file, &opts).await.expect("create");
    let fs = MemFs::new();
    fs.insert("/img.qcow2", file);
    let image = Image::open(&fs, "/img.qcow2".as_ref(), &OpenOptions::default())
        .await
        .expect("open");
    let chunk = 1 << 20;
    for at in (0..SIZE).step_by(chunk) {
        let (res, _) = image
            .write(
                GuestOffset(at),
                IoBuf::from_slice(&vec![0x5a; chunk]),
                false,
            )
            .await;
        res.expect("fill");
    }
    Rc::new(Engine(image))
}

/// The `i`-th request's offset: a cheap, well-spread sequence over the image's 4 KiB blocks.
fn offset(i: u64) -> u64 {
    let blocks = SIZE / BLOCK as u64;
    (i.wrapping_mul(0x9E37_79B9_7F4A_7C15) >> 20) % blocks * BLOCK as u64
}

/// `n` requests at queue depth [`QD`] against `export`, from offset sequence `seed`.
async fn drive<E: Export + 'static>(export: Rc<E>, n: u64, seed: u64, write: bool) {
    let mut running = JoinSet::new();
    for lane in 0..QD as u64 {
        let export = Rc::clone(&export);
        running.spawn_local(async move {
            let mut i = lane;
            while i < n {
                let at = offset(seed.wrapping_add(i));
                if write {
                    let buf = export.alloc(BLOCK);
                    export.write(at, buf, false).await.expect("write");
                } else {
                    export.read(at, BLOCK).await.expect("read");
                }
                i += QD as u64;
            }
        });
    }
    while running.join_next().await.is_some() {}
}

/// Requests sent through [`Remote`] so far, to divide the engine thread's CPU time by.
static REMOTE_REQUESTS: AtomicU64 = AtomicU64::new(0);

/// CPU time the calling thread has used.
fn thread_cpu() -> Duration {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: `ts` is a valid, writable timespec for the duration of the call.
    let rc = unsafe { libc::clock_gettime(libc::CLOCK_THREAD_CPUTIME_ID, &mut ts) };
    assert_eq!(rc, 0, "clock_gettime(CLOCK_THREAD_CPUTIME_ID)");
    Duration::new(ts.tv_sec as u64, ts.tv_nsec as u32)
}

/// The engine on a thread of its own serving calls; dropping every handle ends it, and the
/// thread returns the CPU time it spent serving them.
fn engine_thread() -> (RemoteHandle<Buf>, std::thread::JoinHandle<Duration>) {
    let (tx, rx) = std::sync::mpsc::channel();
    let thread = std::thread::spawn(move || {
        LocalSet::new().block_on(&runtime(), async move {
            let engine = engine().await;
            let start = thread_cpu();
            let (handle, done) = dispatch(engine);
            tx.send(handle).expect("bench waits");
            let _ = done.await;
            thread_cpu() - start
        })
    });
    (rx.recv().expect("engine thread started"), thread)
}

/// `iters` requests split over `threads` client threads calling through `handle`.
fn remote_run(handle: &RemoteHandle<Buf>, threads: u64, iters: u64, write: bool) -> Duration {
    REMOTE_REQUESTS.fetch_add(iters, Ordering::Relaxed);
    let start = Instant::now();
    let clients: Vec<_> = (0..threads)
        .map(|t| {
            let handle = handle.clone();
            let share = iters / threads + u64::from(t < iters % threads);
            std::thread::spawn(move || {
                let remote = Rc::new(Remote::from(handle));
                LocalSet::new().block_on(&runtime(), drive(remote, share, t << 32, write));
            })
        })
        .collect();
    for c in clients {
        c.join().expect("client thread");
    }
    start.elapsed()
}

fn bench(c: &mut Criterion<support::IoTime>) {
    let mut group = c.benchmark_group("engine_threads");
    group.throughput(Throughput::Elements(1));
    group.sample_size(10);
    group.measurement_time(Duration::from_secs(3));
    for (op, write) in [("read", false), ("write", true)] {
        let rt = runtime();
        let local = LocalSet::new();
        let direct = local.block_on(&rt, engine());
        group.bench_function(BenchmarkId::new(op, "direct"), |b| {
            b.iter_custom(|iters| {
                let start = Instant::now();
                local.block_on(&rt, drive(Rc::clone(&direct), iters, 0, write));
                start.elapsed()
            });
        });
        let (handle, engine) = engine_thread();
        REMOTE_REQUESTS.store(0, Ordering::Relaxed);
        for threads in [1u64, 2, 4] {
            group.bench_function(BenchmarkId::new(op, format!("remote/{threads}")), |b| {
                b.iter_custom(|iters| remote_run(&handle, threads, iters, write));
            });
        }
        drop(handle);
        let cpu = engine.join().expect("engine thread");
        let requests = REMOTE_REQUESTS.load(Ordering::Relaxed).max(1);
        // The serial part of a request served from another thread: what bounds scaling.
        eprintln!(
            "engine_threads/{op}: the image's thread spent {:.2} µs of CPU per remote request \
             ({requests} requests)",
            cpu.as_secs_f64() * 1e6 / requests as f64
        );
    }
    group.finish();
}

criterion_group! {
    name = benches;
    config = Criterion::default().with_measurement(support::IoTime);
    targets = bench
}
criterion_main!(benches);
