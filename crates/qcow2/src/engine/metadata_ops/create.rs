//! Creating images the way `qemu-img create` lays them out: header, refcount table, refcount
//! block(s) and L1 table in the first clusters, with the feature name table and (for backed
//! images) the backing format extension; preallocation runs through the normal allocator.

use crate::crypto::LuksCreate;
use crate::engine::infra::compress::Codec;
use crate::engine::infra::error::{EngineError, Result};
use crate::engine::infra::image::Image;
use crate::engine::infra::load::Format;
use crate::engine::infra::open::OpenOptions;
use crate::format::extensions::FdeHeaderPointer;
use crate::format::extensions::{FeatureNameEntry, FeatureNameTable};
use crate::format::features::{
    known_feature_name, FeatureKind, AUTOCLEAR_DATA_FILE_RAW, COMPAT_LAZY_REFCOUNTS,
    INCOMPAT_COMPRESSION, INCOMPAT_DATA_FILE, INCOMPAT_EXTENDED_L2,
};
use crate::format::header::{CRYPT_AES, CRYPT_LUKS};
use crate::format::{be, limits, refcount, Geometry, Header, HeaderExtension};
use storage::{IoBuf, Opener, Storage};

/// How much of the disk to allocate up front (`preallocation=`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Preallocation {
    /// Nothing.
    #[default]
    Off,
    /// L2 tables and data clusters, without touching the data.
    Metadata,
    /// Metadata, plus the data area reserved with fallocate.
    Falloc,
    /// Metadata, plus the data area written with zeros.
    Full,
}

impl Preallocation {
    /// Parses QEMU's names.
    pub fn from_name(name: &str) -> Option<Preallocation> {
        match name {
            "off" => Some(Preallocation::Off),
            "metadata" => Some(Preallocation::Metadata),
            "falloc" => Some(Preallocation::Falloc),
            "full" => Some(Preallocation::Full),
            _ => None,
        }
    }
}

/// Everything `create` needs; the defaults are `qemu-img create -f qcow2`'s.
#[derive(Clone, Debug)]
pub struct CreateOptions {
    /// Virtual size in bytes (rounded up to 512 as QEMU does).
    pub size: u64,
    /// Cluster size (a power of two, 512 B .. 2 MiB).
    pub cluster_size: u64,
    /// Extended L2 entries (32 subclusters per cluster).
    pub extended_l2: bool,
    /// Bits per refcount (1, 2, 4, ... 64).
    pub refcount_bits: u32,
    /// Codec for compressed clusters.
    pub compression: Codec,
    /// Lazy refcounts (compatible feature bit 0).
    pub lazy_refcounts: bool,
    /// 2 for compat=0.10, 3 for compat=1.1.
    pub version: u32,
    /// Up-front allocation.
    pub preallocation: Preallocation,
    /// Backing file name as it is stored, and its format.
    pub backing: Option<(String, Format)>,
    /// External data file name, stored as given; the file is created (replacing any file
    /// there) as QEMU creates it: relative to the working directory, sized to the disk.
    pub data_file: Option<String>,
    /// The data file stays a valid raw image of the disk (`data_file_raw`): every cluster is
    /// mapped to the same offset up front, so `Off` preallocation becomes `Metadata`.
    pub data_file_raw: bool,
    /// Encryption of the new image's data.
    pub encryption: Option<NewEncryption>,
}

/// How a new image is encrypted.
#[derive(Clone)]
pub enum NewEncryption {
    /// LUKS (`encrypt.format=luks`), `password` in key slot 0.
    Luks {
        /// The key slot's password.
        password: Vec<u8>,
        /// Cipher, hash and PBKDF2 time.
        opts: LuksCreate,
    },
    /// The legacy AES-CBC method (`encryption=on`, `encrypt.format=aes`).
    LegacyAes {
        /// The password (the key itself), for preallocation only.
        password: Vec<u8>,
    },
}

impl std::fmt::Debug for NewEncryption {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // Never the password.
        match self {
            NewEncryption::Luks { opts, .. } => f.debug_struct("Luks").field("opts", opts).finish(),
            NewEncryption::LegacyAes { .. } => f.write_str("LegacyAes"),
        }
    }
}

