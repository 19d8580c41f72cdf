//! qemu-img's outputs and messages, side by side with qemu-img (see `qemu_img_options::Pair`):
//! what scripts parse must read the same from our binary invoked as `qemu-img`.

use test_support::Dir;

use crate::qemu_img_options::Pair;

/// Zero clusters that keep their host cluster report where it is, in plain and extended L2
/// images alike, in the image itself and in a backing layer.
#[test]
fn map_json_gives_the_offset_of_allocated_zero_clusters() {
    let p = Pair::new(|d: &Dir| {
        d.create("a.qcow2", "qcow2", "", None, "1M");
        d.qemu_io(
            "qcow2",
            "a.qcow2",
            &["write -P 1 0 192k", "write -z 0 64k", "write -z 128k 64k"],
        );
        d.create("x.qcow2", "qcow2", "extended_l2=on", None, "1M");
        d.qemu_io(
            "qcow2",
            "x.qcow2",
            &["write -P 1 0 64k", "write -z 4k 8k", "write -z 32k 4k"],
        );
        d.create("b.qcow2", "qcow2", "", None, "1M");
        d.qemu_io(
            "qcow2",
            "b.qcow2",
            &["write -P 2 0 128k", "write -z 64k 64k"],
        );
        d.create("m.qcow2", "qcow2", "", Some(("b.qcow2", "qcow2")), "1M");
        d.create("t.qcow2", "qcow2", "", Some(("m.qcow2", "qcow2")), "1M");
        d.qemu_io("qcow2", "t.qcow2", &["write -P 3 0 4k"]);
    });
    for img in ["a.qcow2", "x.qcow2", "t.qcow2"] {
        p.same(&["map", "--output=json", img]);
        p.same(&["map", "--output=json", "-s", "96k", "--max-length=48k", img]);
    }
}

/// The "Formatting" line lists the options in qemu-img's order with its defaults, values as
/// qemu-img reads them (numbers signed, commas in text doubled), also when the driver then
/// refuses a value.
#[test]
fn create_formatting_line_is_qemu_imgs() {
    let p = Pair::new(|d: &Dir| {
        d.create("b,x.qcow2", "qcow2", "", None, "1M");
    });
    for opts in [
        "refcount_bits=-1",
        "refcount_bits=0x8,lazy_refcounts=yes,compat=1.1",
        "preallocation=bogus",
        "compat=bogus",
        "compression_type=nope",
        "cluster_size=4k,extended_l2=on,preallocation=metadata",
        "lazy_refcounts,compat=v3,compression_type=zstd",
    ] {
        p.same(&["create", "-f", "qcow2", "-o", opts, "x.qcow2", "64M"]);
    }
    p.same(&[
        "create",
        "-f",
        "qcow2",
        "-b",
        "b,x.qcow2",
        "-F",
        "qcow2",
        "t.qcow2",
    ]);
    p.same(&[
        "create",
        "-f",
        "raw",
        "-o",
        "preallocation=falloc",
        "r",
        "1000",
    ]);
    p.same(&["create", "-f", "raw", "r2", "1M"]);
}

/// Sets incompatible feature bits 62 and 63 in a v3 image and renames the feature table's
/// first incompatible entry to bit 62, so one bit has a name and one has none.
fn unknown_features(d: &Dir) {
    d.create("f.qcow2", "qcow2", "", None, "1M");
    let path = d.path("f.qcow2");
    let mut b = std::fs::read(&path).expect("read image");
    b[72..80].copy_from_slice(&(3u64 << 62).to_be_bytes());
    let header_len = u32::from_be_bytes(b[100..104].try_into().unwrap()) as usize;
    let mut at = header_len;
    loop {
        let magic = u32::from_be_bytes(b[at..at + 4].try_into().unwrap());
        let len = u32::from_be_bytes(b[at + 4..at + 8].try_into().unwrap()) as usize;
        assert_ne!(magic, 0, "qemu-img wrote no feature name table");
        if magic == 0x6803_f857 {
            let entry = (0..len / 48)
                .map(|i| at + 8 + i * 48)
                .find(|&e| b[e] == 0)
                .expect("an incompatible feature entry");
            b[entry + 1] = 62;
            break;
        }
        at += 8 + len.next_multiple_of(8);
    }
    std::fs::write(&path, b).expect("write image");
}

/// Unknown incompatible features are refused with qemu-img's words: names from the image's
/// feature table, then the mask of the unnamed bits.
#[test]
fn unsupported_features_are_listed_as_qemu_img_does() {
    let p = Pair::new(unknown_features);
    for args in [
        &["info", "f.qcow2"][..],
        &["check", "f.qcow2"],
        &["map", "f.qcow2"],
    ] {
        p.same(args);
    }
}

