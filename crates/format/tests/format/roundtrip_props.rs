//! Property tests: every encoder's output decodes to what was encoded, and decoding then
//! re-encoding reproduces the bytes, for every structure of the format layer.

use proptest::prelude::*;
use qcow2_format::bitmap::{self, BitmapDirectoryEntry, BitmapTableEntry, BitmapsExtension};
use qcow2_format::extensions::{
    FdeHeaderPointer, FeatureNameEntry, FeatureNameTable, HeaderExtension,
};
use qcow2_format::features::{self, FeatureKind};
use qcow2_format::snapshot::{self, SnapshotTableEntry};
use qcow2_format::{
    l1, l2, refcount, CompressedDescriptor, ExtendedL2Entry, FormatError, Geometry, GuestOffset,
    Header, HostOffset, L1Entry, L2Entry, RefcountTableEntry, SubclusterState,
};

fn cluster_bits() -> impl Strategy<Value = u32> {
    9u32..=21
}

/// A cluster-aligned host offset below 2^56.
fn host_offset(bits: u32) -> impl Strategy<Value = u64> {
    (1u64..(1u64 << (56 - bits))).prop_map(move |c| c << bits)
}

fn bytes(max: usize) -> impl Strategy<Value = Vec<u8>> {
    proptest::collection::vec(any::<u8>(), 0..=max)
}

fn feature_table() -> impl Strategy<Value = FeatureNameTable> {
    (
        proptest::collection::vec(
            (0u8..4, 0u8..64, proptest::collection::vec(any::<u8>(), 46)),
            0..6,
        ),
        bytes(47),
    )
        .prop_map(|(entries, trailing)| FeatureNameTable {
            entries: entries
                .into_iter()
                .map(|(kind, bit, name)| FeatureNameEntry {
                    kind,
                    bit,
                    name: name.try_into().unwrap(),
                })
                .collect(),
            trailing,
        })
}

fn extension(bits: u32, crypt_method: u32) -> BoxedStrategy<HeaderExtension> {
    let cs = 1u64 << bits;
    let known = [
        0,
        0xe279_2aca,
        0x6803_f857,
        0x2385_2875,
        0x0537_be77,
        0x4441_5441,
    ];
    let common = prop_oneof![
        bytes(15).prop_map(HeaderExtension::BackingFormat),
        feature_table().prop_map(HeaderExtension::FeatureNameTable),
        (1u32..=65535, 1u64..=4096, 1u64..1000).prop_map(move |(nb, size, c)| {
            HeaderExtension::Bitmaps(BitmapsExtension {
                nb_bitmaps: nb,
                reserved: 0,
                directory_size: size,
                directory_offset: c * cs,
            })
        }),
        bytes(100).prop_map(HeaderExtension::ExternalDataFile),
        (any::<u32>(), bytes(64))
            .prop_filter("not a known type", move |(m, _)| !known.contains(m))
            .prop_map(|(magic, data)| HeaderExtension::Unknown { magic, data }),
    ];
    if crypt_method == 2 {
        // The encryption header pointer is only valid with LUKS.
        prop_oneof![
            common,
            (1u64..1000, any::<u64>()).prop_map(move |(c, length)| {
                HeaderExtension::FullDiskEncryption(FdeHeaderPointer {
                    offset: c * cs,
                    length,
                })
            }),
        ]
        .boxed()
    } else {
        common.boxed()
    }
}

