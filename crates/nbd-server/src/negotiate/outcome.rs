//! What a handshake settles on: the reply mode, the chosen export and the flags sent for it.
//! A leaf of its own so that the option state machine and the byte mover both use it without
//! using each other.

use nbd_proto::wire::consts::*;

use super::meta::MetaSelection;
use crate::export::{BlockSize, ExportFeatures};

/// Which reply format transmission uses.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mode {
    /// Simple replies only (no structured replies negotiated, e.g. the Linux kernel).
    Simple,
    /// Structured replies with compact headers.
    Structured,
    /// Extended headers: 32-byte requests and replies, 64-bit lengths.
    Extended,
}

/// The outcome of a successful handshake.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Negotiated {
    /// Key of the chosen export in the [`Exports`](crate::exports::Exports) set.
    pub export: usize,
    /// Reply format.
    pub mode: Mode,
    /// Metadata contexts selected for this export.
    pub meta: MetaSelection,
    /// Export size sent to the client.
    pub size: u64,
    /// Transmission flags sent to the client.
    pub flags: u16,
    /// Block sizes advertised (maximum already capped).
    pub block_size: BlockSize,
}

/// Transmission flags for an export's features under a reply mode.
pub fn transmission_flags(features: &ExportFeatures, mode: Mode) -> u16 {
    let mut flags = FLAG_HAS_FLAGS;
    let mut set = |cond: bool, bit: u16| {
        if cond {
            flags |= bit;
        }
    };
    let writable = !features.read_only;
    set(features.read_only, FLAG_READ_ONLY);
    set(features.flush, FLAG_SEND_FLUSH);
    set(features.fua, FLAG_SEND_FUA);
    set(features.rotational, FLAG_ROTATIONAL);
    set(writable && features.trim, FLAG_SEND_TRIM);
    set(writable && features.write_zeroes, FLAG_SEND_WRITE_ZEROES);
    set(
        writable && features.write_zeroes && features.fast_zero,
        FLAG_SEND_FAST_ZERO,
    );
    set(mode != Mode::Simple, FLAG_SEND_DF);
    set(features.multi_conn, FLAG_CAN_MULTI_CONN);
    set(features.cache, FLAG_SEND_CACHE);
    flags
}
