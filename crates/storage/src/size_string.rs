//! Size strings (`8M`, `512K`, `1.5G`, `4096`) read exactly the way QEMU's option parser reads
//! them (image options such as a `null-co` node's `size`, and every size of the command line), so a `-o l2-cache-size=...` that QEMU accepts means the same number of bytes here and
//! one it rejects is rejected here too.
//!
//! QEMU's rules (util/cutils.c, `qemu_strtosz`), as observed with qemu-img 10.0:
//! - an optional run of leading white space and a `+` sign, then decimal digits;
//! - an optional fraction (`1.5M`, `.5k`, `1.k`), which needs a suffix other than `B`;
//! - hexadecimal (`0x1F`) is accepted but without fraction or suffix;
//! - one optional suffix, case-insensitive: `B` (bytes), `K`, `M`, `G`, `T`, `P`, `E`
//!   (powers of 1024); nothing may follow it, so `8MB` is rejected as QEMU rejects it;
//! - fractions are computed in 64.64 fixed point and rounded half up (`1.1M` = 1153434);
//! - negative numbers and results of 2^64 or more are "out of range", anything else that does
//!   not parse is "invalid". As in QEMU, trailing garbage turns an out-of-range number into an
//!   invalid one (`-1x`).

/// Why a size string is not a size; messages follow QEMU's.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ParseSizeError {
    /// A size string that is not a size.
    #[error(
        "invalid size '{value}': expects a non-negative number below 2^64; optional suffix \
     k, M, G, T, P or E means kilo-, mega-, giga-, tera-, peta- and exabytes"
    )]
    InvalidSize {
        /// The string given.
        value: String,
    },
    /// A size string that is negative or 2^64 and above.
    #[error("size '{value}' is out of range (a non-negative number below 2^64)")]
    SizeOutOfRange {
        /// The string given.
        value: String,
    },
}

/// What went wrong, before it is turned into a [`ParseSizeError`] naming the input.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Failure {
    Invalid,
    OutOfRange,
}

/// Parse a QEMU size string (`8M`, `512K`, `1G`, `1.5M`, `4096`, `0x1000`) into bytes.
pub fn parse_size(s: &str) -> Result<u64, ParseSizeError> {
    let bytes = s.as_bytes();
    let (end, result) = parse_prefix(bytes);
    // Like QEMU: anything left over makes the whole string invalid, whatever else was wrong.
    let result = if end < bytes.len() {
        Err(Failure::Invalid)
    } else {
        result
    };
    result.map_err(|failure| match failure {
        Failure::Invalid => ParseSizeError::InvalidSize {
            value: s.to_owned(),
        },
        Failure::OutOfRange => ParseSizeError::SizeOutOfRange {
            value: s.to_owned(),
        },
    })
}

/// The multiplier a suffix character stands for, if it is one.
fn suffix_multiplier(c: u8) -> Option<u64> {
    let power = match c.to_ascii_uppercase() {
        b'B' => 0,
        b'K' => 1,
        b'M' => 2,
        b'G' => 3,
        b'T' => 4,
        b'P' => 5,
        b'E' => 6,
        _ => return None,
    };
    Some(1u64 << (10 * power))
}

/// C's `isspace` in the "C" locale.
fn is_c_space(c: u8) -> bool {
    matches!(c, b' ' | b'\t' | b'\n' | 0x0b | 0x0c | b'\r')
}

/// What `strtoull` would see: white space, a sign, then digits of `radix`.
struct Integer {
    /// Index just past the last digit, or 0 when there were no digits (no conversion).
    end: usize,
    /// The value, `None` when it does not fit in 64 bits.
    value: Option<u64>,
    negative: bool,
}

/// Skips what C's number parsers skip before the digits: white space, then one sign.
/// Returns the offset after them and whether the sign was `-`.
fn skip_space_and_sign(s: &[u8]) -> (usize, bool) {
    let mut i = 0;
    while i < s.len() && is_c_space(s[i]) {
        i += 1;
    }
    match s.get(i) {
        Some(&sign @ (b'+' | b'-')) => (i + 1, sign == b'-'),
        _ => (i, false),
    }
}

