//! The few errno values we report, spelled out so the engine needs no libc dependency.

/// Operation not permitted.
pub const EPERM: i32 = 1;
/// I/O error.
pub const EIO: i32 = 5;
/// No such file or directory.
pub const ENOENT: i32 = 2;
/// Resource temporarily unavailable.
pub const EAGAIN: i32 = 11;
/// Device or resource busy.
pub const EBUSY: i32 = 16;
/// Invalid argument.
pub const EINVAL: i32 = 22;
/// File too large.
pub const EFBIG: i32 = 27;
/// No space left on device.
pub const ENOSPC: i32 = 28;
/// Operation not supported.
pub const ENOTSUP: i32 = 95;
/// Disk quota exceeded.
pub const EDQUOT: i32 = 122;
