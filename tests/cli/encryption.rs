//! qcow2's own encryption against QEMU: LUKS (`encrypt.format=luks`) and legacy AES
//! (`encryption=on`) images made by qemu-img are read and written by ours, ours are read and
//! written by qemu-io, and the secrets come as QEMU's tools take them (`--object secret`,
//! `--image-opts ...,encrypt.key-secret=ID`).

use test_support::{text, Dir};

use crate::common::BIN;

const SECRET: &str = "secret,id=sec0,data=astrochicken";
/// A second secret, for a second layer or key slot.
const SECRET1: &str = "secret,id=sec1,data=furby";

/// `--image-opts` string of `image` with secret `sec0`.
fn spec(d: &Dir, image: &str) -> String {
    format!(
        "driver=qcow2,file.filename={},encrypt.key-secret=sec0",
        d.s(image)
    )
}

/// qemu-io on an encrypted image; every command must succeed.
fn qemu_io(d: &Dir, image: &str, cmds: &[&str]) -> String {
    let spec = spec(d, image);
    let mut args = vec!["--object", SECRET];
    for c in cmds {
        args.extend(["-c", c]);
    }
    args.extend(["--image-opts", &spec]);
    let out = d.ok("qemu-io", &args);
    assert!(
        !out.contains("failed") && !out.contains("error"),
        "qemu-io {cmds:?} on {image}: {out}"
    );
    out
}

/// `qemu-img create` of an encrypted image with `opts` (secret `sec0`).
fn qemu_create(d: &Dir, image: &str, opts: &str, size: &str) {
    let path = d.s(image);
    d.ok(
        "qemu-img",
        &[
            "create", "-q", "-f", "qcow2", "--object", SECRET, "-o", opts, &path, size,
        ],
    );
}

/// Our `create` of an encrypted image with `opts` (secret `sec0`).
fn our_create(d: &Dir, image: &str, opts: &str, size: &str) {
    let path = d.s(image);
    let out = d.run(
        BIN,
        &[
            "create", "-q", "-f", "qcow2", "--object", SECRET, "-o", opts, &path, size,
        ],
    );
    assert!(out.status.success(), "{}", text(&out));
}

const LUKS: &str = "encrypt.format=luks,encrypt.key-secret=sec0,encrypt.iter-time=10";
const AES: &str = "encryption=on,encrypt.key-secret=sec0";

/// A new directory with the LUKS image `image` (secret `sec0`) made by qemu-img and
/// written by qemu-io with `writes`.
fn qemu_luks(image: &str, size: &str, writes: &[&str]) -> Dir {
    let d = Dir::new();
    qemu_create(&d, image, LUKS, size);
    if !writes.is_empty() {
        qemu_io(&d, image, writes);
    }
    d
}

/// A new directory with the plain qcow2 image `p.qcow2`, written by qemu-io with `writes`.
fn plain(size: &str, writes: &[&str]) -> Dir {
    let d = Dir::new();
    d.create("p.qcow2", "qcow2", "", None, size);
    if !writes.is_empty() {
        d.qemu_io("qcow2", "p.qcow2", writes);
    }
    d
}

#[test]
fn qemu_made_encrypted_images_read_through_ours() {
    for (opts, name) in [(LUKS, "luks"), (AES, "aes")] {
        let d = Dir::new();
        qemu_create(&d, "e.qcow2", opts, "4M");
        qemu_io(
            &d,
            "e.qcow2",
            &["write -P 0x5c 4096 70000", "write -P 0xa1 3M 1000"],
        );
        d.create("p.qcow2", "qcow2", "", None, "4M");
        d.qemu_io(
            "qcow2",
            "p.qcow2",
            &["write -P 0x5c 4096 70000", "write -P 0xa1 3M 1000"],
        );
        let e = spec(&d, "e.qcow2");
        let p = format!("driver=qcow2,file.filename={}", d.s("p.qcow2"));
        let out = d.run(
            BIN,
            &["compare", "--object", SECRET, "--image-opts", &e, &p],
        );
        assert!(out.status.success(), "{name}: {}", text(&out));
        assert!(text(&out).contains("Images are identical."), "{name}");
    }
}

