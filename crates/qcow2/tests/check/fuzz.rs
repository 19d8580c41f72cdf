//! Fuzz-style robustness: thousands of small real images with random byte mutations (biased
//! towards their metadata) go through the checker, without repair and with `-r all` on a
//! copy. None may panic or hang; each check reports or fails with an error. A repair that
//! reports a consistent image must leave one: checking it again finds nothing, and repairing
//! it again fixes nothing.
//!
//! Needs qemu-img and qemu-io (Debian: qemu-utils) to make the base images.

use qcow2::check::{self, Repair};
use storage::MemStorage;
use test_support::{create_image, qemu_img, qemu_io, Dir, Rng};

/// Small images covering every structure the checker reads.
fn bases(dir: &Dir) -> Vec<Vec<u8>> {
    let specs = [
        ("c512", "cluster_size=512"),
        ("rc1", "cluster_size=1024,refcount_bits=1"),
        (
            "rc4",
            "cluster_size=2048,refcount_bits=4,compression_type=zstd",
        ),
        ("rc64", "cluster_size=4096,refcount_bits=64"),
        ("ext", "cluster_size=16384,extended_l2=on"),
        ("v2", "compat=0.10,cluster_size=512"),
        ("lazy", "cluster_size=1024,lazy_refcounts=on"),
    ];
    let mut out = Vec::new();
    for (name, opts) in specs {
        let p = dir.path(name);
        create_image(&p, "qcow2", opts, None, "256k");
        qemu_io(
            "qcow2",
            &p,
            &["write -P 1 0 20k", "write -z 40k 8k", "write -P 2 100k 3k"],
        );
        if name != "rc1" {
            qemu_img(&["snapshot", "-c", "s", p.to_str().unwrap()]);
            qemu_io("qcow2", &p, &["write -P 3 2k 4k"]);
        }
        out.push(std::fs::read(&p).unwrap());
    }
    // Compressed clusters and a bitmap.
    qemu_img(&[
        "convert",
        "-c",
        "-O",
        "qcow2",
        "-o",
        "cluster_size=1024",
        &dir.s("c512"),
        &dir.s("comp"),
    ]);
    out.push(std::fs::read(dir.path("comp")).unwrap());
    let b = dir.path("bmp");
    create_image(&b, "qcow2", "cluster_size=1024", None, "256k");
    qemu_img(&["bitmap", "--add", "-g", "4096", b.to_str().unwrap(), "b"]);
    qemu_io("qcow2", &b, &["write -P 4 0 64k"]);
    out.push(std::fs::read(&b).unwrap());
    out
}

/// Flips, overwrites or zeroes a few bytes, mostly in the first clusters where the header,
/// tables and refcounts live.
fn mutate(image: &[u8], rng: &mut Rng) -> Vec<u8> {
    let mut m = image.to_vec();
    let hot = (m.len() as u64).min(16 << 10);
    for _ in 0..1 + rng.below(6) {
        let at = if rng.below(4) == 0 {
            rng.below(m.len() as u64)
        } else {
            rng.below(hot)
        } as usize;
        match rng.below(4) {
            0 => m[at] ^= 1 << rng.below(8),
            1 => m[at] = rng.next_u64() as u8,
            2 => m[at] = 0,
            _ => {
                // A whole big-endian word, as a table entry or header field.
                let start = at & !7;
                let v = match rng.below(3) {
                    0 => rng.next_u64(),
                    1 => rng.below(m.len() as u64 * 2) & !0x1ff,
                    _ => 1 << rng.below(64),
                };
                for (i, b) in v.to_be_bytes().iter().enumerate() {
                    if let Some(x) = m.get_mut(start + i) {
                        *x = *b;
                    }
                }
            }
        }
    }
    m
}

#[test]
fn thousands_of_mutated_images_never_panic_the_checker() {
    let dir = Dir::new();
    let bases = bases(&dir);
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let mut rng = Rng(0x5eed_c4ec);
    let (mut checked, mut failed, mut repaired) = (0, 0, 0);
    const PER_BASE: usize = 1200;
    tokio::task::LocalSet::new().block_on(&rt, async {
        for base in &bases {
            for i in 0..PER_BASE {
                let bytes = mutate(base, &mut rng);
                let what = format!("base of {} bytes, mutation {i}", base.len());
                let mem = MemStorage::from_bytes(&bytes);
                match check::check(&mem, Repair::None, &mut |_| {}).await {
                    Ok(_) => checked += 1,
                    Err(_) => failed += 1,
                }
                assert!(mem.to_vec() == bytes, "{what}: a check without -r wrote");

                let copy = MemStorage::from_bytes(&bytes);
                if let Ok(outcome) = check::check(&copy, Repair::All, &mut |_| {}).await {
                    if outcome.report.exit_code() == 0 {
                        repaired += 1;
                        let again = check::check(&copy, Repair::All, &mut |_| {})
                            .await
                            .unwrap_or_else(|e| panic!("{what}: re-checking the repair: {e}"));
                        assert_eq!(again.report.exit_code(), 0, "{what}");
                        assert!(
                            !again.rechecked,
                            "{what}: a second repair fixed more: {:?}",
                            again.report
                        );
                    }
                }
            }
        }
    });
    eprintln!(
        "{} mutated images: {checked} checked, {failed} refused, {repaired} repaired to a clean state",
        bases.len() * PER_BASE
    );
    assert_eq!(checked + failed, bases.len() * PER_BASE);
    assert!(
        checked > 5000 && repaired > 2500,
        "too few images got through"
    );
}
