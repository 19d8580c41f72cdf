//! The `info` binary on mutated real images: it either prints a report (exit 0) or one error
//! line on stderr (exit 1); it never panics (exit 101) or dies from a signal. The in-process
//! mutation test in crates/qcow2 covers 10,000+ mutants; this one covers the CLI's own paths.
//!
//! Needs qemu-img (Debian: qemu-utils); fails with a clear message without it.

use test_support::{Dir, Rng};

#[test]
fn mutated_images_give_a_report_or_a_clean_error() {
    let dir = Dir::new();
    dir.qemu_img(&[
        "create",
        "-q",
        "-f",
        "qcow2",
        "-o",
        "cluster_size=512",
        "orig.qcow2",
        "1M",
    ]);
    dir.qemu_img(&["snapshot", "-c", "s", "orig.qcow2"]);
    dir.qemu_img(&["bitmap", "--add", "orig.qcow2", "b"]);
    let original = dir.read("orig.qcow2");
    let path = dir.path("mutant.qcow2");
    let (mut ok, mut refused) = (0, 0);
    for seed in 1..=300u64 {
        let mut rng = Rng(seed);
        let mut image = original.clone();
        for _ in 0..3 {
            // Mostly the header cluster; sometimes anywhere in the (small) file.
            let limit = if rng.below(4) == 0 { image.len() } else { 512 };
            let at = rng.index(limit);
            image[at] ^= 1 << rng.below(8);
        }
        std::fs::write(&path, &image).unwrap();
        let out = dir.run(
            env!("CARGO_BIN_EXE_qcow2-nbd"),
            &[
                "info",
                "--output=json",
                "--backing-chain",
                &dir.s("mutant.qcow2"),
            ],
        );
        let stderr = String::from_utf8_lossy(&out.stderr);
        match out.status.code() {
            Some(0) => {
                serde_json::from_slice::<serde_json::Value>(&out.stdout)
                    .unwrap_or_else(|e| panic!("seed {seed}: exit 0 but invalid JSON: {e}"));
                ok += 1;
            }
            Some(1) => {
                assert!(
                    stderr.starts_with("qcow2-nbd: "),
                    "seed {seed}: unexpected stderr {stderr:?}"
                );
                // One error, and at most one line of hint after it where QEMU gives one
                // (e.g. which `check -r` removes what the image cannot be opened with).
                let lines: Vec<&str> = stderr.lines().collect();
                assert!(
                    lines.len() <= 2 && lines[1..].iter().all(|l| !l.starts_with("qcow2-nbd")),
                    "seed {seed}: one error line (and a hint at most) expected: {stderr}"
                );
                refused += 1;
            }
            other => panic!("seed {seed}: exit {other:?} (panic or signal): {stderr}"),
        }
    }
    assert!(
        ok > 0 && refused > 0,
        "{ok} reports, {refused} errors: mutations must reach both paths"
    );
}
