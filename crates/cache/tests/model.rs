//! Model-based test: two small caches over one disk, where cache 0 and cache 1 may depend on
//! each other, driven by random sequences of reads, modifications, creations, forgets,
//! flushes, evictions, idle cleanings, dependencies and injected I/O failures, some of them
//! run as concurrent tasks on a `LocalSet` whose I/O yields at random. After every step the
//! caches are checked against a plain map of what each entry must contain:
//! - every access sees the latest version of its entry (never stale data);
//! - after a successful flush every entry modified before it is on the disk, and at the end
//!   the disk holds exactly the model (never a lost dirty write);
//! - no cache ever holds more entries than its budget, checked during I/O too;
//! - every write-back in the disk's log starts only after what its cache depended on was
//!   durable (dependency order), and at most one write-back per entry is in flight.

mod common;

use std::cell::{Cell, RefCell};
use std::collections::HashMap;
use std::rc::Rc;

use cache::{Cache, CacheConfig, CacheError, EvictionPolicy, Flush};
use common::{decode, write_entry, Disk, Io, OrderChecker, TestBackend, ENTRY, INJECTED};
use proptest::prelude::*;

const KEYS: u32 = 6;
const SLOTS: [u32; 2] = [3, 2];

#[derive(Debug, Clone)]
enum Op {
    Read(usize, u32),
    Modify(usize, u32),
    Create(usize, u32),
    Forget(usize, u32),
    Flush(usize),
    /// Read more distinct keys than the cache holds, starting at this one.
    Evict(usize, u32),
    Clean(usize),
    /// Cache `c` depends on the other one.
    Depend(usize),
    FlushFirst(usize),
    FailWrites(usize, u32),
    FailLoads(usize, u32),
    FailFlushes(usize, u32),
    Concurrent(Vec<Op>),
}

struct Harness {
    disk: Rc<Disk>,
    caches: [Rc<Cache<u32, TestBackend>>; 2],
    /// Latest version of every entry; absent = 0 (never modified), `None` = unknown
    /// (forgotten: whatever the disk holds is the truth again).
    model: RefCell<[HashMap<u32, Option<u64>>; 2]>,
    /// Bumped when an entry is forgotten, so a flush does not expect it written.
    forgets: RefCell<HashMap<(usize, u32), u64>>,
    next_version: Cell<u64>,
}

impl Harness {
    fn new(seed: u64, max_yields: u32, policy: EvictionPolicy) -> Rc<Self> {
        let disk = Disk::new(seed, max_yields);
        let make = |id: u8| {
            let config = CacheConfig::new(
                format!("cache{id}"),
                ENTRY,
                u64::from(SLOTS[usize::from(id)]) * ENTRY as u64,
            )
            .with_policy(policy);
            let backend = TestBackend {
                id,
                disk: Rc::clone(&disk),
            };
            Rc::new(Cache::new(config, backend).expect("cache"))
        };
        let caches = [make(0), make(1)];
        for (c, cache) in caches.iter().enumerate() {
            disk.watched
                .borrow_mut()
                .push((Rc::downgrade(cache), u64::from(SLOTS[c])));
        }
        Rc::new(Self {
            disk,
            caches,
            model: RefCell::default(),
            forgets: RefCell::default(),
            next_version: Cell::new(1),
        })
    }

    fn violation(&self, text: String) {
        self.disk.violations.borrow_mut().push(text);
    }

    fn expected(&self, c: usize, key: u32) -> Option<u64> {
        self.model.borrow()[c].get(&key).copied().unwrap_or(Some(0))
    }

    /// Compare an entry's bytes with the model, at the moment the cache hands them out.
    fn check(&self, c: usize, key: u32, bytes: &[u8], what: &str) {
        match decode(bytes, key) {
            Err(e) => self.violation(format!("{what} cache{c} key {key}: {e}")),
            Ok(seen) => match self.expected(c, key) {
                Some(want) if want != seen => self.violation(format!(
                    "{what} cache{c} key {key}: saw v{seen}, latest is v{want}"
                )),
                Some(_) => {}
                None => {
                    self.model.borrow_mut()[c].insert(key, Some(seen));
                }
            },
        }
    }

    fn new_version(&self, c: usize, key: u32, bytes: &mut [u8]) {
        let v = self.next_version.get();
        self.next_version.set(v + 1);
        write_entry(bytes, key, v);
        self.model.borrow_mut()[c].insert(key, Some(v));
    }

    fn outcome(&self, what: &str, result: Result<(), CacheError>) {
        if let Err(e) = result {
            let injected = e.io_error().is_some_and(|io| io.to_string() == INJECTED);
            if !injected {
                self.violation(format!("{what}: unexpected error {e}"));
            }
        }
    }

    fn known_versions(&self, c: usize) -> Vec<(u32, u64)> {
        (0..KEYS)
            .filter_map(|k| self.expected(c, k).map(|v| (k, v)))
            .collect()
    }
}