impl CreateOptions {
    /// The password a new encrypted image opens with, as open options take it.
    pub fn passwords(&self) -> crate::crypto::Passwords {
        let mut p = crate::crypto::Passwords::default();
        if let Some(e) = &self.encryption {
            p.set(0, e.password().to_vec());
        }
        p
    }
}

impl NewEncryption {
    fn password(&self) -> &[u8] {
        match self {
            NewEncryption::Luks { password, .. } | NewEncryption::LegacyAes { password } => {
                password
            }
        }
    }
}

impl Default for CreateOptions {
    fn default() -> Self {
        CreateOptions {
            size: 0,
            cluster_size: 65536,
            extended_l2: false,
            refcount_bits: 16,
            compression: Codec::Zlib,
            lazy_refcounts: false,
            version: 3,
            preallocation: Preallocation::Off,
            backing: None,
            data_file: None,
            data_file_raw: false,
            encryption: None,
        }
    }
}

fn invalid(what: impl Into<String>) -> EngineError {
    EngineError::Unsupported {
        image: "new image".into(),
        what: what.into(),
    }
}

impl CreateOptions {
    /// The preallocation the image gets: `data_file_raw` needs every cluster mapped.
    pub fn effective_preallocation(&self) -> Preallocation {
        if self.data_file_raw && self.preallocation == Preallocation::Off {
            Preallocation::Metadata
        } else {
            self.preallocation
        }
    }

    /// The checks `qemu-img create` makes, with its messages' substance.
    fn validate(&self) -> Result<(u32, u32)> {
        let cs = self.cluster_size;
        if !cs.is_power_of_two() || !(512..=2 << 20).contains(&cs) {
            return Err(invalid(format!(
                "cluster size {cs} (it must be a power of two between 512 and 2M)"
            )));
        }
        let cluster_bits = cs.trailing_zeros();
        if !self.refcount_bits.is_power_of_two() || self.refcount_bits > 64 {
            return Err(invalid(format!(
                "refcount_bits={} (it must be a power of two up to 64)",
                self.refcount_bits
            )));
        }
        if !(2..=3).contains(&self.version) {
            return Err(invalid(format!("version {}", self.version)));
        }
        let v3 = self.version == 3;
        if !v3 {
            if self.refcount_bits != 16 {
                return Err(invalid("refcount_bits other than 16 with compat=0.10"));
            }
            if self.lazy_refcounts {
                return Err(invalid("lazy refcounts with compat=0.10 (use compat=1.1)"));
            }
            if self.extended_l2 {
                return Err(invalid(
                    "extended L2 entries with compat=0.10 (use compat=1.1)",
                ));
            }
            if self.compression != Codec::Zlib {
                return Err(invalid(
                    "zstd compression with compat=0.10 (use compat=1.1)",
                ));
            }
        }
        if self.extended_l2 && cluster_bits < limits::MIN_CLUSTER_BITS_EXTENDED_L2 {
            return Err(invalid(format!(
                "extended L2 entries with {cs}-byte clusters (they need at least 16k)"
            )));
        }
        if self.data_file.is_some() && !v3 {
            return Err(invalid(
                "an external data file with compat=0.10 (use compat=1.1)",
            ));
        }
        if self.data_file_raw && self.data_file.is_none() {
            return Err(invalid("data_file_raw without a data file"));
        }
        if self.data_file_raw && self.backing.is_some() {
            return Err(invalid("data_file_raw together with a backing file"));
        }
        if let Some((name, _)) = &self.backing {
            if name.len() > limits::MAX_BACKING_FILE_NAME as usize {
                return Err(invalid("a backing file name longer than 1023 bytes"));
            }
            if self.preallocation != Preallocation::Off {
                return Err(invalid("preallocation together with a backing file"));
            }
        }
        Ok((cluster_bits, self.refcount_bits.trailing_zeros()))
    }
}

