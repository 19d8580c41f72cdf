//! One layer of a backing chain: a qcow2 image (header, geometry, L1 table, optional external
//! data file), a raw file, or a LUKS volume (QEMU's `luks` driver: a LUKS header, then the
//! enciphered disk). Layer 0 is the image that was opened; layer n is its n-th backing
//! file.

use super::compress::Codec;
use super::error::{EngineError, Result};
use crate::format::{l1, Geometry, Header, HostOffset, L1Entry, L1Index};
use std::cell::{Cell, RefCell};
use storage::{IoBuf, Storage};

/// A layer of the chain.
pub(crate) struct Layer<S> {
    /// File name, for messages.
    pub name: String,
    /// The image file (for raw layers, the data itself).
    pub file: S,
    /// Guest-visible size of this layer (grows when layer 0 is resized).
    pub size: Cell<u64>,
    /// What kind of layer it is.
    pub format: LayerFormat<S>,
    /// An fdatasync of this layer's files failed. The kernel may have dropped the dirty pages
    /// it could not write and will not report that again, so nothing written before can be
    /// called durable any more: every later flush fails too, and the image is never marked
    /// clean. (QEMU's file driver does the same.)
    pub sync_failed: Cell<bool>,
}

/// Raw, qcow2 or a LUKS volume.
// One value per layer, built once on open: boxing the large variant would only add an
// indirection on every request.
#[allow(clippy::large_enum_variant)]
pub(crate) enum LayerFormat<S> {
    /// Every byte below `size` is data at the same offset in the file.
    Raw,
    /// A qcow2 image.
    Qcow2(Qcow2Meta<S>),
    /// A LUKS volume: guest byte `g` is enciphered at `payload + g` of the file.
    Luks(LuksMeta),
}

/// The state of a LUKS volume layer.
pub(crate) struct LuksMeta {
    /// Where the enciphered disk starts in the file (the LUKS header's payload offset).
    pub payload: u64,
    /// The volume's data cipher, its sectors numbered by guest offset as QEMU's `luks`
    /// driver numbers them.
    pub crypto: crate::crypto::DataCrypto,
}

/// The in-memory state of a qcow2 layer.
pub(crate) struct Qcow2Meta<S> {
    /// The decoded header (rewritten in place when the engine changes it).
    pub header: RefCell<Header>,
    /// Cluster arithmetic. Its refcount width is the one the image was opened with: amend
    /// may change the width while the image is open, so refcounts go by `refcount_geom`.
    pub geom: Geometry,
    /// `geom` with the refcount width the image has now (what refcount blocks are read and
    /// written with).
    pub refcount_geom: Cell<Geometry>,
    /// The L1 table in use (the active one, or a snapshot's), as raw entry words.
    pub l1: RefCell<Vec<u64>>,
    /// Where the L1 table lives in the file.
    pub l1_offset: Cell<u64>,
    /// External data file, if the image has one.
    pub data_file: Option<S>,
    /// The external data file is a consistent raw image of the disk (autoclear bit 1).
    pub data_raw: bool,
    /// Codec of compressed clusters.
    pub codec: Codec,
    /// Bytes of the file known to hold clusters; pointers at or past it are corrupt. For the
    /// writable layer the allocator keeps this up to date.
    pub file_end: Cell<u64>,
    /// The unlocked cipher of an encrypted image: data clusters pass through it.
    pub crypto: Option<crate::crypto::DataCrypto>,
    /// Whether this layer looks made with `preallocation=metadata` (decided on first use, by
    /// one request while the others wait).
    pub metadata_prealloc: tokio::sync::OnceCell<bool>,
}

