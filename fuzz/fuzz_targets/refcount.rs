//! Refcount blocks at every width (refcount_order 0..=6): get never panics, writing back what
//! was read leaves the block unchanged, and set then get returns the value set.
#![no_main]

use libfuzzer_sys::fuzz_target;
use qcow2_format::refcount;
use qcow2_format::{Geometry, HostOffset, RefcountTableEntry};

fuzz_target!(|data: &[u8]| {
    let Some((&selector, block)) = data.split_first() else {
        return;
    };
    let order = u32::from(selector) % 8; // 7 must be refused
    let entries = refcount::entries_in(block.len(), order);
    let mut copy = block.to_vec();
    for index in 0..entries.min(4096) {
        let value = refcount::get(block, order, index).expect("index in range");
        refcount::set(&mut copy, order, index, value).expect("a value read fits");
    }
    assert_eq!(copy, block);
    if let Some(max) = refcount::max_value(order) {
        let value = u64::from(selector).wrapping_mul(0x9e37_79b9_7f4a_7c15) & max;
        if entries > 0 {
            let index = usize::from(selector) % entries;
            refcount::set(&mut copy, order, index, value).expect("fits");
            assert_eq!(refcount::get(&copy, order, index).expect("in range"), value);
        }
        if max < u64::MAX {
            assert!(refcount::set(&mut copy, order, 0, max + 1).is_err());
        }
    } else {
        assert!(refcount::get(block, order, 0).is_err());
    }
    assert!(refcount::get(block, order, entries).is_err());

    let geometry = Geometry::new(9 + u32::from(selector) % 13, false, 4, 0).expect("valid");
    for (i, chunk) in block.chunks_exact(8).enumerate() {
        let raw = u64::from_be_bytes(chunk.try_into().expect("8 bytes"));
        if let Ok(e) = RefcountTableEntry::decode(raw, &geometry, i as u64, HostOffset(0x10000)) {
            assert_eq!(e.encode().expect("encodes"), raw);
        }
    }
});
