//! The guess whether an image was made with `preallocation=metadata` is made once, however
//! many requests need it at the same moment: each guess reads the refcount table and a
//! refcount block into memory, and a fresh client at queue depth 32 used to make 32 of them
//! at once (megabytes of heap the allocator then kept).

use crate::support::opener;
use qcow2::engine::{Image, OpenOptions, ReadPart};
use qcow2::format::header::Header;
use qcow2::format::GuestOffset;
use std::cell::Cell;
use std::io;
use std::path::Path;
use std::rc::Rc;
use storage::{Aio, AnyStorage, BufResult, FileOpener, Opener, Slice, Storage};
use test_support::{qemu_img, run, Dir};

/// A file that counts the reads starting at one offset (the refcount table's) and lets other
/// tasks run before each read, so requests in flight overlap whatever the backend.
struct Counting {
    inner: AnyStorage,
    watched: u64,
    hits: Rc<Cell<u64>>,
}

impl Storage for Counting {
    async fn read_at(&self, buf: Slice, offset: u64) -> BufResult<Slice> {
        if offset == self.watched {
            self.hits.set(self.hits.get() + 1);
        }
        tokio::task::yield_now().await;
        self.inner.read_at(buf, offset).await
    }
    async fn write_at(&self, buf: Slice, offset: u64) -> BufResult<Slice> {
        self.inner.write_at(buf, offset).await
    }
    async fn write_zeroes_at(&self, offset: u64, len: u64, unmap: bool) -> io::Result<()> {
        self.inner.write_zeroes_at(offset, len, unmap).await
    }
    async fn discard_at(&self, offset: u64, len: u64) -> io::Result<()> {
        self.inner.discard_at(offset, len).await
    }
    async fn data_run(&self, offset: u64, len: u64) -> io::Result<(bool, u64)> {
        self.inner.data_run(offset, len).await
    }
    fn allocated_size(&self) -> Option<u64> {
        self.inner.allocated_size()
    }
    async fn flush(&self) -> io::Result<()> {
        self.inner.flush().await
    }
    async fn len(&self) -> io::Result<u64> {
        self.inner.len().await
    }
    async fn set_len(&self, len: u64) -> io::Result<()> {
        self.inner.set_len(len).await
    }
    fn zeroes_are_cheap(&self) -> bool {
        self.inner.zeroes_are_cheap()
    }
    fn alignment(&self) -> usize {
        self.inner.alignment()
    }
}

struct CountingOpener {
    files: FileOpener,
    watched: u64,
    hits: Rc<Cell<u64>>,
}

impl Opener for CountingOpener {
    type Storage = Counting;
    async fn open(&self, path: &Path, opts: storage::OpenOptions) -> io::Result<Counting> {
        Ok(Counting {
            inner: self.files.open(path, opts).await?,
            watched: self.watched,
            hits: self.hits.clone(),
        })
    }
}

/// Where the image's header says its refcount table is.
fn refcount_table_offset(path: &Path) -> u64 {
    let head = std::fs::read(path).unwrap();
    Header::decode(&head).unwrap().refcount_table_offset
}

#[test]
fn concurrent_sparse_reads_guess_preallocation_once() {
    let d = Dir::new();
    let path = d.path("prealloc.qcow2");
    qemu_img(&[
        "create",
        "-q",
        "-f",
        "qcow2",
        "-o",
        "preallocation=metadata",
        &d.s("prealloc.qcow2"),
        "64M",
    ]);
    let hits = Rc::new(Cell::new(0));
    let files = CountingOpener {
        files: opener(Aio::Threads),
        watched: refcount_table_offset(&path),
        hits: hits.clone(),
    };
    let opts = OpenOptions {
        read_only: true,
        ..OpenOptions::default()
    };
    run(async {
        let image = Rc::new(Image::open(&files, &path, &opts).await.unwrap());
        let before_reads = hits.get();
        let tasks: Vec<_> = (0..32u64)
            .map(|i| {
                let image = image.clone();
                tokio::task::spawn_local(async move {
                    image
                        .read_sparse(GuestOffset(i * (2 << 20)), 4096)
                        .await
                        .unwrap()
                })
            })
            .collect();
        for t in tasks {
            let parts = t.await.unwrap();
            // Still the right answer for every request: preallocated clusters over holes of
            // the file are holes.
            assert!(
                matches!(parts[..], [ReadPart::Hole(4096)]),
                "a preallocated cluster was not sent as a hole"
            );
        }
        assert_eq!(
            hits.get() - before_reads,
            1,
            "32 concurrent requests each read the refcount table to guess preallocation"
        );
    });
}