#[test]
fn a_wrong_password_is_refused_with_qemus_words() {
    let d = qemu_luks("e.qcow2", "1M", &[]);
    let e = spec(&d, "e.qcow2");
    let out = d.run(
        BIN,
        &[
            "compare",
            "--object",
            "secret,id=sec0,data=platypus",
            "--image-opts",
            &e,
            &e,
        ],
    );
    assert!(!out.status.success());
    assert!(
        text(&out).contains("Invalid password, cannot unlock any keyslot"),
        "{}",
        text(&out)
    );
    // Without a secret at all, as QEMU says.
    let out = d.run(BIN, &["compare", "--image-opts", &e, &e]);
    assert!(!out.status.success());
    assert!(
        text(&out).contains("Parameter 'encrypt.key-secret' is required for cipher"),
        "{}",
        text(&out)
    );
}

#[test]
fn our_encrypted_images_open_in_qemu_and_check_clean() {
    for (opts, name) in [
        (LUKS, "luks"),
        (AES, "aes"),
        (
            "encrypt.format=luks,encrypt.key-secret=sec0,encrypt.iter-time=10,cluster_size=512",
            "luks 512-byte clusters",
        ),
        (
            "encrypt.format=luks,encrypt.key-secret=sec0,encrypt.iter-time=10,encrypt.cipher-alg=aes-128,encrypt.cipher-mode=cbc,encrypt.hash-alg=sha1",
            "luks aes-128-cbc sha1",
        ),
    ] {
        let d = Dir::new();
        our_create(&d, "e.qcow2", opts, "1M");
        qemu_io(&d, "e.qcow2", &["read -P 0 0 1M"]);
        qemu_io(&d, "e.qcow2", &["write -P 0xaa 0xfe00 0x400"]);
        qemu_io(
            &d,
            "e.qcow2",
            &[
                "read -P 0 0 0xfe00",
                "read -P 0xaa 0xfe00 0x400",
                "read -P 0 0x10200 0xefe00",
            ],
        );
        let e = spec(&d, "e.qcow2");
        let out = d.run(
            "qemu-img",
            &["check", "--object", SECRET, "--image-opts", &e],
        );
        assert!(out.status.success(), "{name}: {}", text(&out));
        // info describes the encryption as qemu-img does.
        let path = d.s("e.qcow2");
        assert_eq!(
            d.ok(BIN, &["info", &path]),
            d.ok("qemu-img", &["info", &path]),
            "{name}"
        );
    }
}

#[test]
fn ours_writes_encrypted_data_qemu_reads() {
    // A commit writes into a QEMU-made LUKS base through a LUKS overlay: both layers are
    // deciphered and the base enciphered with its own key.
    let d = qemu_luks("base.qcow2", "4M", &["write -P 0xa 0 4M"]);
    let base = d.s("base.qcow2");
    let top = d.s("top.qcow2");
    d.ok(
        "qemu-img",
        &[
            "create",
            "-q",
            "-f",
            "qcow2",
            "--object",
            SECRET1,
            "-o",
            "encrypt.format=luks,encrypt.key-secret=sec1,encrypt.iter-time=10",
            "-b",
            &base,
            "-F",
            "qcow2",
            &top,
        ],
    );
    let top_spec = format!(
        "driver=qcow2,file.filename={top},encrypt.key-secret=sec1,backing.driver=qcow2,backing.file.filename={base},backing.encrypt.key-secret=sec0"
    );
    d.ok(
        "qemu-io",
        &[
            "--object",
            SECRET,
            "--object",
            SECRET1,
            "-c",
            "write -P 0x9 1000 70000",
            "--image-opts",
            &top_spec,
        ],
    );
    // Ours takes each layer's key by its place in the chain; the backing node itself is the
    // one the image names (describing it again, `backing.driver=`..., is refused).
    let our_spec = format!(
        "driver=qcow2,file.filename={top},encrypt.key-secret=sec1,backing.encrypt.key-secret=sec0"
    );
    let out = d.run(
        BIN,
        &[
            "commit",
            "--object",
            SECRET,
            "--object",
            SECRET1,
            "--image-opts",
            &our_spec,
        ],
    );
    assert!(out.status.success(), "{}", text(&out));
    qemu_io(
        &d,
        "base.qcow2",
        &[
            "read -P 0xa 0 1000",
            "read -P 0x9 1000 70000",
            "read -P 0xa 71000 4123304",
        ],
    );
    let e = spec(&d, "base.qcow2");
    let out = d.run(
        "qemu-img",
        &["check", "--object", SECRET, "--image-opts", &e],
    );
    assert!(out.status.success(), "{}", text(&out));
}