/// QEMU's feature name table: every feature bit it knows, named.
pub(crate) fn feature_table() -> FeatureNameTable {
    let mut entries = Vec::new();
    for kind in [
        FeatureKind::Incompatible,
        FeatureKind::Compatible,
        FeatureKind::Autoclear,
    ] {
        for bit in 0..64u8 {
            if let Some(name) = known_feature_name(kind, u32::from(bit)) {
                entries.push(FeatureNameEntry::new(kind, bit, name));
            }
        }
    }
    FeatureNameTable {
        entries,
        trailing: Vec::new(),
    }
}

/// Where a new image's first clusters go: the header, the refcount table, the refcount
/// blocks covering all of them, then the L1 table.
struct Layout {
    cluster_size: u64,
    l1_entries: u64,
    /// Refcount table clusters.
    rt: u64,
    /// Refcount blocks.
    rb: u64,
    /// L1 table clusters.
    l1_clusters: u64,
    /// Encryption header clusters (after the L1 table).
    crypt_clusters: u64,
    /// Clusters of all the metadata (the L1 table and encryption header included).
    total: u64,
}

impl Layout {
    fn plan(geom: &Geometry, crypt_bytes: u64) -> Result<Layout> {
        let cs = geom.cluster_size();
        let l1_entries = geom.l1_entries_needed();
        if l1_entries * 8 > limits::MAX_L1_SIZE_BYTES {
            return Err(invalid(format!(
                "a virtual size of {} bytes with {cs}-byte clusters (the L1 table would exceed 32 MiB)",
                geom.virtual_size()
            )));
        }
        let l1_clusters = (l1_entries * 8).div_ceil(cs).max(1);
        let crypt_clusters = crypt_bytes.div_ceil(cs);
        let epb = geom.refcount_block_entries();
        // Enough blocks to count the blocks themselves and the table that points to them.
        let (mut rt, mut rb) = (1u64, 1u64);
        loop {
            let total = 1 + rt + rb + l1_clusters + crypt_clusters;
            let need_rb = total.div_ceil(epb);
            let need_rt = (need_rb * 8).div_ceil(cs);
            if need_rb <= rb && need_rt <= rt {
                break;
            }
            rb = rb.max(need_rb);
            rt = rt.max(need_rt);
        }
        Ok(Layout {
            cluster_size: cs,
            l1_entries,
            rt,
            rb,
            l1_clusters,
            crypt_clusters,
            total: 1 + rt + rb + l1_clusters + crypt_clusters,
        })
    }

    fn reftable_offset(&self) -> u64 {
        self.cluster_size
    }

    fn refblock_offset(&self) -> u64 {
        (1 + self.rt) * self.cluster_size
    }

    fn l1_offset(&self) -> u64 {
        (1 + self.rt + self.rb) * self.cluster_size
    }

    fn crypt_offset(&self) -> u64 {
        (1 + self.rt + self.rb + self.l1_clusters) * self.cluster_size
    }
}

fn new_image_format_error(source: crate::format::FormatError) -> EngineError {
    EngineError::Format {
        image: "new image".into(),
        source,
    }
}

