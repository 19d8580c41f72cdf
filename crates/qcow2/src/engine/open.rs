//! Opening an image and its backing chain: probing, validating every structure against the
//! file and against each other, and sizing the shared metadata cache.

use super::backing_map::BackingMap;
use super::backing_name::{self, ChainGuard};
use super::compress::Codec;
use super::error::{EngineError, Result};
use super::layer::{read_exact, Layer, LayerFormat, Qcow2Meta};
use super::metacache::L2Backend;
use super::range_lock::RangeLocks;
use super::writer::Writer;
use super::{Image, Inner, L2Cache};
use crate::format::{limits, snapshot, Header, SnapshotTableEntry};
use std::cell::{Cell, RefCell};
use std::path::{Path, PathBuf};
use std::rc::Rc;
use storage::{Opener, Storage};

/// The four bytes every qcow2 image starts with.
const QCOW2_MAGIC: [u8; 4] = *b"QFI\xfb";

/// Image formats the engine reads.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Format {
    /// qcow2 (versions 2 and 3).
    Qcow2,
    /// A raw disk image.
    Raw,
}

impl Format {
    /// Parses a format name as written in a backing-format extension or given on the
    /// command line.
    pub fn from_name(name: &str) -> Option<Format> {
        match name {
            "qcow2" => Some(Format::Qcow2),
            "raw" => Some(Format::Raw),
            _ => None,
        }
    }
}

/// How to open an image.
#[derive(Clone, Debug, Default)]
pub struct OpenOptions {
    /// Refuse writes.
    pub read_only: bool,
    /// Format of the opened file; `None` accepts qcow2 only (a raw file must be asked for,
    /// so a guest cannot turn a raw disk into a qcow2 header pointing at host files).
    pub format: Option<Format>,
    /// Metadata cache options (`l2-cache-size` and friends).
    pub cache: cache::CacheOptions,
    /// Do not open backing files: unallocated clusters read as zeros.
    pub no_backing: bool,
    /// Open this internal snapshot (by id or name), read-only.
    pub snapshot: Option<String>,
    /// Open files with `O_DIRECT` (QEMU's `cache=none`).
    pub direct: bool,
    /// Read even while another process writes the image (qemu-img's `-U`): its image locks
    /// let others hold every permission. Read-only opens only.
    pub force_share: bool,
    /// Punch holes in the file when a guest discard frees clusters (`--discard=unmap`).
    pub discard_passthrough: bool,
}

impl<S: Storage + 'static> Image<S> {
    /// Opens `path` and its backing chain.
    pub async fn open<O>(opener: &O, path: &Path, opts: &OpenOptions) -> Result<Image<S>>
    where
        O: Opener<Storage = S>,
    {
        let read_only = opts.read_only || opts.snapshot.is_some();
        let mut guard = ChainGuard::default();
        guard.enter(path, path)?;
        let access = storage::OpenOptions {
            read_only,
            direct: opts.direct,
            force_share: opts.force_share,
            ..storage::OpenOptions::default()
        };
        let top = open_layer(
            opener,
            path,
            opts.format,
            access,
            opts.snapshot.as_deref(),
            true,
        )
        .await?;
        let mut layers = vec![top];
        let mut paths = vec![path.to_path_buf()];
        loop {
            if opts.no_backing {
                break;
            }
            let (last, last_path) = (
                layers.last().expect("non-empty"),
                paths.last().expect("non-empty"),
            );
            let Some(meta) = last.qcow2() else { break };
            let (name, fmt_name) = {
                let h = meta.header.borrow();
                let Some(name) = h.backing_file.clone() else {
                    break;
                };
                (name, h.backing_format().map(<[u8]>::to_vec))
            };
            let name = String::from_utf8(name)
                .map_err(|_| last.corrupt("backing file name is not UTF-8".into()))?;
            let next_path: PathBuf = backing_name::resolve(last_path, &name)?;
            guard.enter(last_path, &next_path)?;
            let fmt = match fmt_name {
                Some(f) => {
                    let f = String::from_utf8_lossy(&f).into_owned();
                    Some(
                        Format::from_name(&f).ok_or_else(|| EngineError::Unsupported {
                            image: last.name.clone(),
                            what: format!("backing file format {f:?}"),
                        })?,
                    )
                }
                None => None,
            };
            // Backing files are only read, with the sharing the image was opened with.
            let backing = storage::OpenOptions {
                read_only: true,
                ..access
            };
            let layer = open_layer(opener, &next_path, fmt, backing, None, false).await?;
            layers.push(layer);
            paths.push(next_path);
        }
        build(layers, read_only, opts).await
    }
}