/// Where the feature name table's data starts and how long it is, in the image `b`.
fn feature_table(b: &[u8]) -> (usize, usize) {
    let header_len = u32::from_be_bytes(b[100..104].try_into().unwrap()) as usize;
    let mut at = header_len;
    loop {
        let magic = u32::from_be_bytes(b[at..at + 4].try_into().unwrap());
        let len = u32::from_be_bytes(b[at + 4..at + 8].try_into().unwrap()) as usize;
        assert_ne!(magic, 0, "qemu-img wrote no feature name table");
        if magic == 0x6803_f857 {
            return (at + 8, len);
        }
        at += 8 + len.next_multiple_of(8);
    }
}

/// Images whose feature tables QEMU reads its own way: `p.qcow2` has one partial entry (a
/// name shorter than the 46 bytes an entry holds) naming incompatible bit 63; `e.qcow2` has
/// an entry with an empty name before the one naming bit 62, which ends the table.
fn odd_feature_tables(d: &Dir) {
    for (name, entries, bits) in [
        ("p.qcow2", &b"\x00\x3fTest feature"[..], 1u64 << 63),
        ("e.qcow2", &[0u8; 48][..], 3u64 << 61),
    ] {
        d.create(name, "qcow2", "", None, "1M");
        let path = d.path(name);
        let mut b = std::fs::read(&path).expect("read image");
        b[72..80].copy_from_slice(&bits.to_be_bytes());
        let (data, len) = feature_table(&b);
        let mut table = entries.to_vec();
        if name == "e.qcow2" {
            table[1] = 61;
            table.extend_from_slice(b"\x00\x3etest2");
            table.resize(96, 0);
        }
        assert!(
            table.len() <= len,
            "the new table fits where the old one was"
        );
        b[data - 4..data].copy_from_slice(&(table.len() as u32).to_be_bytes());
        b[data..data + len].fill(0);
        b[data..data + table.len()].copy_from_slice(&table);
        std::fs::write(&path, b).expect("write image");
    }
}

/// A feature name table is read as qemu-img reads it: a partial last entry still names its
/// bit, and an entry without a name ends the table.
#[test]
fn feature_table_partial_and_empty_entries_are_read_as_qemu_img_does() {
    let p = Pair::new(odd_feature_tables);
    for img in ["p.qcow2", "e.qcow2"] {
        p.same(&["info", img]);
        p.same(&["check", img]);
    }
}

/// A repairing check opens the image read-write, which drops the autoclear bits nobody
/// here understands (the header then says the same as after qemu-img's).
#[test]
fn repairing_check_clears_unknown_autoclear_bits() {
    let p = Pair::new(|d: &Dir| {
        d.create("a.qcow2", "qcow2", "", None, "1M");
        let path = d.path("a.qcow2");
        let mut b = std::fs::read(&path).expect("read image");
        b[88..96].copy_from_slice(&(1u64 << 63).to_be_bytes());
        std::fs::write(&path, b).expect("write image");
    });
    p.same(&["check", "a.qcow2"]);
    let autoclear = |d: &Dir| d.read("a.qcow2")[88..96].to_vec();
    assert_eq!(
        autoclear(&p.ours),
        autoclear(&p.qemu),
        "a plain check changes nothing"
    );
    assert_eq!(autoclear(&p.ours), (1u64 << 63).to_be_bytes());
    p.same(&["check", "-r", "all", "a.qcow2"]);
    assert_eq!(autoclear(&p.ours), autoclear(&p.qemu));
    assert_eq!(autoclear(&p.ours), [0; 8]);
}

/// A backing file given without its format is opened all the same before the image is
/// made: one that cannot be opened is reported so, one that can is refused with the format
/// qemu-img found in it; with `-u` only the missing format is reported.
#[test]
fn create_backing_without_format_opens_it_first() {
    let p = Pair::new(|d: &Dir| {
        d.create("b.qcow2", "qcow2", "", None, "1M");
    });
    p.same(&["create", "-f", "qcow2", "-b", "nosuch.qcow2", "t.qcow2"]);
    p.same(&[
        "create",
        "-f",
        "qcow2",
        "-b",
        "nosuch.qcow2",
        "t.qcow2",
        "1M",
    ]);
    p.same(&["create", "-f", "qcow2", "-b", "b.qcow2", "t.qcow2", "1M"]);
    p.same(&[
        "create", "-f", "qcow2", "-u", "-b", "b.qcow2", "t.qcow2", "1M",
    ]);
}

