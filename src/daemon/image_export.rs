//! [`ImageExport`]: the [`nbd_server::Export`] the server drives, over a qcow2 (or raw) [`Image`].
//!
//! The NBD crate validates every request (range, flags, lengths) before it gets here, so this
//! file is only policy: qemu-nbd's `--cache`, `--discard` and `--detect-zeroes` semantics,
//! which features to advertise, and how engine errors become NBD errors.
//!
//! Data is never copied on the way through: WRITE payloads arrive in an [`IoBuf`] (4 KiB
//! aligned, so O_DIRECT can use it as is) that goes straight to the engine, and READ data is
//! sent from the buffer the engine filled.
//!
//! Reads answer ranges that read as zeroes with hole chunks instead of zero bytes
//! ([`Image::read_sparse`] resolves the range once for both the data and the holes). A hole costs the
//! client a chunk header instead of the zero bytes, which is what makes sequential reads of a
//! sparse image fast.

use qcow2::format::GuestOffset;
use std::rc::Rc;
use std::time::Instant;

use nbd_proto::Errno;
use nbd_server::{BlockSize, Export, ExportFeatures, Extent, ReadChunk, WriteZeroesFlags};
use qcow2::engine::{libc_errno, EngineError, Image, ReadPart};
use qcow2::format::BitmapData;
use storage::{AnyStorage, IoBuf};

use crate::common::zeroes::is_zero;
use crate::daemon::stats::{Command, ExportStats};

/// Largest block size we advertise as preferred: a write of this many bytes never needs a
/// copy-on-write of the rest of its (sub)cluster, and it stays far below the 32 MiB payload.
const MAX_PREFERRED: u32 = 2 << 20;

/// `qemu:allocation-depth`/`base:allocation` answers cover at most this many (sub)clusters,
/// which bounds the memory one BLOCK_STATUS request can make the engine use (the protocol
/// lets the server describe less than was asked).
const BLOCK_STATUS_UNITS: u64 = 1 << 16;

/// QEMU's block layer sizes disks in whole sectors of this many bytes.
const SECTOR: u64 = 512;

/// NBD_CMD_CACHE prefetches at most this many bytes per request (the command is advisory);
/// a request for a whole multi-terabyte disk must not tie up the server for hours.
const CACHE_PREFETCH_MAX: u64 = 64 << 20;

/// Buffer size used while prefetching.
const CACHE_CHUNK: usize = 1 << 20;

/// What `--discard` does with TRIM (and with the unmap permission of WRITE_ZEROES).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum DiscardMode {
    /// qemu-nbd's default: TRIM succeeds without effect and zeroing never deallocates.
    #[default]
    Ignore,
    /// TRIM frees clusters (and punches holes in the file); zeroing may deallocate.
    Unmap,
}

/// What `--detect-zeroes` does with WRITEs whose payload is all zero bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum DetectZeroes {
    /// Write them as data.
    #[default]
    Off,
    /// Turn them into zeroing (zero flags instead of data clusters).
    On,
    /// Turn them into zeroing that may deallocate (requires [`DiscardMode::Unmap`]).
    Unmap,
}

/// How the export treats requests and what it advertises (from the `serve` flags).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct ExportPolicy {
    /// Every write is force-unit-access (`--cache=writethrough|directsync`).
    pub writethrough: bool,
    /// FLUSH and FUA do nothing (`--cache=unsafe`).
    pub ignore_flush: bool,
    /// Files are opened with O_DIRECT (`--cache=none|directsync`): prefetching data is useless.
    pub direct: bool,
    /// `--discard`.
    pub discard: DiscardMode,
    /// `--detect-zeroes`.
    pub detect_zeroes: DetectZeroes,
    /// Several clients may connect at once (`-e` other than 1), so advertise multi-conn:
    /// every connection shares one image and one cache, so a FLUSH covers them all.
    pub multi_conn: bool,
    /// Offer the `qemu:allocation-depth` context (`-A`).
    pub allocation_depth: bool,
    /// The export starts this many bytes into the image (`--offset`): clients see the rest.
    pub offset: u64,
    /// The image was given without a format and probing guessed raw. As QEMU does for such
    /// an image, the export works in whole sectors (minimum block size 512, block status
    /// per sector) and refuses a write that would leave a header of another format in the
    /// file's first sector: otherwise a guest could make the next probe open its disk as,
    /// say, a qcow2 image whose backing file is any file of the host.
    pub probed_raw: bool,
    /// The image was given under QEMU's `compress` filter: every write becomes compressed
    /// clusters, as qemu-nbd writes them through the filter (the minimum block size is a
    /// cluster; a partial cluster is merged with what it reads as; as in QEMU, only clusters
    /// not allocated yet take compressed data). Zeroing and trims pass through.
    pub compressed_writes: bool,
    /// Advertise exactly what qemu-nbd advertises (the binary runs as `qemu-nbd`, where
    /// scripts compare listings): FUA on read-only exports too, multi-conn only when several
    /// clients may connect, and a preferred block size of 4 KiB (or the minimum). Otherwise
    /// a read-only export also offers multi-conn and the preferred size is the subcluster,
    /// the write that never copies the rest of its (sub)cluster.
    pub qemu_nbd_flags: bool,
}

