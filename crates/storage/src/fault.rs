//! Fault injection: a storage wrapper that remembers which modifications are not yet durable,
//! produces "crash images" (durable state plus any chosen subset of them, optionally torn at
//! sector granularity) and fails chosen operations.
//!
//! The durable state is a copy-on-write [`MemData`] kept beside the wrapped storage; a
//! completed flush moves the operations it covers from the log into it. A crash image is a
//! clone of that base (one pointer per 64 KiB chunk) plus the chosen log entries, so thousands
//! of crash points cost little more than the writes they replay.

use std::cell::RefCell;
use std::io;
use std::rc::Rc;

use crate::error::{checked_end, len_u64};
use crate::mem::MemData;
use crate::{BufResult, IoBuf, MemStorage, Slice, Storage};

/// Sector size at which crash images may tear a write.
pub const SECTOR: u64 = 512;

/// Kinds of storage operations, for statistics and error injection.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum OpKind {
    /// `read_at`.
    Read,
    /// `write_at`.
    Write,
    /// `write_zeroes_at`.
    WriteZeroes,
    /// `discard_at`.
    Discard,
    /// `flush`.
    Flush,
    /// `set_len`.
    SetLen,
}

/// The error an injected fault returns.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum InjectedError {
    /// `EIO`: the device failed.
    Eio,
    /// `ENOSPC`: the device is full.
    Enospc,
}

impl InjectedError {
    fn to_io(self, kind: OpKind) -> io::Error {
        let errno = match self {
            InjectedError::Eio => libc::EIO,
            InjectedError::Enospc => libc::ENOSPC,
        };
        let os = io::Error::from_raw_os_error(errno);
        io::Error::new(os.kind(), format!("injected fault in {kind:?}: {os}"))
    }
}

/// What happens to one unflushed operation in a crash image.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Survival {
    /// The operation never reached the disk.
    Lost,
    /// The operation reached the disk entirely.
    Kept,
    /// Writes and zeroings: each 512-byte sector reached the disk or not, chosen by `seed`.
    /// Other operations are kept whole.
    Torn {
        /// Seed of the per-sector choice.
        seed: u64,
    },
}

/// How to choose the surviving unflushed operations of a crash image.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum CrashPlan {
    /// A pseudo-random subset chosen by `seed`; with `tear`, kept writes may also be torn.
    Random {
        /// Seed of every choice (the same seed gives the same image for the same log).
        seed: u64,
        /// Allow torn writes.
        tear: bool,
    },
    /// One choice per unflushed operation, oldest first; missing entries are [`Survival::Lost`].
    Explicit(Vec<Survival>),
}

impl CrashPlan {
    /// Keep exactly the operations whose mask entry is true (oldest first).
    pub fn mask(mask: &[bool]) -> CrashPlan {
        CrashPlan::Explicit(
            mask.iter()
                .map(|&keep| if keep { Survival::Kept } else { Survival::Lost })
                .collect(),
        )
    }

    /// The concrete choice for each of `n` operations.
    pub fn survivals(&self, n: usize) -> Vec<Survival> {
        match self {
            CrashPlan::Explicit(v) => (0..n)
                .map(|i| v.get(i).copied().unwrap_or(Survival::Lost))
                .collect(),
            CrashPlan::Random { seed, tear } => {
                let mut rng = crate::rng::Rng(*seed);
                // Vary the keep probability per plan so that "nothing", "everything" and
                // prefix-like outcomes are common, not just half-and-half subsets.
                let keep_in_8 = rng.next_u64() % 9;
                (0..n)
                    .map(|_| {
                        if rng.next_u64() % 8 >= keep_in_8 {
                            Survival::Lost
                        } else if *tear && rng.next_u64() % 4 == 0 {
                            Survival::Torn {
                                seed: rng.next_u64(),
                            }
                        } else {
                            Survival::Kept
                        }
                    })
                    .collect()
            }
        }
    }
}

/// Counters of operations seen by a [`FaultStorage`].
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct FaultStats {
    /// `read_at` calls.
    pub reads: u64,
    /// `write_at` calls.
    pub writes: u64,
    /// `write_zeroes_at` calls.
    pub write_zeroes: u64,
    /// `discard_at` calls.
    pub discards: u64,
    /// `flush` calls.
    pub flushes: u64,
    /// `set_len` calls.
    pub set_lens: u64,
    /// Bytes passed to `write_at`.
    pub bytes_written: u64,
    /// Operations failed on purpose.
    pub injected_errors: u64,
}

