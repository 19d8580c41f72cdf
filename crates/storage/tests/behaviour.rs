//! The same behaviour suite against every backend: memory, fault-injecting memory, threads and
//! io_uring, buffered and O_DIRECT.

mod common;

use std::rc::Rc;

use common::{open, read, write, Backend, TestStorage};
use storage::{IoBuf, Storage};
use test_support::{run, Rng};

async fn basic_read_write_len(s: &TestStorage) {
    assert_eq!(s.len().await.unwrap(), 0);
    write(s, 0, b"hello world").await;
    assert_eq!(s.len().await.unwrap(), 11);
    assert_eq!(read(s, 0, 11).await, b"hello world");
    assert_eq!(read(s, 6, 5).await, b"world");
    // A write past the end extends the file; the gap reads as zeros.
    write(s, 10_000, b"tail").await;
    assert_eq!(s.len().await.unwrap(), 10_004);
    let gap = read(s, 11, 9_989).await;
    assert!(
        gap.iter().all(|&b| b == 0),
        "gap before an extending write is not zero"
    );
    assert_eq!(read(s, 10_000, 4).await, b"tail");
    s.flush().await.unwrap();
    // Empty transfers are no-ops and do not extend.
    let (res, _) = s.write_at(IoBuf::zeroed(0).into(), 50_000).await;
    res.unwrap();
    assert_eq!(s.len().await.unwrap(), 10_004);
}

async fn reads_past_eof_are_zero(s: &TestStorage) {
    write(s, 0, &[0xAB; 1000]).await;
    let got = read(s, 900, 8192).await;
    assert_eq!(&got[..100], &[0xAB; 100][..]);
    assert!(
        got[100..].iter().all(|&b| b == 0),
        "bytes past EOF are not zero"
    );
    assert!(read(s, 1 << 30, 4096).await.iter().all(|&b| b == 0));
    assert_eq!(
        s.len().await.unwrap(),
        1000,
        "reading must not change the length"
    );
}

async fn set_len_truncates_and_extends_with_zeros(s: &TestStorage) {
    write(s, 0, &[7; 8192]).await;
    s.set_len(1000).await.unwrap();
    assert_eq!(s.len().await.unwrap(), 1000);
    s.set_len(6000).await.unwrap();
    assert_eq!(s.len().await.unwrap(), 6000);
    let got = read(s, 0, 6000).await;
    assert!(got[..1000].iter().all(|&b| b == 7));
    assert!(
        got[1000..].iter().all(|&b| b == 0),
        "truncated data came back"
    );
}

async fn write_zeroes_and_discard(s: &TestStorage) {
    let mut rng = Rng(1);
    let data = rng.bytes(256 * 1024);
    for unmap in [false, true] {
        write(s, 0, &data).await;
        // Unaligned head and tail, crossing many blocks.
        s.write_zeroes_at(1000, 100_000, unmap).await.unwrap();
        let got = read(s, 0, data.len()).await;
        assert_eq!(&got[..1000], &data[..1000], "unmap={unmap}: head clobbered");
        assert!(
            got[1000..101_000].iter().all(|&b| b == 0),
            "unmap={unmap}: not zeroed"
        );
        assert_eq!(
            &got[101_000..],
            &data[101_000..],
            "unmap={unmap}: tail clobbered"
        );
        assert_eq!(s.len().await.unwrap(), data.len() as u64);
    }
    // Zeroing past the end extends the file like a write.
    let len = data.len() as u64;
    s.write_zeroes_at(len + 5000, 3000, true).await.unwrap();
    assert_eq!(s.len().await.unwrap(), len + 8000);
    assert!(read(s, len, 8000).await.iter().all(|&b| b == 0));
    // Discard keeps the length; contents become zero or stay.
    write(s, 0, &data).await;
    s.discard_at(4096, 65536).await.unwrap();
    assert_eq!(s.len().await.unwrap(), len + 8000);
    let got = read(s, 4096, 65536).await;
    for (i, (&g, &d)) in got.iter().zip(&data[4096..4096 + 65536]).enumerate() {
        assert!(
            g == 0 || g == d,
            "discard produced byte {g} at {}",
            4096 + i
        );
    }
    s.discard_at(len + 100_000, 4096).await.unwrap();
    assert_eq!(
        s.len().await.unwrap(),
        len + 8000,
        "discard past EOF changed the length"
    );
}