/// A request or reply payload: the engine's aligned [`IoBuf`], moved (never copied) between
/// the socket and the engine. A newtype only because `IoBuf` lacks the `AsRef`/`AsMut`
/// impls the NBD crate asks of a buffer.
#[derive(Debug)]
pub struct Payload(pub IoBuf);

impl AsRef<[u8]> for Payload {
    fn as_ref(&self) -> &[u8] {
        &self.0
    }
}

impl AsMut<[u8]> for Payload {
    fn as_mut(&mut self) -> &mut [u8] {
        &mut self.0
    }
}

impl nbd_server::Buffer for Payload {
    fn zeroed(len: usize) -> Self {
        Payload(IoBuf::zeroed(len))
    }
}

/// An image served over NBD.
pub struct ImageExport {
    image: Image<AnyStorage>,
    policy: ExportPolicy,
    features: ExportFeatures,
    /// Block-status answers are capped at this many bytes.
    status_limit: u64,
    /// The persistent bitmaps offered as `qemu:dirty-bitmap:` contexts (`-B`).
    bitmaps: Vec<ExportedBitmap>,
    /// Where requests are counted, when statistics are on.
    stats: Option<Rc<ExportStats>>,
    /// Held from the check of a probed raw image's first sector to the end of the change
    /// checked, so that two changes to the sector cannot pass their checks apart and
    /// together leave a header.
    first_sector: tokio::sync::Mutex<()>,
}

/// A persistent bitmap an export offers.
pub struct ExportedBitmap {
    name: String,
    /// Bytes of disk per bit.
    granularity: u64,
    /// What it is read from.
    source: BitmapSource,
}

enum BitmapSource {
    /// A writable image's bitmap, as writes keep changing it.
    Live,
    /// A read-only image's bitmap, loaded once.
    Stored(BitmapData),
}

/// Dirty bitmap bits one BLOCK_STATUS answer looks at, at most: a bound on the work of one
/// request (a client asks again for the rest).
const DIRTY_STATUS_BITS: u64 = 1 << 20;

/// The `-B` bitmaps of `image`, refused with qemu-nbd's words when one cannot be exported:
/// it must exist, be consistent (not left in use by a crash) and be named once.
pub async fn exported_bitmaps(
    image: &Image<AnyStorage>,
    names: &[String],
) -> Result<Vec<ExportedBitmap>, String> {
    if names.len() > nbd_server::MAX_DIRTY_BITMAPS {
        return Err(format!(
            "{} bitmaps given; one export offers at most {}",
            names.len(),
            nbd_server::MAX_DIRTY_BITMAPS
        ));
    }
    let listed = image.bitmaps().await.map_err(|e| e.to_string())?;
    let mut out: Vec<ExportedBitmap> = Vec::with_capacity(names.len());
    for name in names {
        if out.iter().any(|b| &b.name == name) {
            return Err(format!("Bitmap '{name}' is given twice"));
        }
        let Some(info) = listed.iter().find(|b| &b.name == name) else {
            out.push(backing_bitmap(image, name).await?);
            continue;
        };
        if info.inconsistent {
            return Err(inconsistent(name));
        }
        let source = if image.is_read_only() {
            let data = image.bitmap_data(name).await.map_err(|e| e.to_string())?;
            BitmapSource::Stored(data)
        } else {
            BitmapSource::Live
        };
        out.push(ExportedBitmap {
            name: name.clone(),
            granularity: info.granularity,
            source,
        });
    }
    Ok(out)
}

fn inconsistent(name: &str) -> String {
    format!("Bitmap '{name}' is inconsistent and cannot be used")
}

