//! Deterministic interleavings the model test reaches only by chance: the disk is held (every
//! I/O waits) while other tasks act, then released.

mod common;

use std::rc::Rc;
use std::time::Duration;

use cache::{Cache, CacheConfig, CacheError, Flush};
use common::{decode, encode, write_entry, Disk, Io, OrderChecker, TestBackend, ENTRY};
use test_support::run;

fn cache(disk: &Rc<Disk>, id: u8, slots: u64) -> Rc<Cache<u32, TestBackend>> {
    let config = CacheConfig::new(format!("cache{id}"), ENTRY, slots * ENTRY as u64);
    let backend = TestBackend {
        id,
        disk: Rc::clone(disk),
    };
    let cache = Rc::new(Cache::new(config, backend).expect("cache"));
    disk.watched
        .borrow_mut()
        .push((Rc::downgrade(&cache), slots));
    cache
}

async fn settle() {
    for _ in 0..50 {
        tokio::task::yield_now().await;
    }
}

async fn version_in(c: &Cache<u32, TestBackend>, key: u32) -> u64 {
    c.read(key, |b| decode(b, key).expect("well-formed entry"))
        .await
        .expect("read")
}

fn assert_clean_log(disk: &Disk) {
    let violations = disk.violations.borrow();
    assert!(violations.is_empty(), "{violations:?}");
    let errors = OrderChecker::default().check(&disk.log.borrow());
    assert!(errors.is_empty(), "{errors:?}");
}

#[test]
fn two_misses_of_one_key_share_one_load() {
    run(async {
        let disk = Disk::new(1, 0);
        let c = cache(&disk, 0, 4);
        disk.hold.set(true);
        let a = tokio::task::spawn_local({
            let c = Rc::clone(&c);
            async move { version_in(&c, 7).await }
        });
        let b = tokio::task::spawn_local({
            let c = Rc::clone(&c);
            async move { version_in(&c, 7).await }
        });
        settle().await;
        assert_eq!(c.stats().entries, 1, "one slot reserved for the one load");
        disk.hold.set(false);
        assert_eq!((a.await.expect("a"), b.await.expect("b")), (0, 0));
        assert_eq!(disk.loads.get(), 1);
        let s = c.stats();
        assert_eq!((s.misses, s.hits), (1, 1));
        assert_clean_log(&disk);
    });
}

#[test]
fn an_entry_modified_during_its_write_back_stays_dirty() {
    run(async {
        let disk = Disk::new(1, 0);
        let c = cache(&disk, 0, 4);
        c.modify(1, |b| write_entry(b, 1, 10))
            .await
            .expect("modify");
        disk.hold.set(true);
        let flush = tokio::task::spawn_local({
            let c = Rc::clone(&c);
            async move { c.flush().await }
        });
        settle().await;
        // The copy of v10 is being written; the entry is readable and writable meanwhile.
        assert_eq!(version_in(&c, 1).await, 10);
        c.modify(1, |b| write_entry(b, 1, 11))
            .await
            .expect("modify");
        disk.hold.set(false);
        flush.await.expect("join").expect("flush");
        assert_eq!(disk.version(0, 1), Ok(10));
        assert_eq!(c.stats().dirty, 1, "v11 came after the write-back started");
        c.flush().await.expect("flush");
        assert_eq!(disk.version(0, 1), Ok(11));
        assert_eq!(c.stats().dirty, 0);
        assert_clean_log(&disk);
    });
}

#[test]
fn a_failed_write_back_is_reported_and_stays_dirty() {
    run(async {
        let disk = Disk::new(1, 0);
        let c = cache(&disk, 0, 4);
        c.modify(3, |b| write_entry(b, 3, 5)).await.expect("modify");
        disk.fail_writes.borrow_mut().insert(0, 1);
        let e = c.flush().await.expect_err("the write-back fails");
        assert!(
            matches!(&e, CacheError::WriteBack { key, .. } if key == "3"),
            "{e}"
        );
        assert!(e.to_string().contains("cache0") && e.to_string().contains("entry 3"));
        // The failed flush did not flush the backend.
        assert!(!disk
            .log
            .borrow()
            .iter()
            .any(|io| matches!(io, Io::FlushStart { .. })));
        assert_eq!(c.stats().dirty, 1);
        c.flush().await.expect("second flush");
        assert_eq!(disk.version(0, 3), Ok(5));
        assert_clean_log(&disk);
    });
}

