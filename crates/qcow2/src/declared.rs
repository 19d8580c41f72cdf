//! What an untrusted image may declare (`--untrusted`): the sizes of the structures an open,
//! `info` or `check` reads and walks, capped at what an image of its virtual size needs, or
//! at a limit with an option. QEMU's own limits (`format::limits`) bound each structure
//! alone; these bound the work a crafted image can ask for in all of them together (a
//! 32 MiB L1 table for a 1 MiB disk, 65536 snapshots with an L1 table each, eight LUKS key
//! slots of 16 million PBKDF2 iterations). Pure: the callers load, this judges.

use crate::format::{BitmapDirectoryEntry, Geometry, Header, SnapshotTableEntry};

/// The limits that have no measure in the image itself, each with a command-line option.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Caps {
    /// Internal snapshots (`--untrusted-max-snapshots`).
    pub max_snapshots: u32,
    /// Persistent bitmaps (`--untrusted-max-bitmaps`).
    pub max_bitmaps: u32,
    /// PBKDF2 iterations of the LUKS header, all key slots and the master key digest
    /// together: what a wrong password costs (`--untrusted-max-kdf-iterations`).
    pub max_kdf_iterations: u64,
}

impl Default for Caps {
    /// Generous for any image a person uploads: a few hundred snapshots and bitmaps, and
    /// the iterations of a LUKS header QEMU or cryptsetup made with its defaults (2 s of
    /// PBKDF2 on a fast CPU) in every slot.
    fn default() -> Caps {
        Caps {
            max_snapshots: 1024,
            max_bitmaps: 256,
            max_kdf_iterations: 40_000_000,
        }
    }
}

/// A declared size past its cap.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("untrusted image declares {what} of {value}, more than {cap} ({why})")]
pub struct Exceeded {
    /// The structure and field.
    pub what: String,
    /// What the image declares.
    pub value: u64,
    /// The cap.
    pub cap: u64,
    /// Where the cap comes from: the virtual size, or the option that raises it.
    pub why: String,
}

/// How an image from an author not trusted with host files is opened (`--untrusted`).
#[derive(Clone, Copy, Debug)]
pub struct Untrusted {
    /// The directories every file it names must resolve inside.
    pub allow: &'static storage::AllowDirs,
    /// The caps on the sizes it declares.
    pub caps: Caps,
}

/// What an image declares, as loaded.
#[derive(Debug, Clone, Copy)]
pub struct Declared<'a> {
    /// The header.
    pub header: &'a Header,
    /// Its geometry.
    pub geom: &'a Geometry,
    /// The file's length.
    pub file_len: u64,
    /// The snapshot table.
    pub snapshots: &'a [SnapshotTableEntry],
    /// The bitmap directory, when loaded (each table is then checked).
    pub bitmaps: &'a [BitmapDirectoryEntry],
    /// How many bitmaps the header's extension declares.
    pub bitmap_count: u64,
    /// PBKDF2 iterations of the LUKS header (master key digest and active slots), if any.
    pub kdf_iterations: Option<u64>,
}