/// The header of a new image laid out as `layout` says.
fn new_header(
    opts: &CreateOptions,
    geom: &Geometry,
    refcount_order: u32,
    layout: &Layout,
    luks_len: Option<u64>,
) -> Result<Header> {
    let mut h = Header::new(opts.version, geom.cluster_bits(), geom.virtual_size());
    h.refcount_order = refcount_order;
    h.l1_size = u32::try_from(layout.l1_entries).map_err(|_| invalid("an L1 table that large"))?;
    h.l1_table_offset = layout.l1_offset();
    h.refcount_table_offset = layout.reftable_offset();
    h.refcount_table_clusters = layout.rt as u32;
    if opts.version >= 3 {
        if opts.extended_l2 {
            h.incompatible_features |= INCOMPAT_EXTENDED_L2;
        }
        if opts.compression == Codec::Zstd {
            h.incompatible_features |= INCOMPAT_COMPRESSION;
            h.compression_type = 1;
        }
        if opts.lazy_refcounts {
            h.compatible_features |= COMPAT_LAZY_REFCOUNTS;
        }
        if opts.data_file.is_some() {
            h.incompatible_features |= INCOMPAT_DATA_FILE;
        }
        if opts.data_file_raw {
            h.autoclear_features |= AUTOCLEAR_DATA_FILE_RAW;
        }
    }
    if let Some((name, fmt)) = &opts.backing {
        let fmt = fmt.name();
        h.extensions
            .push(HeaderExtension::BackingFormat(fmt.as_bytes().to_vec()));
        h.backing_file = Some(name.as_bytes().to_vec());
    }
    if let Some(name) = &opts.data_file {
        h.extensions
            .push(HeaderExtension::ExternalDataFile(name.as_bytes().to_vec()));
    }
    match &opts.encryption {
        None => {}
        Some(NewEncryption::LegacyAes { .. }) => h.crypt_method = CRYPT_AES,
        Some(NewEncryption::Luks { .. }) => {
            h.crypt_method = CRYPT_LUKS;
            h.extensions
                .push(HeaderExtension::FullDiskEncryption(FdeHeaderPointer {
                    offset: layout.crypt_offset(),
                    length: luks_len.unwrap_or(0),
                }));
        }
    }
    if opts.version >= 3 {
        h.extensions
            .push(HeaderExtension::FeatureNameTable(feature_table()));
    }
    Ok(h)
}

/// Encodes the header; like QEMU, leaves the (optional) feature name table out when it does
/// not fit in the first cluster.
fn encode_header(mut h: Header, cs: u64) -> Result<Vec<u8>> {
    let is_names = |e: &HeaderExtension| matches!(e, HeaderExtension::FeatureNameTable(_));
    match h.encode(cs) {
        Ok(bytes) => Ok(bytes),
        Err(_) if h.extensions.iter().any(is_names) => {
            h.extensions.retain(|e| !is_names(e));
            h.encode(cs).map_err(new_image_format_error)
        }
        Err(e) => Err(new_image_format_error(e)),
    }
}

/// The header cluster, the refcount table and the refcount blocks, every metadata cluster
/// counted once.
fn first_clusters(
    header: &[u8],
    layout: &Layout,
    geom: &Geometry,
    refcount_order: u32,
) -> Result<IoBuf> {
    let cs = layout.cluster_size;
    let epb = geom.refcount_block_entries();
    let (reftable_off, refblock_off) = (layout.reftable_offset(), layout.refblock_offset());
    // Built in the buffer that is written: these clusters are large with large clusters.
    let mut meta = IoBuf::zeroed(((1 + layout.rt + layout.rb) * cs) as usize);
    meta[..header.len()].copy_from_slice(header);
    for j in 0..layout.rb {
        let entry = (reftable_off + j * 8) as usize;
        meta[entry..entry + 8].copy_from_slice(&be::word_bytes(refblock_off + j * cs));
    }
    for c in 0..layout.total {
        let block = (refblock_off + (c / epb) * cs) as usize;
        refcount::set(
            &mut meta[block..block + cs as usize],
            refcount_order,
            (c % epb) as usize,
            1,
        )
        .map_err(new_image_format_error)?;
    }
    Ok(meta)
}

