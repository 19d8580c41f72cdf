//! `qcow2-nbd snapshot` side by side with `qemu-img snapshot`: the same operations on two
//! copies of one image must leave images that `qemu-img check` finds clean, that list the
//! same snapshots (IDs, names, sizes) and hold the same disk and snapshot contents; and
//! snapshots made by one tool must apply and delete with the other.

use test_support::{assert_same_bytes, qemu_contents, text, Dir};

use crate::common::{self, BIN};

/// One kind of image the operations run on.
struct Setup {
    what: &'static str,
    opts: &'static str,
    cluster: u64,
    /// A raw backing file under the image.
    backing: bool,
    /// A compressed cluster in the disk.
    compressed: bool,
    /// Persistent bitmaps (which make apply fail, in qemu-img as here).
    bitmaps: bool,
}

/// Creates `name` as `s` says, with data in several clusters.
fn image(d: &Dir, s: &Setup, name: &str) {
    let backing = s.backing.then_some(("base.raw", "raw"));
    if s.backing {
        d.create("base.raw", "raw", "", None, "8M");
        d.qemu_io("raw", "base.raw", &["write -P 0x11 0 8M"]);
    }
    d.create(name, "qcow2", s.opts, backing, "8M");
    let cs = s.cluster;
    d.qemu_io("qcow2", name, &["write -P 1 0 256k", "write -P 9 3M 4k"]);
    if s.compressed {
        d.qemu_io("qcow2", name, &[&format!("write -c -P 7 2M {cs}")]);
    }
    if s.bitmaps {
        d.qemu_img(&["bitmap", "--add", name, "b0"]);
    }
}

/// Runs a snapshot command with qemu-img on `q` and with us on `o`: both must end the
/// same way and say the same (after the program's name).
fn both(d: &Dir, args: &[&str], q: &str, o: &str) {
    let (qemu, ours) = common::side_by_side(d, "snapshot", (q, o), &[args, &["{}"]].concat());
    assert_eq!(
        ours.status.code(),
        qemu.status.code(),
        "snapshot {args:?}: ours {}, qemu {}",
        text(&ours),
        text(&qemu)
    );
    // The first line of stderr after the program's name, the image's name generalized.
    let said = |out: &std::process::Output, prog: &str, img: &str| {
        String::from_utf8_lossy(&out.stderr)
            .lines()
            .next()
            .unwrap_or("")
            .trim_start_matches(prog)
            .replace(img, "IMAGE")
    };
    assert_eq!(
        said(&ours, "qcow2-nbd: ", o),
        said(&qemu, "qemu-img: ", q),
        "{args:?}"
    );
}

/// The listing without dates: ID, tag, VM size, VM clock, icount per snapshot.
fn listing(d: &Dir, img: &str) -> Vec<String> {
    let out = d.qemu_img(&["snapshot", "-l", img]);
    out.lines()
        .skip(2)
        .map(|l| {
            let f: Vec<&str> = l.split_whitespace().collect();
            assert_eq!(f.len(), 8, "listing line {l:?}");
            [f[0], f[1], f[2], f[3], f[6], f[7]].join(" ")
        })
        .collect()
}

/// Both images pass `qemu-img check`, list the same snapshots, and hold the same disk and
/// the same snapshot contents; our listing of ours is qemu-img's to the byte.
fn same(d: &Dir, q: &str, o: &str, what: &str) {
    d.assert_check_clean(q);
    d.assert_check_clean(o);
    let ids = listing(d, o);
    assert_eq!(ids, listing(d, q), "{what}: listings");
    let ours = d.ok(BIN, &["snapshot", "-l", o]);
    assert_eq!(
        ours,
        d.qemu_img(&["snapshot", "-l", o]),
        "{what}: our listing"
    );
    assert_same_bytes(
        &qemu_contents(&d.path(o), &["-f", "qcow2"]),
        &qemu_contents(&d.path(q), &["-f", "qcow2"]),
        &format!("{what}: disk"),
    );
    for line in ids {
        let id = line.split(' ').next().expect("id");
        let sn = format!("snapshot.id={id}");
        assert_same_bytes(
            &qemu_contents(&d.path(o), &["-f", "qcow2", "-l", &sn]),
            &qemu_contents(&d.path(q), &["-f", "qcow2", "-l", &sn]),
            &format!("{what}: snapshot {id}"),
        );
    }
}

