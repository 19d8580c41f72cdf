//! A queue of same-size I/O buffers, with allocations made while one is free, keeps the heap
//! at the buffers it holds at once.
//!
//! The server keeps freed memory in the heap (glibc's mmap threshold raised, see the binary's
//! `malloc_tuning`), so the heap's size is its resident memory. A client reading at queue
//! depth four keeps four request buffers alive, and between one freed and the next allocated
//! the server may allocate something that stays (a metadata table the read brings into the
//! cache). Given back to the allocator, the freed buffer would be split for it, the next
//! buffer would no longer fit, and the heap would grow by a buffer each time until fragments
//! merge again. This runs that pattern in a process of its own (one test, so no other thread
//! allocates meanwhile) and bounds the heap's growth.

mod common;

#[cfg(all(target_os = "linux", target_env = "gnu"))]
#[test]
fn a_queue_of_buffers_with_allocations_between_keeps_the_heap_bounded() {
    use std::collections::VecDeque;
    use storage::{IoBuf, BUF_ALIGN};

    let heap = common::server_heap();
    const BUF: usize = 1 << 20;
    const DEPTH: usize = 4;
    let before = heap();
    let mut buffers: VecDeque<IoBuf> = VecDeque::new();
    let mut kept: Vec<Vec<u8>> = Vec::new();
    for i in 0..400 {
        if buffers.len() == DEPTH {
            buffers.pop_front();
        }
        // Now and then something that stays, allocated while a buffer is free: a metadata
        // table the read brings into the cache.
        if i % 40 == 0 {
            kept.push(vec![1u8; 64 << 10]);
        }
        buffers.push_back(IoBuf::zeroed(BUF));
    }
    let kept_bytes: usize = kept.iter().map(Vec::len).sum();
    let grown = heap().saturating_sub(before);
    assert!(
        // The buffers held at once (each with its alignment slack) and what was kept.
        grown <= DEPTH * (BUF + 2 * BUF_ALIGN) + kept_bytes,
        "heap grew by {grown} bytes for {DEPTH} {BUF}-byte buffers held at once and \
         {kept_bytes} bytes kept"
    );
}
