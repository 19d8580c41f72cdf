//! Sparse detection for `convert -S SIZE`, with qemu-img's rules: a buffer of data is cut
//! into 512-byte sectors; runs of zero sectors of at least SIZE are not written (the target
//! reads zeros there, or gets them as a zero write), shorter zero runs between data are
//! written with the data so that requests are not broken up, and run ends move to multiples
//! of SIZE (a power of two at most) so that writes do not start or end mid-block.

use crate::common::zeroes::is_zero;

/// The unit sparse detection works in.
pub const SECTOR: u64 = 512;

/// A run of a buffer: `len` bytes from `start`, data (written) or zeros (skipped).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Run {
    pub start: usize,
    pub len: usize,
    pub data: bool,
}

/// Sector `i` of `buf` (the last one may be short).
fn sector(buf: &[u8], i: usize) -> &[u8] {
    let a = i * SECTOR as usize;
    &buf[a..(a + SECTOR as usize).min(buf.len())]
}

/// The run of equal sectors (all zero, or all not) that `buf` begins with, in sectors, and
/// whether it is data. `first` is the target sector `buf` starts at and `align` (a power of
/// two) the sectors writes should be aligned to. When more follows, the run's end is moved
/// to an `align` boundary: a data run grows up to it; a zero run shrinks down to it, or, if
/// it would vanish, becomes data (the data after it is written up to the boundary anyway).
fn leading_run(buf: &[u8], first: u64, align: u64) -> (usize, bool) {
    let n = buf.len().div_ceil(SECTOR as usize);
    if n == 0 {
        return (0, false);
    }
    let zero = is_zero(sector(buf, 0));
    let mut i = 1;
    while i < n && is_zero(sector(buf, i)) == zero {
        i += 1;
    }
    if i == n {
        return (n, !zero);
    }
    let past = (first + i as u64) % align;
    if past == 0 {
        return (i, !zero);
    }
    // `past` < `align`, and `align` fits in usize (it is at most the buffer limit).
    let past = past as usize;
    if zero && i > past {
        return (i - past, false);
    }
    ((i + (align as usize - past)).min(n), true)
}

/// Like [`leading_run`], but a data run swallows the zero runs shorter than `min` sectors
/// that are followed by more data.
fn leading_run_min(buf: &[u8], first: u64, min: usize, align: u64) -> (usize, bool) {
    let n = buf.len().div_ceil(SECTOR as usize);
    let min = min.min(n);
    let (len, data) = leading_run(buf, first, align);
    if !data {
        return (len, false);
    }
    let (mut used, mut checked) = (len, len);
    while checked < n {
        let rest = &buf[checked * SECTOR as usize..];
        let (l, d) = leading_run(rest, first + checked as u64, align);
        checked += l;
        if d {
            used = checked;
        } else if l >= min {
            break;
        }
    }
    (used, true)
}

/// Cuts `buf`, which starts at target byte `start` (a multiple of [`SECTOR`]), into data
/// and zero runs for a sparse-detection size of `min_sparse` bytes (a non-zero multiple of
/// [`SECTOR`]).
pub fn runs(buf: &[u8], start: u64, min_sparse: u64) -> Vec<Run> {
    let min = usize::try_from(min_sparse / SECTOR)
        .unwrap_or(usize::MAX)
        .max(1);
    // The largest power of two not above the sparse size, in sectors.
    let align = 1u64 << (63 - (min_sparse / SECTOR).max(1).leading_zeros());
    let mut out: Vec<Run> = Vec::new();
    let mut pos = 0usize;
    while pos < buf.len() {
        let rest = &buf[pos..];
        let first = (start + pos as u64) / SECTOR;
        let (sectors, data) = leading_run_min(rest, first, min, align);
        let len = (sectors * SECTOR as usize).min(rest.len());
        match out.last_mut() {
            Some(r) if r.data == data => r.len += len,
            _ => out.push(Run {
                start: pos,
                len,
                data,
            }),
        }
        pos += len;
    }
    out
}

