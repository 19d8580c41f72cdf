//! Snapshot tables: decoding never panics and stays within QEMU's limits, judging an entry's
//! L1 table (as its use does) never panics either, the checker's
//! strictness reads every entry an open reads the same way, and a decoded table re-encodes to
//! one that decodes to the same entries.
#![no_main]

use libfuzzer_sys::fuzz_target;
use qcow2_format::header::Strictness;
use qcow2_format::snapshot::{self, SnapshotTableEntry};
use qcow2_format::Geometry;

fuzz_target!(|data: &[u8]| {
    if data.len() < 3 {
        return;
    }
    let nb = u32::from(u16::from_be_bytes([data[0], data[1]]));
    let cluster_bits = 9 + u32::from(data[2]) % 13;
    let table = &data[3..];
    let Ok(geometry) = Geometry::new(cluster_bits, false, 4, 1 << 30) else {
        return;
    };
    let _ = SnapshotTableEntry::decode_with(table, 0x30000, 0, Strictness::Check);
    let Ok(entries) = snapshot::decode_table(table, 0x30000, nb) else {
        return;
    };
    assert_eq!(entries.len() as u64, u64::from(nb));
    let mut pos = 0;
    for (index, e) in entries.iter().enumerate() {
        let (lenient, len) = SnapshotTableEntry::decode_with(
            &table[pos..],
            0x30000 + pos as u64,
            index as u64,
            Strictness::Check,
        )
        .expect("the checker reads what an open reads");
        assert_eq!(&lenient, e);
        pos += len;
    }
    for e in &entries {
        let _ = (
            e.vm_state_size(),
            e.disk_size(),
            e.icount(),
            e.name_lossy(),
            e.id_lossy(),
            e.l1_table_problem(geometry.cluster_size()),
        );
    }
    let encoded = snapshot::encode_table(&entries).expect("decoded entries encode");
    let again = snapshot::decode_table(&encoded, 0x30000, nb).expect("re-decodes");
    assert_eq!(again, entries);
});
