//! The io_uring reactor itself: batching really shares syscalls, and the poller hand-off
//! survives operations being dropped at random while others are in flight.

mod common;

use std::rc::Rc;

use common::scratch_dir;
use storage::{IoBuf, OpenOptions, Reactor, Storage, UringStorage};
use test_support::{run, Rng};

async fn open_file(reactor: &Reactor, dir: &tempfile::TempDir, direct: bool) -> Rc<UringStorage> {
    let path = dir.path().join("r.img");
    let s = UringStorage::open_with(
        reactor.clone(),
        &path,
        OpenOptions::create().with_direct(direct),
    )
    .await
    .unwrap();
    let (res, _) = s.write_at(IoBuf::zeroed(4 << 20).into(), 0).await;
    res.unwrap();
    Rc::new(s)
}

#[test]
fn batched_submission_shares_syscalls() {
    run(async {
        let dir = scratch_dir();
        let reactor = Reactor::new(256, true).unwrap();
        let s = open_file(&reactor, &dir, true).await;
        let before = reactor.stats();
        let mut tasks = tokio::task::JoinSet::new();
        for i in 0..32u64 {
            let s = Rc::clone(&s);
            tasks.spawn_local(async move {
                let (res, _) = s.read_at(IoBuf::zeroed(4096).into(), i * 4096).await;
                res.unwrap();
            });
        }
        while let Some(r) = tasks.join_next().await {
            r.unwrap();
        }
        let after = reactor.stats();
        let calls = after.submit_calls - before.submit_calls;
        let sqes = after.submitted - before.submitted;
        assert_eq!(sqes, 32);
        assert!(calls < 8, "32 concurrent reads took {calls} submit calls");
        assert_eq!(after.in_flight, 0);

        let unbatched = Reactor::new(256, false).unwrap();
        let s = open_file(&unbatched, &dir, true).await;
        let before = unbatched.stats();
        let (res, _) = s.read_at(IoBuf::zeroed(4096).into(), 0).await;
        res.unwrap();
        assert_eq!(unbatched.stats().submit_calls - before.submit_calls, 1);
    });
}

#[test]
fn random_drops_never_stall_the_other_operations() {
    for batch in [false, true] {
        run(async move {
            let dir = scratch_dir();
            let reactor = Reactor::new(32, batch).unwrap();
            let s = open_file(&reactor, &dir, true).await;
            let mut tasks = tokio::task::JoinSet::new();
            for t in 0..48u64 {
                let s = Rc::clone(&s);
                tasks.spawn_local(async move {
                    let mut rng = Rng(t + 1);
                    let mut completed = 0;
                    let mut awaited = 0;
                    for _ in 0..150 {
                        let off = rng.below(1024) * 4096;
                        let op = s.read_at(IoBuf::zeroed(4096).into(), off);
                        if rng.below(3) == 0 {
                            // Race the operation against a yield: often dropped mid-flight.
                            tokio::select! {
                                biased;
                                _ = tokio::task::yield_now() => {}
                                (res, _) = op => { res.unwrap(); completed += 1; }
                            }
                        } else {
                            let (res, _) = op.await;
                            res.unwrap();
                            completed += 1;
                            awaited += 1;
                        }
                    }
                    (completed, awaited)
                });
            }
            while let Some(r) = tasks.join_next().await {
                let (completed, awaited) = r.unwrap();
                // Every awaited operation completes; raced ones may or may not.
                assert!(
                    completed >= awaited && awaited > 50,
                    "batch={batch}: {completed}/{awaited}"
                );
            }
            // Abandoned operations are released once their completions are reaped.
            for _ in 0..1000 {
                if reactor.stats().in_flight == 0 {
                    break;
                }
                let (res, _) = s.read_at(IoBuf::zeroed(512).into(), 0).await;
                res.unwrap();
                tokio::task::yield_now().await;
            }
            assert_eq!(
                reactor.stats().in_flight,
                0,
                "batch={batch}: abandoned slots leaked"
            );
        });
    }
}
