//! The cache itself: lookups, single-flight loads, creation and forgetting of entries.
//! Write-back lives in `write_back.rs`, ordering between caches in `dependency.rs`, idle
//! cleaning in `idle.rs`.

use std::cell::RefCell;
use std::fmt::Debug;
use std::hash::Hash;
use std::io;

use crate::arena::Arena;
use crate::config::{CacheConfig, CacheStats};
use crate::error::CacheError;
use crate::flush::Dependencies;
use crate::state::{Phase, Room, State};

/// What a cache loads from and writes back to; implemented by the qcow2 engine.
#[allow(async_fn_in_trait)] // single-threaded by design: futures are deliberately !Send
pub trait Backend<K> {
    /// Fill `buf` (exactly one entry) with the bytes of `key`.
    async fn load(&self, key: K, buf: &mut [u8]) -> io::Result<()>;
    /// An entry's bytes as they were when its write-back started, in the form
    /// [`write_back`](Self::write_back) writes: the entry may change while the write is in
    /// flight, so the cache hands over a copy, and a backend that needs its bytes in a
    /// buffer of its own kind (aligned for `O_DIRECT`) makes that one copy the only one.
    type Snapshot;
    /// The copy of `data` (a part of one entry: whole pages of [`PAGE`](crate::PAGE) bytes,
    /// or the whole entry if it is smaller) that a write-back takes.
    fn snapshot(&self, data: &[u8]) -> Self::Snapshot;
    /// Write a part of one entry back: `data` goes `at` bytes into where `key` lives.
    async fn write_back(&self, key: K, at: usize, data: Self::Snapshot) -> io::Result<()>;
    /// Make everything written so far durable (fdatasync of the file(s) behind the cache).
    async fn flush(&self) -> io::Result<()>;
}

/// A write-back cache of fixed-size entries (L2 slices, refcount blocks) keyed by `K`.
///
/// Driven from one thread: many tasks may use it at once (it is correct at every `.await`),
/// but it is neither `Send` nor `Sync`. Closures given to [`read`](Self::read),
/// [`modify`](Self::modify) and [`create`](Self::create) run synchronously on the entry's
/// bytes and must not call back into the same cache (that would panic on a `RefCell`).
pub struct Cache<K, B> {
    pub(crate) name: String,
    pub(crate) entry_size: usize,
    pub(crate) backend: B,
    pub(crate) arena: Arena,
    pub(crate) state: RefCell<State<K>>,
    pub(crate) deps: RefCell<Dependencies>,
}

/// What an access does to the entry.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Mode {
    Read,
    Modify,
    /// Modifies only bytes `start..end` of the entry.
    ModifyPart {
        start: usize,
        end: usize,
    },
    Create,
}

/// What an access must wait for before trying again.
enum Step {
    Wait(std::rc::Rc<crate::event::Event>),
    WriteBack(usize, u64),
    Load(usize, u64),
}

