//! Turning an export's extents into the descriptors of one metadata context, within the
//! limits the spec puts on a block status reply.

use nbd_proto::wire::consts::{STATE_HOLE, STATE_ZERO};
use nbd_proto::wire::reply::Descriptor;

use crate::export::Extent;

/// Most extents one block status reply describes per context. The spec lets a server
/// describe less than it was asked about; this keeps one reply to a few MiB of memory
/// however fragmented the export is.
pub const MAX_STATUS_EXTENTS: usize = 1 << 16;

/// Largest descriptor length in a compact reply: the biggest 64 KiB multiple below 4 GiB, so a
/// clamped extent stays aligned to any legal minimum block size.
const COMPACT_MAX_EXTENT: u64 = 0xffff_0000;

/// `NBD_STATE_DIRTY`, bit 0 of a `qemu:dirty-bitmap:` context.
pub const STATE_DIRTY: u64 = 1;

/// Which view of an export's allocation a context gives.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Allocation {
    /// `base:allocation`: hole and zero bits.
    Base,
    /// `qemu:allocation-depth`: the layer number.
    Depth,
}

/// The status value of an extent in an allocation context.
pub fn status_of(extent: &Extent, view: Allocation) -> u64 {
    match view {
        Allocation::Base => {
            let mut flags = 0;
            if extent.hole {
                flags |= STATE_HOLE;
            }
            if extent.zero {
                flags |= STATE_ZERO;
            }
            flags.into()
        }
        Allocation::Depth => extent.depth.into(),
    }
}

/// Descriptors of an allocation context (see [`descriptors_of`]).
pub fn descriptors(extents: &[Extent], view: Allocation, q: &StatusQuery) -> Vec<Descriptor> {
    descriptors_of(extents.iter().map(|e| (e.len, status_of(e, view))), q)
}

/// Descriptors of a dirty bitmap context from its `(length, dirty)` runs.
pub fn dirty_descriptors(runs: &[(u64, bool)], q: &StatusQuery) -> Vec<Descriptor> {
    descriptors_of(
        runs.iter()
            .map(|&(len, dirty)| (len, if dirty { STATE_DIRTY } else { 0 })),
        q,
    )
}

/// The request a block status reply answers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StatusQuery {
    /// Offset of the request.
    pub offset: u64,
    /// Length the client asked about.
    pub len: u64,
    /// The client asked for one extent per context.
    pub req_one: bool,
    /// Compact (32-bit) descriptors.
    pub compact: bool,
    /// Export size.
    pub size: u64,
}

