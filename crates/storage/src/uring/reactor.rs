//! A small per-thread io_uring reactor integrated with tokio.
//!
//! Operations live in a slab of slots indexed by the SQE's `user_data`. A slot owns the buffer
//! and the file of its operation until the kernel posts the completion, so dropping the
//! future that submitted it never frees memory the kernel may still write into: the slot is
//! marked abandoned and released when its CQE is reaped (or when the reactor is dropped, which
//! blocks until the kernel is done with every buffer).
//!
//! Completions are noticed through an eventfd registered with the ring and with tokio's
//! `AsyncFd`. Exactly one pending operation future (the "poller") waits on the eventfd; when it
//! wakes it reaps every CQE and wakes the futures whose operations finished. When the poller
//! finishes or is dropped it hands the job to another pending future.
//!
//! Submissions can be batched: a new operation's SQE is queued and its future yields once, so
//! the other tasks that are runnable in the same scheduler turn queue theirs too, and one
//! `io_uring_enter` submits them all.

use std::cell::RefCell;
use std::fs::File;
use std::future::Future;
use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::pin::Pin;
use std::rc::{Rc, Weak};
use std::task::{Context, Poll, Waker};

use io_uring::{opcode, squeue, IoUring};
use tokio::io::unix::AsyncFd;
use tokio::io::Interest;

use crate::Slice;

/// Submission-queue entries per ring (completion queue is twice that; the kernel keeps
/// overflowing completions, so more operations than this may be in flight).
pub const DEFAULT_ENTRIES: u32 = 256;

/// What an in-flight operation keeps alive until the kernel has finished with it.
pub(crate) struct Held {
    /// Never read: holding it keeps the descriptor number from being reused mid-operation.
    #[allow(dead_code)]
    pub(crate) file: Rc<File>,
    pub(crate) buf: Option<Slice>,
}

enum SlotState {
    Free,
    /// Submitted (or queued); the future waits.
    Waiting(Option<Waker>),
    /// The kernel finished with this result; the future has not collected it yet.
    Done(i32),
    /// The future was dropped; release `held` when the completion arrives.
    Abandoned,
}

struct Slot {
    state: SlotState,
    held: Option<Held>,
}

struct State {
    ring: IoUring,
    slots: Vec<Slot>,
    free: Vec<usize>,
    /// Slots not Free.
    in_flight: usize,
    /// SQEs pushed but not yet handed to the kernel.
    unsubmitted: usize,
    /// The slot whose future is registered on the eventfd.
    poller: Option<usize>,
    /// Statistics: io_uring_enter calls made to submit, and SQEs submitted by them.
    submit_calls: u64,
    submitted: u64,
}

struct Inner {
    state: RefCell<State>,
    eventfd: AsyncFd<OwnedFd>,
    batch: bool,
    supports_ftruncate: bool,
}

/// A handle to a per-thread io_uring instance driven from tokio (cheap to clone).
#[derive(Clone)]
pub struct Reactor {
    inner: Rc<Inner>,
}

thread_local! {
    static CURRENT: RefCell<Weak<Inner>> = const { RefCell::new(Weak::new()) };
}

/// Counters of a reactor, for measuring how well submissions batch.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ReactorStats {
    /// `io_uring_enter` calls made to submit.
    pub submit_calls: u64,
    /// SQEs those calls submitted.
    pub submitted: u64,
    /// Operations whose completion has not been reaped (including abandoned ones).
    pub in_flight: usize,
}

impl Reactor {
    /// The calling thread's reactor, created (submitting at once, see the crate docs for why)
    /// if none is alive.
    ///
    /// Must be called inside a tokio runtime with I/O enabled; the reactor must then be used
    /// on this thread only.
    pub fn current() -> io::Result<Reactor> {
        if let Some(inner) = CURRENT.with(|c| c.borrow().upgrade()) {
            return Ok(Reactor { inner });
        }
        let reactor = Reactor::new(DEFAULT_ENTRIES, false)?;
        CURRENT.with(|c| *c.borrow_mut() = Rc::downgrade(&reactor.inner));
        Ok(reactor)
    }

