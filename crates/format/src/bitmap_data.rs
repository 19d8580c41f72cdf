//! A dirty bitmap's data: one bit per `granularity` bytes of the virtual disk, stored in
//! bitmap data clusters with the lowest disk offset in the least significant bit of each
//! byte. Held in memory as 64-bit words in the same order, so that the words' little-endian
//! bytes are the stored bytes.

use super::error::{FormatError, Location, Structure};
use super::limits;

/// The bits of one bitmap, for a disk of a given size.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BitmapData {
    granularity_bits: u8,
    /// Bits in use: one per granularity-sized chunk of the disk (the last may be partial).
    bits: u64,
    words: Vec<u64>,
}

/// Bytes of stored data for a disk of `disk_size` bytes at `granularity_bits`.
pub fn data_bytes(disk_size: u64, granularity_bits: u8) -> u64 {
    disk_size
        .div_ceil(1u64 << granularity_bits.min(63))
        .div_ceil(8)
}

/// Entries of the bitmap table for that data, one per cluster.
pub fn table_entries(disk_size: u64, granularity_bits: u8, cluster_size: u64) -> u64 {
    data_bytes(disk_size, granularity_bits).div_ceil(cluster_size)
}

/// Checks what QEMU checks before it makes or stores a bitmap: the granularity is within
/// 512 B..2 GiB and the data fits QEMU's limits (512 MiB, and the table's entry limit).
pub fn check_size(
    disk_size: u64,
    granularity_bits: u8,
    cluster_size: u64,
) -> Result<(), FormatError> {
    let at = Location::at(Structure::BitmapDirectory, 0);
    if !(limits::MIN_BITMAP_GRANULARITY_BITS..=limits::MAX_BITMAP_GRANULARITY_BITS)
        .contains(&granularity_bits)
    {
        return Err(FormatError::InvalidValue {
            at,
            field: "granularity_bits",
            value: granularity_bits.into(),
            reason: "must be between 9 (512 bytes) and 31 (2 GiB)",
        });
    }
    let bytes = data_bytes(disk_size, granularity_bits);
    let limit = limits::MAX_BITMAP_DATA_BYTES
        .min(u64::from(limits::MAX_BITMAP_TABLE_ENTRIES).saturating_mul(cluster_size));
    if bytes > limit {
        return Err(FormatError::LimitExceeded {
            at,
            field: "bitmap data size",
            value: bytes,
            limit,
            why: "too much space would be occupied by the bitmap; use a larger granularity",
        });
    }
    Ok(())
}

impl BitmapData {
    /// An all-clear bitmap for a disk of `disk_size` bytes. The caller has checked the size
    /// with [`check_size`], which bounds the memory to 512 MiB.
    pub fn new(disk_size: u64, granularity_bits: u8) -> BitmapData {
        let granularity_bits = granularity_bits.clamp(
            limits::MIN_BITMAP_GRANULARITY_BITS,
            limits::MAX_BITMAP_GRANULARITY_BITS,
        );
        let bits = disk_size.div_ceil(1u64 << granularity_bits);
        BitmapData {
            granularity_bits,
            bits,
            words: vec![0; bits.div_ceil(64) as usize],
        }
    }

    /// log2 of the bytes one bit covers.
    pub fn granularity_bits(&self) -> u8 {
        self.granularity_bits
    }

    /// Bytes one bit covers.
    pub fn granularity(&self) -> u64 {
        1 << self.granularity_bits
    }

    /// Bytes of stored data.
    pub fn data_bytes(&self) -> u64 {
        self.bits.div_ceil(8)
    }

    /// Marks every chunk that `[offset, offset + len)` touches.
    pub fn mark(&mut self, offset: u64, len: u64) {
        if len == 0 || self.bits == 0 {
            return;
        }
        let first = offset >> self.granularity_bits;
        let last = (offset.saturating_add(len - 1) >> self.granularity_bits).min(self.bits - 1);
        if first <= last {
            self.set_bits(first, last);
        }
    }

    /// Sets bits `first..=last`.
    fn set_bits(&mut self, first: u64, last: u64) {
        let (fw, lw) = ((first / 64) as usize, (last / 64) as usize);
        let head = !0u64 << (first % 64);
        let tail = !0u64 >> (63 - last % 64);
        if fw == lw {
            self.words[fw] |= head & tail;
            return;
        }
        self.words[fw] |= head;
        for w in &mut self.words[fw + 1..lw] {
            *w = !0;
        }
        self.words[lw] |= tail;
    }

    /// Whether bit `bit` (chunk `bit` of the disk) is set.
    pub fn get(&self, bit: u64) -> bool {
        bit < self.bits && self.words[(bit / 64) as usize] >> (bit % 64) & 1 != 0
    }

