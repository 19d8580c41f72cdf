//! Owned, 4 KiB-aligned I/O buffers passed by value through every storage operation.
//!
//! io_uring and worker threads write into a buffer after the future that submitted the
//! operation may have been dropped, so buffers are owned by the operation and handed back on
//! completion (the tokio-uring model) instead of being borrowed.

use std::alloc::{self, Layout};
use std::fmt;
use std::ops::{Deref, DerefMut, Range};
use std::ptr::NonNull;
use std::sync::{Mutex, PoisonError};

/// Alignment of every [`IoBuf`] allocation: enough for O_DIRECT on any common device.
pub const BUF_ALIGN: usize = 4096;

/// Heap buffer aligned to 4096 bytes (O_DIRECT-ready), zero-initialised, `len <= capacity`.
pub struct IoBuf {
    /// The first byte of the buffer: `raw` rounded up to [`BUF_ALIGN`].
    ptr: NonNull<u8>,
    /// The allocation itself (see [`alloc_zeroed`]).
    raw: NonNull<u8>,
    len: usize,
    cap: usize,
}

// SAFETY: IoBuf uniquely owns its allocation (like Vec<u8>); no interior sharing.
unsafe impl Send for IoBuf {}
// SAFETY: shared references only permit reads of the owned bytes.
unsafe impl Sync for IoBuf {}

impl IoBuf {
    /// A buffer of `len` zero bytes.
    pub fn zeroed(len: usize) -> IoBuf {
        let cap = round_capacity(len);
        let (raw, ptr) = alloc_zeroed(cap);
        IoBuf { ptr, raw, len, cap }
    }

    /// A buffer holding a copy of `data`.
    pub fn from_slice(data: &[u8]) -> IoBuf {
        let mut buf = IoBuf::zeroed(data.len());
        buf.copy_from_slice(data);
        buf
    }

    /// Number of bytes in use.
    pub fn len(&self) -> usize {
        self.len
    }

    /// True when the buffer holds no bytes.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Bytes allocated; growing up to this never reallocates.
    pub fn capacity(&self) -> usize {
        self.cap
    }

    /// Set the length; new bytes are zero. Reallocates (keeping the contents) past capacity.
    pub fn resize(&mut self, len: usize) {
        if len > self.cap {
            let cap = round_capacity(len);
            let (raw, ptr) = alloc_zeroed(cap);
            // SAFETY: both allocations are valid for `self.len` bytes (self.len <= self.cap < cap)
            // and distinct, so they cannot overlap.
            unsafe { std::ptr::copy_nonoverlapping(self.ptr.as_ptr(), ptr.as_ptr(), self.len) };
            let old = std::mem::replace(
                self,
                IoBuf {
                    ptr,
                    raw,
                    len: 0,
                    cap,
                },
            );
            self.len = old.len;
        }
        if len > self.len {
            // SAFETY: [self.len, len) lies inside the allocation because len <= self.cap.
            unsafe { std::ptr::write_bytes(self.ptr.as_ptr().add(self.len), 0, len - self.len) };
        }
        self.len = len;
    }

    /// Shorten to `len` bytes (no effect when already shorter).
    pub fn truncate(&mut self, len: usize) {
        self.len = self.len.min(len);
    }

    /// Restrict I/O to `range` of this buffer, keeping ownership of the whole buffer.
    ///
    /// # Panics
    /// When `range` is decreasing or past `len()`, like slice indexing.
    pub fn slice(self, range: Range<usize>) -> Slice {
        assert!(
            range.start <= range.end && range.end <= self.len,
            "IoBuf::slice: range {range:?} out of bounds for length {}",
            self.len
        );
        Slice { buf: self, range }
    }
}

/// Round a requested length up to a whole number of alignment units (at least one), so every
/// allocation has a non-zero size and ends on an O_DIRECT boundary.
fn round_capacity(len: usize) -> usize {
    len.max(1)
        .checked_next_multiple_of(BUF_ALIGN)
        .expect("IoBuf capacity overflows usize")
}