/// A `-B` bitmap the top image lacks, found down its backing chain as qemu-nbd finds it.
/// Nothing writes a backing layer, so its bitmap is exported as stored.
async fn backing_bitmap(image: &Image<AnyStorage>, name: &str) -> Result<ExportedBitmap, String> {
    match image.backing_bitmap(name).await {
        Ok(Some((info, data))) => Ok(ExportedBitmap {
            name: name.to_owned(),
            granularity: info.granularity,
            source: BitmapSource::Stored(data),
        }),
        Ok(None) => Err(format!("Bitmap '{name}' is not found")),
        Err(qcow2::engine::EngineError::Bitmap {
            source: qcow2::engine::BitmapError::Inconsistent(_),
            ..
        }) => Err(inconsistent(name)),
        Err(e) => Err(e.to_string()),
    }
}

impl ImageExport {
    /// Wraps an open image; the advertised features follow qemu-nbd's for the same flags.
    pub fn new(image: Image<AnyStorage>, policy: ExportPolicy) -> Self {
        let facts = image.facts();
        let writable = !image.is_read_only();
        // A client that writes whole subclusters never makes us copy-on-write a backing
        // file's data, so that is the efficient size; raw images and small subclusters get
        // the page size.
        let minimum = if policy.compressed_writes {
            u32::try_from(facts.cluster_size)
                .unwrap_or(1 << 16)
                .min(1 << 16)
        } else if policy.probed_raw {
            SECTOR as u32
        } else {
            1
        };
        let exact = policy.qemu_nbd_flags;
        let preferred = if exact {
            minimum.max(4096)
        } else {
            u32::try_from(facts.subcluster_size)
                .unwrap_or(MAX_PREFERRED)
                .clamp(4096, MAX_PREFERRED)
        };
        let features = ExportFeatures {
            read_only: !writable,
            flush: true,
            fua: writable || exact,
            trim: writable,
            write_zeroes: writable,
            fast_zero: writable,
            cache: true,
            // Read-only exports are trivially consistent across connections.
            multi_conn: policy.multi_conn || (!writable && !exact),
            rotational: false,
            block_size: BlockSize {
                minimum,
                preferred,
                maximum: nbd_proto::wire::MAX_PAYLOAD,
            },
            allocation_depth: policy.allocation_depth,
        };
        let status_limit = facts
            .subcluster_size
            .max(512)
            .saturating_mul(BLOCK_STATUS_UNITS);
        Self {
            image,
            policy,
            features,
            status_limit,
            bitmaps: Vec::new(),
            stats: None,
            first_sector: tokio::sync::Mutex::new(()),
        }
    }

    /// Counts every request and connection in `stats`.
    pub fn with_stats(self, stats: Rc<ExportStats>) -> Self {
        Self {
            stats: Some(stats),
            ..self
        }
    }

    /// Starts timing a request when statistics are on (with them off, this is one branch);
    /// [`Self::count`] counts it. A pair of calls around the `.await` rather than a wrapper
    /// taking the request's future: an async fn keeps a future it is given and the one it
    /// awaits in separate places, which doubled the state every request task moves around.
    fn start(&self) -> Option<Instant> {
        self.stats.as_ref().map(|_| Instant::now())
    }

    /// Counts a request started at `start` (from [`Self::start`]) that ended with `result`.
    fn count<T>(
        &self,
        start: Option<Instant>,
        cmd: Command,
        bytes: u64,
        result: &Result<T, Errno>,
    ) {
        if let (Some(stats), Some(start)) = (&self.stats, start) {
            stats.record(cmd, bytes, start.elapsed(), result.as_ref().err().copied());
        }
    }

    /// Offers `bitmaps` as `qemu:dirty-bitmap:` contexts.
    pub fn with_bitmaps(self, bitmaps: Vec<ExportedBitmap>) -> Self {
        Self { bitmaps, ..self }
    }

    /// Where the image's data ends for clients: its size less `--offset`. The export is
    /// longer when that is not a whole number of sectors (see [`Export::size`]).
    fn data_end(&self) -> u64 {
        self.image.size().saturating_sub(self.policy.offset)
    }

    /// How much of `len` bytes at `offset` lies before [`Self::data_end`].
    fn data_part(&self, offset: u64, len: u64) -> u64 {
        self.data_end().saturating_sub(offset).min(len)
    }

