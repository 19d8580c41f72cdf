//! Dropping an operation's future while the kernel or a worker is still using its buffer is
//! safe: the memory is not freed until the operation completes, and then it is reclaimed.
//! A counting global allocator shows the buffer's bytes being released.

mod common;

use std::alloc::{GlobalAlloc, Layout, System};
use std::future::Future;
use std::pin::pin;
use std::sync::atomic::{AtomicI64, Ordering};
use std::task::{Context, Waker};

use common::{read, write, Backend};
use storage::{IoBuf, Storage};
use test_support::run;

struct Counting;

static LIVE: AtomicI64 = AtomicI64::new(0);

// SAFETY: forwards to the system allocator, only counting sizes.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        LIVE.fetch_add(layout.size() as i64, Ordering::SeqCst);
        // SAFETY: same contract as the caller's.
        unsafe { System.alloc(layout) }
    }
    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        LIVE.fetch_add(layout.size() as i64, Ordering::SeqCst);
        // SAFETY: same contract as the caller's.
        unsafe { System.alloc_zeroed(layout) }
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        LIVE.fetch_sub(layout.size() as i64, Ordering::SeqCst);
        // SAFETY: same contract as the caller's.
        unsafe { System.dealloc(ptr, layout) }
    }
}

#[global_allocator]
static GLOBAL: Counting = Counting;

const BIG: usize = 64 << 20;

/// Poll `fut` once (so its operation is submitted), then drop it.
fn start_and_drop<F: Future>(fut: F) {
    let mut fut = pin!(fut);
    let mut cx = Context::from_waker(Waker::noop());
    let polled = fut.as_mut().poll(&mut cx);
    // Polling twice gets past the io_uring batching yield, so the SQE is really submitted.
    if polled.is_pending() {
        let _ = fut.as_mut().poll(&mut cx);
    }
}

async fn dropped_ops_release_their_buffers(backend: Backend) {
    let s = common::open(backend).await;
    write(&s, 0, &vec![7u8; BIG]).await;
    for round in 0..3 {
        let before = LIVE.load(Ordering::SeqCst);
        if round % 2 == 0 {
            start_and_drop(s.read_at(IoBuf::zeroed(BIG).into(), 0));
        } else {
            start_and_drop(s.write_at(IoBuf::from_slice(&vec![9u8; BIG]).into(), 0));
        }
        // Keep doing I/O until the abandoned operation completes and its buffer is freed.
        // Bounded: a leak fails the test instead of hanging it.
        let mut released = false;
        for _ in 0..10_000 {
            if LIVE.load(Ordering::SeqCst) < before + (BIG as i64) / 2 {
                released = true;
                break;
            }
            let _ = read(&s, 0, 512).await;
            tokio::time::sleep(std::time::Duration::from_millis(1)).await;
        }
        assert!(
            released,
            "{backend:?}: buffer of a dropped operation never released"
        );
    }
    // The storage still works, and a dropped write either happened or did not, as a whole.
    let head = read(&s, 0, 4096).await;
    assert!(
        head.iter().all(|&b| b == 7) || head.iter().all(|&b| b == 9),
        "{backend:?}"
    );
    write(&s, 10, b"after").await;
    assert_eq!(read(&s, 10, 5).await, b"after");
}

#[test]
fn dropping_in_flight_futures_is_safe_and_buffers_are_reclaimed() {
    for backend in [
        Backend::Threads,
        Backend::ThreadsDirect,
        Backend::Uring,
        Backend::UringBatched,
        Backend::UringDirect,
    ] {
        run(dropped_ops_release_their_buffers(backend));
    }
}

#[test]
fn dropping_a_reactor_with_abandoned_ops_waits_for_them() {
    // The reactor is private to this runtime; dropping the last storage drops it while a big
    // read is still in flight: the drop must wait for the kernel instead of freeing the buffer.
    run(async {
        let dir = common::scratch_dir();
        let path = dir.path().join("r.img");
        std::fs::write(&path, vec![3u8; BIG]).unwrap();
        let reactor = storage::Reactor::new(8, true).unwrap();
        let s = storage::UringStorage::open_with(
            reactor.clone(),
            &path,
            storage::OpenOptions::read_only(),
        )
        .await
        .unwrap();
        start_and_drop(s.read_at(IoBuf::zeroed(BIG).into(), 0));
        drop(s);
        drop(reactor);
    });
}
