//! A queue of same-size I/O buffers, with small allocations made while one is free, keeps the
//! heap at the buffers it holds at once.
//!
//! The server keeps freed memory in the heap (glibc's mmap threshold raised, see the binary's
//! `malloc_tuning`), so the heap's size is its resident memory. A client reading at queue
//! depth four keeps four request buffers alive, and between one freed and the next allocated
//! the server allocates small things (reply headers, futures). Given back to the allocator,
//! the freed buffer would be split for those, the next one would no longer fit, and the heap
//! would grow by most of a buffer each time until fragments merge. This runs that pattern in
//! a process of its own (one test, so no other thread allocates meanwhile) and bounds the
//! heap's growth.

#[cfg(all(target_os = "linux", target_env = "gnu"))]
#[test]
fn a_queue_of_buffers_with_small_allocations_between_keeps_the_heap_bounded() {
    use std::collections::VecDeque;
    use storage::IoBuf;

    // As the server sets it: buffers up to 32 MiB come from the heap, which is not trimmed.
    // SAFETY: mallopt only changes allocator parameters, with values glibc accepts.
    unsafe {
        assert_eq!(libc::mallopt(libc::M_MMAP_THRESHOLD, 32 << 20), 1);
        assert_eq!(libc::mallopt(libc::M_TRIM_THRESHOLD, 32 << 20), 1);
    }
    // SAFETY: mallinfo2 only reads the allocator's statistics.
    let heap = || unsafe { libc::mallinfo2() }.arena;
    const BUF: usize = 1 << 20;
    const DEPTH: usize = 4;
    let before = heap();
    let mut buffers: VecDeque<IoBuf> = VecDeque::new();
    let mut small: VecDeque<Vec<u8>> = VecDeque::new();
    for i in 0..400 {
        if buffers.len() == DEPTH {
            buffers.pop_front();
        }
        // Small allocations that outlive the request, as the reply of one request is queued
        // while the next ones run.
        small.push_back(vec![1u8; 64 + (i % 7) * 48]);
        if small.len() > 16 {
            small.pop_front();
        }
        buffers.push_back(IoBuf::zeroed(BUF));
    }
    let grown = heap().saturating_sub(before);
    assert!(
        grown < (DEPTH + 2) * BUF,
        "heap grew by {grown} bytes for {DEPTH} {BUF}-byte buffers held at once"
    );
}
