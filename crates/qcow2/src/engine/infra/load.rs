//! Loading one file of a chain: probing its format, then reading and validating a qcow2
//! header and the tables every request needs (L1, snapshot table), each checked against the
//! file and against each other before anything uses it.

use super::compress::Codec;
use super::error::{EngineError, Result};
use super::layer::{read_exact, Layer, LayerFormat, LuksMeta, Qcow2Meta};
use crate::crypto::{CryptoError, DataCrypto, LuksHeader, Unlock, SECTOR_SIZE};
use crate::engine::backing_name;
use crate::format::header::{CRYPT_AES, CRYPT_NONE, QCOW2_MAGIC};
use crate::format::{Geometry, Header, SnapshotTableEntry, Structure};
use crate::metadata::{Loader, MetadataError, StorageSource, Strictness, L1_TABLE};
use std::cell::{Cell, RefCell};
use std::path::{Path, PathBuf};
use storage::{Opener, Storage};

/// Image formats the engine reads.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Format {
    /// qcow2 (versions 2 and 3).
    Qcow2,
    /// A raw disk image.
    Raw,
    /// A LUKS volume (QEMU's `luks` driver).
    Luks,
}

impl Format {
    /// Parses a format name as written in a backing-format extension or given on the
    /// command line.
    pub fn from_name(name: &str) -> Option<Format> {
        match name {
            "qcow2" => Some(Format::Qcow2),
            "raw" => Some(Format::Raw),
            "luks" => Some(Format::Luks),
            _ => None,
        }
    }

    /// The name a backing-format extension and the command line use for it.
    pub fn name(self) -> &'static str {
        match self {
            Format::Qcow2 => "qcow2",
            Format::Raw => "raw",
            Format::Luks => "luks",
        }
    }
}

/// What the caller chooses for one layer: what only the top image of a chain may be asked
/// for, and the confinement of the files a layer names.
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct LayerChoices<'a> {
    /// The internal snapshot to open instead of the active state (top image only).
    pub snapshot: Option<&'a str>,
    /// The external data file to open instead of the one the header names (top image only).
    pub data_file: Option<&'a Path>,
    /// The image is untrusted: a data file its header names must resolve inside the
    /// allowed directories, and the sizes it declares are capped.
    pub untrusted: Option<crate::declared::Untrusted>,
}

/// Opens one file of the chain.
pub(crate) async fn open_layer<O>(
    opener: &O,
    path: &Path,
    format: Option<Format>,
    access: storage::OpenOptions,
    choices: LayerChoices<'_>,
    top: bool,
    key: Unlock<'_>,
) -> Result<Layer<O::Storage>>
where
    O: Opener,
    O::Storage: 'static,
{
    let LayerChoices {
        snapshot,
        data_file,
        untrusted,
    } = choices;
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
    let format = match format {
        Some(f) => f,
        // Only a probe reads the magic: a format given is taken as it is, and a raw image's
        // first bytes are then read only when the guest reads them (a read that fails, as
        // when a quorum's children disagree, fails that read, as in QEMU).
        None => {
            let magic = read_exact(&file, &name, "reading the header", 0, 4).await?;
            if file_len >= 4 && magic[..4] == QCOW2_MAGIC.to_be_bytes() {
                Format::Qcow2
            } else if top {
                return Err(EngineError::Unsupported {
                    image: name,
                    what: "opening a file that is not qcow2 without an explicit format (use raw)"
                        .into(),
                });
            } else {
                Format::Raw
            }
        }
    };
    if format != Format::Qcow2 {
        if data_file.is_some() {
            return Err(EngineError::Unsupported {
                image: name,
                what: format!("an external data file for a {} image", format.name()),
            });
        }
        if snapshot.is_some() {
            return Err(EngineError::Unsupported {
                image: name,
                what: format!("internal snapshots of a {} file", format.name()),
            });
        }
        let (size, format) = if format == Format::Luks {
            let at = LayerFile {
                name: &name,
                len: file_len,
                src: StorageSource::new(&file, file_len),
            };
            let meta = open_luks_volume(&at, key).await?;
            (
                file_len.saturating_sub(meta.payload),
                LayerFormat::Luks(meta),
            )
        } else {
            (file_len, LayerFormat::Raw)
        };
        return Ok(Layer {
            name,
            file,
            size: Cell::new(size),
            format,
            sync_failed: Cell::new(false),
        });
    }
    let at = LayerFile {
        name: &name,
        len: file_len,
        src: StorageSource::new(&file, file_len),
    };
    let given = GivenDataFile {
        path: data_file,
        untrusted,
    };
    let (meta, size) = open_qcow2(opener, &at, path, access, snapshot, key, given).await?;
    Ok(Layer {
        name,
        file,
        size: Cell::new(size),
        format: LayerFormat::Qcow2(meta),
        sync_failed: Cell::new(false),
    })
}

