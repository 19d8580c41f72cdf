//! Shared helpers for the storage integration tests: every backend behind one constructor
//! (the runtime comes from test_support).
#![allow(dead_code)] // each test binary uses a different subset

use std::path::PathBuf;

use storage::{
    FaultStorage, MemStorage, OpenOptions, Reactor, Storage, ThreadsStorage, UringStorage,
};

/// A scratch directory on a real disk (O_DIRECT does not work on tmpfs).
pub fn scratch_dir() -> tempfile::TempDir {
    tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).expect("creating scratch dir")
}

/// A scratch directory in memory (tmpfs at `/dev/shm`, as on every Linux with glibc).
pub fn memory_dir() -> tempfile::TempDir {
    tempfile::tempdir_in("/dev/shm").expect("creating a scratch dir on /dev/shm (tmpfs)")
}

/// Every backend the behaviour suite runs against.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Backend {
    Mem,
    FaultMem,
    Threads,
    ThreadsDirect,
    Uring,
    UringBatched,
    UringDirect,
    /// io_uring storage on tmpfs, where data I/O runs inline.
    UringMemory,
}

impl Backend {
    pub const ALL: [Backend; 8] = [
        Backend::Mem,
        Backend::FaultMem,
        Backend::Threads,
        Backend::ThreadsDirect,
        Backend::Uring,
        Backend::UringBatched,
        Backend::UringDirect,
        Backend::UringMemory,
    ];

    pub fn is_direct(self) -> bool {
        matches!(self, Backend::ThreadsDirect | Backend::UringDirect)
    }
}

/// A storage of any backend (holding its scratch directory alive).
pub enum TestStorage {
    Mem(MemStorage),
    Fault(FaultStorage<MemStorage>),
    Threads(ThreadsStorage, tempfile::TempDir),
    Uring(UringStorage, tempfile::TempDir),
}

/// Open a fresh, empty storage of `backend`.
pub async fn open(backend: Backend) -> TestStorage {
    let file = |dir: &tempfile::TempDir| -> PathBuf { dir.path().join("disk.img") };
    let opts = OpenOptions::create().with_direct(backend.is_direct());
    match backend {
        Backend::Mem => TestStorage::Mem(MemStorage::new()),
        Backend::FaultMem => TestStorage::Fault(FaultStorage::from_mem(MemStorage::new())),
        Backend::Threads | Backend::ThreadsDirect => {
            let dir = scratch_dir();
            let s = ThreadsStorage::open(&file(&dir), opts).await.expect("open");
            TestStorage::Threads(s, dir)
        }
        Backend::Uring | Backend::UringDirect | Backend::UringBatched => {
            let dir = scratch_dir();
            let reactor = if backend == Backend::UringBatched {
                Reactor::new(64, true)
            } else {
                Reactor::current()
            }
            .expect("io_uring must be available on this machine (kernel.io_uring_disabled=0)");
            let s = UringStorage::open_with(reactor, &file(&dir), opts)
                .await
                .expect("open");
            TestStorage::Uring(s, dir)
        }
        Backend::UringMemory => {
            let dir = memory_dir();
            let s = UringStorage::open(&file(&dir), opts).await.expect("open");
            assert!(
                s.raw().is_inline(),
                "/dev/shm is not seen as memory-backed: the inline path goes untested"
            );
            TestStorage::Uring(s, dir)
        }
    }
}

macro_rules! each {
    ($self:ident, $s:ident => $e:expr) => {
        match $self {
            TestStorage::Mem($s) => $e,
            TestStorage::Fault($s) => $e,
            TestStorage::Threads($s, _) => $e,
            TestStorage::Uring($s, _) => $e,
        }
    };
}

impl Storage for TestStorage {
    async fn read_at(
        &self,
        buf: storage::Slice,
        offset: u64,
    ) -> storage::BufResult<storage::Slice> {
        each!(self, s => s.read_at(buf, offset).await)
    }
    async fn write_at(
        &self,
        buf: storage::Slice,
        offset: u64,
    ) -> storage::BufResult<storage::Slice> {
        each!(self, s => s.write_at(buf, offset).await)
    }
    async fn write_zeroes_at(&self, offset: u64, len: u64, unmap: bool) -> std::io::Result<()> {
        each!(self, s => s.write_zeroes_at(offset, len, unmap).await)
    }
    async fn discard_at(&self, offset: u64, len: u64) -> std::io::Result<()> {
        each!(self, s => s.discard_at(offset, len).await)
    }
    async fn flush(&self) -> std::io::Result<()> {
        each!(self, s => s.flush().await)
    }
    async fn data_run(&self, offset: u64, len: u64) -> std::io::Result<(bool, u64)> {
        each!(self, s => s.data_run(offset, len).await)
    }
    async fn len(&self) -> std::io::Result<u64> {
        each!(self, s => s.len().await)
    }
    async fn set_len(&self, len: u64) -> std::io::Result<()> {
        each!(self, s => s.set_len(len).await)
    }
    fn zeroes_are_cheap(&self) -> bool {
        each!(self, s => s.zeroes_are_cheap())
    }
    fn alignment(&self) -> usize {
        each!(self, s => s.alignment())
    }
}

/// Write `data` at `offset`, panicking with context on failure.
pub async fn write<S: Storage>(s: &S, offset: u64, data: &[u8]) {
    let (res, _) = s
        .write_at(storage::IoBuf::from_slice(data).into(), offset)
        .await;
    res.unwrap_or_else(|e| panic!("write of {} bytes at {offset}: {e}", data.len()));
}

/// Read `len` bytes at `offset`.
pub async fn read<S: Storage>(s: &S, offset: u64, len: usize) -> Vec<u8> {
    let (res, buf) = s.read_at(storage::IoBuf::zeroed(len).into(), offset).await;
    res.unwrap_or_else(|e| panic!("read of {len} bytes at {offset}: {e}"));
    buf.to_vec()
}

/// Sets glibc's heap as the server does (buffers up to 32 MiB come from the heap, which is
/// not trimmed) and returns a probe of the heap's size in bytes, for the tests that bound
/// its growth.
#[cfg(all(target_os = "linux", target_env = "gnu"))]
pub fn server_heap() -> impl Fn() -> usize {
    // SAFETY: mallopt only changes allocator parameters, with values glibc accepts.
    unsafe {
        assert_eq!(libc::mallopt(libc::M_MMAP_THRESHOLD, 32 << 20), 1);
        assert_eq!(libc::mallopt(libc::M_TRIM_THRESHOLD, 32 << 20), 1);
    }
    // SAFETY: mallinfo2 only reads the allocator's statistics.
    || unsafe { libc::mallinfo2() }.arena
}
