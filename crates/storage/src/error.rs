//! Typed errors of the storage layer; they travel inside `std::io::Error` so the trait stays
//! io-shaped, and keep a message saying which operation and range was wrong.

use std::io;

/// An argument a caller passed that no backend can honour.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum RangeError {
    /// `offset + len` does not fit the 63-bit file offsets the kernel accepts.
    #[error("{op}: range at offset {offset} with length {len} exceeds the maximum file offset")]
    TooLarge {
        /// The storage operation that was refused.
        op: &'static str,
        /// Start of the requested range.
        offset: u64,
        /// Length of the requested range.
        len: u64,
    },
}

impl From<RangeError> for io::Error {
    fn from(e: RangeError) -> io::Error {
        io::Error::new(io::ErrorKind::InvalidInput, e)
    }
}

/// Largest byte offset the kernel's signed `off_t` can address.
pub const MAX_OFFSET: u64 = i64::MAX as u64;

/// End of `[offset, offset+len)`, refusing ranges that overflow or pass [`MAX_OFFSET`].
pub fn checked_end(op: &'static str, offset: u64, len: u64) -> Result<u64, RangeError> {
    offset
        .checked_add(len)
        .filter(|&end| end <= MAX_OFFSET)
        .ok_or(RangeError::TooLarge { op, offset, len })
}

/// `usize` → `u64` without `as` (lossless on every platform Rust supports today).
pub(crate) fn len_u64(len: usize) -> u64 {
    u64::try_from(len).unwrap_or(u64::MAX)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn checked_end_refuses_overflow_and_huge_offsets() {
        assert_eq!(checked_end("read", 10, 5), Ok(15));
        assert!(checked_end("read", u64::MAX, 1).is_err());
        assert!(checked_end("read", MAX_OFFSET, 1).is_err());
        assert_eq!(checked_end("read", MAX_OFFSET, 0), Ok(MAX_OFFSET));
        let e: io::Error = checked_end("write", u64::MAX - 1, 9).unwrap_err().into();
        assert_eq!(e.kind(), io::ErrorKind::InvalidInput);
        assert!(e.to_string().contains("write"), "{e}");
    }
}