async fn build<S: Storage + 'static>(
    layers: Vec<Layer<S>>,
    read_only: bool,
    opts: &OpenOptions,
) -> Result<Image<S>> {
    let cache_opts = &opts.cache;
    let top_name = layers[0].name.clone();
    let (cache_sizes, slice_bytes) = match layers[0].qcow2() {
        Some(m) => {
            let h = m.header.borrow();
            let params = cache::ImageParams {
                cluster_size: m.geom.cluster_size(),
                virtual_size: layers[0].size.get(),
                extended_l2: m.geom.extended_l2(),
                refcount_bits: m.geom.refcount_bits(),
            };
            drop(h);
            let sizes = cache::resolve_sizes(cache_opts, &params).map_err(|source| {
                EngineError::CacheSize {
                    image: top_name.clone(),
                    source,
                }
            })?;
            // A slice may not be larger than the smallest L2 table in the chain.
            let smallest = layers
                .iter()
                .filter_map(|l| l.qcow2().map(|m| m.geom.cluster_size()))
                .min()
                .unwrap_or(sizes.l2_entry_size);
            // With a backing map the L2 cache mostly serves walks that read a little of every
            // layer's tables: whole-table slices (QEMU's choice when one layer fits) would read
            // 16 times too much, so deep chains use QEMU's small-slice default.
            let slice = if layers.len() >= 3 {
                sizes.l2_entry_size.min(cache::SMALL_L2_ENTRY_SIZE)
            } else {
                sizes.l2_entry_size
            };
            (sizes, slice.min(smallest))
        }
        None => {
            // Raw top layer: no L2 tables; a token cache keeps the types simple.
            let sizes = cache::ResolvedCacheSizes {
                l2_cache_bytes: 2 * 512,
                l2_entry_size: 512,
                refcount_cache_bytes: 0,
                refcount_entry_size: 512,
                clean_interval_secs: cache_opts.cache_clean_interval.unwrap_or(0),
            };
            (sizes, 512)
        }
    };
    let layers = Rc::new(layers);
    let slice = usize::try_from(slice_bytes).unwrap_or(usize::MAX);
    let l2: L2Cache<S> = cache::Cache::new(
        cache::CacheConfig::new("l2", slice, cache_sizes.l2_cache_bytes),
        L2Backend {
            layers: layers.clone(),
            slice_bytes: slice,
        },
    )
    .map_err(|source| EngineError::Cache {
        image: top_name.clone(),
        source,
    })?;
    let l2 = Rc::new(l2);
    // Deep chains get a merged map of the backing layers (see backing_map.rs).
    let backing_map = if layers.len() >= 3 {
        Some(BackingMap::new(&layers, &l2, cache_sizes.l2_cache_bytes)?)
    } else {
        None
    };
    // Nothing is written until every check that can refuse a read-write open has passed:
    // a refused open leaves the file as it was.
    let writer = match layers[0].qcow2() {
        Some(m) if !read_only => {
            let bytes = cache_sizes.refcount_cache_bytes;
            let checked = Writer::open(&layers, bytes).await?;
            if m.header.borrow().is_dirty() {
                // Lazy refcounts may be stale after a crash: rebuild them before any write,
                // then load the rebuilt ones.
                drop(checked);
                super::check::repair_dirty_layer(&layers[0]).await?;
                Some(Writer::open(&layers, bytes).await?)
            } else {
                Some(checked)
            }
        }
        _ => None,
    };
    let image = Image {
        inner: Rc::new(Inner {
            layers,
            l2,
            backing_map,
            read_only,
            locks: RangeLocks::new(),
            decompressed: RefCell::new(None),
            cache_sizes,
            writer,
            discard_passthrough: opts.discard_passthrough,
        }),
    };
    if !read_only {
        image.inner.clear_unknown_autoclear().await?;
    }
    Ok(image)
}

