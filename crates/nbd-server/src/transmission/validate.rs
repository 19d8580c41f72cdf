//! Request validation as pure functions: how much payload follows a header, and whether a
//! request may run (with the spec's error when it may not).

use nbd_proto::errno::Errno;
use nbd_proto::wire::consts::*;
use nbd_proto::wire::request::{Command, RequestHeader};

use crate::export::WriteZeroesFlags;
use crate::negotiate::meta::{MetaContext, MetaSelection, MAX_DIRTY_BITMAPS};
use crate::negotiate::{Mode, Negotiated};

/// What follows a request header on the wire.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Payload {
    /// Nothing.
    None,
    /// A write payload of this many bytes, to be read into an export buffer.
    Read(usize),
    /// Bytes to read and throw away (a payload we refuse but can skip).
    Drain(u64),
    /// A block status payload of this many bytes (see [`status_filter`]).
    Filter(usize),
    /// A payload too large to skip politely: hang up, as the spec recommends.
    Disconnect,
}

/// Decides what payload follows `h`, given the mode and the advertised maximum payload.
pub fn payload_of(h: &RequestHeader, mode: Mode, max_payload: u32) -> Payload {
    let max = u64::from(max_payload);
    let payload_len = match mode {
        // QEMU's client (at least up to 10.0) omits PAYLOAD_LEN on extended writes, and
        // QEMU's server accepts that: a write's length is its payload length either way.
        Mode::Extended if h.flags & CMD_FLAG_PAYLOAD_LEN != 0 || h.command == Command::Write => {
            if h.length > max {
                return Payload::Disconnect;
            }
            if h.command == Command::BlockStatus {
                if let Ok(n @ ..=MAX_STATUS_PAYLOAD) = usize::try_from(h.length) {
                    return Payload::Filter(n);
                }
            }
            h.length
        }
        Mode::Extended => return Payload::None,
        Mode::Simple | Mode::Structured if h.command == Command::Write => h.length,
        Mode::Simple | Mode::Structured => return Payload::None,
    };
    if h.command == Command::Write && payload_len <= max {
        // payload_len <= 32 MiB here, so the conversion cannot fail on any supported target.
        return usize::try_from(payload_len).map_or(Payload::Drain(payload_len), Payload::Read);
    }
    Payload::Drain(payload_len)
}

/// The longest block status payload that can be valid: the effect length and one id for
/// each context an export can offer. Longer ones are drained and refused.
pub const MAX_STATUS_PAYLOAD: usize = 8 + 4 * (2 + MAX_DIRTY_BITMAPS);

/// What a block status payload asks for: the effect length, and the contexts (a subset of
/// those negotiated) to answer for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StatusFilter {
    /// The effect length (the header's length is the payload's).
    pub len: u64,
    /// The contexts to answer for.
    pub meta: MetaSelection,
}

/// Decodes a block status payload (a 64-bit effect length, then 32-bit context ids) against
/// the contexts `negotiated`. `None` when the payload is malformed, empty of ids, names a
/// context that was not negotiated, or names one twice: the request is then refused, as
/// qemu-nbd refuses it.
pub fn status_filter(bytes: &[u8], negotiated: &MetaSelection) -> Option<StatusFilter> {
    let (len, ids) = bytes.split_first_chunk::<8>()?;
    if ids.is_empty() || ids.len() % 4 != 0 {
        return None;
    }
    let mut meta = MetaSelection::default();
    for id in ids.chunks_exact(4) {
        let id = u32::from_be_bytes(id.try_into().ok()?);
        let ctx = MetaContext::from_id(id).filter(|c| negotiated.offers(*c))?;
        if meta.offers(ctx) {
            return None;
        }
        meta.insert(ctx);
    }
    Some(StatusFilter {
        len: u64::from_be_bytes(*len),
        meta,
    })
}

/// Checks a block status request that came with a payload, decoded by [`status_filter`]:
/// as [`validate`] would with the effect length and only the contexts the payload names.
pub fn validate_filtered(
    h: &RequestHeader,
    limits: &Limits,
    filter: Option<StatusFilter>,
) -> Result<Action, Refusal> {
    let Some(filter) = filter else {
        return Err(refuse(
            Errno::Inval,
            "block status payload is malformed or names a context not negotiated",
        ));
    };
    let h = RequestHeader {
        flags: h.flags & !CMD_FLAG_PAYLOAD_LEN,
        length: filter.len,
        ..*h
    };
    let limits = Limits {
        meta: filter.meta,
        ..*limits
    };
    validate(&h, &limits, Payload::None)
}