/// The operations of `s`, by qemu-img on one copy and by us on the other, then each tool on
/// the snapshots the other made.
fn scenario(s: &Setup) {
    let d = Dir::new();
    image(&d, s, "q.qcow2");
    d.copy("q.qcow2", "o.qcow2");
    let (q, o) = ("q.qcow2", "o.qcow2");
    let write = |cmd: &str| {
        d.qemu_io("qcow2", q, &[cmd]);
        d.qemu_io("qcow2", o, &[cmd]);
    };
    both(&d, &["-c", "first"], q, o);
    write("write -P 2 128k 128k");
    both(&d, &["-c", "second"], q, o);
    write("write -P 3 0 64k");
    write("write -z 3M 4k");
    both(&d, &["-c", "first"], q, o);
    same(&d, q, o, &format!("{}: after creating", s.what));
    write("write -P 4 64k 64k");
    both(&d, &["-a", "second"], q, o);
    both(&d, &["-a", "nope"], q, o);
    same(&d, q, o, &format!("{}: after applying", s.what));
    both(&d, &["-d", "first"], q, o);
    both(&d, &["-d", "1"], q, o);
    same(&d, q, o, &format!("{}: after deleting", s.what));
    if s.bitmaps {
        // The bitmaps are still there, and still clean, in both.
        let bitmaps = |img: &str| d.info(img)["format-specific"]["data"]["bitmaps"].clone();
        assert_eq!(bitmaps(o), bitmaps(q));
        assert!(bitmaps(o).as_array().is_some_and(|b| b.len() == 1));
        return;
    }
    // Each tool applies and deletes what the other created: the copies swap tools.
    let d2 = |prog: &str, args: &[&str], img: &str| {
        d.ok(prog, &[&["snapshot"], args, &[img]].concat());
    };
    write("write -P 5 1M 64k");
    d2("qemu-img", &["-a", "3"], o);
    d2(BIN, &["-a", "3"], q);
    same(&d, q, o, &format!("{}: applied by the other tool", s.what));
    d2("qemu-img", &["-d", "second"], o);
    d2(BIN, &["-d", "second"], q);
    same(&d, q, o, &format!("{}: deleted by the other tool", s.what));
}

#[test]
fn snapshots_side_by_side_64k_standard_with_compressed_clusters() {
    scenario(&Setup {
        what: "64k standard",
        opts: "",
        cluster: 65536,
        backing: false,
        compressed: true,
        bitmaps: false,
    });
}

#[test]
fn snapshots_side_by_side_64k_extended_over_backing() {
    scenario(&Setup {
        what: "64k extended L2 over raw backing",
        opts: "extended_l2=on",
        cluster: 65536,
        backing: true,
        compressed: true,
        bitmaps: false,
    });
}

#[test]
fn snapshots_side_by_side_4k_standard_over_backing() {
    scenario(&Setup {
        what: "4k standard over raw backing",
        opts: "cluster_size=4096",
        cluster: 4096,
        backing: true,
        compressed: true,
        bitmaps: false,
    });
}

#[test]
fn snapshots_side_by_side_with_persistent_bitmaps() {
    scenario(&Setup {
        what: "64k with bitmaps",
        opts: "cluster_size=65536",
        cluster: 65536,
        backing: false,
        compressed: false,
        bitmaps: true,
    });
}

#[test]
fn snapshots_side_by_side_v2_4k() {
    scenario(&Setup {
        what: "4k compat 0.10",
        opts: "cluster_size=4096,compat=0.10",
        cluster: 4096,
        backing: false,
        compressed: true,
        bitmaps: false,
    });
}

