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

/// What a path names, when it is not something an image can live in.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FileKind {
    /// A directory.
    Directory,
    /// A FIFO (named pipe): opening it waits for a writer, reading it consumes the data.
    Fifo,
    /// A Unix socket.
    Socket,
    /// A character device (a terminal, `/dev/null`, a watchdog...).
    CharDevice,
    /// Anything else the kernel reports.
    Other,
}

impl std::fmt::Display for FileKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            FileKind::Directory => "a directory",
            FileKind::Fifo => "a FIFO (named pipe)",
            FileKind::Socket => "a socket",
            FileKind::CharDevice => "a character device",
            FileKind::Other => "a special file",
        })
    }
}

impl FileKind {
    /// The kind of `t`, or `None` for a regular file or a block device (what images live in).
    pub fn refused(t: std::fs::FileType) -> Option<FileKind> {
        use std::os::unix::fs::FileTypeExt;
        if t.is_file() || t.is_block_device() {
            None
        } else if t.is_dir() {
            Some(FileKind::Directory)
        } else if t.is_fifo() {
            Some(FileKind::Fifo)
        } else if t.is_socket() {
            Some(FileKind::Socket)
        } else if t.is_char_device() {
            Some(FileKind::CharDevice)
        } else {
            Some(FileKind::Other)
        }
    }
}

/// A path that names something other than a regular file or a block device.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
#[error("opening {path}: it is {kind}; an image must be a regular file or a block device")]
pub struct NotAnImageFile {
    /// The path.
    pub path: String,
    /// What it names.
    pub kind: FileKind,
}

impl From<NotAnImageFile> for io::Error {
    fn from(e: NotAnImageFile) -> io::Error {
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
