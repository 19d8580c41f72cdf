//! Helpers shared by the `cli_*` tests: our binary and QEMU's tools side by side, map
//! comparison, and a deterministic random source.
//!
//! The tests need qemu-img and qemu-io (Debian: qemu-utils); a missing tool fails the test
//! with a message saying so.
#![allow(dead_code)] // each test binary uses a different subset

use std::io::Write;
use std::os::unix::fs::MetadataExt;
use std::path::PathBuf;
use std::process::{Command, Output, Stdio};

use serde_json::Value;

/// A temporary directory that commands run in, so relative backing names stay short.
pub struct Dir {
    pub dir: tempfile::TempDir,
}

impl Dir {
    /// A new temporary directory (under $TMPDIR).
    pub fn new() -> Dir {
        Dir {
            dir: tempfile::tempdir().expect("create a temporary directory"),
        }
    }

    /// `name` inside the directory.
    pub fn path(&self, name: &str) -> PathBuf {
        self.dir.path().join(name)
    }

    /// Runs `program args` in the directory.
    pub fn run(&self, program: &str, args: &[&str]) -> Output {
        Command::new(program)
            .args(args)
            .current_dir(self.dir.path())
            .stdin(Stdio::null())
            .output()
            .unwrap_or_else(|e| {
                panic!(
                    "cannot run {program} ({e}); install qemu-utils to run the CLI interop tests"
                )
            })
    }

