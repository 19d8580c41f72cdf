//! What the engine benches share: a runtime to drive the engine on, scratch directories on a
//! real file system (O_DIRECT fails on tmpfs), the file opener and a small seeded PRNG.

#![allow(dead_code)] // each bench uses a different part of this module

use qcow2::engine::{Format, Image, OpenOptions};
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
pub async fn open_direct(
    path: &Path,
    read_only: bool,
    cache: cache::CacheOptions,
) -> Image<AnyStorage> {
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

/// SplitMix64: a tiny, seeded, good-enough PRNG, so runs are repeatable without a dependency.
pub struct SplitMix64(pub u64);

impl SplitMix64 {
    /// The next 64 random bits.
    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    /// A uniform value in `0..n` (n > 0); the modulo bias is irrelevant at these sizes.
    pub fn below(&mut self, n: u64) -> u64 {
        self.next_u64() % n
    }

    /// Fisher–Yates shuffle of `items`.
    pub fn shuffle<T>(&mut self, items: &mut [T]) {
        for i in (1..items.len()).rev() {
            let j = usize::try_from(self.below(i as u64 + 1)).expect("index fits usize");
            items.swap(i, j);
        }
    }
}
