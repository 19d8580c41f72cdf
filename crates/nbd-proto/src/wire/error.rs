//! The error every decoder returns.

/// Why a byte sequence is not a valid NBD structure.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum WireError {
    /// The input ends before a field does.
    #[error("{structure}: field `{field}` at byte {offset} needs {need} bytes, only {have} left")]
    Truncated {
        /// Structure being decoded.
        structure: &'static str,
        /// Field that did not fit.
        field: &'static str,
        /// Byte offset of the field within the structure.
        offset: usize,
        /// Bytes the field needs.
        need: usize,
        /// Bytes that were left.
        have: usize,
    },
    /// A magic number does not match.
    #[error("{structure}: bad magic {found:#x} at byte {offset}, expected {expected:#x}")]
    BadMagic {
        /// Structure being decoded.
        structure: &'static str,
        /// Byte offset of the magic.
        offset: usize,
        /// Value found.
        found: u64,
        /// Value required.
        expected: u64,
    },
    /// A field holds a value the protocol forbids.
    #[error("{structure}: field `{field}` at byte {offset} has invalid value {value}: {reason}")]
    Invalid {
        /// Structure being decoded.
        structure: &'static str,
        /// Offending field.
        field: &'static str,
        /// Byte offset of the field.
        offset: usize,
        /// Value found.
        value: u64,
        /// What rule it breaks.
        reason: &'static str,
    },
    /// Bytes remain after the structure ended.
    #[error("{structure}: {extra} unexpected trailing bytes at byte {offset}")]
    Trailing {
        /// Structure being decoded.
        structure: &'static str,
        /// Offset where the structure ended.
        offset: usize,
        /// Number of extra bytes.
        extra: usize,
    },
}