    /// A new, private reactor with `entries` SQEs; `batch` defers submission to the end of the
    /// scheduler turn so concurrent operations share one syscall.
    pub fn new(entries: u32, batch: bool) -> io::Result<Reactor> {
        if tokio::runtime::Handle::try_current().is_err() {
            return Err(io::Error::other(
                "io_uring reactor needs a tokio runtime on this thread",
            ));
        }
        let ring = IoUring::new(entries)
            .map_err(|e| io::Error::new(e.kind(), format!("io_uring_setup failed: {e}")))?;
        // SAFETY: plain syscall creating a new descriptor.
        let raw = unsafe { libc::eventfd(0, libc::EFD_NONBLOCK | libc::EFD_CLOEXEC) };
        if raw < 0 {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: `raw` is a fresh descriptor that nothing else owns.
        let efd = unsafe { OwnedFd::from_raw_fd(raw) };
        ring.submitter().register_eventfd(efd.as_raw_fd())?;
        let mut probe = io_uring::Probe::new();
        let supports_ftruncate = ring.submitter().register_probe(&mut probe).is_ok()
            && probe.is_supported(opcode::Ftruncate::CODE);
        // tokio panics (rather than erroring) when the runtime was built without I/O.
        let eventfd = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            // SAFETY: `efd` is an OwnedFd moved into the AsyncFd, so the descriptor stays open
            // and unchanged for the AsyncFd's whole life.
            unsafe { AsyncFd::register_with_interest(efd, Interest::READABLE) }
        }))
        .map_err(|_| io::Error::other("tokio runtime has I/O disabled (use enable_io)"))?
        .map_err(|e| {
            let (_, e) = e.into_parts();
            io::Error::new(e.kind(), format!("registering io_uring eventfd: {e}"))
        })?;
        Ok(Reactor {
            inner: Rc::new(Inner {
                state: RefCell::new(State {
                    ring,
                    slots: Vec::new(),
                    free: Vec::new(),
                    in_flight: 0,
                    unsubmitted: 0,
                    poller: None,
                    submit_calls: 0,
                    submitted: 0,
                }),
                eventfd,
                batch,
                supports_ftruncate,
            }),
        })
    }

    /// Counters so far.
    pub fn stats(&self) -> ReactorStats {
        let st = self.inner.state.borrow();
        ReactorStats {
            submit_calls: st.submit_calls,
            submitted: st.submitted,
            in_flight: st.in_flight,
        }
    }

    /// Whether the kernel implements IORING_OP_FTRUNCATE (Linux 6.9+).
    pub(crate) fn supports_ftruncate(&self) -> bool {
        self.inner.supports_ftruncate
    }

    /// Queue `entry`, keeping `held` alive until it completes.
    ///
    /// # Safety
    /// Every pointer in `entry` must point into `held` (its buffer or nothing), so that the
    /// memory stays valid until the completion is reaped.
    pub(crate) unsafe fn submit(&self, entry: squeue::Entry, held: Held) -> Op {
        let mut st = self.inner.state.borrow_mut();
        let slot = st.alloc(held);
        let entry = entry.user_data(u64::try_from(slot).unwrap_or(u64::MAX));
        // SAFETY: the caller guarantees the entry only references `held`, which the slot owns
        // until the completion is reaped.
        unsafe { st.push(&entry) };
        if !self.inner.batch {
            st.submit();
        }
        Op {
            reactor: Rc::clone(&self.inner),
            slot,
            yielded: !self.inner.batch,
            finished: false,
        }
    }
}

impl State {
    fn alloc(&mut self, held: Held) -> usize {
        let slot = Slot {
            state: SlotState::Waiting(None),
            held: Some(held),
        };
        self.in_flight += 1;
        match self.free.pop() {
            Some(i) => {
                self.slots[i] = slot;
                i
            }
            None => {
                self.slots.push(slot);
                self.slots.len() - 1
            }
        }
    }

    fn release(&mut self, i: usize) -> Option<Held> {
        let slot = &mut self.slots[i];
        slot.state = SlotState::Free;
        let held = slot.held.take();
        self.free.push(i);
        self.in_flight -= 1;
        held
    }

    /// # Safety
    /// As for [`Reactor::submit`].
    unsafe fn push(&mut self, entry: &squeue::Entry) {
        loop {
            // SAFETY: forwarded from the caller.
            if unsafe { self.ring.submission().push(entry) }.is_ok() {
                self.unsubmitted += 1;
                return;
            }
            // The SQ is full: hand what is queued to the kernel to make room.
            self.submit();
        }
    }

    /// Hand queued SQEs to the kernel, retrying transient failures.
    fn submit(&mut self) {
        while self.unsubmitted > 0 {
            self.submit_calls += 1;
            match self.ring.submit() {
                Ok(n) => {
                    self.unsubmitted = self.unsubmitted.saturating_sub(n);
                    self.submitted += u64::try_from(n).unwrap_or(0);
                    if n == 0 {
                        // Nothing consumed (should not happen without SQPOLL): avoid spinning.
                        self.reap();
                        break;
                    }
                }
                Err(e) => match e.raw_os_error() {
                    Some(libc::EINTR) => {}
                    // Completion queue overflowing or kernel short of memory: free room.
                    Some(libc::EBUSY | libc::EAGAIN) => {
                        if !self.reap() {
                            std::thread::yield_now();
                        }
                    }
                    _ => {
                        tracing::error!("io_uring submit failed: {e}");
                        break;
                    }
                },
            }
        }
    }