#[test]
fn convert_into_a_preallocated_encrypted_image_reads_back_the_source() {
    // Preallocated clusters of an encrypted image hold noise to the guest: what the copy
    // skips as zeros must read as zeros all the same.
    let d = plain("2M", &["write -P 0x5c 4096 70000"]);
    let out = d.run(
        BIN,
        &[
            "convert", "--object", SECRET, "-O", "qcow2", "-o",
            "encrypt.format=luks,encrypt.key-secret=sec0,encrypt.iter-time=10,preallocation=metadata",
            &d.s("p.qcow2"), &d.s("c.qcow2"),
        ],
    );
    assert!(out.status.success(), "{}", text(&out));
    qemu_io(
        &d,
        "c.qcow2",
        &[
            "read -P 0 0 4096",
            "read -P 0x5c 4096 70000",
            "read -P 0 74096 2023056",
        ],
    );
}

#[test]
fn compressed_copies_into_encrypted_images_are_refused_as_qemu_img_refuses_them() {
    // Compressed clusters would be stored in plain text.
    let d = plain("1M", &[]);
    let p = d.s("p.qcow2");
    let args = |out: &str| {
        vec![
            "convert".to_string(),
            "--object".into(),
            SECRET.into(),
            "-c".into(),
            "-O".into(),
            "qcow2".into(),
            "-o".into(),
            LUKS.into(),
            p.clone(),
            d.s(out),
        ]
    };
    let ours: Vec<String> = args("o.qcow2");
    let ours: Vec<&str> = ours.iter().map(String::as_str).collect();
    let theirs: Vec<String> = args("q.qcow2");
    let theirs: Vec<&str> = theirs.iter().map(String::as_str).collect();
    let o = d.run(BIN, &ours);
    let q = d.run("qemu-img", &theirs);
    assert_eq!(o.status.code(), q.status.code(), "{}", text(&o));
    let reason = |out: &std::process::Output| {
        let e = String::from_utf8_lossy(&out.stderr).into_owned();
        e.split_once(": ")
            .map(|(_, r)| r.trim().to_string())
            .unwrap_or(e)
    };
    assert_eq!(reason(&o), reason(&q));
    assert!(!d.path("o.qcow2").exists());
}

#[test]
fn raw_luks_volumes_are_created_for_qemu() {
    let d = Dir::new();
    let path = d.s("v.luks");
    let out = d.run(
        BIN,
        &[
            "create",
            "-f",
            "luks",
            "--object",
            SECRET,
            "-o",
            "key-secret=sec0,iter-time=10",
            &path,
            "1M",
        ],
    );
    assert!(out.status.success(), "{}", text(&out));
    let spec = format!("driver=luks,file.filename={path},key-secret=sec0");
    let out = d.ok(
        "qemu-io",
        &[
            "--object",
            SECRET,
            "-c",
            "write -P 0x11 0 64k",
            "-c",
            "read -P 0x11 0 64k",
            "--image-opts",
            &spec,
        ],
    );
    assert!(!out.contains("failed"), "{out}");
}

