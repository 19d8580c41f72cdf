//! Mutation test: more than 10,000 mutated copies of real qemu-img images (their headers,
//! extensions, L1/L2 tables, refcount tables and blocks, snapshot tables and bitmap
//! directories) go through every decoder and through `info`'s inspector and renderers. None
//! may panic; each must either decode or return an error.
//!
//! Needs qemu-img and qemu-io (Debian: qemu-utils); fails with a clear message without them.

use std::panic::{self, AssertUnwindSafe};

use qcow2::format::{l2, refcount, ExtendedL2Entry, L2Entry};
use qcow2::inspect::{self, ImageInfo};
use test_support::{Dir, Rng};

/// Small real images covering every structure: extended L2, sub-byte refcounts, snapshots,
/// bitmaps, compressed clusters, a backing file, version 2.
fn make_images(dir: &Dir) -> Vec<(String, Vec<u8>)> {
    let specs: &[(&str, &str)] = &[
        ("c512", "cluster_size=512"),
        ("rc1", "cluster_size=1024,refcount_bits=1"),
        (
            "rc4-zstd",
            "cluster_size=2048,refcount_bits=4,compression_type=zstd",
        ),
        ("rc64", "cluster_size=4096,refcount_bits=64"),
        ("ext", "cluster_size=16384,extended_l2=on"),
        ("v2", "compat=0.10,cluster_size=512"),
        ("lazy", "cluster_size=1024,lazy_refcounts=on"),
    ];
    dir.qemu_img(&[
        "create",
        "-q",
        "-f",
        "qcow2",
        "-o",
        "cluster_size=512",
        "base.qcow2",
        "1M",
    ]);
    let mut names = Vec::new();
    for (name, opts) in specs {
        let file = format!("{name}.qcow2");
        dir.qemu_img(&[
            "create",
            "-q",
            "-f",
            "qcow2",
            "-o",
            opts,
            "-b",
            "base.qcow2",
            "-F",
            "qcow2",
            &file,
            "1M",
        ]);
        dir.qemu_io(
            "qcow2",
            &file,
            &["write -P 1 0 20k", "write -z 24k 4k", "write -P 2 33k 1k"],
        );
        // 1-bit refcounts cannot count the second reference a snapshot needs.
        if *name != "rc1" {
            dir.qemu_img(&["snapshot", "-c", "one", &file]);
            dir.qemu_io("qcow2", &file, &["write -P 3 0 2k"]);
            dir.qemu_img(&["snapshot", "-c", "two", &file]);
        }
        if *name != "v2" {
            dir.qemu_img(&["bitmap", "--add", &file, "b0"]);
            dir.qemu_img(&["bitmap", "--add", "-g", "64k", "--disable", &file, "b1"]);
        }
        names.push(file);
    }
    dir.qemu_img(&[
        "convert",
        "-c",
        "-O",
        "qcow2",
        "-o",
        "cluster_size=4096",
        "rc64.qcow2",
        "compressed.qcow2",
    ]);
    names.push("compressed.qcow2".into());
    names
        .into_iter()
        .map(|n| {
            let bytes = dir.read(&n);
            (n, bytes)
        })
        .collect()
}

/// Byte ranges holding metadata, found by decoding the unmutated image.
fn metadata_regions(image: &[u8]) -> Vec<(usize, usize)> {
    let meta = inspect::inspect(image).expect("the original image is valid");
    let h = &meta.header;
    let cs = meta.geometry.cluster_size() as usize;
    let mut regions = vec![(0, cs.min(image.len()))];
    let l1 = h.l1_table_offset as usize;
    regions.push((l1, l1 + 8 * h.l1_size as usize));
    let rt = h.refcount_table_offset as usize;
    regions.push((rt, rt + cs * h.refcount_table_clusters as usize));
    for e in inspect::read_l1_table(image, h).unwrap() {
        if let Some(o) = e.l2_offset {
            regions.push((o.0 as usize, o.0 as usize + cs));
        }
    }
    for e in inspect::read_refcount_table(image, h).unwrap() {
        if let Some(o) = e.block_offset {
            regions.push((o.0 as usize, o.0 as usize + cs));
        }
    }
    if h.nb_snapshots > 0 {
        let s = h.snapshots_offset as usize;
        regions.push((s, s + 128 * h.nb_snapshots as usize));
    }
    if let Some(b) = h.bitmaps() {
        let d = b.directory_offset as usize;
        regions.push((d, d + b.directory_size as usize));
    }
    regions
        .into_iter()
        .map(|(a, b)| (a.min(image.len()), b.min(image.len())))
        .filter(|(a, b)| a < b)
        .collect()
}

