//! What resolving a guest range through the chain produces: pieces of guest bytes, each with
//! where its bytes come from and which layer decided.

use crate::format::{GuestOffset, HostOffset};

/// Where the bytes of a piece come from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Source {
    /// Zeros (a zero cluster or subcluster, or nothing allocated anywhere); `host` is the
    /// host cluster a zero cluster keeps allocated (for the start of the piece), if any.
    Zero { host: Option<HostOffset> },
    /// Bytes at `host` of the layer's data storage.
    Data { host: HostOffset },
    /// Part of a compressed cluster (raw L2 word, guest offset of the cluster's start).
    Compressed { raw: u64, cluster: GuestOffset },
}

/// A run of guest bytes and where they come from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Piece {
    /// First guest byte.
    pub start: GuestOffset,
    /// Length.
    pub len: u64,
    /// Where the bytes come from.
    pub src: Source,
    /// The layer that decided: the one holding the data or zero flag when `present`,
    /// otherwise the deepest layer whose size covers the range (qemu-img map's `depth`).
    pub layer: usize,
    /// Allocated (as data or zeros) in some layer.
    pub present: bool,
}

/// True when a run of `len` bytes at host offset `a` is followed by host offset `b` (both
/// absent counts as continuing, for zeros with no host cluster).
pub(crate) fn host_continues(a: Option<HostOffset>, len: u64, b: Option<HostOffset>) -> bool {
    match (a, b) {
        (None, None) => true,
        (Some(a), Some(b)) => a.0.checked_add(len) == Some(b.0),
        _ => false,
    }
}

impl Source {
    /// Reads as zeros.
    pub(crate) fn is_zero(&self) -> bool {
        matches!(self, Source::Zero { .. })
    }
}

impl Piece {
    /// The guest offset just past the piece.
    pub(crate) fn end(&self) -> GuestOffset {
        GuestOffset(self.start.0 + self.len)
    }

    /// True when `next` is data that continues this data piece in the same file, in guest
    /// and host order alike, so one I/O can read both.
    pub(crate) fn continues_data(&self, next: &Piece) -> bool {
        match (self.src, next.src) {
            (Source::Data { host: a }, Source::Data { host: b }) => {
                next.layer == self.layer && b.0 == a.0 + self.len && next.start == self.end()
            }
            _ => false,
        }
    }
}

/// Zeros nobody allocated; `deepest` is the last layer that covers them.
pub(crate) fn absent(start: GuestOffset, len: u64, deepest: usize) -> Piece {
    Piece {
        start,
        len,
        src: Source::Zero { host: None },
        layer: deepest,
        present: false,
    }
}
