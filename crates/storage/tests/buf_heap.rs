//! I/O buffers freed and allocated again at the same size reuse their heap memory.
//!
//! The server keeps freed buffers in the heap (glibc's mmap threshold raised, see the
//! binary's `malloc_tuning`), so the heap's size is its resident memory. A serving loop
//! allocates a request buffer and frees it, again and again; if a freed buffer cannot hold
//! the next one of the same size, the heap grows by a buffer per request until fragments
//! happen to merge, and the server's peak RSS is a multiple of what it ever holds at once.
//! This runs that loop in a process of its own (one test, so no other thread allocates
//! meanwhile) and bounds the heap's growth.

mod common;

#[cfg(all(target_os = "linux", target_env = "gnu"))]
#[test]
fn same_size_buffers_reuse_the_heap() {
    use storage::IoBuf;

    let heap = common::server_heap();
    const BUF: usize = 1 << 20;
    // Where a buffer starts relative to a 4 KiB boundary depends on what the heap held
    // before; each pad puts the heap's top at another offset, so one of them is the case
    // where an aligned allocation leaves a small piece before the buffer.
    let mut pads = Vec::new();
    let before = heap();
    for pad in 0..16 {
        pads.push(vec![1u8; 24 + pad * 256]);
        for _ in 0..40 {
            let buf = IoBuf::zeroed(BUF);
            assert_eq!(buf.len(), BUF);
            drop(buf);
        }
    }
    let grown = heap().saturating_sub(before);
    assert!(
        grown < 2 * BUF,
        "heap grew by {grown} bytes over 640 requests that each held one {BUF}-byte buffer"
    );
}
