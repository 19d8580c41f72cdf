//! A scriptable in-memory disk shared by the caches under test: it records every load,
//! write-back and flush in one log, yields at every I/O so that tasks interleave, fails I/O
//! on request, and checks the caches' budgets while I/O is in flight.

#![allow(dead_code)] // each test binary uses a different part of this module

use std::cell::{Cell, RefCell};
use std::collections::{HashMap, HashSet};
use std::io;
use std::rc::{Rc, Weak};

use cache::{Backend, Cache};
use test_support::Rng;

/// Bytes per entry in these tests.
pub const ENTRY: usize = 512;

/// The entry bytes that carry `version` of `key`: key and version in the first 12 bytes,
/// then a pattern derived from both, so a torn or misplaced entry is noticed.
pub fn encode(key: u32, version: u64) -> Vec<u8> {
    let mut bytes = vec![0u8; ENTRY];
    write_entry(&mut bytes, key, version);
    bytes
}

/// Write `encode(key, version)` into `buf`.
pub fn write_entry(buf: &mut [u8], key: u32, version: u64) {
    buf[..4].copy_from_slice(&key.to_le_bytes());
    buf[4..12].copy_from_slice(&version.to_le_bytes());
    let seed = version
        .wrapping_mul(31)
        .wrapping_add(u64::from(key))
        .to_le_bytes()[0];
    for (i, b) in buf[12..].iter_mut().enumerate() {
        *b = seed ^ i.to_le_bytes()[0];
    }
}

/// The version an entry carries, or why it is not a well-formed entry of `key`.
pub fn decode(buf: &[u8], key: u32) -> Result<u64, String> {
    if buf.len() != ENTRY {
        return Err(format!("entry of {} bytes", buf.len()));
    }
    let stored_key = u32::from_le_bytes(buf[..4].try_into().expect("4 bytes"));
    let version = u64::from_le_bytes(buf[4..12].try_into().expect("8 bytes"));
    if stored_key != key || buf != encode(key, version).as_slice() {
        return Err(format!(
            "entry for key {key} holds key {stored_key} version {version} or is torn"
        ));
    }
    Ok(version)
}

/// One thing that happened at the disk, in order.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Io {
    Load {
        cache: u8,
        key: u32,
    },
    WriteStart {
        cache: u8,
        key: u32,
        version: u64,
    },
    WriteEnd {
        cache: u8,
        key: u32,
        version: u64,
        ok: bool,
    },
    FlushStart {
        cache: u8,
        id: u64,
    },
    FlushEnd {
        cache: u8,
        id: u64,
        ok: bool,
    },
    /// Logged by the test when `from.set_dependency(to)` returned, with the versions `to`'s
    /// keys had then (what must be durable before `from` writes anything).
    DependencySet {
        from: u8,
        to: u8,
        required: Vec<(u32, u64)>,
    },
    /// Logged by the test when `set_flush_before_writeback` was called on `cache`.
    FlushFirstSet {
        cache: u8,
    },
    /// Logged by the test when it forgot `key` in `cache`.
    Forgot {
        cache: u8,
        key: u32,
    },
}

/// A cache whose budget is checked at every I/O, with its slot count.
pub type Watched = (Weak<Cache<u32, TestBackend>>, u64);

/// Per dependent cache: (target cache, key -> version that must be durable first).
type PendingDeps = HashMap<u8, Vec<(u8, HashMap<u32, u64>)>>;

/// The shared disk.
#[derive(Default)]
pub struct Disk {
    /// (cache, key) -> bytes written; absent = the initial version 0.
    pub data: RefCell<HashMap<(u8, u32), Vec<u8>>>,
    pub log: RefCell<Vec<Io>>,
    pub violations: RefCell<Vec<String>>,
    rng: RefCell<Rng>,
    /// Up to this many yields before each I/O completes.
    pub max_yields: Cell<u32>,
    /// While set, every I/O waits (yielding) before completing.
    pub hold: Cell<bool>,
    /// Number of upcoming I/Os of each kind to fail, per cache.
    pub fail_loads: RefCell<HashMap<u8, u32>>,
    pub fail_writes: RefCell<HashMap<u8, u32>>,
    pub fail_flushes: RefCell<HashMap<u8, u32>>,
    writes_in_flight: RefCell<HashSet<(u8, u32)>>,
    next_flush: Cell<u64>,
    /// Caches whose budget is checked at every I/O: (cache, slot count).
    pub watched: RefCell<Vec<Watched>>,
    pub loads: Cell<u64>,
}

