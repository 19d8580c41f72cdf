//! Request validation as pure functions: how much payload follows a header, and whether a
//! request may run (with the spec's error when it may not).

use crate::errno::Errno;
use crate::export::WriteZeroesFlags;
use crate::negotiate::meta::MetaSelection;
use crate::negotiate::{Mode, Negotiated};
use crate::wire::consts::*;
use crate::wire::request::{Command, RequestHeader};

/// What follows a request header on the wire.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Payload {
    /// Nothing.
    None,
    /// A write payload of this many bytes, to be read into an export buffer.
    Read(usize),
    /// Bytes to read and throw away (a payload we refuse but can skip).
    Drain(u64),
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

/// Checks a request whose payload (per [`payload_of`]) has been dealt with.
pub fn validate(h: &RequestHeader, limits: &Limits, payload: Payload) -> Result<Action, Refusal> {
    let cmd = h.command;
    if cmd == Command::Disc {
        return Ok(Action::Disc);
    }
    if let Command::Unknown(_) = cmd {
        return Err(refuse(Errno::Inval, "unknown command"));
    }
    let advertised = |bit: u16| limits.flags & bit != 0;
    let extended = limits.mode == Mode::Extended;

    let mut allowed = 0u16;
    if advertised(FLAG_SEND_FUA) {
        allowed |= CMD_FLAG_FUA;
    }
    match cmd {
        Command::Read if limits.mode != Mode::Simple => allowed |= CMD_FLAG_DF,
        Command::Write if extended => allowed |= CMD_FLAG_PAYLOAD_LEN,
        Command::WriteZeroes => {
            allowed |= CMD_FLAG_NO_HOLE;
            if advertised(FLAG_SEND_FAST_ZERO) {
                allowed |= CMD_FLAG_FAST_ZERO;
            }
        }
        Command::BlockStatus => allowed |= CMD_FLAG_REQ_ONE,
        _ => {}
    }
    if h.flags & !allowed != 0 {
        return Err(refuse(
            Errno::Inval,
            "command flag not valid for this command",
        ));
    }
    match payload {
        Payload::Drain(_) if cmd == Command::Write => {
            return Err(refuse(
                Errno::Inval,
                "write payload larger than the maximum payload size",
            ))
        }
        Payload::Drain(_) => return Err(refuse(Errno::Inval, "command does not take a payload")),
        Payload::Disconnect => return Err(refuse(Errno::Inval, "payload too large")),
        Payload::None | Payload::Read(_) => {}
    }

    let writes = matches!(cmd, Command::Write | Command::Trim | Command::WriteZeroes);
    if writes && advertised(FLAG_READ_ONLY) {
        return Err(refuse(Errno::Perm, "export is read-only"));
    }
    let supported = match cmd {
        Command::Flush => advertised(FLAG_SEND_FLUSH),
        Command::Trim => advertised(FLAG_SEND_TRIM),
        Command::WriteZeroes => advertised(FLAG_SEND_WRITE_ZEROES),
        Command::Cache => advertised(FLAG_SEND_CACHE),
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
    let fua = h.flags & CMD_FLAG_FUA != 0;
    if cmd == Command::Flush {
        return Ok(Action::Flush);
    }

    let (offset, len) = (h.offset, h.length);
    let in_range = offset <= limits.size && len <= limits.size - offset;
    if !in_range {
        let errno = if matches!(cmd, Command::Write | Command::WriteZeroes) {
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

    match cmd {
        Command::Read => {
            if len > u64::from(limits.max_payload) {
                return Err(refuse(
                    Errno::Inval,
                    "read larger than the maximum payload size",
                ));
            }
            let len = usize::try_from(len).map_err(|_| refuse(Errno::Inval, "read too large"))?;
            Ok(Action::Read {
                offset,
                len,
                df: h.flags & CMD_FLAG_DF != 0,
            })
        }
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
        }),
        Command::Flush | Command::Disc | Command::Unknown(_) => {
            Err(refuse(Errno::Inval, "unexpected command"))
        }
    }
}

#[cfg(test)]
mod tests;
