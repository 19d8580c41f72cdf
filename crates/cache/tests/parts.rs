//! `modify_part`: a write-back writes only the pages that changed, not the whole entry, and
//! a part that could not be written stays to be written.

use std::cell::{Cell, RefCell};
use std::collections::HashMap;
use std::io;

use cache::{Backend, Cache, CacheConfig, CacheError, PAGE};
use test_support::run;

const ENTRY: usize = 64 * 1024;

/// Entries kept in memory; every write is logged as (key, at, length).
#[derive(Default)]
struct Recorder {
    disk: RefCell<HashMap<u64, Vec<u8>>>,
    writes: RefCell<Vec<(u64, usize, usize)>>,
    fail_writes: Cell<bool>,
}

impl Backend<u64> for Recorder {
    async fn load(&self, key: u64, buf: &mut [u8]) -> io::Result<()> {
        match self.disk.borrow().get(&key) {
            Some(bytes) => buf.copy_from_slice(bytes),
            None => buf.fill(0xee),
        }
        Ok(())
    }
    type Snapshot = Vec<u8>;
    fn snapshot(&self, data: &[u8]) -> Vec<u8> {
        data.to_vec()
    }
    async fn write_back(&self, key: u64, at: usize, data: Vec<u8>) -> io::Result<()> {
        tokio::task::yield_now().await;
        if self.fail_writes.get() {
            return Err(io::Error::other("injected write failure"));
        }
        self.writes.borrow_mut().push((key, at, data.len()));
        let mut disk = self.disk.borrow_mut();
        let entry = disk.entry(key).or_insert_with(|| vec![0xee; ENTRY]);
        entry[at..at + data.len()].copy_from_slice(&data);
        Ok(())
    }
    async fn flush(&self) -> io::Result<()> {
        Ok(())
    }
}

fn cache() -> Cache<u64, Recorder> {
    Cache::new(
        CacheConfig::new("l2", ENTRY, 4 * ENTRY as u64),
        Recorder::default(),
    )
    .expect("cache")
}

#[test]
fn a_changed_part_is_written_back_as_its_page_only() {
    run(async {
        let c = cache();
        c.modify_part(7, 5000..5008, |b| b.copy_from_slice(&[1; 8]))
            .await
            .expect("modify");
        c.modify_part(7, 40_000..40_001, |b| b[0] = 2)
            .await
            .expect("modify");
        c.flush().await.expect("flush");
        let writes = c.backend().writes.borrow().clone();
        assert_eq!(writes, vec![(7, PAGE, PAGE), (7, 9 * PAGE, PAGE)]);
        let disk = c.backend().disk.borrow();
        let entry = &disk[&7];
        assert_eq!(&entry[5000..5008], &[1; 8]);
        assert_eq!(entry[40_000], 2);
        // Bytes of the written pages that were not changed hold what was loaded.
        assert_eq!(entry[4096], 0xee);
    });
}

#[test]
fn a_whole_modify_still_writes_the_whole_entry() {
    run(async {
        let c = cache();
        c.modify(3, |b| b[0] = 9).await.expect("modify");
        c.flush().await.expect("flush");
        assert_eq!(*c.backend().writes.borrow(), vec![(3, 0, ENTRY)]);
    });
}

#[test]
fn parts_that_failed_to_be_written_are_written_by_the_next_flush() {
    run(async {
        let c = cache();
        c.modify_part(1, 0..8, |b| b.fill(3)).await.expect("modify");
        c.backend().fail_writes.set(true);
        assert!(c.flush().await.is_err());
        c.backend().fail_writes.set(false);
        c.modify_part(1, 3 * PAGE..3 * PAGE + 8, |b| b.fill(4))
            .await
            .expect("modify");
        c.flush().await.expect("flush");
        let writes = c.backend().writes.borrow().clone();
        assert_eq!(writes, vec![(1, 0, PAGE), (1, 3 * PAGE, PAGE)]);
        assert_eq!(&c.backend().disk.borrow()[&1][..8], &[3; 8]);
        // Nothing is left dirty.
        c.flush().await.expect("flush");
        assert_eq!(c.backend().writes.borrow().len(), 2);
    });
}

#[test]
fn a_part_outside_the_entry_is_refused_without_running_the_closure() {
    run(async {
        let c = cache();
        let ran = Cell::new(false);
        let err = c
            .modify_part(1, ENTRY - 4..ENTRY + 4, |_| ran.set(true))
            .await
            .expect_err("outside");
        assert!(matches!(err, CacheError::Part { .. }), "{err}");
        assert!(!ran.get());
        assert!(c.backend().writes.borrow().is_empty());
    });
}