/// Message of every injected failure; errors with any other text are bugs.
pub const INJECTED: &str = "injected failure";

impl Disk {
    pub fn new(seed: u64, max_yields: u32) -> Rc<Self> {
        let disk = Self::default();
        disk.rng.replace(Rng(seed));
        disk.max_yields.set(max_yields);
        Rc::new(disk)
    }

    fn violation(&self, text: String) {
        self.violations.borrow_mut().push(text);
    }

    /// What is on the disk for `key` of `cache`, as a version.
    pub fn version(&self, cache: u8, key: u32) -> Result<u64, String> {
        match self.data.borrow().get(&(cache, key)) {
            Some(bytes) => decode(bytes, key),
            None => Ok(0),
        }
    }

    fn take_failure(map: &RefCell<HashMap<u8, u32>>, cache: u8) -> bool {
        let mut map = map.borrow_mut();
        match map.get_mut(&cache) {
            Some(n) if *n > 0 => {
                *n -= 1;
                true
            }
            _ => false,
        }
    }

    pub fn clear_failures(&self) {
        self.fail_loads.borrow_mut().clear();
        self.fail_writes.borrow_mut().clear();
        self.fail_flushes.borrow_mut().clear();
    }

    /// Let other tasks run, a random number of times, and while `hold` is set.
    async fn interleave(&self) {
        let max = u64::from(self.max_yields.get());
        let n = if max == 0 {
            0
        } else {
            self.rng.borrow_mut().below(max + 1)
        };
        for _ in 0..n {
            tokio::task::yield_now().await;
        }
        while self.hold.get() {
            tokio::task::yield_now().await;
        }
    }

    fn check_budgets(&self) {
        for (cache, slots) in self.watched.borrow().iter() {
            if let Some(cache) = cache.upgrade() {
                let stats = cache.stats();
                if stats.entries > *slots || stats.bytes_in_use > stats.capacity {
                    self.violation(format!(
                        "{} over budget during I/O: {stats:?}",
                        cache.name()
                    ));
                }
            }
        }
    }

    pub fn log(&self, event: Io) {
        self.log.borrow_mut().push(event);
    }
}

/// One cache's view of the disk.
pub struct TestBackend {
    pub id: u8,
    pub disk: Rc<Disk>,
}

fn injected() -> io::Error {
    io::Error::other(INJECTED)
}

impl Backend<u32> for TestBackend {
    async fn load(&self, key: u32, buf: &mut [u8]) -> io::Result<()> {
        let disk = &self.disk;
        disk.loads.set(disk.loads.get() + 1);
        disk.check_budgets();
        if disk.writes_in_flight.borrow().contains(&(self.id, key)) {
            disk.violation(format!(
                "cache {} loads key {key} during its write-back",
                self.id
            ));
        }
        disk.interleave().await;
        disk.check_budgets();
        if Disk::take_failure(&disk.fail_loads, self.id) {
            return Err(injected());
        }
        match disk.data.borrow().get(&(self.id, key)) {
            Some(bytes) => buf.copy_from_slice(bytes),
            None => write_entry(buf, key, 0),
        }
        disk.log(Io::Load {
            cache: self.id,
            key,
        });
        Ok(())
    }

    type Snapshot = Vec<u8>;
    fn snapshot(&self, data: &[u8]) -> Vec<u8> {
        data.to_vec()
    }
    async fn write_back(&self, key: u32, at: usize, data: Vec<u8>) -> io::Result<()> {
        let disk = &self.disk;
        if at != 0 {
            // These tests modify whole entries, so every write-back writes a whole entry.
            disk.violation(format!(
                "cache {} writes back part of key {key} at {at}",
                self.id
            ));
        }
        let version = match decode(&data, key) {
            Ok(v) => v,
            Err(e) => {
                disk.violation(format!("cache {} writes back garbage: {e}", self.id));
                u64::MAX
            }
        };
        if !disk.writes_in_flight.borrow_mut().insert((self.id, key)) {
            disk.violation(format!(
                "cache {} has two write-backs of key {key} in flight",
                self.id
            ));
        }
        disk.log(Io::WriteStart {
            cache: self.id,
            key,
            version,
        });
        disk.check_budgets();
        disk.interleave().await;
        disk.check_budgets();
        disk.writes_in_flight.borrow_mut().remove(&(self.id, key));
        let ok = !Disk::take_failure(&disk.fail_writes, self.id);
        if ok {
            let old = disk.version(self.id, key).unwrap_or(0);
            if version < old {
                disk.violation(format!(
                    "cache {} key {key}: version {version} overwrites newer {old}",
                    self.id
                ));
            }
            disk.data.borrow_mut().insert((self.id, key), data);
        }
        disk.log(Io::WriteEnd {
            cache: self.id,
            key,
            version,
            ok,
        });
        if ok {
            Ok(())
        } else {
            Err(injected())
        }
    }

