//! NBD error values and their mapping from operating-system errors.

use std::io;

/// An error an export returns for one request; the server sends its NBD value.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, thiserror::Error)]
pub enum Errno {
    /// `NBD_EPERM` (1): operation not permitted, e.g. a write to a read-only export.
    #[error("operation not permitted (EPERM)")]
    Perm,
    /// `NBD_EIO` (5): input/output error, e.g. a read of a corrupt region.
    #[error("input/output error (EIO)")]
    Io,
    /// `NBD_ENOMEM` (12): cannot allocate memory.
    #[error("cannot allocate memory (ENOMEM)")]
    NoMem,
    /// `NBD_EINVAL` (22): invalid argument.
    #[error("invalid argument (EINVAL)")]
    Inval,
    /// `NBD_ENOSPC` (28): no space left, e.g. a write past the end.
    #[error("no space left on device (ENOSPC)")]
    NoSpc,
    /// `NBD_EOVERFLOW` (75): value too large.
    #[error("value too large (EOVERFLOW)")]
    Overflow,
    /// `NBD_ENOTSUP` (95): operation not supported, e.g. a fast zero that would be slow.
    #[error("operation not supported (ENOTSUP)")]
    NotSup,
    /// `NBD_ESHUTDOWN` (108): the server is shutting down.
    #[error("server is shutting down (ESHUTDOWN)")]
    Shutdown,
}

impl Errno {
    /// Every error the spec defines, in the order of their values.
    pub const ALL: [Errno; 8] = [
        Self::Perm,
        Self::Io,
        Self::NoMem,
        Self::Inval,
        Self::NoSpc,
        Self::Overflow,
        Self::NotSup,
        Self::Shutdown,
    ];

    /// The C name of the error (`"EIO"`), as logs and statistics label it.
    pub fn name(self) -> &'static str {
        match self {
            Self::Perm => "EPERM",
            Self::Io => "EIO",
            Self::NoMem => "ENOMEM",
            Self::Inval => "EINVAL",
            Self::NoSpc => "ENOSPC",
            Self::Overflow => "EOVERFLOW",
            Self::NotSup => "ENOTSUP",
            Self::Shutdown => "ESHUTDOWN",
        }
    }

    /// The value sent on the wire.
    pub fn code(self) -> u32 {
        match self {
            Self::Perm => 1,
            Self::Io => 5,
            Self::NoMem => 12,
            Self::Inval => 22,
            Self::NoSpc => 28,
            Self::Overflow => 75,
            Self::NotSup => 95,
            Self::Shutdown => 108,
        }
    }

    /// The error for a wire value, if it is one the spec defines.
    pub fn from_code(code: u32) -> Option<Self> {
        Some(match code {
            1 => Self::Perm,
            5 => Self::Io,
            12 => Self::NoMem,
            22 => Self::Inval,
            28 => Self::NoSpc,
            75 => Self::Overflow,
            95 => Self::NotSup,
            108 => Self::Shutdown,
            _ => return None,
        })
    }

    /// Maps an operating-system error the way the spec asks (`EDQUOT`/`EFBIG` become
    /// `ENOSPC`, `EROFS`/`EACCES` become `EPERM`, anything unlisted becomes `EIO`).
    pub fn from_io(err: &io::Error) -> Self {
        match err.raw_os_error() {
            Some(libc::EPERM | libc::EACCES | libc::EROFS) => Self::Perm,
            Some(libc::ENOMEM) => Self::NoMem,
            Some(libc::EINVAL) => Self::Inval,
            Some(libc::ENOSPC | libc::EDQUOT | libc::EFBIG) => Self::NoSpc,
            Some(libc::EOVERFLOW) => Self::Overflow,
            Some(libc::ENOTSUP) => Self::NotSup,
            Some(libc::ESHUTDOWN) => Self::Shutdown,
            _ => match err.kind() {
                io::ErrorKind::PermissionDenied => Self::Perm,
                io::ErrorKind::OutOfMemory => Self::NoMem,
                io::ErrorKind::InvalidInput => Self::Inval,
                io::ErrorKind::Unsupported => Self::NotSup,
                _ => Self::Io,
            },
        }
    }
}

impl From<io::Error> for Errno {
    fn from(err: io::Error) -> Self {
        Self::from_io(&err)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn codes_round_trip_and_match_the_spec() {
        let codes: Vec<u32> = Errno::ALL.iter().map(|e| e.code()).collect();
        assert_eq!(codes, [1, 5, 12, 22, 28, 75, 95, 108]);
        for e in Errno::ALL {
            assert_eq!(Errno::from_code(e.code()), Some(e));
        }
        assert_eq!(Errno::from_code(0), None);
        assert_eq!(Errno::from_code(2), None);
    }

    #[test]
    fn names_are_the_c_names() {
        let names: Vec<&str> = Errno::ALL.iter().map(|e| e.name()).collect();
        assert_eq!(
            names,
            [
                "EPERM",
                "EIO",
                "ENOMEM",
                "EINVAL",
                "ENOSPC",
                "EOVERFLOW",
                "ENOTSUP",
                "ESHUTDOWN"
            ]
        );
    }

    #[test]
    fn os_errors_map_as_the_spec_recommends() {
        let os = |code| Errno::from_io(&io::Error::from_raw_os_error(code));
        assert_eq!(os(libc::EDQUOT), Errno::NoSpc);
        assert_eq!(os(libc::EFBIG), Errno::NoSpc);
        assert_eq!(os(libc::EROFS), Errno::Perm);
        assert_eq!(os(libc::EOPNOTSUPP), Errno::NotSup);
        assert_eq!(os(libc::EBADF), Errno::Io);
        assert_eq!(
            Errno::from_io(&io::Error::new(io::ErrorKind::UnexpectedEof, "short")),
            Errno::Io
        );
    }
}
