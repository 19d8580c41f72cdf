//! Bitmap directories and bitmap table entries: decoding never panics, decoded directories
//! re-encode byte-for-byte, decoded table entries encode back to the same word.
#![no_main]

use libfuzzer_sys::fuzz_target;
use qcow2_format::bitmap::{self, BitmapTableEntry, BitmapsExtension};
use qcow2_format::{Geometry, HostOffset};

fuzz_target!(|data: &[u8]| {
    if data.len() < 3 {
        return;
    }
    let nb_bitmaps = u32::from(u16::from_be_bytes([data[0], data[1]]));
    let cluster_bits = 9 + u32::from(data[2]) % 13;
    let dir = &data[3..];
    let Ok(geometry) = Geometry::new(cluster_bits, false, 4, 1 << 30) else {
        return;
    };
    let ext = BitmapsExtension {
        nb_bitmaps,
        reserved: 0,
        directory_size: dir.len() as u64,
        directory_offset: geometry.cluster_size() * 3,
    };
    if let Ok(entries) = bitmap::decode_directory(dir, &ext, &geometry) {
        let encoded = bitmap::encode_directory(&entries).expect("decoded entries encode");
        assert_eq!(encoded, dir);
        for e in &entries {
            let _ = (e.granularity(), e.in_use(), e.auto(), e.name_lossy());
        }
    }
    for (i, chunk) in dir.chunks_exact(8).enumerate() {
        let raw = u64::from_be_bytes(chunk.try_into().expect("8 bytes"));
        if let Ok(e) = BitmapTableEntry::decode(raw, &geometry, i as u64, HostOffset(0x40000)) {
            assert_eq!(e.encode().expect("encodes"), raw);
        }
    }
});
