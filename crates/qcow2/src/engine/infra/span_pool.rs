//! Spare buffers for copy-on-write spans. An allocating write into a large cluster builds the
//! whole unit in memory (the data it copies and the guest's bytes) and writes it at once;
//! allocating and zeroing a fresh buffer of the unit's size for every such write costs more
//! CPU than the rest of the request (2 MiB of `memset` with 2 MiB clusters). A few buffers
//! are kept instead and handed out with their old contents: the writer fills every byte of
//! the span, zeroing only what neither its data nor its copied ranges cover.

use std::cell::RefCell;

use storage::IoBuf;

/// Buffers kept at most.
const MAX_SPARE: usize = 2;
/// Largest buffer kept: a 2 MiB cluster's span (bigger spans are rare and not kept).
const MAX_SPARE_BYTES: usize = 2 << 20;

/// The spare span buffers of one image.
#[derive(Default)]
pub(crate) struct SpanPool {
    spare: RefCell<Vec<IoBuf>>,
}

/// A buffer for a span, and whether its bytes are all zero.
pub(crate) struct SpanBuf {
    pub buf: IoBuf,
    pub zeroed: bool,
}

impl SpanPool {
    /// A buffer of `len` bytes: a spare one holding old bytes if one is large enough,
    /// otherwise a new zeroed one.
    pub fn take(&self, len: usize) -> SpanBuf {
        let mut spare = self.spare.borrow_mut();
        match spare.iter().position(|b| b.capacity() >= len) {
            Some(i) => {
                // Spares are kept at their full capacity (see `give`).
                let mut buf = spare.swap_remove(i);
                buf.truncate(len);
                SpanBuf { buf, zeroed: false }
            }
            None => SpanBuf {
                buf: IoBuf::zeroed(len),
                zeroed: true,
            },
        }
    }

    /// Keeps `buf` for a later span, if there is room.
    pub fn give(&self, mut buf: IoBuf) {
        let mut spare = self.spare.borrow_mut();
        if spare.len() < MAX_SPARE && buf.capacity() <= MAX_SPARE_BYTES {
            buf.resize(buf.capacity());
            spare.push(buf);
        }
    }

    /// Lets every spare buffer go (with the caches' idle cleaning).
    pub fn clear(&self) {
        self.spare.borrow_mut().clear();
    }

    /// Bytes held by spare buffers.
    #[cfg(test)]
    pub fn bytes(&self) -> usize {
        self.spare.borrow().iter().map(IoBuf::capacity).sum()
    }
}

/// Zeroes the bytes of `buf` (which starts at `base`) that none of `covered` (ranges
/// relative to the same origin, within the buffer) covers.
pub(crate) fn zero_uncovered(buf: &mut [u8], base: u64, covered: &mut [(u64, u64)]) {
    covered.sort_unstable();
    let mut at = 0usize;
    for &(from, to) in covered.iter() {
        let from = clamp(from, base, buf.len());
        let to = clamp(to, base, buf.len());
        if from > at {
            buf[at..from].fill(0);
        }
        at = at.max(to);
    }
    buf[at..].fill(0);
}

/// `offset` as an index into a buffer of `len` bytes starting at `base`, clamped to it.
fn clamp(offset: u64, base: u64, len: usize) -> usize {
    usize::try_from(offset.saturating_sub(base)).map_or(len, |i| i.min(len))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_what_nothing_covers_is_zeroed() {
        let mut buf = vec![0xaau8; 16];
        // Overlapping, unordered, one reaching past the end.
        zero_uncovered(
            &mut buf,
            100,
            &mut [(110, 112), (102, 104), (103, 106), (115, 130)],
        );
        let want: Vec<u8> = (0..16)
            .map(|i| match i {
                2..=5 | 10..=11 | 15 => 0xaa,
                _ => 0,
            })
            .collect();
        assert_eq!(buf, want);
        let mut all = vec![0xaau8; 8];
        zero_uncovered(&mut all, 0, &mut []);
        assert_eq!(all, [0; 8]);
    }

    #[test]
    fn spares_are_reused_bounded_and_cleared() {
        let pool = SpanPool::default();
        let first = pool.take(8192);
        assert!(first.zeroed);
        let mut buf = first.buf;
        buf[..4].copy_from_slice(b"old!");
        pool.give(buf);
        assert_eq!(pool.bytes(), 8192);
        let again = pool.take(4096);
        assert!(!again.zeroed, "a spare buffer keeps its old bytes");
        assert_eq!((again.buf.len(), &again.buf[..4]), (4096, &b"old!"[..]));
        // No spare large enough: a new, zeroed one.
        assert!(pool.take(1 << 20).zeroed);
        for _ in 0..3 {
            pool.give(IoBuf::zeroed(4096));
        }
        assert_eq!(pool.bytes(), 2 * 4096, "at most two spares");
        pool.give(IoBuf::zeroed(4 << 20));
        assert_eq!(pool.bytes(), 2 * 4096);
        pool.clear();
        assert_eq!(pool.bytes(), 0);
        pool.give(IoBuf::zeroed(4 << 20));
        assert_eq!(pool.bytes(), 0, "too large to keep");
    }
}
