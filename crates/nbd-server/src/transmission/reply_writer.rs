//! Serializing one request's complete reply (simple, structured or extended) into header
//! bytes plus borrowed data slices, and writing it with vectored I/O so read data goes from
//! the export's buffers to the socket without a copy.

use std::io::IoSlice;
use std::ops::Range;

use tokio::io::{AsyncWrite, AsyncWriteExt};

use nbd_proto::errno::Errno;
use nbd_proto::wire::consts::*;
use nbd_proto::wire::reply::{BlockStatusChunk, ChunkHeader, ErrorChunk, OffsetHole, SimpleReply};

use crate::export::ReadChunk;
use crate::negotiate::Mode;

/// The result of one request, before serialization.
#[derive(Debug)]
pub enum Outcome<B> {
    /// Success without payload.
    Done,
    /// Failure.
    Error(Errno, &'static str),
    /// Read data covering the request (`offset` is the request offset).
    Read {
        /// Offset of the request.
        offset: u64,
        /// Data and holes, in order.
        chunks: Vec<ReadChunk<B>>,
        /// Send a single content chunk.
        df: bool,
    },
    /// One status chunk per selected metadata context.
    Status(Vec<BlockStatusChunk>),
}

impl<B: AsRef<[u8]>> Outcome<B> {
    /// Bytes of read data this reply carries (holes and headers not counted).
    pub fn payload_len(&self) -> usize {
        match self {
            Outcome::Read { chunks, .. } => chunks
                .iter()
                .map(|c| match c {
                    ReadChunk::Data(b) => b.as_ref().len(),
                    ReadChunk::Hole(_) => 0,
                })
                .sum(),
            Outcome::Done | Outcome::Error(..) | Outcome::Status(_) => 0,
        }
    }
}

/// A part of a serialized reply.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Part<'a> {
    /// Bytes of the header arena.
    Head(Range<usize>),
    /// Borrowed data.
    Data(&'a [u8]),
    /// This many zero bytes.
    Zeros(usize),
}

/// A serialized reply: headers in one arena, data borrowed from the outcome.
#[derive(Debug, Default)]
pub struct Serialized<'a> {
    head: Vec<u8>,
    parts: Vec<Part<'a>>,
}

static ZEROS: [u8; 64 * 1024] = [0; 64 * 1024];

/// Caps on the iovec count of one `writev` (Linux `IOV_MAX`).
const MAX_IOV: usize = 1024;

impl<'a> Serialized<'a> {
    fn push_head(&mut self, bytes: &[u8]) {
        let start = self.head.len();
        self.head.extend_from_slice(bytes);
        let end = self.head.len();
        match self.parts.last_mut() {
            Some(Part::Head(r)) if r.end == start => r.end = end,
            _ => self.parts.push(Part::Head(start..end)),
        }
    }

    fn push_data(&mut self, data: &'a [u8]) {
        if !data.is_empty() {
            self.parts.push(Part::Data(data));
        }
    }

    fn push_zeros(&mut self, n: usize) {
        if n > 0 {
            self.parts.push(Part::Zeros(n));
        }
    }

    /// Total bytes.
    pub fn len(&self) -> usize {
        self.parts
            .iter()
            .map(|p| match p {
                Part::Head(r) => r.len(),
                Part::Data(d) => d.len(),
                Part::Zeros(n) => *n,
            })
            .sum()
    }

    /// True if nothing is to be sent.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The reply as one byte vector (for tests and small replies).
    pub fn to_bytes(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(self.len());
        for s in self.slices() {
            out.extend_from_slice(&s);
        }
        out
    }

    fn slices(&self) -> Vec<IoSlice<'_>> {
        let mut out = Vec::with_capacity(self.parts.len() + 1);
        for p in &self.parts {
            match p {
                Part::Head(r) => {
                    out.push(IoSlice::new(self.head.get(r.clone()).unwrap_or_default()))
                }
                Part::Data(d) => out.push(IoSlice::new(d)),
                Part::Zeros(n) => {
                    let mut left = *n;
                    while left > 0 {
                        let take = left.min(ZEROS.len());
                        out.push(IoSlice::new(&ZEROS[..take]));
                        left -= take;
                    }
                }
            }
        }
        out
    }

    /// Writes the whole reply and flushes.
    pub async fn write_to<W: AsyncWrite + Unpin>(&self, w: &mut W) -> std::io::Result<()> {
        let mut slices = self.slices();
        let mut rest: &mut [IoSlice<'_>] = &mut slices;
        while !rest.is_empty() {
            let window = rest.len().min(MAX_IOV);
            let n = w.write_vectored(&rest[..window]).await?;
            if n == 0 {
                return Err(std::io::ErrorKind::WriteZero.into());
            }
            IoSlice::advance_slices(&mut rest, n);
        }
        w.flush().await
    }
}

/// Where a reply goes: the reply mode and the request it answers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ReplyTo {
    /// Reply mode.
    pub mode: Mode,
    /// Cookie of the request.
    pub cookie: u64,
    /// Offset of the request (echoed in extended headers).
    pub offset: u64,
    /// The request was a READ (which never gets a simple reply once structured).
    pub is_read: bool,
}

impl ReplyTo {
    fn chunk(&self, out: &mut Serialized<'_>, flags: u16, reply_type: u16, length: u64) {
        let h = ChunkHeader {
            flags,
            reply_type,
            cookie: self.cookie,
            offset: self.offset,
            length,
        };
        match self.mode {
            Mode::Extended => out.push_head(&h.encode_extended()),
            // Payloads are bounded by 32 MiB + 8 and 8 MiB status chunks, far below 4 GiB.
            _ => out.push_head(&h.encode_structured().unwrap_or_default()),
        }
    }