    /// A write that reaches into the sector tail past the data: the tail has no storage,
    /// so only zeroes may go there (what it reads as already).
    async fn write_with_tail(
        &self,
        offset: u64,
        data_len: u64,
        Payload(mut data): Payload,
        fua: bool,
    ) -> Result<(), Errno> {
        let keep = usize::try_from(data_len).map_err(|_| Errno::Inval)?;
        if !data.get(keep..).is_some_and(is_zero) {
            tracing::debug!(offset, "write past the end of the image data refused");
            return Err(Errno::NoSpc);
        }
        if keep == 0 {
            return self.after_write(fua).await;
        }
        data.resize(keep);
        self.write_image(self.at(offset), Payload(data), fua).await
    }

    /// For a probed raw image, checks the first sector as a change of `len` bytes at
    /// `offset` (the bytes of `data`, or zeroes without it) would leave it, and refuses the
    /// change (EPERM, as QEMU) if it would then start as an image of another format. The
    /// guard returned is held until the change is done.
    async fn check_first_sector(
        &self,
        offset: u64,
        len: u64,
        data: Option<&[u8]>,
    ) -> Result<Option<tokio::sync::MutexGuard<'_, ()>>, Errno> {
        let at = self.at(offset);
        if !self.policy.probed_raw || at >= SECTOR || len == 0 {
            return Ok(None);
        }
        let guard = self.first_sector.lock().await;
        let have = usize::try_from(self.image.size().min(SECTOR)).unwrap_or(0);
        let (res, current) = self
            .image
            .read_into(GuestOffset(0), IoBuf::zeroed(have))
            .await;
        res.map_err(|e| errno("read (first sector)", &e))?;
        let mut sector = [0u8; SECTOR as usize];
        sector[..have].copy_from_slice(&current[..have]);
        let start = usize::try_from(at).unwrap_or(0);
        let n = usize::try_from(len.min(SECTOR - at)).unwrap_or(0);
        match data {
            Some(d) => sector[start..start + n].copy_from_slice(&d[..n.min(d.len())]),
            None => sector[start..start + n].fill(0),
        }
        if let Some(format) = foreign_header(&sector) {
            tracing::warn!(
                offset,
                format,
                "write refused: it would put a {format} header into the first sector of an \
                 image whose format was probed as raw"
            );
            return Err(Errno::Perm);
        }
        Ok(Some(guard))
    }

    /// Where a client's `offset` is in the image. The NBD layer has checked the request
    /// against [`Export::size`], which leaves room for the offset.
    fn at(&self, offset: u64) -> u64 {
        offset.saturating_add(self.policy.offset)
    }

    /// Persists after a request that asked for FUA (or under writethrough).
    async fn after_write(&self, fua: bool) -> Result<(), Errno> {
        if (fua || self.policy.writethrough) && !self.policy.ignore_flush {
            self.image.flush().await.map_err(|e| errno("flush", &e))?;
        }
        Ok(())
    }

    /// Block status of `[offset, offset + len)`, merged into NBD's coarser view.
    async fn extents(&self, offset: u64, len: u64) -> Result<Vec<Extent>, EngineError> {
        let mut out: Vec<Extent> = Vec::new();
        for e in self.image.block_status(GuestOffset(offset), len).await? {
            let next = Extent {
                len: e.len,
                hole: !e.data,
                zero: e.zero,
                depth: e.allocation_depth(),
            };
            match out.last_mut() {
                Some(last)
                    if (last.hole, last.zero, last.depth) == (next.hole, next.zero, next.depth) =>
                {
                    last.len = last.len.saturating_add(next.len);
                }
                _ => out.push(next),
            }
        }
        Ok(out)
    }
}

/// Whether `sector` (the first sector of a raw image) starts as an image of another format
/// does, one that QEMU would probe as that format: the magic numbers of the formats QEMU
/// recognises by their first sector.
fn foreign_header(sector: &[u8]) -> Option<&'static str> {
    // qcow and qcow2 share a magic and tell themselves apart by the version after it;
    // version 0 is neither.
    if sector.starts_with(&qcow2::format::header::QCOW2_MAGIC.to_be_bytes())
        && sector.get(4..8).is_some_and(|v| v != [0; 4])
    {
        return Some("qcow/qcow2");
    }
    const AT_START: &[(&[u8], &str)] = &[
        (b"QED\0", "qed"),
        (b"LUKS\xba\xbe", "luks"),
        (b"KDMV", "vmdk"),
        (b"COWD", "vmdk"),
        (b"# Disk DescriptorFile", "vmdk"),
        (b"conectix", "vpc"),
        (b"vhdxfile", "vhdx"),
        (b"WithoutFreeSpace", "parallels"),
        (b"WithouFreSpacExt", "parallels"),
        (b"Bochs Virtual HD Image", "bochs"),
    ];
    /// VDI's signature, little-endian at byte 64.
    const VDI_SIGNATURE: [u8; 4] = 0xbeda_107f_u32.to_le_bytes();
    if let Some((_, name)) = AT_START.iter().find(|(m, _)| sector.starts_with(m)) {
        return Some(name);
    }
    (sector.get(64..68) == Some(&VDI_SIGNATURE[..])).then_some("vdi")
}