/// The allocation behind a buffer of `cap` bytes: `BUF_ALIGN` more, at the allocator's own
/// alignment, so the aligned buffer fits inside wherever the allocation starts.
///
/// Asking the allocator for 4096-byte alignment instead (`posix_memalign`) makes glibc carve
/// each buffer out of a larger free chunk and return the piece before it to the heap; a freed
/// buffer then comes back a little smaller than the next request of the same size needs, so a
/// serving loop grew the heap by one buffer per request until fragments merged (ten 1 MiB
/// buffers resident for one in use). A plain allocation of the same size every time is reused
/// as it is.
fn layout(cap: usize) -> Layout {
    let size = cap
        .checked_add(BUF_ALIGN)
        .expect("IoBuf capacity overflows usize");
    Layout::from_size_align(size, std::mem::align_of::<u128>())
        .expect("IoBuf layout exceeds isize::MAX")
}

/// An allocation for a buffer of `cap` bytes, the buffer zeroed: the allocation and the
/// buffer's aligned start inside it. A spare one of the same size is reused when there is.
fn alloc_zeroed(cap: usize) -> (NonNull<u8>, NonNull<u8>) {
    let spare = keeps(cap)
        .then(|| {
            SPARES
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .take(cap)
        })
        .flatten();
    let raw = match spare {
        Some(spare) => spare.raw,
        None => {
            let layout = layout(cap);
            // SAFETY: `layout` has a non-zero size (at least BUF_ALIGN).
            let raw = unsafe { alloc::alloc(layout) };
            NonNull::new(raw).unwrap_or_else(|| alloc::handle_alloc_error(layout))
        }
    };
    let offset = raw.as_ptr().align_offset(BUF_ALIGN);
    debug_assert!(offset < BUF_ALIGN);
    // SAFETY: offset < BUF_ALIGN, so `offset + cap` bytes lie within the `cap + BUF_ALIGN`
    // bytes allocated (a spare of capacity `cap` has that layout too), and the pointer is
    // non-null as `raw` is. Only the buffer's own bytes are zeroed, as before (calloc would
    // also clear the padding).
    let ptr = unsafe {
        let ptr = raw.as_ptr().add(offset);
        std::ptr::write_bytes(ptr, 0, cap);
        NonNull::new_unchecked(ptr)
    };
    (raw, ptr)
}

/// Frees the allocation of a buffer of `cap` bytes, or keeps it as a spare.
fn free(raw: NonNull<u8>, cap: usize) {
    if !keeps(cap) {
        // SAFETY: `raw` came from alloc_zeroed with the layout of `cap` and is freed once.
        unsafe { alloc::dealloc(raw.as_ptr(), layout(cap)) };
        return;
    }
    let evicted = SPARES
        .lock()
        .unwrap_or_else(PoisonError::into_inner)
        .put(Spare { raw, cap });
    // Freed outside the lock: the allocator may take its time.
    for spare in evicted {
        // SAFETY: every spare came from alloc_zeroed with the layout of its capacity and is
        // owned by nobody else once out of the list.
        unsafe { alloc::dealloc(spare.raw.as_ptr(), layout(spare.cap)) };
    }
}

/// Gives the spare buffers back to the allocator, for when memory matters more than the next
/// few requests (the server calls it where it returns idle memory to the kernel).
pub fn release_spare_buffers() {
    let spares = std::mem::take(&mut SPARES.lock().unwrap_or_else(PoisonError::into_inner).list);
    for spare in spares {
        // SAFETY: as in `free`.
        unsafe { alloc::dealloc(spare.raw.as_ptr(), layout(spare.cap)) };
    }
}

/// Buffers from this size up are kept as spares when freed. Requests and copy-on-writes
/// allocate them by the thousand, each the same size as the last; given back to the
/// allocator, a freed one is soon split for small allocations made meanwhile (the allocator
/// prefers a free chunk to the heap's top), the next buffer of that size no longer fits
/// and the heap grows: a sequential read holding four 1 MiB buffers at a time grew it by
/// seven. Smaller buffers are rarely split that way and are cheap to allocate.
const SPARE_MIN: usize = 64 << 10;
/// At most this many spares: a few requests' worth, at the queue depths clients use.
const SPARE_BUFFERS: usize = 8;
/// At most this many bytes of spares (one buffer of NBD's largest request).
const SPARE_BYTES: usize = 32 << 20;

/// Spare buffers, for every thread: buffers move between threads with their operations.
static SPARES: Mutex<Spares> = Mutex::new(Spares {
    list: Vec::new(),
    bytes: 0,
});