    fn simple(&self, out: &mut Serialized<'_>, error: u32) {
        out.push_head(
            &SimpleReply {
                error,
                cookie: self.cookie,
            }
            .encode(),
        );
    }

    fn error_chunk(&self, out: &mut Serialized<'_>, errno: Errno, message: &str) {
        let payload = ErrorChunk {
            error: errno.code(),
            message: message.as_bytes(),
            offset: None,
        }
        .encode();
        self.chunk(out, REPLY_FLAG_DONE, REPLY_TYPE_ERROR, payload.len() as u64);
        out.push_head(&payload);
    }
}

/// Serializes `outcome` as the reply to `to`.
pub fn serialize<'a, B: AsRef<[u8]>>(to: &ReplyTo, outcome: &'a Outcome<B>) -> Serialized<'a> {
    let mut out = Serialized::default();
    out.append(to, outcome);
    out
}

impl<'a> Serialized<'a> {
    /// Adds `outcome`, the reply to `to`, after the replies already here: replies that
    /// complete together go out in one `writev`.
    pub fn append<B: AsRef<[u8]>>(&mut self, to: &ReplyTo, outcome: &'a Outcome<B>) {
        let out = self;
        match (to.mode, outcome) {
            (Mode::Simple, Outcome::Done) => to.simple(out, 0),
            (Mode::Simple, Outcome::Error(e, _)) => to.simple(out, e.code()),
            (Mode::Simple, Outcome::Read { chunks, .. }) => {
                to.simple(out, 0);
                for c in chunks {
                    match c {
                        ReadChunk::Data(b) => out.push_data(b.as_ref()),
                        ReadChunk::Hole(n) => out.push_zeros(*n),
                    }
                }
            }
            // Validation refuses block status without structured replies; never send chunks.
            (Mode::Simple, Outcome::Status(_)) => to.simple(out, Errno::Inval.code()),
            (Mode::Structured, Outcome::Done) if !to.is_read => to.simple(out, 0),
            (_, Outcome::Done) => to.chunk(out, REPLY_FLAG_DONE, REPLY_TYPE_NONE, 0),
            (_, Outcome::Error(e, msg)) => to.error_chunk(out, *e, msg),
            (_, Outcome::Read { offset, chunks, df }) => read_chunks(to, out, *offset, chunks, *df),
            (_, Outcome::Status(chunks)) => status_chunks(to, out, chunks),
        }
    }
}

fn read_chunks<'a, B: AsRef<[u8]>>(
    to: &ReplyTo,
    out: &mut Serialized<'a>,
    offset: u64,
    chunks: &'a [ReadChunk<B>],
    df: bool,
) {
    let total: usize = chunks.iter().map(ReadChunk::len).sum();
    if total == 0 {
        to.chunk(out, REPLY_FLAG_DONE, REPLY_TYPE_NONE, 0);
        return;
    }
    if df {
        // One content chunk: holes become explicit zeroes.
        to.chunk(
            out,
            REPLY_FLAG_DONE,
            REPLY_TYPE_OFFSET_DATA,
            8 + total as u64,
        );
        out.push_head(&offset.to_be_bytes());
        for c in chunks {
            match c {
                ReadChunk::Data(b) => out.push_data(b.as_ref()),
                ReadChunk::Hole(n) => out.push_zeros(*n),
            }
        }
        return;
    }
    // Runs of data become one OFFSET_DATA chunk, runs of holes one OFFSET_HOLE chunk.
    let mut pos = offset;
    let mut i = 0;
    let non_empty: Vec<&ReadChunk<B>> = chunks.iter().filter(|c| !c.is_empty()).collect();
    while i < non_empty.len() {
        let is_data = matches!(non_empty[i], ReadChunk::Data(_));
        let mut j = i;
        let mut run = 0usize;
        while j < non_empty.len() && matches!(non_empty[j], ReadChunk::Data(_)) == is_data {
            run += non_empty[j].len();
            j += 1;
        }
        let flags = if j == non_empty.len() {
            REPLY_FLAG_DONE
        } else {
            0
        };
        if is_data {
            to.chunk(out, flags, REPLY_TYPE_OFFSET_DATA, 8 + run as u64);
            out.push_head(&pos.to_be_bytes());
            for c in &non_empty[i..j] {
                if let ReadChunk::Data(b) = c {
                    out.push_data(b.as_ref());
                }
            }
        } else {
            let hole = OffsetHole {
                offset: pos,
                size: u32::try_from(run).unwrap_or(u32::MAX),
            };
            to.chunk(
                out,
                flags,
                REPLY_TYPE_OFFSET_HOLE,
                hole.encode().len() as u64,
            );
            out.push_head(&hole.encode());
        }
        pos += run as u64;
        i = j;
    }
}

fn status_chunks(to: &ReplyTo, out: &mut Serialized<'_>, chunks: &[BlockStatusChunk]) {
    let (reply_type, extended) = match to.mode {
        Mode::Extended => (REPLY_TYPE_BLOCK_STATUS_EXT, true),
        _ => (REPLY_TYPE_BLOCK_STATUS, false),
    };
    let payloads: Vec<Vec<u8>> = chunks
        .iter()
        .filter_map(|c| {
            if extended {
                c.encode_extended()
            } else {
                c.encode_compact()
            }
        })
        .collect();
    if payloads.is_empty() {
        to.error_chunk(out, Errno::Io, "no extent to report");
        return;
    }
    let last = payloads.len() - 1;
    for (i, p) in payloads.iter().enumerate() {
        let flags = if i == last { REPLY_FLAG_DONE } else { 0 };
        to.chunk(out, flags, reply_type, p.len() as u64);
        out.push_head(p);
    }
}

#[cfg(test)]
#[path = "reply_writer_tests.rs"]
mod tests;
