//! How big the L2 and refcount caches are, decided exactly as QEMU decides it
//! (`read_cache_sizes` and `qcow2_update_options_prepare` in block/qcow2.c, documented in
//! docs/qcow2-cache.txt): a pure function from the user's options and the image geometry.

use cache::CacheConfig;

const KIB: u64 = 1 << 10;
const MIB: u64 = 1 << 20;

/// Upper bound of the L2 cache when `l2-cache-size` is not given (QEMU's value on Linux).
pub const DEFAULT_L2_CACHE_MAX_SIZE: u64 = 32 * MIB;
/// Default `cache-clean-interval` in seconds (QEMU's value on Linux).
pub const DEFAULT_CACHE_CLEAN_INTERVAL: u64 = 600;
/// The L2 cache never has fewer entries than this (copy-on-write needs two slices at once).
pub const MIN_L2_CACHE_ENTRIES: u64 = 2;
/// The refcount cache never has fewer clusters than this (refcount-table growth needs four).
pub const MIN_REFCOUNT_CACHE_CLUSTERS: u64 = 4;
/// Entry size used when the L2 cache cannot cover the whole disk (and no size was asked for).
pub const SMALL_L2_ENTRY_SIZE: u64 = 4 * KIB;
/// Smallest cluster and L2 entry size QEMU accepts.
pub const MIN_CLUSTER_SIZE: u64 = 512;
/// Largest cluster size QEMU accepts.
pub const MAX_CLUSTER_SIZE: u64 = 2 * MIB;
/// Both caches are limited to this many entries (QEMU keeps the count in a C `int`).
pub const MAX_CACHE_ENTRIES: u64 = i32::MAX as u64;

/// The user's cache options, as given (`None` = not set); sizes in bytes, interval in seconds.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct CacheOptions {
    /// `l2-cache-size`: maximum bytes of the L2 cache.
    pub l2_cache_size: Option<u64>,
    /// `l2-cache-entry-size`: bytes of one L2 cache entry (a slice of an L2 table).
    pub l2_cache_entry_size: Option<u64>,
    /// `refcount-cache-size`: bytes of the refcount-block cache.
    pub refcount_cache_size: Option<u64>,
    /// `cache-size`: bytes of both caches together.
    pub cache_size: Option<u64>,
    /// `cache-clean-interval`: seconds between idle cleanings, 0 = never.
    pub cache_clean_interval: Option<u64>,
}

/// The image facts the sizing depends on (from the qcow2 header).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ImageParams {
    /// Bytes per cluster (a power of two, 512 B .. 2 MiB).
    pub cluster_size: u64,
    /// Guest-visible size in bytes.
    pub virtual_size: u64,
    /// Extended L2 entries (subclusters): 16-byte L2 entries instead of 8.
    pub extended_l2: bool,
    /// Bits per refcount (a power of two, 1 ..= 64).
    pub refcount_bits: u32,
}

impl ImageParams {
    /// Bytes of one L2 table entry.
    pub fn l2_entry_bytes(&self) -> u64 {
        if self.extended_l2 {
            16
        } else {
            8
        }
    }
}

/// The sizes to build the caches with.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ResolvedCacheSizes {
    /// Bytes of the L2 cache: a whole number of entries.
    pub l2_cache_bytes: u64,
    /// Bytes of one L2 cache entry.
    pub l2_entry_size: u64,
    /// Bytes of the refcount cache: a whole number of clusters.
    pub refcount_cache_bytes: u64,
    /// Bytes of one refcount cache entry (always the cluster size).
    pub refcount_entry_size: u64,
    /// Seconds between idle cleanings, 0 = never.
    pub clean_interval_secs: u64,
}

impl ResolvedCacheSizes {
    /// Number of L2 cache entries.
    pub fn l2_entries(&self) -> u64 {
        self.l2_cache_bytes / self.l2_entry_size
    }

    /// Number of refcount cache entries.
    pub fn refcount_entries(&self) -> u64 {
        self.refcount_cache_bytes / self.refcount_entry_size
    }