impl<K, B> Cache<K, B>
where
    K: Copy + Eq + Hash + Debug,
    B: Backend<K>,
{
    /// A cache of `config.capacity_bytes / config.entry_size` entries over `backend`. Its
    /// memory is mapped now but costs nothing until entries are filled.
    pub fn new(config: CacheConfig, backend: B) -> Result<Self, CacheError> {
        let bad = |reason: String| CacheError::Config {
            cache: config.name.clone(),
            reason,
        };
        let entry_size = config.entry_size;
        if entry_size == 0 {
            return Err(bad("entry size is 0".into()));
        }
        let entry_bytes = u64::try_from(entry_size).unwrap_or(u64::MAX);
        let slots = config.capacity_bytes / entry_bytes;
        if slots == 0 {
            return Err(bad(format!(
                "{} bytes hold no entry of {entry_size} bytes",
                config.capacity_bytes
            )));
        }
        // Slot indices are kept in u32 by the policies.
        let slots = usize::try_from(slots)
            .ok()
            .filter(|&s| u32::try_from(s).is_ok_and(|s| s < u32::MAX))
            .ok_or_else(|| bad(format!("{slots} entries are too many")))?;
        let arena = Arena::new(entry_size, slots).map_err(|source| CacheError::Arena {
            cache: config.name.clone(),
            bytes: entry_size.saturating_mul(slots),
            source,
        })?;
        Ok(Self {
            state: RefCell::new(State::new(slots, config.policy)),
            deps: RefCell::new(Dependencies::default()),
            name: config.name,
            entry_size,
            backend,
            arena,
        })
    }

    /// Run `f` on the entry of `key`, loading it first if it is not cached. Fails if the
    /// load fails, or if making room needed a dirty entry written back and that failed.
    pub async fn read<R>(&self, key: K, f: impl FnOnce(&[u8]) -> R) -> Result<R, CacheError> {
        self.access(key, Mode::Read, |bytes| f(bytes)).await
    }

    /// Run `f` on the entry of `key` (loading it first if needed) and mark it dirty.
    pub async fn modify<R>(&self, key: K, f: impl FnOnce(&mut [u8]) -> R) -> Result<R, CacheError> {
        self.access(key, Mode::Modify, f).await
    }

    /// Run `f` on bytes `part` of the entry of `key` (loading it first if needed) and mark
    /// them dirty: a write-back writes only the pages they lie in, not the whole entry.
    /// Fails without running `f` if `part` does not lie inside an entry.
    pub async fn modify_part<R>(
        &self,
        key: K,
        part: std::ops::Range<usize>,
        f: impl FnOnce(&mut [u8]) -> R,
    ) -> Result<R, CacheError> {
        if part.start > part.end || part.end > self.entry_size {
            return Err(CacheError::Part {
                cache: self.name.clone(),
                start: part.start,
                end: part.end,
                entry_size: self.entry_size,
            });
        }
        let mode = Mode::ModifyPart {
            start: part.start,
            end: part.end,
        };
        self.access(key, mode, f).await
    }

    /// A brand-new table slice: zero-filled, not loaded from disk, dirty. `f` fills it in.
    pub async fn create<R>(&self, key: K, f: impl FnOnce(&mut [u8]) -> R) -> Result<R, CacheError> {
        self.access(key, Mode::Create, f).await
    }

    /// Drop entries matching `pred` without writing them back (their table was freed).
    /// An entry with a load or write-back in flight is dropped when that ends; until then
    /// accesses to its key wait, so no two I/Os on one key ever overlap.
    pub fn forget(&self, pred: impl Fn(&K) -> bool) {
        self.state.borrow_mut().forget(pred);
    }

    /// Counters and occupancy.
    pub fn stats(&self) -> CacheStats {
        self.state.borrow().stats(self.entry_size)
    }

    /// The name given in the configuration.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// Bytes per entry.
    pub fn entry_size(&self) -> usize {
        self.entry_size
    }

    /// The backend the cache loads from and writes to.
    pub fn backend(&self) -> &B {
        &self.backend
    }

    /// Whether `key` is resident (loaded and not forgotten); does not count as a use.
    pub fn contains(&self, key: &K) -> bool {
        let st = self.state.borrow();
        st.map.get(key).is_some_and(|&idx| st.slots[idx].is_live())
    }

    async fn access<R>(
        &self,
        key: K,
        mode: Mode,
        f: impl FnOnce(&mut [u8]) -> R,
    ) -> Result<R, CacheError> {
        loop {
            let step = {
                let mut st = self.state.borrow_mut();
                match st.map.get(&key).copied() {
                    Some(idx) if st.slots[idx].is_live() => {
                        if mode != Mode::Create {
                            st.counters.hits += 1;
                        }
                        return Ok(self.apply(&mut st, idx, mode, f));
                    }
                    // Loading, or forgotten with I/O in flight: wait for it to end.
                    Some(idx) => Step::Wait(st.slots[idx].changed.listen()),
                    None => match st.make_room() {
                        Room::Slot(idx) => {
                            let residency = st.occupy(idx, key);
                            if mode == Mode::Create {
                                st.make_ready(idx);
                                return Ok(self.apply(&mut st, idx, mode, f));
                            }
                            st.counters.misses += 1;
                            Step::Load(idx, residency)
                        }
                        Room::WriteBack(idx, residency) => Step::WriteBack(idx, residency),
                        Room::Full => Step::Wait(st.room.listen()),
                    },
                }
            };
            // The write-back and the load are boxed: their futures (storage I/O, and for a
            // backend that reads through other caches, whole lookups) would otherwise be
            // part of every caller's state, hits included, and every request's future would
            // carry (and its task move) kilobytes it needs only on a miss.
            match step {
                Step::Wait(event) => event.wait().await,
                Step::WriteBack(idx, residency) => {
                    Box::pin(self.write_back_slot(idx, residency)).await?
                }
                Step::Load(idx, residency) => {
                    if Box::pin(self.load(idx, residency, key)).await? {
                        // No await since the load finished: the entry is still there.
                        let mut st = self.state.borrow_mut();
                        return Ok(self.apply(&mut st, idx, mode, f));
                    }
                    // Forgotten while loading: what was read may be stale, start afresh.
                }
            }
        }
    }

    /// Run `f` on a live slot's bytes and record the use.
    fn apply<R>(
        &self,
        st: &mut State<K>,
        idx: usize,
        mode: Mode,
        f: impl FnOnce(&mut [u8]) -> R,
    ) -> R {
        st.policy.accessed(idx);
        let slot = &mut st.slots[idx];
        slot.used = true;
        let part = match mode {
            Mode::Read => None,
            Mode::ModifyPart { start, end } => Some(start..end),
            Mode::Modify | Mode::Create => Some(0..self.entry_size),
        };
        if let Some(part) = &part {
            slot.dirty = true;
            slot.pages.mark(part.clone(), self.entry_size);
            slot.version += 1;
        }
        // SAFETY: the slot is not Loading (whose bytes belong to the loading task) and not
        // Free (which `release` may zap); every other reference to slot bytes is made, like
        // this one, while holding the `state` borrow that `st` proves we hold, and none
        // outlives it. `f` cannot reach the cache again without a second (panicking) borrow.
        let bytes = unsafe { self.arena.slot_mut(idx) };
        if mode == Mode::Create {
            bytes.fill(0);
        }
        match part {
            // `modify_part` checked that the part lies inside the entry.
            Some(part) => f(&mut bytes[part]),
            None => f(bytes),
        }
    }

    /// Fill the reserved slot `idx` with `key`'s bytes. `Ok(true)`: the entry is ready;
    /// `Ok(false)`: it was forgotten meanwhile and the slot has been freed.
    async fn load(&self, idx: usize, residency: u64, key: K) -> Result<bool, CacheError> {
        let mut guard = LoadGuard {
            state: &self.state,
            idx,
            residency,
            armed: true,
        };
        // SAFETY: the slot is Loading and was reserved for this call by `occupy`. Nothing
        // else makes a reference to a Loading slot's bytes (accesses wait, eviction,
        // write-back and cleaning skip it, `release` only touches Free slots) until this
        // call makes it Ready or frees it, which happens after `buf` is last used.
        let buf = unsafe { self.arena.slot_mut(idx) };
        let result = self.backend.load(key, buf).await;
        guard.armed = false;
        let mut st = self.state.borrow_mut();
        match result {
            Ok(()) if st.slots[idx].forgotten => {
                st.free_slot(idx);
                Ok(false)
            }
            Ok(()) => {
                st.make_ready(idx);
                Ok(true)
            }
            Err(source) => {
                st.free_slot(idx);
                Err(CacheError::Load {
                    cache: self.name.clone(),
                    key: format!("{key:?}"),
                    source,
                })
            }
        }
    }
}

/// Frees the reserved slot if a load is abandoned (its future dropped) halfway.
struct LoadGuard<'a, K: Copy + Eq + Hash> {
    state: &'a RefCell<State<K>>,
    idx: usize,
    residency: u64,
    armed: bool,
}

impl<K: Copy + Eq + Hash> Drop for LoadGuard<'_, K> {
    fn drop(&mut self) {
        if !self.armed {
            return;
        }
        // A drop from inside a closure running on this cache cannot borrow; the slot then
        // stays reserved, which wastes it but breaks nothing.
        if let Ok(mut st) = self.state.try_borrow_mut() {
            let slot = &st.slots[self.idx];
            if slot.residency == self.residency && slot.phase == Phase::Loading {
                st.free_slot(self.idx);
            }
        }
    }
}

impl<K, B> Drop for Cache<K, B> {
    fn drop(&mut self) {
        let unwritten = self
            .state
            .get_mut()
            .slots
            .iter()
            .filter(|s| s.dirty && !s.forgotten)
            .count();
        if unwritten > 0 {
            tracing::warn!(
                cache = %self.name,
                unwritten,
                "cache dropped with dirty entries that were never written back"
            );
        }
    }
}
