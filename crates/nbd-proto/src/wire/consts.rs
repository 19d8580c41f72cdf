//! Numeric constants of the NBD protocol: magics, option and reply codes, flags, commands.
//!
//! Values follow `nbd-proto.md` and the `EXTENDED_HEADERS` extension; names keep the
//! spec's spelling minus the `NBD_` prefix so they can be grepped against it.

/// `NBDMAGIC`, the first 8 bytes the server sends.
pub const NBDMAGIC: u64 = 0x4e42_444d_4147_4943;
/// `IHAVEOPT`, the newstyle magic; also prefixes every client option.
pub const IHAVEOPT: u64 = 0x4948_4156_454f_5054;
/// Magic of every option reply (fixed newstyle).
pub const OPTION_REPLY_MAGIC: u64 = 0x0003_e889_0455_65a9;
/// Magic of a compact (28-byte) request.
pub const REQUEST_MAGIC: u32 = 0x2560_9513;
/// Magic of an extended (32-byte) request.
pub const EXTENDED_REQUEST_MAGIC: u32 = 0x21e4_1c71;
/// Magic of a simple reply.
pub const SIMPLE_REPLY_MAGIC: u32 = 0x6744_6698;
/// Magic of a structured reply chunk.
pub const STRUCTURED_REPLY_MAGIC: u32 = 0x668e_33ef;
/// Magic of an extended reply chunk.
pub const EXTENDED_REPLY_MAGIC: u32 = 0x6e8a_278c;

/// Handshake flag: the server speaks fixed newstyle.
pub const FLAG_FIXED_NEWSTYLE: u16 = 1 << 0;
/// Handshake flag: the server can omit the 124 zero bytes after `OPT_EXPORT_NAME`.
pub const FLAG_NO_ZEROES: u16 = 1 << 1;
/// Client flag: the client speaks fixed newstyle.
pub const FLAG_C_FIXED_NEWSTYLE: u32 = 1 << 0;
/// Client flag: the client wants no zero padding after `OPT_EXPORT_NAME`.
pub const FLAG_C_NO_ZEROES: u32 = 1 << 1;

/// Transmission flag: always set.
pub const FLAG_HAS_FLAGS: u16 = 1 << 0;
/// Transmission flag: the export is read-only.
pub const FLAG_READ_ONLY: u16 = 1 << 1;
/// Transmission flag: `CMD_FLUSH` is supported.
pub const FLAG_SEND_FLUSH: u16 = 1 << 2;
/// Transmission flag: `CMD_FLAG_FUA` is supported.
pub const FLAG_SEND_FUA: u16 = 1 << 3;
/// Transmission flag: the export behaves like a rotational disk.
pub const FLAG_ROTATIONAL: u16 = 1 << 4;
/// Transmission flag: `CMD_TRIM` is supported.
pub const FLAG_SEND_TRIM: u16 = 1 << 5;
/// Transmission flag: `CMD_WRITE_ZEROES` (and `NO_HOLE`) is supported.
pub const FLAG_SEND_WRITE_ZEROES: u16 = 1 << 6;
/// Transmission flag: `CMD_FLAG_DF` is supported on reads.
pub const FLAG_SEND_DF: u16 = 1 << 7;
/// Transmission flag: several connections share one cache.
pub const FLAG_CAN_MULTI_CONN: u16 = 1 << 8;
/// Transmission flag: `CMD_RESIZE` (experimental, never advertised here).
pub const FLAG_SEND_RESIZE: u16 = 1 << 9;
/// Transmission flag: `CMD_CACHE` is supported.
pub const FLAG_SEND_CACHE: u16 = 1 << 10;
/// Transmission flag: `CMD_FLAG_FAST_ZERO` is supported.
pub const FLAG_SEND_FAST_ZERO: u16 = 1 << 11;
/// Transmission flag: block status accepts a payload that names the contexts to answer for.
pub const FLAG_BLOCK_STATUS_PAYLOAD: u16 = 1 << 12;

/// Option: choose an export and enter transmission (no error path).
pub const OPT_EXPORT_NAME: u32 = 1;
/// Option: abort negotiation.
pub const OPT_ABORT: u32 = 2;
/// Option: list exports.
pub const OPT_LIST: u32 = 3;
/// Option: withdrawn `PEEK_EXPORT`.
pub const OPT_PEEK_EXPORT: u32 = 4;
/// Option: upgrade to TLS.
pub const OPT_STARTTLS: u32 = 5;
/// Option: describe an export.
pub const OPT_INFO: u32 = 6;
/// Option: describe an export and enter transmission.
pub const OPT_GO: u32 = 7;
/// Option: enable structured replies.
pub const OPT_STRUCTURED_REPLY: u32 = 8;
/// Option: list metadata contexts.
pub const OPT_LIST_META_CONTEXT: u32 = 9;
/// Option: select metadata contexts.
pub const OPT_SET_META_CONTEXT: u32 = 10;
/// Option: enable extended headers.
pub const OPT_EXTENDED_HEADERS: u32 = 11;

