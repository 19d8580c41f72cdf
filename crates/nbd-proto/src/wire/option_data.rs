//! Option payloads and option reply payloads: `OPT_INFO`/`OPT_GO` requests, metadata context
//! requests, `REP_INFO` items, `REP_SERVER` entries and `REP_META_CONTEXT` entries.

use super::consts::*;
use super::cursor::put_string;
use super::{Cursor, WireError};

/// Data of `OPT_INFO` / `OPT_GO`: an export name and the information items requested.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct InfoRequest<'a> {
    /// Export name (empty selects the default export).
    pub name: &'a [u8],
    /// Requested `INFO_*` items, in client order.
    pub requests: Vec<u16>,
}

impl<'a> InfoRequest<'a> {
    /// Decodes the option data.
    pub fn decode(bytes: &'a [u8]) -> Result<Self, WireError> {
        let mut c = Cursor::new("OPT_GO/OPT_INFO data", bytes);
        let name = c.string("export name", MAX_STRING_LEN)?;
        let at = c.pos();
        let count = c.u16("number of information requests")?;
        let count = usize::from(count);
        if c.remaining() != count * 2 {
            return Err(c.invalid_at(
                "number of information requests",
                at,
                count as u64,
                "does not match the option length",
            ));
        }
        let mut requests = Vec::with_capacity(count);
        for _ in 0..count {
            requests.push(c.u16("information request")?);
        }
        c.finish()?;
        Ok(Self { name, requests })
    }

    /// Encodes the option data.
    pub fn encode(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(6 + self.name.len() + 2 * self.requests.len());
        put_string(&mut out, self.name);
        let count = u16::try_from(self.requests.len()).unwrap_or(u16::MAX);
        out.extend_from_slice(&count.to_be_bytes());
        for r in self.requests.iter().take(usize::from(count)) {
            out.extend_from_slice(&r.to_be_bytes());
        }
        out
    }
}

/// Data of `OPT_LIST_META_CONTEXT` / `OPT_SET_META_CONTEXT`: an export name and queries.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MetaContextRequest<'a> {
    /// Export the contexts are for.
    pub name: &'a [u8],
    /// Query strings (each starts with a namespace and a colon).
    pub queries: Vec<&'a [u8]>,
}

impl<'a> MetaContextRequest<'a> {
    /// Decodes the option data.
    pub fn decode(bytes: &'a [u8]) -> Result<Self, WireError> {
        let mut c = Cursor::new("meta context option data", bytes);
        let name = c.string("export name", MAX_STRING_LEN)?;
        let at = c.pos();
        let count = c.u32("number of queries")?;
        // Each query needs at least its 4-byte length: bound the count before allocating.
        let count = usize::try_from(count).unwrap_or(usize::MAX);
        if count > c.remaining() / 4 {
            return Err(c.invalid_at(
                "number of queries",
                at,
                count as u64,
                "more queries than the option data can hold",
            ));
        }
        let mut queries = Vec::with_capacity(count);
        for _ in 0..count {
            queries.push(c.string("query", MAX_STRING_LEN)?);
        }
        c.finish()?;
        Ok(Self { name, queries })
    }

    /// Encodes the option data.
    pub fn encode(&self) -> Vec<u8> {
        let mut out = Vec::new();
        put_string(&mut out, self.name);
        let count = u32::try_from(self.queries.len()).unwrap_or(u32::MAX);
        out.extend_from_slice(&count.to_be_bytes());
        for q in &self.queries {
            put_string(&mut out, q);
        }
        out
    }
}