/// `extents` (from `offset` on) in whole sectors: a sector whose bytes have different
/// states is one extent, data if any of it is, zero only if all of it is.
fn whole_sectors(offset: u64, extents: Vec<Extent>) -> Vec<Extent> {
    let mut spans = Vec::with_capacity(extents.len());
    let mut at = offset;
    for e in extents.into_iter().filter(|e| e.len > 0) {
        let end = at.saturating_add(e.len);
        spans.push((end, e));
        at = end;
    }
    let end_all = at;
    let mut out: Vec<Extent> = Vec::with_capacity(spans.len());
    let mut push = |len: u64, hole: bool, zero: bool, depth: u32| match out.last_mut() {
        Some(last) if (last.hole, last.zero, last.depth) == (hole, zero, depth) => {
            last.len = last.len.saturating_add(len);
        }
        _ => out.push(Extent {
            len,
            hole,
            zero,
            depth,
        }),
    };
    let (mut pos, mut i) = (offset, 0);
    while pos < end_all {
        while spans[i].0 <= pos {
            i += 1;
        }
        let (e_end, e) = spans[i];
        let next = (pos / SECTOR)
            .saturating_add(1)
            .saturating_mul(SECTOR)
            .min(end_all);
        if e_end >= next {
            // This extent reaches the next sector boundary: it keeps the whole sectors it
            // covers; the sector it ends inside is combined with what follows.
            let stop = if e_end == end_all || e_end % SECTOR == 0 {
                e_end
            } else {
                e_end / SECTOR * SECTOR
            };
            push(stop - pos, e.hole, e.zero, e.depth);
            pos = stop;
        } else {
            let (mut hole, mut zero, mut depth) = (true, true, 0);
            // Every extent with bytes in [pos, next): the spans end after pos from i on.
            for (end, part) in &spans[i..] {
                hole &= part.hole;
                zero &= part.zero;
                if part.depth != 0 && (depth == 0 || part.depth < depth) {
                    depth = part.depth;
                }
                if *end >= next {
                    break;
                }
            }
            push(next - pos, hole, zero, depth);
            pos = next;
        }
    }
    out
}

/// The NBD error for an engine error. Failures the client did not cause are logged: they
/// mean a damaged image or a failing disk, which the operator must hear about.
fn errno(op: &'static str, e: &EngineError) -> Errno {
    let errno = match e.errno() {
        libc_errno::EPERM => Errno::Perm,
        libc_errno::EINVAL => Errno::Inval,
        libc_errno::ENOSPC | libc_errno::EDQUOT => Errno::NoSpc,
        libc_errno::ENOTSUP => Errno::NotSup,
        _ => Errno::Io,
    };
    match e {
        EngineError::ZeroNotFast { .. } => tracing::trace!(op, error = %e, "request refused"),
        _ if errno == Errno::Io || errno == Errno::NoSpc => {
            tracing::warn!(op, error = %e, "request failed")
        }
        _ => tracing::debug!(op, error = %e, "request refused"),
    }
    errno
}

/// The requests themselves, as the image carries them out.
impl ImageExport {
    /// The dirty and clean runs of bitmap `index` over (at most) `len` bytes at `offset`.
    fn dirty_runs(&self, index: usize, offset: u64, len: u64) -> Result<Vec<(u64, bool)>, Errno> {
        let b = self.bitmaps.get(index).ok_or(Errno::Inval)?;
        let len = len.min(b.granularity.saturating_mul(DIRTY_STATUS_BITS));
        match &b.source {
            BitmapSource::Live => self
                .image
                .live_bitmap_runs(&b.name, offset, len)
                .map_err(|e| errno("block status", &e)),
            BitmapSource::Stored(data) => Ok(data.runs(offset, len)),
        }
    }

