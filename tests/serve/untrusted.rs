//! `--untrusted --allow-dir DIR`: a corpus of hostile images, one per kind of reference and
//! per way out of the allowed directory, each refused at open by `serve` (positional,
//! `--export untrusted=on`, `block-export-add untrusted=true`), `info` and the image tools,
//! with a message naming the reference; a secret marker in the outside file never appears
//! in anything they return. The same images served without `--untrusted` do show it (QEMU's
//! behaviour, the default), so each refusal is the option's doing.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use crate::support::{serve_fails, Server, BIN};
use test_support::{qemu_io_read_only, text, Dir};

/// What the outside file holds: a line of a host file an image's author wants.
const SECRET: &str = "root:x:SECRET-MARKER-5f3a";

/// A directory tree: `allowed/` (given as `--allow-dir`) and `outside/secret.raw`.
struct Tree {
    dir: Dir,
}

impl Tree {
    fn new() -> Tree {
        let dir = Dir::new();
        std::fs::create_dir_all(dir.path("allowed")).unwrap();
        std::fs::create_dir_all(dir.path("outside")).unwrap();
        let mut secret = SECRET.as_bytes().to_vec();
        secret.resize(1 << 20, b'\n');
        std::fs::write(dir.path("outside/secret.raw"), &secret).unwrap();
        Tree { dir }
    }

    fn allowed(&self) -> String {
        self.dir.s("allowed")
    }

    fn p(&self, name: &str) -> PathBuf {
        self.dir.path(name)
    }

    fn s(&self, name: &str) -> String {
        self.dir.s(name)
    }

    /// `allowed/NAME`, a 1 MiB qcow2 image whose backing file name is `backing` (stored as
    /// given, nothing checked), `fmt` recorded when given.
    fn with_backing(&self, name: &str, backing: &str, fmt: Option<&str>) -> String {
        let path = self.s(&format!("allowed/{name}"));
        let mut args = vec!["create", "-q", "-f", "qcow2", "-u", "-b", backing];
        if let Some(f) = fmt {
            args.extend(["-F", f]);
        }
        args.extend([path.as_str(), "1M"]);
        self.dir.qemu_img(&args);
        path
    }
}

/// The hostile corpus: (image, what the refusal must name).
fn corpus(t: &Tree) -> Vec<(String, &'static str)> {
    let secret = t.s("outside/secret.raw");
    // A symlink inside the allowed directory that leads out of it.
    std::os::unix::fs::symlink(&secret, t.p("allowed/link.raw")).unwrap();
    // A chain whose first step is inside and whose second leads out.
    t.with_backing("mid.qcow2", &secret, Some("raw"));
    let json_file =
        format!(r#"json:{{"driver":"raw","file":{{"driver":"file","filename":"{secret}"}}}}"#);
    // Never opened: a FIFO would hold a reader until a writer came.
    let fifo = t.s("outside/config.fifo");
    let c = std::ffi::CString::new(fifo.clone()).unwrap();
    // SAFETY: mkfifo reads a NUL-terminated path.
    assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o600) }, 0);
    let blkdebug = format!(
        r#"json:{{"driver":"raw","file":{{"driver":"blkdebug","config":"{fifo}","image":{{"driver":"file","filename":"{}"}}}}}}"#,
        t.s("allowed/mid.qcow2")
    );
    let null = r#"json:{"driver":"raw","file":{"driver":"file","filename":"null-co://"}}"#;
    let mut images = vec![
        (
            t.with_backing("plain.qcow2", &secret, Some("raw")),
            "it resolves to",
        ),
        (
            t.with_backing("dotdot.qcow2", "../outside/secret.raw", Some("raw")),
            "it resolves to",
        ),
        (
            t.with_backing("symlink.qcow2", "link.raw", Some("raw")),
            "it resolves to",
        ),
        (
            t.with_backing("json.qcow2", &json_file, Some("raw")),
            "it resolves to",
        ),
        (
            t.with_backing("chain.qcow2", "mid.qcow2", Some("qcow2")),
            "mid.qcow2",
        ),
        (
            t.with_backing("blkdebug.qcow2", &blkdebug, Some("raw")),
            "a blkdebug fault-injection node is not a local file",
        ),
        (
            t.with_backing("null.qcow2", null, Some("raw")),
            "a null-co device is not a local file",
        ),
    ];
    // An external data file, made inside and then pointed at the outside file.
    let data = t.s("allowed/data.qcow2");
    let inside = t.s("allowed/data.raw");
    t.dir.qemu_img(&[
        "create",
        "-q",
        "-f",
        "qcow2",
        "-o",
        &format!("data_file={inside},data_file_raw=on"),
        &data,
        "1M",
    ]);
    t.dir.qemu_img(&[
        "amend",
        "-f",
        "qcow2",
        "-o",
        &format!("data_file={secret}"),
        &data,
    ]);
    images.push((data, "external data file"));
    images
}

