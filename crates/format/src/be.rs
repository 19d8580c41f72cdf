//! Big-endian field access on untrusted byte slices: every read is bounds-checked and a short
//! buffer becomes a `Truncated` error naming the structure.

use super::error::{FormatError, Location};

/// Reads `N` bytes at `pos`, or reports what was missing.
pub(crate) fn array<const N: usize>(
    buf: &[u8],
    pos: usize,
    at: Location,
    what: &'static str,
) -> Result<[u8; N], FormatError> {
    pos.checked_add(N)
        .and_then(|end| buf.get(pos..end))
        .and_then(|s| <[u8; N]>::try_from(s).ok())
        .ok_or(FormatError::Truncated {
            at,
            what,
            need: (pos as u64).saturating_add(N as u64),
            have: buf.len() as u64,
        })
}

/// Reads a big-endian u16 at `pos`.
pub(crate) fn u16_at(
    buf: &[u8],
    pos: usize,
    at: Location,
    what: &'static str,
) -> Result<u16, FormatError> {
    array::<2>(buf, pos, at, what).map(u16::from_be_bytes)
}

/// Reads a big-endian u32 at `pos`.
pub(crate) fn u32_at(
    buf: &[u8],
    pos: usize,
    at: Location,
    what: &'static str,
) -> Result<u32, FormatError> {
    array::<4>(buf, pos, at, what).map(u32::from_be_bytes)
}

/// Reads a big-endian u64 at `pos`.
pub(crate) fn u64_at(
    buf: &[u8],
    pos: usize,
    at: Location,
    what: &'static str,
) -> Result<u64, FormatError> {
    array::<8>(buf, pos, at, what).map(u64::from_be_bytes)
}

/// Borrows `len` bytes at `pos`.
pub(crate) fn bytes_at<'a>(
    buf: &'a [u8],
    pos: usize,
    len: usize,
    at: Location,
    what: &'static str,
) -> Result<&'a [u8], FormatError> {
    pos.checked_add(len)
        .and_then(|end| buf.get(pos..end))
        .ok_or(FormatError::Truncated {
            at,
            what,
            need: (pos as u64).saturating_add(len as u64),
            have: buf.len() as u64,
        })
}

/// Rounds `n` up to a multiple of 8 (all qcow2 variable-length records are 8-byte padded).
pub(crate) fn pad8(n: usize) -> Option<usize> {
    n.checked_add(7).map(|v| v & !7)
}

/// Converts an untrusted u64 to usize, reporting overflow at `at`.
pub(crate) fn to_usize(v: u64, at: Location, what: &'static str) -> Result<usize, FormatError> {
    usize::try_from(v).map_err(|_| FormatError::Overflow { at, what })
}

/// Decodes a table of big-endian 64-bit entries (L1, refcount and bitmap tables); a trailing
/// partial word is ignored.
pub fn words(buf: &[u8]) -> Vec<u64> {
    buf.chunks_exact(8)
        .map(|w| u64::from_be_bytes([w[0], w[1], w[2], w[3], w[4], w[5], w[6], w[7]]))
        .collect()
}

/// One entry of such a table as stored.
pub fn word_bytes(word: u64) -> [u8; 8] {
    word.to_be_bytes()
}

/// Encodes a table of 64-bit entries as stored, zero-padded to `len` bytes (a table fills
/// whole clusters); entries past `len` are not written.
pub fn table_bytes(words: &[u64], len: usize) -> Vec<u8> {
    let mut out = vec![0u8; len];
    for (slot, w) in out.chunks_exact_mut(8).zip(words) {
        slot.copy_from_slice(&word_bytes(*w));
    }
    out
}