#[test]
fn amend_adds_and_erases_key_slots_qemu_then_honours() {
    let d = qemu_luks("e.qcow2", "1M", &["write -P 0x42 0 64k"]);
    let path = d.s("e.qcow2");
    let with = |id: &str| format!("driver=qcow2,file.filename={path},encrypt.key-secret={id}");
    let amend = |spec: &str, opts: &str, force: bool| {
        let mut args = vec![
            "amend",
            "--object",
            SECRET,
            "--object",
            SECRET1,
            "--image-opts",
            spec,
        ];
        args.extend(["-o", opts]);
        if force {
            args.push("--force");
        }
        d.run(BIN, &args)
    };
    let opens = |id: &str| {
        let spec = with(id);
        let out = d.run(
            "qemu-io",
            &[
                "--object",
                SECRET,
                "--object",
                SECRET1,
                "-c",
                "read -P 0x42 0 64k",
                "--image-opts",
                &spec,
            ],
        );
        let all = text(&out);
        out.status.success() && !all.contains("can't open") && !all.contains("failed")
    };
    let out = amend(
        &with("sec0"),
        "encrypt.state=active,encrypt.new-secret=sec1,encrypt.iter-time=10,encrypt.keyslot=3",
        false,
    );
    assert!(out.status.success(), "{}", text(&out));
    assert!(opens("sec0") && opens("sec1"));
    // The slot is taken now: QEMU's refusal, unless forced.
    let out = amend(
        &with("sec0"),
        "encrypt.state=active,encrypt.new-secret=sec1,encrypt.iter-time=10,encrypt.keyslot=3",
        false,
    );
    assert!(!out.status.success());
    assert!(
        text(&out).contains("Refusing to overwrite active keyslot 3 - please erase it first"),
        "{}",
        text(&out)
    );
    let out = amend(
        &with("sec1"),
        "encrypt.state=inactive,encrypt.old-secret=sec0",
        false,
    );
    assert!(out.status.success(), "{}", text(&out));
    assert!(!opens("sec0") && opens("sec1"));
    // The last key is only erased by force.
    let out = amend(
        &with("sec1"),
        "encrypt.state=inactive,encrypt.keyslot=3",
        false,
    );
    assert!(!out.status.success());
    assert!(
        text(&out).contains("Attempt to erase the only active keyslot 3"),
        "{}",
        text(&out)
    );
    assert!(opens("sec1"));
}

#[test]
fn measure_counts_the_luks_header_as_qemu_img_does() {
    let d = plain("4M", &["write -P 1 0 1M"]);
    let p = d.s("p.qcow2");
    for opts in [
        "encrypt.format=luks,encrypt.key-secret=sec0",
        "encrypt.format=luks,encrypt.key-secret=sec0,encrypt.cipher-alg=aes-128,cluster_size=512",
        "encryption=on,encrypt.key-secret=sec0",
    ] {
        for source in [vec!["--size", "16M"], vec![p.as_str()]] {
            let mut args = vec!["measure", "-O", "qcow2", "--object", SECRET, "-o", opts];
            args.extend(&source);
            assert_eq!(
                d.ok(BIN, &args),
                d.ok("qemu-img", &args),
                "{opts} {source:?}"
            );
        }
    }
}