fn run(args: &[&str]) -> Output {
    Command::new(BIN).args(args).output().unwrap()
}

/// Neither the marker nor qemu-io's dump of it (punctuation shown as dots).
fn assert_no_secret(what: &str, out: &str) {
    assert!(
        !out.contains(SECRET) && !out.contains("SECRET.MA"),
        "{what} returned the secret:\n{out}"
    );
}

/// The refusal `serve` prints names the image, the reference and the rule.
fn assert_refusal(what: &str, err: &str, image: &str, names: &str) {
    assert_no_secret(what, err);
    let file = Path::new(image).file_name().unwrap().to_str().unwrap();
    assert!(
        err.contains("refusing the") && err.contains(names),
        "{what}: the refusal does not name {names:?}:\n{err}"
    );
    if names != "mid.qcow2" {
        assert!(
            err.contains(file),
            "{what}: the refusal does not name {file}:\n{err}"
        );
    }
}

#[test]
fn every_hostile_image_is_refused_by_serve_and_no_byte_of_the_secret_is_served() {
    let t = Tree::new();
    let allowed = t.allowed();
    for (image, names) in corpus(&t) {
        let err = serve_fails(&["--untrusted", "--allow-dir", &allowed, "-r", &image]);
        assert_refusal(&format!("serve {image}"), &err, &image, names);
        // The same refusal for one export among several, named with untrusted=on.
        let benign = t.s("allowed/benign.qcow2");
        if !Path::new(&benign).exists() {
            t.dir
                .qemu_img(&["create", "-q", "-f", "qcow2", &benign, "1M"]);
        }
        let err = serve_fails(&[
            "--allow-dir",
            &allowed,
            "--export",
            &format!("name=ok,file={benign},readonly=on"),
            "--export",
            &format!("name=bad,file={image},readonly=on,untrusted=on"),
        ]);
        assert_refusal(&format!("--export {image}"), &err, &image, names);
    }
}

#[test]
fn without_untrusted_the_same_images_serve_the_secret_as_qemu_does() {
    // The control: the corpus really reaches the secret, so the refusals above are the
    // option's doing. Only the plain kinds (QEMU follows them the same way).
    let t = Tree::new();
    let images = corpus(&t);
    for (image, _) in images.iter().take(4) {
        let server = Server::unix(&["-r", "-t", image]);
        let out = qemu_io_read_only("raw", &server.uri(), &["read -v 0 32"]);
        assert!(out.contains("SECRET.MA"), "{image}: {out}");
        drop(server);
    }
}

#[test]
fn a_backing_file_inside_the_allowed_directory_serves_normally() {
    let t = Tree::new();
    let base = t.s("allowed/sub/base.raw");
    std::fs::create_dir_all(t.p("allowed/sub")).unwrap();
    let mut data = b"INSIDE-DATA".to_vec();
    data.resize(1 << 20, 0);
    std::fs::write(&base, &data).unwrap();
    // By a relative name through `..` that stays inside, and through a symlink inside.
    std::os::unix::fs::symlink(&base, t.p("allowed/inner-link.raw")).unwrap();
    std::fs::create_dir_all(t.p("allowed/top")).unwrap();
    for (name, backing) in [
        ("top/rel.qcow2", "../sub/base.raw"),
        ("top/link.qcow2", "../inner-link.raw"),
    ] {
        let image = t.with_backing(name, backing, Some("raw"));
        let server = Server::unix(&[
            "--untrusted",
            "--allow-dir",
            &t.allowed(),
            "-r",
            "-t",
            &image,
        ]);
        let out = qemu_io_read_only("raw", &server.uri(), &["read -v 0 16"]);
        assert!(out.contains("INSIDE.DATA"), "{name}: {out}");
        drop(server);
        let out = run(&["info", "--untrusted", "--allow-dir", &t.allowed(), &image]);
        assert!(out.status.success(), "info {name}: {}", text(&out));
    }
}

#[test]
fn a_plain_image_serves_under_untrusted_without_any_allowed_directory() {
    let t = Tree::new();
    let image = t.s("outside/plain.qcow2");
    t.dir
        .qemu_img(&["create", "-q", "-f", "qcow2", &image, "1M"]);
    let server = Server::unix(&["--untrusted", "-r", "-t", &image]);
    qemu_io_read_only("raw", &server.uri(), &["read -P 0 0 64k"]);
}