/// Whether a freed buffer of capacity `cap` may be kept as a spare.
fn keeps(cap: usize) -> bool {
    (SPARE_MIN..=SPARE_BYTES).contains(&cap)
}

/// A freed buffer's allocation, kept for the next buffer of the same capacity.
struct Spare {
    raw: NonNull<u8>,
    cap: usize,
}

// SAFETY: a spare is an allocation nobody else refers to, like a freed IoBuf's.
unsafe impl Send for Spare {}

/// The spare list: most recently freed last, bounded by [`SPARE_BUFFERS`] and
/// [`SPARE_BYTES`].
struct Spares {
    list: Vec<Spare>,
    bytes: usize,
}

impl Spares {
    /// The most recently freed spare of capacity `cap`, if any.
    fn take(&mut self, cap: usize) -> Option<Spare> {
        let i = self.list.iter().rposition(|s| s.cap == cap)?;
        let spare = self.list.remove(i);
        self.bytes -= spare.cap;
        Some(spare)
    }

    /// Keeps `spare` (of a capacity [`keeps`] allows), returning the oldest spares that no
    /// longer fit the bounds, to be freed.
    fn put(&mut self, spare: Spare) -> Vec<Spare> {
        debug_assert!(keeps(spare.cap));
        let mut evicted = Vec::new();
        while self.list.len() >= SPARE_BUFFERS || self.bytes + spare.cap > SPARE_BYTES {
            let oldest = self.list.remove(0);
            self.bytes -= oldest.cap;
            evicted.push(oldest);
        }
        self.bytes += spare.cap;
        self.list.push(spare);
        evicted
    }
}

impl Drop for IoBuf {
    fn drop(&mut self) {
        free(self.raw, self.cap);
    }
}

impl Deref for IoBuf {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        // SAFETY: the allocation is valid and initialised for `len <= cap` bytes.
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr(), self.len) }
    }
}

impl DerefMut for IoBuf {
    fn deref_mut(&mut self) -> &mut [u8] {
        // SAFETY: as in deref, and `&mut self` guarantees exclusive access.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr(), self.len) }
    }
}

impl Clone for IoBuf {
    fn clone(&self) -> IoBuf {
        let (raw, ptr) = alloc_zeroed(self.cap);
        let mut copy = IoBuf {
            ptr,
            raw,
            len: self.len,
            cap: self.cap,
        };
        copy.copy_from_slice(self);
        copy
    }
}

impl fmt::Debug for IoBuf {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("IoBuf")
            .field("len", &self.len)
            .field("capacity", &self.cap)
            .finish()
    }
}

impl PartialEq for IoBuf {
    fn eq(&self, other: &IoBuf) -> bool {
        **self == **other
    }
}

impl Eq for IoBuf {}

/// A byte range of an owned [`IoBuf`]; I/O happens on exactly this range.
#[derive(Clone, PartialEq, Eq)]
pub struct Slice {
    buf: IoBuf,
    range: Range<usize>,
}

impl Slice {
    /// Give back the whole buffer.
    pub fn into_inner(self) -> IoBuf {
        self.buf
    }

    /// The range of the underlying buffer this slice covers.
    pub fn range(&self) -> Range<usize> {
        self.range.clone()
    }

    /// The underlying buffer (all of it, not just this range).
    pub fn get_ref(&self) -> &IoBuf {
        &self.buf
    }

    /// The same buffer restricted to `range` (relative to the whole buffer), for partial I/O.
    pub(crate) fn with_range(self, range: Range<usize>) -> Slice {
        self.buf.slice(range)
    }

    /// Raw pointer to the first byte of the range, for handing to the kernel.
    pub(crate) fn as_mut_ptr(&mut self) -> *mut u8 {
        self.deref_mut().as_mut_ptr()
    }
}

impl From<IoBuf> for Slice {
    fn from(buf: IoBuf) -> Slice {
        let len = buf.len();
        buf.slice(0..len)
    }
}

impl Deref for Slice {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        &self.buf[self.range.clone()]
    }
}

impl DerefMut for Slice {
    fn deref_mut(&mut self) -> &mut [u8] {
        &mut self.buf[self.range.clone()]
    }
}

