//! The [`Export`] trait the server drives, and the types its methods exchange.

use nbd_proto::errno::Errno;
use nbd_proto::wire::MAX_PAYLOAD;

/// Block size constraints an export advertises with `NBD_INFO_BLOCK_SIZE`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BlockSize {
    /// Smallest addressable unit and alignment (power of two, at most 64 KiB). Advertised
    /// and enforced only for clients that ask for block sizes; the export serves unaligned
    /// requests from the others (they are told minimum 1, as qemu-nbd tells them).
    pub minimum: u32,
    /// Size at which I/O is efficient (power of two, at least `max(minimum, 512)`).
    pub preferred: u32,
    /// Largest payload accepted; the server caps it at 32 MiB.
    pub maximum: u32,
}

impl Default for BlockSize {
    fn default() -> Self {
        Self {
            minimum: 1,
            preferred: 4096,
            maximum: MAX_PAYLOAD,
        }
    }
}

/// Why a [`BlockSize`] breaks the spec's rules.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum BlockSizeError {
    /// The minimum is not a power of two in 1..=65536.
    #[error("minimum block size {0} must be a power of two between 1 and 65536")]
    Minimum(u32),
    /// The preferred size is not a power of two at least `max(minimum, 512)`.
    #[error("preferred block size {preferred} must be a power of two >= max({minimum}, 512)")]
    Preferred {
        /// Offending preferred size.
        preferred: u32,
        /// Minimum it must not undercut.
        minimum: u32,
    },
    /// The maximum payload is below the preferred size.
    #[error("maximum payload {maximum} must be at least the preferred block size {preferred}")]
    Maximum {
        /// Offending maximum.
        maximum: u32,
        /// Preferred size it must reach.
        preferred: u32,
    },
}

impl BlockSize {
    /// Checks the constraints `nbd-proto.md` puts on advertised sizes.
    pub fn validate(&self) -> Result<(), BlockSizeError> {
        if !self.minimum.is_power_of_two() || self.minimum > 65536 {
            return Err(BlockSizeError::Minimum(self.minimum));
        }
        if !self.preferred.is_power_of_two() || self.preferred < self.minimum.max(512) {
            return Err(BlockSizeError::Preferred {
                preferred: self.preferred,
                minimum: self.minimum,
            });
        }
        if self.maximum < self.preferred {
            return Err(BlockSizeError::Maximum {
                maximum: self.maximum,
                preferred: self.preferred,
            });
        }
        Ok(())
    }

    /// The sizes the server advertises: the maximum capped at [`MAX_PAYLOAD`].
    pub fn advertised(&self) -> Self {
        Self {
            maximum: self.maximum.min(MAX_PAYLOAD),
            ..*self
        }
    }
}

/// What an export supports; the server turns this into transmission flags and meta contexts.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ExportFeatures {
    /// Refuse writes, trims and zeroing with `EPERM`.
    pub read_only: bool,
    /// `flush` does something worth calling (advertises `SEND_FLUSH`).
    pub flush: bool,
    /// Writes honour force-unit-access (advertises `SEND_FUA`).
    pub fua: bool,
    /// `trim` is supported (advertises `SEND_TRIM`).
    pub trim: bool,
    /// `write_zeroes` is supported (advertises `SEND_WRITE_ZEROES`).
    pub write_zeroes: bool,
    /// `write_zeroes` honours `fast` by failing with `ENOTSUP` (advertises `SEND_FAST_ZERO`).
    pub fast_zero: bool,
    /// `cache` is supported (advertises `SEND_CACHE`).
    pub cache: bool,
    /// Connections share one cache, so flush is visible across them (`CAN_MULTI_CONN`).
    pub multi_conn: bool,
    /// The export behaves like a rotational disk (`ROTATIONAL`).
    pub rotational: bool,
    /// Block size constraints.
    pub block_size: BlockSize,
    /// Offer the `qemu:allocation-depth` metadata context.
    pub allocation_depth: bool,
}

impl Default for ExportFeatures {
    /// A writable export with every optional command enabled and default block sizes.
    fn default() -> Self {
        Self {
            read_only: false,
            flush: true,
            fua: true,
            trim: true,
            write_zeroes: true,
            fast_zero: true,
            cache: true,
            multi_conn: true,
            rotational: false,
            block_size: BlockSize::default(),
            allocation_depth: true,
        }
    }
}

/// Flags of a zeroing request.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct WriteZeroesFlags {
    /// The export may deallocate the range (the client did not send `NO_HOLE`).
    pub may_unmap: bool,
    /// Fail with [`Errno::NotSup`] unless zeroing is faster than writing zeroes.
    pub fast: bool,
    /// Persist before completing.
    pub fua: bool,
}

/// One piece of a read: data, or a run of zeroes the server may send as a hole.
#[derive(Debug)]
pub enum ReadChunk<B> {
    /// Bytes read (the buffer's whole length).
    Data(B),
    /// This many bytes read as zeroes.
    Hole(usize),
}

impl<B: AsRef<[u8]>> ReadChunk<B> {
    /// Bytes this chunk covers.
    pub fn len(&self) -> usize {
        match self {
            Self::Data(buf) => buf.as_ref().len(),
            Self::Hole(len) => *len,
        }
    }

