//! The external programs the tests use as oracles, found or explained, and the checks made
//! with them.

use std::ffi::OsStr;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};

/// Path of an external tool, or a panic naming the Debian package that provides it.
pub fn require(tool: &str, package: &str) -> PathBuf {
    let path = std::env::var_os("PATH").unwrap_or_default();
    // nbd-client lives in sbin, which a user's PATH may lack.
    for dir in
        std::env::split_paths(&path).chain([PathBuf::from("/usr/sbin"), PathBuf::from("/sbin")])
    {
        let candidate = dir.join(tool);
        if candidate.is_file() {
            return candidate;
        }
    }
    panic!(
        "`{tool}` is required by this test but not installed: \
         install the Debian package `{package}` (apt-get install {package})"
    );
}

/// A Python interpreter that can `import nbd` (libnbd's bindings, which nbdsh uses). A
/// pyenv or virtualenv `python3` first on PATH usually cannot, Debian's can.
pub fn python_with_libnbd() -> PathBuf {
    for python in ["python3", "/usr/bin/python3"] {
        let ok = Command::new(python)
            .args(["-c", "import nbd"])
            .output()
            .is_ok_and(|o| o.status.success());
        if ok {
            return PathBuf::from(python);
        }
    }
    panic!(
        "no python3 can `import nbd`: install the Debian package `python3-libnbd` \
         (it provides nbdsh's bindings)"
    );
}

/// A command for one of QEMU's tools (`qemu-img`, `qemu-io`, `qemu-nbd`).
pub fn qemu(tool: &str) -> Command {
    Command::new(require(tool, "qemu-utils"))
}

