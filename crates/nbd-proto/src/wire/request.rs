//! Transmission requests: the compact 28-byte header and the extended 32-byte header.

use super::consts::*;
use super::{Cursor, WireError};

/// Length of a compact request header.
pub const COMPACT_REQUEST_LEN: usize = 28;
/// Length of an extended request header.
pub const EXTENDED_REQUEST_LEN: usize = 32;

/// A request command, with unknown codes kept so they can be answered with `EINVAL`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Command {
    /// `CMD_READ`.
    Read,
    /// `CMD_WRITE`.
    Write,
    /// `CMD_DISC`.
    Disc,
    /// `CMD_FLUSH`.
    Flush,
    /// `CMD_TRIM`.
    Trim,
    /// `CMD_CACHE`.
    Cache,
    /// `CMD_WRITE_ZEROES`.
    WriteZeroes,
    /// `CMD_BLOCK_STATUS`.
    BlockStatus,
    /// Any other code.
    Unknown(u16),
}

impl Command {
    /// Maps a wire code to a command.
    pub fn from_code(code: u16) -> Self {
        match code {
            CMD_READ => Self::Read,
            CMD_WRITE => Self::Write,
            CMD_DISC => Self::Disc,
            CMD_FLUSH => Self::Flush,
            CMD_TRIM => Self::Trim,
            CMD_CACHE => Self::Cache,
            CMD_WRITE_ZEROES => Self::WriteZeroes,
            CMD_BLOCK_STATUS => Self::BlockStatus,
            other => Self::Unknown(other),
        }
    }

    /// The wire code.
    pub fn code(self) -> u16 {
        match self {
            Self::Read => CMD_READ,
            Self::Write => CMD_WRITE,
            Self::Disc => CMD_DISC,
            Self::Flush => CMD_FLUSH,
            Self::Trim => CMD_TRIM,
            Self::Cache => CMD_CACHE,
            Self::WriteZeroes => CMD_WRITE_ZEROES,
            Self::BlockStatus => CMD_BLOCK_STATUS,
            Self::Unknown(code) => code,
        }
    }

    /// Name for logs and error messages.
    pub fn name(self) -> &'static str {
        match self {
            Self::Read => "READ",
            Self::Write => "WRITE",
            Self::Disc => "DISC",
            Self::Flush => "FLUSH",
            Self::Trim => "TRIM",
            Self::Cache => "CACHE",
            Self::WriteZeroes => "WRITE_ZEROES",
            Self::BlockStatus => "BLOCK_STATUS",
            Self::Unknown(_) => "unknown command",
        }
    }
}

/// One request header, compact or extended (the length is widened to 64 bits).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RequestHeader {
    /// Command flags (`CMD_FLAG_*`).
    pub flags: u16,
    /// Command.
    pub command: Command,
    /// Opaque cookie echoed in the reply.
    pub cookie: u64,
    /// Offset into the export.
    pub offset: u64,
    /// Length: payload length for writes (and `PAYLOAD_LEN` requests), effect length otherwise.
    pub length: u64,
}

impl RequestHeader {
    /// Decodes a compact header (exactly 28 bytes).
    pub fn decode_compact(bytes: &[u8]) -> Result<Self, WireError> {
        let mut c = Cursor::new("request", bytes);
        c.magic32(REQUEST_MAGIC)?;
        let flags = c.u16("command flags")?;
        let command = Command::from_code(c.u16("type")?);
        let cookie = c.u64("cookie")?;
        let offset = c.u64("offset")?;
        let length = c.u32("length")?.into();
        c.finish()?;
        Ok(Self {
            flags,
            command,
            cookie,
            offset,
            length,
        })
    }

    /// Decodes an extended header (exactly 32 bytes).
    pub fn decode_extended(bytes: &[u8]) -> Result<Self, WireError> {
        let mut c = Cursor::new("extended request", bytes);
        c.magic32(EXTENDED_REQUEST_MAGIC)?;
        let flags = c.u16("command flags")?;
        let command = Command::from_code(c.u16("type")?);
        let cookie = c.u64("cookie")?;
        let offset = c.u64("offset")?;
        let length = c.u64("length")?;
        c.finish()?;
        Ok(Self {
            flags,
            command,
            cookie,
            offset,
            length,
        })
    }

    /// Encodes a compact header; `None` if the length does not fit in 32 bits.
    pub fn encode_compact(&self) -> Option<[u8; COMPACT_REQUEST_LEN]> {
        let length = u32::try_from(self.length).ok()?;
        let mut out = [0u8; COMPACT_REQUEST_LEN];
        out[..4].copy_from_slice(&REQUEST_MAGIC.to_be_bytes());
        out[4..6].copy_from_slice(&self.flags.to_be_bytes());
        out[6..8].copy_from_slice(&self.command.code().to_be_bytes());
        out[8..16].copy_from_slice(&self.cookie.to_be_bytes());
        out[16..24].copy_from_slice(&self.offset.to_be_bytes());
        out[24..].copy_from_slice(&length.to_be_bytes());
        Some(out)
    }

    /// Encodes an extended header.
    pub fn encode_extended(&self) -> [u8; EXTENDED_REQUEST_LEN] {
        let mut out = [0u8; EXTENDED_REQUEST_LEN];
        out[..4].copy_from_slice(&EXTENDED_REQUEST_MAGIC.to_be_bytes());
        out[4..6].copy_from_slice(&self.flags.to_be_bytes());
        out[6..8].copy_from_slice(&self.command.code().to_be_bytes());
        out[8..16].copy_from_slice(&self.cookie.to_be_bytes());
        out[16..24].copy_from_slice(&self.offset.to_be_bytes());
        out[24..].copy_from_slice(&self.length.to_be_bytes());
        out
    }
}