async fn bad_ranges_are_errors(s: &TestStorage) {
    let (res, buf) = s.read_at(IoBuf::zeroed(16).into(), u64::MAX - 4).await;
    assert_eq!(res.unwrap_err().kind(), std::io::ErrorKind::InvalidInput);
    assert_eq!(buf.len(), 16, "buffer must come back on error");
    let (res, _) = s.write_at(IoBuf::zeroed(16).into(), i64::MAX as u64).await;
    assert_eq!(res.unwrap_err().kind(), std::io::ErrorKind::InvalidInput);
    let e = s.write_zeroes_at(u64::MAX, 2, false).await.unwrap_err();
    assert_eq!(e.kind(), std::io::ErrorKind::InvalidInput);
    assert!(s.discard_at(1, u64::MAX).await.is_err());
    assert!(s.set_len(u64::MAX).await.is_err());
}

async fn unaligned_io(s: &TestStorage) {
    let mut rng = Rng(2);
    let base = rng.bytes(64 * 1024);
    write(s, 0, &base).await;
    let mut model = base.clone();
    for _ in 0..200 {
        let off = rng.below(60_000) as usize;
        let len = 1 + rng.below(5000) as usize;
        let data = rng.bytes(len);
        // Also misalign the memory: the slice starts at an odd address inside its buffer.
        let skew = rng.below(8) as usize;
        let mut buf = IoBuf::zeroed(skew + len);
        buf[skew..].copy_from_slice(&data);
        let (res, _) = s.write_at(buf.slice(skew..skew + len), off as u64).await;
        res.unwrap();
        let end = (off + len).max(model.len());
        model.resize(end, 0);
        model[off..off + len].copy_from_slice(&data);
        let roff = rng.below(64_000) as usize;
        let rlen = 1 + rng.below(6000) as usize;
        let (res, got) = s
            .read_at(IoBuf::zeroed(rlen + 3).slice(3..rlen + 3), roff as u64)
            .await;
        res.unwrap();
        let mut want = vec![0u8; rlen];
        let avail = model.len().saturating_sub(roff).min(rlen);
        want[..avail].copy_from_slice(&model[roff..roff + avail]);
        assert_eq!(&got[..], &want[..], "read {rlen} at {roff}");
    }
    assert_eq!(s.len().await.unwrap(), model.len() as u64);
    // A sub-block write at EOF must not leave block padding behind.
    let end = model.len() as u64;
    write(s, end, b"xyz").await;
    assert_eq!(
        s.len().await.unwrap(),
        end + 3,
        "O_DIRECT padding leaked into the length"
    );
}

async fn concurrent_sub_block_writes_lose_no_update(s: Rc<TestStorage>) {
    write(&*s, 0, &[0u8; 16384]).await;
    // 8 writers per 4 KiB block, each 512 bytes at a different place in the same block, plus
    // unaligned 100-byte writers straddling sectors: all in flight together.
    let mut tasks = tokio::task::JoinSet::new();
    for block in 0..4u64 {
        for i in 0..8u64 {
            let s = Rc::clone(&s);
            let fill = (block * 8 + i + 1) as u8;
            tasks.spawn_local(async move {
                write(&*s, block * 4096 + i * 512, &[fill; 512]).await;
            });
        }
    }
    while let Some(r) = tasks.join_next().await {
        r.unwrap();
    }
    let got = read(&*s, 0, 16384).await;
    for block in 0..4u64 {
        for i in 0..8u64 {
            let at = (block * 4096 + i * 512) as usize;
            let fill = (block * 8 + i + 1) as u8;
            assert!(
                got[at..at + 512].iter().all(|&b| b == fill),
                "lost update in block {block} sector {i}"
            );
        }
    }
    let mut tasks = tokio::task::JoinSet::new();
    for i in 0..40u64 {
        let s = Rc::clone(&s);
        tasks.spawn_local(
            async move { write(&*s, 50 + i * 100, &[200 + (i % 50) as u8; 100]).await },
        );
    }
    while let Some(r) = tasks.join_next().await {
        r.unwrap();
    }
    let got = read(&*s, 0, 16384).await;
    for i in 0..40u64 {
        let at = (50 + i * 100) as usize;
        assert!(
            got[at..at + 100].iter().all(|&b| b == 200 + (i % 50) as u8),
            "lost 100-byte write {i}"
        );
    }
}