    /// Guest bytes the L2 cache maps when full (`l2_cache_size * cluster_size / 8`, or `/ 16`
    /// with extended L2 entries), saturating at `u64::MAX`.
    pub fn l2_coverage(&self, image: &ImageParams) -> u64 {
        let covered = u128::from(self.l2_cache_bytes) * u128::from(image.cluster_size)
            / u128::from(image.l2_entry_bytes());
        u64::try_from(covered).unwrap_or(u64::MAX)
    }

    /// Guest bytes whose refcounts the refcount cache holds when full
    /// (`refcount_cache_size * cluster_size * 8 / refcount_bits`), saturating at `u64::MAX`.
    pub fn refcount_coverage(&self, image: &ImageParams) -> u64 {
        let bits = u128::from(image.refcount_bits.max(1));
        let covered =
            u128::from(self.refcount_cache_bytes) * u128::from(image.cluster_size) * 8 / bits;
        u64::try_from(covered).unwrap_or(u64::MAX)
    }

    /// Configuration for the L2 cache named `name`.
    pub fn l2_cache_config(&self, name: &str) -> CacheConfig {
        CacheConfig::new(
            name,
            usize::try_from(self.l2_entry_size).unwrap_or(usize::MAX),
            self.l2_cache_bytes,
        )
    }

    /// Configuration for the refcount cache named `name`.
    pub fn refcount_cache_config(&self, name: &str) -> CacheConfig {
        CacheConfig::new(
            name,
            usize::try_from(self.refcount_entry_size).unwrap_or(usize::MAX),
            self.refcount_cache_bytes,
        )
    }
}

/// Why cache options are unusable; messages follow QEMU's.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum CacheSizeError {
    /// `cache-size`, `l2-cache-size` and `refcount-cache-size` were all given.
    #[error("cache-size, l2-cache-size and refcount-cache-size may not be set at the same time")]
    AllThreeSet,
    /// `l2-cache-size` is larger than `cache-size`.
    #[error("l2-cache-size may not exceed cache-size")]
    L2ExceedsCombined,
    /// `refcount-cache-size` is larger than `cache-size`.
    #[error("refcount-cache-size may not exceed cache-size")]
    RefcountExceedsCombined,
    /// `l2-cache-entry-size` is not a power of two between 512 and the cluster size.
    #[error(
        "L2 cache entry size must be a power of two between 512 and the cluster size \
         ({cluster_size}); got {entry_size}"
    )]
    BadL2EntrySize {
        /// The entry size that was asked for (or defaulted to).
        entry_size: u64,
        /// The image's cluster size.
        cluster_size: u64,
    },
    /// More L2 cache entries than QEMU allows.
    #[error("L2 cache size too big ({entries} entries, at most {MAX_CACHE_ENTRIES})")]
    L2CacheTooBig {
        /// The entry count the options asked for.
        entries: u64,
    },
    /// More refcount cache entries than QEMU allows.
    #[error("Refcount cache size too big ({entries} entries, at most {MAX_CACHE_ENTRIES})")]
    RefcountCacheTooBig {
        /// The entry count the options asked for.
        entries: u64,
    },
    /// `cache-clean-interval` does not fit QEMU's `unsigned int`.
    #[error("Cache clean interval too big ({secs} s, at most {} s)", u32::MAX)]
    CleanIntervalTooBig {
        /// The interval that was asked for.
        secs: u64,
    },
    /// The image geometry is outside what QEMU accepts (a corrupt or hostile header).
    #[error("image {field} is {value}: {reason}")]
    InvalidImage {
        /// Which `ImageParams` field.
        field: &'static str,
        /// Its value.
        value: u64,
        /// What it should be.
        reason: &'static str,
    },
}

fn check_image(image: &ImageParams) -> Result<(), CacheSizeError> {
    let cluster = image.cluster_size;
    if !cluster.is_power_of_two() || !(MIN_CLUSTER_SIZE..=MAX_CLUSTER_SIZE).contains(&cluster) {
        return Err(CacheSizeError::InvalidImage {
            field: "cluster_size",
            value: cluster,
            reason: "must be a power of two between 512 and 2097152",
        });
    }
    let bits = image.refcount_bits;
    if !bits.is_power_of_two() || bits > 64 {
        return Err(CacheSizeError::InvalidImage {
            field: "refcount_bits",
            value: u64::from(bits),
            reason: "must be a power of two between 1 and 64",
        });
    }
    Ok(())
}

