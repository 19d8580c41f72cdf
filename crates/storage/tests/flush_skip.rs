//! A file storage's flush calls `fdatasync` only when a modification completed since the last
//! successful one: closing an image that was only read costs no disk flush, and a write that
//! completes after a flush began is still made durable by the next.

use std::cell::Cell;
use std::fs::File;
use std::io;
use std::os::unix::fs::FileExt;
use std::rc::Rc;

use storage::file::{FileStorage, RawFile};
use storage::{IoBuf, Slice, Storage};
use test_support::run;
use tokio::sync::Notify;

/// Plain synchronous file I/O that counts `fdatasync` calls and can hold writes back.
struct Counting {
    file: File,
    syncs: Cell<u32>,
    fail_sync: Cell<bool>,
    hold_writes: Cell<bool>,
    release: Rc<Notify>,
}

impl RawFile for Counting {
    async fn read(&self, mut buf: Slice, offset: u64) -> (io::Result<usize>, Slice) {
        let r = self.file.read_at(&mut buf, offset);
        (r, buf)
    }
    async fn write(&self, buf: Slice, offset: u64) -> (io::Result<usize>, Slice) {
        if self.hold_writes.get() {
            self.release.notified().await;
        }
        let r = self.file.write_at(&buf, offset);
        (r, buf)
    }
    async fn fallocate(&self, _mode: i32, _offset: u64, _len: u64) -> io::Result<()> {
        Err(io::Error::from_raw_os_error(libc::EOPNOTSUPP))
    }
    async fn fdatasync(&self) -> io::Result<()> {
        if self.fail_sync.get() {
            return Err(io::Error::other("injected fdatasync failure"));
        }
        self.syncs.set(self.syncs.get() + 1);
        self.file.sync_data()
    }
    async fn set_len(&self, len: u64) -> io::Result<()> {
        self.file.set_len(len)
    }
    fn file(&self) -> &File {
        &self.file
    }
}

fn storage() -> (tempfile::TempDir, Rc<FileStorage<Counting>>) {
    let dir = tempfile::tempdir().expect("tempdir");
    let file = File::options()
        .read(true)
        .write(true)
        .create(true)
        .truncate(true)
        .open(dir.path().join("f"))
        .expect("file");
    let raw = Counting {
        file,
        syncs: Cell::new(0),
        fail_sync: Cell::new(false),
        hold_writes: Cell::new(false),
        release: Rc::new(Notify::new()),
    };
    (dir, Rc::new(FileStorage::from_file(raw, false)))
}

fn syncs(s: &FileStorage<Counting>) -> u32 {
    s.raw().syncs.get()
}

async fn write(s: &FileStorage<Counting>, offset: u64) {
    let (res, _) = s
        .write_at(IoBuf::from_slice(&[7; 512]).into(), offset)
        .await;
    res.expect("write");
}

#[test]
fn a_flush_with_nothing_new_makes_no_fdatasync() {
    run(async {
        let (_dir, s) = storage();
        s.flush().await.expect("flush");
        assert_eq!(syncs(&s), 0);
        write(&s, 0).await;
        s.flush().await.expect("flush");
        s.flush().await.expect("flush");
        assert_eq!(syncs(&s), 1);
        s.set_len(4096).await.expect("set_len");
        s.flush().await.expect("flush");
        s.write_zeroes_at(0, 512, false).await.expect("zeroes");
        s.flush().await.expect("flush");
        assert_eq!(syncs(&s), 3);
    });
}

#[test]
fn a_failed_fdatasync_is_tried_again_by_the_next_flush() {
    run(async {
        let (_dir, s) = storage();
        write(&s, 0).await;
        s.raw().fail_sync.set(true);
        assert!(s.flush().await.is_err());
        s.raw().fail_sync.set(false);
        s.flush().await.expect("flush");
        assert_eq!(syncs(&s), 1);
    });
}

#[test]
fn a_write_that_completes_during_a_flush_is_synced_by_the_next() {
    run(async {
        let (_dir, s) = storage();
        s.raw().hold_writes.set(true);
        let w = {
            let s = s.clone();
            tokio::task::spawn_local(async move { write(&s, 0).await })
        };
        tokio::task::yield_now().await;
        // The write has not completed: this flush need not (and does not) cover it.
        s.flush().await.expect("flush");
        assert_eq!(syncs(&s), 0);
        s.raw().hold_writes.set(false);
        s.raw().release.notify_one();
        w.await.expect("write task");
        s.flush().await.expect("flush");
        assert_eq!(syncs(&s), 1);
    });
}