    async fn read_image(&self, offset: u64, len: usize) -> Result<Vec<ReadChunk<Payload>>, Errno> {
        if len == 0 {
            return Ok(Vec::new());
        }
        let parts = self
            .image
            .read_sparse(GuestOffset(offset), len)
            .await
            .map_err(|e| errno("read", &e))?;
        Ok(parts
            .into_iter()
            .map(|p| match p {
                ReadPart::Data(buf) => ReadChunk::Data(Payload(buf)),
                ReadPart::Hole(n) => ReadChunk::Hole(n),
            })
            .collect())
    }

    async fn write_image(
        &self,
        offset: u64,
        Payload(data): Payload,
        fua: bool,
    ) -> Result<(), Errno> {
        let fua = fua && !self.policy.ignore_flush;
        if self.policy.detect_zeroes != DetectZeroes::Off && is_zero(&data) {
            let len = u64::try_from(data.len()).map_err(|_| Errno::Inval)?;
            let unmap = self.policy.detect_zeroes == DetectZeroes::Unmap
                && self.policy.discard == DiscardMode::Unmap;
            self.image
                .write_zeroes(GuestOffset(offset), len, unmap, false)
                .await
                .map_err(|e| errno("write (detected zeroes)", &e))?;
            return self.after_write(fua).await;
        }
        if self.policy.compressed_writes {
            self.write_compressed(offset, &data).await?;
            return self.after_write(fua).await;
        }
        let writethrough = self.policy.writethrough && !self.policy.ignore_flush;
        let (res, _buf) = self
            .image
            .write(GuestOffset(offset), data, fua || writethrough)
            .await;
        res.map_err(|e| errno("write", &e))
    }

    /// Writes `data` at `offset` as compressed clusters, one cluster at a time; a cluster
    /// the write covers only in part is read first and merged (QEMU's block layer pads such
    /// a write to the filter's alignment, a cluster, the same way).
    async fn write_compressed(&self, offset: u64, data: &[u8]) -> Result<(), Errno> {
        let cs = self.image.facts().cluster_size.max(1);
        let size = self.image.size();
        let len = u64::try_from(data.len()).map_err(|_| Errno::Inval)?;
        let end = offset.checked_add(len).ok_or(Errno::Inval)?;
        let mut cluster = offset / cs * cs;
        while cluster < end {
            let cluster_end = cluster.saturating_add(cs).min(size);
            let buf = if offset <= cluster && end >= cluster_end {
                let from = usize::try_from(cluster - offset).map_err(|_| Errno::Inval)?;
                let to = usize::try_from(cluster_end - offset).map_err(|_| Errno::Inval)?;
                IoBuf::from_slice(&data[from..to])
            } else {
                let n = usize::try_from(cluster_end - cluster).map_err(|_| Errno::Inval)?;
                let (res, mut buf) = self
                    .image
                    .read_into(GuestOffset(cluster), IoBuf::zeroed(n))
                    .await;
                res.map_err(|e| errno("read (compressed write)", &e))?;
                let start = offset.max(cluster);
                let stop = end.min(cluster_end);
                let (b0, b1) = (start - cluster, stop - cluster);
                let (d0, d1) = (start - offset, stop - offset);
                let [b0, b1, d0, d1] = [b0, b1, d0, d1].map(|v| usize::try_from(v).unwrap_or(0));
                buf[b0..b1].copy_from_slice(&data[d0..d1]);
                buf
            };
            self.image
                .write_compressed(GuestOffset(cluster), buf)
                .await
                .map_err(|e| errno("write (compressed)", &e))?;
            cluster = cluster.saturating_add(cs);
        }
        Ok(())
    }

    async fn write_zeroes_image(
        &self,
        offset: u64,
        len: u64,
        flags: WriteZeroesFlags,
    ) -> Result<(), Errno> {
        let may_unmap = flags.may_unmap && self.policy.discard == DiscardMode::Unmap;
        self.image
            .write_zeroes(GuestOffset(offset), len, may_unmap, flags.fast)
            .await
            .map_err(|e| errno("write zeroes", &e))?;
        self.after_write(flags.fua).await
    }

    async fn trim_image(&self, offset: u64, len: u64, fua: bool) -> Result<(), Errno> {
        if self.policy.discard == DiscardMode::Unmap {
            self.image
                .discard(GuestOffset(offset), len)
                .await
                .map_err(|e| errno("trim", &e))?;
        }
        self.after_write(fua).await
    }