/// Descriptors of `(length, status)` runs: zero-length ones dropped, equal neighbours merged, nothing past
/// the end of the export, stopping once the requested length is covered (the last one may
/// run past it unless `req_one`), and no more than [`MAX_STATUS_EXTENTS`] (the spec allows
/// 2^20 per chunk; fewer keep a reply's memory small). Empty if the
/// export described nothing.
pub fn descriptors_of(
    runs: impl IntoIterator<Item = (u64, u64)>,
    q: &StatusQuery,
) -> Vec<Descriptor> {
    let limit = q.size.saturating_sub(q.offset);
    let mut out: Vec<Descriptor> = Vec::new();
    let mut covered = 0u64;
    for (len, status) in runs {
        if covered >= q.len || covered >= limit {
            break;
        }
        let len = len.min(limit - covered);
        if len == 0 {
            continue;
        }
        let full = out.len() >= MAX_STATUS_EXTENTS;
        match out.last_mut() {
            Some(last) if last.status == status => last.length += len,
            _ if full => break,
            _ => out.push(Descriptor {
                length: len,
                status,
            }),
        }
        covered += len;
    }
    if q.req_one {
        out.truncate(1);
        if let Some(first) = out.first_mut() {
            first.length = first.length.min(q.len);
        }
    }
    if q.compact {
        if let Some(last) = out.last_mut() {
            if last.length > u64::from(u32::MAX) {
                last.length = COMPACT_MAX_EXTENT;
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ext(len: u64, hole: bool, zero: bool, depth: u32) -> Extent {
        Extent {
            len,
            hole,
            zero,
            depth,
        }
    }

    fn q(offset: u64, len: u64, req_one: bool, compact: bool, size: u64) -> StatusQuery {
        StatusQuery {
            offset,
            len,
            req_one,
            compact,
            size,
        }
    }

    fn pairs(d: &[Descriptor]) -> Vec<(u64, u64)> {
        d.iter().map(|d| (d.length, d.status)).collect()
    }

    #[test]
    fn base_allocation_maps_hole_and_zero_bits_and_merges_neighbours() {
        let e = [
            ext(4096, false, false, 1),
            ext(4096, false, false, 2),
            ext(8192, true, true, 0),
            ext(512, false, true, 1),
        ];
        let d = descriptors(&e, Allocation::Base, &q(0, 1 << 20, false, true, 1 << 20));
        assert_eq!(pairs(&d), [(8192, 0), (8192, 3), (512, 2)]);
        let d = descriptors(&e, Allocation::Depth, &q(0, 1 << 20, false, true, 1 << 20));
        assert_eq!(pairs(&d), [(4096, 1), (4096, 2), (8192, 0), (512, 1)]);
    }

    #[test]
    fn stops_once_the_request_is_covered_but_the_last_may_run_past_it() {
        let e = [
            ext(1000, false, false, 1),
            ext(5000, true, true, 0),
            ext(100, false, false, 1),
        ];
        let d = descriptors(&e, Allocation::Base, &q(0, 2000, false, true, 10_000));
        assert_eq!(pairs(&d), [(1000, 0), (5000, 3)]);
    }

    #[test]
    fn req_one_gives_one_extent_no_longer_than_the_request() {
        let e = [ext(5000, true, true, 0), ext(100, false, false, 1)];
        let d = descriptors(&e, Allocation::Base, &q(0, 2000, true, true, 10_000));
        assert_eq!(pairs(&d), [(2000, 3)]);
    }

    #[test]
    fn never_describes_past_the_end_of_the_export() {
        let e = [ext(u64::MAX, false, false, 1)];
        let d = descriptors(&e, Allocation::Base, &q(4096, 100, false, false, 8192));
        assert_eq!(pairs(&d), [(4096, 0)]);
    }

    #[test]
    fn compact_replies_clamp_huge_extents_to_32_bits() {
        let e = [ext(1 << 40, true, true, 0)];
        let d = descriptors(&e, Allocation::Base, &q(0, 4096, false, true, 1 << 41));
        assert_eq!(pairs(&d), [(COMPACT_MAX_EXTENT, 3)]);
        let d = descriptors(&e, Allocation::Base, &q(0, 4096, false, false, 1 << 41));
        assert_eq!(pairs(&d), [(1 << 40, 3)]);
    }

    #[test]
    fn empty_and_zero_length_extents_describe_nothing() {
        assert!(descriptors(&[], Allocation::Base, &q(0, 10, false, true, 10)).is_empty());
        let e = [ext(0, true, true, 0)];
        assert!(descriptors(&e, Allocation::Base, &q(0, 10, false, true, 10)).is_empty());
    }

    #[test]
    fn at_most_max_status_extents_descriptors() {
        const { assert!(MAX_STATUS_EXTENTS <= nbd_proto::wire::MAX_EXTENTS_PER_CHUNK) };
        let e: Vec<Extent> = (0..(MAX_STATUS_EXTENTS + 10))
            .map(|i| ext(1, i % 2 == 0, false, 0))
            .collect();
        let size = e.len() as u64;
        let d = descriptors(&e, Allocation::Base, &q(0, size, false, true, size));
        assert_eq!(d.len(), MAX_STATUS_EXTENTS);
    }

    #[test]
    fn dirty_runs_become_dirty_flags_cut_at_the_request() {
        let runs = [(100, false), (200, true), (300, false)];
        let d = dirty_descriptors(&runs, &q(0, 250, false, true, 10_000));
        assert_eq!(pairs(&d), [(100, 0), (200, 1)]);
        let d = dirty_descriptors(&runs, &q(0, 600, true, true, 10_000));
        assert_eq!(pairs(&d), [(100, 0)]);
    }
}