#[test]
fn the_budget_holds_while_loads_are_in_flight() {
    run(async {
        let disk = Disk::new(1, 0);
        let c = cache(&disk, 0, 2);
        disk.hold.set(true);
        let tasks: Vec<_> = (0..6)
            .map(|key| {
                let c = Rc::clone(&c);
                tokio::task::spawn_local(async move { version_in(&c, key).await })
            })
            .collect();
        settle().await;
        let s = c.stats();
        assert_eq!((s.entries, s.bytes_in_use), (2, 2 * ENTRY as u64));
        assert_eq!(disk.loads.get(), 2, "the other four wait for room");
        disk.hold.set(false);
        for t in tasks {
            assert_eq!(t.await.expect("join"), 0);
        }
        assert!(c.stats().entries <= 2);
        assert_eq!(disk.loads.get(), 6);
        assert_clean_log(&disk);
    });
}

#[test]
fn forgetting_an_entry_being_written_keeps_its_key_busy() {
    run(async {
        let disk = Disk::new(1, 0);
        let c = cache(&disk, 0, 4);
        c.modify(2, |b| write_entry(b, 2, 20))
            .await
            .expect("modify");
        disk.hold.set(true);
        let flush = tokio::task::spawn_local({
            let c = Rc::clone(&c);
            async move { c.flush().await }
        });
        settle().await;
        c.forget(|&k| k == 2);
        assert!(!c.contains(&2));
        // A new table at the same place must not be written while the old write runs.
        let create = tokio::task::spawn_local({
            let c = Rc::clone(&c);
            async move { c.create(2, |b| write_entry(b, 2, 21)).await }
        });
        settle().await;
        assert!(!create.is_finished(), "create waits for the old write-back");
        disk.hold.set(false);
        create.await.expect("join").expect("create");
        flush.await.expect("join").expect("flush");
        c.flush().await.expect("flush");
        assert_eq!(disk.version(0, 2), Ok(21));
        assert_clean_log(&disk);
    });
}

#[test]
fn forgotten_dirty_entries_are_not_written() {
    run(async {
        let disk = Disk::new(1, 0);
        let c = cache(&disk, 0, 4);
        c.create(4, |b| write_entry(b, 4, 40))
            .await
            .expect("create");
        c.modify(5, |b| write_entry(b, 5, 50))
            .await
            .expect("modify");
        c.forget(|&k| k == 4);
        c.flush().await.expect("flush");
        assert_eq!(disk.version(0, 4), Ok(0));
        assert_eq!(disk.version(0, 5), Ok(50));
        assert_eq!(c.stats().entries, 1);
        // A key forgotten while it loads is loaded afresh by whoever waited for it.
        disk.hold.set(true);
        let read = tokio::task::spawn_local({
            let c = Rc::clone(&c);
            async move { version_in(&c, 6).await }
        });
        settle().await;
        c.forget(|&k| k == 6);
        disk.hold.set(false);
        assert_eq!(read.await.expect("join"), 0);
        assert_eq!(disk.loads.get(), 3, "5, then 6 twice");
        assert_clean_log(&disk);
    });
}

#[test]
fn abandoned_loads_and_write_backs_leave_a_consistent_cache() {
    run(async {
        let disk = Disk::new(1, 0);
        let c = cache(&disk, 0, 2);
        disk.hold.set(true);
        let read = tokio::task::spawn_local({
            let c = Rc::clone(&c);
            async move { version_in(&c, 1).await }
        });
        settle().await;
        assert_eq!(c.stats().entries, 1);
        read.abort();
        assert!(read.await.is_err());
        assert_eq!(
            c.stats().entries,
            0,
            "the abandoned load's slot is free again"
        );
        disk.hold.set(false);

        c.modify(1, |b| write_entry(b, 1, 7)).await.expect("modify");
        disk.hold.set(true);
        let flush = tokio::task::spawn_local({
            let c = Rc::clone(&c);
            async move { c.flush().await }
        });
        settle().await;
        assert_eq!(c.stats().dirty, 0, "the write-back has started");
        flush.abort();
        assert!(flush.await.is_err());
        assert_eq!(c.stats().dirty, 1, "nobody knows whether it arrived");
        disk.hold.set(false);
        c.flush().await.expect("flush");
        assert_eq!(disk.version(0, 1), Ok(7));
        assert_eq!(c.stats().dirty, 0);
    });
}