impl<S: Storage + 'static> Layer<S> {
    /// The qcow2 state, if this is a qcow2 layer.
    pub fn qcow2(&self) -> Option<&Qcow2Meta<S>> {
        match &self.format {
            LayerFormat::Qcow2(m) => Some(m),
            LayerFormat::Raw | LayerFormat::Luks(_) => None,
        }
    }

    /// The data cipher of an encrypted layer (qcow2 with encryption, or a LUKS volume).
    pub fn crypto(&self) -> Option<&crate::crypto::DataCrypto> {
        match &self.format {
            LayerFormat::Qcow2(m) => m.crypto.as_ref(),
            LayerFormat::Luks(l) => Some(&l.crypto),
            LayerFormat::Raw => None,
        }
    }

    /// Whether guest byte `g` is byte `g` of the file (a raw layer), so that the file's own
    /// allocation status is the guest's.
    pub fn is_raw(&self) -> bool {
        matches!(self.format, LayerFormat::Raw)
    }

    /// An operation this layer's format cannot do.
    pub(crate) fn unsupported_here(&self, what: &str) -> EngineError {
        EngineError::Unsupported {
            image: self.name.clone(),
            what: what.into(),
        }
    }

    /// The LUKS volume's state, if this is a LUKS volume layer.
    pub fn luks(&self) -> Option<&LuksMeta> {
        match &self.format {
            LayerFormat::Luks(l) => Some(l),
            _ => None,
        }
    }

    /// The qcow2 state, for operations that exist only for qcow2: a raw layer is refused with
    /// an error rather than trusted never to get there.
    pub(crate) fn qcow2_required(&self) -> Result<&Qcow2Meta<S>> {
        self.qcow2().ok_or_else(|| EngineError::Unsupported {
            image: self.name.clone(),
            what: "this operation on a raw image".into(),
        })
    }

    /// Where this layer's guest data lives: the external data file, or the image file.
    pub fn data_storage(&self) -> &S {
        match &self.format {
            LayerFormat::Qcow2(Qcow2Meta {
                data_file: Some(d), ..
            }) => d,
            _ => &self.file,
        }
    }

    /// Reads `len` bytes at `offset` of the image file into a fresh buffer.
    pub async fn read_file(&self, what: &'static str, offset: u64, len: usize) -> Result<IoBuf> {
        read_exact(&self.file, &self.name, what, offset, len).await
    }

    /// `[host, host + len)` of the data storage as runs of (holds data, length), in order and
    /// covering it exactly; holes of the file read as zeros.
    pub async fn stored_runs(&self, host: HostOffset, len: u64) -> Result<Vec<(bool, u64)>> {
        let host = host.0;
        let mut runs = Vec::new();
        let mut pos = 0;
        while pos < len {
            let (stored, n) = self
                .data_storage()
                .data_run(host + pos, len - pos)
                .await
                .map_err(|e| self.io_error("querying allocation", host + pos, e))?;
            let n = n.clamp(1, len - pos);
            runs.push((stored, n));
            pos += n;
        }
        Ok(runs)
    }

    /// `[host, host + len)` of the data storage as runs of block status (data, zeros, both or
    /// neither, as the storage tells them), in order and covering it exactly.
    pub async fn status_runs(
        &self,
        host: HostOffset,
        len: u64,
    ) -> Result<Vec<(storage::RunStatus, u64)>> {
        let host = host.0;
        let mut runs = Vec::new();
        let mut pos = 0;
        while pos < len {
            let (status, n) = self
                .data_storage()
                .status_run(host + pos, len - pos)
                .await
                .map_err(|e| self.io_error("querying allocation", host + pos, e))?;
            let n = n.clamp(1, len - pos);
            runs.push((status, n));
            pos += n;
        }
        Ok(runs)
    }
}

/// Reads `len` bytes at `offset` of `file` into a fresh buffer.
pub(crate) async fn read_exact<S: Storage + 'static>(
    file: &S,
    image: &str,
    what: &'static str,
    offset: u64,
    len: usize,
) -> Result<IoBuf> {
    let (res, slice) = file.read_at(IoBuf::zeroed(len).into(), offset).await;
    res.map_err(|source| EngineError::Io {
        image: image.to_string(),
        what,
        offset,
        source,
    })?;
    Ok(slice.into_inner())
}

/// Largest piece [`read_exact_into`] reads at once.
const READ_PIECE: usize = 256 << 10;

/// Reads `buf.len()` bytes at `offset` of `file` into `buf`, in pieces of at most
/// [`READ_PIECE`] bytes: a cache loading a 2 MiB table into its own memory would otherwise
/// hold a second 2 MiB buffer for as long as the read lasts.
pub(crate) async fn read_exact_into<S: Storage + 'static>(
    file: &S,
    image: &str,
    what: &'static str,
    offset: u64,
    buf: &mut [u8],
) -> Result<()> {
    let mut piece = IoBuf::zeroed(buf.len().min(READ_PIECE));
    let mut at = offset;
    for chunk in buf.chunks_mut(READ_PIECE) {
        piece.truncate(chunk.len());
        let (res, slice) = file.read_at(piece.into(), at).await;
        piece = slice.into_inner();
        res.map_err(|source| EngineError::Io {
            image: image.to_string(),
            what,
            offset: at,
            source,
        })?;
        chunk.copy_from_slice(&piece[..chunk.len()]);
        at += chunk.len() as u64;
    }
    Ok(())
}