/// Scan an unsigned integer the way `strtoull(s, &end, radix)` does (radix 10 or 16; for 16 an
/// optional `0x`/`0X` prefix is skipped when a hex digit follows it).
fn scan_integer(s: &[u8], radix: u32) -> Integer {
    let (mut i, negative) = skip_space_and_sign(s);
    if radix == 16
        && s.get(i) == Some(&b'0')
        && matches!(s.get(i + 1), Some(b'x' | b'X'))
        && s.get(i + 2).is_some_and(u8::is_ascii_hexdigit)
    {
        i += 2;
    }
    let digits_start = i;
    let mut value = Some(0u64);
    while let Some(digit) = s.get(i).and_then(|&c| char::from(c).to_digit(radix)) {
        value = value
            .and_then(|v| v.checked_mul(u64::from(radix)))
            .and_then(|v| v.checked_add(u64::from(digit)));
        i += 1;
    }
    if i == digits_start {
        return Integer {
            end: 0,
            value: Some(0),
            negative: false,
        };
    }
    Integer {
        end: i,
        value,
        negative,
    }
}

/// The fraction `strtod` would read from `s` once any exponent has been cut off: white space,
/// a sign, a dot and decimal digits. Returns (bytes consumed, value, negative, any non-zero
/// digit), or `None` when `strtod` would convert nothing.
fn scan_fraction(s: &[u8]) -> Option<(usize, f64, bool, bool)> {
    let (mut i, negative) = skip_space_and_sign(s);
    if s.get(i) != Some(&b'.') {
        return None;
    }
    i += 1;
    let digits_start = i;
    while s.get(i).is_some_and(u8::is_ascii_digit) {
        i += 1;
    }
    let digits = s.get(digits_start..i)?;
    if digits.is_empty() {
        return None;
    }
    let nonzero = digits.iter().any(|&d| d != b'0');
    // Only ASCII digits, so this is valid UTF-8 and a valid float literal; Rust rounds
    // correctly, as glibc's strtod does.
    let text = std::str::from_utf8(digits).ok()?;
    let value: f64 = format!("0.{text}").parse().ok()?;
    Some((i, value, negative, nonzero))
}

