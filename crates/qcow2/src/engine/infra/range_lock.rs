//! Guest-range locks: who may touch which guest clusters while requests are in flight.
//!
//! Reads and in-place writes take shared locks; anything that changes where a guest cluster
//! lives (allocation, copy-on-write, discard, zeroing that frees) takes an exclusive lock. That
//! is the only waiting the engine does: requests on other clusters never wait for each other.
//! Without it a read could land in a host cluster that a concurrent discard freed and a later
//! write reused for another guest offset, or two copy-on-writes of one subcluster could
//! overwrite each other's guest data. Waiters are served in arrival order, so a stream of
//! shared requests cannot starve an exclusive one.

use std::cell::RefCell;
use tokio::sync::Notify;

/// How a range is held.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LockMode {
    /// Many holders at once (reads, in-place writes).
    Shared,
    /// One holder (allocation, COW, freeing).
    Exclusive,
}

#[derive(Clone, Copy, Debug)]
struct Entry {
    ticket: u64,
    start: u64,
    end: u64,
    mode: LockMode,
}

impl Entry {
    fn conflicts(&self, other: &Entry) -> bool {
        self.start < other.end
            && other.start < self.end
            && (self.mode == LockMode::Exclusive || other.mode == LockMode::Exclusive)
    }
}

#[derive(Default)]
struct State {
    next_ticket: u64,
    held: Vec<Entry>,
    waiting: Vec<Entry>,
}

/// A set of locked half-open ranges `[start, end)` (units are the caller's, e.g. clusters).
#[derive(Default)]
pub struct RangeLocks {
    state: RefCell<State>,
    released: Notify,
}

/// Holds a range until dropped.
#[must_use = "the range is unlocked when the guard is dropped"]
pub struct RangeGuard<'a> {
    locks: &'a RangeLocks,
    ticket: u64,
}

/// Removes a waiter that gave up (its future was dropped) so it blocks nobody.
struct WaitTicket<'a> {
    locks: &'a RangeLocks,
    ticket: u64,
    granted: bool,
}

impl Drop for WaitTicket<'_> {
    fn drop(&mut self) {
        if !self.granted {
            let mut st = self.locks.state.borrow_mut();
            st.waiting.retain(|e| e.ticket != self.ticket);
            drop(st);
            self.locks.released.notify_waiters();
        }
    }
}

impl RangeLocks {
    /// An empty lock set.
    pub fn new() -> Self {
        Self::default()
    }

    /// Lock `[start, end)`; waits while a conflicting lock is held or requested earlier.
    pub async fn lock(&self, start: u64, end: u64, mode: LockMode) -> RangeGuard<'_> {
        let ticket = {
            let mut st = self.state.borrow_mut();
            st.next_ticket += 1;
            let ticket = st.next_ticket;
            st.waiting.push(Entry {
                ticket,
                start,
                end,
                mode,
            });
            ticket
        };
        let mut wait = WaitTicket {
            locks: self,
            ticket,
            granted: false,
        };
        loop {
            // Single-threaded: nothing can run between this check and registering the
            // notification below, so no release is missed.
            if self.try_grant(ticket) {
                wait.granted = true;
                return RangeGuard {
                    locks: self,
                    ticket,
                };
            }
            self.released.notified().await;
        }
    }

    fn try_grant(&self, ticket: u64) -> bool {
        let mut st = self.state.borrow_mut();
        let Some(pos) = st.waiting.iter().position(|e| e.ticket == ticket) else {
            return false;
        };
        let me = st.waiting[pos];
        let blocked = st.held.iter().any(|h| h.conflicts(&me))
            || st.waiting[..pos].iter().any(|w| w.conflicts(&me));
        if blocked {
            return false;
        }
        st.waiting.remove(pos);
        st.held.push(me);
        true
    }

    /// Number of held locks (for statistics and tests).
    pub fn held(&self) -> usize {
        self.state.borrow().held.len()
    }
}

impl Drop for RangeGuard<'_> {
    fn drop(&mut self) {
        let mut st = self.locks.state.borrow_mut();
        st.held.retain(|e| e.ticket != self.ticket);
        let anyone_waiting = !st.waiting.is_empty();
        drop(st);
        if anyone_waiting {
            self.locks.released.notify_waiters();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::cell::Cell;
    use std::rc::Rc;
    use tokio::task::{spawn_local, yield_now, LocalSet};

    fn run<F: std::future::Future>(f: F) -> F::Output {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        LocalSet::new().block_on(&rt, f)
    }

    #[test]
    fn shared_locks_coexist_exclusive_waits() {
        run(async {
            let locks = Rc::new(RangeLocks::new());
            let a = locks.lock(0, 10, LockMode::Shared).await;
            let b = locks.lock(5, 15, LockMode::Shared).await;
            let done = Rc::new(Cell::new(false));
            let (l2, d2) = (locks.clone(), done.clone());
            let t = spawn_local(async move {
                let _g = l2.lock(8, 9, LockMode::Exclusive).await;
                d2.set(true);
            });
            yield_now().await;
            assert!(!done.get());
            drop(a);
            yield_now().await;
            assert!(!done.get(), "still overlaps b");
            drop(b);
            t.await.unwrap();
            assert!(done.get());
            assert_eq!(locks.held(), 0);
        });
    }

    #[test]
    fn disjoint_exclusive_locks_do_not_wait() {
        run(async {
            let locks = RangeLocks::new();
            let _a = locks.lock(0, 10, LockMode::Exclusive).await;
            let _b = locks.lock(10, 20, LockMode::Exclusive).await;
            assert_eq!(locks.held(), 2);
        });
    }

    #[test]
    fn waiting_exclusive_blocks_later_shared() {
        run(async {
            let locks = Rc::new(RangeLocks::new());
            let order = Rc::new(RefCell::new(Vec::new()));
            let first = locks.lock(0, 4, LockMode::Shared).await;
            let (l, o) = (locks.clone(), order.clone());
            let ex = spawn_local(async move {
                let _g = l.lock(0, 4, LockMode::Exclusive).await;
                o.borrow_mut().push("exclusive");
                yield_now().await;
            });
            yield_now().await;
            let (l, o) = (locks.clone(), order.clone());
            let sh = spawn_local(async move {
                let _g = l.lock(2, 3, LockMode::Shared).await;
                o.borrow_mut().push("shared");
            });
            yield_now().await;
            assert!(order.borrow().is_empty());
            drop(first);
            ex.await.unwrap();
            sh.await.unwrap();
            assert_eq!(*order.borrow(), vec!["exclusive", "shared"]);
        });
    }

    #[test]
    fn abandoned_waiter_unblocks_others() {
        run(async {
            let locks = Rc::new(RangeLocks::new());
            let held = locks.lock(0, 4, LockMode::Shared).await;
            let l = locks.clone();
            let ex = spawn_local(async move {
                let _g = l.lock(0, 4, LockMode::Exclusive).await;
            });
            yield_now().await;
            let l = locks.clone();
            let sh = spawn_local(async move {
                let _g = l.lock(0, 1, LockMode::Shared).await;
            });
            yield_now().await;
            ex.abort();
            let _ = ex.await;
            sh.await.unwrap();
            drop(held);
            assert_eq!(locks.held(), 0);
        });
    }
}