impl<'a> Declared<'a> {
    /// What the metadata `info` and `check` load declares.
    pub fn of(meta: &'a crate::inspect::ImageMetadata) -> Declared<'a> {
        Declared {
            header: &meta.header,
            geom: &meta.geometry,
            file_len: meta.file_len,
            snapshots: &meta.snapshots,
            bitmaps: &meta.bitmaps,
            bitmap_count: meta.header.bitmaps().map_or(0, |b| u64::from(b.nb_bitmaps)),
            kdf_iterations: meta.luks.as_ref().map(|l| l.kdf_iterations()),
        }
    }
}

/// L1 entries an image of `size` bytes needs, with the slack of one cluster of entries
/// (QEMU rounds a growing table up, and a shrink keeps it).
fn l1_cap(geom: &Geometry, size: u64) -> u64 {
    let per_entry = geom.cluster_size().saturating_mul(geom.l2_entries()).max(1);
    size.div_ceil(per_entry)
        .saturating_add(geom.cluster_size() / 8)
}

/// Refcount table entries that cover twice the larger of the file and the virtual disk
/// (with its metadata), and at least one cluster of entries: room for any growth QEMU
/// leaves, none for a table that addresses petabytes of a small file.
fn refcount_table_cap(geom: &Geometry, file_len: u64, size: u64) -> u64 {
    let covered_per_entry = geom
        .cluster_size()
        .saturating_mul(geom.refcount_block_entries())
        .max(1);
    let host = file_len.max(size).saturating_mul(2);
    host.div_ceil(covered_per_entry)
        .max(geom.cluster_size() / 8)
}

/// Checks every declared size against its cap.
pub fn check(d: &Declared<'_>, caps: &Caps) -> Result<(), Exceeded> {
    let size = d.header.size;
    let over = |what: &str, value: u64, cap: u64, why: &str| {
        (value > cap).then(|| Exceeded {
            what: what.to_string(),
            value,
            cap,
            why: why.to_string(),
        })
    };
    let needs = "what an image of its virtual size needs";
    let mut found = over(
        "an L1 table (l1_size)",
        d.header.l1_size.into(),
        l1_cap(d.geom, size),
        needs,
    )
    .or_else(|| {
        let clusters = u64::from(d.header.refcount_table_clusters);
        let entries = clusters.saturating_mul(d.geom.cluster_size() / 8);
        over(
            "a refcount table (refcount_table_clusters, in entries)",
            entries,
            refcount_table_cap(d.geom, d.file_len, size),
            "what twice its file or virtual size needs",
        )
    })
    .or_else(|| {
        over(
            "internal snapshots (nb_snapshots)",
            d.header.nb_snapshots.into(),
            caps.max_snapshots.into(),
            "--untrusted-max-snapshots",
        )
    })
    .or_else(|| {
        over(
            "persistent bitmaps",
            d.bitmap_count
                .max(u64::try_from(d.bitmaps.len()).unwrap_or(u64::MAX)),
            caps.max_bitmaps.into(),
            "--untrusted-max-bitmaps",
        )
    })
    .or_else(|| {
        over(
            "LUKS PBKDF2 iterations (all key slots and the master key digest)",
            d.kdf_iterations.unwrap_or(0),
            caps.max_kdf_iterations,
            "--untrusted-max-kdf-iterations",
        )
    });
    for s in d.snapshots {
        if found.is_some() {
            break;
        }
        // A snapshot's disk may be larger than today's (a later shrink): its own size
        // counts where the entry records it.
        let disk = s.disk_size().unwrap_or(size).max(size);
        found = over(
            "a snapshot's L1 table (l1_size)",
            s.l1_size.into(),
            l1_cap(d.geom, disk),
            "what its snapshot's virtual size needs",
        );
    }
    for b in d.bitmaps {
        if found.is_some() {
            break;
        }
        // A bitmap covers the disk at its granularity: one bit per granule.
        let bits = size.div_ceil(b.granularity().max(1));
        let clusters = bits.div_ceil(8).div_ceil(d.geom.cluster_size().max(1));
        found = over(
            "a bitmap table (bitmap_table_size)",
            b.table_size.into(),
            clusters.max(1),
            "what its granularity and the virtual size need",
        );
    }
    found.map_or(Ok(()), Err)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn header(size: u64) -> Header {
        Header::new(3, 16, size)
    }

    #[test]
    fn a_fresh_image_passes_and_each_oversized_field_is_caught() {
        let mut h = header(1 << 30);
        let geom = h.geometry().unwrap();
        h.l1_size = u32::try_from(geom.l1_entries_needed()).unwrap();
        h.refcount_table_clusters = 1;
        let judge = |h: &Header, kdf: Option<u64>| {
            let d = Declared {
                header: h,
                geom: &geom,
                file_len: 1 << 20,
                snapshots: &[],
                bitmaps: &[],
                bitmap_count: 0,
                kdf_iterations: kdf,
            };
            check(&d, &Caps::default())
        };
        judge(&h, None).unwrap();
        let mut big = h.clone();
        big.l1_size = 1 << 20;
        assert!(judge(&big, None).unwrap_err().what.contains("L1"));
        let mut big = h.clone();
        big.refcount_table_clusters = 4096;
        assert!(judge(&big, None).unwrap_err().what.contains("refcount"));
        let mut many = h.clone();
        many.nb_snapshots = 5000;
        assert!(judge(&many, None)
            .unwrap_err()
            .why
            .contains("--untrusted-max-snapshots"));
        assert!(judge(&h, Some(100_000_000)).is_err());
        judge(&h, Some(1_000_000)).unwrap();
    }
}