/// Runs a command, panicking with its output if it cannot start or fails.
pub fn run_ok(cmd: &mut Command) -> Output {
    let out = cmd
        .output()
        .unwrap_or_else(|e| panic!("cannot run {cmd:?}: {e}"));
    assert!(
        out.status.success(),
        "{cmd:?} failed with {}\n--- stdout\n{}\n--- stderr\n{}",
        out.status,
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    out
}

/// Stdout as text.
pub fn stdout(out: &Output) -> String {
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// Stdout and then stderr, as text.
pub fn text(out: &Output) -> String {
    String::from_utf8_lossy(&out.stdout).into_owned() + &String::from_utf8_lossy(&out.stderr)
}

/// `qemu-img ARGS`, which must succeed: its stdout.
pub fn qemu_img(args: &[&str]) -> String {
    stdout(&run_ok(qemu("qemu-img").args(args)))
}

/// `qemu-io -f FMT -c CMD... TARGET` (a file, or an NBD URI with `raw`): fails the test on
/// any error or pattern mismatch qemu-io reports, which it does on stdout with exit 0.
pub fn qemu_io(fmt: &str, target: &(impl AsRef<OsStr> + ?Sized), cmds: &[&str]) -> String {
    qemu_io_with(qemu("qemu-io"), &["-f", fmt], target.as_ref(), cmds)
}

/// [`qemu_io`] opening `target` read-only (a read-only export refuses read-write opens).
pub fn qemu_io_read_only(
    fmt: &str,
    target: &(impl AsRef<OsStr> + ?Sized),
    cmds: &[&str],
) -> String {
    qemu_io_with(qemu("qemu-io"), &["-r", "-f", fmt], target.as_ref(), cmds)
}

/// [`qemu_io`] opening `target` with O_DIRECT (`-n`, QEMU's `cache=none`).
pub fn qemu_io_direct(fmt: &str, target: &(impl AsRef<OsStr> + ?Sized), cmds: &[&str]) -> String {
    qemu_io_with(qemu("qemu-io"), &["-n", "-f", fmt], target.as_ref(), cmds)
}

/// Runs `qemu-io OPTS -c CMD... TARGET` as `cmd` (which may have a working directory set).
pub(crate) fn qemu_io_with(
    mut cmd: Command,
    opts: &[&str],
    target: &OsStr,
    cmds: &[&str],
) -> String {
    cmd.args(opts);
    for c in cmds {
        cmd.args(["-c", c]);
    }
    cmd.arg(target);
    let out = stdout(&run_ok(&mut cmd));
    assert_qemu_io_ok(&out, target, &cmds);
    out
}

/// Fails the test if qemu-io's output reports an error or a failed pattern check.
pub(crate) fn assert_qemu_io_ok(out: &str, target: &OsStr, what: &dyn std::fmt::Debug) {
    let lower = out.to_lowercase();
    assert!(
        !lower.contains("error") && !lower.contains("fail"),
        "qemu-io {what:?} on {}: {}",
        target.to_string_lossy(),
        out.chars().take(4000).collect::<String>()
    );
}

/// `qemu-img create -q -f FMT [-o OPTS] [-b BACKING -F BFMT] PATH [SIZE]` (an empty `opts` or
/// `size` is left out).
pub fn create_image(
    path: &Path,
    fmt: &str,
    opts: &str,
    backing: Option<(&Path, &str)>,
    size: &str,
) {
    create_image_with(qemu("qemu-img"), path, fmt, opts, backing, size);
}

/// [`create_image`] run as `cmd` (which may have a working directory set).
pub(crate) fn create_image_with(
    mut cmd: Command,
    path: &Path,
    fmt: &str,
    opts: &str,
    backing: Option<(&Path, &str)>,
    size: &str,
) {
    cmd.args(["create", "-q", "-f", fmt]);
    if !opts.is_empty() {
        cmd.args(["-o", opts]);
    }
    if let Some((file, bfmt)) = backing {
        cmd.arg("-b").arg(file).args(["-F", bfmt]);
    }
    cmd.arg(path);
    if !size.is_empty() {
        cmd.arg(size);
    }
    run_ok(&mut cmd);
}

/// `qemu-img check` succeeds and finds no corruption, no leak and no check error.
pub fn assert_check_clean(image: &Path) {
    let json = stdout(&run_ok(
        qemu("qemu-img").args(["check", "--output=json"]).arg(image),
    ));
    let v: serde_json::Value = serde_json::from_str(&json)
        .unwrap_or_else(|e| panic!("qemu-img check JSON of {}: {e}\n{json}", image.display()));
    for key in ["corruptions", "leaks", "check-errors"] {
        assert!(
            v[key].as_u64().unwrap_or(0) == 0,
            "qemu-img check of {}: {key} in {json}",
            image.display()
        );
    }
}

/// `qemu-img compare` finds `a` (of format `a_fmt`) and `b` (of `b_fmt`) identical.
pub fn assert_same_contents(a: &Path, a_fmt: &str, b: &Path, b_fmt: &str) {
    let out = qemu("qemu-img")
        .args(["compare", "-f", a_fmt, "-F", b_fmt])
        .arg(a)
        .arg(b)
        .output()
        .unwrap_or_else(|e| panic!("cannot run qemu-img compare: {e}"));
    assert!(
        out.status.success(),
        "qemu-img compare {} {}: {}",
        a.display(),
        b.display(),
        text(&out)
    );
}

/// The guest-visible bytes of `image` according to QEMU: `qemu-img convert ARGS -O raw`
/// (`args` such as `-f qcow2` or `-l SNAPSHOT`).
pub fn qemu_contents(image: &Path, args: &[&str]) -> Vec<u8> {
    let dir = tempfile::tempdir().expect("create a temporary directory");
    let out = dir.path().join("contents.raw");
    run_ok(
        qemu("qemu-img")
            .arg("convert")
            .args(args)
            .args(["-O", "raw"])
            .arg(image)
            .arg(&out),
    );
    std::fs::read(&out).unwrap_or_else(|e| panic!("read {}: {e}", out.display()))
}

/// Asserts two byte strings (disks, files) are equal, naming the first difference.
pub fn assert_same_bytes(ours: &[u8], theirs: &[u8], what: &str) {
    assert_eq!(ours.len(), theirs.len(), "{what}: lengths differ");
    if let Some(i) = ours.iter().zip(theirs).position(|(a, b)| a != b) {
        panic!(
            "{what}: first difference at byte {i:#x}: ours {:#04x}, theirs {:#04x}",
            ours[i], theirs[i]
        );
    }
}

/// `nbdinfo ARGS`, which must succeed: its stdout.
pub fn nbdinfo(args: &[&str]) -> String {
    stdout(&run_ok(
        Command::new(require("nbdinfo", "libnbd-bin")).args(args),
    ))
}

/// The extents of `nbdinfo --map=CONTEXT ...` output: `(offset, length, value)` in order.
pub fn parse_nbdinfo_map(map: &str) -> Vec<(u64, u64, u32)> {
    map.lines()
        .filter_map(|l| {
            let mut f = l.split_whitespace();
            let (o, n, v) = (f.next()?, f.next()?, f.next()?);
            Some((o.parse().ok()?, n.parse().ok()?, v.parse().ok()?))
        })
        .collect()
}

/// The dirty ranges of persistent bitmap `bitmap` of `image`, as QEMU sees them: qemu-nbd
/// exports it read-only with `-B` and nbdinfo maps its `qemu:dirty-bitmap:` context.
pub fn qemu_dirty_ranges(image: &Path, bitmap: &str) -> Vec<(u64, u64)> {
    let context = format!("--map=qemu:dirty-bitmap:{bitmap}");
    let qemu_nbd = require("qemu-nbd", "qemu-utils");
    let image = image.to_str().expect("UTF-8 path");
    let map = nbdinfo(&[
        &context,
        "--",
        "[",
        qemu_nbd.to_str().expect("UTF-8 path"),
        "-r",
        "-B",
        bitmap,
        "-f",
        "qcow2",
        image,
        "]",
    ]);
    parse_nbdinfo_map(&map)
        .into_iter()
        .filter(|e| e.2 & 1 != 0)
        .map(|(o, n, _)| (o, n))
        .collect()
}

/// A persistent bitmap as `qemu-img info --output=json` lists it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct QemuBitmap {
    /// Its name.
    pub name: String,
    /// `in-use`, `auto`, as qemu-img lists them.
    pub flags: Vec<String>,
    /// Bytes of disk per bit.
    pub granularity: u64,
}

/// The persistent bitmaps of a qcow2 image, in directory order, as `qemu-img info -U` lists
/// them (none when the image has no bitmaps extension).
pub fn qemu_bitmaps(image: &Path) -> Vec<QemuBitmap> {
    let out = qemu_img(&[
        "info",
        "-U",
        "--output=json",
        image.to_str().expect("UTF-8 path"),
    ]);
    let info: serde_json::Value =
        serde_json::from_str(&out).unwrap_or_else(|e| panic!("qemu-img info JSON: {e}\n{out}"));
    let Some(list) = info["format-specific"]["data"]["bitmaps"].as_array() else {
        return Vec::new();
    };
    list.iter()
        .map(|b| QemuBitmap {
            name: b["name"].as_str().expect("a name").to_string(),
            flags: b["flags"]
                .as_array()
                .expect("flags")
                .iter()
                .map(|f| f.as_str().expect("a flag").to_string())
                .collect(),
            granularity: b["granularity"].as_u64().expect("a granularity"),
        })
        .collect()
}

/// The NBD URI of export `export` on the Unix socket `socket`, as QEMU's tools and libnbd
/// take it.
pub fn nbd_unix_uri(socket: &std::path::Path, export: &str) -> String {
    format!("nbd+unix:///{export}?socket={}", socket.display())
}

/// The NBD URI of export `export` on TCP port `port` of the loopback address.
pub fn nbd_tcp_uri(port: u16, export: &str) -> String {
    format!("nbd://127.0.0.1:{port}/{export}")
}