/// The transmission parameters a request is checked against.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Limits {
    /// Reply mode.
    pub mode: Mode,
    /// Export size.
    pub size: u64,
    /// Transmission flags advertised.
    pub flags: u16,
    /// Minimum block size (alignment).
    pub min_block: u32,
    /// Maximum payload.
    pub max_payload: u32,
    /// Selected metadata contexts.
    pub meta: MetaSelection,
}

impl From<&Negotiated> for Limits {
    fn from(n: &Negotiated) -> Self {
        Self {
            mode: n.mode,
            size: n.size,
            flags: n.flags,
            min_block: n.block_size.minimum,
            max_payload: n.block_size.maximum,
            meta: n.meta,
        }
    }
}

/// A validated request, ready to run against the export.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Action {
    /// Read `len` bytes; `df` asks for a single content chunk.
    Read {
        /// Offset.
        offset: u64,
        /// Length.
        len: usize,
        /// Don't fragment.
        df: bool,
    },
    /// Write the payload.
    Write {
        /// Offset.
        offset: u64,
        /// Force unit access.
        fua: bool,
    },
    /// Flush.
    Flush,
    /// Trim.
    Trim {
        /// Offset.
        offset: u64,
        /// Length.
        len: u64,
        /// Force unit access.
        fua: bool,
    },
    /// Cache.
    Cache {
        /// Offset.
        offset: u64,
        /// Length.
        len: u64,
    },
    /// Write zeroes.
    WriteZeroes {
        /// Offset.
        offset: u64,
        /// Length.
        len: u64,
        /// Flags.
        flags: WriteZeroesFlags,
    },
    /// Block status.
    BlockStatus {
        /// Offset.
        offset: u64,
        /// Length hint.
        len: u64,
        /// At most one extent per context.
        req_one: bool,
        /// The contexts to answer for.
        meta: MetaSelection,
    },
    /// A zero-length write, trim, zero or cache: succeeds without touching the export.
    Nothing,
    /// Disconnect.
    Disc,
}

/// A refused request: the error to send and a message for structured replies.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Refusal {
    /// Error value.
    pub errno: Errno,
    /// Why, for a human.
    pub message: &'static str,
}

fn refuse(errno: Errno, message: &'static str) -> Refusal {
    Refusal { errno, message }
}

impl Limits {
    fn advertised(&self, bit: u16) -> bool {
        self.flags & bit != 0
    }
}

/// Checks a request whose payload (per [`payload_of`]) has been dealt with.
///
/// The first check that fails decides the error, so their order is part of the behaviour:
/// flags, payload, read-only and support, range and alignment, then per-command limits.
pub fn validate(h: &RequestHeader, limits: &Limits, payload: Payload) -> Result<Action, Refusal> {
    let cmd = h.command;
    if cmd == Command::Disc {
        return Ok(Action::Disc);
    }
    if let Command::Unknown(_) = cmd {
        return Err(refuse(Errno::Inval, "unknown command"));
    }
    check_flags(h, limits)?;
    check_payload(cmd, payload)?;
    check_supported(cmd, limits)?;
    if cmd == Command::Flush {
        return Ok(Action::Flush);
    }
    check_range(h, limits)?;
    action(h, limits)
}

/// The command flags `cmd` may carry, given what was advertised and the reply mode.
fn allowed_flags(cmd: Command, limits: &Limits) -> u16 {
    let mut allowed = 0u16;
    if limits.advertised(FLAG_SEND_FUA) {
        allowed |= CMD_FLAG_FUA;
    }
    match cmd {
        Command::Read if limits.mode != Mode::Simple => allowed |= CMD_FLAG_DF,
        Command::Write if limits.mode == Mode::Extended => allowed |= CMD_FLAG_PAYLOAD_LEN,
        Command::WriteZeroes => {
            allowed |= CMD_FLAG_NO_HOLE;
            if limits.advertised(FLAG_SEND_FAST_ZERO) {
                allowed |= CMD_FLAG_FAST_ZERO;
            }
        }
        Command::BlockStatus => allowed |= CMD_FLAG_REQ_ONE,
        _ => {}
    }
    allowed
}

fn check_flags(h: &RequestHeader, limits: &Limits) -> Result<(), Refusal> {
    if h.flags & !allowed_flags(h.command, limits) != 0 {
        return Err(refuse(
            Errno::Inval,
            "command flag not valid for this command",
        ));
    }
    Ok(())
}