/// Parse as much of `s` as QEMU would; returns where parsing stopped and the outcome.
fn parse_prefix(s: &[u8]) -> (usize, Result<u64, Failure>) {
    let int = scan_integer(s, 10);
    let have_digits = int.end > 0;
    if have_digits && int.negative {
        return (int.end, Err(Failure::OutOfRange));
    }
    let Some(mut value) = int.value else {
        return (int.end, Err(Failure::OutOfRange));
    };
    let mut end = int.end;
    // 64-bit binary fraction: `fraction` / 2^64.
    let mut fraction: u64 = 0;

    let next = s.get(end).copied();
    if have_digits && value == 0 && matches!(next, Some(b'x' | b'X')) {
        // Hexadecimal: reparse the whole string, and allow neither fraction nor suffix.
        let hex = scan_integer(s, 16);
        if hex.end == 0 {
            return (0, Err(Failure::Invalid));
        }
        let Some(v) = hex.value else {
            return (hex.end, Err(Failure::OutOfRange));
        };
        let after = s.get(hex.end).copied();
        if after == Some(b'.') || after.and_then(suffix_multiplier).is_some() {
            return (0, Err(Failure::Invalid));
        }
        value = v;
        end = hex.end;
    } else if next == Some(b'.') || (!have_digits && s.contains(&b'.')) {
        if have_digits && !s.get(end + 1).is_some_and(u8::is_ascii_digit) {
            // "1." or "1.k": a dot without digits adds nothing.
            end += 1;
        } else {
            // QEMU reads the fraction with strtod after cutting the string at the first
            // 'e'/'E', so that "1.5E" means exabytes rather than an exponent.
            let rest = &s[end..];
            let cut = rest
                .iter()
                .position(|&c| c == b'e' || c == b'E')
                .unwrap_or(rest.len());
            let Some((used, f, negative, nonzero)) = scan_fraction(&rest[..cut]) else {
                return (end, Err(Failure::Invalid));
            };
            end += used;
            if negative {
                return (end, Err(Failure::OutOfRange));
            }
            if f >= 1.0 {
                // So many nines that the double rounded up to one.
                let Some(v) = value.checked_add(1) else {
                    return (end, Err(Failure::OutOfRange));
                };
                value = v;
            } else {
                // f < 1, so f * 2^64 < 2^64: the float-to-int conversion cannot saturate.
                let scaled = f * 18_446_744_073_709_551_616.0;
                fraction = if scaled >= 1.0 {
                    scaled as u64
                } else {
                    u64::from(nonzero)
                };
            }
        }
    } else if !have_digits {
        return (0, Err(Failure::Invalid));
    }

    let multiplier = match s.get(end).copied().and_then(suffix_multiplier) {
        Some(m) => {
            end += 1;
            m
        }
        None => 1,
    };
    if multiplier == 1 {
        if fraction != 0 {
            // A fraction of a byte: QEMU insists on a larger unit.
            return (0, Err(Failure::Invalid));
        }
        return (end, Ok(value));
    }
    // Exact 64.64 x 64 product, rounded half up.
    let whole = u128::from(value) * u128::from(multiplier);
    let frac = u128::from(fraction) * u128::from(multiplier);
    let total = whole + (frac >> 64) + ((frac >> 63) & 1);
    match u64::try_from(total) {
        Ok(v) => (end, Ok(v)),
        Err(_) => (end, Err(Failure::OutOfRange)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ok(s: &str) -> u64 {
        parse_size(s).unwrap_or_else(|e| panic!("{s:?} should parse: {e}"))
    }

    fn invalid(s: &str) {
        assert!(
            matches!(parse_size(s), Err(ParseSizeError::InvalidSize { .. })),
            "{s:?} should be invalid, got {:?}",
            parse_size(s)
        );
    }

    fn out_of_range(s: &str) {
        assert!(
            matches!(parse_size(s), Err(ParseSizeError::SizeOutOfRange { .. })),
            "{s:?} should be out of range, got {:?}",
            parse_size(s)
        );
    }

    #[test]
    fn plain_bytes_and_suffixes() {
        assert_eq!(ok("0"), 0);
        assert_eq!(ok("4096"), 4096);
        assert_eq!(ok("512B"), 512);
        assert_eq!(ok("1b"), 1);
        assert_eq!(ok("512K"), 512 << 10);
        assert_eq!(ok("512k"), 512 << 10);
        assert_eq!(ok("8M"), 8 << 20);
        assert_eq!(ok("8m"), 8 << 20);
        assert_eq!(ok("1G"), 1 << 30);
        assert_eq!(ok("2T"), 2 << 40);
        assert_eq!(ok("3P"), 3 << 50);
        assert_eq!(ok("15E"), 15 << 60);
        assert_eq!(ok(" 12"), 12);
        assert_eq!(ok("+5"), 5);
        assert_eq!(ok("18446744073709551615"), u64::MAX);
    }

    #[test]
    fn fractions_round_half_up_in_fixed_point() {
        assert_eq!(ok("1.5k"), 1536);
        assert_eq!(ok("1.5M"), 3 << 19);
        assert_eq!(ok("1.1M"), 1_153_434);
        assert_eq!(ok(".5k"), 512);
        assert_eq!(ok("+.5k"), 512);
        assert_eq!(ok("1.k"), 1024);
        assert_eq!(ok("1."), 1);
        assert_eq!(ok("1.0"), 1);
        assert_eq!(ok("4096.5k"), 4_194_816);
        assert_eq!(ok("1.5e"), 1_729_382_256_910_270_464);
        assert_eq!(ok("1.00000000000000000001k"), 1024);
        assert_eq!(ok(".00000000000000000000001k"), 0);
        assert_eq!(ok("0.9999999999999999999999999k"), 1024);
        assert_eq!(ok("1.9999999999999999m"), 2 << 20);
    }

    #[test]
    fn hexadecimal_without_fraction_or_suffix() {
        assert_eq!(ok("0X1F"), 31);
        assert_eq!(ok("0x1b"), 27);
        assert_eq!(ok(" +0x10"), 16);
        invalid("0x10k");
        invalid("0x1.5");
        invalid("0x");
        invalid("0x1p3");
    }

    #[test]
    fn rejects_what_qemu_rejects() {
        for s in [
            "",
            " ",
            ".",
            ".k",
            "8MB",
            "1e3",
            "1.5e3",
            "0.5",
            "1.5",
            "1.5b",
            "inf.",
            "2k3",
            "-.5k",
            "k",
            "1 k",
            "99999999999999999999k",
            "-1x",
            "nan",
        ] {
            invalid(s);
        }
        for s in [
            "-1",
            "-0",
            "-.5",
            "99999999999999999999",
            "16E",
            "15.999999999999999999E",
        ] {
            out_of_range(s);
        }
    }

    #[test]
    fn error_messages_name_the_value() {
        let e = parse_size("8MB").unwrap_err().to_string();
        assert!(
            e.contains("'8MB'") && e.contains("non-negative number below 2^64"),
            "{e}"
        );
        let e = parse_size("-1").unwrap_err().to_string();
        assert!(e.contains("'-1'") && e.contains("out of range"), "{e}");
    }
}

/// `parse_size` against QEMU itself: `qemu-img create -o size=STRING` prints the number of
/// bytes QEMU read from STRING (or says why it rejected it), for a fixed list of tricky
/// strings and a few hundred generated ones.
#[cfg(test)]
mod qemu_oracle {
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
}