/// The file a layer is being loaded from, with what every error about it needs.
struct LayerFile<'a, S> {
    name: &'a str,
    len: u64,
    src: StorageSource<'a, S>,
}

impl<'a, S: Storage + 'static> LayerFile<'a, S> {
    /// Opening for I/O loads at open strictness: whatever QEMU would refuse, we refuse.
    fn loader(&self) -> Loader<'_, StorageSource<'a, S>> {
        Loader::new(&self.src, Strictness::Open)
    }

    fn load_error(&self, e: MetadataError) -> EngineError {
        EngineError::from_metadata(self.name, e)
    }

    fn format_error(&self, source: crate::format::FormatError) -> EngineError {
        EngineError::Format {
            image: self.name.to_string(),
            source,
        }
    }

    fn corrupt(&self, detail: String) -> EngineError {
        EngineError::Corrupt {
            image: self.name.to_string(),
            detail,
        }
    }

    fn unsupported(&self, what: String) -> EngineError {
        EngineError::Unsupported {
            image: self.name.to_string(),
            what,
        }
    }
}

/// A metadata structure's place in the file, for the checks that structures stay inside the
/// file and apart from each other.
type Region = (u64, u64, &'static str);

/// Reads and validates a qcow2 layer's header and tables; returns them with the guest size
/// (the snapshot's, when a snapshot is opened).
async fn open_qcow2<O>(
    opener: &O,
    at: &LayerFile<'_, O::Storage>,
    path: &Path,
    access: storage::OpenOptions,
    snapshot: Option<&str>,
    key: Unlock<'_>,
    data_file: GivenDataFile<'_>,
) -> Result<(Qcow2Meta<O::Storage>, u64)>
where
    O: Opener,
    O::Storage: 'static,
{
    let header = read_header(at).await?;
    if header.is_corrupt() && !access.read_only {
        return Err(EngineError::MarkedCorrupt {
            image: at.name.to_string(),
        });
    }
    let codec = codec_of(at, &header)?;
    let geom = header.geometry().map_err(|e| at.format_error(e))?;
    // An untrusted image's header is judged before any table it declares is read, its
    // snapshots' L1 tables once the snapshot table is.
    if let Some(u) = data_file.untrusted {
        check_declared(at, &header, &geom, None, &u.caps).await?;
    }
    let (regions, snapshots) = metadata_regions(at, &header, &geom).await?;
    if let Some(u) = data_file.untrusted {
        check_declared(at, &header, &geom, Some(&snapshots), &u.caps).await?;
    }
    let (l1_offset, l1_entries, size) = l1_in_use(at, &header, &snapshots, snapshot, &geom)?;
    let l1 = read_l1(at, &geom, l1_offset, l1_entries, size, &regions).await?;
    let crypto = unlock(at, &header, key).await?;
    let data_file = open_data_file(opener, at, &header, path, data_file, access).await?;
    let data_raw = header.data_file_is_raw();
    let geom = geom.with_data_file(data_file.is_some());
    Ok((
        Qcow2Meta {
            geom,
            refcount_geom: Cell::new(geom),
            header: RefCell::new(header),
            l1: RefCell::new(l1),
            l1_offset: Cell::new(l1_offset),
            data_file,
            data_raw,
            codec,
            file_end: Cell::new(at.len),
            metadata_prealloc: tokio::sync::OnceCell::new(),
            crypto,
        },
        size,
    ))
}

/// An untrusted image's declared sizes against their caps ([`crate::declared`]): the
/// header's (and its LUKS header's) when `snapshots` is `None`, before any table is read or
/// a key slot tried; then its snapshots' L1 tables, before any of them is read.
async fn check_declared<S: Storage + 'static>(
    at: &LayerFile<'_, S>,
    header: &Header,
    geom: &Geometry,
    snapshots: Option<&[(SnapshotTableEntry, u64)]>,
    caps: &crate::declared::Caps,
) -> Result<()> {
    let luks = header.crypt_method != CRYPT_NONE && header.crypt_method != CRYPT_AES;
    let kdf_iterations = match header.fde_pointer() {
        Some(fde) if snapshots.is_none() && luks => {
            let area = read_luks_area(at, fde.offset, fde.length).await?;
            LuksHeader::parse(&area)
                .ok()
                .map(|l| l.info().kdf_iterations())
        }
        _ => None,
    };
    let entries: Vec<SnapshotTableEntry> = snapshots
        .unwrap_or_default()
        .iter()
        .map(|s| s.0.clone())
        .collect();
    let nb_bitmaps = header.bitmaps().map_or(0, |b| u64::from(b.nb_bitmaps));
    let declared = crate::declared::Declared {
        header,
        geom,
        file_len: at.len,
        snapshots: &entries,
        bitmaps: &[],
        bitmap_count: nb_bitmaps,
        kdf_iterations,
    };
    crate::declared::check(&declared, caps).map_err(|source| EngineError::Declared {
        image: at.name.to_string(),
        source,
    })
}

