//! Backing chains that must not be followed to the end: a file that is its own backing file,
//! two files backing each other, and a chain 10,000 images deep (made cheaply by copying one
//! qemu-img header and patching the backing name). The engine refuses each with a clear
//! error, quickly; `check` looks at the top image only, as it should, and finds it clean.
//!
//! `qemu-img check` is not asked: it follows the backing chain when it opens an image, and on
//! a loop it never returns (QEMU 10.0 grows without bound), so these are images QEMU cannot
//! open and the agreement rule does not apply.
//!
//! Needs qemu-img (Debian: qemu-utils).

use crate::common::{our_check, Patch};
use qcow2::check::Repair;
use qcow2::engine::{Image, OpenOptions};
use qcow2::format::GuestOffset;
use std::path::Path;
use storage::{Aio, AnyStorage, FileOpener};
use test_support::{qemu_img, Dir};

/// Opens `path` with its backing chain and reads it all; the error text if that fails.
fn open_chain(path: &Path) -> Result<(), String> {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    tokio::task::LocalSet::new().block_on(&rt, async {
        let opener = FileOpener {
            aio: Aio::Threads,
            direct: false,
            // No image locks: see the note on test processes in storage::lock.
            locking: storage::Locking::Off,
        };
        let opts = OpenOptions {
            read_only: true,
            ..OpenOptions::default()
        };
        let img: Image<AnyStorage> = Image::open(&opener, path, &opts)
            .await
            .map_err(|e| e.to_string())?;
        img.read(GuestOffset(0), img.size() as usize)
            .await
            .map(|_| ())
            .map_err(|e| e.to_string())
    })
}

/// `qemu-img create` with a backing file that need not exist yet.
fn create_over(dir: &Dir, name: &str, backing: &str) {
    qemu_img(&[
        "create",
        "-q",
        "-f",
        "qcow2",
        "-u",
        "-b",
        backing,
        "-F",
        "qcow2",
        "-o",
        "cluster_size=512",
        &dir.s(name),
        "1M",
    ]);
}

/// The top image itself is consistent: our check finds nothing, in every mode.
fn assert_top_clean(path: &Path) {
    for repair in [Repair::None, Repair::Leaks, Repair::All] {
        let (r, findings) = our_check(path, repair);
        let outcome = r.unwrap_or_else(|e| panic!("{}: check failed: {e}", path.display()));
        assert_eq!(
            outcome.report.exit_code(),
            0,
            "{}: {findings:?}",
            path.display()
        );
    }
}

#[test]
fn an_image_that_is_its_own_backing_file() {
    let dir = Dir::new();
    create_over(&dir, "self.qcow2", "self.qcow2");
    let e = open_chain(&dir.path("self.qcow2")).expect_err("a self-loop must not open");
    assert!(e.contains("loop"), "{e}");
    assert_top_clean(&dir.path("self.qcow2"));
}

#[test]
fn two_images_backing_each_other() {
    let dir = Dir::new();
    create_over(&dir, "a.qcow2", "b.qcow2");
    create_over(&dir, "b.qcow2", "a.qcow2");
    for name in ["a.qcow2", "b.qcow2"] {
        let e = open_chain(&dir.path(name)).expect_err("a loop must not open");
        assert!(e.contains("loop"), "{name}: {e}");
        assert_top_clean(&dir.path(name));
    }
}

#[test]
fn a_chain_ten_thousand_images_deep() {
    const DEPTH: usize = 10_000;
    let dir = Dir::new();
    let name = |i: usize| format!("c{i:05}.qcow2");
    // One real header, copied with only the backing name changed: every name has the same
    // length, so nothing else in the header moves.
    create_over(&dir, &name(0), &name(1));
    let template = std::fs::read(dir.path(&name(0))).unwrap();
    let p = Patch::open(&dir.path(&name(0)));
    let name_at = p.u64(8) as usize;
    let name_len = p.u32(16) as usize;
    assert_eq!(&template[name_at..name_at + name_len], name(1).as_bytes());
    for i in 1..DEPTH {
        let mut bytes = template.clone();
        bytes[name_at..name_at + name_len].copy_from_slice(name(i + 1).as_bytes());
        std::fs::write(dir.path(&name(i)), bytes).unwrap();
    }
    qemu_img(&["create", "-q", "-f", "qcow2", &dir.s(&name(DEPTH)), "1M"]);
    let e = open_chain(&dir.path(&name(0))).expect_err("the chain is too deep to open");
    assert!(e.contains("deeper than"), "{e}");
    // The engine refuses deep chains but reads any image of this one on its own.
    assert!(open_chain(&dir.path(&name(DEPTH - 1))).is_ok());
    assert_top_clean(&dir.path(&name(0)));
}
