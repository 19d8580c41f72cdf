//! Keeps large I/O buffers in the heap instead of a fresh `mmap` each time.
//!
//! Every request and every copy-on-write allocates a 4 KiB-aligned buffer of up to 32 MiB.
//! With glibc's defaults, buffers from 128 KiB up are mmapped and unmapped per request, so
//! each one page-faults on first touch and flushes the TLB when freed; on a 128 KiB-cluster
//! allocation benchmark that cost half of the server's CPU time and a third of its IOPS
//! (benches/RESULTS.md). Raising the thresholds lets freed buffers be reused from the heap.
//!
//! The price is that freed buffers stay resident: after a burst of large requests the heap
//! keeps tens of MiB nobody uses. [`release_free_heap`] gives them back; the server calls it
//! where the user asked for idle memory to be returned (`--cache-clean-interval`).

/// Largest allocation served from the heap: NBD's largest request (glibc's maximum).
#[cfg(all(target_os = "linux", target_env = "gnu"))]
const MMAP_THRESHOLD: libc::c_int = 32 << 20;
/// Free memory the heap may keep at its top before giving it back to the kernel.
#[cfg(all(target_os = "linux", target_env = "gnu"))]
const TRIM_THRESHOLD: libc::c_int = 32 << 20;

/// Applies the thresholds (glibc only; elsewhere the allocator's defaults stay).
pub fn tune_for_io_buffers() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    {
        // SAFETY: mallopt only changes allocator parameters; it is called before any other
        // thread exists and with values glibc documents as valid (it returns 0 if not).
        let ok = unsafe {
            libc::mallopt(libc::M_MMAP_THRESHOLD, MMAP_THRESHOLD) != 0
                && libc::mallopt(libc::M_TRIM_THRESHOLD, TRIM_THRESHOLD) != 0
        };
        if !ok {
            tracing::debug!("mallopt refused the I/O buffer thresholds; keeping defaults");
        }
    }
}

/// Returns the heap's free pages to the kernel (glibc only; elsewhere only the spare I/O
/// buffers are freed). Costs a walk over the free chunks, and the next allocations that reuse
/// those pages fault them in again: call it when memory matters more than the next few
/// requests, not per request.
pub fn release_free_heap() {
    storage::release_spare_buffers();
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    {
        // SAFETY: malloc_trim only gives free memory of the allocator's own arenas back to
        // the kernel (madvise on free pages, shrinking the heap top); no live allocation is
        // touched, and glibc's arena locks make it safe to call from any thread at any time.
        unsafe {
            libc::malloc_trim(0);
        }
    }
}