    /// True if the chunk covers nothing.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// One extent of block status: enough for `base:allocation` and `qemu:allocation-depth`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Extent {
    /// Length in bytes (zero-length extents are skipped).
    pub len: u64,
    /// Not allocated in the backing storage (`NBD_STATE_HOLE`).
    pub hole: bool,
    /// Reads as zeroes (`NBD_STATE_ZERO`).
    pub zero: bool,
    /// Layer of the backing chain providing the data: 0 unallocated, 1 the top layer, ...
    pub depth: u32,
}

/// A block device the server exports. Single-threaded by design: the futures need not be
/// `Send`, and several connections share one export on one thread.
///
/// A payload buffer an export reads into and writes from, made without its export (so a
/// worker thread can make one for an export on another thread).
pub trait Buffer: AsRef<[u8]> + AsMut<[u8]> {
    /// A zero-filled buffer of exactly `len` bytes.
    fn zeroed(len: usize) -> Self;
}

impl Buffer for Vec<u8> {
    fn zeroed(len: usize) -> Self {
        vec![0; len]
    }
}

/// The server validates every request against [`Export::size`] and [`ExportFeatures`]
/// before calling a method, so implementations see only in-range, aligned, supported calls.
#[allow(async_fn_in_trait)] // single-threaded by design: futures are deliberately !Send
pub trait Export {
    /// Payload buffer, so an engine can hand out O_DIRECT-aligned memory: WRITE payloads
    /// are read straight into it and READ data is sent straight from it.
    type Buf: Buffer;

    /// A zero-filled buffer of exactly `len` bytes.
    fn alloc(&self, len: usize) -> Self::Buf {
        Self::Buf::zeroed(len)
    }

    /// Export size in bytes.
    fn size(&self) -> u64;

    /// Supported features and block sizes.
    fn features(&self) -> ExportFeatures;

    /// Reads `len` bytes at `offset`; the chunks must cover exactly `len` bytes in order.
    async fn read(&self, offset: u64, len: usize) -> Result<Vec<ReadChunk<Self::Buf>>, Errno>;

    /// Writes `data` at `offset`; with `fua`, persists it before returning.
    async fn write(&self, offset: u64, data: Self::Buf, fua: bool) -> Result<(), Errno>;

    /// Makes `len` bytes at `offset` read as zeroes.
    async fn write_zeroes(
        &self,
        offset: u64,
        len: u64,
        flags: WriteZeroesFlags,
    ) -> Result<(), Errno>;

    /// Discards `len` bytes at `offset` (advisory: contents become unspecified).
    async fn trim(&self, offset: u64, len: u64, fua: bool) -> Result<(), Errno>;

    /// Persists every completed write.
    async fn flush(&self) -> Result<(), Errno>;

    /// Prefetches `len` bytes at `offset`.
    async fn cache(&self, offset: u64, len: u64) -> Result<(), Errno>;

    /// Describes the range starting at `offset`; `len` is a hint, the extents may cover less
    /// (at least one byte) or more.
    async fn block_status(&self, offset: u64, len: u64) -> Result<Vec<Extent>, Errno>;

    /// A connection selected this export (`NBD_OPT_GO` or `NBD_OPT_EXPORT_NAME`) and
    /// starts transmission on it. Called once per connection, on the export's own thread,
    /// before any request of that connection. For statistics: the default does nothing.
    /// How many connections are attached now is the export's [`crate::ExportState`], which
    /// counts them on every thread and is what closing the export waits on.
    fn client_attached(&self) {}

    /// Names of the dirty bitmaps offered as `qemu:dirty-bitmap:NAME` contexts (the server
    /// serves the first [`crate::negotiate::meta::MAX_DIRTY_BITMAPS`]).
    fn dirty_bitmaps(&self) -> Vec<String> {
        Vec::new()
    }

    /// The dirty and clean extents of dirty bitmap `index` over `[offset, offset + len)`:
    /// `(length, dirty)` in order, covering the range exactly.
    async fn dirty_status(
        &self,
        index: usize,
        offset: u64,
        len: u64,
    ) -> Result<Vec<(u64, bool)>, Errno> {
        let _ = (index, offset, len);
        Err(Errno::Inval)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn block_size_rules_follow_the_spec() {
        assert_eq!(BlockSize::default().validate(), Ok(()));
        let bs = |minimum, preferred, maximum| BlockSize {
            minimum,
            preferred,
            maximum,
        };
        assert_eq!(bs(512, 4096, 1 << 25).validate(), Ok(()));
        assert_eq!(
            bs(3, 4096, 1 << 25).validate(),
            Err(BlockSizeError::Minimum(3))
        );
        assert_eq!(
            bs(1 << 17, 1 << 17, 1 << 25).validate(),
            Err(BlockSizeError::Minimum(1 << 17))
        );
        assert!(matches!(
            bs(1, 256, 1 << 25).validate(),
            Err(BlockSizeError::Preferred { .. })
        ));
        assert!(matches!(
            bs(4096, 2048, 1 << 25).validate(),
            Err(BlockSizeError::Preferred { .. })
        ));
        assert!(matches!(
            bs(512, 4096, 1024).validate(),
            Err(BlockSizeError::Maximum { .. })
        ));
        assert_eq!(bs(1, 4096, u32::MAX).advertised().maximum, MAX_PAYLOAD);
    }
}