impl FaultStats {
    /// Every operation of any kind: what [`FaultStorage::fail_after`] counts, so a crash
    /// campaign can fail after each one in turn.
    pub fn operations(&self) -> u64 {
        self.reads + self.writes + self.write_zeroes + self.discards + self.flushes + self.set_lens
    }
}

/// An operation that changes contents, as remembered until a flush covers it.
#[derive(Debug, Clone)]
enum Modification {
    Write { offset: u64, data: Rc<[u8]> },
    Zero { offset: u64, len: u64 },
    Discard { offset: u64, len: u64 },
    SetLen { len: u64 },
}

impl Modification {
    fn apply(&self, data: &mut MemData) {
        match self {
            Modification::Write {
                offset,
                data: bytes,
            } => data.write(*offset, bytes),
            Modification::Zero { offset, len } => data.write_zeroes(*offset, *len),
            Modification::Discard { offset, len } => data.zero(*offset, *len),
            Modification::SetLen { len } => data.set_len(*len),
        }
    }

    /// Apply only the sectors `seed` picks (writes and zeroings; others whole).
    fn apply_torn(&self, data: &mut MemData, seed: u64) {
        let (offset, len) = match self {
            Modification::Write { offset, data } => (*offset, len_u64(data.len())),
            Modification::Zero { offset, len } => (*offset, *len),
            _ => return self.apply(data),
        };
        let mut rng = crate::rng::Rng(seed);
        let end = offset + len;
        let mut pos = offset;
        while pos < end {
            let piece_end = end.min((pos / SECTOR + 1) * SECTOR);
            if rng.next_u64() & 1 == 1 {
                match self {
                    Modification::Write { data: bytes, .. } => {
                        let a = usize::try_from(pos - offset).unwrap_or(usize::MAX);
                        let b = usize::try_from(piece_end - offset).unwrap_or(usize::MAX);
                        if let Some(piece) = bytes.get(a..b) {
                            data.write(pos, piece);
                        }
                    }
                    _ => data.write_zeroes(pos, piece_end - pos),
                }
            }
            pos = piece_end;
        }
    }
}

#[derive(Debug)]
struct LogEntry {
    id: u64,
    modification: Modification,
    completed: bool,
}

#[derive(Debug, Clone, Copy)]
enum Rule {
    /// Fail the `n`-th (1-based) operation of `kind` counted from when the rule was set.
    Nth {
        kind: OpKind,
        n: u64,
        seen: u64,
        error: InjectedError,
    },
    /// Let `remaining` more operations through, then fail every operation.
    After {
        remaining: u64,
        error: InjectedError,
    },
}

#[derive(Debug, Default)]
struct State {
    durable: MemData,
    log: Vec<LogEntry>,
    next_id: u64,
    stats: FaultStats,
    rules: Vec<Rule>,
}

impl State {
    /// Count the operation and decide whether an injected fault fails it.
    fn admit(&mut self, kind: OpKind) -> io::Result<()> {
        let s = &mut self.stats;
        match kind {
            OpKind::Read => s.reads += 1,
            OpKind::Write => s.writes += 1,
            OpKind::WriteZeroes => s.write_zeroes += 1,
            OpKind::Discard => s.discards += 1,
            OpKind::Flush => s.flushes += 1,
            OpKind::SetLen => s.set_lens += 1,
        }
        let mut failure = None;
        for rule in &mut self.rules {
            match rule {
                Rule::Nth {
                    kind: k,
                    n,
                    seen,
                    error,
                } if *k == kind => {
                    *seen += 1;
                    if *seen == *n {
                        failure.get_or_insert(*error);
                    }
                }
                Rule::After { remaining, error } => {
                    if *remaining == 0 {
                        failure.get_or_insert(*error);
                    } else {
                        *remaining -= 1;
                    }
                }
                Rule::Nth { .. } => {}
            }
        }
        match failure {
            Some(error) => {
                self.stats.injected_errors += 1;
                Err(error.to_io(kind))
            }
            None => Ok(()),
        }
    }

    fn log(&mut self, modification: Modification) -> u64 {
        let id = self.next_id;
        self.next_id += 1;
        self.log.push(LogEntry {
            id,
            modification,
            completed: false,
        });
        id
    }

    fn complete(&mut self, id: u64) {
        if let Some(e) = self.log.iter_mut().find(|e| e.id == id) {
            e.completed = true;
        }
    }
}