fn run(h: Rc<Harness>, op: Op) -> std::pin::Pin<Box<dyn std::future::Future<Output = ()>>> {
    Box::pin(async move {
        match op {
            Op::Read(c, k) => {
                let r = h.caches[c].read(k, |b| h.check(c, k, b, "read")).await;
                h.outcome("read", r);
            }
            Op::Modify(c, k) => {
                let r = h.caches[c]
                    .modify(k, |b| {
                        h.check(c, k, b, "modify");
                        h.new_version(c, k, b);
                    })
                    .await;
                h.outcome("modify", r);
            }
            Op::Create(c, k) => {
                let r = h.caches[c]
                    .create(k, |b| {
                        if b.iter().any(|&x| x != 0) {
                            h.violation(format!("create cache{c} key {k}: not zero-filled"));
                        }
                        h.new_version(c, k, b);
                    })
                    .await;
                h.outcome("create", r);
            }
            Op::Forget(c, k) => {
                h.caches[c].forget(|&x| x == k);
                h.model.borrow_mut()[c].insert(k, None);
                *h.forgets.borrow_mut().entry((c, k)).or_insert(0) += 1;
                h.disk.log(Io::Forgot {
                    cache: c as u8,
                    key: k,
                });
            }
            Op::Flush(c) => {
                let before: Vec<(u32, u64, u64)> = h
                    .known_versions(c)
                    .into_iter()
                    .map(|(k, v)| (k, v, h.forgets.borrow().get(&(c, k)).copied().unwrap_or(0)))
                    .collect();
                let r = h.caches[c].flush().await;
                if r.is_ok() {
                    for (k, v, epoch) in before {
                        let still = h.forgets.borrow().get(&(c, k)).copied().unwrap_or(0) == epoch;
                        match h.disk.version(c as u8, k) {
                            Ok(on_disk) if still && on_disk < v => h.violation(format!(
                                "flush cache{c} returned with key {k} at v{on_disk} on disk, \
                                 v{v} was modified before the flush"
                            )),
                            Err(e) => h.violation(e),
                            _ => {}
                        }
                    }
                }
                h.outcome("flush", r);
            }
            Op::Evict(c, k) => {
                for i in 0..=SLOTS[c] {
                    let key = (k + i) % KEYS;
                    let r = h.caches[c].read(key, |b| h.check(c, key, b, "evict")).await;
                    h.outcome("evict", r);
                }
            }
            Op::Clean(c) => {
                let r = h.caches[c].clean_idle().await;
                h.outcome("clean", r);
            }
            Op::Depend(c) => {
                let other: Rc<dyn Flush> = h.caches[1 - c].clone();
                let r = h.caches[c].set_dependency(other).await;
                if r.is_ok() {
                    // Logged in the same poll as the dependency was recorded.
                    h.disk.log(Io::DependencySet {
                        from: c as u8,
                        to: (1 - c) as u8,
                        required: h.known_versions(1 - c),
                    });
                }
                h.outcome("set_dependency", r);
            }
            Op::FlushFirst(c) => {
                h.caches[c].set_flush_before_writeback();
                h.disk.log(Io::FlushFirstSet { cache: c as u8 });
            }
            Op::FailWrites(c, n) => {
                h.disk.fail_writes.borrow_mut().insert(c as u8, n);
            }
            Op::FailLoads(c, n) => {
                h.disk.fail_loads.borrow_mut().insert(c as u8, n);
            }
            Op::FailFlushes(c, n) => {
                h.disk.fail_flushes.borrow_mut().insert(c as u8, n);
            }
            Op::Concurrent(ops) => {
                let tasks: Vec<_> = ops
                    .into_iter()
                    .map(|op| tokio::task::spawn_local(run(Rc::clone(&h), op)))
                    .collect();
                for task in tasks {
                    if let Err(e) = task.await {
                        h.violation(format!("task failed: {e}"));
                    }
                }
            }
        }
    })
}

/// Everything that must hold between steps.
fn check_step(h: &Harness, order: &mut OrderChecker, step: usize) -> Result<(), String> {
    let mut errors: Vec<String> = h.disk.violations.borrow_mut().drain(..).collect();
    errors.extend(order.check(&h.disk.log.borrow()));
    for (c, cache) in h.caches.iter().enumerate() {
        let s = cache.stats();
        if s.entries > u64::from(SLOTS[c]) || s.bytes_in_use > s.capacity {
            errors.push(format!("cache{c} over budget: {s:?}"));
        }
        if s.dirty > s.entries {
            errors.push(format!(
                "cache{c} has more dirty entries than entries: {s:?}"
            ));
        }
    }
    if errors.is_empty() {
        Ok(())
    } else {
        Err(format!("after step {step}: {}", errors.join("; ")))
    }
}

