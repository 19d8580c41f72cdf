//! FaultStorage: crash images are exactly the durable state plus the chosen unflushed
//! operations, flush only covers completed operations, and injected errors fire as asked.

mod common;

use std::cell::RefCell;
use std::rc::Rc;

use common::{read, write};
use storage::{
    BufResult, CrashPlan, FaultStorage, InjectedError, IoBuf, MemStorage, OpKind, Slice, Storage,
    Survival,
};
use test_support::{rss_bytes, run, Rng};

/// An independent model of one logged modification, applied to a Vec.
#[derive(Clone, Debug)]
enum ModelOp {
    Write(u64, Vec<u8>),
    Zero(u64, u64),
    SetLen(u64),
}

fn apply(model: &mut Vec<u8>, op: &ModelOp) {
    match op {
        ModelOp::Write(off, data) => {
            let (off, end) = (*off as usize, *off as usize + data.len());
            if model.len() < end {
                model.resize(end, 0);
            }
            model[off..end].copy_from_slice(data);
        }
        ModelOp::Zero(off, len) => {
            let (off, end) = (*off as usize, (*off + *len) as usize);
            if model.len() < end {
                model.resize(end, 0);
            }
            model[off..end].fill(0);
        }
        ModelOp::SetLen(len) => model.resize(*len as usize, 0),
    }
}

async fn issue<S: Storage>(s: &S, op: &ModelOp) {
    match op {
        ModelOp::Write(off, data) => write(s, *off, data).await,
        ModelOp::Zero(off, len) => s.write_zeroes_at(*off, *len, false).await.unwrap(),
        ModelOp::SetLen(len) => s.set_len(*len).await.unwrap(),
    }
}

#[test]
fn crash_images_are_durable_state_plus_exactly_the_chosen_subset() {
    run(async {
        let fs = FaultStorage::from_mem(MemStorage::from_bytes(&[1u8; 3000]));
        let mut durable = vec![1u8; 3000];
        let flushed = ModelOp::Write(100, vec![2; 500]);
        issue(&fs, &flushed).await;
        apply(&mut durable, &flushed);
        fs.flush().await.unwrap();
        assert_eq!(fs.unflushed_ops(), 0);
        // Overlapping unflushed operations, so order matters.
        let ops = vec![
            ModelOp::Write(0, vec![3; 1000]),
            ModelOp::Zero(500, 1000),
            ModelOp::Write(900, vec![4; 5000]),
            ModelOp::SetLen(4000),
            ModelOp::Write(70_000, vec![5; 100]),
        ];
        for op in &ops {
            issue(&fs, op).await;
        }
        assert_eq!(fs.unflushed_ops(), ops.len());
        for mask in 0u32..1 << ops.len() {
            let keep: Vec<bool> = (0..ops.len()).map(|i| mask & (1 << i) != 0).collect();
            let mut want = durable.clone();
            for (op, &k) in ops.iter().zip(&keep) {
                if k {
                    apply(&mut want, op);
                }
            }
            let image = fs.crash_image(&CrashPlan::mask(&keep));
            assert_eq!(image.to_vec(), want, "mask {keep:?}");
        }
        assert_eq!(fs.durable_image().to_vec(), durable);
        // Keeping everything is the live contents.
        let all = fs.crash_image(&CrashPlan::mask(&[true; 5]));
        assert_eq!(all.to_vec(), fs.inner().to_vec());
    });
}

#[test]
fn random_plans_match_a_model_of_their_survivals() {
    run(async {
        let fs = FaultStorage::from_mem(MemStorage::new());
        let mut rng = Rng(11);
        let mut durable = Vec::new();
        let mut ops = Vec::new();
        for step in 0..300 {
            let op = match rng.below(10) {
                0 => ModelOp::Zero(rng.below(100_000), rng.below(10_000)),
                1 => ModelOp::SetLen(rng.below(120_000)),
                _ => {
                    let len = 1 + rng.below(3000) as usize;
                    ModelOp::Write(rng.below(100_000), rng.bytes(len))
                }
            };
            issue(&fs, &op).await;
            ops.push(op);
            if step % 50 == 49 {
                // Check many crash points of this epoch, then make it durable.
                for seed in 0..40 {
                    let plan = CrashPlan::Random { seed, tear: false };
                    let mut want = durable.clone();
                    for (op, s) in ops.iter().zip(plan.survivals(ops.len())) {
                        if s == Survival::Kept {
                            apply(&mut want, op);
                        }
                    }
                    assert_eq!(
                        fs.crash_image(&plan).to_vec(),
                        want,
                        "step {step} seed {seed}"
                    );
                }
                fs.flush().await.unwrap();
                for op in ops.drain(..) {
                    apply(&mut durable, &op);
                }
                assert_eq!(fs.unflushed_ops(), 0);
                assert_eq!(fs.durable_image().to_vec(), durable);
            }
        }
    });
}

