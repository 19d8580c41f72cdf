//! One request on the wire and the whole reply to it: simple or structured, every chunk's
//! length, offset and count checked against the request before anything is read or stored.

use std::collections::BTreeMap;
use std::io::{Read, Write};

use nbd_proto::wire::consts::*;

use crate::error::{proto, ClientError};
use crate::limits::{MAX_CHUNKS, MAX_EXTENTS};
use crate::session::{NbdClient, Status};

/// What the chunks of one structured reply have said so far.
#[derive(Default)]
struct Sofar {
    /// The first error a chunk reported.
    error: Option<u32>,
    /// Bytes of the read that data and hole chunks have filled.
    covered: u64,
    /// The stretches of the read filled so far (start to end, request-relative), adjacent
    /// ones merged. Counting bytes alone is not enough: two chunks over the same bytes would
    /// add up to the request while part of the buffer was never written. At most one entry
    /// per chunk (MAX_CHUNKS), and one in all for a server that sends its chunks in order.
    filled: BTreeMap<u64, u64>,
}

impl Sofar {
    /// Records that `[start, end)` of the read was filled; false if any of it already was.
    fn fill(&mut self, start: u64, end: u64) -> bool {
        if start == end {
            return true;
        }
        let (mut lo, mut hi) = (start, end);
        if let Some((&s, &e)) = self.filled.range(..=start).next_back() {
            if e > start {
                return false;
            }
            if e == start {
                lo = s;
            }
        }
        if let Some((&s, &e)) = self.filled.range(start..).next() {
            if s < end {
                return false;
            }
            if s == end {
                self.filled.remove(&s);
                hi = e;
            }
        }
        self.filled.insert(lo, hi);
        self.covered += end - start;
        true
    }
}

impl<S: Read + Write> NbdClient<S> {
    pub(super) fn send(
        &mut self,
        kind: u16,
        flags: u16,
        offset: u64,
        len: u32,
        data: &[u8],
    ) -> Result<u64, ClientError> {
        let handle = self.next_handle;
        self.next_handle = self.next_handle.wrapping_add(1);
        let mut msg = Vec::with_capacity(28 + data.len());
        msg.extend_from_slice(&REQUEST_MAGIC.to_be_bytes());
        msg.extend_from_slice(&flags.to_be_bytes());
        msg.extend_from_slice(&kind.to_be_bytes());
        msg.extend_from_slice(&handle.to_be_bytes());
        msg.extend_from_slice(&offset.to_be_bytes());
        msg.extend_from_slice(&len.to_be_bytes());
        msg.extend_from_slice(data);
        self.s.write_all(&msg)?;
        self.s.flush()?;
        Ok(handle)
    }

    fn read_exact(&mut self, buf: &mut [u8]) -> Result<(), ClientError> {
        self.s.read_exact(buf)?;
        Ok(())
    }

    /// Reads the whole reply to request `handle`; `read` (the read's buffer and offset)
    /// receives data, `status` receives block status descriptors.
    pub(super) fn reply(
        &mut self,
        handle: u64,
        mut read: Option<(&mut [u8], u64)>,
        mut status: Option<&mut Vec<Status>>,
    ) -> Result<(), ClientError> {
        let mut magic = [0; 4];
        self.read_exact(&mut magic)?;
        match u32::from_be_bytes(magic) {
            SIMPLE_REPLY_MAGIC => {
                let mut h = [0; 12];
                self.read_exact(&mut h)?;
                let errno = u32::from_be_bytes(h[..4].try_into().unwrap_or([0; 4]));
                self.check_handle(handle, &h[4..12])?;
                if errno != 0 {
                    return Err(ClientError::Server { errno });
                }
                if let Some((buf, _)) = read.as_mut() {
                    if self.structured {
                        return Err(proto("simple reply to a read with structured replies"));
                    }
                    self.read_exact(buf)?;
                }
                Ok(())
            }
            STRUCTURED_REPLY_MAGIC if self.structured => {
                let mut sofar = Sofar::default();
                let mut chunks = 0u32;
                loop {
                    chunks += 1;
                    if chunks > MAX_CHUNKS {
                        return Err(proto("reply of too many chunks"));
                    }
                    let mut h = [0; 16];
                    self.read_exact(&mut h)?;
                    let flags = u16::from_be_bytes([h[0], h[1]]);
                    let kind = u16::from_be_bytes([h[2], h[3]]);
                    self.check_handle(handle, &h[4..12])?;
                    let len = u32::from_be_bytes(h[12..16].try_into().unwrap_or([0; 4]));
                    let done = flags & REPLY_FLAG_DONE != 0;
                    self.chunk(kind, len, done, &mut read, &mut status, &mut sofar)?;
                    if flags & REPLY_FLAG_DONE != 0 {
                        break;
                    }
                    let mut magic = [0; 4];
                    self.read_exact(&mut magic)?;
                    if u32::from_be_bytes(magic) != STRUCTURED_REPLY_MAGIC {
                        return Err(proto("bad structured reply magic"));
                    }
                }
                if let Some(errno) = sofar.error {
                    return Err(ClientError::Server { errno });
                }
                if let Some((buf, _)) = read {
                    if sofar.covered != buf.len() as u64 {
                        return Err(proto("read reply does not cover the request"));
                    }
                }
                Ok(())
            }
            m => Err(proto(format!("bad reply magic {m:#x}"))),
        }
    }

