use std::future::Future;

/// Runs `f` the way the server runs its work: on a current-thread runtime with I/O and timers
/// enabled, inside a `LocalSet` (so futures need not be `Send` and may `spawn_local`).
pub fn run<F: Future>(f: F) -> F::Output {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("build the test runtime");
    tokio::task::LocalSet::new().block_on(&rt, f)
}