fn simple_op() -> impl Strategy<Value = Op> {
    let c = 0..2usize;
    let k = 0..KEYS;
    prop_oneof![
        4 => (c.clone(), k.clone()).prop_map(|(c, k)| Op::Read(c, k)),
        4 => (c.clone(), k.clone()).prop_map(|(c, k)| Op::Modify(c, k)),
        2 => (c.clone(), k.clone()).prop_map(|(c, k)| Op::Create(c, k)),
        1 => (c.clone(), k.clone()).prop_map(|(c, k)| Op::Forget(c, k)),
        2 => c.clone().prop_map(Op::Flush),
        1 => (c.clone(), k).prop_map(|(c, k)| Op::Evict(c, k)),
        1 => c.clone().prop_map(Op::Clean),
        2 => c.clone().prop_map(Op::Depend),
        1 => c.clone().prop_map(Op::FlushFirst),
        1 => (c.clone(), 1..3u32).prop_map(|(c, n)| Op::FailWrites(c, n)),
        1 => (c.clone(), 1..3u32).prop_map(|(c, n)| Op::FailLoads(c, n)),
        1 => (c, 1..3u32).prop_map(|(c, n)| Op::FailFlushes(c, n)),
    ]
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        3 => simple_op(),
        1 => prop::collection::vec(simple_op(), 2..6).prop_map(Op::Concurrent),
    ]
}

fn policy() -> impl Strategy<Value = EvictionPolicy> {
    prop_oneof![
        Just(EvictionPolicy::Lru),
        Just(EvictionPolicy::Clock),
        Just(EvictionPolicy::TwoQueue),
    ]
}

fn run_case(
    ops: Vec<Op>,
    seed: u64,
    max_yields: u32,
    policy: EvictionPolicy,
) -> Result<(), String> {
    test_support::run(async move {
        let h = Harness::new(seed, max_yields, policy);
        let mut order = OrderChecker::default();
        for (step, op) in ops.into_iter().enumerate() {
            run(Rc::clone(&h), op).await;
            check_step(&h, &mut order, step)?;
        }
        // No more failures: everything must reach the disk, in order.
        h.disk.clear_failures();
        for cache in &h.caches {
            cache
                .flush()
                .await
                .map_err(|e| format!("final flush of {}: {e}", cache.name()))?;
        }
        check_step(&h, &mut order, usize::MAX)?;
        for c in 0..2 {
            for k in 0..KEYS {
                if let Some(want) = h.expected(c, k) {
                    let on_disk = h.disk.version(c as u8, k)?;
                    if on_disk != want {
                        return Err(format!(
                            "after the final flush cache{c} key {k} is v{on_disk} on disk, \
                             the latest write was v{want}"
                        ));
                    }
                }
                run(Rc::clone(&h), Op::Read(c, k)).await;
            }
            if h.caches[c].stats().dirty != 0 {
                return Err(format!("cache{c} still dirty after its flush"));
            }
        }
        check_step(&h, &mut order, usize::MAX)
    })
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 512, ..ProptestConfig::default() })]

    #[test]
    fn two_dependent_caches_behave_like_a_map(
        ops in prop::collection::vec(op(), 1..40),
        seed in any::<u64>(),
        max_yields in 0..4u32,
        policy in policy(),
    ) {
        if let Err(e) = run_case(ops, seed, max_yields, policy) {
            prop_assert!(false, "{}", e);
        }
    }
}

/// The checker itself must catch a write-back that ignores a dependency, or this test could
/// not fail.
#[test]
fn order_checker_catches_a_violation() {
    let log = vec![
        Io::DependencySet {
            from: 0,
            to: 1,
            required: vec![(3, 7)],
        },
        Io::WriteStart {
            cache: 0,
            key: 1,
            version: 9,
        },
    ];
    assert_eq!(OrderChecker::default().check(&log).len(), 1);
    let log = vec![
        Io::FlushFirstSet { cache: 0 },
        Io::WriteStart {
            cache: 0,
            key: 1,
            version: 9,
        },
    ];
    assert_eq!(OrderChecker::default().check(&log).len(), 1);
    let ok = vec![
        Io::WriteStart {
            cache: 1,
            key: 3,
            version: 7,
        },
        Io::WriteEnd {
            cache: 1,
            key: 3,
            version: 7,
            ok: true,
        },
        Io::DependencySet {
            from: 0,
            to: 1,
            required: vec![(3, 7)],
        },
        Io::FlushFirstSet { cache: 0 },
        Io::FlushStart { cache: 1, id: 0 },
        Io::FlushEnd {
            cache: 1,
            id: 0,
            ok: true,
        },
        Io::WriteStart {
            cache: 0,
            key: 1,
            version: 9,
        },
    ];
    assert!(OrderChecker::default().check(&ok).is_empty());
}