/// One `REP_INFO` payload.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum InfoReply<'a> {
    /// `INFO_EXPORT`: size and transmission flags.
    Export {
        /// Export size in bytes.
        size: u64,
        /// Transmission flags.
        flags: u16,
    },
    /// `INFO_NAME`: canonical export name.
    Name(&'a [u8]),
    /// `INFO_DESCRIPTION`: human-readable description.
    Description(&'a [u8]),
    /// `INFO_BLOCK_SIZE`: size constraints.
    BlockSize {
        /// Minimum block size.
        minimum: u32,
        /// Preferred block size.
        preferred: u32,
        /// Maximum payload size.
        maximum: u32,
    },
    /// An information type this crate does not know.
    Unknown {
        /// Information type.
        kind: u16,
        /// Raw payload after the type.
        data: &'a [u8],
    },
}

impl<'a> InfoReply<'a> {
    /// Encodes the `REP_INFO` data (type then payload).
    pub fn encode(&self) -> Vec<u8> {
        let mut out = Vec::new();
        match self {
            Self::Export { size, flags } => {
                out.extend_from_slice(&INFO_EXPORT.to_be_bytes());
                out.extend_from_slice(&size.to_be_bytes());
                out.extend_from_slice(&flags.to_be_bytes());
            }
            Self::Name(name) => {
                out.extend_from_slice(&INFO_NAME.to_be_bytes());
                out.extend_from_slice(name);
            }
            Self::Description(text) => {
                out.extend_from_slice(&INFO_DESCRIPTION.to_be_bytes());
                out.extend_from_slice(text);
            }
            Self::BlockSize {
                minimum,
                preferred,
                maximum,
            } => {
                out.extend_from_slice(&INFO_BLOCK_SIZE.to_be_bytes());
                out.extend_from_slice(&minimum.to_be_bytes());
                out.extend_from_slice(&preferred.to_be_bytes());
                out.extend_from_slice(&maximum.to_be_bytes());
            }
            Self::Unknown { kind, data } => {
                out.extend_from_slice(&kind.to_be_bytes());
                out.extend_from_slice(data);
            }
        }
        out
    }

    /// Decodes `REP_INFO` data, checking the fixed lengths of known types.
    pub fn decode(bytes: &'a [u8]) -> Result<Self, WireError> {
        let mut c = Cursor::new("REP_INFO data", bytes);
        let kind = c.u16("information type")?;
        let reply = match kind {
            INFO_EXPORT => Self::Export {
                size: c.u64("export size")?,
                flags: c.u16("transmission flags")?,
            },
            INFO_NAME => Self::Name(c.rest()),
            INFO_DESCRIPTION => Self::Description(c.rest()),
            INFO_BLOCK_SIZE => Self::BlockSize {
                minimum: c.u32("minimum block size")?,
                preferred: c.u32("preferred block size")?,
                maximum: c.u32("maximum payload size")?,
            },
            _ => Self::Unknown {
                kind,
                data: c.rest(),
            },
        };
        c.finish()?;
        Ok(reply)
    }
}

/// One `REP_SERVER` payload of `OPT_LIST`: export name and optional details text.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ServerEntry<'a> {
    /// Export name.
    pub name: &'a [u8],
    /// Implementation-specific text (we send the description).
    pub details: &'a [u8],
}

impl<'a> ServerEntry<'a> {
    /// Encodes the reply data.
    pub fn encode(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(4 + self.name.len() + self.details.len());
        put_string(&mut out, self.name);
        out.extend_from_slice(self.details);
        out
    }

    /// Decodes the reply data.
    pub fn decode(bytes: &'a [u8]) -> Result<Self, WireError> {
        let mut c = Cursor::new("REP_SERVER data", bytes);
        let name = c.string("export name", bytes.len())?;
        Ok(Self {
            name,
            details: c.rest(),
        })
    }
}

/// One `REP_META_CONTEXT` payload: context id and name.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MetaContextEntry<'a> {
    /// Context id used in block status replies (zero in list replies).
    pub id: u32,
    /// Context name, e.g. `base:allocation`.
    pub name: &'a [u8],
}

impl<'a> MetaContextEntry<'a> {
    /// Encodes the reply data.
    pub fn encode(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(4 + self.name.len());
        out.extend_from_slice(&self.id.to_be_bytes());
        out.extend_from_slice(self.name);
        out
    }

    /// Decodes the reply data.
    pub fn decode(bytes: &'a [u8]) -> Result<Self, WireError> {
        let mut c = Cursor::new("REP_META_CONTEXT data", bytes);
        let id = c.u32("context id")?;
        Ok(Self { id, name: c.rest() })
    }
}
