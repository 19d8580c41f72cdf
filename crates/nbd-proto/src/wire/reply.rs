//! Transmission replies: simple replies, structured and extended chunk headers, and the
//! payloads of data, hole, error and block status chunks.

use super::consts::*;
use super::{Cursor, WireError};

/// Length of a simple reply header.
pub const SIMPLE_REPLY_LEN: usize = 16;
/// Length of a structured chunk header.
pub const STRUCTURED_HEADER_LEN: usize = 20;
/// Length of an extended chunk header.
pub const EXTENDED_HEADER_LEN: usize = 32;
/// Length of an `OFFSET_HOLE` payload.
pub const OFFSET_HOLE_LEN: usize = 12;

/// A simple reply header (read data, if any, follows it).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SimpleReply {
    /// NBD error value, zero on success.
    pub error: u32,
    /// Cookie of the request.
    pub cookie: u64,
}

impl SimpleReply {
    /// Encodes the header.
    pub fn encode(&self) -> [u8; SIMPLE_REPLY_LEN] {
        let mut out = [0u8; SIMPLE_REPLY_LEN];
        out[..4].copy_from_slice(&SIMPLE_REPLY_MAGIC.to_be_bytes());
        out[4..8].copy_from_slice(&self.error.to_be_bytes());
        out[8..].copy_from_slice(&self.cookie.to_be_bytes());
        out
    }

    /// Decodes the header.
    pub fn decode(bytes: &[u8]) -> Result<Self, WireError> {
        let mut c = Cursor::new("simple reply", bytes);
        c.magic32(SIMPLE_REPLY_MAGIC)?;
        let error = c.u32("error")?;
        let cookie = c.u64("cookie")?;
        c.finish()?;
        Ok(Self { error, cookie })
    }
}

/// A structured or extended reply chunk header.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ChunkHeader {
    /// Reply flags (`REPLY_FLAG_DONE`).
    pub flags: u16,
    /// Chunk type (`REPLY_TYPE_*`).
    pub reply_type: u16,
    /// Cookie of the request.
    pub cookie: u64,
    /// Offset of the request (extended headers only; zero for structured chunks).
    pub offset: u64,
    /// Payload length.
    pub length: u64,
}

impl ChunkHeader {
    /// True if this chunk ends its reply.
    pub fn is_done(&self) -> bool {
        self.flags & REPLY_FLAG_DONE != 0
    }

    /// True for error chunk types.
    pub fn is_error(&self) -> bool {
        self.reply_type & REPLY_TYPE_FLAG_ERROR != 0
    }

    /// Encodes a structured header; `None` if the length does not fit in 32 bits.
    pub fn encode_structured(&self) -> Option<[u8; STRUCTURED_HEADER_LEN]> {
        let length = u32::try_from(self.length).ok()?;
        let mut out = [0u8; STRUCTURED_HEADER_LEN];
        out[..4].copy_from_slice(&STRUCTURED_REPLY_MAGIC.to_be_bytes());
        out[4..6].copy_from_slice(&self.flags.to_be_bytes());
        out[6..8].copy_from_slice(&self.reply_type.to_be_bytes());
        out[8..16].copy_from_slice(&self.cookie.to_be_bytes());
        out[16..].copy_from_slice(&length.to_be_bytes());
        Some(out)
    }

    /// Encodes an extended header.
    pub fn encode_extended(&self) -> [u8; EXTENDED_HEADER_LEN] {
        let mut out = [0u8; EXTENDED_HEADER_LEN];
        out[..4].copy_from_slice(&EXTENDED_REPLY_MAGIC.to_be_bytes());
        out[4..6].copy_from_slice(&self.flags.to_be_bytes());
        out[6..8].copy_from_slice(&self.reply_type.to_be_bytes());
        out[8..16].copy_from_slice(&self.cookie.to_be_bytes());
        out[16..24].copy_from_slice(&self.offset.to_be_bytes());
        out[24..].copy_from_slice(&self.length.to_be_bytes());
        out
    }

    /// Decodes a structured header (20 bytes).
    pub fn decode_structured(bytes: &[u8]) -> Result<Self, WireError> {
        let mut c = Cursor::new("structured reply chunk", bytes);
        c.magic32(STRUCTURED_REPLY_MAGIC)?;
        let flags = c.u16("flags")?;
        let reply_type = c.u16("type")?;
        let cookie = c.u64("cookie")?;
        let length = c.u32("length")?.into();
        c.finish()?;
        Ok(Self {
            flags,
            reply_type,
            cookie,
            offset: 0,
            length,
        })
    }