/// Decide the cache sizes for an image from the user's options, exactly as QEMU does.
///
/// The rules, in QEMU's order:
/// - the L2 cache is at most `l2-cache-size` (default 32 MiB) and at most what holds every L2
///   table of the disk (rounded up to a whole cluster);
/// - with `cache-size`: all three options set is an error, as is `l2-cache-size` or
///   `refcount-cache-size` above `cache-size`; with one of them set the other cache gets the
///   rest; alone, the L2 cache gets all it can use provided 4 clusters remain for refcounts,
///   else the refcount cache gets (up to) 4 clusters and the L2 cache the rest;
/// - when the L2 cache does not cover the whole disk and no entry size was asked for, entries
///   are min(cluster size, 4 KiB), else the cluster size; the entry size must be a power of two
///   in 512 ..= cluster size;
/// - sizes are rounded down to whole entries, then raised to at least 2 L2 entries and
///   4 refcount clusters; more than `i32::MAX` entries is an error;
/// - `cache-clean-interval` defaults to 600 s and must fit 32 bits.
pub fn resolve_sizes(
    opts: &CacheOptions,
    image: &ImageParams,
) -> Result<ResolvedCacheSizes, CacheSizeError> {
    check_image(image)?;
    let cluster = image.cluster_size;
    // QEMU sizes from whole 512-byte sectors (bs->total_sectors).
    let disk = image.virtual_size / 512 * 512;
    let max_l2_entries = disk.div_ceil(cluster);
    // With clusters of at least 512 bytes this stays below 2^60; checked all the same.
    let max_l2_cache = max_l2_entries
        .checked_mul(image.l2_entry_bytes())
        .and_then(|b| b.checked_next_multiple_of(cluster))
        .unwrap_or(u64::MAX);
    let min_refcount_cache = MIN_REFCOUNT_CACHE_CLUSTERS * cluster;

    let l2_setting = opts.l2_cache_size.unwrap_or(DEFAULT_L2_CACHE_MAX_SIZE);
    let mut l2_bytes = max_l2_cache.min(l2_setting);
    let mut refcount_bytes = opts.refcount_cache_size.unwrap_or(0);
    let mut entry_size = opts.l2_cache_entry_size.unwrap_or(cluster);

    if let Some(combined) = opts.cache_size {
        let l2_set = opts.l2_cache_size.is_some();
        let refcount_set = opts.refcount_cache_size.is_some();
        if l2_set && refcount_set {
            return Err(CacheSizeError::AllThreeSet);
        } else if l2_set && l2_setting > combined {
            return Err(CacheSizeError::L2ExceedsCombined);
        } else if refcount_bytes > combined {
            return Err(CacheSizeError::RefcountExceedsCombined);
        }
        // The subtractions below cannot underflow: l2_bytes <= l2_setting <= combined and
        // refcount_bytes <= combined were just checked.
        if l2_set {
            refcount_bytes = combined - l2_bytes;
        } else if refcount_set {
            l2_bytes = combined - refcount_bytes;
        } else if max_l2_cache
            .checked_add(min_refcount_cache)
            .is_some_and(|need| combined >= need)
        {
            l2_bytes = max_l2_cache;
            refcount_bytes = combined - l2_bytes;
        } else {
            refcount_bytes = combined.min(min_refcount_cache);
            l2_bytes = combined - refcount_bytes;
        }
    }

    // Smaller entries make loads and evictions cheaper when the cache cannot hold everything.
    if l2_bytes < max_l2_cache && opts.l2_cache_entry_size.is_none() {
        entry_size = cluster.min(SMALL_L2_ENTRY_SIZE);
    }
    if entry_size < MIN_CLUSTER_SIZE || entry_size > cluster || !entry_size.is_power_of_two() {
        return Err(CacheSizeError::BadL2EntrySize {
            entry_size,
            cluster_size: cluster,
        });
    }

    let l2_entries = (l2_bytes / entry_size).max(MIN_L2_CACHE_ENTRIES);
    if l2_entries > MAX_CACHE_ENTRIES {
        return Err(CacheSizeError::L2CacheTooBig {
            entries: l2_entries,
        });
    }
    let refcount_entries = (refcount_bytes / cluster).max(MIN_REFCOUNT_CACHE_CLUSTERS);
    if refcount_entries > MAX_CACHE_ENTRIES {
        return Err(CacheSizeError::RefcountCacheTooBig {
            entries: refcount_entries,
        });
    }
    let clean_interval_secs = opts
        .cache_clean_interval
        .unwrap_or(DEFAULT_CACHE_CLEAN_INTERVAL);
    if clean_interval_secs > u64::from(u32::MAX) {
        return Err(CacheSizeError::CleanIntervalTooBig {
            secs: clean_interval_secs,
        });
    }

    // entries <= i32::MAX and sizes <= 2 MiB, so these products fit easily.
    Ok(ResolvedCacheSizes {
        l2_cache_bytes: l2_entries * entry_size,
        l2_entry_size: entry_size,
        refcount_cache_bytes: refcount_entries * cluster,
        refcount_entry_size: cluster,
        clean_interval_secs,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    const GIB: u64 = 1 << 30;

    fn image(cluster_size: u64, virtual_size: u64) -> ImageParams {
        ImageParams {
            cluster_size,
            virtual_size,
            extended_l2: false,
            refcount_bits: 16,
        }
    }

    fn resolve(opts: CacheOptions, img: ImageParams) -> ResolvedCacheSizes {
        resolve_sizes(&opts, &img).unwrap_or_else(|e| panic!("{opts:?} on {img:?}: {e}"))
    }

    // qcow2-cache.txt: "1MB of L2 cache is needed to cover every 8 GB of the virtual image
    // size (given that the default cluster size is used)".
    #[test]
    fn doc_example_8g_disk_needs_1m_of_l2_cache() {
        let img = image(64 * KIB, 8 * GIB);
        let r = resolve(CacheOptions::default(), img);
        assert_eq!(r.l2_cache_bytes, MIB);
        // The cache covers the whole disk, so entries are whole tables.
        assert_eq!(r.l2_entry_size, 64 * KIB);
        assert_eq!(r.l2_coverage(&img), 8 * GIB);
    }

    // qcow2-cache.txt: "disk_size = l2_cache_size * 8192" and "refcount_cache_size * 32768"
    // with 64 KiB clusters and 16-bit refcounts.
    #[test]
    fn doc_formulas_for_default_geometry() {
        let img = image(64 * KIB, 100 * GIB);
        let r = ResolvedCacheSizes {
            l2_cache_bytes: 3 * MIB,
            l2_entry_size: 4 * KIB,
            refcount_cache_bytes: 5 * MIB,
            refcount_entry_size: 64 * KIB,
            clean_interval_secs: 0,
        };
        assert_eq!(r.l2_coverage(&img), 3 * MIB * 8192);
        assert_eq!(r.refcount_coverage(&img), 5 * MIB * 32768);
    }

    // qcow2-cache.txt: "The refcount cache is 4 times the cluster size by default. With the
    // default cluster size of 64 KB, it is 256 KB (262144 bytes). This is sufficient for
    // 8 GB of image size".
    #[test]
    fn doc_example_default_refcount_cache_is_four_clusters() {
        let img = image(64 * KIB, 8 * GIB);
        let r = resolve(CacheOptions::default(), img);
        assert_eq!(r.refcount_cache_bytes, 262_144);
        assert_eq!(r.refcount_entries(), 4);
        assert_eq!(r.refcount_coverage(&img), 8 * GIB);
        // The refcount cache always uses whole clusters.
        assert_eq!(r.refcount_entry_size, 64 * KIB);
        let r = resolve(CacheOptions::default(), image(4 * KIB, 8 * GIB));
        assert_eq!(r.refcount_cache_bytes, 16 * KIB);
    }

    // qcow2-cache.txt: "The maximum L2 cache size is 32 MB by default on Linux platforms
    // (enough for full coverage of 256 GB images, with the default cluster size)".
    #[test]
    fn doc_example_default_max_covers_256g() {
        let img = image(64 * KIB, 256 * GIB);
        let r = resolve(CacheOptions::default(), img);
        assert_eq!(r.l2_cache_bytes, 32 * MIB);
        assert_eq!(r.l2_entry_size, 64 * KIB, "covers the disk: whole tables");
        assert_eq!(r.l2_coverage(&img), 256 * GIB);
    }

    // Beyond 256 GB the default maximum no longer covers the disk: 4 KiB entries (QEMU 4.0+).
    #[test]
    fn l2_default_is_capped_at_32m_and_then_uses_4k_entries() {
        let r = resolve(CacheOptions::default(), image(64 * KIB, 512 * GIB));
        assert_eq!(r.l2_cache_bytes, 32 * MIB);
        assert_eq!(r.l2_entry_size, 4 * KIB);
        assert_eq!(r.l2_entries(), 8192);
    }

    // "QEMU will not use more memory than needed to hold all of the image's L2 tables,
    // regardless of this max. value."
    #[test]
    fn l2_cache_never_exceeds_what_covers_the_disk() {
        let opts = CacheOptions {
            l2_cache_size: Some(64 * MIB),
            ..Default::default()
        };
        let r = resolve(opts, image(64 * KIB, 8 * GIB));
        assert_eq!(r.l2_cache_bytes, MIB);
        // A partial L2 table still costs a whole cluster.
        let r = resolve(CacheOptions::default(), image(64 * KIB, 10 * GIB + 512));
        assert_eq!(r.l2_cache_bytes, 1280 * KIB + 64 * KIB);
    }

    // "-drive file=hd.qcow2,l2-cache-size=2097152,l2-cache-entry-size=4096"
    #[test]
    fn doc_example_explicit_size_and_entry_size() {
        let opts = CacheOptions {
            l2_cache_size: Some(2_097_152),
            l2_cache_entry_size: Some(4096),
            ..Default::default()
        };
        let r = resolve(opts, image(64 * KIB, 100 * GIB));
        assert_eq!(r.l2_cache_bytes, 2 * MIB);
        assert_eq!(r.l2_entry_size, 4096);
        assert_eq!(r.l2_entries(), 512);
    }

    // "the value of l2-cache-entry-size defaults to 4KB (or the cluster size if it's
    // smaller)".
    #[test]
    fn small_entries_never_exceed_the_cluster() {
        let r = resolve(CacheOptions::default(), image(2 * KIB, 1024 * GIB));
        assert_eq!(r.l2_entry_size, 2 * KIB);
        let r = resolve(CacheOptions::default(), image(2 * MIB, 1 << 50));
        assert_eq!(r.l2_entry_size, 4 * KIB);
    }

    // An explicit entry size is kept even when the cache covers the disk.
    #[test]
    fn explicit_entry_size_is_kept() {
        let opts = CacheOptions {
            l2_cache_entry_size: Some(8 * KIB),
            ..Default::default()
        };
        let r = resolve(opts, image(64 * KIB, 8 * GIB));
        assert_eq!((r.l2_cache_bytes, r.l2_entry_size), (MIB, 8 * KIB));
    }

    // "The minimal L2 cache size is 2 clusters (or 2 cache entries)".
    #[test]
    fn at_least_two_l2_entries() {
        // A 1 MiB disk needs 16 L2 entries = 128 bytes, rounded to one 64 KiB cluster.
        let r = resolve(CacheOptions::default(), image(64 * KIB, MIB));
        assert_eq!((r.l2_entries(), r.l2_entry_size), (2, 64 * KIB));
        let opts = CacheOptions {
            l2_cache_size: Some(0),
            ..Default::default()
        };
        let r = resolve(opts, image(64 * KIB, 100 * GIB));
        assert_eq!((r.l2_entries(), r.l2_entry_size), (2, 4 * KIB));
        // An empty disk still gets a cache.
        let r = resolve(CacheOptions::default(), image(64 * KIB, 0));
        assert_eq!(r.l2_entries(), 2);
    }

    // "Both caches must have a size that is a multiple of the cluster size (or the cache
    // entry size)": QEMU rounds down to whole entries.
    #[test]
    fn sizes_round_down_to_whole_entries() {
        let opts = CacheOptions {
            l2_cache_size: Some(10 * KIB + 100),
            refcount_cache_size: Some(5 * 64 * KIB + 1),
            ..Default::default()
        };
        let r = resolve(opts, image(64 * KIB, 100 * GIB));
        assert_eq!((r.l2_cache_bytes, r.l2_entry_size), (8 * KIB, 4 * KIB));
        assert_eq!(r.refcount_cache_bytes, 5 * 64 * KIB);
    }

    // "The default (and minimum) refcount cache size is 4 clusters."
    #[test]
    fn refcount_minimum_is_four_clusters() {
        let opts = CacheOptions {
            refcount_cache_size: Some(64 * KIB),
            ..Default::default()
        };
        let r = resolve(opts, image(64 * KIB, 8 * GIB));
        assert_eq!(r.refcount_cache_bytes, 256 * KIB);
    }

    // "If only cache-size is specified then QEMU will assign as much memory as possible to
    // the L2 cache before increasing the refcount cache size."
    #[test]
    fn cache_size_alone_fills_l2_first() {
        let img = image(64 * KIB, 8 * GIB);
        let opts = |c| CacheOptions {
            cache_size: Some(c),
            ..Default::default()
        };
        // Room for all L2 tables (1 MiB) plus 4 refcount clusters: the rest goes to refcounts.
        let r = resolve(opts(2 * MIB), img);
        assert_eq!((r.l2_cache_bytes, r.refcount_cache_bytes), (MIB, MIB));
        assert_eq!(r.l2_entry_size, 64 * KIB);
        // Exactly enough.
        let r = resolve(opts(MIB + 256 * KIB), img);
        assert_eq!((r.l2_cache_bytes, r.refcount_cache_bytes), (MIB, 256 * KIB));
        // Not enough: refcounts keep 4 clusters, L2 gets the rest and small entries.
        let r = resolve(opts(MIB), img);
        assert_eq!(
            (r.l2_cache_bytes, r.refcount_cache_bytes),
            (768 * KIB, 256 * KIB)
        );
        assert_eq!(r.l2_entry_size, 4 * KIB);
        // Less than 4 clusters in all: both minimums win over cache-size.
        let r = resolve(opts(128 * KIB), img);
        assert_eq!(r.refcount_cache_bytes, 256 * KIB);
        assert_eq!((r.l2_entries(), r.l2_entry_size), (2, 4 * KIB));
    }

    #[test]
    fn cache_size_with_one_other_gives_the_rest() {
        let img = image(64 * KIB, 100 * GIB);
        let opts = CacheOptions {
            cache_size: Some(4 * MIB),
            l2_cache_size: Some(3 * MIB),
            ..Default::default()
        };
        let r = resolve(opts, img);
        assert_eq!((r.l2_cache_bytes, r.refcount_cache_bytes), (3 * MIB, MIB));
        let opts = CacheOptions {
            cache_size: Some(4 * MIB),
            refcount_cache_size: Some(MIB),
            ..Default::default()
        };
        let r = resolve(opts, img);
        assert_eq!((r.l2_cache_bytes, r.refcount_cache_bytes), (3 * MIB, MIB));
        // With l2-cache-size larger than the disk needs, the refcount cache gets what the
        // L2 cache does not use (QEMU subtracts the capped L2 size).
        let opts = CacheOptions {
            cache_size: Some(4 * MIB),
            l2_cache_size: Some(3 * MIB),
            ..Default::default()
        };
        let r = resolve(opts, image(64 * KIB, 8 * GIB));
        assert_eq!((r.l2_cache_bytes, r.refcount_cache_bytes), (MIB, 3 * MIB));
        // QEMU does not cap L2 at the disk's needs when refcount-cache-size sets it.
        let opts = CacheOptions {
            cache_size: Some(4 * MIB),
            refcount_cache_size: Some(MIB),
            ..Default::default()
        };
        let r = resolve(opts, image(64 * KIB, 8 * GIB));
        assert_eq!((r.l2_cache_bytes, r.l2_entry_size), (3 * MIB, 64 * KIB));
    }

    // "At most two of l2-cache-size, refcount-cache-size, and cache-size can be set
    // simultaneously."
    #[test]
    fn all_three_is_an_error() {
        let opts = CacheOptions {
            cache_size: Some(4 * MIB),
            l2_cache_size: Some(MIB),
            refcount_cache_size: Some(MIB),
            ..Default::default()
        };
        let e = resolve_sizes(&opts, &image(64 * KIB, GIB)).unwrap_err();
        assert_eq!(e, CacheSizeError::AllThreeSet);
        assert_eq!(
            e.to_string(),
            "cache-size, l2-cache-size and refcount-cache-size may not be set at the same time"
        );
    }

    #[test]
    fn parts_may_not_exceed_cache_size() {
        let img = image(64 * KIB, GIB);
        let opts = CacheOptions {
            cache_size: Some(MIB),
            l2_cache_size: Some(2 * MIB),
            ..Default::default()
        };
        assert_eq!(
            resolve_sizes(&opts, &img),
            Err(CacheSizeError::L2ExceedsCombined)
        );
        // QEMU compares the setting, not the capped size.
        let opts = CacheOptions {
            cache_size: Some(MIB),
            l2_cache_size: Some(64 * MIB),
            ..Default::default()
        };
        assert_eq!(
            resolve_sizes(&opts, &image(64 * KIB, 8 * GIB)),
            Err(CacheSizeError::L2ExceedsCombined)
        );
        let opts = CacheOptions {
            cache_size: Some(MIB),
            refcount_cache_size: Some(2 * MIB),
            ..Default::default()
        };
        let e = resolve_sizes(&opts, &img).unwrap_err();
        assert_eq!(e, CacheSizeError::RefcountExceedsCombined);
        assert_eq!(
            e.to_string(),
            "refcount-cache-size may not exceed cache-size"
        );
    }

    // "Images with extended L2 entries need twice as much L2 metadata":
    // l2_cache_size = disk_size * 16 / cluster_size.
    #[test]
    fn extended_l2_doubles_the_l2_cache() {
        let mut img = image(64 * KIB, 8 * GIB);
        img.extended_l2 = true;
        let r = resolve(CacheOptions::default(), img);
        assert_eq!(r.l2_cache_bytes, 8 * GIB * 16 / (64 * KIB));
        assert_eq!(r.l2_coverage(&img), 8 * GIB);
        // Refcounts are not affected.
        assert_eq!(r.refcount_cache_bytes, 256 * KIB);
        // The 32 MiB default now covers only 128 GB.
        img.virtual_size = 256 * GIB;
        let r = resolve(CacheOptions::default(), img);
        assert_eq!((r.l2_cache_bytes, r.l2_entry_size), (32 * MIB, 4 * KIB));
    }

    // "The L2 cache entry size has the same restrictions as the cluster size (power of two,
    // at least 512 bytes)", and it cannot exceed the cluster size.
    #[test]
    fn entry_size_must_be_a_power_of_two_within_the_cluster() {
        let img = image(64 * KIB, GIB);
        for bad in [0, 256, 511, 3000, 128 * KIB] {
            let opts = CacheOptions {
                l2_cache_entry_size: Some(bad),
                ..Default::default()
            };
            let e = resolve_sizes(&opts, &img).unwrap_err();
            assert!(
                matches!(e, CacheSizeError::BadL2EntrySize { .. }),
                "{bad}: {e}"
            );
            assert!(e.to_string().starts_with(
                "L2 cache entry size must be a power of two between 512 and the cluster size \
                 (65536)"
            ));
        }
        for good in [512, 4096, 64 * KIB] {
            let opts = CacheOptions {
                l2_cache_entry_size: Some(good),
                ..Default::default()
            };
            assert_eq!(resolve(opts, img).l2_entry_size, good);
        }
    }

    #[test]
    fn entry_counts_are_limited_to_int_max() {
        let img = image(512, u64::MAX);
        let opts = CacheOptions {
            l2_cache_size: Some(u64::MAX),
            ..Default::default()
        };
        let e = resolve_sizes(&opts, &img).unwrap_err();
        assert!(matches!(e, CacheSizeError::L2CacheTooBig { .. }), "{e}");
        let opts = CacheOptions {
            refcount_cache_size: Some(u64::MAX),
            ..Default::default()
        };
        let e = resolve_sizes(&opts, &image(64 * KIB, GIB)).unwrap_err();
        assert!(
            matches!(e, CacheSizeError::RefcountCacheTooBig { .. }),
            "{e}"
        );
    }

    // "If unset, the default value for this parameter is 600"; "Setting this parameter to 0
    // disables this feature".
    #[test]
    fn clean_interval_default_off_and_limit() {
        let img = image(64 * KIB, GIB);
        assert_eq!(
            resolve(CacheOptions::default(), img).clean_interval_secs,
            600
        );
        let opts = |s| CacheOptions {
            cache_clean_interval: Some(s),
            ..Default::default()
        };
        assert_eq!(resolve(opts(0), img).clean_interval_secs, 0);
        assert_eq!(resolve(opts(900), img).clean_interval_secs, 900);
        assert_eq!(
            resolve_sizes(&opts(1 << 32), &img),
            Err(CacheSizeError::CleanIntervalTooBig { secs: 1 << 32 })
        );
    }

    #[test]
    fn virtual_size_counts_whole_sectors_only() {
        // 8 GiB + 511 bytes is 8 GiB for QEMU; 8 GiB + 512 needs one more L2 table.
        let r = resolve(CacheOptions::default(), image(64 * KIB, 8 * GIB + 511));
        assert_eq!(r.l2_cache_bytes, MIB);
        let r = resolve(CacheOptions::default(), image(64 * KIB, 8 * GIB + 512));
        assert_eq!(r.l2_cache_bytes, MIB + 64 * KIB);
    }

    #[test]
    fn hostile_geometry_is_an_error_not_a_panic() {
        for cluster in [0, 1, 256, 3 * 1024, 4 * MIB, u64::MAX] {
            let e = resolve_sizes(&CacheOptions::default(), &image(cluster, GIB)).unwrap_err();
            assert!(
                matches!(e, CacheSizeError::InvalidImage { .. }),
                "{cluster}: {e}"
            );
        }
        for bits in [0, 3, 128] {
            let mut img = image(64 * KIB, GIB);
            img.refcount_bits = bits;
            let e = resolve_sizes(&CacheOptions::default(), &img).unwrap_err();
            assert!(
                matches!(e, CacheSizeError::InvalidImage { .. }),
                "{bits}: {e}"
            );
        }
        // Largest disk, smallest clusters, extended entries: no overflow.
        let mut img = image(512, u64::MAX);
        img.extended_l2 = true;
        let r = resolve(CacheOptions::default(), img);
        assert_eq!((r.l2_cache_bytes, r.l2_entry_size), (32 * MIB, 512));
        let opts = CacheOptions {
            cache_size: Some(u64::MAX),
            ..Default::default()
        };
        let e = resolve_sizes(&opts, &img).unwrap_err();
        assert!(matches!(e, CacheSizeError::L2CacheTooBig { .. }), "{e}");
    }

    #[test]
    fn configs_carry_the_sizes() {
        let r = resolve(CacheOptions::default(), image(64 * KIB, 512 * GIB));
        let l2 = r.l2_cache_config("l2");
        assert_eq!((l2.entry_size, l2.capacity_bytes), (4096, 32 * MIB));
        let rc = r.refcount_cache_config("refcount");
        assert_eq!((rc.entry_size, rc.capacity_bytes), (64 * 1024, 256 * KIB));
    }
}