#[test]
fn json_names_give_their_layers_keys_as_option_strings_do() {
    // A LUKS base under a LUKS overlay, each with its own secret; QEMU writes a pattern
    // through the chain, and ours must read it given the keys in a `json:` name, flat
    // (`"encrypt.key-secret"`) or nested (`{"encrypt": {"key-secret": ...}}`), the backing
    // layer's under `"backing"`.
    let d = Dir::new();
    qemu_create(&d, "base.qcow2", LUKS, "1M");
    qemu_io(&d, "base.qcow2", &["write -P 0x3c 0 64k"]);
    let (base, top) = (d.s("base.qcow2"), d.s("top.qcow2"));
    let s1 = "secret,id=sec1,data=furby";
    d.ok(
        "qemu-img",
        &[
            "create",
            "-q",
            "-f",
            "qcow2",
            "--object",
            s1,
            "-o",
            "encrypt.format=luks,encrypt.key-secret=sec1,encrypt.iter-time=10",
            "-b",
            &base,
            "-F",
            "qcow2",
            &top,
        ],
    );
    d.create("p.qcow2", "qcow2", "", None, "1M");
    d.qemu_io("qcow2", "p.qcow2", &["write -P 0x3c 0 64k"]);
    let plain = d.s("p.qcow2");
    let file = |path: &str| format!(r#""file":{{"driver":"file","filename":"{path}"}}"#);
    for (what, top_key, base_key) in [
        (
            "flat",
            r#""encrypt.key-secret":"sec1""#,
            r#""backing.encrypt.key-secret":"sec0""#,
        ),
        (
            "nested",
            r#""encrypt":{"key-secret":"sec1"}"#,
            r#""backing":{"encrypt":{"key-secret":"sec0"}}"#,
        ),
    ] {
        let name = format!(
            r#"json:{{"driver":"qcow2",{},{top_key},{base_key}}}"#,
            file(&top)
        );
        let out = d.run(
            BIN,
            &["compare", "--object", SECRET, "--object", s1, &name, &plain],
        );
        assert!(out.status.success(), "{what}: {}", text(&out));
        assert!(text(&out).contains("Images are identical."), "{what}");
    }
    // The single-layer image given to the server: a client reads the guest data back.
    let name = format!(
        r#"json:{{"driver":"qcow2",{},"encrypt.key-secret":"sec0"}}"#,
        file(&base)
    );
    let sock = d.s("s.sock");
    let mut server = std::process::Command::new(BIN)
        .args(["serve", "--object", SECRET, "-k", &sock, &name])
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let uri = format!("nbd+unix:///?socket={sock}");
    let mut read = None;
    for _ in 0..100 {
        if std::path::Path::new(&sock).exists() {
            read = Some(d.run("qemu-io", &["-f", "raw", "-c", "read -P 0x3c 0 64k", &uri]));
            break;
        }
        if let Ok(Some(_)) = server.try_wait() {
            break;
        }
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
    let _ = server.kill();
    let out = server.wait_with_output().unwrap();
    let read = read.unwrap_or_else(|| panic!("the server did not start: {}", text(&out)));
    assert!(text(&read).contains("read 65536/65536"), "{}", text(&read));
}

/// A LUKS image whose header extension locating the encryption header is gone: QEMU refuses
/// every open of it, `info` and `check` too (which read no data), and so do we, in its words
/// and naming the image as it was given.
#[test]
fn a_luks_image_without_its_crypto_header_extension_is_refused() {
    let d = qemu_luks("e.qcow2", "4M", &[]);
    // Renaming the extension (an unknown magic is skipped) removes it for every reader.
    let mut bytes = std::fs::read(d.path("e.qcow2")).unwrap();
    let magic = 0x0537_be77u32.to_be_bytes();
    let at = bytes[..65536]
        .windows(4)
        .position(|w| w == magic)
        .expect("the crypto header extension");
    bytes[at..at + 4].copy_from_slice(&0x7e57_0001u32.to_be_bytes());
    std::fs::write(d.path("e.qcow2"), &bytes).unwrap();
    let opts = spec(&d, "e.qcow2");
    for args in [
        &["info", &d.s("e.qcow2")][..],
        &["check", &d.s("e.qcow2")],
        &["check", "--object", SECRET, "--image-opts", &opts],
    ] {
        let (q, o) = (d.run("qemu-img", args), d.run(BIN, args));
        assert_eq!(o.status.code(), q.status.code(), "{args:?}: {}", text(&o));
        let (qe, oe) = (
            String::from_utf8_lossy(&q.stderr).replace("qemu-img: ", ""),
            String::from_utf8_lossy(&o.stderr).replace("qcow2-nbd: ", ""),
        );
        assert_eq!(oe, qe, "{args:?}: ours (left) and qemu-img (right)");
        assert!(
            qe.contains("Missing CRYPTO header for crypt method 2"),
            "{qe}"
        );
    }
}
