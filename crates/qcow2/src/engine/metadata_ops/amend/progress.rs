//! How far an amend has come, reported as QEMU's qcow2 driver reports it to `qemu-img amend
//! -p`: each long operation (a version change, a refcount width change) reports its own
//! offset out of its own work size, and the whole is projected from the operations done so
//! far, so scripts that parse the percentages see the same ones.

use std::cell::Cell;

/// The long operations of an amend, in the order they run.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Operation {
    Upgrade,
    RefcountWidth,
    Downgrade,
}

/// Reports percentages (0 to 100) to a callback as operations advance.
pub(super) struct Steps<'a> {
    report: &'a dyn Fn(f64),
    total_ops: u64,
    ops_done: Cell<u64>,
    offset_done: Cell<u64>,
    last_work: Cell<u64>,
    current: Cell<Option<Operation>>,
    last: Cell<Option<Operation>>,
}

impl<'a> Steps<'a> {
    /// Steps over `total_ops` operations (none reports nothing).
    pub(super) fn new(report: &'a dyn Fn(f64), total_ops: u64) -> Self {
        Steps {
            report,
            total_ops,
            ops_done: Cell::new(0),
            offset_done: Cell::new(0),
            last_work: Cell::new(0),
            current: Cell::new(None),
            last: Cell::new(None),
        }
    }

    /// The operation that reports from now on.
    pub(super) fn start(&self, op: Operation) {
        self.current.set(Some(op));
    }

    /// The current operation has done `offset` of `work`.
    pub(super) fn at(&self, offset: u64, work: u64) {
        if self.total_ops == 0 {
            return;
        }
        if self.current.get() != self.last.get() {
            if self.last.get().is_some() {
                self.offset_done
                    .set(self.offset_done.get().saturating_add(self.last_work.get()));
                self.ops_done.set(self.ops_done.get() + 1);
            }
            self.last.set(self.current.get());
        }
        self.last_work.set(work);
        let done = self.ops_done.get().min(self.total_ops - 1);
        let current = self.offset_done.get().saturating_add(work);
        // The operations still to come are assumed to be as long, on average, as the ones
        // seen so far (this one included).
        let projected = current.saturating_mul(self.total_ops - done - 1) / (done + 1);
        let total = current.saturating_add(projected);
        if total == 0 {
            return;
        }
        let at = self.offset_done.get().saturating_add(offset);
        (self.report)(100.0 * at as f64 / total as f64);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::cell::RefCell;

    fn run(total_ops: u64, f: impl FnOnce(&Steps<'_>)) -> Vec<f64> {
        let seen = RefCell::new(Vec::new());
        let report = |p: f64| seen.borrow_mut().push(p);
        f(&Steps::new(&report, total_ops));
        seen.into_inner()
    }

    #[test]
    fn one_operation_reports_its_own_fraction() {
        let seen = run(1, |s| {
            s.start(Operation::Downgrade);
            for i in 0..=4 {
                s.at(i, 4);
            }
        });
        assert_eq!(seen, [0.0, 25.0, 50.0, 75.0, 100.0]);
    }

    #[test]
    fn later_operations_are_projected_from_earlier_ones() {
        let seen = run(2, |s| {
            s.start(Operation::Upgrade);
            s.at(0, 2);
            s.at(2, 2);
            s.start(Operation::Downgrade);
            s.at(1, 2);
            s.at(2, 2);
        });
        // First: 2 units seen, 2 more projected; then the second's own 2.
        assert_eq!(seen, [0.0, 50.0, 75.0, 100.0]);
    }

    #[test]
    fn nothing_to_report_without_operations() {
        assert!(run(0, |s| s.at(1, 2)).is_empty());
    }
}