/// Refuses a payload the request should not have had (it has been skipped already).
fn check_payload(cmd: Command, payload: Payload) -> Result<(), Refusal> {
    match payload {
        Payload::Drain(_) if cmd == Command::Write => Err(refuse(
            Errno::Inval,
            "write payload larger than the maximum payload size",
        )),
        Payload::Drain(_) => Err(refuse(Errno::Inval, "command does not take a payload")),
        Payload::Disconnect => Err(refuse(Errno::Inval, "payload too large")),
        Payload::None | Payload::Read(_) | Payload::Filter(_) => Ok(()),
    }
}

/// Refuses writes to a read-only export and commands the export did not advertise.
fn check_supported(cmd: Command, limits: &Limits) -> Result<(), Refusal> {
    let writes = matches!(cmd, Command::Write | Command::Trim | Command::WriteZeroes);
    if writes && limits.advertised(FLAG_READ_ONLY) {
        return Err(refuse(Errno::Perm, "export is read-only"));
    }
    let supported = match cmd {
        Command::Flush => limits.advertised(FLAG_SEND_FLUSH),
        Command::Trim => limits.advertised(FLAG_SEND_TRIM),
        Command::WriteZeroes => limits.advertised(FLAG_SEND_WRITE_ZEROES),
        Command::Cache => limits.advertised(FLAG_SEND_CACHE),
        Command::BlockStatus => {
            if limits.mode == Mode::Simple || limits.meta.is_empty() {
                return Err(refuse(Errno::Inval, "no metadata context was negotiated"));
            }
            true
        }
        _ => true,
    };
    if !supported {
        return Err(refuse(Errno::Inval, "command not supported by this export"));
    }
    Ok(())
}

/// Refuses a range that leaves the export or breaks the minimum block size (a range may end
/// unaligned only at the export's end).
fn check_range(h: &RequestHeader, limits: &Limits) -> Result<(), Refusal> {
    let (offset, len) = (h.offset, h.length);
    let in_range = offset <= limits.size && len <= limits.size - offset;
    if !in_range {
        let errno = if matches!(h.command, Command::Write | Command::WriteZeroes) {
            Errno::NoSpc
        } else {
            Errno::Inval
        };
        return Err(refuse(
            errno,
            "request extends beyond the end of the export",
        ));
    }
    let min = u64::from(limits.min_block);
    if min > 1 && (offset % min != 0 || (len % min != 0 && offset + len != limits.size)) {
        return Err(refuse(
            Errno::Inval,
            "request not aligned to the minimum block size",
        ));
    }
    Ok(())
}

/// What to run for a request that passed every check but the per-command ones.
fn action(h: &RequestHeader, limits: &Limits) -> Result<Action, Refusal> {
    let (offset, len) = (h.offset, h.length);
    let fua = h.flags & CMD_FLAG_FUA != 0;
    match h.command {
        Command::Read => read_action(h, limits),
        Command::Write if len == 0 => Ok(Action::Nothing),
        Command::Write => Ok(Action::Write { offset, fua }),
        Command::Trim | Command::WriteZeroes | Command::Cache if len == 0 => Ok(Action::Nothing),
        Command::Trim => Ok(Action::Trim { offset, len, fua }),
        Command::Cache => Ok(Action::Cache { offset, len }),
        Command::WriteZeroes => Ok(Action::WriteZeroes {
            offset,
            len,
            flags: WriteZeroesFlags {
                may_unmap: h.flags & CMD_FLAG_NO_HOLE == 0,
                fast: h.flags & CMD_FLAG_FAST_ZERO != 0,
                fua,
            },
        }),
        Command::BlockStatus if len == 0 => {
            Err(refuse(Errno::Inval, "block status needs a nonzero length"))
        }
        Command::BlockStatus => Ok(Action::BlockStatus {
            offset,
            len,
            req_one: h.flags & CMD_FLAG_REQ_ONE != 0,
            meta: limits.meta,
        }),
        Command::Flush | Command::Disc | Command::Unknown(_) => {
            Err(refuse(Errno::Inval, "unexpected command"))
        }
    }
}

/// A read, which may not ask for more than the maximum payload size.
fn read_action(h: &RequestHeader, limits: &Limits) -> Result<Action, Refusal> {
    if h.length > u64::from(limits.max_payload) {
        return Err(refuse(
            Errno::Inval,
            "read larger than the maximum payload size",
        ));
    }
    let len = usize::try_from(h.length).map_err(|_| refuse(Errno::Inval, "read too large"))?;
    Ok(Action::Read {
        offset: h.offset,
        len,
        df: h.flags & CMD_FLAG_DF != 0,
    })
}

#[cfg(test)]
#[path = "validate_tests.rs"]
mod tests;