/// Largest buffer of zeros written at once by [`write_zero_data`].
const ZERO_CHUNK: u64 = 1 << 20;

/// Writes `len` bytes of zeros as data at `offset` of `layer`'s file (`preallocation=full`:
/// the space is really written, not just reserved).
pub(crate) async fn write_zero_data<S: Storage + 'static>(
    layer: &Layer<S>,
    offset: u64,
    len: u64,
) -> Result<()> {
    write_zeros_into(layer, &layer.file, offset, len).await
}

/// Writes zeros over `[offset, offset + len)` of `file`, one of `layer`'s files (the image
/// or its external data file), in bounded chunks.
pub(crate) async fn write_zeros_into<S: Storage + 'static>(
    layer: &Layer<S>,
    file: &S,
    offset: u64,
    len: u64,
) -> Result<()> {
    let end = offset
        .checked_add(len)
        .ok_or_else(|| layer.corrupt(format!("zeroing {len:#x} bytes at {offset:#x} overflows")))?;
    let mut pos = offset;
    while pos < end {
        let n = (end - pos).min(ZERO_CHUNK);
        // n <= 1 MiB, so the cast is exact.
        let (res, _) = file.write_at(IoBuf::zeroed(n as usize).into(), pos).await;
        res.map_err(|e| layer.io_error("writing zeros", pos, e))?;
        pos += n;
    }
    Ok(())
}

impl<S: Storage + 'static> Layer<S> {
    /// Tells this layer's file what its qcow2 driver is about to do (QEMU's blkdebug
    /// events, which fault injection acts on); a raw layer has no such points.
    pub(crate) fn announce(&self, event: storage::Event) {
        if self.qcow2().is_some() {
            self.file.event(event);
        }
    }
}

impl<S> Layer<S> {
    /// An I/O error in this layer's file.
    pub fn io_error(&self, what: &'static str, offset: u64, source: std::io::Error) -> EngineError {
        EngineError::io(self.name.clone(), what, offset, source)
    }

    /// A metadata inconsistency in this layer.
    pub fn corrupt(&self, detail: String) -> EngineError {
        EngineError::Corrupt {
            image: self.name.clone(),
            detail,
        }
    }
}

impl<S> Qcow2Meta<S> {
    /// The L2 table offset for L1 index `index`, `None` when unallocated or out of the table.
    /// Entries were validated when the table was loaded or written.
    pub fn l2_table(&self, index: L1Index) -> Option<HostOffset> {
        let l1 = self.l1.borrow();
        let word = *l1.get(usize::try_from(index.0).ok()?)?;
        match l1::table_of(word) {
            0 => None,
            off => Some(HostOffset(off)),
        }
    }

    /// Validates a whole L1 table as loaded from the file: reserved bits, alignment, and
    /// every L2 table inside the file.
    pub fn validate_l1(
        words: Vec<u64>,
        geom: &Geometry,
        table_offset: u64,
        file_len: u64,
        image: &str,
    ) -> Result<Vec<u64>> {
        for (i, &word) in words.iter().enumerate() {
            let entry = L1Entry::decode(word, geom, i as u64, HostOffset(table_offset)).map_err(
                |source| EngineError::Format {
                    image: image.to_string(),
                    source,
                },
            )?;
            if let Some(l2) = entry.l2_offset {
                let end = l2.0.checked_add(geom.cluster_size());
                if l2.0 == 0 || end.is_none_or(|e| e > file_len) {
                    return Err(EngineError::Corrupt {
                        image: image.to_string(),
                        detail: format!(
                            "L1 table at {table_offset:#x}: entry {i} points to an L2 table at {:#x} past the end of the file ({file_len:#x} bytes)",
                            l2.0
                        ),
                    });
                }
            }
        }
        Ok(words)
    }
}