/// A storage wrapper that logs unflushed modifications, builds crash images and injects errors.
///
/// Cloning gives another handle to the same wrapper, so a test can keep one while the engine
/// owns the other.
pub struct FaultStorage<S> {
    inner: Rc<S>,
    state: Rc<RefCell<State>>,
}

impl<S> Clone for FaultStorage<S> {
    fn clone(&self) -> Self {
        FaultStorage {
            inner: Rc::clone(&self.inner),
            state: Rc::clone(&self.state),
        }
    }
}

impl FaultStorage<MemStorage> {
    /// Wrap a memory storage; its current contents are taken as durable.
    pub fn from_mem(inner: MemStorage) -> FaultStorage<MemStorage> {
        let durable = inner.data().clone();
        FaultStorage::with_durable(inner, durable)
    }
}

impl<S: Storage> FaultStorage<S> {
    /// Wrap any storage, reading its current contents as the durable state.
    pub async fn new(inner: S) -> io::Result<FaultStorage<S>> {
        const STEP: u64 = 1 << 20;
        let len = inner.len().await?;
        let mut durable = MemData::default();
        let mut buf = IoBuf::zeroed(0);
        let mut pos = 0;
        while pos < len {
            let n = usize::try_from((len - pos).min(STEP)).unwrap_or(1 << 20);
            buf.resize(n);
            let (res, slice) = inner.read_at(Slice::from(buf), pos).await;
            res?;
            buf = slice.into_inner();
            durable.write(pos, &buf);
            pos += len_u64(n);
        }
        durable.set_len(len);
        Ok(FaultStorage::with_durable(inner, durable))
    }

    fn with_durable(inner: S, durable: MemData) -> FaultStorage<S> {
        FaultStorage {
            inner: Rc::new(inner),
            state: Rc::new(RefCell::new(State {
                durable,
                ..State::default()
            })),
        }
    }

    /// The wrapped storage.
    pub fn inner(&self) -> &S {
        &self.inner
    }

    /// Modifications not yet covered by a completed flush.
    pub fn unflushed_ops(&self) -> usize {
        self.state.borrow().log.len()
    }

    /// Counters so far.
    pub fn stats(&self) -> FaultStats {
        self.state.borrow().stats
    }

    /// The contents a crash right now would leave if no unflushed modification survived.
    pub fn durable_image(&self) -> MemStorage {
        MemStorage::from_data(self.state.borrow().durable.clone())
    }

    /// The contents a crash right now could leave: the durable state plus the unflushed
    /// modifications `plan` keeps, applied in the order they were issued.
    pub fn crash_image(&self, plan: &CrashPlan) -> MemStorage {
        let state = self.state.borrow();
        let mut image = state.durable.clone();
        for (entry, survival) in state.log.iter().zip(plan.survivals(state.log.len())) {
            match survival {
                Survival::Lost => {}
                Survival::Kept => entry.modification.apply(&mut image),
                Survival::Torn { seed } => entry.modification.apply_torn(&mut image, seed),
            }
        }
        MemStorage::from_data(image)
    }

    /// Fail the `n`-th (1-based, counted from now) operation of `kind` once.
    pub fn fail_nth(&self, kind: OpKind, n: u64, error: InjectedError) {
        self.state.borrow_mut().rules.push(Rule::Nth {
            kind,
            n,
            seen: 0,
            error,
        });
    }

    /// Let `n` more operations (of any kind) through, then fail every one, as a dead disk.
    pub fn fail_after(&self, n: u64, error: InjectedError) {
        self.state.borrow_mut().rules.push(Rule::After {
            remaining: n,
            error,
        });
    }

    /// Remove every fault rule.
    pub fn clear_faults(&self) {
        self.state.borrow_mut().rules.clear();
    }

    fn admit(&self, kind: OpKind) -> io::Result<()> {
        self.state.borrow_mut().admit(kind)
    }

    /// Log `m` before it is issued: a crash while it is in flight may or may not include it.
    /// Failed operations stay logged for the same reason.
    async fn logged<T>(&self, m: Modification, op: impl std::future::Future<Output = T>) -> T {
        let id = self.state.borrow_mut().log(m);
        let out = op.await;
        self.state.borrow_mut().complete(id);
        out
    }
}

impl<S: Storage> Storage for FaultStorage<S> {
    async fn read_at(&self, buf: Slice, offset: u64) -> BufResult<Slice> {
        if let Err(e) = self.admit(OpKind::Read) {
            return (Err(e), buf);
        }
        self.inner.read_at(buf, offset).await
    }

