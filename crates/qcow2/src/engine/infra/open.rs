//! Opening an image and its backing chain: probing, validating every structure against the
//! file and against each other, and sizing the shared metadata cache.

use super::backing_name::{self, ChainGuard, Reference};
use super::cache_sizing::{self, CacheOptions, ImageParams, ResolvedCacheSizes};
use super::chain::Chain;
use super::error::{EngineError, Result};
use super::image::{Image, Inner};
use super::layer::Layer;
use super::load::{open_layer, Format, LayerChoices};
use super::metacache::L2Backend;
use super::metacache::L2Cache;
use crate::declared::Untrusted;
use crate::engine::alloc::Allocator;
use std::path::{Path, PathBuf};
use std::rc::Rc;
use storage::{Opener, Storage};

/// How to open an image.
#[derive(Clone, Debug, Default)]
pub struct OpenOptions {
    /// Refuse writes.
    pub read_only: bool,
    /// Format of the opened file; `None` accepts qcow2 only (a raw file must be asked for,
    /// so a guest cannot turn a raw disk into a qcow2 header pointing at host files).
    pub format: Option<Format>,
    /// Metadata cache options (`l2-cache-size` and friends).
    pub cache: CacheOptions,
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
    /// How long opening each file of the chain may take, and how many given-up opens may
    /// stay stuck (see [`storage::bounded`]).
    pub open_bound: storage::OpenBound,
    /// Passwords of the encrypted layers, by depth in the chain.
    pub passwords: crate::crypto::Passwords,
    /// Open to read metadata only (QEMU's "no I/O" opens): encrypted layers without a
    /// password open locked instead of being refused.
    pub no_io: bool,
    /// The top image's external data file, instead of the one its header names (QEMU's
    /// `data-file.filename` option). Refused for an image without an external data file.
    pub data_file: Option<std::path::PathBuf>,
    /// The image comes from an author not trusted with host files (`--untrusted`): every
    /// file it names (backing files, data files, down the chain) must resolve inside
    /// these directories, and names that are not files are refused, before anything is
    /// read from them.
    pub untrusted: Option<Untrusted>,
    /// Flushes of the image's files return at once, durable or not (QEMU's `cache=unsafe`,
    /// `qemu-img convert`'s default): the metadata's write order no longer reaches the
    /// disk, so a host crash may leave the image inconsistent.
    pub ignore_flush: bool,
}

impl<S: Storage + 'static> Image<S> {
    /// Opens `path` and its backing chain.
    pub async fn open<O>(opener: &O, path: &Path, opts: &OpenOptions) -> Result<Image<S>>
    where
        O: Opener<Storage = S>,
    {
        let read_only = opts.read_only || opts.snapshot.is_some();
        let access = storage::OpenOptions {
            read_only,
            direct: opts.direct,
            force_share: opts.force_share,
            bound: opts.open_bound,
            ignore_flush: opts.ignore_flush,
            ..storage::OpenOptions::default()
        };
        let mut guard = ChainGuard::default();
        let key = canonical(opener, path, access).await?;
        guard.enter_as(path, path, key)?;
        let top = open_layer(
            opener,
            path,
            opts.format,
            access,
            LayerChoices {
                snapshot: opts.snapshot.as_deref(),
                data_file: opts.data_file.as_deref(),
                untrusted: opts.untrusted,
            },
            true,
            opts.passwords.unlock(0, opts.no_io),
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
            let next_path: PathBuf = match opts.untrusted {
                None => backing_name::resolve(last_path, &name)?,
                Some(_) => {
                    backing_name::resolve_untrusted(last_path, &name, Reference::BackingFile)?
                }
            };
            // A backing file that cannot be opened is named with the chain that needs it.
            let above: Vec<String> = layers.iter().map(|l| l.name.clone()).collect();
            let backing_open = |e: EngineError| match e {
                EngineError::Open { path, source } => EngineError::BackingOpen {
                    images: above.clone(),
                    path,
                    source,
                },
                other => other,
            };
            let key = canonical(opener, &next_path, access)
                .await
                .map_err(backing_open)?;
            if let Some(u) = opts.untrusted {
                backing_name::admit(u.allow, last_path, &name, Reference::BackingFile, &key)?;
            }
            guard.enter_as(last_path, &next_path, key)?;
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
                confine: opts.untrusted.map(|u| u.allow),
                ..access
            };
            let layer = open_layer(
                opener,
                &next_path,
                fmt,
                backing,
                LayerChoices {
                    untrusted: opts.untrusted,
                    ..LayerChoices::default()
                },
                false,
                opts.passwords.unlock(layers.len(), opts.no_io),
            )
            .await
            .map_err(backing_open)?;
            layers.push(layer);
            paths.push(next_path);
        }
        build(layers, read_only, opts).await
    }
}

/// The name `path` is known by in a chain, as the opener finds it.
async fn canonical<O: Opener>(
    opener: &O,
    path: &Path,
    access: storage::OpenOptions,
) -> Result<PathBuf> {
    opener
        .canonical(path, access)
        .await
        .map_err(|source| EngineError::Open {
            path: path.display().to_string(),
            source,
        })
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
            let params = ImageParams {
                cluster_size: m.geom.cluster_size(),
                virtual_size: layers[0].size.get(),
                extended_l2: m.geom.extended_l2(),
                refcount_bits: m.geom.refcount_bits(),
            };
            drop(h);
            let sizes = cache_sizing::resolve_sizes(cache_opts, &params).map_err(|source| {
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
            let slice = if Chain::<S>::wants_backing_map(layers.len()) {
                sizes.l2_entry_size.min(cache_sizing::SMALL_L2_ENTRY_SIZE)
            } else {
                sizes.l2_entry_size
            };
            (sizes, slice.min(smallest))
        }
        None => {
            // Raw top layer: no L2 tables; a token cache keeps the types simple.
            let sizes = ResolvedCacheSizes {
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
    let chain = Chain::new(layers.clone(), Rc::new(l2), cache_sizes.l2_cache_bytes)?;
    // Nothing is written until every check that can refuse a read-write open has passed:
    // a refused open leaves the file as it was.
    let alloc = match layers[0].qcow2() {
        Some(m) if !read_only => {
            let bytes = cache_sizes.refcount_cache_bytes;
            let checked = Allocator::open(&layers, &chain.l2, bytes).await?;
            if m.header.borrow().is_dirty() {
                // Lazy refcounts may be stale after a crash: rebuild them before any write,
                // then load the rebuilt ones.
                drop(checked);
                crate::check::repair_dirty_layer(&layers[0]).await?;
                Some(Allocator::open(&layers, &chain.l2, bytes).await?)
            } else {
                Some(checked)
            }
        }
        _ => None,
    };
    let image = Image {
        inner: Rc::new(Inner::new(
            chain,
            read_only,
            cache_sizes,
            alloc,
            opts.discard_passthrough,
        )),
    };
    if let Some(a) = image.inner.writer() {
        a.clear_unknown_autoclear().await?;
        a.claim_bitmaps().await?;
    }
    Ok(image)
}
