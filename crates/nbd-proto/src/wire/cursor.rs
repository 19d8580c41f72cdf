//! A bounds-checked big-endian reader over untrusted bytes.

use super::error::WireError;

/// Reads big-endian fields from a byte slice, reporting the structure, field and offset of
/// any shortfall instead of panicking.
#[derive(Debug, Clone)]
pub(crate) struct Cursor<'a> {
    structure: &'static str,
    bytes: &'a [u8],
    pos: usize,
}

impl<'a> Cursor<'a> {
    /// Starts reading `bytes` as `structure` (used in error messages).
    pub(crate) fn new(structure: &'static str, bytes: &'a [u8]) -> Self {
        Self {
            structure,
            bytes,
            pos: 0,
        }
    }

    /// Current byte offset.
    pub(crate) fn pos(&self) -> usize {
        self.pos
    }

    /// Bytes not yet consumed.
    pub(crate) fn remaining(&self) -> usize {
        self.bytes.len().saturating_sub(self.pos)
    }

    /// Takes the next `len` bytes.
    pub(crate) fn take(&mut self, field: &'static str, len: usize) -> Result<&'a [u8], WireError> {
        let rest = self.bytes.get(self.pos..).unwrap_or_default();
        match rest.get(..len) {
            Some(slice) => {
                self.pos += len;
                Ok(slice)
            }
            None => Err(WireError::Truncated {
                structure: self.structure,
                field,
                offset: self.pos,
                need: len,
                have: rest.len(),
            }),
        }
    }

    /// Takes everything left.
    pub(crate) fn rest(&mut self) -> &'a [u8] {
        let rest = self.bytes.get(self.pos..).unwrap_or_default();
        self.pos = self.bytes.len();
        rest
    }

    fn array<const N: usize>(&mut self, field: &'static str) -> Result<[u8; N], WireError> {
        let slice = self.take(field, N)?;
        let mut out = [0u8; N];
        out.copy_from_slice(slice);
        Ok(out)
    }

    /// Reads a big-endian u16.
    pub(crate) fn u16(&mut self, field: &'static str) -> Result<u16, WireError> {
        self.array(field).map(u16::from_be_bytes)
    }

    /// Reads a big-endian u32.
    pub(crate) fn u32(&mut self, field: &'static str) -> Result<u32, WireError> {
        self.array(field).map(u32::from_be_bytes)
    }

    /// Reads a big-endian u64.
    pub(crate) fn u64(&mut self, field: &'static str) -> Result<u64, WireError> {
        self.array(field).map(u64::from_be_bytes)
    }

    /// Reads a u32 length prefix followed by that many bytes, refusing lengths above `max`.
    pub(crate) fn string(
        &mut self,
        field: &'static str,
        max: usize,
    ) -> Result<&'a [u8], WireError> {
        let at = self.pos;
        let len = self.u32(field)?;
        let len = usize::try_from(len).unwrap_or(usize::MAX);
        if len > max {
            return Err(self.invalid_at(field, at, len as u64, "string longer than allowed"));
        }
        self.take(field, len)
    }

    /// Checks a magic number.
    pub(crate) fn magic32(&mut self, expected: u32) -> Result<(), WireError> {
        let at = self.pos;
        let found = self.u32("magic")?;
        if found != expected {
            return Err(WireError::BadMagic {
                structure: self.structure,
                offset: at,
                found: found.into(),
                expected: expected.into(),
            });
        }
        Ok(())
    }

    /// Checks a 64-bit magic number.
    pub(crate) fn magic64(&mut self, expected: u64) -> Result<(), WireError> {
        let at = self.pos;
        let found = self.u64("magic")?;
        if found != expected {
            return Err(WireError::BadMagic {
                structure: self.structure,
                offset: at,
                found,
                expected,
            });
        }
        Ok(())
    }

    /// Builds an `Invalid` error for a field that started at `offset`.
    pub(crate) fn invalid_at(
        &self,
        field: &'static str,
        offset: usize,
        value: u64,
        reason: &'static str,
    ) -> WireError {
        WireError::Invalid {
            structure: self.structure,
            field,
            offset,
            value,
            reason,
        }
    }

    /// Fails if any bytes remain.
    pub(crate) fn finish(&self) -> Result<(), WireError> {
        match self.remaining() {
            0 => Ok(()),
            extra => Err(WireError::Trailing {
                structure: self.structure,
                offset: self.pos,
                extra,
            }),
        }
    }
}

/// Appends a u32 length prefix and the bytes; callers guarantee `bytes.len()` fits in u32
/// (all strings we encode are bounded by [`super::MAX_STRING_LEN`] or the payload maximum).
pub(crate) fn put_string(out: &mut Vec<u8>, bytes: &[u8]) {
    let len = u32::try_from(bytes.len()).unwrap_or(u32::MAX);
    out.extend_from_slice(&len.to_be_bytes());
    out.extend_from_slice(bytes.get(..len as usize).unwrap_or(bytes));
}