    async fn flush_image(&self) -> Result<(), Errno> {
        if self.policy.ignore_flush {
            return Ok(());
        }
        self.image.flush().await.map_err(|e| errno("flush", &e))
    }

    async fn cache_image(&self, offset: u64, len: u64) -> Result<(), Errno> {
        let len = len.min(CACHE_PREFETCH_MAX);
        if self.policy.direct {
            // O_DIRECT bypasses the page cache: only the metadata lookup can be warmed.
            self.image
                .block_status(GuestOffset(offset), len)
                .await
                .map_err(|e| errno("cache", &e))?;
            return Ok(());
        }
        // Reading loads the L2 slices and brings the data into the page cache.
        let mut buf = IoBuf::zeroed(0);
        let end = offset.saturating_add(len);
        let mut at = offset;
        while at < end {
            let n = usize::try_from(end - at).map_or(CACHE_CHUNK, |n| n.min(CACHE_CHUNK));
            buf.resize(n);
            let (res, back) = self.image.read_into(GuestOffset(at), buf).await;
            buf = back;
            res.map_err(|e| errno("cache", &e))?;
            at += n as u64;
        }
        Ok(())
    }

    async fn block_status_image(&self, offset: u64, len: u64) -> Result<Vec<Extent>, Errno> {
        let len = len.min(self.status_limit);
        self.extents(offset, len)
            .await
            .map_err(|e| errno("block status", &e))
    }
}

impl Export for ImageExport {
    type Buf = Payload;

    fn size(&self) -> u64 {
        // As QEMU's block layer, which counts whole 512-byte sectors: a raw file of 1000
        // bytes is a 1024-byte disk whose last 24 bytes read as zeroes.
        let data = self.data_end();
        data.checked_next_multiple_of(SECTOR).unwrap_or(data)
    }

    fn features(&self) -> ExportFeatures {
        self.features
    }

    async fn read(&self, offset: u64, len: usize) -> Result<Vec<ReadChunk<Payload>>, Errno> {
        let start = self.start();
        let data = usize::try_from(self.data_part(offset, len as u64)).unwrap_or(len);
        let result = self
            .read_image(self.at(offset), data)
            .await
            .map(|mut chunks| {
                if data < len {
                    chunks.push(ReadChunk::Hole(len - data));
                }
                chunks
            });
        let bytes = u64::try_from(len).unwrap_or(u64::MAX);
        self.count(start, Command::Read, bytes, &result);
        result
    }

    async fn write(&self, offset: u64, data: Payload, fua: bool) -> Result<(), Errno> {
        let bytes = u64::try_from(data.0.len()).unwrap_or(u64::MAX);
        let start = self.start();
        let result = match self.check_first_sector(offset, bytes, Some(&data.0)).await {
            Err(e) => Err(e),
            Ok(_guard) => match self.data_part(offset, bytes) {
                n if n == bytes => self.write_image(self.at(offset), data, fua).await,
                n => self.write_with_tail(offset, n, data, fua).await,
            },
        };
        self.count(start, Command::Write, bytes, &result);
        result
    }

    async fn write_zeroes(
        &self,
        offset: u64,
        len: u64,
        flags: WriteZeroesFlags,
    ) -> Result<(), Errno> {
        let start = self.start();
        // The sector tail past the data already reads as zeroes.
        let data = self.data_part(offset, len);
        let result = match self.check_first_sector(offset, len, None).await {
            Err(e) => Err(e),
            Ok(_guard) => self.write_zeroes_image(self.at(offset), data, flags).await,
        };
        self.count(start, Command::WriteZeroes, len, &result);
        result
    }

    async fn trim(&self, offset: u64, len: u64, fua: bool) -> Result<(), Errno> {
        let start = self.start();
        let data = self.data_part(offset, len);
        // Trimmed bytes may read as zeroes after, as zeroed ones do.
        let result = match self.check_first_sector(offset, len, None).await {
            Err(e) => Err(e),
            Ok(_guard) => self.trim_image(self.at(offset), data, fua).await,
        };
        self.count(start, Command::Trim, len, &result);
        result
    }

    async fn flush(&self) -> Result<(), Errno> {
        let start = self.start();
        let result = self.flush_image().await;
        self.count(start, Command::Flush, 0, &result);
        result
    }

    async fn cache(&self, offset: u64, len: u64) -> Result<(), Errno> {
        let start = self.start();
        let data = self.data_part(offset, len);
        let result = self.cache_image(self.at(offset), data).await;
        self.count(start, Command::Cache, len, &result);
        result
    }