    /// Runs `program args`, failing the test with its output unless it succeeds; returns
    /// stdout.
    pub fn ok(&self, program: &str, args: &[&str]) -> String {
        let out = self.run(program, args);
        assert!(
            out.status.success(),
            "{program} {args:?} failed ({}):\n{}{}",
            out.status,
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8_lossy(&out.stdout).into_owned()
    }

    /// Runs our binary.
    pub fn ours(&self, args: &[&str]) -> Output {
        self.run(env!("CARGO_BIN_EXE_qcow2-nbd"), args)
    }

    /// Runs our binary, which must succeed; returns stdout.
    pub fn ours_ok(&self, args: &[&str]) -> String {
        self.ok(env!("CARGO_BIN_EXE_qcow2-nbd"), args)
    }

    /// `qemu-img args`, which must succeed.
    pub fn qemu_img(&self, args: &[&str]) -> String {
        self.ok("qemu-img", args)
    }

    /// `qemu-io -f fmt -c cmd ... image`; every command must succeed.
    pub fn qemu_io(&self, fmt: &str, image: &str, cmds: &[&str]) {
        let mut args = vec!["-f", fmt];
        for c in cmds {
            args.extend(["-c", c]);
        }
        args.push(image);
        let out = self.ok("qemu-io", &args);
        assert!(
            !out.contains("error") && !out.contains("failed"),
            "qemu-io {cmds:?} on {image}: {out}"
        );
    }

    /// Feeds `script` (one qemu-io command per line) to `qemu-io -f fmt image` on stdin.
    pub fn qemu_io_script(&self, fmt: &str, image: &str, script: &str) {
        let mut child = Command::new("qemu-io")
            .args(["-f", fmt, image])
            .current_dir(self.dir.path())
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap_or_else(|e| panic!("cannot run qemu-io ({e}); install qemu-utils"));
        let mut stdin = child.stdin.take().expect("stdin");
        let script = script.to_string();
        // Write from another thread: qemu-io's output could otherwise fill its pipe and block.
        let writer = std::thread::spawn(move || {
            stdin
                .write_all(script.as_bytes())
                .expect("write qemu-io script");
        });
        let out = child.wait_with_output().expect("wait for qemu-io");
        writer.join().expect("script writer");
        let text = String::from_utf8_lossy(&out.stdout);
        assert!(
            out.status.success() && !text.contains("error") && !text.contains("failed"),
            "qemu-io script on {image} failed: {}{}",
            text.chars().take(2000).collect::<String>(),
            String::from_utf8_lossy(&out.stderr)
        );
    }

    /// `qemu-img check` must find nothing wrong.
    pub fn assert_check_clean(&self, image: &str) {
        let out = self.run("qemu-img", &["check", image]);
        let text = format!(
            "{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        assert!(
            out.status.success() && text.contains("No errors were found on the image."),
            "qemu-img check {image}: {text}"
        );
    }

    /// `qemu-img compare` must find the images identical.
    pub fn assert_identical(&self, a: &str, a_fmt: &str, b: &str, b_fmt: &str) {
        let out = self.run("qemu-img", &["compare", "-f", a_fmt, "-F", b_fmt, a, b]);
        assert!(
            out.status.success(),
            "qemu-img compare {a} {b}: {}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
    }

    /// `qemu-img info --output=json`.
    pub fn info(&self, image: &str) -> Value {
        serde_json::from_str(&self.qemu_img(&["info", "--output=json", image]))
            .expect("qemu-img info JSON")
    }

    /// `qemu-img check --output=json` (which must succeed).
    pub fn check_json(&self, image: &str) -> Value {
        serde_json::from_str(&self.qemu_img(&["check", "--output=json", image]))
            .expect("qemu-img check JSON")
    }

    /// Reads a file of the directory.
    pub fn read(&self, name: &str) -> Vec<u8> {
        std::fs::read(self.path(name)).unwrap_or_else(|e| panic!("read {name}: {e}"))
    }

    /// Bytes the file occupies on disk (what `du` counts).
    pub fn disk_usage(&self, name: &str) -> u64 {
        std::fs::metadata(self.path(name))
            .unwrap_or_else(|e| panic!("stat {name}: {e}"))
            .blocks()
            * 512
    }
}

/// One run of a `map --output=json`, with what the comparison looks at.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Run {
    pub start: u64,
    pub length: u64,
    pub depth: u64,
    pub present: bool,
    pub zero: bool,
    pub data: bool,
    pub compressed: bool,
    pub offset: Option<u64>,
}

/// Parses `map --output=json` (ours or qemu-img's).
pub fn parse_map(json: &str) -> Vec<Run> {
    let v: Value = serde_json::from_str(json).unwrap_or_else(|e| panic!("map JSON: {e}\n{json}"));
    let arr = v.as_array().expect("map JSON is an array");
    arr.iter()
        .map(|e| {
            let u = |k: &str| e[k].as_u64().unwrap_or_else(|| panic!("{k} in {e}"));
            let b = |k: &str| e[k].as_bool().unwrap_or_else(|| panic!("{k} in {e}"));
            Run {
                start: u("start"),
                length: u("length"),
                depth: u("depth"),
                present: b("present"),
                zero: b("zero"),
                data: b("data"),
                compressed: b("compressed"),
                offset: e.get("offset").and_then(Value::as_u64),
            }
        })
        .collect()
}

/// What two maps disagree on.
#[derive(Debug, Default)]
pub struct MapDiff {
    /// Bytes where QEMU reports zeros because the host range is a hole in the file (data in a
    /// preallocated cluster never written, a hole in a raw layer) and we report data.
    pub host_hole_bytes: u64,
    /// Bytes inside the `raw_tail` range given to [`compare_maps`] where both read as zeros
    /// but QEMU counts them as present in the raw layer (it rounds a raw file's size up to
    /// 512 bytes) and we do not.
    pub raw_tail_bytes: u64,
    /// Any other disagreement, described.
    pub mismatches: Vec<String>,
}

/// Compares two maps byte for byte on data, zero, present, depth and compressed (extents may
/// be split and merged differently). `raw_tail` is a range where only present and depth may
/// differ (see [`MapDiff::raw_tail_bytes`]).
pub fn compare_maps(
    ours: &[Run],
    qemu: &[Run],
    size: u64,
    raw_tail: Option<(u64, u64)>,
) -> MapDiff {
    let mut diff = MapDiff::default();
    for (name, runs) in [("ours", ours), ("qemu", qemu)] {
        let mut pos = 0;
        for r in runs.iter().filter(|r| r.length > 0) {
            if r.start != pos {
                diff.mismatches.push(format!(
                    "{name}: run at {} leaves a gap or overlap at {pos}",
                    r.start
                ));
            }
            pos = r.start + r.length;
        }
        if pos != size {
            diff.mismatches
                .push(format!("{name}: runs end at {pos}, the disk at {size}"));
        }
    }
    if !diff.mismatches.is_empty() {
        return diff;
    }
    let (mut i, mut j, mut pos) = (0, 0, 0u64);
    let ours: Vec<&Run> = ours.iter().filter(|r| r.length > 0).collect();
    let qemu: Vec<&Run> = qemu.iter().filter(|r| r.length > 0).collect();
    while pos < size {
        let (a, b) = (ours[i], qemu[j]);
        let end = (a.start + a.length).min(b.start + b.length);
        let same = a.data == b.data
            && a.zero == b.zero
            && a.present == b.present
            && a.depth == b.depth
            && a.compressed == b.compressed;
        if !same {
            // QEMU says zero (with or without data) at a host offset where we say plain data.
            let hole = b.zero
                && b.present
                && b.offset.is_some()
                && a.data
                && !a.zero
                && a.present
                && a.depth == b.depth;
            let in_tail = raw_tail.is_some_and(|(s, e)| s <= pos && end <= e);
            let tail = in_tail && a.data == b.data && a.zero == b.zero && !a.compressed;
            if hole {
                diff.host_hole_bytes += end - pos;
            } else if tail {
                diff.raw_tail_bytes += end - pos;
            } else if diff.mismatches.len() < 10 {
                diff.mismatches
                    .push(format!("[{pos:#x}, {end:#x}): ours {a:?}, qemu {b:?}"));
            }
        }
        pos = end;
        if pos == a.start + a.length {
            i += 1;
        }
        if pos == b.start + b.length {
            j += 1;
        }
    }
    diff
}

/// One line of human `map` output: guest start, length, host offset, file.
pub type HumanLine = (u64, u64, u64, String);

/// Parses human `map` output and merges lines that continue each other.
pub fn parse_human_map(text: &str) -> Vec<HumanLine> {
    let mut lines = text.lines();
    assert_eq!(
        lines.next().map(str::trim_end),
        Some("Offset          Length          Mapped to       File"),
        "header of {text}"
    );
    let num = |s: &str| {
        if s == "0" {
            0
        } else {
            u64::from_str_radix(s.trim_start_matches("0x"), 16)
                .unwrap_or_else(|e| panic!("{s}: {e}"))
        }
    };
    let mut out: Vec<HumanLine> = Vec::new();
    for l in lines {
        let (cols, file) = l.split_at(48);
        let f: Vec<&str> = cols.split_whitespace().collect();
        let (s, n, o) = (num(f[0]), num(f[1]), num(f[2]));
        match out.last_mut() {
            Some(last) if last.0 + last.1 == s && last.2 + last.1 == o && last.3 == file => {
                last.1 += n
            }
            _ => out.push((s, n, o, file.to_string())),
        }
    }
    out
}

/// splitmix64: a small deterministic random source (the tests must not depend on a crate
/// just for this, and must be reproducible from the printed seed).
pub struct Rng(pub u64);

impl Rng {
    /// The next 64 random bits.
    pub fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    /// A number in `0..n`.
    pub fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }

    /// `n` random bytes.
    pub fn bytes(&mut self, n: usize) -> Vec<u8> {
        let mut v = Vec::with_capacity(n + 8);
        while v.len() < n {
            v.extend_from_slice(&self.next().to_le_bytes());
        }
        v.truncate(n);
        v
    }
}

/// Asserts two byte strings are equal, naming the first difference.
pub fn assert_same_bytes(ours: &[u8], theirs: &[u8], what: &str) {
    assert_eq!(ours.len(), theirs.len(), "{what}: lengths differ");
    if let Some(i) = ours.iter().zip(theirs).position(|(a, b)| a != b) {
        panic!(
            "{what}: first difference at byte {i:#x}: ours {:#04x}, QEMU {:#04x}",
            ours[i], theirs[i]
        );
    }
}