/// Applying a snapshot taken at another disk size brings that size back (and its data),
/// as QEMU does; our snapshot of the larger disk applies in QEMU too.
#[test]
fn apply_restores_the_snapshot_disk_size() {
    let d = Dir::new();
    d.create("q.qcow2", "qcow2", "", None, "4M");
    d.qemu_io("qcow2", "q.qcow2", &["write -P 1 0 4M"]);
    d.copy("q.qcow2", "o.qcow2");
    let (q, o) = ("q.qcow2", "o.qcow2");
    both(&d, &["-c", "small"], q, o);
    for img in [q, o] {
        d.qemu_img(&["resize", img, "300M"]);
        d.qemu_io("qcow2", img, &["write -P 2 200M 1M"]);
    }
    both(&d, &["-c", "large"], q, o);
    both(&d, &["-a", "small"], q, o);
    same(&d, q, o, "shrunk back");
    assert_eq!(d.info(o)["virtual-size"], 4 << 20);
    d.ok("qemu-img", &["snapshot", "-a", "large", o]);
    d.ok(BIN, &["snapshot", "-a", "large", q]);
    same(&d, q, o, "grown again");
    assert_eq!(d.info(o)["virtual-size"], 300 << 20);
}

/// Option and lookup errors read as qemu-img's, and exit the same way.
#[test]
fn refusals_match_qemu_img() {
    let d = Dir::new();
    d.create("q.qcow2", "qcow2", "", None, "1M");
    d.copy("q.qcow2", "o.qcow2");
    let (q, o) = ("q.qcow2", "o.qcow2");
    both(&d, &["-l", "-c", "x"], q, o);
    both(&d, &["-a", "x"], q, o);
    both(&d, &["-d", "x"], q, o);
    both(&d, &["-U", "-c", "x"], q, o);
    both(&d, &[], q, o);
    d.create("r.raw", "raw", "", None, "1M");
    d.copy("r.raw", "s.raw");
    for op in ["-c", "-a", "-d"] {
        both(&d, &["-f", "raw", op, "x"], "r.raw", "s.raw");
    }
    both(&d, &["-f", "raw", "-l"], "r.raw", "s.raw");
    d.create("df.qcow2", "qcow2", "data_file=df.raw", None, "1M");
    let out = d.run(BIN, &["snapshot", "-c", "x", "df.qcow2"]);
    assert_eq!(
        String::from_utf8_lossy(&out.stderr).trim(),
        "qcow2-nbd: Could not create snapshot 'x': Operation not supported"
    );
    // One-bit refcounts cannot count a second reference. QEMU has written the copy of the
    // L1 table by then: it stays leaked, and the refusal says only "Invalid argument".
    d.create("r1.qcow2", "qcow2", "refcount_bits=1", None, "1M");
    d.qemu_io("qcow2", "r1.qcow2", &["write 0 64k"]);
    d.copy("r1.qcow2", "q1.qcow2");
    both(&d, &["-c", "x"], "q1.qcow2", "r1.qcow2");
    let checked = |img: &str| d.run("qemu-img", &["check", img]);
    let (q, o) = (checked("q1.qcow2"), checked("r1.qcow2"));
    assert_eq!(o.status.code(), Some(3), "{}", text(&o));
    assert_eq!(text(&o), text(&q));
}

/// Writes `bytes` at `offset` of the file `name` in `d`.
fn poke(d: &Dir, name: &str, offset: u64, bytes: &[u8]) {
    use std::io::{Seek, SeekFrom, Write};
    let mut f = std::fs::OpenOptions::new()
        .write(true)
        .open(d.path(name))
        .expect("open");
    f.seek(SeekFrom::Start(offset)).expect("seek");
    f.write_all(bytes).expect("poke");
}

/// The big-endian word at `offset` of the file `name` in `d`.
fn peek64(d: &Dir, name: &str, offset: usize) -> u64 {
    let bytes = d.read(name);
    u64::from_be_bytes(bytes[offset..offset + 8].try_into().expect("8 bytes"))
}

