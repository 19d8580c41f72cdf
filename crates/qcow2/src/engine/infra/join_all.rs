//! Waiting for several futures at once on the image's one thread, so that the pieces of one
//! request that live in different places of the file (or in different layers of a chain) are
//! read concurrently instead of one after another.

use std::future::{poll_fn, Future};
use std::pin::Pin;
use std::task::Poll;

/// Runs all `futs` concurrently and returns their outputs in the given order.
pub(crate) async fn join_all<F: Future>(futs: Vec<F>) -> Vec<F::Output> {
    let mut futs: Vec<Pin<Box<F>>> = futs.into_iter().map(Box::pin).collect();
    let mut outs: Vec<Option<F::Output>> = futs.iter().map(|_| None).collect();
    poll_fn(|cx| {
        let mut pending = false;
        for (fut, out) in futs.iter_mut().zip(outs.iter_mut()) {
            if out.is_none() {
                match fut.as_mut().poll(cx) {
                    Poll::Ready(v) => *out = Some(v),
                    Poll::Pending => pending = true,
                }
            }
        }
        if pending {
            Poll::Pending
        } else {
            Poll::Ready(())
        }
    })
    .await;
    outs.into_iter().flatten().collect()
}

#[cfg(test)]
mod tests {
    use super::join_all;

    #[test]
    fn outputs_keep_the_given_order_whatever_finishes_first() {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_time()
            .build()
            .unwrap();
        let out = rt.block_on(join_all(
            [30u64, 0, 10]
                .into_iter()
                .map(|ms| async move {
                    tokio::time::sleep(std::time::Duration::from_millis(ms)).await;
                    ms
                })
                .collect(),
        ));
        assert_eq!(out, vec![30, 0, 10]);
    }
}
