//! What a read-write open owes the format: unknown autoclear bits cleared (the spec asks a
//! writer to), and nothing written at all when the open is refused.

use storage::Aio;

use qcow2::engine::{Image, OpenOptions};

use crate::support::opener;
use test_support::{qemu_img, run, Dir};

const AUTOCLEAR_AT: usize = 88;
const INCOMPATIBLE_AT: usize = 72;
const UNKNOWN_AUTOCLEAR: u64 = 1 << 5;

fn word(bytes: &[u8], at: usize) -> u64 {
    u64::from_be_bytes(bytes[at..at + 8].try_into().unwrap())
}

fn set_bits(path: &std::path::Path, at: usize, bits: u64) {
    let mut bytes = std::fs::read(path).unwrap();
    let v = word(&bytes, at) | bits;
    bytes[at..at + 8].copy_from_slice(&v.to_be_bytes());
    std::fs::write(path, bytes).unwrap();
}

fn open(path: &std::path::Path, read_only: bool) -> Result<(), String> {
    run(async {
        let opts = OpenOptions {
            read_only,
            ..OpenOptions::default()
        };
        let img = Image::open(&opener(Aio::Threads), path, &opts)
            .await
            .map_err(|e| e.to_string())?;
        img.close().await.map_err(|e| e.to_string())
    })
}

#[test]
fn unknown_autoclear_bits_are_cleared_by_a_read_write_open_only() {
    let d = Dir::new();
    let path = d.create("img.qcow2", "qcow2", "", None, "16M");
    qemu_img(&["bitmap", "--add", "--disable", &d.s("img.qcow2"), "kept"]);
    set_bits(&path, AUTOCLEAR_AT, UNKNOWN_AUTOCLEAR);
    let before = std::fs::read(&path).unwrap();
    assert_eq!(word(&before, AUTOCLEAR_AT), 1 | UNKNOWN_AUTOCLEAR);

    open(&path, true).unwrap();
    assert_eq!(
        std::fs::read(&path).unwrap(),
        before,
        "a read-only open wrote"
    );

    open(&path, false).unwrap();
    let after = std::fs::read(&path).unwrap();
    // The bitmaps bit is ours to keep (a disabled bitmap stays valid); the unknown one goes.
    assert_eq!(word(&after, AUTOCLEAR_AT), 1);
    let check = qemu_img(&["check", &d.s("img.qcow2")]);
    assert!(check.contains("No errors"), "{check}");
    let info = qemu_img(&["info", &d.s("img.qcow2")]);
    assert!(
        info.contains("kept"),
        "the disabled bitmap survived: {info}"
    );
}

#[test]
fn a_refused_read_write_open_writes_nothing() {
    let d = Dir::new();
    let path = d.create("img.qcow2", "qcow2", "lazy_refcounts=on", None, "16M");
    // A bitmap whose table has a reserved bit set cannot be loaded, which refuses the open
    // late; the dirty bit would ask for a refcount repair, the unknown autoclear bit for a
    // header write and the bitmap for its in-use mark.
    qemu_img(&["bitmap", "--add", &d.s("img.qcow2"), "tracking"]);
    let table = {
        let bytes = std::fs::read(&path).unwrap();
        let meta = qcow2::inspect::inspect(bytes.as_slice()).unwrap();
        meta.bitmaps[0].table_offset as usize
    };
    set_bits(&path, table, 1 << 1);
    set_bits(&path, INCOMPATIBLE_AT, 1);
    set_bits(&path, AUTOCLEAR_AT, UNKNOWN_AUTOCLEAR);
    let before = std::fs::read(&path).unwrap();
    let err = open(&path, false).expect_err("a bitmap that cannot be loaded refuses the open");
    assert!(err.contains("bitmap table"), "{err}");
    assert_eq!(
        std::fs::read(&path).unwrap(),
        before,
        "the refused open changed the file"
    );
}
