//! The LUKS header of an encrypted qcow2 image: the input is the fixed header, padded with
//! zeros into the area its key slots claim (bounded), so every check is reached. Parsing
//! never panics; what parses re-encodes to a header that parses the same; `info` and
//! unlocking (when its iteration counts keep a run short) never panic either.
#![no_main]

use libfuzzer_sys::fuzz_target;
use qcow2::crypto::luks::HEADER_LEN;
use qcow2::crypto::LuksHeader;

/// Largest area built from one input.
const MAX_AREA: usize = 4 << 20;

fuzz_target!(|data: &[u8]| {
    let claimed = data
        .get(104..108)
        .map_or(0, |b| u32::from_be_bytes([b[0], b[1], b[2], b[3]]) as usize * 512);
    let mut area = data.to_vec();
    if claimed > area.len() {
        area.resize(claimed.min(MAX_AREA), 0);
    }
    let Ok(header) = LuksHeader::parse(&area) else {
        return;
    };
    let mut again = area.clone();
    again[..HEADER_LEN].copy_from_slice(&header.encode());
    assert_eq!(
        LuksHeader::parse(&again).expect("an encoded header parses"),
        header
    );
    let _ = header.info();
    let cheap = header.mk_iterations <= 2000
        && header
            .slots
            .iter()
            .all(|s| !s.active || s.iterations <= 2000);
    if cheap {
        let _ = header.unlock(&area, b"password");
    }
});