/// qd 64: batches of 64 non-overlapping random writes in flight at once, then 64 random reads
/// in flight at once, all compared with a model.
async fn many_concurrent_ops_match_model(s: Rc<TestStorage>) {
    const SIZE: usize = 4 << 20;
    let mut rng = Rng(3);
    let mut model = vec![0u8; SIZE];
    write(&*s, 0, &model).await;
    let align = s.alignment().max(512) as u64;
    for round in 0..6 {
        let mut ranges: Vec<(u64, usize)> = Vec::new();
        while ranges.len() < 64 {
            // Mostly aligned 4 KiB-ish I/O with some unaligned requests mixed in.
            let (off, len) = if rng.below(4) == 0 {
                (
                    rng.below(SIZE as u64 - 20_000),
                    1 + rng.below(20_000) as usize,
                )
            } else {
                (
                    rng.below(SIZE as u64 / align - 16) * align,
                    (1 + rng.below(16) as usize) * align as usize,
                )
            };
            if ranges
                .iter()
                .all(|&(o, l)| off + len as u64 <= o || o + l as u64 <= off)
            {
                ranges.push((off, len));
            }
        }
        let mut tasks = tokio::task::JoinSet::new();
        for &(off, len) in &ranges {
            let data = rng.bytes(len);
            model[off as usize..off as usize + len].copy_from_slice(&data);
            let s = Rc::clone(&s);
            tasks.spawn_local(async move { write(&*s, off, &data).await });
        }
        while let Some(r) = tasks.join_next().await {
            r.unwrap();
        }
        let mut tasks = tokio::task::JoinSet::new();
        for _ in 0..64 {
            let off = rng.below(SIZE as u64 - 9000);
            let len = 1 + rng.below(9000) as usize;
            let s = Rc::clone(&s);
            tasks.spawn_local(async move { (off, len, read(&*s, off, len).await) });
        }
        while let Some(r) = tasks.join_next().await {
            let (off, len, got) = r.unwrap();
            assert!(
                got == model[off as usize..off as usize + len],
                "round {round}: read of {len} at {off} differs from the model"
            );
        }
        s.flush().await.unwrap();
    }
    assert_eq!(read(&*s, 0, SIZE).await, model);
}

macro_rules! suite {
    ($($name:ident => $case:ident($arg:tt)),* $(,)?) => {
        $(
            #[test]
            fn $name() {
                for backend in Backend::ALL {
                    run(async {
                        let s = open(backend).await;
                        eprintln!("backend {backend:?}");
                        suite!(@call $case, $arg, s);
                    });
                }
            }
        )*
    };
    (@call $case:ident, ref, $s:ident) => { $case(&$s).await };
    (@call $case:ident, rc, $s:ident) => { $case(Rc::new($s)).await };
}

suite! {
    every_backend_reads_and_writes => basic_read_write_len(ref),
    every_backend_reads_zeros_past_eof => reads_past_eof_are_zero(ref),
    every_backend_set_len => set_len_truncates_and_extends_with_zeros(ref),
    every_backend_zeroes_and_discards => write_zeroes_and_discard(ref),
    every_backend_rejects_bad_ranges => bad_ranges_are_errors(ref),
    every_backend_handles_unaligned_io => unaligned_io(ref),
    every_backend_keeps_concurrent_sub_block_writes => concurrent_sub_block_writes_lose_no_update(rc),
    every_backend_qd64_matches_model => many_concurrent_ops_match_model(rc),
}

#[test]
fn direct_backends_report_alignment_and_files_have_cheap_zeroes() {
    run(async {
        for backend in Backend::ALL {
            let s = open(backend).await;
            let a = s.alignment();
            if backend.is_direct() {
                assert!(
                    a == 512 || a == 4096,
                    "{backend:?}: odd O_DIRECT alignment {a}"
                );
            } else {
                assert_eq!(a, 1, "{backend:?}");
            }
            // Scratch files live on the ext4 target directory, where fallocate works; tmpfs
            // has no ZERO_RANGE, so zeroes there are written.
            assert_eq!(
                s.zeroes_are_cheap(),
                backend != Backend::UringMemory,
                "{backend:?}: which file systems have cheap zeroes"
            );
        }
    });
}

/// On tmpfs a data run is not followed to its end, because `SEEK_HOLE` there walks every
/// page up to the next hole (the whole file for a fully written one), which made each read
/// of a raw export cost milliseconds; holes are still found.
#[test]
fn tmpfs_data_runs_find_holes_without_seeking_the_end_of_data() {
    run(async {
        let (m1, m2) = (1u64 << 20, 2u64 << 20);
        let s = open(Backend::UringMemory).await;
        for at in [0, m1] {
            let (res, _) = s
                .write_at(IoBuf::from_slice(&[7u8; 65536]).into(), at)
                .await;
            res.unwrap();
        }
        assert_eq!(s.data_run(0, m2).await.unwrap(), (true, m2));
        assert_eq!(s.data_run(m1 / 2, m2).await.unwrap(), (false, m1 / 2));
    });
}

#[test]
fn read_only_files_refuse_writes() {
    run(async {
        let dir = common::scratch_dir();
        let path = dir.path().join("ro.img");
        std::fs::write(&path, b"data").unwrap();
        let uring = storage::UringStorage::open(&path, storage::OpenOptions::read_only())
            .await
            .unwrap();
        let threads = storage::ThreadsStorage::open(&path, storage::OpenOptions::read_only())
            .await
            .unwrap();
        for s in [
            storage::AnyStorage::Uring(uring),
            storage::AnyStorage::Threads(threads),
        ] {
            assert_eq!(read(&s, 0, 4).await, b"data");
            let (res, _) = s.write_at(IoBuf::from_slice(b"x").into(), 0).await;
            assert!(
                res.is_err(),
                "{:?}: write to a read-only file succeeded",
                s.aio()
            );
        }
        let e = storage::ThreadsStorage::open(
            &dir.path().join("missing"),
            storage::OpenOptions::read_only(),
        )
        .await
        .err()
        .expect("opening a missing file must fail");
        assert!(
            e.to_string().contains("missing"),
            "error does not name the file: {e}"
        );
    });
}