/// A header whose tables or size fail the checks QEMU makes when it opens an image is
/// refused in QEMU's words, by every tool that opens it.
#[test]
fn header_table_errors_are_worded_as_qemu_img_words_them() {
    // (field offset, bytes): L1 too small, disk too big, refcount table too large, refcount
    // table and L1 table misaligned, no refcount table.
    let pokes: [(usize, &[u8]); 6] = [
        (36, &[0; 4]),
        (24, &(1u64 << 60).to_be_bytes()),
        (56, &[0xff; 4]),
        (48, &0x1234_5678_90ab_cdefu64.to_be_bytes()),
        (40, &0x1234_5678_90ab_cdefu64.to_be_bytes()),
        (56, &[0; 4]),
    ];
    let p = Pair::new(|d: &Dir| {
        for (i, (at, bytes)) in pokes.iter().enumerate() {
            let name = format!("h{i}.qcow2");
            d.create(&name, "qcow2", "", None, "64M");
            let mut b = d.read(&name);
            b[*at..at + bytes.len()].copy_from_slice(bytes);
            std::fs::write(d.path(&name), b).expect("write image");
        }
    });
    for i in 0..pokes.len() {
        let img = format!("h{i}.qcow2");
        p.same(&["info", &img]);
        p.same(&["map", &img]);
        if i != 5 {
            // A check opens an image without a refcount table to rebuild one.
            p.same(&["check", &img]);
        }
    }
}

/// `info --output=json` is laid out as qemu-img lays it out: four spaces per level, empty
/// containers over two lines, members in the order QEMU's dictionary gives them.
#[test]
fn info_json_is_laid_out_as_qemu_img_lays_it_out() {
    let p = Pair::new(|d: &Dir| {
        d.create("b.qcow2", "qcow2", "", None, "1M");
        d.create("t.qcow2", "qcow2", "", Some(("b.qcow2", "qcow2")), "1M");
        d.qemu_img(&["bitmap", "--add", "t.qcow2", "bm0"]);
        d.create("r.raw", "raw", "", None, "1M");
    });
    p.same(&["info", "--output=json", "t.qcow2"]);
    p.same(&["info", "--output=json", "--backing-chain", "t.qcow2"]);
    p.same(&["info", "--output=json", "r.raw"]);
}

/// A backing chain that comes back to an image already shown is refused with qemu-img's
/// words, naming the image seen twice.
#[test]
fn info_backing_chain_loop_is_reported_as_qemu_img_reports_it() {
    let p = Pair::new(|d: &Dir| {
        d.create("self.qcow2", "qcow2", "", None, "1M");
        d.qemu_img(&[
            "rebase",
            "-u",
            "-b",
            "self.qcow2",
            "-F",
            "qcow2",
            "self.qcow2",
        ]);
        d.create("a.qcow2", "qcow2", "", None, "1M");
        d.create("b.qcow2", "qcow2", "", Some(("a.qcow2", "qcow2")), "1M");
        d.create("c.qcow2", "qcow2", "", Some(("b.qcow2", "qcow2")), "1M");
        d.qemu_img(&["rebase", "-u", "-b", "b.qcow2", "-F", "qcow2", "a.qcow2"]);
    });
    for img in ["self.qcow2", "c.qcow2"] {
        p.same(&["info", "--backing-chain", img]);
        p.same(&["info", img]);
    }
}

/// An encrypted image given with its key secret in `--image-opts` is shown under QEMU's
/// `json:{...}` pseudo-filename; the file below it keeps its plain name.
#[test]
fn info_names_an_image_opened_with_its_key_secret_as_qemu_img_does() {
    let p = Pair::new(|d: &Dir| {
        d.qemu_img(&[
            "create",
            "-q",
            "-f",
            "qcow2",
            "--object",
            "secret,id=s0,data=x",
            "-o",
            "encrypt.format=luks,encrypt.key-secret=s0,encrypt.iter-time=10",
            "e.qcow2",
            "1M",
        ]);
    });
    let names = |out: &std::process::Output| -> Vec<String> {
        String::from_utf8_lossy(&out.stdout)
            .lines()
            .filter(|l| l.starts_with("image: ") || l.contains("\"filename\": "))
            .map(str::to_string)
            .collect()
    };
    for output in ["--output=human", "--output=json"] {
        let (q, o) = p.run(&[
            "info",
            output,
            "--object",
            "secret,id=s0,data=x",
            "--image-opts",
            "driver=qcow2,file.filename=e.qcow2,encrypt.key-secret=s0",
        ]);
        assert!(q.status.success() && o.status.success(), "{o:?}");
        assert_eq!(names(&o), names(&q));
        assert!(
            names(&o).iter().any(|n| n.contains("json:{")),
            "{:?}",
            names(&o)
        );
    }
}

/// Encryption settings without `encrypt.format` are refused as qemu-img refuses them, after
/// the "Formatting" line.
#[test]
fn encrypt_settings_without_a_format_are_refused_as_qemu_img_refuses_them() {
    let p = Pair::new(|_: &Dir| {});
    for opts in [
        "encrypt.key-secret=s",
        "encrypt.iter-time=10,encrypt.cipher-alg=aes-128",
        "encryption=off,encrypt.hash-alg=sha1",
    ] {
        p.same(&["create", "-f", "qcow2", "-o", opts, "z.qcow2", "1M"]);
    }
}
