//! `--cache`, as `serve` and `commit` take it: how image files are opened and flushed.

use clap::ValueEnum;

/// `--cache`: QEMU's modes, each a combination of O_DIRECT, writethrough and ignored flushes.
#[derive(ValueEnum, Debug, Clone, Copy, PartialEq, Eq)]
pub enum CacheMode {
    /// O_DIRECT, flushes honoured.
    None,
    /// Page cache, flushes honoured.
    Writeback,
    /// Page cache, every write persisted before it completes.
    Writethrough,
    /// O_DIRECT, every write persisted before it completes.
    Directsync,
    /// Page cache, flushes ignored (fast, loses data on a host crash).
    Unsafe,
}

impl CacheMode {
    /// Files are opened with O_DIRECT.
    pub fn direct(self) -> bool {
        matches!(self, Self::None | Self::Directsync)
    }

    /// Every write completes only once durable.
    pub fn writethrough(self) -> bool {
        matches!(self, Self::Writethrough | Self::Directsync)
    }

    /// FLUSH and FUA are no-ops.
    pub fn ignore_flush(self) -> bool {
        self == Self::Unsafe
    }
}