#[test]
fn info_refuses_the_same_images_and_reports_why_in_json() {
    let t = Tree::new();
    let allowed = t.allowed();
    for (image, names) in corpus(&t) {
        let out = run(&["info", "--untrusted", "--allow-dir", &allowed, &image]);
        assert_eq!(out.status.code(), Some(1), "info {image}: {}", text(&out));
        let all = text(&out);
        assert_no_secret("info", &all);
        if names != "mid.qcow2" {
            assert_refusal("info", &all, &image, names);
        }
        let out = run(&[
            "info",
            "--untrusted",
            "--allow-dir",
            &allowed,
            "--backing-chain",
            "--output=json",
            &image,
        ]);
        assert_eq!(out.status.code(), Some(1), "info {image}: {}", text(&out));
        assert_no_secret("info --output=json", &text(&out));
        let json: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
        let refs: Vec<&serde_json::Value> = json
            .as_array()
            .unwrap()
            .iter()
            .flat_map(|i| i["untrusted-references"].as_array().unwrap())
            .collect();
        assert!(
            refs.iter().any(|r| r["refused"].is_string()),
            "{image}: {json}"
        );
        // Without --untrusted the default output has no key QEMU lacks.
        let out = run(&["info", "--output=json", &image]);
        let plain = String::from_utf8_lossy(&out.stdout).into_owned();
        assert!(!plain.contains("untrusted-references"), "{plain}");
    }
}

#[test]
fn the_image_tools_refuse_them_too() {
    let t = Tree::new();
    let allowed = t.allowed();
    let target = t.s("allowed/copy.raw");
    for (image, names) in corpus(&t) {
        for args in [
            vec!["map", "--output=json", image.as_str()],
            vec!["convert", "-O", "raw", image.as_str(), target.as_str()],
            vec!["compare", image.as_str(), image.as_str()],
            vec!["measure", "-O", "qcow2", image.as_str()],
        ] {
            let mut full = args.clone();
            full.extend(["--untrusted", "--allow-dir", &allowed]);
            let out = run(&full);
            // compare reports errors with 2, as qemu-img compare does.
            assert!(
                matches!(out.status.code(), Some(1 | 2)),
                "{full:?}: {}",
                text(&out)
            );
            assert_refusal(&format!("{args:?}"), &text(&out), &image, names);
        }
        assert!(
            !Path::new(&target).exists()
                || !String::from_utf8_lossy(&std::fs::read(&target).unwrap()).contains(SECRET),
            "convert copied the secret"
        );
    }
}

#[test]
fn block_export_add_with_untrusted_refuses_and_adds_nothing() {
    let t = Tree::new();
    let images = corpus(&t);
    let ctl = t.s("ctl.sock");
    let benign = t.s("allowed/benign.qcow2");
    t.dir
        .qemu_img(&["create", "-q", "-f", "qcow2", &benign, "1M"]);
    let server = Server::unix(&[
        "--threads",
        "1",
        "-t",
        "--allow-dir",
        &t.allowed(),
        "--control",
        &ctl,
        "--export",
        &format!("name=ok,file={benign},readonly=on"),
    ]);
    for (i, (image, names)) in images.iter().enumerate() {
        let out = Command::new(BIN)
            .args(["ctl", "--socket", &ctl, "--timeout", "60"])
            .args([
                "block-export-add",
                &format!("id=e{i}"),
                &format!("file={image}"),
                "untrusted=true",
            ])
            .output()
            .unwrap();
        assert_eq!(out.status.code(), Some(1), "{image}: {}", text(&out));
        assert_refusal("block-export-add", &text(&out), image, names);
    }
    let out = Command::new(BIN)
        .args(["ctl", "--socket", &ctl, "query-block-exports"])
        .output()
        .unwrap();
    let listed: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let ids: Vec<&str> = listed
        .as_array()
        .unwrap()
        .iter()
        .map(|e| e["id"].as_str().unwrap())
        .collect();
    assert_eq!(ids.len(), 1, "only the benign export: {listed}");
    drop(server);
}

/// Writes `value` big-endian at `offset` of `path`.
fn patch_u32(path: &str, offset: u64, value: u32) {
    use std::os::unix::fs::FileExt;
    let f = std::fs::OpenOptions::new().write(true).open(path).unwrap();
    f.write_all_at(&value.to_be_bytes(), offset).unwrap();
}

/// Reads the big-endian u64 at `offset` of `path`.
fn read_u64(path: &str, offset: u64) -> u64 {
    use std::os::unix::fs::FileExt;
    let mut b = [0u8; 8];
    std::fs::File::open(path)
        .unwrap()
        .read_exact_at(&mut b, offset)
        .unwrap();
    u64::from_be_bytes(b)
}