    /// Clears every bit.
    pub fn clear(&mut self) {
        self.words.iter_mut().for_each(|w| *w = 0);
    }

    /// No bit is set.
    pub fn is_clear(&self) -> bool {
        self.words.iter().all(|&w| w == 0)
    }

    /// The stored bytes `[start, start + len)` of the data (past the end read as zero).
    pub fn serialize(&self, start: u64, len: usize) -> Vec<u8> {
        let mut out = vec![0u8; len];
        for (i, b) in out.iter_mut().enumerate() {
            let byte = start + i as u64;
            if let Some(w) = self.words.get((byte / 8) as usize) {
                *b = (w >> (8 * (byte % 8))) as u8;
            }
        }
        out
    }

    /// Loads stored bytes at `start` of the data. Bits past the disk's last chunk are
    /// ignored, as QEMU ignores them.
    pub fn deserialize(&mut self, start: u64, bytes: &[u8]) {
        for (i, &b) in bytes.iter().enumerate() {
            let byte = start + i as u64;
            let Some(w) = self.words.get_mut((byte / 8) as usize) else {
                break;
            };
            *w |= u64::from(b) << (8 * (byte % 8));
        }
        self.clear_tail();
    }

    /// Sets every bit of the stored bytes `[start, start + len)` (a table entry that reads
    /// as all ones).
    pub fn fill(&mut self, start: u64, len: u64) {
        let first = start.saturating_mul(8);
        if len == 0 || first >= self.bits {
            return;
        }
        let last = start.saturating_add(len).saturating_mul(8).min(self.bits) - 1;
        self.set_bits(first, last);
    }

    fn clear_tail(&mut self) {
        let used = self.bits % 64;
        if let (Some(last), true) = (self.words.last_mut(), used != 0) {
            *last &= !0u64 >> (64 - used);
        }
    }

    /// The dirty and clean extents of `[offset, offset + len)` of the disk, in order, each
    /// whole chunks except where the range cuts them: `(start, length, dirty)`.
    pub fn extents(&self, offset: u64, len: u64) -> Vec<(u64, u64, bool)> {
        let mut out = Vec::new();
        let end = offset.saturating_add(len);
        let mut pos = offset;
        while pos < end {
            let bit = pos >> self.granularity_bits;
            if bit >= self.bits {
                // Past the disk: nothing is dirty there.
                out.push((pos, end - pos, false));
                break;
            }
            let dirty = self.get(bit);
            let next = self
                .run_end(bit, dirty)
                .checked_shl(self.granularity_bits.into())
                .map_or(end, |b| b.min(end));
            out.push((pos, next - pos, dirty));
            pos = next;
        }
        // A clean run that ends the disk and the clean space past it are one extent.
        let mut merged: Vec<(u64, u64, bool)> = Vec::with_capacity(out.len());
        for e in out {
            match merged.last_mut() {
                Some(last) if last.2 == e.2 => last.1 += e.1,
                _ => merged.push(e),
            }
        }
        merged
    }

    /// The same extents as `(length, dirty)` runs, as a block status answer gives them.
    pub fn runs(&self, offset: u64, len: u64) -> Vec<(u64, bool)> {
        self.extents(offset, len)
            .into_iter()
            .map(|(_, n, dirty)| (n, dirty))
            .collect()
    }

    /// The first bit after `bit` whose value differs from `value` (bits past the disk count
    /// as differing), skipping whole words at a time.
    fn run_end(&self, bit: u64, value: bool) -> u64 {
        let same = if value { !0u64 } else { 0 };
        let mut b = bit;
        while b < self.bits {
            let w = self.words[(b / 64) as usize] ^ same;
            let masked = w >> (b % 64);
            if masked != 0 {
                return (b + u64::from(masked.trailing_zeros())).min(self.bits);
            }
            b = (b / 64 + 1) * 64;
        }
        self.bits
    }

    /// Follows the disk to `disk_size` bytes, as QEMU truncates a bitmap with its disk:
    /// chunks past the new end are dropped, new chunks start clean. The caller has checked
    /// the new size with [`check_size`].
    pub fn resize(&mut self, disk_size: u64) {
        self.bits = disk_size.div_ceil(1u64 << self.granularity_bits);
        self.words.resize(self.bits.div_ceil(64) as usize, 0);
        self.clear_tail();
    }

