//! The PSK key file parser on arbitrary bytes (an operator's file, possibly truncated or
//! binary): never a panic, and every key it accepts is within OpenSSL's limits.
#![no_main]

use std::path::Path;

use libfuzzer_sys::fuzz_target;
use nbd_proto::tls::parse_psk_file;

fuzz_target!(|data: &[u8]| {
    if let Ok(keys) = parse_psk_file(Path::new("keys.psk"), data) {
        assert!(!keys.is_empty());
        for (identity, key) in &keys {
            assert!(!identity.is_empty() && identity.len() <= 256);
            assert!(!key.is_empty() && key.len() <= 512);
        }
    }
});
