//! Incremental backup end to end, as QEMU's iotest 223 and virtnbdbackup do it: add a
//! bitmap, take a full copy through the server, change the disk through the server (writes,
//! zeroes, trims), stop, serve read-only with `-B`, copy only the dirty extents onto the full
//! copy, and `qemu-img compare` must find it identical to the image. Then the same with QEMU
//! doing one half and us the other.

use std::path::Path;
use std::process::Command;

use crate::support::qemu_nbd::QemuNbd;
use crate::support::Server;
use test_support::{
    assert_check_clean, python_with_libnbd, qemu_img, qemu_io, run_ok, stdout, Dir,
};

use crate::support::BIN;

/// Copies the dirty extents of context `ctx` of the export at `uri` into the raw file
/// `target`; prints how many bytes were dirty.
const COPY_DIRTY: &str = r#"
import sys, nbd
uri, ctx, target = sys.argv[1], sys.argv[2], sys.argv[3]
h = nbd.NBD()
h.add_meta_context(ctx)
h.connect_uri(uri)
size = h.get_size()
dirty = []
off = 0
while off < size:
    seen = []
    def cb(meta, o, entries, err):
        if meta == ctx:
            seen.append(list(entries))
        return 0
    h.block_status(min(size - off, 1 << 30), off, cb)
    for i in range(0, len(seen[0]), 2):
        n, flags = seen[0][i], seen[0][i + 1]
        if flags & 1:
            dirty.append((off, n))
        off += n
total = 0
with open(target, "r+b") as f:
    for o, n in dirty:
        done = 0
        while done < n:
            k = min(n - done, 1 << 22)
            f.seek(o + done)
            f.write(h.pread(k, o + done))
            done += k
        total += n
h.shutdown()
print(total)
"#;

fn copy_dirty(uri: &str, bitmap: &str, target: &Path) -> u64 {
    let ctx = format!("qemu:dirty-bitmap:{bitmap}");
    let out = stdout(&run_ok(Command::new(python_with_libnbd()).args([
        "-c",
        COPY_DIRTY,
        uri,
        &ctx,
        target.to_str().unwrap(),
    ])));
    out.trim().parse().unwrap()
}

/// A 64 MiB image with data everywhere a full backup must carry, and bitmap `inc`.
fn image(d: &Dir) -> String {
    let p = d.s("disk.qcow2");
    d.create("disk.qcow2", "qcow2", "", None, "64M");
    qemu_io(
        "qcow2",
        &p,
        &[
            "write -P 0x11 0 8M",
            "write -P 0x22 20M 4M",
            "write -P 0x33 60M 4M",
        ],
    );
    run_ok(Command::new(BIN).args(["bitmap", "--add", &p, "inc"]));
    p
}

/// What the guest does between the two backups.
const CHANGES: [&str; 5] = [
    "write -P 0x44 1M 4k",
    "write -P 0x55 22020608 100k",
    "write -z 2M 1M",
    "discard 60M 2M",
    "write -P 0x66 40M 64k",
];

fn full_copy(uri: &str, target: &Path) {
    qemu_img(&[
        "convert",
        "-f",
        "raw",
        "-O",
        "raw",
        uri,
        target.to_str().unwrap(),
    ]);
}

#[derive(Clone, Copy)]
enum Who {
    Us,
    Qemu,
}

/// Serves `image` writable with the tool `who`, takes the full copy and applies the
/// changes through it, then stops it cleanly.
fn track(who: Who, image: &str, full: &Path) {
    match who {
        Who::Us => {
            let s = Server::unix(&["-t", "--discard=unmap", image]);
            full_copy(&s.uri(), full);
            qemu_io("raw", &s.uri(), &CHANGES);
            s.stop_ok();
        }
        Who::Qemu => {
            let s = QemuNbd::unix(&["-f", "qcow2", "--discard=unmap"], image.as_ref());
            full_copy(&s.uri_of(""), full);
            qemu_io("raw", &s.uri_of(""), &CHANGES);
            s.stop();
        }
    }
}

/// Serves `image` read-only with `-B inc` by `who` and copies the dirty extents onto `full`.
fn incremental(who: Who, image: &str, full: &Path) -> u64 {
    match who {
        Who::Us => {
            let s = Server::unix(&["-t", "-r", "-B", "inc", image]);
            let n = copy_dirty(&s.uri(), "inc", full);
            s.stop_ok();
            n
        }
        Who::Qemu => {
            let s = QemuNbd::unix(&["-r", "-f", "qcow2", "-B", "inc"], image.as_ref());
            let n = copy_dirty(&s.uri_of(""), "inc", full);
            s.stop();
            n
        }
    }
}

fn backup_round_trip(tracker: Who, exporter: Who) {
    let d = Dir::new();
    let img = image(&d);
    let full = d.path("full.raw");
    track(tracker, &img, &full);
    let compare = |a: &str| {
        d.run(
            "qemu-img",
            &["compare", "-f", "raw", "-F", "qcow2", a, &img],
        )
    };
    assert_eq!(
        compare(full.to_str().unwrap()).status.code(),
        Some(1),
        "the changes made the full copy stale"
    );
    let copied = incremental(exporter, &img, &full);
    let out = compare(full.to_str().unwrap());
    assert!(
        out.status.success(),
        "the incremental copy is not the image: {}",
        String::from_utf8_lossy(&out.stdout)
    );
    // Only the touched 64 KiB chunks were copied, not the disk.
    assert!(copied > 0 && copied <= 12 << 20, "{copied} bytes copied");
    assert_check_clean(img.as_ref());
}

#[test]
fn incremental_backup_through_us_alone() {
    backup_round_trip(Who::Us, Who::Us);
}

#[test]
fn incremental_backup_tracked_by_us_exported_by_qemu_nbd() {
    backup_round_trip(Who::Us, Who::Qemu);
}

#[test]
fn incremental_backup_tracked_by_qemu_nbd_exported_by_us() {
    backup_round_trip(Who::Qemu, Who::Us);
}