#[test]
fn torn_writes_keep_or_lose_whole_sectors() {
    run(async {
        let fs = FaultStorage::from_mem(MemStorage::from_bytes(&[0u8; 8192]));
        write(&fs, 300, &[9u8; 4000]).await;
        let mut seen_partial = false;
        for seed in 0..64 {
            let image = fs.crash_image(&CrashPlan::Explicit(vec![Survival::Torn { seed }]));
            let v = image.to_vec();
            let mut kept = 0;
            let mut pos = 300usize;
            while pos < 4300 {
                let end = 4300.min((pos / 512 + 1) * 512);
                let piece = &v[pos..end];
                let all_new = piece.iter().all(|&b| b == 9);
                assert!(
                    all_new || piece.iter().all(|&b| b == 0),
                    "seed {seed}: torn inside a sector at {pos}"
                );
                kept += usize::from(all_new);
                pos = end;
            }
            seen_partial |= kept > 0 && kept < 9;
            assert!(v[..300].iter().chain(&v[4300..]).all(|&b| b == 0));
        }
        assert!(seen_partial, "no seed produced a partially written request");
    });
}

/// A storage whose writes wait for a gate, so a flush can run while a write is in flight.
#[derive(Clone, Default)]
struct Gated {
    mem: MemStorage,
    gate: Rc<tokio::sync::Notify>,
    flushes: Rc<RefCell<u32>>,
}

impl Storage for Gated {
    async fn read_at(&self, buf: Slice, offset: u64) -> BufResult<Slice> {
        self.mem.read_at(buf, offset).await
    }
    async fn write_at(&self, buf: Slice, offset: u64) -> BufResult<Slice> {
        self.gate.notified().await;
        self.mem.write_at(buf, offset).await
    }
    async fn write_zeroes_at(&self, offset: u64, len: u64, unmap: bool) -> std::io::Result<()> {
        self.mem.write_zeroes_at(offset, len, unmap).await
    }
    async fn discard_at(&self, offset: u64, len: u64) -> std::io::Result<()> {
        self.mem.discard_at(offset, len).await
    }
    async fn flush(&self) -> std::io::Result<()> {
        *self.flushes.borrow_mut() += 1;
        Ok(())
    }
    async fn len(&self) -> std::io::Result<u64> {
        self.mem.len().await
    }
    async fn set_len(&self, len: u64) -> std::io::Result<()> {
        self.mem.set_len(len).await
    }
    fn zeroes_are_cheap(&self) -> bool {
        true
    }
    fn alignment(&self) -> usize {
        1
    }
}

#[test]
fn flush_covers_only_operations_completed_before_it() {
    run(async {
        let gated = Gated::default();
        let fs = Rc::new(FaultStorage::new(gated.clone()).await.unwrap());
        fs.write_zeroes_at(0, 10, false).await.unwrap(); // completes at once
        let writer = {
            let fs = Rc::clone(&fs);
            tokio::task::spawn_local(async move { write(&*fs, 100, b"in flight").await })
        };
        tokio::task::yield_now().await; // the write is now waiting at the gate
        assert_eq!(fs.unflushed_ops(), 2);
        fs.flush().await.unwrap();
        assert_eq!(*gated.flushes.borrow(), 1);
        assert_eq!(
            fs.unflushed_ops(),
            1,
            "the in-flight write must stay unflushed"
        );
        assert_eq!(fs.durable_image().size(), 10);
        gated.gate.notify_one();
        writer.await.unwrap();
        fs.flush().await.unwrap();
        assert_eq!(fs.unflushed_ops(), 0);
        assert_eq!(&fs.durable_image().to_vec()[100..109], b"in flight");
    });
}