/// The header, refusing what the engine cannot serve.
async fn read_header<S: Storage + 'static>(at: &LayerFile<'_, S>) -> Result<Header> {
    at.loader().header().await.map_err(|e| at.load_error(e))
}

/// The data cipher of an encrypted image, unlocked with `password`: for LUKS, the key slots
/// in the encryption header are tried; the legacy method keys with the password itself.
async fn unlock<S: Storage + 'static>(
    at: &LayerFile<'_, S>,
    header: &Header,
    key: Unlock<'_>,
) -> Result<Option<DataCrypto>> {
    let fail = |source| EngineError::Crypto {
        image: at.name.to_string(),
        source,
    };
    if header.crypt_method == CRYPT_NONE {
        return Ok(None);
    }
    if header.size % SECTOR_SIZE != 0 {
        return Err(at.corrupt(format!(
            "encrypted image of {} bytes, not a whole number of 512-byte sectors",
            header.size
        )));
    }
    let password = match key {
        Unlock::With(p) => Some(p),
        Unlock::Missing => None,
        Unlock::Locked => return Ok(Some(DataCrypto::locked())),
    };
    if header.crypt_method == CRYPT_AES {
        let password = password.ok_or_else(|| fail(CryptoError::MissingSecret))?;
        return Ok(Some(DataCrypto::legacy_aes(password)));
    }
    let fde = header.fde_pointer().ok_or_else(|| {
        at.corrupt(format!(
            "Missing CRYPTO header for crypt method {}",
            header.crypt_method
        ))
    })?;
    let area = read_luks_area(at, fde.offset, fde.length).await?;
    let luks = LuksHeader::parse(&area).map_err(fail)?;
    let password = password.ok_or_else(|| fail(CryptoError::MissingSecret))?;
    let (_, master) = luks.unlock(&area, password).map_err(fail)?;
    let cipher = luks.data_cipher(&master).map_err(fail)?;
    Ok(Some(DataCrypto::luks(cipher)))
}

/// A LUKS volume's header, unlocked with the password (or opened locked, for opens that
/// read no data).
async fn open_luks_volume<S: Storage + 'static>(
    at: &LayerFile<'_, S>,
    key: Unlock<'_>,
) -> Result<LuksMeta> {
    let fail = |source| EngineError::Crypto {
        image: at.name.to_string(),
        source,
    };
    let head = read_luks_area(at, 0, crate::crypto::luks::HEADER_LEN as u64).await?;
    let payload = LuksHeader::area_len_of(&head).map_err(fail)?;
    let area = read_luks_area(at, 0, payload).await?;
    let header = LuksHeader::parse(&area).map_err(fail)?;
    let crypto = match key {
        Unlock::Locked => DataCrypto::locked(),
        Unlock::Missing => return Err(fail(CryptoError::MissingVolumeSecret)),
        Unlock::With(password) => {
            let (_, master) = header.unlock(&area, password).map_err(fail)?;
            DataCrypto::luks_volume(header.data_cipher(&master).map_err(fail)?)
        }
    };
    Ok(LuksMeta { payload, crypto })
}

/// The LUKS area of an image (header and key material), bounded in size.
async fn read_luks_area<S: Storage + 'static>(
    at: &LayerFile<'_, S>,
    offset: u64,
    length: u64,
) -> Result<Vec<u8>> {
    if length > crate::crypto::luks::MAX_AREA {
        return Err(at.corrupt(format!(
            "encryption header of {length} bytes exceeds the limit of {} bytes",
            crate::crypto::luks::MAX_AREA
        )));
    }
    use crate::metadata::MetaSource;
    let buf = at
        .src
        .read(offset, length as usize)
        .await
        .map_err(|source| EngineError::Io {
            image: at.name.to_string(),
            what: "reading the encryption header",
            offset,
            source,
        })?;
    Ok(buf.to_vec())
}