#[test]
fn file_opener_opens_both_backends() {
    use storage::{Aio, FileOpener, OpenOptions, Opener};
    run(async {
        let dir = common::scratch_dir();
        for (aio, direct) in [
            (Aio::IoUring, false),
            (Aio::IoUring, true),
            (Aio::Threads, false),
            (Aio::Threads, true),
        ] {
            let path = dir.path().join(format!("{aio:?}-{direct}.img"));
            let s = FileOpener {
                aio,
                direct,
                // No image locks: see the note on test processes in storage::lock.
                locking: storage::Locking::Off,
            }
            .open(&path, OpenOptions::create())
            .await
            .unwrap();
            assert_eq!(
                s.aio(),
                aio,
                "io_uring is available here, no fallback expected"
            );
            assert_eq!(s.alignment() > 1, direct);
            write(&s, 3, b"abc").await;
            assert_eq!(read(&s, 0, 6).await, b"\0\0\0abc");
        }
        assert_eq!("threads".parse::<Aio>(), Ok(Aio::Threads));
        assert!("posix".parse::<Aio>().is_err());
    });
}

#[test]
fn file_opener_falls_back_to_threads_without_runtime_io() {
    use storage::{Aio, FileOpener, OpenOptions, Opener};
    // A runtime without the I/O driver cannot host the io_uring reactor.
    let rt = tokio::runtime::Builder::new_current_thread()
        .build()
        .unwrap();
    rt.block_on(async {
        let dir = common::scratch_dir();
        let s = FileOpener {
            aio: Aio::IoUring,
            direct: false,
            // No image locks: see the note on test processes in storage::lock.
            locking: storage::Locking::Off,
        }
        .open(&dir.path().join("f.img"), OpenOptions::create())
        .await
        .unwrap();
        assert_eq!(s.aio(), Aio::Threads);
        write(&s, 0, b"ok").await;
        assert_eq!(read(&s, 0, 2).await, b"ok");
    });
}

#[test]
fn file_backends_open_regular_files_only_and_name_what_else_they_were_given() {
    use storage::{Aio, FileKind, FileOpener, NotAnImageFile, OpenOptions, Opener};
    run(async {
        let dir = common::scratch_dir();
        let fifo = dir.path().join("fifo");
        let c_fifo = std::ffi::CString::new(fifo.to_str().unwrap()).unwrap();
        // SAFETY: mkfifo reads a valid NUL-terminated path.
        assert_eq!(unsafe { libc::mkfifo(c_fifo.as_ptr(), 0o600) }, 0);
        let socket = dir.path().join("sock");
        let _listening = std::os::unix::net::UnixListener::bind(&socket).unwrap();
        let refused = [
            (fifo.as_path(), FileKind::Fifo),
            (dir.path(), FileKind::Directory),
            (socket.as_path(), FileKind::Socket),
            (std::path::Path::new("/dev/null"), FileKind::CharDevice),
        ];
        for aio in [Aio::IoUring, Aio::Threads] {
            let opener = FileOpener {
                aio,
                direct: false,
                // No image locks: see the note on test processes in storage::lock.
                locking: storage::Locking::Off,
            };
            for (path, kind) in refused {
                // Read-only: a FIFO would block this open until a writer came.
                let err = match opener.open(path, OpenOptions::read_only()).await {
                    Ok(_) => panic!("{aio:?}: {} was opened", path.display()),
                    Err(e) => e,
                };
                let inner = err
                    .get_ref()
                    .and_then(|e| e.downcast_ref::<NotAnImageFile>())
                    .unwrap_or_else(|| panic!("{aio:?} {}: {err}", path.display()));
                assert_eq!(inner.kind, kind);
                let text = err.to_string();
                assert!(
                    text.contains(&path.display().to_string())
                        && text.contains("regular file or a block device"),
                    "{text}"
                );
            }
            // A regular file, and one the open creates, are fine.
            let new = dir.path().join(format!("{aio:?}.img"));
            let s = opener.open(&new, OpenOptions::create()).await.unwrap();
            write(&s, 0, b"ok").await;
            let s = opener.open(&new, OpenOptions::read_only()).await.unwrap();
            assert_eq!(read(&s, 0, 2).await, b"ok");
        }
    });
}
