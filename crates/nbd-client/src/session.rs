//! One connection in the transmission phase: what the handshake settled on, and what a
//! caller may ask of it.

use std::io::{Read, Write};

use nbd_proto::wire::consts::*;

/// One connection to an export, in the transmission phase.
pub struct NbdClient<S = Box<dyn ReadWrite>> {
    pub(super) s: S,
    pub(super) size: u64,
    pub(super) flags: u16,
    pub(super) structured: bool,
    /// The id the server gave `base:allocation`, when it offers it.
    pub(super) allocation: Option<u32>,
    pub(super) max_request: u32,
    /// The server's minimum block size (1 when it sent none).
    pub(super) min_block: u32,
    /// Block status comes from `qemu:allocation-depth`: depths above 2 read as 2.
    pub(super) depth_context: bool,
    pub(super) next_handle: u64,
}

/// A byte stream the client can talk over.
pub trait ReadWrite: Read + Write + Send {}
impl<T: Read + Write + Send> ReadWrite for T {}

/// One stretch of block status: its length and whether it is a hole / reads as zeros.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Status {
    /// Bytes.
    pub len: u64,
    /// Not allocated.
    pub hole: bool,
    /// Reads as zeros.
    pub zero: bool,
}

impl<S: Read + Write> NbdClient<S> {
    /// The export's size in bytes.
    pub fn size(&self) -> u64 {
        self.size
    }

    /// Whether the server refuses writes.
    pub fn read_only(&self) -> bool {
        self.flags & FLAG_READ_ONLY != 0
    }

    /// Whether block status (`base:allocation`) was negotiated.
    pub fn has_block_status(&self) -> bool {
        self.allocation.is_some()
    }

    /// Whether the server takes NBD_CMD_WRITE_ZEROES.
    pub fn can_write_zeroes(&self) -> bool {
        self.flags & FLAG_SEND_WRITE_ZEROES != 0
    }
}