fn codec_of<S: Storage + 'static>(at: &LayerFile<'_, S>, header: &Header) -> Result<Codec> {
    match header.compression_type {
        0 => Ok(Codec::Zlib),
        1 => Ok(Codec::Zstd),
        other => Err(at.unsupported(format!("compression type {other}"))),
    }
}

/// The regions of the header cluster, L1 table, refcount table, snapshot table, bitmap
/// directory and encryption header, checked to lie inside the file and apart; the first three
/// come first. Returns them with the snapshot table, which was read to learn its length.
async fn metadata_regions<S: Storage + 'static>(
    at: &LayerFile<'_, S>,
    header: &Header,
    geom: &Geometry,
) -> Result<(Vec<Region>, Vec<(SnapshotTableEntry, u64)>)> {
    let cs = geom.cluster_size();
    let mut regions: Vec<Region> = vec![(0, cs, "the header cluster")];
    let l1_bytes = u64::from(header.l1_size) * 8;
    regions.push((header.l1_table_offset, l1_bytes, "the L1 table"));
    regions.push((
        header.refcount_table_offset,
        u64::from(header.refcount_table_clusters) * cs,
        "the refcount table",
    ));
    let snapshots = at
        .loader()
        .snapshot_table(header)
        .await
        .map_err(|e| at.load_error(e))?;
    if header.nb_snapshots > 0 {
        // QEMU does not write the padding after the last entry when the table ends the file.
        let padding = snapshots.last().map_or(0, |(e, used)| {
            used - (40 + e.extra_data.len() + e.id.len() + e.name.len()) as u64
        });
        let len = snapshots.iter().map(|s| s.1).sum::<u64>() - padding;
        // What lies past the end of the file read as zeros, as QEMU reads it: only the part
        // inside must keep clear of the other structures.
        let inside = at.len.saturating_sub(header.snapshots_offset).min(len);
        regions.push((header.snapshots_offset, inside, "the snapshot table"));
    }
    if let Some(b) = header.bitmaps() {
        regions.push((b.directory_offset, b.directory_size, "the bitmap directory"));
    }
    if let Some(fde) = header.fde_pointer() {
        regions.push((fde.offset, fde.length, "the encryption header"));
    }
    check_regions(&mut regions, at.len, cs).map_err(|d| at.corrupt(d))?;
    Ok((regions, snapshots))
}

/// The L1 table to read through (the active one, or the wanted snapshot's): its offset,
/// entry count, and the guest size it serves.
fn l1_in_use<S: Storage + 'static>(
    at: &LayerFile<'_, S>,
    header: &Header,
    snapshots: &[(SnapshotTableEntry, u64)],
    snapshot: Option<&str>,
    geom: &Geometry,
) -> Result<(u64, u32, u64)> {
    let Some(wanted) = snapshot else {
        return Ok((header.l1_table_offset, header.l1_size, header.size));
    };
    let by = |pick: fn(&SnapshotTableEntry) -> &[u8]| {
        snapshots
            .iter()
            .map(|s| &s.0)
            .find(|s| pick(s) == wanted.as_bytes())
    };
    let snap =
        by(|s| &s.id)
            .or_else(|| by(|s| &s.name))
            .ok_or_else(|| EngineError::NoSuchSnapshot {
                image: at.name.to_string(),
                wanted: wanted.to_string(),
            })?;
    // QEMU judges a snapshot's L1 table only now that it is to be used, in its words.
    if let Some(problem) = snap.l1_table_problem(geom.cluster_size()) {
        return Err(EngineError::LoadSnapshot {
            image: at.name.to_string(),
            problem,
        });
    }
    let l1_bytes = u64::from(snap.l1_size) * 8;
    let mut r = vec![(snap.l1_table_offset, l1_bytes, "the snapshot's L1 table")];
    check_regions(&mut r, at.len, geom.cluster_size()).map_err(|d| at.corrupt(d))?;
    Ok((
        snap.l1_table_offset,
        snap.l1_size,
        snap.disk_size().unwrap_or(header.size),
    ))
}