impl fmt::Debug for Slice {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Slice")
            .field("range", &self.range)
            .field("buf", &self.buf)
            .finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn zeroed_is_aligned_and_zero() {
        for len in [0, 1, 511, 4096, 4097, 1 << 20] {
            let buf = IoBuf::zeroed(len);
            assert_eq!(buf.len(), len);
            assert!(buf.capacity() >= len);
            assert_eq!(buf.as_ptr() as usize % BUF_ALIGN, 0);
            assert!(buf.iter().all(|&b| b == 0));
        }
    }

    #[test]
    fn resize_zero_fills_after_truncate_and_growth() {
        let mut buf = IoBuf::from_slice(&[7u8; 100]);
        buf.truncate(10);
        buf.resize(50);
        assert_eq!(&buf[..10], &[7u8; 10]);
        assert!(buf[10..].iter().all(|&b| b == 0), "stale bytes reappeared");
        buf.resize(10_000);
        assert_eq!(buf.len(), 10_000);
        assert_eq!(&buf[..10], &[7u8; 10]);
        assert!(buf[10..].iter().all(|&b| b == 0));
        assert_eq!(buf.as_ptr() as usize % BUF_ALIGN, 0);
    }

    #[test]
    fn slice_views_exact_range_and_returns_whole_buffer() {
        let data: Vec<u8> = (0..=255).collect();
        let mut s = IoBuf::from_slice(&data).slice(16..32);
        assert_eq!(&s[..], &data[16..32]);
        s[0] = 0xff;
        assert_eq!(s.range(), 16..32);
        let buf = s.into_inner();
        assert_eq!(buf.len(), 256);
        assert_eq!(buf[16], 0xff);
        assert_eq!(buf[15], 15);
        let whole = Slice::from(buf.clone());
        assert_eq!(whole.range(), 0..256);
        assert_eq!(whole.into_inner(), buf);
    }

    fn spare(cap: usize) -> Spare {
        // Never dereferenced nor freed: the list only moves spares around.
        Spare {
            raw: NonNull::dangling(),
            cap,
        }
    }

    #[test]
    fn spares_come_back_at_their_exact_size_most_recent_first() {
        let mut spares = Spares {
            list: Vec::new(),
            bytes: 0,
        };
        let a = round_capacity(1 << 20);
        let b = round_capacity(256 << 10);
        for cap in [a, b, a] {
            assert!(spares.put(spare(cap)).is_empty());
        }
        assert!(spares.take(a + BUF_ALIGN).is_none());
        assert!(spares.take(b - BUF_ALIGN).is_none());
        assert_eq!(spares.take(b).map(|s| s.cap), Some(b));
        assert_eq!(spares.take(a).map(|s| s.cap), Some(a));
        assert_eq!(spares.list.len(), 1);
        assert_eq!(spares.bytes, a);
    }

    #[test]
    fn spares_stay_within_their_count_and_bytes() {
        let mut spares = Spares {
            list: Vec::new(),
            bytes: 0,
        };
        let small = SPARE_MIN;
        let mut evicted = 0;
        for _ in 0..3 * SPARE_BUFFERS {
            evicted += spares.put(spare(small)).len();
            assert!(spares.list.len() <= SPARE_BUFFERS);
        }
        assert_eq!(evicted, 2 * SPARE_BUFFERS);
        // A buffer as large as the byte bound pushes every other spare out.
        let out = spares.put(spare(SPARE_BYTES));
        assert_eq!(out.len(), SPARE_BUFFERS);
        assert!(out.iter().all(|s| s.cap == small), "the oldest go first");
        assert_eq!((spares.list.len(), spares.bytes), (1, SPARE_BYTES));
        assert!(!keeps(SPARE_MIN - 1) && !keeps(SPARE_BYTES + 1));
    }

    #[test]
    fn reused_buffers_are_aligned_and_zero() {
        let cap = round_capacity(SPARE_MIN + 1);
        for _ in 0..4 {
            let mut buf = IoBuf::zeroed(cap);
            assert_eq!(buf.as_ptr() as usize % BUF_ALIGN, 0);
            assert!(
                buf.iter().all(|&b| b == 0),
                "a reused buffer kept old bytes"
            );
            buf.fill(0xa5);
        }
        release_spare_buffers();
    }

    #[test]
    #[should_panic(expected = "out of bounds")]
    fn slice_past_len_panics() {
        let _ = IoBuf::zeroed(8).slice(4..9);
    }
}
