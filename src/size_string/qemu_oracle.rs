//! `parse_size` against QEMU itself: `qemu-img create -o size=STRING` prints the number of
//! bytes QEMU read from STRING (or says why it rejected it), for a fixed list of tricky
//! strings and a few hundred generated ones.

use super::{parse_size, ParseSizeError};
use test_support::{qemu, text};

#[derive(Debug, PartialEq, Eq)]
enum Verdict {
    Bytes(u64),
    Invalid,
    OutOfRange,
}

fn qemu_verdict(dir: &std::path::Path, s: &str) -> Verdict {
    let path = dir.join("x.raw");
    let out = qemu("qemu-img")
        .args(["create", "-f", "raw", "-o"])
        .arg(format!("size={}", s.replace(',', ",,")))
        .arg(&path)
        .output()
        .expect("run qemu-img");
    let _ = std::fs::remove_file(&path);
    let text = text(&out);
    if text.contains("is out of range for parameter") {
        return Verdict::OutOfRange;
    }
    if text.contains("expects a non-negative number below 2^64") {
        return Verdict::Invalid;
    }
    // "Formatting 'x.raw', fmt=raw size=N": N is what QEMU read, printed as a signed number.
    let size = text
        .split_whitespace()
        .find_map(|word| word.strip_prefix("size="))
        .and_then(|n| n.parse::<i64>().ok())
        .unwrap_or_else(|| panic!("cannot tell what qemu-img made of {s:?}: {text}"));
    Verdict::Bytes(u64::from_ne_bytes(size.to_ne_bytes()))
}

fn ours(s: &str) -> Verdict {
    match parse_size(s) {
        Ok(n) => Verdict::Bytes(n),
        Err(ParseSizeError::InvalidSize { .. }) => Verdict::Invalid,
        Err(ParseSizeError::SizeOutOfRange { .. }) => Verdict::OutOfRange,
    }
}

#[test]
fn parse_size_agrees_with_qemu_img() {
    let dir = tempfile::tempdir().expect("temp dir");
    let mut inputs: Vec<String> = [
        "0",
        "512",
        "4096",
        "512B",
        "512b",
        "1k",
        "1K",
        "1.5k",
        "1.5K",
        ".5k",
        "+.5k",
        "1.k",
        "8M",
        "8m",
        "8MB",
        "1G",
        "1g",
        "1T",
        "1.5",
        "1.0",
        "1.",
        "0x200",
        "0X1F",
        "0x10k",
        "0x1.5",
        "0x",
        "-1",
        "-0",
        "-.5",
        "-.5k",
        "-1k",
        "1e3",
        "1.5e3",
        "1E",
        "16E",
        "15.5E",
        " 1024",
        "+1024",
        "",
        " ",
        ".",
        ".k",
        "k",
        "inf.",
        "nan",
        "2k3",
        "1 k",
        "1.1M",
        "99999999999999999999",
        "99999999999999999999k",
        "18446744073709551615",
        "0.9999999999999999999999999k",
        "4096.5k",
        "1.25m",
        "0.001M",
        "3.9999k",
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    // Generated strings over the characters that matter, from a fixed seed.
    let alphabet: Vec<char> = "0123456789.kKmMgGbBeExX+- ".chars().collect();
    let mut x: u64 = 0x9e37_79b9_7f4a_7c15;
    for _ in 0..300 {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        let len = 1 + (x % 6) as usize;
        let s: String = (0..len)
            .map(|i| alphabet[((x >> (8 * i)) % alphabet.len() as u64) as usize])
            .collect();
        inputs.push(s);
    }
    let mut compared = 0;
    for s in &inputs {
        let mine = ours(s);
        // qemu-img takes a size of 2^64 - 1 for "no size given".
        if mine == Verdict::Bytes(u64::MAX) {
            continue;
        }
        let theirs = qemu_verdict(dir.path(), s);
        assert_eq!(mine, theirs, "parse_size({s:?}) disagrees with qemu-img");
        compared += 1;
    }
    assert!(compared > 150, "only {compared} strings could be compared");
}