/// Flips bits, writes boundary values or random bytes at a random metadata offset.
fn mutate(image: &mut [u8], regions: &[(usize, usize)], rng: &mut Rng) {
    for _ in 0..1 + rng.index(3) {
        let (start, end) = regions[rng.index(regions.len())];
        let at = start + rng.index(end - start);
        match rng.index(6) {
            0 => image[at] ^= 1 << rng.index(8),
            1 => image[at] = rng.next_u64() as u8,
            2 | 3 => {
                let values = [
                    0u64,
                    1,
                    u64::MAX,
                    1 << 63,
                    0x7fff_ffff,
                    0xffff_ffff,
                    1 << 56,
                    1 << 62,
                    511,
                    512,
                    65536,
                ];
                let v = values[rng.index(values.len())].to_be_bytes();
                let width = [1usize, 2, 4, 8][rng.index(4)];
                let at = at.min(image.len().saturating_sub(width));
                image[at..at + width].copy_from_slice(&v[8 - width..]);
            }
            4 => {
                let v = rng.next_u64().to_be_bytes();
                let at = at.min(image.len().saturating_sub(8));
                image[at..at + 8].copy_from_slice(&v);
            }
            _ => {
                let len = rng.index(64);
                let at = at.min(image.len().saturating_sub(len));
                for b in &mut image[at..at + len] {
                    *b = 0;
                }
            }
        }
    }
}

/// Everything `info` does, plus every table decoder, on one (possibly broken) image.
fn exercise(image: &[u8]) -> bool {
    let Ok(meta) = inspect::inspect(image) else {
        return false;
    };
    let info = ImageInfo::from_metadata(&meta, "mutant.qcow2");
    assert!(!info.to_human().is_empty());
    serde_json::to_string(&info).expect("serializes");
    let g = meta.geometry;
    let cs = g.cluster_size() as usize;
    if let Ok(l1) = inspect::read_l1_table(image, &meta.header) {
        for e in l1.iter().filter_map(|e| e.l2_offset) {
            let Some(table) = usize::try_from(e.0)
                .ok()
                .and_then(|o| image.get(o..o.checked_add(cs)?))
            else {
                continue;
            };
            for i in 0..g.l2_entries() as usize {
                let (word, bitmap) =
                    l2::entry_at(table, i, g.extended_l2()).expect("within the table");
                if g.extended_l2() {
                    let _ = ExtendedL2Entry::decode(word, bitmap, &g, i as u64, e)
                        .map(|x| x.runs().count());
                } else {
                    let _ = L2Entry::decode(word, &g, i as u64, e).map(|x| x.host_cluster());
                }
            }
        }
    }
    if let Ok(rt) = inspect::read_refcount_table(image, &meta.header) {
        for e in rt.iter().filter_map(|e| e.block_offset) {
            let Some(block) = usize::try_from(e.0)
                .ok()
                .and_then(|o| image.get(o..o.checked_add(cs)?))
            else {
                continue;
            };
            for i in 0..g.refcount_block_entries() as usize {
                refcount::get(block, g.refcount_order(), i).expect("within the block");
            }
        }
    }
    true
}

#[test]
fn ten_thousand_mutated_images_never_panic() {
    const PER_IMAGE: usize = 1300;
    let dir = Dir::new();
    let images = make_images(&dir);
    let (mut total, mut accepted) = (0usize, 0usize);
    for (name, original) in &images {
        assert!(
            exercise(original),
            "{name}: the unmutated image must inspect cleanly"
        );
        let regions = metadata_regions(original);
        for seed in 0..PER_IMAGE as u64 {
            let mut rng = Rng(seed);
            let mut image = original.clone();
            mutate(&mut image, &regions, &mut rng);
            match panic::catch_unwind(AssertUnwindSafe(|| exercise(&image))) {
                Ok(ok) => accepted += usize::from(ok),
                Err(_) => panic!("{name}: mutation seed {seed} made a decoder panic"),
            }
            total += 1;
        }
    }
    assert!(total >= 10_000, "only {total} mutations ran");
    // Both outcomes must occur, or the mutations are not reaching the checks.
    assert!(
        accepted > 0 && accepted < total,
        "{accepted} of {total} mutants accepted"
    );
    eprintln!(
        "{total} mutants: {accepted} decoded, {} refused with an error",
        total - accepted
    );
}
