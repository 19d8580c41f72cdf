//! Exclusive locks on ranges of aligned blocks, so that O_DIRECT read-modify-write cycles on a
//! block never interleave with another write to that block (which would lose an update).
//! Single-threaded: a list of held ranges and the wakers of those waiting for one.

use std::cell::RefCell;
use std::future::poll_fn;
use std::ops::Range;
use std::task::{Poll, Waker};

#[derive(Default)]
struct State {
    held: Vec<(u64, Range<u64>)>,
    waiters: Vec<Waker>,
    next_id: u64,
}

/// A set of exclusive block-range locks.
#[derive(Default)]
pub(crate) struct BlockLocks {
    state: RefCell<State>,
}

/// Releases its range when dropped.
pub(crate) struct BlockGuard<'a> {
    locks: &'a BlockLocks,
    id: u64,
}

impl BlockLocks {
    /// Wait until no held range overlaps `blocks`, then hold it.
    pub(crate) async fn lock(&self, blocks: Range<u64>) -> BlockGuard<'_> {
        poll_fn(|cx| {
            let mut st = self.state.borrow_mut();
            if st
                .held
                .iter()
                .any(|(_, r)| r.start < blocks.end && blocks.start < r.end)
            {
                st.waiters.push(cx.waker().clone());
                return Poll::Pending;
            }
            let id = st.next_id;
            st.next_id += 1;
            st.held.push((id, blocks.clone()));
            Poll::Ready(BlockGuard { locks: self, id })
        })
        .await
    }

    /// Number of ranges held now (tests).
    #[cfg(test)]
    pub(crate) fn held(&self) -> usize {
        self.state.borrow().held.len()
    }
}

impl Drop for BlockGuard<'_> {
    fn drop(&mut self) {
        let waiters = {
            let mut st = self.locks.state.borrow_mut();
            st.held.retain(|(id, _)| *id != self.id);
            std::mem::take(&mut st.waiters)
        };
        // Everyone re-checks; the queue is short (bounded by the requests in flight).
        for w in waiters {
            w.wake();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::cell::Cell;

    #[test]
    fn overlapping_ranges_exclude_each_other_and_disjoint_ones_do_not() {
        let rt = tokio::runtime::Builder::new_current_thread()
            .build()
            .unwrap();
        rt.block_on(async {
            let locks = BlockLocks::default();
            let inside = Cell::new(0u32);
            let max_inside = Cell::new(0u32);
            let critical = |r: Range<u64>| {
                let (locks, inside, max_inside) = (&locks, &inside, &max_inside);
                async move {
                    let _g = locks.lock(r).await;
                    inside.set(inside.get() + 1);
                    max_inside.set(max_inside.get().max(inside.get()));
                    tokio::task::yield_now().await;
                    inside.set(inside.get() - 1);
                }
            };
            tokio::join!(critical(0..3), critical(1..4), critical(2..5));
            assert_eq!(max_inside.get(), 1, "overlapping ranges ran together");
            max_inside.set(0);
            tokio::join!(critical(0..1), critical(1..2), critical(5..9));
            assert_eq!(max_inside.get(), 3, "disjoint ranges were serialized");
            assert_eq!(locks.held(), 0);
        });
    }
}