/// QEMU opens an image whose snapshot's L1 table it would not use, and refuses the table
/// only when the snapshot is used: `convert -l`, `measure -l`, `qemu-nbd -l`, `-a`, `-d`
/// and the zero expansion of a downgrade, each in its own words (iotest 080); a check
/// reports it and counts on.
#[test]
fn snapshot_l1_tables_are_judged_when_used() {
    let cases: [(&str, u64, &[u8]); 2] = [
        ("unaligned", 0, &0x40_0200u64.to_be_bytes()),
        ("too large", 8, &0x1000_0000u32.to_be_bytes()),
    ];
    for (what, field, value) in cases {
        let p = crate::qemu_img_options::Pair::new(|d| {
            d.create("s.qcow2", "qcow2", "", None, "64M");
            d.qemu_io("qcow2", "s.qcow2", &["write 0 512"]);
            d.qemu_img(&["snapshot", "-c", "test", "s.qcow2"]);
            let table = peek64(d, "s.qcow2", 64);
            poke(d, "s.qcow2", table + field, value);
        });
        eprintln!("{what}");
        p.same(&["info", "s.qcow2"]);
        p.same(&["convert", "-l", "test", "s.qcow2", "c.raw"]);
        p.same(&["measure", "-l", "test", "s.qcow2"]);
        // qemu-nbd loads the snapshot as qemu-img does (the timeout only bounds a server
        // that would wrongly start).
        std::os::unix::fs::symlink(BIN, p.ours.path("qemu-nbd")).expect("link");
        let nbd = |d: &Dir, prog: &str| {
            let out = d.run(
                "timeout",
                &[
                    "10",
                    prog,
                    "-r",
                    "-l",
                    "test",
                    "-k",
                    &d.s("n.sock"),
                    "s.qcow2",
                ],
            );
            (
                out.status.code(),
                String::from_utf8_lossy(&out.stderr).into_owned(),
            )
        };
        let ours = nbd(&p.ours, p.ours.s("qemu-nbd").as_str());
        assert_eq!(ours, nbd(&p.qemu, "qemu-nbd"), "{what}");
        p.same(&["snapshot", "-a", "test", "s.qcow2"]);
        p.same(&["snapshot", "-d", "test", "s.qcow2"]);
        p.same(&["amend", "-o", "compat=0.10", "s.qcow2"]);
        p.same(&["check", "s.qcow2"]);
    }
}

/// Changes an image in place.
type Patcher = Box<dyn Fn(&Dir)>;

/// Snapshot creation fails as QEMU's fails: with EFBIG for a full table (here 65536 entries
/// past the end of the file, which read as empty ones), and for an L2 entry whose cluster
/// no refcount table of QEMU's size can reach, and with EAGAIN for one whose refcount block
/// is missing (QEMU creates it and asks to start over).
#[test]
fn snapshot_creation_fails_in_qemus_words() {
    let table_full = |d: &Dir| {
        poke(d, "s.qcow2", 60, &0x1_0000u32.to_be_bytes());
        poke(d, "s.qcow2", 64, &0x100_0000u64.to_be_bytes());
    };
    let l2_entry = |word: u64| {
        move |d: &Dir| {
            d.qemu_io("qcow2", "s.qcow2", &["write 0 512"]);
            poke(d, "s.qcow2", 0x4_0000, &word.to_be_bytes());
        }
    };
    let cases: [(&str, Patcher); 3] = [
        ("a full table", Box::new(table_full)),
        ("past any table", Box::new(l2_entry(0xbfff_ffff_ffff_0000))),
        ("no block", Box::new(l2_entry(0x8000_00ff_ffff_0000))),
    ];
    for (what, patch) in cases {
        let p = crate::qemu_img_options::Pair::new(|d| {
            d.create("s.qcow2", "qcow2", "", None, "64M");
            patch(d);
        });
        eprintln!("{what}");
        let out = p.same(&["snapshot", "-c", "test", "s.qcow2"]);
        assert_eq!(out.status.code(), Some(1), "{what}");
    }
}

/// A name longer than qemu-img keeps is cut as qemu-img cuts it, and IDs continue after
/// the largest one.
#[test]
fn long_names_and_ids_match_qemu_img() {
    let d = Dir::new();
    d.create("q.qcow2", "qcow2", "", None, "1M");
    d.copy("q.qcow2", "o.qcow2");
    let long = "n".repeat(300);
    both(&d, &["-c", &long], "q.qcow2", "o.qcow2");
    both(&d, &["-c", "b"], "q.qcow2", "o.qcow2");
    both(&d, &["-d", &long[..255]], "q.qcow2", "o.qcow2");
    both(&d, &["-c", "c"], "q.qcow2", "o.qcow2");
    same(&d, "q.qcow2", "o.qcow2", "long names");
}