/// Reads the L1 table, which must be large enough for `size` and may not point an L2 table
/// at the header, the L1 table or the refcount table (the first three `regions`).
async fn read_l1<S: Storage + 'static>(
    at: &LayerFile<'_, S>,
    geom: &Geometry,
    l1_offset: u64,
    l1_entries: u32,
    size: u64,
    regions: &[Region],
) -> Result<Vec<u64>> {
    let geom_for_size = Geometry::new(
        geom.cluster_bits(),
        geom.extended_l2(),
        geom.refcount_order(),
        size,
    )
    .map_err(|e| at.format_error(e))?;
    let needed = geom
        .l1_entries_needed()
        .max(geom_for_size.l1_entries_needed());
    if u64::from(l1_entries) < geom_for_size.l1_entries_needed() {
        return Err(at.corrupt(format!(
            "L1 table at {l1_offset:#x} has {l1_entries} entries, too few for a virtual size of {size} bytes (needs {needed})"
        )));
    }
    let len = u64::from(l1_entries) * 8;
    let words = at
        .loader()
        .table(Structure::L1Table, L1_TABLE, l1_offset, len)
        .await
        .map_err(|e| at.load_error(e))?;
    let l1 = Qcow2Meta::<S>::validate_l1(words, geom, l1_offset, at.len, at.name)?;
    let cs = geom.cluster_size();
    for (i, &word) in l1.iter().enumerate() {
        let off = crate::format::l1::table_of(word);
        if off == 0 {
            continue;
        }
        for &(start, len, what) in regions.iter().take(3) {
            if off < start.saturating_add(len) && start < off + cs {
                return Err(at.corrupt(format!(
                    "L1 table at {l1_offset:#x}: entry {i} points to an L2 table at {off:#x} that overlaps {what}"
                )));
            }
        }
    }
    Ok(l1)
}

/// What the caller says of a layer's external data file.
#[derive(Clone, Copy, Debug)]
struct GivenDataFile<'a> {
    /// The file to open instead of the one the header names (QEMU's `data-file` option).
    path: Option<&'a Path>,
    /// The image is untrusted: the file its header names must resolve inside the allowed
    /// directories, and the sizes the image declares are capped.
    untrusted: Option<crate::declared::Untrusted>,
}

/// Opens the external data file, if the image has one: `given` (QEMU's `data-file`
/// option), else the one the header names, with the image's own access: it holds the
/// guest's bytes, so it is locked as the image is. An untrusted image's name is refused
/// unless it resolves inside the allowed directories.
async fn open_data_file<O>(
    opener: &O,
    at: &LayerFile<'_, O::Storage>,
    header: &Header,
    path: &Path,
    given: GivenDataFile<'_>,
    access: storage::OpenOptions,
) -> Result<Option<O::Storage>>
where
    O: Opener,
    O::Storage: 'static,
{
    let GivenDataFile {
        path: given,
        untrusted,
    } = given;
    let confine = untrusted.map(|u| u.allow);
    if !header.has_data_file() {
        return match given {
            Some(_) => Err(EngineError::DataFileNotUsed {
                image: at.name.to_string(),
            }),
            None => Ok(None),
        };
    }
    let dpath = match given {
        Some(p) => p.to_path_buf(),
        None => {
            let Some(dname) = header.data_file_name() else {
                return Err(
                    at.unsupported("an external data file without a name in the image".into())
                );
            };
            let dname = String::from_utf8(dname.to_vec())
                .map_err(|_| at.corrupt("external data file name is not UTF-8".into()))?;
            match confine {
                None => backing_name::resolve(path, &dname)?,
                Some(allowed) => confined_data_file(opener, path, &dname, allowed, access).await?,
            }
        }
    };
    let access = storage::OpenOptions {
        confine: confine.filter(|_| given.is_none()),
        ..access
    };
    let file = opener
        .open(&dpath, access)
        .await
        .map_err(|source| EngineError::Open {
            path: dpath.display().to_string(),
            source,
        })?;
    Ok(Some(file))
}

/// The path of the data file an untrusted image names, once it is shown to resolve inside
/// `allowed` (the open that follows checks its descriptor again).
async fn confined_data_file<O: Opener>(
    opener: &O,
    path: &Path,
    name: &str,
    allowed: &storage::AllowDirs,
    access: storage::OpenOptions,
) -> Result<PathBuf> {
    use backing_name::Reference;
    let dpath = backing_name::resolve_untrusted(path, name, Reference::DataFile)?;
    let canonical = opener
        .canonical(&dpath, access)
        .await
        .map_err(|source| EngineError::Open {
            path: dpath.display().to_string(),
            source,
        })?;
    backing_name::admit(allowed, path, name, Reference::DataFile, &canonical)?;
    Ok(dpath)
}

/// The snapshot table of a layer opened for I/O, each entry with the bytes it occupies.
pub(crate) async fn snapshot_table<S: Storage + 'static>(
    file: &S,
    name: &str,
    header: &Header,
    file_len: u64,
) -> Result<Vec<(SnapshotTableEntry, u64)>> {
    let src = StorageSource::new(file, file_len);
    Loader::new(&src, Strictness::Open)
        .snapshot_table(header)
        .await
        .map_err(|e| EngineError::from_metadata(name, e))
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
