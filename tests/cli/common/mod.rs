//! Helpers of the CLI tests: our binary, to run in a `test_support::Dir` beside QEMU's
//! tools, and map comparison.
//!
//! The tests need qemu-img and qemu-io (Debian: qemu-utils); a missing tool fails the test
//! with a message saying so.

use std::process::Output;

use serde_json::Value;

/// The binary under test, for `Dir::run` and `Dir::ok`.
pub const BIN: &str = env!("CARGO_BIN_EXE_qcow2-nbd");

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

/// `qemu-img info --output=json` of `image` with what may differ between two equal images
/// taken out: the file names (`image` becomes `IMG`) and the sizes and offsets on disk.
pub fn info_sans_offsets(d: &test_support::Dir, image: &str) -> Value {
    let mut v = d.info(image);
    fn strip(v: &mut Value) {
        if let Value::Object(m) = v {
            for k in ["actual-size", "children", "filename"] {
                m.remove(k);
            }
            m.values_mut().for_each(strip);
        } else if let Value::Array(a) = v {
            a.iter_mut().for_each(strip);
        }
    }
    strip(&mut v);
    v
}

/// The first line of a tool's error, without its `prog: ` prefix.
pub fn reason(stderr: &[u8]) -> String {
    let text = String::from_utf8_lossy(stderr);
    // The tool's own message, not what an open printed before it (repairs, warnings).
    let line = text
        .lines()
        .find(|l| l.starts_with("qemu-img: ") || l.starts_with("qcow2-nbd: "))
        .unwrap_or("");
    line.split_once(": ")
        .map_or(line, |(_, r)| r)
        .trim()
        .to_string()
}

/// Runs `SUBCOMMAND ARGS` in `d` through qemu-img on the image `theirs` and through our
/// binary on `ours` (a copy of it), `{}` in `args` standing for the image name as given:
/// (QEMU's output, ours).
pub fn side_by_side(
    d: &test_support::Dir,
    subcommand: &str,
    (theirs, ours): (&str, &str),
    args: &[&str],
) -> (Output, Output) {
    let with = |img: &str| -> Vec<String> {
        std::iter::once(subcommand.to_string())
            .chain(args.iter().map(|a| match *a {
                "{}" => img.to_string(),
                a => a.to_string(),
            }))
            .collect()
    };
    let (q_args, o_args) = (with(theirs), with(ours));
    let q_args: Vec<&str> = q_args.iter().map(String::as_str).collect();
    let o_args: Vec<&str> = o_args.iter().map(String::as_str).collect();
    (d.run("qemu-img", &q_args), d.run(BIN, &o_args))
}