#[test]
fn injected_errors_fire_on_the_chosen_operations() {
    run(async {
        let fs = FaultStorage::from_mem(MemStorage::new());
        fs.fail_nth(OpKind::Write, 2, InjectedError::Eio);
        write(&fs, 0, b"one").await;
        let (res, buf) = fs.write_at(IoBuf::from_slice(b"two").into(), 10).await;
        let e = res.unwrap_err();
        assert_eq!(e.raw_os_error(), None);
        assert!(e.to_string().contains("Input/output error"), "{e}");
        assert_eq!(
            &buf[..],
            b"two",
            "buffer must come back on an injected error"
        );
        write(&fs, 20, b"three").await;
        assert_eq!(
            read(&fs, 0, 25).await,
            b"one\0\0\0\0\0\0\0\0\0\0\0\0\0\0\0\0\0three"
        );
        assert_eq!(
            fs.unflushed_ops(),
            2,
            "a failed write never reached the disk"
        );

        fs.fail_nth(OpKind::Flush, 1, InjectedError::Eio);
        assert!(fs.flush().await.is_err());
        assert_eq!(
            fs.unflushed_ops(),
            2,
            "a failed flush makes nothing durable"
        );

        fs.fail_after(2, InjectedError::Enospc);
        read(&fs, 0, 1).await;
        write(&fs, 0, b"x").await;
        let (res, _) = fs.read_at(IoBuf::zeroed(1).into(), 0).await;
        assert_eq!(res.unwrap_err().kind(), std::io::ErrorKind::StorageFull);
        assert!(fs.flush().await.is_err());
        assert!(fs.set_len(0).await.is_err());
        assert!(fs.discard_at(0, 1).await.is_err());
        fs.clear_faults();
        fs.flush().await.unwrap();
        assert_eq!(fs.unflushed_ops(), 0);

        let st = fs.stats();
        assert_eq!(st.writes, 4);
        assert_eq!(st.flushes, 3);
        assert_eq!(st.reads, 3);
        assert_eq!(st.injected_errors, 6);
        assert_eq!(st.bytes_written, 3 + 5 + 1, "refused writes count no bytes");
    });
}

#[test]
fn fault_storage_wraps_a_file_backend() {
    run(async {
        let dir = common::scratch_dir();
        let path = dir.path().join("f.img");
        std::fs::write(&path, vec![6u8; 100_000]).unwrap();
        let file = storage::ThreadsStorage::open(&path, storage::OpenOptions::read_write())
            .await
            .unwrap();
        let fs = FaultStorage::new(file).await.unwrap();
        assert_eq!(fs.durable_image().to_vec(), vec![6u8; 100_000]);
        write(&fs, 5, b"new").await;
        assert_eq!(&read(&fs, 4, 5).await, b"\x06new\x06");
        assert_eq!(
            fs.crash_image(&CrashPlan::mask(&[])).to_vec(),
            vec![6u8; 100_000]
        );
        fs.flush().await.unwrap();
        assert_eq!(&fs.durable_image().to_vec()[5..8], b"new");
        assert_eq!(std::fs::read(&path).unwrap()[5..8], *b"new");
    });
}

#[test]
fn crash_images_of_a_large_image_share_memory() {
    run(async {
        // 64 MiB of durable data; a thousand crash images must not copy it.
        let fs = FaultStorage::from_mem(MemStorage::new());
        write(&fs, 0, &vec![1u8; 64 << 20]).await;
        fs.flush().await.unwrap();
        for i in 0..64u64 {
            write(&fs, i * 1_000_003 % (64 << 20), &[2u8; 4096]).await;
        }
        let before = rss_bytes();
        let mut images = Vec::new();
        for seed in 0..100 {
            images.push(fs.crash_image(&CrashPlan::Random { seed, tear: true }));
        }
        let grown = rss_bytes().saturating_sub(before);
        // Copying would take 100 x 64 MiB; sharing costs the touched chunks only.
        assert!(
            grown < 512 << 20,
            "100 crash images grew RSS by {grown} bytes"
        );
        assert!(images.iter().all(|i| i.size() == 64 << 20));
        let image = fs.crash_image(&CrashPlan::mask(&[true; 64]));
        assert_eq!(image.to_vec(), fs.inner().to_vec());
    });
}