    async fn block_status(&self, offset: u64, len: u64) -> Result<Vec<Extent>, Errno> {
        let start = self.start();
        let result = match self.data_part(offset, len) {
            0 => Ok(vec![Extent {
                len,
                hole: true,
                zero: true,
                depth: 0,
            }]),
            data if self.policy.probed_raw => {
                self.block_status_image(self.at(offset), data)
                    .await
                    .map(|mut extents| {
                        // The sector tail past the data, then whole sectors, as QEMU
                        // reports a probed raw image.
                        if data < len {
                            extents.push(Extent {
                                len: len - data,
                                hole: true,
                                zero: true,
                                depth: 0,
                            });
                        }
                        whole_sectors(offset, extents)
                    })
            }
            data => self.block_status_image(self.at(offset), data).await,
        };
        self.count(start, Command::BlockStatus, len, &result);
        result
    }

    fn client_attached(&self) {
        if let Some(stats) = &self.stats {
            stats.attached();
        }
    }

    fn dirty_bitmaps(&self) -> Vec<String> {
        self.bitmaps.iter().map(|b| b.name.clone()).collect()
    }

    async fn dirty_status(
        &self,
        index: usize,
        offset: u64,
        len: u64,
    ) -> Result<Vec<(u64, bool)>, Errno> {
        let start = self.start();
        let result = match self.data_part(offset, len) {
            0 => Ok(vec![(len, false)]),
            data => self.dirty_runs(index, self.at(offset), data),
        };
        self.count(start, Command::BlockStatus, len, &result);
        result
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ext(len: u64, data: bool) -> Extent {
        Extent {
            len,
            hole: !data,
            zero: !data,
            depth: u32::from(data),
        }
    }

    #[test]
    fn extents_become_whole_sectors_data_where_any_byte_is() {
        let lens = |v: &[Extent]| v.iter().map(|e| (e.len, e.hole)).collect::<Vec<_>>();
        // 1000 bytes of data and a 24-byte tail: one data sector after the first.
        assert_eq!(
            lens(&whole_sectors(0, vec![ext(1000, true), ext(24, false)])),
            [(1024, false)]
        );
        // A hole that starts inside a sector keeps only its whole sectors.
        assert_eq!(
            lens(&whole_sectors(
                0,
                vec![ext(100, true), ext(2000, false), ext(460, true)]
            )),
            [(512, false), (1536, true), (512, false)]
        );
        // Many small extents inside one sector, then aligned ones.
        let mut v: Vec<Extent> = (0..8).map(|i| ext(64, i % 2 == 0)).collect();
        v.push(ext(512, false));
        assert_eq!(lens(&whole_sectors(512, v)), [(512, false), (512, true)]);
        // Lengths are kept whatever the request.
        let total: u64 = whole_sectors(7, vec![ext(3, true), ext(1000, false)])
            .iter()
            .map(|e| e.len)
            .sum();
        assert_eq!(total, 1003);
        assert!(whole_sectors(0, Vec::new()).is_empty());
    }

    #[test]
    fn foreign_headers_are_recognised_by_their_magic() {
        let mut s = [0u8; 512];
        assert_eq!(foreign_header(&s), None);
        s[..8].copy_from_slice(b"QFI\xfb\0\0\0\x03");
        assert_eq!(foreign_header(&s), Some("qcow/qcow2"));
        s[7] = 0;
        assert_eq!(foreign_header(&s), None, "version 0 is no qcow");
        s[..8].copy_from_slice(b"conectix");
        assert_eq!(foreign_header(&s), Some("vpc"));
        s[..8].fill(0);
        s[64..68].copy_from_slice(&[0x7f, 0x10, 0xda, 0xbe]);
        assert_eq!(foreign_header(&s), Some("vdi"));
        assert_eq!(foreign_header(&s[..10]), None);
    }

    #[test]
    fn zero_detection_looks_at_every_byte_whatever_the_alignment() {
        let mut buf = vec![0u8; 4096 + 3];
        assert!(is_zero(&buf));
        assert!(is_zero(&buf[1..]));
        assert!(is_zero(&[]));
        for i in [0, 1, 7, 8, 2048, 4095, 4098] {
            buf[i] = 1;
            assert!(!is_zero(&buf), "byte {i}");
            assert!(!is_zero(&buf[i.min(1)..]), "byte {i}, unaligned start");
            buf[i] = 0;
        }
    }
}