    fn check_handle(&self, handle: u64, got: &[u8]) -> Result<(), ClientError> {
        let got = u64::from_be_bytes(got.try_into().unwrap_or([0; 8]));
        if got != handle {
            return Err(proto(format!("reply for request {got}, expected {handle}")));
        }
        Ok(())
    }

    /// One structured reply chunk of `len` payload bytes.
    fn chunk(
        &mut self,
        kind: u16,
        len: u32,
        done: bool,
        read: &mut Option<(&mut [u8], u64)>,
        status: &mut Option<&mut Vec<Status>>,
        sofar: &mut Sofar,
    ) -> Result<(), ClientError> {
        match kind {
            REPLY_TYPE_NONE if len == 0 && done => Ok(()),
            REPLY_TYPE_OFFSET_DATA | REPLY_TYPE_OFFSET_HOLE => {
                let Some((buf, base)) = read.as_mut() else {
                    return Err(proto("data chunk in a reply that is not a read"));
                };
                let mut off = [0; 8];
                if len < 8 {
                    return Err(proto("short data chunk"));
                }
                self.read_exact(&mut off)?;
                let off = u64::from_be_bytes(off);
                let n = if kind == REPLY_TYPE_OFFSET_DATA {
                    u64::from(len - 8)
                } else {
                    if len != 12 {
                        return Err(proto("malformed hole chunk"));
                    }
                    let mut l = [0; 4];
                    self.read_exact(&mut l)?;
                    u64::from(u32::from_be_bytes(l))
                };
                let start = off
                    .checked_sub(*base)
                    .ok_or_else(|| proto("chunk before the request"))?;
                let end = start
                    .checked_add(n)
                    .filter(|&e| e <= buf.len() as u64)
                    .ok_or_else(|| proto("chunk past the request"))?;
                if !sofar.fill(start, end) {
                    return Err(proto(format!(
                        "chunk at {off} for {n} bytes overlaps an earlier one"
                    )));
                }
                let dest = &mut buf[start as usize..end as usize];
                if kind == REPLY_TYPE_OFFSET_DATA {
                    self.s.read_exact(dest)?;
                } else {
                    dest.fill(0);
                }
                Ok(())
            }
            REPLY_TYPE_BLOCK_STATUS => {
                let Some(out) = status.as_mut() else {
                    return Err(proto("block status chunk in a reply that is not one"));
                };
                if len < 12 || (len - 4) % 8 != 0 || (len - 4) / 8 > MAX_EXTENTS {
                    return Err(proto(format!("{len}-byte block status chunk")));
                }
                let mut id = [0; 4];
                self.read_exact(&mut id)?;
                if Some(u32::from_be_bytes(id)) != self.allocation {
                    return Err(proto("block status for a context not asked"));
                }
                for _ in 0..(len - 4) / 8 {
                    let mut e = [0; 8];
                    self.read_exact(&mut e)?;
                    let elen = u32::from_be_bytes(e[..4].try_into().unwrap_or([0; 4]));
                    let mut flags = u32::from_be_bytes(e[4..].try_into().unwrap_or([0; 4]));
                    if self.depth_context {
                        flags = flags.min(2);
                    }
                    if elen == 0 {
                        return Err(proto("empty extent"));
                    }
                    if out.len() >= MAX_EXTENTS as usize {
                        return Err(proto("too many extents"));
                    }
                    out.push(Status {
                        len: u64::from(elen),
                        hole: flags & STATE_HOLE != 0,
                        zero: flags & STATE_ZERO != 0,
                    });
                }
                Ok(())
            }
            k if k & REPLY_TYPE_FLAG_ERROR != 0 => {
                if len < 6 || len > 6 + MAX_STRING_LEN as u32 + 8 {
                    return Err(proto(format!("{len}-byte error chunk")));
                }
                let mut payload = vec![0; len as usize];
                self.read_exact(&mut payload)?;
                let errno = u32::from_be_bytes(payload[..4].try_into().unwrap_or([0; 4]));
                // A zero errno in an error chunk is itself a protocol error; report EIO.
                sofar
                    .error
                    .get_or_insert(if errno == 0 { libc::EIO as u32 } else { errno });
                Ok(())
            }
            k => Err(proto(format!(
                "unexpected reply chunk type {k} ({len} bytes)"
            ))),
        }
    }
}
