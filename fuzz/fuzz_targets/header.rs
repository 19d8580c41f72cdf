//! Header + extensions + backing name: decoding never panics at either strictness, the
//! checker's strictness accepts every header a normal open accepts and reads it the same, and
//! whatever decodes re-encodes to bytes that decode to the same header.
#![no_main]

use libfuzzer_sys::fuzz_target;
use qcow2_format::header::Strictness;
use qcow2_format::{FeatureKind, Header};

fuzz_target!(|data: &[u8]| {
    let lenient = Header::decode_with(data, Strictness::Check);
    let Ok(header) = Header::decode(data) else {
        return;
    };
    assert_eq!(
        lenient.as_ref().ok(),
        Some(&header),
        "the checker reads what an open reads"
    );
    let cluster_size = header.cluster_size();
    let geometry = header
        .geometry()
        .expect("a decoded header has a valid geometry");
    assert_eq!(geometry.cluster_size(), cluster_size);
    for bit in 0..64 {
        let _ = header.feature_name(FeatureKind::Incompatible, bit);
    }
    let _ = (
        header.bitmaps(),
        header.backing_format(),
        header.data_file_name(),
        header.fde_pointer(),
    );
    if let Ok(encoded) = header.encode(cluster_size) {
        let again = Header::decode(&encoded).expect("an encoded header decodes");
        assert_eq!(again.encode(cluster_size).expect("re-encodes"), encoded);
        assert_eq!(again.extensions, header.extensions);
        assert_eq!(again.unknown_header_tail, header.unknown_header_tail);
        assert_eq!(again.backing_file, header.backing_file);
    }
});