#[test]
fn a_failed_load_frees_its_slot_and_waiters_retry() {
    run(async {
        let disk = Disk::new(1, 0);
        let c = cache(&disk, 0, 2);
        disk.fail_loads.borrow_mut().insert(0, 1);
        disk.hold.set(true);
        let first = tokio::task::spawn_local({
            let c = Rc::clone(&c);
            async move { c.read(9, |_| ()).await }
        });
        let second = tokio::task::spawn_local({
            let c = Rc::clone(&c);
            async move { version_in(&c, 9).await }
        });
        settle().await;
        disk.hold.set(false);
        let e = first.await.expect("join").expect_err("injected");
        assert!(
            matches!(&e, CacheError::Load { key, .. } if key == "9"),
            "{e}"
        );
        assert_eq!(
            second.await.expect("join"),
            0,
            "the waiter loaded it itself"
        );
        assert_eq!(disk.loads.get(), 2);
        assert_eq!(c.stats().entries, 1);
    });
}

#[test]
fn evicting_a_dirty_entry_writes_it_back_first() {
    run(async {
        let disk = Disk::new(1, 0);
        let c = cache(&disk, 0, 2);
        c.modify(1, |b| write_entry(b, 1, 100))
            .await
            .expect("modify");
        c.modify(2, |b| write_entry(b, 2, 200))
            .await
            .expect("modify");
        // Both dirty: room for key 3 needs a write-back.
        assert_eq!(version_in(&c, 3).await, 0);
        let s = c.stats();
        assert_eq!((s.evictions, s.write_backs, s.entries), (1, 1, 2));
        assert!(disk.version(0, 1) == Ok(100) || disk.version(0, 2) == Ok(200));
        assert_eq!(version_in(&c, 1).await, 100);
        assert_eq!(version_in(&c, 2).await, 200);
        assert_clean_log(&disk);
    });
}

#[test]
fn a_dependency_flushes_the_other_cache_first() {
    run(async {
        let disk = Disk::new(1, 0);
        let l2 = cache(&disk, 0, 4);
        let refcounts = cache(&disk, 1, 4);
        refcounts
            .modify(1, |b| write_entry(b, 1, 1))
            .await
            .expect("modify");
        l2.set_dependency(refcounts.clone()).await.expect("depend");
        disk.log(Io::DependencySet {
            from: 0,
            to: 1,
            required: vec![(1, 1)],
        });
        assert!(l2.has_pending_dependency());
        l2.create(8, |b| write_entry(b, 8, 2))
            .await
            .expect("create");
        l2.flush().await.expect("flush");
        assert!(!l2.has_pending_dependency(), "cleared once honoured");
        assert_eq!(disk.version(1, 1), Ok(1));
        assert_eq!(disk.version(0, 8), Ok(2));
        let log = disk.log.borrow();
        let pos = |want: &Io| log.iter().position(|io| io == want).expect("logged");
        assert!(
            pos(&Io::WriteStart {
                cache: 1,
                key: 1,
                version: 1
            }) < pos(&Io::WriteStart {
                cache: 0,
                key: 8,
                version: 2
            })
        );
        drop(log);
        assert_clean_log(&disk);
    });
}

#[test]
fn opposite_dependencies_are_honoured_in_turn_without_a_cycle() {
    run(async {
        let disk = Disk::new(1, 0);
        let l2 = cache(&disk, 0, 4);
        let refcounts = cache(&disk, 1, 4);
        // Allocation: refcount first, then the L2 entry.
        refcounts
            .modify(1, |b| write_entry(b, 1, 1))
            .await
            .expect("modify");
        l2.set_dependency(refcounts.clone()).await.expect("depend");
        disk.log(Io::DependencySet {
            from: 0,
            to: 1,
            required: vec![(1, 1)],
        });
        l2.modify(5, |b| write_entry(b, 5, 2))
            .await
            .expect("modify");
        // Freeing: the L2 entry first, then the refcount. Setting this flushes the
        // refcounts now (the L2 cache's dependency), so no cycle forms.
        refcounts.set_dependency(l2.clone()).await.expect("depend");
        disk.log(Io::DependencySet {
            from: 1,
            to: 0,
            required: vec![(5, 2)],
        });
        assert_eq!(
            disk.version(1, 1),
            Ok(1),
            "refcount v1 flushed by set_dependency"
        );
        assert!(!l2.has_pending_dependency() && refcounts.has_pending_dependency());
        refcounts
            .modify(1, |b| write_entry(b, 1, 3))
            .await
            .expect("modify");
        refcounts.flush().await.expect("flush");
        l2.flush().await.expect("flush");
        assert_eq!(disk.version(0, 5), Ok(2));
        assert_eq!(disk.version(1, 1), Ok(3));
        assert_clean_log(&disk);
        // Depending on oneself is meaningless and ignored.
        let me: Rc<dyn Flush> = l2.clone();
        l2.set_dependency(me).await.expect("self");
        assert!(!l2.has_pending_dependency());
    });
}