/// Grows `path` by `bytes` of zeros, so that a table declared larger still lies inside it.
fn pad(path: &str, bytes: u64) {
    let f = std::fs::OpenOptions::new().write(true).open(path).unwrap();
    let len = f.metadata().unwrap().len();
    f.set_len(len + bytes).unwrap();
}

/// `serve`, `info` and `check` under `--untrusted` (and `extra`) all refuse `image`, naming
/// the cap; `tools` says which of info and check can judge it (a table that does not load
/// is refused by its own fault first).
fn refused_by_cap(image: &str, extra: &[&str], needle: &str, tools: &[&str]) {
    let mut args = vec!["--untrusted"];
    args.extend(extra);
    let mut serve = args.clone();
    serve.extend(["-r", image]);
    let err = serve_fails(&serve);
    assert!(err.contains(needle), "serve {image}: {err}");
    for tool in tools {
        let mut full = vec![*tool];
        full.extend(&args);
        full.push(image);
        let out = run(&full);
        assert_eq!(out.status.code(), Some(1), "{full:?}: {}", text(&out));
        assert!(text(&out).contains(needle), "{full:?}: {}", text(&out));
    }
}

#[test]
fn each_cap_refuses_an_image_that_declares_more_than_it() {
    let t = Tree::new();
    let img = |name: &str| {
        let p = t.s(name);
        t.dir.qemu_img(&["create", "-q", "-f", "qcow2", &p, "1M"]);
        p
    };
    // An L1 table of 65536 entries for a 1 MiB disk (one entry needed).
    let l1 = img("l1.qcow2");
    patch_u32(&l1, 36, 65536);
    pad(&l1, 1 << 20);
    assert!(run(&["info", &l1]).status.success(), "the default opens it");
    refused_by_cap(
        &l1,
        &[],
        "an L1 table (l1_size) of 65536",
        &["info", "check"],
    );

    // A refcount table of 64 clusters for a file of a few clusters.
    let rt = img("reftable.qcow2");
    patch_u32(&rt, 56, 64);
    pad(&rt, 5 << 20);
    refused_by_cap(&rt, &[], "a refcount table", &["check"]);

    // More internal snapshots than --untrusted-max-snapshots.
    let snaps = img("snaps.qcow2");
    for s in ["s1", "s2", "s3"] {
        t.dir.qemu_img(&["snapshot", "-c", s, &snaps]);
    }
    let cap = ["--untrusted-max-snapshots", "2"];
    refused_by_cap(
        &snaps,
        &cap,
        "internal snapshots (nb_snapshots) of 3",
        &["info", "check"],
    );
    let ok = run(&[
        "info",
        "--untrusted",
        "--untrusted-max-snapshots",
        "3",
        &snaps,
    ]);
    assert!(ok.status.success(), "{}", text(&ok));

    // A snapshot whose L1 table is far larger than its disk needs.
    let snap_l1 = img("snap-l1.qcow2");
    t.dir.qemu_img(&["snapshot", "-c", "s1", &snap_l1]);
    let table = read_u64(&snap_l1, 64);
    patch_u32(&snap_l1, table + 8, 65536);
    pad(&snap_l1, 1 << 20);
    refused_by_cap(
        &snap_l1,
        &[],
        "a snapshot's L1 table (l1_size) of 65536",
        &["info", "check"],
    );

    // More bitmaps than --untrusted-max-bitmaps.
    let bitmaps = img("bitmaps.qcow2");
    for b in ["b1", "b2", "b3"] {
        t.dir.qemu_img(&["bitmap", "--add", &bitmaps, b]);
    }
    let cap = ["--untrusted-max-bitmaps", "2"];
    refused_by_cap(
        &bitmaps,
        &cap,
        "persistent bitmaps of 3",
        &["info", "check"],
    );

    // A LUKS header whose key slots cost more PBKDF2 iterations than allowed.
    let luks = t.s("luks.qcow2");
    t.dir.qemu_img(&[
        "create",
        "-q",
        "-f",
        "qcow2",
        "--object",
        "secret,id=sec0,data=pw",
        "-o",
        "encrypt.format=luks,encrypt.key-secret=sec0,encrypt.iter-time=10",
        &luks,
        "1M",
    ]);
    let cap = ["--untrusted-max-kdf-iterations", "1000"];
    refused_by_cap(&luks, &cap, "LUKS PBKDF2 iterations", &["info"]);
    assert!(run(&["info", "--untrusted", &luks]).status.success());
}