/// Option reply: success / end of a list.
pub const REP_ACK: u32 = 1;
/// Option reply: one export of `OPT_LIST`.
pub const REP_SERVER: u32 = 2;
/// Option reply: one information item of `OPT_INFO`/`OPT_GO`.
pub const REP_INFO: u32 = 3;
/// Option reply: one metadata context.
pub const REP_META_CONTEXT: u32 = 4;
/// Bit set in every error option reply.
pub const REP_FLAG_ERROR: u32 = 1 << 31;
/// Option error: unknown option.
pub const REP_ERR_UNSUP: u32 = REP_FLAG_ERROR | 1;
/// Option error: forbidden by policy.
pub const REP_ERR_POLICY: u32 = REP_FLAG_ERROR | 2;
/// Option error: syntactically or semantically invalid.
pub const REP_ERR_INVALID: u32 = REP_FLAG_ERROR | 3;
/// Option error: not supported on this platform.
pub const REP_ERR_PLATFORM: u32 = REP_FLAG_ERROR | 4;
/// Option error: TLS required.
pub const REP_ERR_TLS_REQD: u32 = REP_FLAG_ERROR | 5;
/// Option error: unknown export.
pub const REP_ERR_UNKNOWN: u32 = REP_FLAG_ERROR | 6;
/// Option error: the server is shutting down.
pub const REP_ERR_SHUTDOWN: u32 = REP_FLAG_ERROR | 7;
/// Option error: the client must request block sizes first.
pub const REP_ERR_BLOCK_SIZE_REQD: u32 = REP_FLAG_ERROR | 8;
/// Option error: request or reply too large.
pub const REP_ERR_TOO_BIG: u32 = REP_FLAG_ERROR | 9;
/// Option error: extended headers required (or already negotiated).
pub const REP_ERR_EXT_HEADER_REQD: u32 = REP_FLAG_ERROR | 10;

/// Information item: size and transmission flags.
pub const INFO_EXPORT: u16 = 0;
/// Information item: canonical export name.
pub const INFO_NAME: u16 = 1;
/// Information item: human-readable description.
pub const INFO_DESCRIPTION: u16 = 2;
/// Information item: block size constraints.
pub const INFO_BLOCK_SIZE: u16 = 3;

/// Command: read.
pub const CMD_READ: u16 = 0;
/// Command: write.
pub const CMD_WRITE: u16 = 1;
/// Command: disconnect.
pub const CMD_DISC: u16 = 2;
/// Command: flush.
pub const CMD_FLUSH: u16 = 3;
/// Command: trim (discard).
pub const CMD_TRIM: u16 = 4;
/// Command: cache (prefetch).
pub const CMD_CACHE: u16 = 5;
/// Command: write zeroes.
pub const CMD_WRITE_ZEROES: u16 = 6;
/// Command: block status.
pub const CMD_BLOCK_STATUS: u16 = 7;

/// Command flag: force unit access.
pub const CMD_FLAG_FUA: u16 = 1 << 0;
/// Command flag: `WRITE_ZEROES` must not punch a hole.
pub const CMD_FLAG_NO_HOLE: u16 = 1 << 1;
/// Command flag: read reply must have at most one content chunk.
pub const CMD_FLAG_DF: u16 = 1 << 2;
/// Command flag: block status wants one extent per context.
pub const CMD_FLAG_REQ_ONE: u16 = 1 << 3;
/// Command flag: `WRITE_ZEROES` must fail fast if it would be slow.
pub const CMD_FLAG_FAST_ZERO: u16 = 1 << 4;
/// Command flag: the extended-header length is a payload length.
pub const CMD_FLAG_PAYLOAD_LEN: u16 = 1 << 5;

/// Structured reply flag: last chunk of a reply.
pub const REPLY_FLAG_DONE: u16 = 1 << 0;

/// Chunk type: no payload, ends a reply.
pub const REPLY_TYPE_NONE: u16 = 0;
/// Chunk type: data at an offset.
pub const REPLY_TYPE_OFFSET_DATA: u16 = 1;
/// Chunk type: a run of zeroes at an offset.
pub const REPLY_TYPE_OFFSET_HOLE: u16 = 2;
/// Chunk type: compact block status descriptors.
pub const REPLY_TYPE_BLOCK_STATUS: u16 = 5;
/// Chunk type: 64-bit block status descriptors (extended headers).
pub const REPLY_TYPE_BLOCK_STATUS_EXT: u16 = 6;
/// Bit set in every error chunk type.
pub const REPLY_TYPE_FLAG_ERROR: u16 = 1 << 15;
/// Chunk type: an error.
pub const REPLY_TYPE_ERROR: u16 = REPLY_TYPE_FLAG_ERROR | 1;
/// Chunk type: an error at an offset.
pub const REPLY_TYPE_ERROR_OFFSET: u16 = REPLY_TYPE_FLAG_ERROR | 2;

/// `base:allocation` status bit: the extent is a hole.
pub const STATE_HOLE: u32 = 1 << 0;
/// `base:allocation` status bit: the extent reads as zeroes.
pub const STATE_ZERO: u32 = 1 << 1;

/// Longest string (export name, query, message) the spec allows.
pub const MAX_STRING_LEN: usize = 4096;
/// Largest payload we advertise and accept: 32 MiB, the spec's interoperable maximum.
pub const MAX_PAYLOAD: u32 = 32 * 1024 * 1024;
/// Spec limit on descriptors in one block status chunk.
pub const MAX_EXTENTS_PER_CHUNK: usize = 1 << 20;

/// Name of the `base:allocation` metadata context.
pub const BASE_ALLOCATION: &str = "base:allocation";
/// Name of the `qemu:allocation-depth` metadata context.
pub const ALLOCATION_DEPTH: &str = "qemu:allocation-depth";
/// What a `qemu:dirty-bitmap` metadata context's name starts with.
pub const DIRTY_BITMAP_PREFIX: &str = "qemu:dirty-bitmap:";
