//! What the engine benches share: a runtime to drive the engine on, scratch directories on a
//! real file system (O_DIRECT fails on tmpfs), the file opener and a small seeded PRNG.

#![allow(dead_code)] // each bench uses a different part of this module

use qcow2::engine::{CacheOptions, Format, Image, OpenOptions};
use std::future::Future;
use std::path::Path;
use storage::{Aio, AnyStorage, FileOpener, IoBuf};

/// One current-thread runtime with a `LocalSet`, as the server drives the engine.
pub struct Runner {
    rt: tokio::runtime::Runtime,
    local: tokio::task::LocalSet,
}

impl Runner {
    /// A fresh runtime with I/O enabled (the io_uring reactor needs it).
    pub fn new() -> Runner {
        Runner {
            rt: tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .expect("tokio runtime"),
            local: tokio::task::LocalSet::new(),
        }
    }

    /// Runs `fut` to completion on this runtime.
    pub fn run<F: Future>(&self, fut: F) -> F::Output {
        self.local.block_on(&self.rt, fut)
    }
}

/// The server's fast path: io_uring with O_DIRECT (`--cache=none --aio=io_uring`).
pub fn direct_opener() -> FileOpener {
    FileOpener {
        aio: Aio::IoUring,
        direct: true,
        ..FileOpener::default()
    }
}

/// A scratch directory under Cargo's target tmp dir (a real file system, unlike a tmpfs /tmp),
/// removed when dropped.
pub fn scratch_dir(prefix: &str) -> tempfile::TempDir {
    let base = Path::new(env!("CARGO_TARGET_TMPDIR"));
    std::fs::create_dir_all(base).expect("target tmp dir");
    tempfile::Builder::new()
        .prefix(prefix)
        .tempdir_in(base)
        .expect("scratch dir")
}

/// Opens a qcow2 image read-write (or read-only) with O_DIRECT and the given cache options.
pub async fn open_direct(path: &Path, read_only: bool, cache: CacheOptions) -> Image<AnyStorage> {
    Image::open(
        &direct_opener(),
        path,
        &OpenOptions {
            read_only,
            format: Some(Format::Qcow2),
            cache,
            direct: true,
            ..OpenOptions::default()
        },
    )
    .await
    .unwrap_or_else(|e| panic!("open {}: {e}", path.display()))
}

/// Writes `len` bytes of a non-zero pattern to a new raw file, in 1 MiB chunks.
pub fn write_pattern_file(path: &Path, len: u64) {
    use std::io::Write;
    let mut f = std::io::BufWriter::new(std::fs::File::create(path).expect("create raw file"));
    let mut chunk = vec![0u8; 1 << 20];
    let mut pos = 0u64;
    let mut rng = SplitMix64(0x5eed);
    while pos < len {
        for word in chunk.chunks_exact_mut(8) {
            word.copy_from_slice(&rng.next_u64().to_le_bytes());
        }
        let n = usize::try_from((len - pos).min(1 << 20)).expect("chunk fits usize");
        f.write_all(&chunk[..n]).expect("write raw file");
        pos += n as u64;
    }
    f.into_inner()
        .expect("flush raw file")
        .sync_all()
        .expect("sync raw file");
}

/// A 4 KiB buffer of a fixed non-zero pattern (aligned, as O_DIRECT wants).
pub fn block_4k(byte: u8) -> IoBuf {
    IoBuf::from_slice(&[byte; 4096])
}

/// The tests' seeded random source, so bench runs are repeatable.
pub use test_support::Rng as SplitMix64;

/// Wall time, as criterion's default, but element throughput printed as I/O operations per
/// second: the engine benches count one element per request, and criterion's own formatter
/// would print `Kelem/s`.
pub struct IoTime;

impl criterion::measurement::Measurement for IoTime {
    type Intermediate = std::time::Instant;
    type Value = std::time::Duration;

    fn start(&self) -> Self::Intermediate {
        std::time::Instant::now()
    }
    fn end(&self, i: Self::Intermediate) -> Self::Value {
        i.elapsed()
    }
    fn add(&self, v1: &Self::Value, v2: &Self::Value) -> Self::Value {
        *v1 + *v2
    }
    fn zero(&self) -> Self::Value {
        std::time::Duration::ZERO
    }
    fn to_f64(&self, value: &Self::Value) -> f64 {
        value.as_nanos() as f64
    }
    fn formatter(&self) -> &dyn criterion::measurement::ValueFormatter {
        &IopsFormatter
    }
}

/// Formats [`IoTime`] values: times as criterion does, elements per second as IOPS.
struct IopsFormatter;

impl criterion::measurement::ValueFormatter for IopsFormatter {
    fn scale_values(&self, ns: f64, values: &mut [f64]) -> &'static str {
        let (factor, unit) = match ns {
            n if n < 1e3 => (1.0, "ns"),
            n if n < 1e6 => (1e-3, "µs"),
            n if n < 1e9 => (1e-6, "ms"),
            _ => (1e-9, "s"),
        };
        values.iter_mut().for_each(|v| *v *= factor);
        unit
    }

    fn scale_throughputs(
        &self,
        typical: f64,
        throughput: &criterion::Throughput,
        values: &mut [f64],
    ) -> &'static str {
        use criterion::Throughput;
        let ops = match *throughput {
            Throughput::Elements(n) => n as f64,
            Throughput::Bytes(n) | Throughput::BytesDecimal(n) => {
                values
                    .iter_mut()
                    .for_each(|v| *v = n as f64 * 1e9 / *v / 1048576.0);
                return "MiB/s";
            }
        };
        let iops = ops * 1e9 / typical;
        let (denominator, unit) = match iops {
            r if r < 1e3 => (1.0, " IOPS"),
            r if r < 1e6 => (1e3, "kIOPS"),
            _ => (1e6, "MIOPS"),
        };
        values
            .iter_mut()
            .for_each(|v| *v = ops * 1e9 / *v / denominator);
        unit
    }

    fn scale_for_machines(&self, _values: &mut [f64]) -> &'static str {
        "ns"
    }
}
