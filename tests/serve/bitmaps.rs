//! `serve -B` side by side with `qemu-nbd -B` on copies of the same image: the
//! `qemu:dirty-bitmap:` contexts list alike, and nbdinfo's map, `qemu-img map` with
//! `x-dirty-bitmap` and libnbd's raw block status answers are identical, read-only and
//! writable; what cannot be exported is refused in qemu-nbd's words.

use std::process::Command;

use crate::support::qemu_nbd::QemuNbd;
use crate::support::{serve_fails, Server};
use serde_json::Value;
use test_support::{
    assert_check_clean, nbdinfo, parse_nbdinfo_map, python_with_libnbd, qemu_dirty_ranges,
    qemu_img, qemu_io, run_ok, stdout, Dir,
};

/// A 64 MiB image: `b1` enabled at 64 KiB (dirty at 1M, 5M and 63M+), `b2` disabled at 1 MiB
/// (dirty at 1M), `b3` enabled at 512 B (dirty at 5M+512), and a copy for each server.
fn images(d: &Dir) -> (String, String) {
    let p = d.s("qemu.qcow2");
    d.create("qemu.qcow2", "qcow2", "", None, "64M");
    qemu_img(&["bitmap", "--add", &p, "b1"]);
    qemu_img(&["bitmap", "--add", "-g", "1M", &p, "b2"]);
    qemu_io("qcow2", &p, &["write 1M 4k"]);
    qemu_img(&["bitmap", "--disable", &p, "b2"]);
    qemu_img(&["bitmap", "--add", "-g", "512", &p, "b3"]);
    qemu_io(
        "qcow2",
        &p,
        &["write 5M 1k", "write 5244416 512", "write 63M 1M"],
    );
    d.copy("qemu.qcow2", "ours.qcow2");
    (d.s("ours.qcow2"), p)
}

fn map(uri: &str, bitmap: &str) -> Vec<(u64, u64, u32)> {
    parse_nbdinfo_map(&nbdinfo(&[
        &format!("--map=qemu:dirty-bitmap:{bitmap}"),
        uri,
    ]))
}

fn contexts(uri: &str) -> Vec<String> {
    let v: Value = serde_json::from_str(&nbdinfo(&["--json", uri])).unwrap();
    let mut c: Vec<String> = v["exports"][0]["contexts"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| c.as_str().unwrap().to_string())
        .collect();
    c.sort();
    c
}

fn qemu_img_map(socket: &std::path::Path, bitmap: &str) -> Value {
    let opts = format!(
        "driver=nbd,server.type=unix,server.path={},x-dirty-bitmap=qemu:dirty-bitmap:{bitmap}",
        socket.display()
    );
    serde_json::from_str(&qemu_img(&["map", "--output=json", "--image-opts", &opts])).unwrap()
}

/// Raw `NBD_CMD_BLOCK_STATUS` answers for a few requests (unaligned, inside one chunk,
/// crossing the end, one extent only), as libnbd reports them.
const BLOCK_STATUS: &str = r#"
import json, sys, nbd
uri, ctx = sys.argv[1], sys.argv[2]
h = nbd.NBD()
h.add_meta_context(ctx)
h.connect_uri(uri)
size = h.get_size()
out = []
for off, n, flags in [(0, size, 0), (1000, 3 << 20, 0), (5 << 20, 4096, 0),
                      (size - 100000, 100000, 0), (1 << 20, 8 << 20, nbd.CMD_FLAG_REQ_ONE),
                      (5242881, 1, 0)]:
    got = []
    def cb(meta, offset, entries, err):
        got.append([meta, offset, list(entries)])
        return 0
    h.block_status(n, off, cb, flags)
    out.append(got)
h.shutdown()
print(json.dumps(out))
"#;

fn block_status(uri: &str, bitmap: &str) -> Value {
    let ctx = format!("qemu:dirty-bitmap:{bitmap}");
    let out = stdout(&run_ok(Command::new(python_with_libnbd()).args([
        "-c",
        BLOCK_STATUS,
        uri,
        &ctx,
    ])));
    serde_json::from_str(&out).unwrap()
}

fn compare(ours: &Server, qemu: &QemuNbd, bitmaps: &[&str]) {
    let (ou, qu) = (ours.uri(), qemu.uri_of(""));
    assert_eq!(contexts(&ou), contexts(&qu), "listed contexts");
    for b in bitmaps {
        assert_eq!(map(&ou, b), map(&qu, b), "nbdinfo --map of {b}");
        assert_eq!(
            qemu_img_map(&ours.socket, b),
            qemu_img_map(&qemu.socket, b),
            "qemu-img map x-dirty-bitmap {b}"
        );
        assert_eq!(
            block_status(&ou, b),
            block_status(&qu, b),
            "block status of {b}"
        );
    }
}

#[test]
fn a_read_only_export_answers_as_qemu_nbd() {
    let d = Dir::new();
    let (ours, theirs) = images(&d);
    let server = Server::unix(&["-t", "-r", "-B", "b1", "-B", "b2", "-B", "b3", &ours]);
    let qemu = QemuNbd::unix(
        &["-r", "-f", "qcow2", "-B", "b1", "-B", "b2", "-B", "b3"],
        theirs.as_ref(),
    );
    compare(&server, &qemu, &["b1", "b2", "b3"]);
    let dirty: Vec<(u64, u64)> = map(&server.uri(), "b1")
        .into_iter()
        .filter(|e| e.2 == 1)
        .map(|e| (e.0, e.1))
        .collect();
    assert_eq!(
        dirty,
        [(1 << 20, 65536), (5 << 20, 65536), (63 << 20, 1 << 20)]
    );
    server.stop_ok();
}