/// Opens one file of the chain.
async fn open_layer<O>(
    opener: &O,
    path: &Path,
    format: Option<Format>,
    access: storage::OpenOptions,
    snapshot: Option<&str>,
    top: bool,
) -> Result<Layer<O::Storage>>
where
    O: Opener,
    O::Storage: 'static,
{
    let name = path.display().to_string();
    let file = opener
        .open(path, access)
        .await
        .map_err(|source| EngineError::Open {
            path: name.clone(),
            source,
        })?;
    let file_len = file.len().await.map_err(|source| EngineError::Io {
        image: name.clone(),
        what: "getting the file size",
        offset: 0,
        source,
    })?;
    let magic = read_exact(&file, &name, "reading the header", 0, 4).await?;
    let is_qcow2 = file_len >= 4 && magic[..4] == QCOW2_MAGIC;
    let format = match format {
        Some(f) => f,
        None if is_qcow2 => Format::Qcow2,
        None if top => {
            return Err(EngineError::Unsupported {
                image: name,
                what: "opening a file that is not qcow2 without an explicit format (use raw)"
                    .into(),
            })
        }
        None => Format::Raw,
    };
    if format == Format::Raw {
        if snapshot.is_some() {
            return Err(EngineError::Unsupported {
                image: name,
                what: "internal snapshots of a raw file".into(),
            });
        }
        return Ok(Layer {
            name,
            file,
            size: Cell::new(file_len),
            format: LayerFormat::Raw,
            sync_failed: Cell::new(false),
        });
    }
    let meta = open_qcow2(opener, &file, path, &name, file_len, access, snapshot).await?;
    let size = meta.1;
    Ok(Layer {
        name,
        file,
        size: Cell::new(size),
        format: LayerFormat::Qcow2(meta.0),
        sync_failed: Cell::new(false),
    })
}