    /// Decodes an extended header (32 bytes).
    pub fn decode_extended(bytes: &[u8]) -> Result<Self, WireError> {
        let mut c = Cursor::new("extended reply chunk", bytes);
        c.magic32(EXTENDED_REPLY_MAGIC)?;
        let flags = c.u16("flags")?;
        let reply_type = c.u16("type")?;
        let cookie = c.u64("cookie")?;
        let offset = c.u64("offset")?;
        let length = c.u64("length")?;
        c.finish()?;
        Ok(Self {
            flags,
            reply_type,
            cookie,
            offset,
            length,
        })
    }
}

/// Decodes an `OFFSET_DATA` payload into its offset and data (at least one byte).
pub fn decode_offset_data(payload: &[u8]) -> Result<(u64, &[u8]), WireError> {
    let mut c = Cursor::new("OFFSET_DATA chunk", payload);
    let offset = c.u64("offset")?;
    let data = c.rest();
    if data.is_empty() {
        return Err(c.invalid_at("data", 8, 0, "data chunk must carry at least one byte"));
    }
    Ok((offset, data))
}

/// The 8-byte prefix of an `OFFSET_DATA` payload.
pub fn encode_offset_data_prefix(offset: u64) -> [u8; 8] {
    offset.to_be_bytes()
}

/// An `OFFSET_HOLE` payload.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct OffsetHole {
    /// Offset of the hole.
    pub offset: u64,
    /// Hole length (nonzero).
    pub size: u32,
}

impl OffsetHole {
    /// Encodes the payload.
    pub fn encode(&self) -> [u8; OFFSET_HOLE_LEN] {
        let mut out = [0u8; OFFSET_HOLE_LEN];
        out[..8].copy_from_slice(&self.offset.to_be_bytes());
        out[8..].copy_from_slice(&self.size.to_be_bytes());
        out
    }

    /// Decodes the payload.
    pub fn decode(payload: &[u8]) -> Result<Self, WireError> {
        let mut c = Cursor::new("OFFSET_HOLE chunk", payload);
        let offset = c.u64("offset")?;
        let size = c.u32("hole size")?;
        c.finish()?;
        if size == 0 {
            return Err(c.invalid_at("hole size", 8, 0, "must be nonzero"));
        }
        Ok(Self { offset, size })
    }
}

/// An `ERROR` or `ERROR_OFFSET` payload.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ErrorChunk<'a> {
    /// NBD error value (nonzero).
    pub error: u32,
    /// Human-readable message (at most 4096 bytes).
    pub message: &'a [u8],
    /// Offset of the error, for `ERROR_OFFSET`.
    pub offset: Option<u64>,
}

impl<'a> ErrorChunk<'a> {
    /// The chunk type this payload goes with.
    pub fn reply_type(&self) -> u16 {
        if self.offset.is_some() {
            REPLY_TYPE_ERROR_OFFSET
        } else {
            REPLY_TYPE_ERROR
        }
    }

    /// Encodes the payload; the message is cut to the 4096-byte string limit.
    pub fn encode(&self) -> Vec<u8> {
        let message = self.message.get(..MAX_STRING_LEN).unwrap_or(self.message);
        let mut out = Vec::with_capacity(14 + message.len());
        out.extend_from_slice(&self.error.to_be_bytes());
        let len = u16::try_from(message.len()).unwrap_or(0);
        out.extend_from_slice(&len.to_be_bytes());
        out.extend_from_slice(message.get(..usize::from(len)).unwrap_or_default());
        if let Some(offset) = self.offset {
            out.extend_from_slice(&offset.to_be_bytes());
        }
        out
    }

    /// Decodes the payload of a chunk of type `reply_type` (any type with bit 15 set; the
    /// fields after the message are only interpreted for `ERROR_OFFSET`).
    pub fn decode(reply_type: u16, payload: &'a [u8]) -> Result<Self, WireError> {
        let mut c = Cursor::new("error chunk", payload);
        if reply_type & REPLY_TYPE_FLAG_ERROR == 0 {
            return Err(c.invalid_at("type", 0, reply_type.into(), "not an error chunk type"));
        }
        let error = c.u32("error")?;
        if error == 0 {
            return Err(c.invalid_at("error", 0, 0, "error chunk must carry a nonzero error"));
        }
        let len = c.u16("message length")?;
        let message = c.take("message", usize::from(len))?;
        let offset = if reply_type == REPLY_TYPE_ERROR_OFFSET {
            let offset = c.u64("offset")?;
            c.finish()?;
            Some(offset)
        } else {
            if reply_type == REPLY_TYPE_ERROR {
                c.finish()?;
            }
            None
        };
        Ok(Self {
            error,
            message,
            offset,
        })
    }
}

