//! A one-shot wake-up for tasks of one thread: tasks that must wait for a load, a write-back
//! or a free slot park on an `Event`, and the task that finishes the work fires it. Waiters
//! then look at the cache again rather than trusting what the event meant.

use std::cell::{Cell, RefCell};
use std::future::Future;
use std::pin::Pin;
use std::rc::Rc;
use std::task::{Context, Poll, Waker};

/// Fires once; every task waiting on it is woken.
#[derive(Default)]
pub(crate) struct Event {
    fired: Cell<bool>,
    wakers: RefCell<Vec<Waker>>,
}

impl Event {
    /// Wake every waiter, now and later.
    pub(crate) fn fire(&self) {
        self.fired.set(true);
        let wakers = std::mem::take(&mut *self.wakers.borrow_mut());
        for waker in wakers {
            waker.wake();
        }
    }

    /// A future that completes once the event has fired.
    pub(crate) fn wait(self: Rc<Self>) -> Wait {
        Wait { event: self }
    }
}

/// Completes when its event fires.
pub(crate) struct Wait {
    event: Rc<Event>,
}

impl Future for Wait {
    type Output = ();

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<()> {
        if self.event.fired.get() {
            return Poll::Ready(());
        }
        let mut wakers = self.event.wakers.borrow_mut();
        if !wakers.iter().any(|w| w.will_wake(cx.waker())) {
            wakers.push(cx.waker().clone());
        }
        Poll::Pending
    }
}

/// An event that is created when the first waiter needs it and fired (and forgotten) when
/// the awaited change happens, so that nobody pays for it when nobody waits.
#[derive(Default)]
pub(crate) struct LazyEvent(Option<Rc<Event>>);

impl LazyEvent {
    /// The event to wait on for the next change.
    pub(crate) fn listen(&mut self) -> Rc<Event> {
        Rc::clone(self.0.get_or_insert_with(Rc::default))
    }

    /// Wake whoever waits for the next change.
    pub(crate) fn notify(&mut self) {
        if let Some(event) = self.0.take() {
            event.fire();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::sync::Arc;
    use std::task::Wake;

    struct CountingWaker(AtomicUsize);
    impl Wake for CountingWaker {
        fn wake(self: Arc<Self>) {
            self.0.fetch_add(1, Ordering::SeqCst);
        }
    }

    #[test]
    fn waiters_are_woken_once_and_then_ready() {
        let counter = Arc::new(CountingWaker(AtomicUsize::new(0)));
        let waker = Waker::from(Arc::clone(&counter));
        let mut cx = Context::from_waker(&waker);
        let mut lazy = LazyEvent::default();
        let mut a = lazy.listen().wait();
        let mut b = lazy.listen().wait();
        assert!(Pin::new(&mut a).poll(&mut cx).is_pending());
        assert!(Pin::new(&mut a).poll(&mut cx).is_pending());
        assert!(Pin::new(&mut b).poll(&mut cx).is_pending());
        lazy.notify();
        // Both futures registered the same waker: it is woken once.
        assert_eq!(counter.0.load(Ordering::SeqCst), 1);
        assert!(Pin::new(&mut a).poll(&mut cx).is_ready());
        assert!(Pin::new(&mut b).poll(&mut cx).is_ready());
        // The next listener waits for the next change.
        let mut c = lazy.listen().wait();
        assert!(Pin::new(&mut c).poll(&mut cx).is_pending());
    }
}