    /// Move every available completion into its slot; returns whether there was any.
    fn reap(&mut self) -> bool {
        let mut any = false;
        let done: Vec<(u64, i32)> = self
            .ring
            .completion()
            .map(|cqe| (cqe.user_data(), cqe.result()))
            .collect();
        for (user_data, result) in done {
            any = true;
            let Some(i) = usize::try_from(user_data)
                .ok()
                .filter(|&i| i < self.slots.len())
            else {
                tracing::error!("io_uring completion for unknown slot {user_data}");
                continue;
            };
            match std::mem::replace(&mut self.slots[i].state, SlotState::Done(result)) {
                SlotState::Waiting(waker) => {
                    if let Some(w) = waker {
                        w.wake();
                    }
                }
                SlotState::Abandoned => {
                    drop(self.release(i));
                }
                other @ (SlotState::Free | SlotState::Done(_)) => {
                    self.slots[i].state = other;
                    tracing::error!("io_uring completion for idle slot {i}");
                }
            }
        }
        any
    }

    /// A future is leaving (finished or dropped). If it was the poller, or nobody is (it may
    /// have been woken to become the poller but found its own completion first), another
    /// waiting future must take the eventfd job or completions would go unnoticed.
    fn leave(&mut self, slot: usize) {
        if self.poller.is_none() || self.poller == Some(slot) {
            self.hand_off_poller();
        }
    }

    /// Give the eventfd job to another waiting operation.
    fn hand_off_poller(&mut self) {
        self.poller = None;
        for slot in &self.slots {
            if let SlotState::Waiting(Some(w)) = &slot.state {
                w.wake_by_ref();
                return;
            }
        }
    }
}

impl Drop for Inner {
    fn drop(&mut self) {
        // Abandoned operations may still be writing into buffers this drop would free: wait.
        let st = self.state.get_mut();
        st.submit();
        while st.in_flight > 0 {
            match st.ring.submit_and_wait(1) {
                Ok(_) => {}
                Err(e) if e.raw_os_error() == Some(libc::EINTR) => {}
                Err(e) => {
                    // Leaking is the only sound choice if the kernel may still use the memory.
                    tracing::error!("io_uring drain failed: {e}; leaking in-flight buffers");
                    for slot in st.slots.drain(..) {
                        std::mem::forget(slot.held);
                    }
                    return;
                }
            }
            st.reap();
        }
    }
}

/// The future of one submitted operation: the raw CQE result and the held buffer.
pub(crate) struct Op {
    reactor: Rc<Inner>,
    slot: usize,
    /// Batching: whether this future already yielded once to let others queue.
    yielded: bool,
    finished: bool,
}

impl Future for Op {
    type Output = (i32, Option<Slice>);

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let this = &mut *self;
        let inner = &*this.reactor;
        loop {
            let mut st = inner.state.borrow_mut();
            if let SlotState::Done(result) = st.slots[this.slot].state {
                let held = st.release(this.slot);
                st.leave(this.slot);
                this.finished = true;
                return Poll::Ready((result, held.and_then(|h| h.buf)));
            }
            if st.unsubmitted > 0 {
                if !this.yielded {
                    this.yielded = true;
                    st.slots[this.slot].state = SlotState::Waiting(Some(cx.waker().clone()));
                    cx.waker().wake_by_ref();
                    return Poll::Pending;
                }
                st.submit();
            }
            if st.reap() {
                continue;
            }
            st.slots[this.slot].state = SlotState::Waiting(Some(cx.waker().clone()));
            match st.poller {
                Some(p) if p != this.slot => return Poll::Pending,
                _ => st.poller = Some(this.slot),
            }
            drop(st);
            match inner.eventfd.poll_read_ready(cx) {
                Poll::Pending => return Poll::Pending,
                Poll::Ready(Ok(mut guard)) => {
                    guard.clear_ready();
                    let mut counter = [0u8; 8];
                    // SAFETY: reading 8 bytes into a local array from our nonblocking eventfd;
                    // EAGAIN (already drained) is fine to ignore.
                    let _ = unsafe {
                        libc::read(
                            inner.eventfd.get_ref().as_raw_fd(),
                            counter.as_mut_ptr().cast(),
                            counter.len(),
                        )
                    };
                }
                Poll::Ready(Err(e)) => {
                    // The runtime's I/O driver is gone (e.g. shut down): block for a completion
                    // instead, which is slow but correct.
                    tracing::warn!("io_uring eventfd unusable ({e}); waiting synchronously");
                    let mut st = inner.state.borrow_mut();
                    st.poller = None;
                    if let Err(e) = st.ring.submit_and_wait(1) {
                        tracing::error!("io_uring wait failed: {e}");
                    }
                }
            }
        }
    }
}

impl Drop for Op {
    fn drop(&mut self) {
        if self.finished {
            return;
        }
        let mut st = self.reactor.state.borrow_mut();
        match st.slots[self.slot].state {
            SlotState::Done(_) => drop(st.release(self.slot)),
            _ => st.slots[self.slot].state = SlotState::Abandoned,
        }
        st.leave(self.slot);
    }
}
