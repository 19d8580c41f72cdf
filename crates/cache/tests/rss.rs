//! Idle cleaning really returns memory to the operating system: the resident set size of
//! the process grows when a cache fills and shrinks again when idle entries are dropped.

use std::cell::Cell;
use std::io;

use cache::{Backend, Cache, CacheConfig};
use test_support::{rss_bytes, run};

const MIB: u64 = 1 << 20;

/// Counts write-backs and keeps nothing, so the test's own memory does not grow.
#[derive(Default)]
struct Sink {
    written: Cell<u64>,
}

impl Backend<u64> for Sink {
    async fn load(&self, _key: u64, buf: &mut [u8]) -> io::Result<()> {
        buf.fill(0xa5);
        Ok(())
    }
    type Snapshot = ();
    fn snapshot(&self, _data: &[u8]) {}
    async fn write_back(&self, _key: u64, _at: usize, _data: ()) -> io::Result<()> {
        self.written.set(self.written.get() + 1);
        Ok(())
    }
    async fn flush(&self) -> io::Result<()> {
        Ok(())
    }
}

#[test]
fn idle_cleaning_gives_memory_back() {
    run(async {
        let capacity = 64 * MIB;
        let entries = capacity / 4096;
        let c = Cache::new(CacheConfig::new("l2", 4096, capacity), Sink::default()).expect("cache");
        let empty = rss_bytes();
        // Half the entries dirty (created), half clean (loaded).
        for key in 0..entries {
            if key % 2 == 0 {
                c.create(key, |b| b.fill(0x5a)).await.expect("create");
            } else {
                c.read(key, |b| assert_eq!(b[0], 0xa5)).await.expect("read");
            }
        }
        let full = rss_bytes();
        assert_eq!(c.stats().bytes_in_use, capacity);
        assert!(
            full >= empty + capacity * 9 / 10,
            "filling the cache should cost about {capacity} bytes: {empty} -> {full}"
        );

        // First cleaning: everything was used since the start, nothing goes.
        c.clean_idle().await.expect("clean");
        assert_eq!(c.stats().entries, entries);
        // Second cleaning: nothing was used since the first one.
        c.clean_idle().await.expect("clean");
        let s = c.stats();
        assert_eq!((s.entries, s.idle_drops, s.dirty), (0, entries, 0));
        assert_eq!(
            c.backend().written.get(),
            entries / 2,
            "dirty ones written first"
        );
        let cleaned = rss_bytes();
        assert!(
            cleaned + capacity * 9 / 10 <= full,
            "cleaning should give back about {capacity} bytes: {full} -> {cleaned}"
        );

        // The cache still works, from the start of its memory.
        c.read(1, |b| assert_eq!(b[0], 0xa5)).await.expect("read");
        assert_eq!(c.stats().entries, 1);
    });
}
