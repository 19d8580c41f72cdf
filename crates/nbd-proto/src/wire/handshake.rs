//! Handshake framing: the server greeting, client flags, option headers, option reply
//! headers and the `OPT_EXPORT_NAME` reply.

use super::consts::*;
use super::{Cursor, WireError};

/// Length of the server greeting.
pub const GREETING_LEN: usize = 18;
/// Length of the client flags field.
pub const CLIENT_FLAGS_LEN: usize = 4;
/// Length of a client option header.
pub const OPTION_HEADER_LEN: usize = 16;
/// Length of an option reply header.
pub const OPTION_REPLY_HEADER_LEN: usize = 20;
/// Length of the `OPT_EXPORT_NAME` reply without the zero padding.
pub const EXPORT_NAME_REPLY_LEN: usize = 10;
/// Zero padding after the `OPT_EXPORT_NAME` reply unless `NO_ZEROES` was negotiated.
pub const EXPORT_NAME_PADDING: usize = 124;

/// The newstyle greeting: `NBDMAGIC`, `IHAVEOPT`, handshake flags.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Greeting {
    /// Handshake flags (`FLAG_FIXED_NEWSTYLE`, `FLAG_NO_ZEROES`).
    pub flags: u16,
}

impl Greeting {
    /// Encodes the greeting.
    pub fn encode(&self) -> [u8; GREETING_LEN] {
        let mut out = [0u8; GREETING_LEN];
        out[..8].copy_from_slice(&NBDMAGIC.to_be_bytes());
        out[8..16].copy_from_slice(&IHAVEOPT.to_be_bytes());
        out[16..].copy_from_slice(&self.flags.to_be_bytes());
        out
    }

    /// Decodes a greeting.
    pub fn decode(bytes: &[u8]) -> Result<Self, WireError> {
        let mut c = Cursor::new("greeting", bytes);
        c.magic64(NBDMAGIC)?;
        c.magic64(IHAVEOPT)?;
        let flags = c.u16("handshake flags")?;
        c.finish()?;
        Ok(Self { flags })
    }
}

/// The client's 32-bit flags, validated against what the server advertised.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ClientFlags {
    /// The client speaks fixed newstyle.
    pub fixed_newstyle: bool,
    /// The client wants no padding after `OPT_EXPORT_NAME`.
    pub no_zeroes: bool,
}

impl ClientFlags {
    /// Encodes the flags.
    pub fn encode(&self) -> [u8; CLIENT_FLAGS_LEN] {
        let mut v = 0;
        if self.fixed_newstyle {
            v |= FLAG_C_FIXED_NEWSTYLE;
        }
        if self.no_zeroes {
            v |= FLAG_C_NO_ZEROES;
        }
        u32::to_be_bytes(v)
    }

    /// Decodes the flags; unknown bits, or bits the server did not advertise in
    /// `server_flags`, are an error (the spec requires the server to drop the connection).
    pub fn decode(bytes: &[u8], server_flags: u16) -> Result<Self, WireError> {
        let mut c = Cursor::new("client flags", bytes);
        let v = c.u32("client flags")?;
        c.finish()?;
        let mut allowed = 0;
        if server_flags & FLAG_FIXED_NEWSTYLE != 0 {
            allowed |= FLAG_C_FIXED_NEWSTYLE;
        }
        if server_flags & FLAG_NO_ZEROES != 0 {
            allowed |= FLAG_C_NO_ZEROES;
        }
        if v & !allowed != 0 {
            return Err(c.invalid_at(
                "client flags",
                0,
                v.into(),
                "unknown or unadvertised flag set",
            ));
        }
        Ok(Self {
            fixed_newstyle: v & FLAG_C_FIXED_NEWSTYLE != 0,
            no_zeroes: v & FLAG_C_NO_ZEROES != 0,
        })
    }
}

/// Header of one client option: `IHAVEOPT`, option code, data length.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct OptionHeader {
    /// Option code (`OPT_*`).
    pub option: u32,
    /// Length of the option data that follows.
    pub length: u32,
}

impl OptionHeader {
    /// Encodes the header.
    pub fn encode(&self) -> [u8; OPTION_HEADER_LEN] {
        let mut out = [0u8; OPTION_HEADER_LEN];
        out[..8].copy_from_slice(&IHAVEOPT.to_be_bytes());
        out[8..12].copy_from_slice(&self.option.to_be_bytes());
        out[12..].copy_from_slice(&self.length.to_be_bytes());
        out
    }

    /// Decodes the header.
    pub fn decode(bytes: &[u8]) -> Result<Self, WireError> {
        let mut c = Cursor::new("option header", bytes);
        c.magic64(IHAVEOPT)?;
        let option = c.u32("option")?;
        let length = c.u32("length")?;
        c.finish()?;
        Ok(Self { option, length })
    }
}

/// Header of one option reply: magic, option, reply type, data length.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct OptionReplyHeader {
    /// Option being answered.
    pub option: u32,
    /// Reply type (`REP_*`).
    pub reply_type: u32,
    /// Length of the reply data that follows.
    pub length: u32,
}

impl OptionReplyHeader {
    /// Encodes the header.
    pub fn encode(&self) -> [u8; OPTION_REPLY_HEADER_LEN] {
        let mut out = [0u8; OPTION_REPLY_HEADER_LEN];
        out[..8].copy_from_slice(&OPTION_REPLY_MAGIC.to_be_bytes());
        out[8..12].copy_from_slice(&self.option.to_be_bytes());
        out[12..16].copy_from_slice(&self.reply_type.to_be_bytes());
        out[16..].copy_from_slice(&self.length.to_be_bytes());
        out
    }

    /// Decodes the header.
    pub fn decode(bytes: &[u8]) -> Result<Self, WireError> {
        let mut c = Cursor::new("option reply header", bytes);
        c.magic64(OPTION_REPLY_MAGIC)?;
        let option = c.u32("option")?;
        let reply_type = c.u32("reply type")?;
        let length = c.u32("length")?;
        c.finish()?;
        Ok(Self {
            option,
            reply_type,
            length,
        })
    }

    /// True for error reply types (bit 31 set).
    pub fn is_error(&self) -> bool {
        self.reply_type & REP_FLAG_ERROR != 0
    }
}

/// The reply to `OPT_EXPORT_NAME`: export size and transmission flags.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ExportNameReply {
    /// Export size in bytes.
    pub size: u64,
    /// Transmission flags.
    pub flags: u16,
}

impl ExportNameReply {
    /// Encodes the reply, with the 124 zero bytes unless `no_zeroes`.
    pub fn encode(&self, no_zeroes: bool) -> Vec<u8> {
        let pad = if no_zeroes { 0 } else { EXPORT_NAME_PADDING };
        let mut out = Vec::with_capacity(EXPORT_NAME_REPLY_LEN + pad);
        out.extend_from_slice(&self.size.to_be_bytes());
        out.extend_from_slice(&self.flags.to_be_bytes());
        out.resize(EXPORT_NAME_REPLY_LEN + pad, 0);
        out
    }

    /// Decodes the first 10 bytes (the caller skips any padding).
    pub fn decode(bytes: &[u8]) -> Result<Self, WireError> {
        let mut c = Cursor::new("export name reply", bytes);
        let size = c.u64("size")?;
        let flags = c.u16("transmission flags")?;
        c.finish()?;
        Ok(Self { size, flags })
    }
}
