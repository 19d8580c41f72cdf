//! The `info` binary on mutated real images: it either prints a report (exit 0) or one error
//! line on stderr (exit 1); it never panics (exit 101) or dies from a signal. The in-process
//! mutation test in crates/qcow2 covers 10,000+ mutants; this one covers the CLI's own paths.
//!
//! Needs qemu-img (Debian: qemu-utils); fails with a clear message without it.

use std::process::Command;

/// xorshift64*, so a failing mutant is reproducible from its seed.
fn next(state: &mut u64) -> u64 {
    *state ^= *state >> 12;
    *state ^= *state << 25;
    *state ^= *state >> 27;
    state.wrapping_mul(0x2545_f491_4f6c_dd1d)
}

#[test]
fn mutated_images_give_a_report_or_a_clean_error() {
    let dir = tempfile::tempdir().unwrap();
    let status = Command::new("qemu-img")
        .args([
            "create",
            "-q",
            "-f",
            "qcow2",
            "-o",
            "cluster_size=512",
            "orig.qcow2",
            "1M",
        ])
        .current_dir(dir.path())
        .status()
        .unwrap_or_else(|e| {
            panic!("cannot run qemu-img ({e}); install qemu-utils to run this test")
        });
    assert!(status.success());
    for args in [
        &["snapshot", "-c", "s", "orig.qcow2"][..],
        &["bitmap", "--add", "orig.qcow2", "b"][..],
    ] {
        assert!(Command::new("qemu-img")
            .args(args)
            .current_dir(dir.path())
            .status()
            .unwrap()
            .success());
    }
    let original = std::fs::read(dir.path().join("orig.qcow2")).unwrap();
    let path = dir.path().join("mutant.qcow2");
    let (mut ok, mut refused) = (0, 0);
    for seed in 1..=300u64 {
        let mut state = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
        let mut image = original.clone();
        for _ in 0..3 {
            // Mostly the header cluster; sometimes anywhere in the (small) file.
            let limit = if next(&mut state) % 4 == 0 {
                image.len()
            } else {
                512
            };
            let at = (next(&mut state) % limit as u64) as usize;
            image[at] ^= 1 << (next(&mut state) % 8);
        }
        std::fs::write(&path, &image).unwrap();
        let out = Command::new(env!("CARGO_BIN_EXE_qcow2-nbd"))
            .args(["info", "--output=json", "--backing-chain"])
            .arg(&path)
            .output()
            .unwrap();
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
                assert_eq!(
                    stderr.lines().count(),
                    1,
                    "seed {seed}: one error line expected: {stderr}"
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