#[test]
fn a_writable_export_shows_writes_as_they_are_tracked() {
    let d = Dir::new();
    let (ours, theirs) = images(&d);
    let server = Server::unix(&["-t", "-B", "b1", "-B", "b2", &ours]);
    let qemu = QemuNbd::unix(&["-f", "qcow2", "-B", "b1", "-B", "b2"], theirs.as_ref());
    let writes = ["write 20M 4k", "write -z 30M 128k", "discard 40M 64k"];
    qemu_io("raw", &server.uri(), &writes);
    qemu_io("raw", &qemu.uri_of(""), &writes);
    compare(&server, &qemu, &["b1", "b2"]);
    server.stop_ok();
    qemu.stop();
    assert_check_clean(ours.as_ref());
    for b in ["b1", "b2", "b3"] {
        assert_eq!(
            qemu_dirty_ranges(ours.as_ref(), b),
            qemu_dirty_ranges(theirs.as_ref(), b),
            "{b} as stored"
        );
    }
}

/// A `-B` bitmap the top image lacks is found in its backing file, as qemu-nbd finds it,
/// whether the export is read-only or writable (writes go to the top, never to the backing
/// file's bitmap); one neither layer has is refused in qemu-nbd's words.
#[test]
fn a_bitmap_of_the_backing_file_is_exported_as_qemu_nbd_exports_it() {
    let d = Dir::new();
    images(&d);
    // One top per server, over its own copy of the base, each with a bitmap of its own.
    let tops = ["ours", "qemu"].map(|who| {
        let top = format!("top-{who}.qcow2");
        d.create(
            &top,
            "qcow2",
            "",
            Some((&format!("{who}.qcow2"), "qcow2")),
            "64M",
        );
        qemu_img(&["bitmap", "--add", &d.s(&top), "top"]);
        qemu_io("qcow2", &d.s(&top), &["write 2M 64k"]);
        d.s(&top)
    });
    for writable in [false, true] {
        let ro: &[&str] = if writable { &[] } else { &["-r"] };
        let bitmaps = ["-B", "top", "-B", "b1", "-B", "b3"];
        let server = Server::unix(&[&["-t"][..], ro, &bitmaps, &[tops[0].as_str()]].concat());
        let qemu = QemuNbd::unix(&[ro, &["-f", "qcow2"], &bitmaps].concat(), tops[1].as_ref());
        compare(&server, &qemu, &["top", "b1", "b3"]);
        server.stop_ok();
        qemu.stop();
    }
    let missing = serve_fails(&["-r", "-B", "nowhere", &tops[0]]);
    assert!(
        missing.contains("Bitmap 'nowhere' is not found"),
        "{missing}"
    );
}

#[test]
fn bitmaps_that_cannot_be_exported_are_refused_as_qemu_nbd_refuses_them() {
    let d = Dir::new();
    let (ours, _) = images(&d);
    let err = serve_fails(&["-r", "-B", "nope", &ours]);
    assert!(err.contains("Bitmap 'nope' is not found"), "{err}");
    // A bitmap left in use by a crash.
    let meta = qcow2::inspect::inspect(std::fs::read(&ours).unwrap().as_slice()).unwrap();
    let dir = meta.header.bitmaps().unwrap().directory_offset as usize;
    let mut bytes = std::fs::read(&ours).unwrap();
    bytes[dir + 15] |= 1;
    std::fs::write(&ours, &bytes).unwrap();
    let err = serve_fails(&["-r", "-B", "b1", &ours]);
    assert!(
        err.contains("Bitmap 'b1' is inconsistent and cannot be used"),
        "{err}"
    );
    let flags = || qemu_img(&["info", &ours]);
    let before = flags();
    let err = serve_fails(&["-B", "b1", &ours]);
    assert!(err.contains("inconsistent"), "{err}");
    // The writable open marked b2 and b3 in use; the refusal still closes the image cleanly.
    assert_eq!(
        flags(),
        before,
        "a refused writable serve leaves the bitmaps as they were"
    );
    assert_check_clean(ours.as_ref());
}

#[test]
fn bitmaps_per_export_and_bits_per_answer_are_bounded() {
    let d = Dir::new();
    let img = d.s("big.qcow2");
    d.create("big.qcow2", "qcow2", "", None, "1G");
    qemu_img(&["bitmap", "--add", "-g", "512", &img, "fine"]);
    let mut args: Vec<String> = vec!["-r".into()];
    for _ in 0..65 {
        args.extend(["-B".into(), "fine".into()]);
    }
    args.push(img.clone());
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let err = serve_fails(&args);
    assert!(
        err.contains("65 bitmaps given; one export offers at most 64"),
        "{err}"
    );
    // One answer looks at 2^20 bits at most: 512 MiB of a 512-byte-granularity bitmap.
    let server = Server::unix(&["-t", "-r", "-B", "fine", &img]);
    let answers = block_status(&server.uri(), "fine");
    let whole: u64 = answers[0][0][2]
        .as_array()
        .unwrap()
        .iter()
        .step_by(2)
        .map(|n| n.as_u64().unwrap())
        .sum();
    assert_eq!(whole, 512 << 20, "{answers}");
    // Clients ask again for the rest, so the map still covers the disk.
    let total: u64 = map(&server.uri(), "fine").iter().map(|e| e.1).sum();
    assert_eq!(total, 1 << 30);
    server.stop_ok();
}
