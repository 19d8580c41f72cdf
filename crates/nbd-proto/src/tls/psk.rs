//! The pre-shared key file: one `identity:hexkey` per line, as GnuTLS's `psktool` writes it
//! and QEMU's `tls-creds-psk` reads it.

use std::collections::HashMap;
use std::path::Path;

use super::error::{PskFileError, TlsError};

/// Largest key file read; a real one holds a few lines.
pub const MAX_PSK_FILE: u64 = 1 << 20;

/// Longest identity OpenSSL accepts from a client.
pub const MAX_IDENTITY_LEN: usize = 256;

/// Longest key OpenSSL accepts.
pub const MAX_KEY_LEN: usize = 512;

/// Identity to key.
pub type PskKeys = HashMap<Vec<u8>, Vec<u8>>;

/// Reads and parses the key file at `path`.
pub fn load_keys(path: &Path) -> Result<PskKeys, TlsError> {
    let read = |source| TlsError::Read {
        path: path.to_owned(),
        source,
    };
    let len = std::fs::metadata(path).map_err(read)?.len();
    if len > MAX_PSK_FILE {
        return Err(PskFileError {
            path: path.to_owned(),
            line: 0,
            reason: format!("{len} bytes is larger than a key file can be ({MAX_PSK_FILE})"),
        }
        .into());
    }
    let text = std::fs::read(path).map_err(read)?;
    Ok(parse_psk_file(path, &text)?)
}

/// Parses key file contents; blank lines are skipped, a repeated identity is an error.
pub fn parse_psk_file(path: &Path, text: &[u8]) -> Result<PskKeys, PskFileError> {
    let mut keys = PskKeys::new();
    for (i, raw) in text.split(|&b| b == b'\n').enumerate() {
        let line = raw.strip_suffix(b"\r").unwrap_or(raw);
        if line.iter().all(u8::is_ascii_whitespace) {
            continue;
        }
        let error = |reason: String| PskFileError {
            path: path.to_owned(),
            line: i + 1,
            reason,
        };
        let Some(colon) = line.iter().rposition(|&b| b == b':') else {
            return Err(error("expected identity:hexkey".into()));
        };
        let (identity, hex) = (&line[..colon], &line[colon + 1..]);
        if identity.is_empty() || identity.len() > MAX_IDENTITY_LEN {
            return Err(error(format!(
                "the identity must be 1 to {MAX_IDENTITY_LEN} bytes"
            )));
        }
        let key = decode_hex(hex).ok_or_else(|| error("the key is not hexadecimal".into()))?;
        if key.is_empty() || key.len() > MAX_KEY_LEN {
            return Err(error(format!("the key must be 1 to {MAX_KEY_LEN} bytes")));
        }
        if keys.insert(identity.to_vec(), key).is_some() {
            return Err(error(format!(
                "identity {:?} appears twice",
                String::from_utf8_lossy(identity)
            )));
        }
    }
    if keys.is_empty() {
        return Err(PskFileError {
            path: path.to_owned(),
            line: 0,
            reason: "no keys in the file".into(),
        });
    }
    Ok(keys)
}

fn decode_hex(hex: &[u8]) -> Option<Vec<u8>> {
    if hex.len() % 2 != 0 {
        return None;
    }
    let digit = |c: u8| (c as char).to_digit(16).map(|d| d as u8);
    hex.chunks_exact(2)
        .map(|pair| Some(digit(pair[0])? << 4 | digit(pair[1])?))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(text: &str) -> Result<PskKeys, PskFileError> {
        parse_psk_file(Path::new("keys.psk"), text.as_bytes())
    }

    #[test]
    fn psktool_lines_are_read() {
        let keys = parse("alice:00ff10\n\nbob:ABCD\r\n").unwrap();
        assert_eq!(keys[&b"alice"[..]], vec![0x00, 0xff, 0x10]);
        assert_eq!(keys[&b"bob"[..]], vec![0xab, 0xcd]);
        // An identity may contain a colon: the key is after the last one.
        let keys = parse("host:port:0102\n").unwrap();
        assert_eq!(keys[&b"host:port"[..]], vec![1, 2]);
    }

    #[test]
    fn malformed_files_say_where() {
        for (text, line, what) in [
            ("alice\n", 1, "identity:hexkey"),
            ("a:0g\n", 1, "hexadecimal"),
            ("a:012\n", 1, "hexadecimal"),
            ("ok:00\n:00\n", 2, "identity must"),
            ("a:\n", 1, "key must"),
            ("a:00\na:01\n", 2, "twice"),
            ("\n\n", 0, "no keys"),
        ] {
            let e = parse(text).unwrap_err();
            assert_eq!(e.line, line, "{text:?}: {e}");
            assert!(e.reason.contains(what), "{text:?}: {e}");
        }
        let long = format!("{}:00", "i".repeat(MAX_IDENTITY_LEN + 1));
        assert!(parse(&long).is_err());
        let big = format!("a:{}", "00".repeat(MAX_KEY_LEN + 1));
        assert!(parse(&big).is_err());
    }
}