/// An image another process has open for writing is refused, as qemu-img refuses it.
#[test]
fn a_served_image_is_refused() {
    let d = Dir::new();
    d.create("o.qcow2", "qcow2", "", None, "1M");
    let mut nbd = std::process::Command::new("qemu-nbd")
        .args(["-f", "qcow2", "-k"])
        .arg(d.path("nbd.sock"))
        .arg(d.path("o.qcow2"))
        .spawn()
        .expect("run qemu-nbd");
    let sock = d.path("nbd.sock");
    for _ in 0..200 {
        if sock.exists() {
            break;
        }
        std::thread::sleep(std::time::Duration::from_millis(10));
    }
    let out = d.run(BIN, &["snapshot", "-c", "x", "o.qcow2"]);
    let listed = d.run(BIN, &["snapshot", "-U", "-l", "o.qcow2"]);
    let _ = nbd.kill();
    let _ = nbd.wait();
    assert_eq!(out.status.code(), Some(1), "{}", text(&out));
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("lock"),
        "{}",
        text(&out)
    );
    assert!(listed.status.success(), "{}", text(&listed));
    d.assert_check_clean("o.qcow2");
}

/// A snapshot entry claiming more extra data than QEMU allows is refused at open in QEMU's
/// words, with its hint to repair it.
#[test]
fn too_much_snapshot_extra_data_is_refused_in_qemus_words() {
    let p = crate::qemu_img_options::Pair::new(|d| {
        d.create("x.qcow2", "qcow2", "", None, "1M");
        d.qemu_img(&["snapshot", "-c", "a", "x.qcow2"]);
        let path = d.path("x.qcow2");
        let mut file = std::fs::read(&path).expect("read");
        let table = u64::from_be_bytes(file[64..72].try_into().expect("8 bytes")) as usize;
        file[table + 36..table + 40].copy_from_slice(&0x1_0000u32.to_be_bytes());
        std::fs::write(&path, file).expect("write");
    });
    p.same(&["info", "x.qcow2"]);
    p.same(&["map", "x.qcow2"]);
    // check reports it through QEMU's error reporter and fails with EFBIG's text.
    p.same(&["check", "x.qcow2"]);
}

/// An image whose snapshot table passes 64 MiB: refused at open with the count of the
/// snapshots that do not fit, and the check says so in QEMU's words.
#[test]
fn a_snapshot_table_past_64_mib_is_refused_in_qemus_words() {
    let p = crate::qemu_img_options::Pair::new(|d| {
        d.create("big.qcow2", "qcow2", "", None, "64M");
        let mut file = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .open(d.path("big.qcow2"))
            .expect("open");
        // Entries of 40 + 1 KiB + 2 * 65535 bytes (IDs and names all NUL), enough of them
        // to pass 64 MiB, at 1 MiB; only the fixed parts are written, the rest is sparse.
        let entry_len: u64 = (40 + 1024 + 65535 + 65535 + 2) as u64;
        let count = (64 << 20) / entry_len + 2;
        let mut fixed = [0u8; 40];
        fixed[12..14].copy_from_slice(&0xffffu16.to_be_bytes());
        fixed[14..16].copy_from_slice(&0xffffu16.to_be_bytes());
        fixed[36..40].copy_from_slice(&1024u32.to_be_bytes());
        use std::io::{Seek, SeekFrom, Write};
        for i in 0..count {
            file.seek(SeekFrom::Start((1 << 20) + i * entry_len))
                .expect("seek");
            file.write_all(&fixed).expect("write an entry");
        }
        file.set_len((1 << 20) + count * entry_len).expect("size");
        file.seek(SeekFrom::Start(60)).expect("seek");
        file.write_all(&(count as u32).to_be_bytes())
            .expect("nb_snapshots");
        file.write_all(&(1u64 << 20).to_be_bytes())
            .expect("snapshots_offset");
    });
    p.same(&["info", "big.qcow2"]);
    p.same(&["check", "big.qcow2"]);
    // The repair drops the snapshots that do not fit; the rest are listed with their IDs
    // and names ending at the first NUL byte, as QEMU's C strings end.
    p.same(&["check", "-r", "all", "big.qcow2"]);
    p.same(&["snapshot", "-l", "big.qcow2"]);
}
