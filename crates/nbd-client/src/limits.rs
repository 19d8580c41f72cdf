//! How much the client sends in one request and accepts in one reply, and how long it waits.

use std::time::Duration;

/// Largest request sent: bigger reads and writes are split. QEMU's servers take 32 MiB.
pub const MAX_REQUEST: u32 = 32 << 20;

/// Largest zero, trim or block status request: the biggest 32-bit length in whole 4 KiB
/// blocks, so a split never leaves the rest unaligned.
pub const MAX_RANGE: u32 = 0xffff_f000;

/// Most chunks accepted in one structured reply: a 32 MiB read in 512-byte pieces is
/// 65536; a server that never ends a reply is cut off here.
pub const MAX_CHUNKS: u32 = 1 << 17;

/// Most extents accepted in one block status chunk (each is 8 bytes): bounds a reply.
pub const MAX_EXTENTS: u32 = 1 << 16;

/// How long a read from or write to the server may wait before the request fails.
pub const DEFAULT_IO_TIMEOUT: Duration = Duration::from_secs(300);