/// Reads and validates a qcow2 layer's header and tables.
#[allow(clippy::too_many_arguments)]
async fn open_qcow2<O>(
    opener: &O,
    file: &O::Storage,
    path: &Path,
    name: &str,
    file_len: u64,
    access: storage::OpenOptions,
    snapshot: Option<&str>,
) -> Result<(Qcow2Meta<O::Storage>, u64)>
where
    O: Opener,
    O::Storage: 'static,
{
    let fmt_err = |source| EngineError::Format {
        image: name.to_string(),
        source,
    };
    let corrupt = |detail: String| EngineError::Corrupt {
        image: name.to_string(),
        detail,
    };
    // The header fits in the first cluster: learn the cluster size from the first sector,
    // then read just that cluster (or the whole file, if it is shorter).
    let probe = read_exact(file, name, "reading the header", 0, 512).await?;
    let bits = u32::from_be_bytes([probe[20], probe[21], probe[22], probe[23]])
        .clamp(limits::MIN_CLUSTER_BITS, limits::MAX_CLUSTER_BITS);
    let first_len = file_len.min(1 << bits).max(512);
    let first = read_exact(file, name, "reading the header", 0, first_len as usize).await?;
    let header = Header::decode(&first).map_err(fmt_err)?;
    if header.crypt_method != 0 {
        return Err(EngineError::Unsupported {
            image: name.to_string(),
            what: "an encrypted image".into(),
        });
    }
    let read_only = access.read_only;
    if header.is_corrupt() && !read_only {
        return Err(EngineError::MarkedCorrupt {
            image: name.to_string(),
        });
    }
    let codec = match header.compression_type {
        0 => Codec::Zlib,
        1 => Codec::Zstd,
        other => {
            return Err(EngineError::Unsupported {
                image: name.to_string(),
                what: format!("compression type {other}"),
            })
        }
    };
    let geom = header.geometry().map_err(fmt_err)?;
    let cs = geom.cluster_size();

    // Metadata regions must be inside the file and must not overlap.
    let mut regions: Vec<(u64, u64, &'static str)> = vec![(0, cs, "the header cluster")];
    let l1_bytes = u64::from(header.l1_size) * 8;
    regions.push((header.l1_table_offset, l1_bytes, "the L1 table"));
    regions.push((
        header.refcount_table_offset,
        u64::from(header.refcount_table_clusters) * cs,
        "the refcount table",
    ));
    let snapshots = snapshot_table(file, name, &header, &geom, file_len).await?;
    if header.nb_snapshots > 0 {
        // QEMU does not write the padding after the last entry when the table ends the file.
        let padding = snapshots.last().map_or(0, |(e, used)| {
            used - (40 + e.extra_data.len() + e.id.len() + e.name.len()) as u64
        });
        let len = snapshots.iter().map(|s| s.1).sum::<u64>() - padding;
        regions.push((header.snapshots_offset, len, "the snapshot table"));
    }
    if let Some(b) = header.bitmaps() {
        regions.push((b.directory_offset, b.directory_size, "the bitmap directory"));
    }
    if let Some(fde) = header.fde_pointer() {
        regions.push((fde.offset, fde.length, "the encryption header"));
    }
    check_regions(&mut regions, file_len, cs).map_err(corrupt)?;

    // The L1 table in use: the active one, or a snapshot's.
    let (l1_offset, l1_entries, size) = match snapshot {
        None => (header.l1_table_offset, header.l1_size, header.size),
        Some(wanted) => {
            let snap = snapshots
                .iter()
                .map(|s| &s.0)
                .find(|s| s.id == wanted.as_bytes())
                .or_else(|| {
                    snapshots
                        .iter()
                        .map(|s| &s.0)
                        .find(|s| s.name == wanted.as_bytes())
                })
                .ok_or_else(|| EngineError::NoSuchSnapshot {
                    image: name.to_string(),
                    wanted: wanted.to_string(),
                })?;
            let l1_bytes = u64::from(snap.l1_size) * 8;
            let mut r = vec![(snap.l1_table_offset, l1_bytes, "the snapshot's L1 table")];
            check_regions(&mut r, file_len, cs).map_err(corrupt)?;
            (
                snap.l1_table_offset,
                snap.l1_size,
                snap.disk_size().unwrap_or(header.size),
            )
        }
    };
    let needed = geom.l1_entries_needed();
    let geom_for_size = crate::format::Geometry::new(
        geom.cluster_bits(),
        geom.extended_l2(),
        geom.refcount_order(),
        size,
    )
    .map_err(fmt_err)?;
    let needed = needed.max(geom_for_size.l1_entries_needed());
    if u64::from(l1_entries) < geom_for_size.l1_entries_needed() {
        return Err(corrupt(format!(
            "L1 table at {l1_offset:#x} has {l1_entries} entries, too few for a virtual size of {size} bytes (needs {needed})"
        )));
    }
    let raw = read_exact(
        file,
        name,
        "reading the L1 table",
        l1_offset,
        (u64::from(l1_entries) * 8) as usize,
    )
    .await?;
    let l1 = Qcow2Meta::<O::Storage>::decode_l1(
        &raw,
        l1_entries as usize,
        &geom,
        l1_offset,
        file_len,
        name,
    )?;
    // No L2 table may sit on top of the header, the L1 table or the refcount table.
    for (i, &word) in l1.iter().enumerate() {
        let off = word & crate::format::l1::L1_OFFSET_MASK;
        if off == 0 {
            continue;
        }
        for &(start, len, what) in regions.iter().take(3) {
            if off < start.saturating_add(len) && start < off + cs {
                return Err(corrupt(format!(
                    "L1 table at {l1_offset:#x}: entry {i} points to an L2 table at {off:#x} that overlaps {what}"
                )));
            }
        }
    }

    let data_file = if header.has_data_file() {
        let Some(dname) = header.data_file_name() else {
            return Err(EngineError::Unsupported {
                image: name.to_string(),
                what: "an external data file without a name in the image".into(),
            });
        };
        let dname = String::from_utf8(dname.to_vec())
            .map_err(|_| corrupt("external data file name is not UTF-8".into()))?;
        let dpath = backing_name::resolve(path, &dname)?;
        Some(
            // The data file holds the guest's bytes: it is locked as the image is.
            opener
                .open(&dpath, access)
                .await
                .map_err(|source| EngineError::Open {
                    path: dpath.display().to_string(),
                    source,
                })?,
        )
    } else {
        None
    };
    let data_raw = header.data_file_is_raw();
    Ok((
        Qcow2Meta {
            geom: geom.with_data_file(data_file.is_some()),
            header: RefCell::new(header),
            l1: RefCell::new(l1),
            l1_offset: Cell::new(l1_offset),
            data_file,
            data_raw,
            codec,
            file_end: Cell::new(file_len),
            metadata_prealloc: Cell::new(None),
        },
        size,
    ))
}

/// Reads the snapshot table one entry at a time (entries with their encoded lengths), so an
/// image with a few snapshots does not cost a 64 MiB read.
pub(crate) async fn snapshot_table<S: Storage + 'static>(
    file: &S,
    name: &str,
    header: &Header,
    geom: &crate::format::Geometry,
    file_len: u64,
) -> Result<Vec<(SnapshotTableEntry, u64)>> {
    let fmt_err = |source| EngineError::Format {
        image: name.to_string(),
        source,
    };
    let mut cursor = snapshot::SnapshotTableCursor::new(header.snapshots_offset);
    let mut out = Vec::new();
    let mut total = 0u64;
    for index in 0..u64::from(header.nb_snapshots) {
        let offset = cursor.next_offset().map_err(fmt_err)?;
        let at = crate::format::Location::entry(
            crate::format::Structure::SnapshotTable,
            header.snapshots_offset,
            index,
        );
        let fixed = limits::SNAPSHOT_ENTRY_FIXED_SIZE;
        if offset.checked_add(fixed).is_none_or(|e| e > file_len) {
            return Err(EngineError::Corrupt {
                image: name.to_string(),
                detail: format!("snapshot table at {:#x}: entry {index} at {offset:#x} is past the end of the file", header.snapshots_offset),
            });
        }
        let head = read_exact(
            file,
            name,
            "reading the snapshot table",
            offset,
            fixed as usize,
        )
        .await?;
        let len = SnapshotTableEntry::entry_len(&head, at).map_err(fmt_err)?;
        total += len as u64;
        if total > limits::MAX_SNAPSHOT_TABLE_BYTES || offset + len as u64 > file_len {
            return Err(EngineError::Corrupt {
                image: name.to_string(),
                detail: format!("snapshot table at {:#x}: entry {index} at {offset:#x} is past the end of the file or the 64 MiB limit", header.snapshots_offset),
            });
        }
        let whole = read_exact(file, name, "reading the snapshot table", offset, len).await?;
        let (entry, used) =
            SnapshotTableEntry::decode(&whole, offset, index, geom).map_err(fmt_err)?;
        cursor.advance(used).map_err(fmt_err)?;
        out.push((entry, used as u64));
    }
    Ok(out)
}

/// Every region must be inside the file, and no two may overlap.
fn check_regions(
    regions: &mut [(u64, u64, &'static str)],
    file_len: u64,
    cluster_size: u64,
) -> std::result::Result<(), String> {
    for &(start, len, what) in regions.iter() {
        if len == 0 {
            continue;
        }
        if start % cluster_size != 0 {
            return Err(format!("{what} at {start:#x} is not aligned to a cluster"));
        }
        match start.checked_add(len) {
            Some(end) if end <= file_len => {}
            _ => {
                return Err(format!(
                    "{what} at {start:#x} ({len} bytes) extends past the end of the file ({file_len:#x} bytes)"
                ))
            }
        }
    }
    let mut sorted: Vec<_> = regions.iter().filter(|r| r.1 > 0).collect();
    sorted.sort_by_key(|r| r.0);
    for w in sorted.windows(2) {
        let (a, b) = (w[0], w[1]);
        // Tables are cluster-granular: round the first one up to whole clusters.
        let a_end = a.0 + a.1.div_ceil(cluster_size) * cluster_size;
        if b.0 < a_end {
            return Err(format!(
                "{} at {:#x} overlaps {} at {:#x}",
                b.2, b.0, a.2, a.0
            ));
        }
    }
    Ok(())
}
