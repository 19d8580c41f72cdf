//! [`StatsRegistry`]: the exports whose statistics the server reports, added and removed as
//! exports come and go, and the server's total, which never goes back: an export's numbers
//! stay in it after the export is removed.

use std::cell::RefCell;
use std::rc::Rc;

use super::counters::{Counters, ExportStats, Gauges};

/// Where what is true now of an export comes from (its image's caches, the server's count
/// of its clients), asked at each snapshot.
pub type GaugeSource = Box<dyn Fn() -> Gauges>;

/// Why an export cannot be registered.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum StatsError {
    /// Another registered export has the name.
    #[error("statistics: export {0:?} is registered already")]
    Duplicate(String),
}

struct Live {
    name: String,
    stats: Rc<ExportStats>,
    now: GaugeSource,
}

/// A removed export whose requests may still be finishing: its counters join the total
/// once nothing else holds them.
struct Leaving {
    stats: Rc<ExportStats>,
    last: Gauges,
}

#[derive(Default)]
struct Inner {
    live: Vec<Live>,
    leaving: Vec<Leaving>,
    /// Everything the removed exports counted.
    retired: Counters,
}

/// The statistics of every export of a server, on the thread that owns the images.
#[derive(Default)]
pub struct StatsRegistry {
    inner: RefCell<Inner>,
}

/// Every export's statistics and the server's total at one moment.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Snapshot {
    /// Each export by name, in the order they were added.
    pub exports: Vec<(String, Counters)>,
    /// All exports, those removed included.
    pub total: Counters,
}

impl StatsRegistry {
    /// Starts counting for export `name`, whose present state `now` reports (it usually
    /// holds a clone of the image, which [`StatsRegistry::remove`] lets go); the export
    /// records its requests in the returned stats.
    pub fn add(&self, name: &str, now: GaugeSource) -> Result<Rc<ExportStats>, StatsError> {
        let mut inner = self.inner.borrow_mut();
        if inner.live.iter().any(|l| l.name == name) {
            return Err(StatsError::Duplicate(name.to_owned()));
        }
        let stats = Rc::new(ExportStats::default());
        inner.live.push(Live {
            name: name.to_owned(),
            stats: Rc::clone(&stats),
            now,
        });
        Ok(stats)
    }

    /// Stops reporting export `name` on its own; its numbers stay in the total. Returns
    /// false if no such export is registered.
    pub fn remove(&self, name: &str) -> bool {
        let mut inner = self.inner.borrow_mut();
        let Some(i) = inner.live.iter().position(|l| l.name == name) else {
            return false;
        };
        let gone = inner.live.remove(i);
        let last = (gone.now)();
        inner.leaving.push(Leaving {
            stats: gone.stats,
            last,
        });
        // Folded in here too, not only when the numbers are read: a server nobody scrapes
        // that adds and deletes exports for months keeps only those still in use.
        inner.retire_finished();
        true
    }

    /// The numbers now.
    pub fn snapshot(&self) -> Snapshot {
        let mut inner = self.inner.borrow_mut();
        inner.retire_finished();
        let exports: Vec<(String, Counters)> = inner
            .live
            .iter()
            .map(|l| (l.name.clone(), l.stats.counters((l.now)())))
            .collect();
        let mut total = inner.retired;
        for l in &inner.leaving {
            total.add(&l.stats.counters(l.last).history());
        }
        for (_, c) in &exports {
            total.add(c);
        }
        Snapshot { exports, total }
    }

    /// One export's statistics as JSON (see [`super::json`]), if it is registered.
    pub fn export_json(&self, name: &str) -> Option<serde_json::Value> {
        let snap = self.snapshot();
        let (_, c) = snap.exports.iter().find(|(n, _)| n == name)?;
        Some(super::json::counters(c))
    }

    /// The server's total as JSON (see [`super::json`]).
    pub fn total_json(&self) -> serde_json::Value {
        super::json::counters(&self.snapshot().total)
    }
}

impl Inner {
    /// Folds into `retired` the removed exports nothing else holds any more: no request of
    /// theirs can still be counted.
    fn retire_finished(&mut self) {
        let mut i = 0;
        while i < self.leaving.len() {
            if Rc::strong_count(&self.leaving[i].stats) == 1 {
                let done = self.leaving.swap_remove(i);
                self.retired.add(&done.stats.counters(done.last).history());
            } else {
                i += 1;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::daemon::stats::Command;
    use std::time::Duration;

    fn no_caches() -> GaugeSource {
        Box::new(Gauges::default)
    }

    fn read(stats: &ExportStats) {
        stats.record(Command::Read, 4096, Duration::from_micros(50), None);
    }

    #[test]
    fn removed_exports_are_folded_in_even_when_nobody_reads_the_numbers() {
        let reg = StatsRegistry::default();
        for _ in 0..100 {
            let c = reg.add("c", no_caches()).unwrap();
            read(&c);
            drop(c);
            assert!(reg.remove("c"));
        }
        assert_eq!(reg.inner.borrow().leaving.len(), 0);
        let held = reg.add("h", no_caches()).unwrap();
        assert!(reg.remove("h"));
        assert_eq!(
            reg.inner.borrow().leaving.len(),
            1,
            "still counted by its export"
        );
        read(&held);
        drop(held);
        assert_eq!(reg.snapshot().total.command(Command::Read).requests(), 101);
        assert_eq!(reg.inner.borrow().leaving.len(), 0);
    }

    #[test]
    fn exports_come_and_go_and_the_total_never_goes_back() {
        let reg = StatsRegistry::default();
        let a = reg.add("a", no_caches()).unwrap();
        let b = reg.add("b", no_caches()).unwrap();
        assert_eq!(
            reg.add("a", no_caches()).unwrap_err(),
            StatsError::Duplicate("a".into())
        );
        read(&a);
        read(&b);
        read(&b);
        let snap = reg.snapshot();
        let names: Vec<&str> = snap.exports.iter().map(|(n, _)| n.as_str()).collect();
        assert_eq!(names, ["a", "b"]);
        assert_eq!(snap.total.command(Command::Read).requests(), 3);

        assert!(reg.remove("b"));
        assert!(!reg.remove("b"));
        // A request of the removed export still finishing counts in the total.
        read(&b);
        let snap = reg.snapshot();
        assert_eq!(snap.exports.len(), 1);
        assert_eq!(snap.total.command(Command::Read).requests(), 4);
        drop(b);
        assert_eq!(reg.snapshot().total.command(Command::Read).requests(), 4);
        assert!(
            reg.inner.borrow().leaving.is_empty(),
            "folded once released"
        );

        // The name can be used again, and starts from zero.
        let b2 = reg.add("b", no_caches()).unwrap();
        read(&b2);
        let snap = reg.snapshot();
        assert_eq!(snap.exports[1].1.command(Command::Read).requests(), 1);
        assert_eq!(snap.total.command(Command::Read).requests(), 5);
        assert!(reg.export_json("b").is_some());
        assert!(reg.export_json("zz").is_none());
    }

    #[test]
    fn attached_connections_of_a_removed_export_leave_the_total() {
        let reg = StatsRegistry::default();
        let a = reg
            .add(
                "a",
                Box::new(|| Gauges {
                    attached: 1,
                    ..Gauges::default()
                }),
            )
            .unwrap();
        a.attached();
        assert_eq!(reg.snapshot().total.attached, 1);
        reg.remove("a");
        let total = reg.snapshot().total;
        assert_eq!((total.attached, total.connections), (0, 1));
    }
}
