//! An NBD export as a storage: what lets the image tools open `nbd://` and `nbd+unix://`
//! names (and QEMU's legacy `nbd:` form) like files.
//!
//! The client is blocking with socket timeouts (so every wait ends) and takes one request
//! at a time; the image's thread waits for each answer. The export's size is fixed: writes
//! past its end fail with `ENOSPC` as QEMU's client fails them, and reads past it read zeros
//! as [`Storage`] promises.

use std::cell::RefCell;
use std::io;

use nbd_client::{NbdClient, DEFAULT_IO_TIMEOUT};

use crate::{BufResult, OpenOptions, Slice, Storage};

/// A connection to an NBD export.
pub struct NbdStorage {
    client: RefCell<NbdClient>,
    size: u64,
    read_only: bool,
}

impl NbdStorage {
    /// Connects to the export `name` names (see [`crate::opener::nbd_name`]).
    pub fn open(name: &str, opts: OpenOptions) -> io::Result<NbdStorage> {
        let target = crate::opener::nbd_name::parse(name)
            .map_err(|e| io::Error::new(io::ErrorKind::InvalidInput, e))?;
        let client = NbdClient::connect(&target, DEFAULT_IO_TIMEOUT).map_err(io::Error::from)?;
        let size = client.size();
        let read_only = opts.read_only || client.read_only();
        if !opts.read_only && client.read_only() {
            return Err(io::Error::from_raw_os_error(libc::EROFS));
        }
        Ok(NbdStorage {
            client: RefCell::new(client),
            size,
            read_only,
        })
    }

    fn writable(&self) -> io::Result<()> {
        if self.read_only {
            return Err(io::Error::from_raw_os_error(libc::EROFS));
        }
        Ok(())
    }

    /// The part of `[offset, offset + len)` inside the export, or ENOSPC past its end.
    fn inside(&self, offset: u64, len: u64) -> io::Result<()> {
        match offset.checked_add(len) {
            Some(end) if end <= self.size => Ok(()),
            _ => Err(io::Error::from_raw_os_error(libc::ENOSPC)),
        }
    }
}

impl Storage for NbdStorage {
    async fn read_at(&self, mut buf: Slice, offset: u64) -> BufResult<Slice> {
        let inside = self.size.saturating_sub(offset).min(buf.len() as u64) as usize;
        buf[inside..].fill(0);
        if inside == 0 {
            return (Ok(()), buf);
        }
        let r = self.client.borrow_mut().read(&mut buf[..inside], offset);
        (r.map_err(io::Error::from), buf)
    }

    async fn write_at(&self, buf: Slice, offset: u64) -> BufResult<Slice> {
        let r = self
            .writable()
            .and_then(|()| self.inside(offset, buf.len() as u64))
            .and_then(|()| {
                self.client
                    .borrow_mut()
                    .write(&buf, offset)
                    .map_err(io::Error::from)
            });
        (r, buf)
    }

    async fn write_zeroes_at(&self, offset: u64, len: u64, unmap: bool) -> io::Result<()> {
        self.writable()?;
        self.inside(offset, len)?;
        Ok(self.client.borrow_mut().write_zeroes(offset, len, unmap)?)
    }

    async fn discard_at(&self, offset: u64, len: u64) -> io::Result<()> {
        self.writable()?;
        let len = len.min(self.size.saturating_sub(offset));
        if len == 0 {
            return Ok(());
        }
        Ok(self.client.borrow_mut().trim(offset, len)?)
    }

    async fn data_run(&self, offset: u64, len: u64) -> io::Result<(bool, u64)> {
        let inside = len.min(self.size.saturating_sub(offset));
        if inside == 0 {
            return Ok((false, len));
        }
        let st = self.client.borrow_mut().block_status(offset, inside)?;
        Ok((!st.zero, st.len))
    }

    /// The server's flags as QEMU's client takes them: not a hole is data, and zero is zero,
    /// whatever context they come from (`x-dirty-bitmap`).
    async fn status_run(&self, offset: u64, len: u64) -> io::Result<(crate::RunStatus, u64)> {
        let inside = len.min(self.size.saturating_sub(offset));
        if inside == 0 {
            return Ok((
                crate::RunStatus {
                    data: false,
                    zero: true,
                },
                len,
            ));
        }
        let st = self.client.borrow_mut().block_status(offset, inside)?;
        let status = crate::RunStatus {
            data: !st.hole,
            zero: st.zero,
        };
        Ok((status, st.len))
    }

    async fn flush(&self) -> io::Result<()> {
        if self.read_only {
            return Ok(());
        }
        Ok(self.client.borrow_mut().flush()?)
    }

    async fn len(&self) -> io::Result<u64> {
        Ok(self.size)
    }

    /// An export's size is fixed: shrinking leaves it as it is (as QEMU's client, the
    /// bytes past `len` stay), growing fails.
    async fn set_len(&self, len: u64) -> io::Result<()> {
        if len <= self.size {
            return Ok(());
        }
        Err(io::Error::new(
            io::ErrorKind::Unsupported,
            "Cannot grow NBD nodes",
        ))
    }

    fn zeroes_are_cheap(&self) -> bool {
        self.client.borrow().can_write_zeroes()
    }

    fn alignment(&self) -> usize {
        1
    }
}

impl Drop for NbdStorage {
    fn drop(&mut self) {
        self.client.get_mut().disconnect();
    }
}