    async fn flush(&self) -> io::Result<()> {
        let disk = &self.disk;
        let id = disk.next_flush.get();
        disk.next_flush.set(id + 1);
        disk.log(Io::FlushStart { cache: self.id, id });
        disk.interleave().await;
        let ok = !Disk::take_failure(&disk.fail_flushes, self.id);
        disk.log(Io::FlushEnd {
            cache: self.id,
            id,
            ok,
        });
        if ok {
            Ok(())
        } else {
            Err(injected())
        }
    }
}

/// Replays a log and reports every write-back that started before what it depends on was
/// durable. The disk is shared: a flush of either cache makes every write that had
/// completed when the flush started durable.
#[derive(Default)]
pub struct OrderChecker {
    seen: usize,
    written: HashMap<(u8, u32), u64>,
    durable: HashMap<(u8, u32), u64>,
    flush_snapshots: HashMap<u64, HashMap<(u8, u32), u64>>,
    pending_deps: PendingDeps,
    /// Per cache: log index of an unsatisfied flush-before-write-back request.
    pending_flush_first: HashMap<u8, usize>,
    /// Flush id -> log index of its start.
    flush_started_at: HashMap<u64, usize>,
}

impl OrderChecker {
    /// Check the log entries not seen yet; returns violations.
    pub fn check(&mut self, log: &[Io]) -> Vec<String> {
        let mut errors = Vec::new();
        while self.seen < log.len() {
            let at = self.seen;
            self.seen += 1;
            match &log[at] {
                Io::Load { .. } => {}
                Io::WriteStart {
                    cache,
                    key,
                    version,
                } => {
                    if let Some(set_at) = self.pending_flush_first.get(cache) {
                        errors.push(format!(
                            "log[{at}]: cache {cache} writes key {key} v{version} without the \
                             flush requested at log[{set_at}]"
                        ));
                    }
                    for (target, required) in self.pending_deps.remove(cache).unwrap_or_default() {
                        for (tkey, need) in required {
                            let have = self.durable.get(&(target, tkey)).copied().unwrap_or(0);
                            if have < need {
                                errors.push(format!(
                                    "log[{at}]: cache {cache} writes key {key} v{version} \
                                     before cache {target} key {tkey} v{need} is durable \
                                     (durable: v{have})"
                                ));
                            }
                        }
                    }
                }
                Io::WriteEnd {
                    cache,
                    key,
                    version,
                    ok,
                } => {
                    if *ok {
                        let w = self.written.entry((*cache, *key)).or_insert(0);
                        *w = (*w).max(*version);
                    }
                }
                Io::FlushStart { id, .. } => {
                    self.flush_snapshots.insert(*id, self.written.clone());
                    self.flush_started_at.insert(*id, at);
                }
                Io::FlushEnd { id, ok, .. } => {
                    let snapshot = self.flush_snapshots.remove(id).unwrap_or_default();
                    let started = self.flush_started_at.remove(id).unwrap_or(0);
                    if *ok {
                        for (k, v) in snapshot {
                            let d = self.durable.entry(k).or_insert(0);
                            *d = (*d).max(v);
                        }
                        self.pending_flush_first
                            .retain(|_, set_at| *set_at > started);
                    }
                }
                Io::DependencySet { from, to, required } => {
                    self.pending_deps
                        .entry(*from)
                        .or_default()
                        .push((*to, required.iter().copied().collect()));
                }
                Io::FlushFirstSet { cache } => {
                    // The latest request is the hardest to satisfy.
                    self.pending_flush_first.insert(*cache, at);
                }
                Io::Forgot { cache, key } => {
                    for deps in self.pending_deps.values_mut() {
                        for (target, required) in deps.iter_mut() {
                            if target == cache {
                                required.remove(key);
                            }
                        }
                    }
                }
            }
        }
        errors
    }
}