/// One block status descriptor, widened to 64 bits.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Descriptor {
    /// Extent length (nonzero).
    pub length: u64,
    /// Status flags defined by the context.
    pub status: u64,
}

/// A `BLOCK_STATUS` or `BLOCK_STATUS_EXT` payload for one metadata context.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BlockStatusChunk {
    /// Metadata context id.
    pub context_id: u32,
    /// Consecutive extents (at least one).
    pub descriptors: Vec<Descriptor>,
}

impl BlockStatusChunk {
    /// Encodes a compact payload; `None` if empty or a field does not fit in 32 bits.
    pub fn encode_compact(&self) -> Option<Vec<u8>> {
        if self.descriptors.is_empty() {
            return None;
        }
        let mut out = Vec::with_capacity(4 + 8 * self.descriptors.len());
        out.extend_from_slice(&self.context_id.to_be_bytes());
        for d in &self.descriptors {
            out.extend_from_slice(&u32::try_from(d.length).ok()?.to_be_bytes());
            out.extend_from_slice(&u32::try_from(d.status).ok()?.to_be_bytes());
        }
        Some(out)
    }

    /// Encodes an extended payload; `None` if empty or the count does not fit in 32 bits.
    pub fn encode_extended(&self) -> Option<Vec<u8>> {
        if self.descriptors.is_empty() {
            return None;
        }
        let count = u32::try_from(self.descriptors.len()).ok()?;
        let mut out = Vec::with_capacity(8 + 16 * self.descriptors.len());
        out.extend_from_slice(&self.context_id.to_be_bytes());
        out.extend_from_slice(&count.to_be_bytes());
        for d in &self.descriptors {
            out.extend_from_slice(&d.length.to_be_bytes());
            out.extend_from_slice(&d.status.to_be_bytes());
        }
        Some(out)
    }

    /// Decodes a compact payload (`4 + 8n` bytes, `n >= 1`, nonzero lengths).
    pub fn decode_compact(payload: &[u8]) -> Result<Self, WireError> {
        let mut c = Cursor::new("BLOCK_STATUS chunk", payload);
        let context_id = c.u32("context id")?;
        if c.remaining() == 0 || c.remaining() % 8 != 0 {
            return Err(c.invalid_at(
                "descriptors",
                4,
                c.remaining() as u64,
                "length must be 4 + a positive multiple of 8",
            ));
        }
        let mut descriptors = Vec::with_capacity(c.remaining() / 8);
        while c.remaining() > 0 {
            let at = c.pos();
            let length = c.u32("extent length")?;
            if length == 0 {
                return Err(c.invalid_at("extent length", at, 0, "must be nonzero"));
            }
            let status = c.u32("status flags")?;
            descriptors.push(Descriptor {
                length: length.into(),
                status: status.into(),
            });
        }
        Ok(Self {
            context_id,
            descriptors,
        })
    }

    /// Decodes an extended payload (`8 + 16n` bytes, `n` = descriptor count >= 1).
    pub fn decode_extended(payload: &[u8]) -> Result<Self, WireError> {
        let mut c = Cursor::new("BLOCK_STATUS_EXT chunk", payload);
        let context_id = c.u32("context id")?;
        let count = c.u32("descriptor count")?;
        let count = usize::try_from(count).unwrap_or(usize::MAX);
        if count == 0 || c.remaining() / 16 != count || c.remaining() % 16 != 0 {
            return Err(c.invalid_at(
                "descriptor count",
                4,
                count as u64,
                "must be nonzero and match the payload length",
            ));
        }
        let mut descriptors = Vec::with_capacity(count);
        for _ in 0..count {
            let at = c.pos();
            let length = c.u64("extent length")?;
            if length == 0 {
                return Err(c.invalid_at("extent length", at, 0, "must be nonzero"));
            }
            let status = c.u64("status flags")?;
            descriptors.push(Descriptor { length, status });
        }
        c.finish()?;
        Ok(Self {
            context_id,
            descriptors,
        })
    }
}