/// Writes a new, empty image into `file` (which should be empty).
pub async fn create<S: Storage + 'static>(file: &S, opts: &CreateOptions) -> Result<()> {
    let (cluster_bits, refcount_order) = opts.validate()?;
    let size = opts.size.div_ceil(512) * 512;
    let geom = Geometry::new(cluster_bits, opts.extended_l2, refcount_order, size)
        .map_err(new_image_format_error)?;
    // A new LUKS area (key slot 0 filled) goes into clusters of its own after the L1 table.
    let luks = match &opts.encryption {
        Some(NewEncryption::Luks { password, opts }) => Some(
            crate::crypto::luks::create(password, opts).map_err(|source| EngineError::Crypto {
                image: "new image".into(),
                source,
            })?,
        ),
        _ => None,
    };
    let luks_len = luks.as_ref().map(|(area, _)| area.len() as u64);
    let layout = Layout::plan(&geom, luks_len.unwrap_or(0))?;
    let header = new_header(opts, &geom, refcount_order, &layout, luks_len)?;
    let header = encode_header(header, layout.cluster_size)?;
    let meta = first_clusters(&header, &layout, &geom, refcount_order)?;
    let io = |what: &'static str, offset: u64| {
        move |source| EngineError::Io {
            image: "new image".into(),
            what,
            offset,
            source,
        }
    };
    file.set_len(0).await.map_err(io("truncating", 0))?;
    // An NBD export keeps its size and its old bytes, so nothing past what is written here
    // can be taken to read as zeros.
    let kept_old_bytes = file.len().await.map_err(io("getting the file size", 0))? > 0;
    let (res, _) = file.write_at(meta.into(), 0).await;
    res.map_err(io("writing the metadata", 0))?;
    // The L1 table is all zeros: the file just has to reach its end, as QEMU leaves it.
    let l1_off = layout.l1_offset();
    let l1_len = layout.l1_entries * 8;
    if kept_old_bytes {
        file.write_zeroes_at(l1_off, l1_len, false)
            .await
            .map_err(io("zeroing the L1 table", l1_off))?;
    }
    file.set_len(l1_off + l1_len)
        .await
        .map_err(io("sizing the file", l1_off))?;
    if let Some((area, _)) = &luks {
        let at = layout.crypt_offset();
        // Whole clusters, zero past the area, as QEMU leaves them.
        let mut bytes = area.clone();
        bytes.resize((layout.crypt_clusters * layout.cluster_size) as usize, 0);
        let (res, _) = file.write_at(IoBuf::from_slice(&bytes).into(), at).await;
        res.map_err(io("writing the encryption header", at))?;
    }
    file.flush().await.map_err(io("flushing", 0))?;
    Ok(())
}

/// Opens `path` for writing through `opener`, creating it if it does not exist.
async fn open_to_create<O: Opener>(opener: &O, path: &std::path::Path) -> Result<O::Storage> {
    let options = storage::OpenOptions {
        read_only: false,
        create: true,
        ..storage::OpenOptions::default()
    };
    opener
        .open(path, options)
        .await
        .map_err(|source| EngineError::Open {
            path: path.display().to_string(),
            source,
        })
}

/// Creates `path` with `opts` through `opener` and, if asked, preallocates it.
pub async fn create_file<O>(opener: &O, path: &std::path::Path, opts: &CreateOptions) -> Result<()>
where
    O: Opener,
    O::Storage: 'static,
{
    let file = open_to_create(opener, path).await?;
    opts.validate()?;
    if let Some(name) = &opts.data_file {
        create_data_file(opener, std::path::Path::new(name), opts.size).await?;
    }
    create(&file, opts).await?;
    drop(file);
    let preallocation = opts.effective_preallocation();
    if preallocation != Preallocation::Off {
        let passwords = opts.passwords();
        let img = Image::open(
            opener,
            path,
            &OpenOptions {
                no_backing: true,
                passwords,
                ..OpenOptions::default()
            },
        )
        .await?;
        img.preallocate(preallocation).await?;
        img.close().await?;
    }
    Ok(())
}

/// Creates an external data file as QEMU's `file` driver creates one: emptied, then sized to
/// the disk (sparse but for its first block).
async fn create_data_file<O>(opener: &O, path: &std::path::Path, size: u64) -> Result<()>
where
    O: Opener,
{
    let file = open_to_create(opener, path).await?;
    let size = size.div_ceil(512) * 512;
    let io = |what: &'static str| {
        move |source| EngineError::Io {
            image: path.display().to_string(),
            what,
            offset: 0,
            source,
        }
    };
    file.set_len(0)
        .await
        .map_err(io("truncating the data file"))?;
    file.set_len(size)
        .await
        .map_err(io("sizing the data file"))?;
    // QEMU's `file` driver grows the new data file from empty, writing its first block; a
    // failure there is ignored, as QEMU ignores it.
    let _ = storage::allocate_first_block(&file, size).await;
    file.flush().await.map_err(io("flushing the data file"))?;
    Ok(())
}