/// Widens the data runs of `runs` (of a buffer of `len` bytes at target byte `start`) to
/// whole `unit`s (the target's clusters), within the buffer, merging what then touches: a
/// cluster gets its data in one write, with its zeros written rather than left to the
/// image to fill, so that it is allocated in one go and in order.
pub fn widen(runs: &[Run], start: u64, unit: u64, len: usize) -> Vec<Run> {
    let unit = unit.max(1);
    let mut out: Vec<Run> = Vec::new();
    for r in runs.iter().filter(|r| r.data) {
        let (a, b) = (start + r.start as u64, start + (r.start + r.len) as u64);
        let a = (a - a % unit).max(start) - start;
        let b = b
            .div_ceil(unit)
            .saturating_mul(unit)
            .min(start + len as u64)
            - start;
        let (a, b) = (a as usize, b as usize);
        match out.last_mut() {
            Some(last) if last.start + last.len >= a => {
                last.len = b.max(last.start + last.len) - last.start
            }
            _ => out.push(Run {
                start: a,
                len: b - a,
                data: true,
            }),
        }
    }
    // The gaps between are zeros.
    let mut all = Vec::with_capacity(out.len() * 2 + 1);
    let mut pos = 0;
    for r in out {
        if r.start > pos {
            all.push(Run {
                start: pos,
                len: r.start - pos,
                data: false,
            });
        }
        pos = r.start + r.len;
        all.push(r);
    }
    if pos < len {
        all.push(Run {
            start: pos,
            len: len - pos,
            data: false,
        });
    }
    all
}

#[cfg(test)]
mod tests {
    use super::*;

    const K: usize = 1024;

    /// A buffer of `len` zero bytes with 0xff over each `(offset, len)`.
    fn buf(len: usize, data: &[(usize, usize)]) -> Vec<u8> {
        let mut b = vec![0u8; len];
        for &(o, l) in data {
            b[o..o + l].fill(0xff);
        }
        b
    }

    fn data_runs(b: &[u8], start: u64, min: u64) -> Vec<(usize, usize)> {
        let r = runs(b, start, min);
        // The runs tile the buffer.
        assert_eq!(r.iter().map(|r| r.len).sum::<usize>(), b.len());
        r.iter()
            .filter(|r| r.data)
            .map(|r| (r.start, r.len))
            .collect()
    }

    #[test]
    fn small_gaps_are_written_and_ends_are_aligned() {
        // Data at 0-1k, 8k-9k and 17k-18k of 64k.
        let b = buf(64 * K, &[(0, K), (8 * K, K), (17 * K, K)]);
        assert_eq!(
            data_runs(&b, 0, 4096),
            vec![(0, 4 * K), (8 * K, 4 * K), (16 * K, 4 * K)]
        );
        assert_eq!(data_runs(&b, 0, 8192), vec![(0, 24 * K)]);
        // Sector granularity: only the data sectors themselves.
        assert_eq!(data_runs(&b, 0, 512), vec![(0, K), (8 * K, K), (17 * K, K)]);
    }

    #[test]
    fn uniform_buffers_are_one_run() {
        assert_eq!(data_runs(&buf(8 * K, &[]), 0, 4096), vec![]);
        assert_eq!(
            data_runs(&buf(8 * K, &[(0, 8 * K)]), 0, 4096),
            vec![(0, 8 * K)]
        );
        // A short last sector counts as a sector.
        assert_eq!(
            data_runs(&buf(4096 + 100, &[(4096, 1)]), 0, 512),
            vec![(4096, 100)]
        );
    }

    #[test]
    fn widening_covers_whole_clusters() {
        let b = buf(256 * K, &[(10 * K, K), (60 * K, 8 * K), (200 * K, K)]);
        let r = widen(&runs(&b, 0, 4096), 0, 64 * K as u64, b.len());
        let spans: Vec<_> = r.iter().map(|r| (r.start / K, r.len / K, r.data)).collect();
        assert_eq!(
            spans,
            vec![(0, 128, true), (128, 64, false), (192, 64, true)]
        );
        // Clipped to the buffer, which need not start on a cluster.
        let r = widen(
            &runs(&b[8 * K..], 8 * K as u64, 4096),
            8 * K as u64,
            64 * K as u64,
            248 * K,
        );
        assert_eq!((r[0].start, r[0].len, r[0].data), (0, 120 * K, true));
        assert_eq!(
            widen(&runs(&buf(8 * K, &[]), 0, 4096), 0, 4096, 8 * K).len(),
            1
        );
    }

    #[test]
    fn alignment_follows_the_target_offset() {
        // The same data 1k later in the target: the aligned boundaries move.
        let b = buf(16 * K, &[(0, K)]);
        assert_eq!(data_runs(&b, 0, 4096), vec![(0, 4 * K)]);
        assert_eq!(data_runs(&b, 1024, 4096), vec![(0, 3 * K)]);
    }
}