    async fn write_at(&self, buf: Slice, offset: u64) -> BufResult<Slice> {
        if let Err(e) = self.admit(OpKind::Write) {
            return (Err(e), buf);
        }
        if let Err(e) = checked_end("write_at", offset, len_u64(buf.len())) {
            return (Err(e.into()), buf);
        }
        self.state.borrow_mut().stats.bytes_written += len_u64(buf.len());
        let m = Modification::Write {
            offset,
            data: Rc::from(&buf[..]),
        };
        self.logged(m, self.inner.write_at(buf, offset)).await
    }

    async fn write_zeroes_at(&self, offset: u64, len: u64, unmap: bool) -> io::Result<()> {
        self.admit(OpKind::WriteZeroes)?;
        checked_end("write_zeroes_at", offset, len)?;
        let m = Modification::Zero { offset, len };
        self.logged(m, self.inner.write_zeroes_at(offset, len, unmap))
            .await
    }

    async fn data_run(&self, offset: u64, len: u64) -> io::Result<(bool, u64)> {
        self.inner.data_run(offset, len).await
    }

    fn allocated_size(&self) -> Option<u64> {
        self.inner.allocated_size()
    }

    async fn discard_at(&self, offset: u64, len: u64) -> io::Result<()> {
        self.admit(OpKind::Discard)?;
        checked_end("discard_at", offset, len)?;
        let m = Modification::Discard { offset, len };
        self.logged(m, self.inner.discard_at(offset, len)).await
    }

    async fn flush(&self) -> io::Result<()> {
        self.admit(OpKind::Flush)?;
        // Only what completed before the flush was issued is guaranteed durable by it.
        let covered: Vec<u64> = {
            let state = self.state.borrow();
            state
                .log
                .iter()
                .filter(|e| e.completed)
                .map(|e| e.id)
                .collect()
        };
        self.inner.flush().await?;
        let mut state = self.state.borrow_mut();
        let State { durable, log, .. } = &mut *state;
        log.retain(|e| {
            let done = covered.binary_search(&e.id).is_ok();
            if done {
                e.modification.apply(durable);
            }
            !done
        });
        Ok(())
    }

    async fn len(&self) -> io::Result<u64> {
        self.inner.len().await
    }

    async fn set_len(&self, len: u64) -> io::Result<()> {
        self.admit(OpKind::SetLen)?;
        checked_end("set_len", len, 0)?;
        self.logged(Modification::SetLen { len }, self.inner.set_len(len))
            .await
    }

    fn zeroes_are_cheap(&self) -> bool {
        self.inner.zeroes_are_cheap()
    }

    fn alignment(&self) -> usize {
        self.inner.alignment()
    }
    fn event(&self, event: crate::Event) {
        self.inner.event(event);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn random_plans_are_deterministic_and_varied() {
        let a = CrashPlan::Random {
            seed: 7,
            tear: true,
        }
        .survivals(50);
        let b = CrashPlan::Random {
            seed: 7,
            tear: true,
        }
        .survivals(50);
        assert_eq!(a, b);
        let mut saw_all = false;
        let mut saw_none = false;
        let mut saw_torn = false;
        for seed in 0..200 {
            let s = CrashPlan::Random { seed, tear: true }.survivals(20);
            saw_all |= s.iter().all(|x| *x != Survival::Lost);
            saw_none |= s.iter().all(|x| *x == Survival::Lost);
            saw_torn |= s.iter().any(|x| matches!(x, Survival::Torn { .. }));
        }
        assert!(saw_all && saw_none && saw_torn);
    }

    #[test]
    fn torn_write_changes_only_whole_sectors() {
        let m = Modification::Write {
            offset: 100,
            data: Rc::from(vec![1u8; 2000]),
        };
        for seed in 0..32 {
            let mut d = MemData::default();
            d.write(0, &[0u8; 3000]);
            m.apply_torn(&mut d, seed);
            let v = d.to_vec();
            // Pieces: [100,512) [512,1024) [1024,1536) [1536,2048) [2048,2100)
            for (a, b) in [
                (100, 512),
                (512, 1024),
                (1024, 1536),
                (1536, 2048),
                (2048, 2100),
            ] {
                let piece = &v[a..b];
                assert!(
                    piece.iter().all(|&x| x == 1) || piece.iter().all(|&x| x == 0),
                    "seed {seed}: sector piece {a}..{b} partly written"
                );
            }
            assert!(v[..100].iter().all(|&x| x == 0));
            assert!(v[2100..].iter().all(|&x| x == 0));
        }
    }
}