    /// Sets every chunk that is dirty in `other` (which may have another granularity).
    pub fn merge(&mut self, other: &BitmapData) {
        let disk = other.bits << other.granularity_bits;
        for (start, len, dirty) in other.extents(0, disk) {
            if dirty {
                self.mark(start, len);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_first_chunk_is_the_least_significant_bit_of_the_first_byte() {
        let mut b = BitmapData::new(1 << 20, 16);
        b.mark(0, 1);
        b.mark(9 << 16, 1);
        assert_eq!(b.serialize(0, 2), vec![0b0000_0001, 0b0000_0010]);
        let mut c = BitmapData::new(1 << 20, 16);
        c.deserialize(0, &[0b1000_0000, 0xff]);
        assert!(c.get(7) && c.get(8) && c.get(15) && !c.get(0));
    }

    #[test]
    fn marking_covers_every_touched_chunk_and_stops_at_the_disk_end() {
        let mut b = BitmapData::new(10 * 65536 + 1, 16);
        assert_eq!(b.data_bytes(), 2);
        b.mark(65535, 2);
        assert!(b.get(0) && b.get(1) && !b.get(2));
        b.mark(10 * 65536, u64::MAX);
        assert!(b.get(10) && !b.get(11));
        b.mark(64 * 65536, 65536 * 200);
        assert_eq!(b.serialize(0, 3), vec![0b11, 0b100, 0]);
    }

    #[test]
    fn runs_across_words_set_exactly_their_bits() {
        let mut b = BitmapData::new(1000 << 9, 9);
        b.mark(60 << 9, 70 << 9);
        let set: Vec<u64> = (0..1000).filter(|&i| b.get(i)).collect();
        assert_eq!(set, (60..130).collect::<Vec<_>>());
        b.fill(0, 1);
        assert!((0..8).all(|i| b.get(i)) && !b.get(8));
    }

    #[test]
    fn bits_past_the_disk_are_dropped_on_load() {
        let mut b = BitmapData::new(3 << 16, 16);
        b.deserialize(0, &[0xff]);
        assert_eq!(b.serialize(0, 1), vec![0b111]);
        b.fill(0, 100);
        assert_eq!(b.serialize(0, 2), vec![0b111, 0]);
    }

    #[test]
    fn extents_merge_neighbours_and_cut_at_the_range() {
        let mut b = BitmapData::new(8 << 16, 16);
        b.mark(2 << 16, 2 << 16);
        assert_eq!(
            b.extents(65536 + 10, 4 << 16),
            vec![
                (65546, 65526, false),
                (2 << 16, 2 << 16, true),
                (4 << 16, 65546, false)
            ]
        );
    }

    #[test]
    fn extents_skip_long_runs_and_stop_at_the_disk() {
        let mut b = BitmapData::new(1000 << 9, 9);
        b.mark(100 << 9, 500 << 9);
        assert_eq!(
            b.extents(0, 1000 << 9),
            vec![
                (0, 100 << 9, false),
                (100 << 9, 500 << 9, true),
                (600 << 9, 400 << 9, false)
            ]
        );
        assert_eq!(
            b.extents(999 << 9, 10 << 9),
            vec![(999 << 9, 10 << 9, false)]
        );
    }

    #[test]
    fn merging_a_finer_bitmap_marks_the_coarser_chunks() {
        let mut fine = BitmapData::new(1 << 20, 9);
        fine.mark(70_000, 1);
        let mut coarse = BitmapData::new(1 << 20, 16);
        coarse.merge(&fine);
        assert!(coarse.get(1) && !coarse.get(0) && !coarse.get(2));
    }

    #[test]
    fn resizing_drops_chunks_past_the_end_and_adds_clean_ones() {
        let mut b = BitmapData::new(10 * 512, 9);
        b.mark(0, 10 * 512);
        b.resize(3 * 512 + 1);
        assert_eq!((0..4).filter(|&i| b.get(i)).count(), 4);
        b.resize(200 * 512);
        assert!((0..4).all(|i| b.get(i)));
        assert!((4..200).all(|i| !b.get(i)));
        b.resize(2 * 512);
        b.resize(200 * 512);
        assert!((2..200).all(|i| !b.get(i)));
        assert_eq!(b.data_bytes(), 25);
    }

    #[test]
    fn sizes_follow_qemus_limits() {
        assert!(check_size(1 << 40, 8, 65536).is_err());
        assert!(check_size(1 << 40, 32, 65536).is_err());
        assert!(check_size(1 << 40, 16, 65536).is_ok());
        // 2^52 bytes at 512 B per bit would need 1 TiB of bitmap.
        assert!(check_size(1 << 52, 9, 65536).is_err());
        assert_eq!(table_entries(1 << 30, 16, 65536), 1);
        assert_eq!(data_bytes(1 << 30, 16), 2048);
    }
}