#[test]
fn clean_idle_drops_only_unused_entries_and_writes_dirty_ones_first() {
    run(async {
        let disk = Disk::new(1, 0);
        let c = cache(&disk, 0, 4);
        c.modify(1, |b| write_entry(b, 1, 11))
            .await
            .expect("modify");
        version_in(&c, 2).await;
        // Everything was used since the (implicit) previous cleaning: nothing goes.
        c.clean_idle().await.expect("clean");
        assert_eq!(c.stats().entries, 2);
        version_in(&c, 2).await;
        c.clean_idle().await.expect("clean");
        let s = c.stats();
        assert_eq!((s.entries, s.idle_drops, s.dirty), (1, 1, 0));
        assert!(c.contains(&2) && !c.contains(&1));
        assert_eq!(
            disk.version(0, 1),
            Ok(11),
            "written back before it was dropped"
        );
        // A failing write-back keeps the entry.
        c.modify(3, |b| write_entry(b, 3, 33))
            .await
            .expect("modify");
        c.clean_idle().await.expect("clean");
        disk.fail_writes.borrow_mut().insert(0, 1);
        assert!(c.clean_idle().await.is_err());
        assert!(c.contains(&3));
        assert_eq!(c.stats().dirty, 1);
        c.flush().await.expect("flush");
        assert_eq!(disk.version(0, 3), Ok(33));
        assert_clean_log(&disk);
    });
}

#[test]
fn the_idle_cleaner_runs_every_interval() {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_time()
        .start_paused(true)
        .build()
        .expect("runtime");
    tokio::task::LocalSet::new().block_on(&rt, async {
        let disk = Disk::new(1, 0);
        let c = cache(&disk, 0, 4);
        c.modify(1, |b| write_entry(b, 1, 5)).await.expect("modify");
        let cleaner = tokio::task::spawn_local(c.idle_cleaner(Duration::from_secs(600)));
        tokio::time::sleep(Duration::from_secs(599)).await;
        assert_eq!(c.stats().entries, 1);
        // First tick: the entry was used before it, so it survives; second tick drops it.
        tokio::time::sleep(Duration::from_secs(2)).await;
        assert_eq!(c.stats().entries, 1);
        tokio::time::sleep(Duration::from_secs(600)).await;
        assert_eq!(c.stats().entries, 0);
        assert_eq!(disk.version(0, 1), Ok(5));
        // The cleaner ends when the cache goes away.
        drop(c);
        tokio::time::sleep(Duration::from_secs(601)).await;
        assert!(cleaner.is_finished());
        // Interval 0 = disabled: the task ends at once.
        let c = cache(&disk, 1, 4);
        let off = tokio::task::spawn_local(c.idle_cleaner(Duration::ZERO));
        tokio::time::sleep(Duration::from_millis(1)).await;
        assert!(off.is_finished());
    });
}

#[test]
fn invalid_configurations_are_errors() {
    let disk = Disk::new(1, 0);
    let backend = || TestBackend {
        id: 0,
        disk: Rc::clone(&disk),
    };
    for (entry, capacity) in [(0, 4096), (512, 511), (512, 0)] {
        let e = Cache::new(CacheConfig::new("bad", entry, capacity), backend())
            .err()
            .expect("invalid");
        assert!(matches!(e, CacheError::Config { .. }), "{e}");
        assert!(e
            .to_string()
            .starts_with("bad cache: invalid configuration"));
    }
    // Capacity rounds down to whole entries.
    let c = Cache::new(CacheConfig::new("ok", 512, 1500), backend()).expect("cache");
    assert_eq!(c.stats().capacity, 1024);
    assert_eq!(encode(1, 2).len(), ENTRY);
}
