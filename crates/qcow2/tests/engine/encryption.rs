//! Encrypted images through the engine against QEMU: random unaligned writes, zeroes and
//! discards on LUKS and legacy AES images (ours or qemu-img's, alone or over an encrypted
//! backing file with another key) and on a LUKS volume (QEMU's `luks` format) match a
//! model, and QEMU reads the same bytes back and finds the image clean.

use crate::support::opener;
use qcow2::crypto::{LuksCreate, Passwords};
use qcow2::engine::{create_file, CreateOptions, Image, NewEncryption, OpenOptions};
use qcow2::format::GuestOffset;
use std::path::Path;
use storage::{Aio, IoBuf};
use test_support::{assert_same_bytes, run, Dir, Rng};

const SECRET: &str = "secret,id=sec0,data=astrochicken";
const PASSWORD: &[u8] = b"astrochicken";

fn luks() -> NewEncryption {
    NewEncryption::Luks {
        password: PASSWORD.to_vec(),
        opts: LuksCreate {
            iter_time_ms: 10,
            ..LuksCreate::default()
        },
    }
}

fn passwords(depths: usize) -> Passwords {
    let mut p = Passwords::default();
    for d in 0..depths {
        p.set(d, PASSWORD.to_vec());
    }
    p
}

/// Random writes (at any byte), zeroes and discards on `path`, checked against `model`.
async fn exercise(path: &Path, model: &mut [u8], depths: usize, seed: u64) {
    let opts = OpenOptions {
        passwords: passwords(depths),
        ..OpenOptions::default()
    };
    exercise_with(path, model, &opts, seed).await;
}

/// [`exercise`] with the image opened with `opts`.
async fn exercise_with(path: &Path, model: &mut [u8], opts: &OpenOptions, seed: u64) {
    let img = Image::open(&opener(Aio::Threads), path, opts)
        .await
        .unwrap_or_else(|e| panic!("open {}: {e}", path.display()));
    let size = model.len() as u64;
    let mut rng = Rng(seed);
    for step in 0..120 {
        let offset = rng.below(size);
        let len = (rng.below(3 * 65536) + 1).min(size - offset);
        let ctx = format!("step {step}: at {offset:#x}+{len:#x}");
        match rng.below(6) {
            0..=3 => {
                let buf = IoBuf::from_slice(&rng.bytes(len as usize));
                model[offset as usize..(offset + len) as usize].copy_from_slice(&buf);
                let (res, _) = img.write(GuestOffset(offset), buf, false).await;
                res.unwrap_or_else(|e| panic!("{ctx}: write: {e}"));
            }
            4 => {
                img.write_zeroes(GuestOffset(offset), len, rng.below(2) == 0, false)
                    .await
                    .unwrap_or_else(|e| panic!("{ctx}: zero: {e}"));
                model[offset as usize..(offset + len) as usize].fill(0);
            }
            _ => {
                let got = img.read(GuestOffset(offset), len as usize).await.unwrap();
                assert_same_bytes(&got, &model[offset as usize..(offset + len) as usize], &ctx);
            }
        }
    }
    let all = img.read(GuestOffset(0), size as usize).await.unwrap();
    assert_same_bytes(&all, model, "end of run");
    img.close().await.unwrap();
}

/// What QEMU reads of the encrypted image at `path` (backing files with the same secret).
fn qemu_reads(d: &Dir, path: &Path, depths: usize) -> Vec<u8> {
    let mut spec = format!("driver=qcow2,file.filename={}", path.display());
    let mut prefix = String::new();
    for _ in 0..depths {
        spec.push_str(&format!(",{prefix}encrypt.key-secret=sec0"));
        prefix.push_str("backing.");
    }
    let out = d.path("out.raw");
    let out_s = out.display().to_string();
    d.ok(
        "qemu-img",
        &[
            "convert",
            "--object",
            SECRET,
            "--image-opts",
            &spec,
            "-O",
            "raw",
            &out_s,
        ],
    );
    let check = d.run(
        "qemu-img",
        &["check", "--object", SECRET, "--image-opts", &spec],
    );
    assert!(
        check.status.success(),
        "qemu-img check: {}",
        String::from_utf8_lossy(&check.stdout)
    );
    std::fs::read(out).unwrap()
}

