//! Block-size negotiation as qemu-nbd does it: an export with a minimum block size (a raw
//! file whose format was probed works in whole sectors) holds to it only the clients that
//! asked for block sizes. The others (`NBD_OPT_EXPORT_NAME`, or `NBD_OPT_GO` without
//! `NBD_INFO_BLOCK_SIZE`) are told minimum 1 and their unaligned requests are served; an
//! `NBD_OPT_INFO` that did not ask is answered `NBD_REP_ERR_BLOCK_SIZE_REQD`.

use std::process::Command;

use crate::support::kernel_client::{KernelClient, CMD_WRITE};
use crate::support::qemu_nbd::QemuNbd;
use crate::support::Server;
use test_support::{python_with_libnbd, run_ok, stdout, Dir};

/// For each (request block sizes?) prints the minimum NBD_OPT_INFO reports (0 when it is
/// refused) and the one NBD_OPT_GO settles on.
const SIZES: &str = r#"
import nbd, sys
for request in (True, False):
    h = nbd.NBD()
    h.set_opt_mode(True)
    h.set_request_block_size(request)
    h.connect_uri(sys.argv[1])
    try:
        h.opt_info()
        info = h.get_block_size(nbd.SIZE_MINIMUM)
    except nbd.Error:
        info = 0
    h.opt_go()
    print(request, info, h.get_block_size(nbd.SIZE_MINIMUM))
    h.shutdown()
"#;

/// Unaligned reads and writes from a client that did not ask for block sizes (libnbd's
/// strict alignment check off, as a client that never learnt of one).
const UNALIGNED: &str = r#"
import nbd, sys
h = nbd.NBD()
h.set_request_block_size(False)
h.set_strict_mode(0)
h.connect_uri(sys.argv[1])
assert h.get_block_size(nbd.SIZE_MINIMUM) == 1, h.get_block_size(nbd.SIZE_MINIMUM)
assert h.pread(1, 1) == b"\x5a"
h.pwrite(b"abc", 4097)
h.pwrite(b"xyz", 1)
assert h.pread(5, 0) == b"\x5axyz\x5a"
assert h.pread(5, 4096) == b"\x5aabc\x5a"
h.shutdown()
print("ok")
"#;

fn python(script: &str, uri: &str) -> String {
    stdout(&run_ok(
        Command::new(python_with_libnbd()).args(["-c", script, uri]),
    ))
}

#[test]
fn block_sizes_are_negotiated_as_qemu_nbd_negotiates_them() {
    let images = Dir::new();
    let raw = images.path("disk.raw");
    std::fs::write(&raw, vec![0u8; 1 << 20]).unwrap();
    for args in [&[][..], &["-f", "raw"][..]] {
        let theirs = QemuNbd::unix(args, &raw);
        let expected = python(SIZES, &theirs.uri_of(""));
        theirs.stop();
        let mut full = vec!["-t"];
        full.extend_from_slice(args);
        full.push(raw.to_str().unwrap());
        let ours = Server::unix(&full);
        let got = python(SIZES, &ours.uri());
        ours.stop_ok();
        assert_eq!(got, expected, "ours (left) against qemu-nbd, args {args:?}");
    }
    // The oracle's answers, so a change in it shows: probed raw has minimum 512 for
    // clients that ask, and refuses OPT_INFO to those that do not.
    let theirs = QemuNbd::unix(&[], &raw);
    let expected = python(SIZES, &theirs.uri_of(""));
    theirs.stop();
    assert_eq!(expected, "True 512 512\nFalse 0 1\n");
}

#[test]
fn unaligned_requests_from_clients_that_did_not_ask_are_served() {
    let images = Dir::new();
    let raw = images.path("disk.raw");
    for cache in ["writeback", "none"] {
        std::fs::write(&raw, vec![0x5au8; 1 << 20]).unwrap();
        let ours = Server::unix(&["-t", "--cache", cache, raw.to_str().unwrap()]);
        assert_eq!(python(UNALIGNED, &ours.uri()), "ok\n", "--cache={cache}");
        ours.stop_ok();
        let data = std::fs::read(&raw).unwrap();
        assert_eq!(&data[..5], b"\x5axyz\x5a", "--cache={cache}");
        assert_eq!(&data[4096..4101], b"\x5aabc\x5a", "--cache={cache}");
        assert!(data[4101..].iter().all(|&b| b == 0x5a), "--cache={cache}");
    }
}

#[test]
fn an_export_name_client_has_no_minimum_to_keep() {
    let images = Dir::new();
    let raw = images.path("disk.raw");
    std::fs::write(&raw, vec![0x5au8; 1 << 20]).unwrap();
    let server = Server::unix(&["-t", raw.to_str().unwrap()]);
    let mut c = KernelClient::connect(&server.socket, "");
    assert_eq!(c.read(1, 1), [0x5a]);
    assert_eq!(c.call(CMD_WRITE, 0, 3, 3, b"def").error, 0);
    assert_eq!(c.read(0, 7), b"\x5a\x5a\x5adef\x5a");
    c.disconnect();
    server.stop_ok();
    assert_eq!(&std::fs::read(&raw).unwrap()[..7], b"\x5a\x5a\x5adef\x5a");
}

/// QEMU's `compress` filter: writes through the export become compressed clusters, as
/// qemu-nbd writes them; the image passes `qemu-img check`, reads back what was written, and
/// `qemu-img map` shows the data compressed. The minimum block size is a cluster.
#[test]
fn writes_under_the_compress_filter_become_compressed_clusters() {
    let images = Dir::new();
    let img = images.create("disk.qcow2", "qcow2", "", None, "4M");
    let mut data = b"compress me ".repeat(100_000);
    data.truncate(1 << 20);
    data.resize(4 << 20, 0);
    std::fs::write(images.path("src.raw"), &data).unwrap();
    let opts = format!(
        "driver=compress,file.driver=qcow2,file.file.filename={}",
        img.display()
    );
    let server = Server::unix(&["-t", "--image-opts", &opts]);
    run_ok(
        Command::new(test_support::require("nbdcopy", "libnbd-bin"))
            .args([images.s("src.raw").as_str(), server.uri().as_str()]),
    );
    // A partial cluster is merged with what the cluster reads as, into a fresh cluster.
    let script = "import nbd, sys\nh = nbd.NBD()\nh.set_request_block_size(False)\n\
                  h.connect_uri(sys.argv[1])\nh.pwrite(b'tail', 3 << 20)\nh.shutdown()\n";
    python(script, &server.uri());
    server.stop_ok();
    data[3 << 20..(3 << 20) + 4].copy_from_slice(b"tail");
    std::fs::write(images.path("want.raw"), &data).unwrap();
    test_support::assert_check_clean(&img);
    images.qemu_img(&[
        "compare",
        "-f",
        "raw",
        "-F",
        "qcow2",
        "want.raw",
        "disk.qcow2",
    ]);
    let map = images.qemu_img(&["map", "--output=json", "disk.qcow2"]);
    let map: serde_json::Value = serde_json::from_str(&map).unwrap();
    let compressed: u64 = map
        .as_array()
        .unwrap()
        .iter()
        .filter(|e| e["compressed"] == true)
        .map(|e| e["length"].as_u64().unwrap())
        .sum();
    assert_eq!(compressed, (1 << 20) + (64 << 10), "{map}");
}