prop_compose! {
    fn header()(bits in cluster_bits(), v3 in any::<bool>(), crypt in 0u32..=2)
        (bits in Just(bits), v3 in Just(v3), crypt in Just(crypt),
         extended in any::<bool>(), dirty in any::<bool>(), corrupt in any::<bool>(),
         data_file in any::<bool>(), zstd in any::<bool>(), raw in any::<bool>(),
         compatible in any::<u64>(), autoclear in any::<u64>(), refcount_order in 0u32..=6,
         long_header in any::<bool>(), tail_words in 0usize..4, tail_seed in any::<u8>(),
         l1_extra in 0u64..100, size_frac in 0u64..=1000, l1_clusters in 1u64..1000,
         rt_clusters in 1u32..=16, rt_at in 1u64..1000, nb_snapshots in 0u32..100, snap_at in 0u64..1000,
         exts in proptest::collection::vec(extension(bits, crypt), 0..5),
         backing in proptest::option::of(bytes(200)))
        -> Header
    {
        let mut h = Header::new(if v3 { 3 } else { 2 }, bits, 0);
        let cs = 1u64 << bits;
        h.crypt_method = crypt;
        if v3 {
            let extended = extended && bits >= 14;
            let zstd = zstd && long_header;
            h.incompatible_features = [(dirty, features::INCOMPAT_DIRTY), (corrupt, features::INCOMPAT_CORRUPT),
                (data_file, features::INCOMPAT_DATA_FILE), (zstd, features::INCOMPAT_COMPRESSION),
                (extended, features::INCOMPAT_EXTENDED_L2)]
                .iter().filter(|(on, _)| *on).fold(0, |acc, (_, bit)| acc | bit);
            h.compatible_features = compatible;
            h.autoclear_features = autoclear & !features::AUTOCLEAR_DATA_FILE_RAW
                | if raw && data_file { features::AUTOCLEAR_DATA_FILE_RAW } else { 0 };
            h.refcount_order = refcount_order;
            h.compression_type = u8::from(zstd);
            if long_header {
                h.header_length = 112 + 8 * tail_words as u32;
                h.unknown_header_tail = (0..7 + 8 * tail_words).map(|i| tail_seed.wrapping_add(i as u8)).collect();
            } else {
                h.header_length = 104;
                h.unknown_header_tail = Vec::new();
            }
        }
        let geometry = h.geometry().unwrap();
        let span = geometry.cluster_size() * geometry.l2_entries();
        let l1_size = l1_extra.min(1000);
        h.size = (l1_size * span).saturating_mul(size_frac) / 1000;
        let needed = Geometry::new(bits, h.has_extended_l2(), h.refcount_order, h.size).unwrap().l1_entries_needed();
        h.l1_size = needed.max(l1_size) as u32;
        h.l1_table_offset = l1_clusters * cs;
        h.refcount_table_clusters = rt_clusters.min((8 << 20) / cs as u32).max(1);
        h.refcount_table_offset = rt_at * cs;
        h.nb_snapshots = nb_snapshots;
        h.snapshots_offset = snap_at * cs;
        h.extensions = exts;
        // A LUKS image always has its encryption header pointer (QEMU refuses one without).
        if crypt == 2 && h.fde_pointer().is_none() {
            h.extensions.push(HeaderExtension::FullDiskEncryption(FdeHeaderPointer { offset: cs, length: 4096 }));
        }
        h.backing_file = backing;
        h
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 512, ..ProptestConfig::default() })]

    #[test]
    fn header_round_trips(h in header()) {
        let cs = h.cluster_size();
        match h.encode(cs) {
            Ok(bytes) => {
                prop_assert_eq!(bytes.len() as u64, cs);
                let decoded = Header::decode(&bytes).unwrap();
                let mut expected = h.clone();
                expected.backing_file_offset = decoded.backing_file_offset;
                expected.backing_file_size = decoded.backing_file_size;
                prop_assert_eq!(decoded.backing_file_size as usize, h.backing_file.as_ref().map_or(0, Vec::len));
                prop_assert_eq!(&decoded, &expected);
                prop_assert_eq!(decoded.encode(cs).unwrap(), bytes);
            }
            Err(FormatError::DoesNotFit { need, available, .. }) => prop_assert!(need > available),
            Err(e) => prop_assert!(false, "encode failed: {e}"),
        }
    }

    #[test]
    fn l1_entries_round_trip(bits in cluster_bits(), offset in prop_oneof![Just(0u64), host_offset(21)], copied in any::<bool>()) {
        let g = Geometry::new(bits, false, 4, 0).unwrap();
        let entry = L1Entry { l2_offset: (offset != 0).then_some(HostOffset(offset)), copied: copied && offset != 0 };
        let raw = entry.encode().unwrap();
        prop_assert_eq!(L1Entry::decode(raw, &g, 3, HostOffset(0x30000)).unwrap(), entry);
        let mut table = vec![0u8; 32];
        table[16..24].copy_from_slice(&raw.to_be_bytes());
        prop_assert_eq!(l1::entry_at(&table, 2), Some(raw));
    }

    #[test]
    fn standard_l2_entries_round_trip(bits in cluster_bits(), data_file in any::<bool>(), kind in 0u8..4,
            offset in host_offset(21), copied in any::<bool>(), sectors in any::<u64>(), coffset in any::<u64>()) {
        let g = Geometry::new(bits, false, 4, 1 << 30).unwrap().with_data_file(data_file);
        let entry = match kind {
            0 => L2Entry::Unallocated,
            1 => L2Entry::Zero { preallocated: (offset % 3 != 0).then_some(HostOffset(offset)), copied },
            2 => L2Entry::Normal { host: HostOffset(offset), copied },
            _ => {
                if data_file { L2Entry::Unallocated } else {
                    let shift = 62 - (bits - 8);
                    let max_off = (1u64 << shift).min(1 << 56);
                    L2Entry::Compressed(CompressedDescriptor {
                        host_offset: coffset % max_off,
                        additional_sectors: sectors % (1 << (bits - 8)),
                    })
                }
            }
        };
        let raw = entry.encode(&g).unwrap();
        prop_assert_eq!(L2Entry::decode(raw, &g, 7, HostOffset(0x50000)).unwrap(), entry);
        let mut table = vec![0u8; 64];
        prop_assert!(l2::set_entry_at(&mut table, 3, false, raw, 0));
        prop_assert_eq!(l2::entry_at(&table, 3, false), Some((raw, 0)));
    }

    #[test]
    fn extended_l2_entries_round_trip(bits in 14u32..=21, offset in host_offset(21), copied in any::<bool>(),
            alloc in any::<u32>(), zero in any::<u32>(), allocated in any::<bool>()) {
        let g = Geometry::new(bits, true, 4, 1 << 30).unwrap();
        let zero = zero & !alloc;
        let entry = if allocated {
            ExtendedL2Entry { entry: L2Entry::Normal { host: HostOffset(offset), copied }, alloc, zero }
        } else {
            ExtendedL2Entry { entry: L2Entry::Unallocated, alloc: 0, zero }
        };
        let (raw, bitmap) = entry.encode(&g).unwrap();
        let decoded = ExtendedL2Entry::decode(raw, bitmap, &g, 1, HostOffset(0x40000)).unwrap();
        prop_assert_eq!(decoded, entry);
        let mut covered = 0;
        for (start, state, len) in decoded.runs() {
            prop_assert_eq!(start, covered);
            for sc in start..start + len {
                prop_assert_eq!(decoded.state(sc), state);
                let expected = if entry.alloc & (1 << sc) != 0 { SubclusterState::Allocated }
                    else if entry.zero & (1 << sc) != 0 { SubclusterState::Zero } else { SubclusterState::Unallocated };
                prop_assert_eq!(state, expected);
            }
            if start + len < 32 {
                prop_assert_ne!(decoded.state(start + len), state, "runs are maximal");
            }
            covered += len;
        }
        prop_assert_eq!(covered, 32);
    }

    #[test]
    fn compressed_descriptors_round_trip_for_every_cluster_size(bits in cluster_bits(), offset in any::<u64>(), len in 1u64..(4 << 20)) {
        let shift = 62 - (bits - 8);
        let max_off = (1u64 << shift).min(1 << 56);
        let offset = offset % max_off;
        match CompressedDescriptor::for_range(offset, len, bits) {
            Ok(d) => {
                let raw = d.encode(bits).unwrap();
                let at = qcow2_format::Location::at(qcow2_format::Structure::L2Table, 0);
                prop_assert_eq!(CompressedDescriptor::decode(raw, bits, at).unwrap(), d);
                let (start, read_len) = d.byte_range();
                prop_assert_eq!(start, offset);
                prop_assert!(read_len >= len, "the read range covers the data");
                prop_assert!(read_len < len + 512, "and at most the rest of the last sector");
            }
            Err(_) => {
                let sectors = (offset + len - 1) / 512 - offset / 512;
                prop_assert!(sectors >= 1 << (bits - 8), "only too many sectors may fail");
            }
        }
    }

    #[test]
    fn refcounts_round_trip_at_every_order(order in 0u32..=6, block in proptest::collection::vec(any::<u8>(), 8..256),
            index in any::<usize>(), value in any::<u64>()) {
        let entries = refcount::entries_in(block.len(), order);
        let index = index % entries;
        let max = refcount::max_value(order).unwrap();
        let value = value & max;
        let mut b = block.clone();
        refcount::set(&mut b, order, index, value).unwrap();
        prop_assert_eq!(refcount::get(&b, order, index).unwrap(), value);
        for other in (0..entries).filter(|&i| i != index) {
            prop_assert_eq!(refcount::get(&b, order, other).unwrap(), refcount::get(&block, order, other).unwrap());
        }
    }

    #[test]
    fn refcount_table_entries_round_trip(bits in cluster_bits(), offset in prop_oneof![Just(0u64), (1u64..(1 << 40)).prop_map(|c| c << 21)]) {
        let g = Geometry::new(bits, false, 4, 0).unwrap();
        let e = RefcountTableEntry { block_offset: (offset != 0).then_some(HostOffset(offset)) };
        prop_assert_eq!(RefcountTableEntry::decode(e.encode().unwrap(), &g, 0, HostOffset(0x10000)).unwrap(), e);
    }

    #[test]
    fn snapshot_tables_round_trip(bits in cluster_bits(), entries in proptest::collection::vec(
            (1u64..1000, 0u32..1000, bytes(20), bytes(40), any::<u32>(), any::<u32>(), any::<u64>(), any::<u32>(), bytes(64)), 0..8)) {
        let entries: Vec<_> = entries.into_iter().map(|(l1c, l1_size, id, name, ds, dn, clock, vm32, extra)| SnapshotTableEntry {
            l1_table_offset: l1c << bits, l1_size, id, name, date_sec: ds, date_nsec: dn, vm_clock_nsec: clock,
            vm_state_size_32: vm32, extra_data: extra,
        }).collect();
        let bytes = snapshot::encode_table(&entries).unwrap();
        prop_assert_eq!(bytes.len() % 8, 0);
        let decoded = snapshot::decode_table(&bytes, 0x20000, entries.len() as u32).unwrap();
        prop_assert_eq!(&decoded, &entries);
        prop_assert_eq!(snapshot::encode_table(&decoded).unwrap(), bytes);
    }

    #[test]
    fn bitmap_directories_round_trip(bits in cluster_bits(), entries in proptest::collection::vec(
            (1u64..1000, 1u32..10_000, 0u32..8, 9u8..=31, bytes(30), bytes(40)), 1..8)) {
        let g = Geometry::new(bits, false, 4, 0).unwrap();
        let entries: Vec<_> = entries.into_iter().enumerate().map(|(i, (tc, size, flags, gran, mut name, extra))| {
            name.extend_from_slice(format!("#{i}").as_bytes()); // unique, non-empty
            BitmapDirectoryEntry { table_offset: tc << bits, table_size: size, flags, bitmap_type: 1,
                granularity_bits: gran, name, extra_data: extra }
        }).collect();
        let dir = bitmap::encode_directory(&entries).unwrap();
        let ext = BitmapsExtension { nb_bitmaps: entries.len() as u32, reserved: 0, directory_size: dir.len() as u64, directory_offset: 1 << bits };
        ext.validate(1 << bits, qcow2_format::Location::at(qcow2_format::Structure::BitmapsExtension, 0)).unwrap();
        prop_assert_eq!(BitmapsExtension::decode(&ext.encode(), qcow2_format::Location::at(qcow2_format::Structure::BitmapsExtension, 0)).unwrap(), ext);
        let decoded = bitmap::decode_directory(&dir, &ext, &g).unwrap();
        prop_assert_eq!(&decoded, &entries);
        prop_assert_eq!(bitmap::encode_directory(&decoded).unwrap(), dir);
    }

    #[test]
    fn bitmap_table_entries_round_trip(bits in cluster_bits(), kind in 0u8..3, offset in host_offset(21)) {
        let g = Geometry::new(bits, false, 4, 0).unwrap();
        let e = match kind { 0 => BitmapTableEntry::Zeros, 1 => BitmapTableEntry::Ones, _ => BitmapTableEntry::Cluster(HostOffset(offset)) };
        prop_assert_eq!(BitmapTableEntry::decode(e.encode().unwrap(), &g, 0, HostOffset(0x10000)).unwrap(), e);
    }

    #[test]
    fn geometry_indices_recompose_the_offset(bits in cluster_bits(), extended in any::<bool>(), order in 0u32..=6, offset in any::<u64>()) {
        let Ok(g) = Geometry::new(bits, extended, order, u64::MAX) else { return Ok(()); };
        let o = GuestOffset(offset);
        let rebuilt = (g.l1_index(o).0 << (bits + g.l2_bits())) | ((g.l2_index(o) as u64) << bits) | g.offset_in_cluster(offset);
        prop_assert_eq!(rebuilt, offset);
        prop_assert!(g.subcluster_index(o) < g.subclusters_per_cluster());
        prop_assert_eq!(
            u64::from(g.subcluster_index(o)) * g.subcluster_size() + g.offset_in_subcluster(offset),
            g.offset_in_cluster(offset)
        );
        let h = HostOffset(offset);
        let rebuilt = (g.refcount_table_index(h) << (bits + g.refcount_block_bits()))
            | ((g.refcount_block_index(h) as u64) << bits) | g.offset_in_cluster(offset);
        prop_assert_eq!(rebuilt, offset);
    }

    #[test]
    fn feature_names_come_from_the_table_first(bit in 0u32..64) {
        let mut h = Header::new(3, 16, 0);
        let table = FeatureNameTable { entries: vec![FeatureNameEntry::new(FeatureKind::Incompatible, bit as u8, "custom")], trailing: vec![] };
        h.extensions.push(HeaderExtension::FeatureNameTable(table));
        prop_assert_eq!(h.feature_name(FeatureKind::Incompatible, bit), Some("custom".to_owned()));
        prop_assert_eq!(
            h.feature_name(FeatureKind::Compatible, bit),
            features::known_feature_name(FeatureKind::Compatible, bit).map(str::to_owned)
        );
    }
}