#[test]
fn our_luks_and_aes_images_match_the_model_in_qemu() {
    let d = Dir::new();
    for (i, (cs, enc)) in [
        (65536u64, luks()),
        (512, luks()),
        (
            65536,
            NewEncryption::LegacyAes {
                password: PASSWORD.to_vec(),
            },
        ),
    ]
    .into_iter()
    .enumerate()
    {
        let path = d.path(&format!("e{i}.qcow2"));
        let size = 2 << 20;
        let opts = CreateOptions {
            size,
            cluster_size: cs,
            encryption: Some(enc),
            ..CreateOptions::default()
        };
        run(async {
            create_file(&opener(Aio::Threads), &path, &opts)
                .await
                .unwrap()
        });
        let mut model = vec![0u8; size as usize];
        run(exercise(&path, &mut model, 1, 0x5eed + i as u64));
        assert_same_bytes(&qemu_reads(&d, &path, 1), &model, &format!("image {i}"));
    }
}

#[test]
fn qemu_made_luks_overlay_over_luks_backing_matches_the_model() {
    let d = Dir::new();
    let base = d.s("base.qcow2");
    let top = d.s("top.qcow2");
    let luks_opts = "encrypt.format=luks,encrypt.key-secret=sec0,encrypt.iter-time=10";
    d.ok(
        "qemu-img",
        &[
            "create", "-q", "-f", "qcow2", "--object", SECRET, "-o", luks_opts, &base, "2M",
        ],
    );
    let spec = format!("driver=qcow2,file.filename={base},encrypt.key-secret=sec0");
    d.ok(
        "qemu-io",
        &[
            "--object",
            SECRET,
            "-c",
            "write -P 0x3c 0 2M",
            "--image-opts",
            &spec,
        ],
    );
    d.ok(
        "qemu-img",
        &[
            "create", "-q", "-f", "qcow2", "--object", SECRET, "-o", luks_opts, "-b", &base, "-F",
            "qcow2", &top,
        ],
    );
    let mut model = vec![0x3cu8; 2 << 20];
    run(exercise(&d.path("top.qcow2"), &mut model, 2, 7));
    assert_same_bytes(&qemu_reads(&d, &d.path("top.qcow2"), 2), &model, "chain");
}

#[test]
fn a_qemu_made_luks_volume_matches_the_model_in_qemu() {
    // QEMU's `luks` format: the header, then the disk, its sectors numbered from the disk's
    // start. Unwritten sectors read as noise, so QEMU fills it first.
    let d = Dir::new();
    let path = d.path("v.luks");
    let s = path.display().to_string();
    let spec = format!("driver=luks,key-secret=sec0,file.filename={s}");
    d.ok(
        "qemu-img",
        &[
            "create",
            "-q",
            "-f",
            "luks",
            "--object",
            SECRET,
            "-o",
            "key-secret=sec0,iter-time=10",
            &s,
            "2M",
        ],
    );
    d.ok(
        "qemu-io",
        &[
            "--object",
            SECRET,
            "-c",
            "write -P 0 0 2M",
            "--image-opts",
            &spec,
        ],
    );
    let mut model = vec![0u8; 2 << 20];
    let opts = OpenOptions {
        format: Some(qcow2::engine::Format::Luks),
        passwords: passwords(1),
        ..OpenOptions::default()
    };
    run(exercise_with(&path, &mut model, &opts, 0x1115));
    let out = d.path("out.raw");
    let out_s = out.display().to_string();
    d.ok(
        "qemu-img",
        &[
            "convert",
            "--object",
            SECRET,
            "--image-opts",
            &spec,
            "-O",
            "raw",
            &out_s,
        ],
    );
    assert_same_bytes(&std::fs::read(out).unwrap(), &model, "QEMU's read");
}
