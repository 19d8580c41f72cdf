//! L1 and L2 entries (standard and extended): every raw word either decodes to something
//! that encodes back to exactly the same bits, or is refused with an error.
#![no_main]

use libfuzzer_sys::fuzz_target;
use qcow2_format::{
    l1, l2, ExtendedL2Entry, Geometry, HostOffset, L1Entry, L2Entry, SubclusterState,
};

fuzz_target!(|data: &[u8]| {
    let Some((&selector, table)) = data.split_first() else {
        return;
    };
    // Low 4 bits pick the cluster size (9..=21), bit 4 extended L2, bit 5 an external data
    // file, so one corpus entry exercises every layout.
    let cluster_bits = 9 + u32::from(selector & 0x0f) % 13;
    let extended = selector & 0x10 != 0;
    let Ok(geometry) = Geometry::new(cluster_bits, extended, 4, 1 << 30) else {
        return;
    };
    let geometry = geometry.with_data_file(selector & 0x20 != 0);
    let at = HostOffset(0x50000);

    let mut i = 0usize;
    while let Some(raw) = l1::entry_at(table, i) {
        if let Ok(e) = L1Entry::decode(raw, &geometry, i as u64, at) {
            assert_eq!(e.encode().expect("decoded L1 entries encode"), raw);
        }
        i += 1;
    }

    let mut i = 0usize;
    while let Some((word, bitmap)) = l2::entry_at(table, i, extended) {
        if extended {
            if let Ok(e) = ExtendedL2Entry::decode(word, bitmap, &geometry, i as u64, at) {
                assert_eq!(
                    e.encode(&geometry).expect("decoded entries encode"),
                    (word, bitmap)
                );
                let mut covered = 0;
                for (start, state, len) in e.runs() {
                    assert_eq!(start, covered);
                    for sc in start..start + len {
                        assert_eq!(e.state(sc), state);
                    }
                    covered += len;
                }
                assert_eq!(covered, 32);
                let _ = e.mask(SubclusterState::Zero);
            }
        } else if let Ok(e) = L2Entry::decode(word, &geometry, i as u64, at) {
            assert_eq!(e.encode(&geometry).expect("decoded entries encode"), word);
            if let L2Entry::Compressed(d) = e {
                let (start, len) = d.byte_range();
                assert!(len > 0 && start.checked_add(len).is_some());
            }
        }
        i += 1;
    }
});
