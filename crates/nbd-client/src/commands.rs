//! What a caller asks of an export: read, write, zero, trim, flush, block status and
//! disconnect, each split into requests the server takes.

use std::io::{Read, Write};

use nbd_proto::wire::consts::*;

use crate::error::{proto, ClientError};
use crate::limits::MAX_RANGE;
use crate::session::{NbdClient, Status};

impl<S: Read + Write> NbdClient<S> {
    fn check_range(&self, offset: u64, len: u64) -> Result<(), ClientError> {
        match offset.checked_add(len) {
            Some(end) if end <= self.size => Ok(()),
            _ => Err(ClientError::OutOfRange {
                offset,
                len,
                size: self.size,
            }),
        }
    }
    /// Reads `buf.len()` bytes at `offset`.
    pub fn read(&mut self, buf: &mut [u8], offset: u64) -> Result<(), ClientError> {
        self.check_range(offset, buf.len() as u64)?;
        let max = self.max_request as usize;
        for (i, piece) in buf.chunks_mut(max).enumerate() {
            let off = offset + (i * max) as u64;
            let h = self.send(CMD_READ, 0, off, piece.len() as u32, &[])?;
            self.reply(h, Some((piece, off)), None)?;
        }
        Ok(())
    }

    /// Writes `data` at `offset`.
    pub fn write(&mut self, data: &[u8], offset: u64) -> Result<(), ClientError> {
        if self.read_only() {
            return Err(ClientError::ReadOnly);
        }
        self.check_range(offset, data.len() as u64)?;
        let max = self.max_request as usize;
        for (i, piece) in data.chunks(max).enumerate() {
            let off = offset + (i * max) as u64;
            let h = self.send(CMD_WRITE, 0, off, piece.len() as u32, piece)?;
            self.reply(h, None, None)?;
        }
        Ok(())
    }

    /// Zeroes or trims `[offset, offset + len)` in requests the server takes.
    fn ranged(&mut self, cmd: u16, flags: u16, offset: u64, len: u64) -> Result<(), ClientError> {
        if self.read_only() {
            return Err(ClientError::ReadOnly);
        }
        self.check_range(offset, len)?;
        let mut done = 0;
        while done < len {
            let n = (len - done).min(u64::from(MAX_RANGE)) as u32;
            let h = self.send(cmd, flags, offset + done, n, &[])?;
            self.reply(h, None, None)?;
            done += u64::from(n);
        }
        Ok(())
    }

    /// Makes `[offset, offset + len)` read as zeros; with `unmap`, lets the server free it.
    /// Without NBD_CMD_WRITE_ZEROES, zeros are written.
    pub fn write_zeroes(&mut self, offset: u64, len: u64, unmap: bool) -> Result<(), ClientError> {
        if self.can_write_zeroes() {
            let flags = if unmap { 0 } else { CMD_FLAG_NO_HOLE };
            return self.ranged(CMD_WRITE_ZEROES, flags, offset, len);
        }
        self.check_range(offset, len)?;
        let zeros = vec![0; (self.max_request as u64).min(len) as usize];
        let mut done = 0;
        while done < len {
            let n = (len - done).min(zeros.len() as u64) as usize;
            self.write(&zeros[..n], offset + done)?;
            done += n as u64;
        }
        Ok(())
    }

    /// Lets the server free `[offset, offset + len)`; a no-op when it does not trim.
    pub fn trim(&mut self, offset: u64, len: u64) -> Result<(), ClientError> {
        if self.flags & FLAG_SEND_TRIM == 0 || len == 0 {
            return Ok(());
        }
        self.ranged(CMD_TRIM, 0, offset, len)
    }

    /// Makes what was written durable; a no-op when the server has no flush.
    pub fn flush(&mut self) -> Result<(), ClientError> {
        if self.flags & FLAG_SEND_FLUSH == 0 {
            return Ok(());
        }
        let h = self.send(CMD_FLUSH, 0, 0, 0, &[])?;
        self.reply(h, None, None)
    }

    /// Block status of the stretch starting at `offset` (at most `len` bytes): whether it
    /// is a hole and whether it reads as zeros, and its length (never more than `len`,
    /// never zero). All data when the server has no `base:allocation`.
    pub fn block_status(&mut self, offset: u64, len: u64) -> Result<Status, ClientError> {
        self.check_range(offset, len)?;
        let all_data = Status {
            len,
            hole: false,
            zero: false,
        };
        if self.allocation.is_none() || len == 0 {
            return Ok(all_data);
        }
        let n = len.min(u64::from(MAX_RANGE)).max(1) as u32;
        let h = self.send(CMD_BLOCK_STATUS, CMD_FLAG_REQ_ONE, offset, n, &[])?;
        let mut out = Vec::new();
        self.reply(h, None, Some(&mut out))?;
        let first = out
            .first()
            .copied()
            .ok_or_else(|| proto("block status reply without extents"))?;
        // A server whose extents do not follow its own minimum block (an unaligned file
        // end) is read in whole blocks, as QEMU's client reads it: a short extent grows
        // to a block and counts as data, a long one is cut back to whole blocks.
        let min = u64::from(self.min_block);
        let status = if first.len % min == 0 {
            first
        } else if first.len > min {
            Status {
                len: first.len / min * min,
                ..first
            }
        } else {
            Status {
                len: min,
                hole: false,
                zero: false,
            }
        };
        Ok(Status {
            len: status.len.min(len),
            ..status
        })
    }

    /// Tells the server we are done (best effort).
    pub fn disconnect(&mut self) {
        let _ = self.send(CMD_DISC, 0, 0, 0, &[]);
    }
}
