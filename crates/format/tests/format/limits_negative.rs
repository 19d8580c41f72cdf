//! Table-driven negative tests: every sanity limit, reserved bit and invalid subcluster
//! combination is refused with the error that names it.

use qcow2_format::bitmap::{self, BitmapDirectoryEntry, BitmapTableEntry, BitmapsExtension};
use qcow2_format::extensions::{FeatureNameEntry, FeatureNameTable, HeaderExtension};
use qcow2_format::features::{self, FeatureKind};
use qcow2_format::header::Strictness;
use qcow2_format::snapshot::{
    self, SnapshotEntrySizes, SnapshotL1Problem, SnapshotTableCursor, SnapshotTableEntry,
};
use qcow2_format::{
    refcount, CompressedDescriptor, ExtendedL2Entry, FormatError, Geometry, Header, HostOffset,
    L1Entry, L2Entry, Location, RefcountTableEntry, Structure,
};

const CS: u64 = 65536;

/// A valid version 3 header with 64 KiB clusters and a 1 GiB disk.
fn base() -> Header {
    let mut h = Header::new(3, 16, 1 << 30);
    h.l1_size = 2;
    h.l1_table_offset = 3 * CS;
    h.refcount_table_offset = CS;
    h.refcount_table_clusters = 1;
    h
}

fn put32(b: &mut [u8], at: usize, v: u32) {
    b[at..at + 4].copy_from_slice(&v.to_be_bytes());
}

fn put64(b: &mut [u8], at: usize, v: u64) {
    b[at..at + 8].copy_from_slice(&v.to_be_bytes());
}

/// Which field an error names, for checking that the right check fired.
fn field_of(e: &FormatError) -> &'static str {
    match e {
        FormatError::InvalidValue { field, .. }
        | FormatError::LimitExceeded { field, .. }
        | FormatError::ReservedBits { field, .. }
        | FormatError::Unaligned { field, .. } => field,
        FormatError::Truncated { what, .. } | FormatError::Overflow { what, .. } => what,
        FormatError::DoesNotFit { what, .. } => what,
        FormatError::BadMagic { .. } => "magic",
        FormatError::InvalidSubclusters { .. } => "subclusters",
        FormatError::UnsupportedIncompatibleFeatures { .. } => "incompatible_features",
        FormatError::Inconsistent { .. } => "inconsistent",
        FormatError::RefcountTooLarge { .. } => "refcount value",
        FormatError::RefcountIndex { .. } => "refcount index",
        FormatError::SnapshotTableTooBig { .. } => "snapshot table size",
        FormatError::MissingCryptoHeader { .. } => "crypt_method",
    }
}

type Patch = fn(&mut Header, &mut Vec<u8>);

/// One negative case: a name, a change that breaks a valid value, the field the error names.
type Case<T> = (&'static str, fn(&mut T), &'static str);

/// Cases that break a field of the fixed header: magic, version, cluster size, header
/// length, backing name, compression, feature bits, refcount order, encryption method.
fn field_cases() -> Vec<(&'static str, Patch, &'static str)> {
    vec![
        ("bad magic", |_, b| put32(b, 0, 0x5146_49fa), "magic"),
        ("version 1", |_, b| put32(b, 4, 1), "version"),
        ("version 4", |_, b| put32(b, 4, 4), "version"),
        ("cluster_bits 8", |_, b| put32(b, 20, 8), "cluster_bits"),
        ("cluster_bits 22", |_, b| put32(b, 20, 22), "cluster_bits"),
        (
            "header_length 103",
            |_, b| put32(b, 100, 103),
            "header_length",
        ),
        (
            "header_length past the cluster",
            |_, b| put32(b, 100, 65544),
            "header_length",
        ),
        (
            "backing_file_offset past the cluster",
            |_, b| put64(b, 8, CS + 8),
            "backing_file_offset",
        ),
        (
            "backing name of 1024 bytes",
            |_, b| {
                put64(b, 8, 4096);
                put32(b, 16, 1024);
            },
            "backing_file_size",
        ),
        (
            "backing name past the cluster end",
            |_, b| {
                put64(b, 8, CS - 10);
                put32(b, 16, 11);
            },
            "backing_file_size",
        ),
        ("compression_type 2", |_, b| b[104] = 2, "compression_type"),
        (
            "zstd without its feature bit",
            |_, b| b[104] = 1,
            "inconsistent",
        ),
        (
            "compression bit with zlib",
            |_, b| put64(b, 72, features::INCOMPAT_COMPRESSION),
            "inconsistent",
        ),
        (
            "unknown incompatible bit",
            |_, b| put64(b, 72, 1 << 5),
            "incompatible_features",
        ),
        (
            "extended L2 with 8 KiB clusters",
            |_, b| {
                put32(b, 20, 13);
                put64(b, 72, features::INCOMPAT_EXTENDED_L2);
            },
            "cluster_bits",
        ),
        ("refcount_order 7", |_, b| put32(b, 96, 7), "refcount_order"),
        ("crypt_method 3", |_, b| put32(b, 32, 3), "crypt_method"),
    ]
}

/// Cases that break where the tables lie, or the disk's size.
fn layout_cases() -> Vec<(&'static str, Patch, &'static str)> {
    vec![
        (
            "no refcount table",
            |_, b| put32(b, 56, 0),
            "refcount_table_clusters",
        ),
        (
            "refcount table over 8 MiB",
            |_, b| put32(b, 56, 129),
            "refcount_table_clusters",
        ),
        (
            "refcount table unaligned",
            |_, b| put64(b, 48, CS + 512),
            "refcount_table_offset",
        ),
        (
            "refcount table past 2^63",
            |_, b| put64(b, 48, (i64::MAX as u64) & !(CS - 1)),
            "refcount_table_offset",
        ),
        (
            "65537 snapshots",
            |_, b| put32(b, 60, 65_537),
            "nb_snapshots",
        ),
        (
            "snapshot table unaligned",
            |_, b| put64(b, 64, 4096),
            "snapshots_offset",
        ),
        (
            "L1 table over 32 MiB",
            |_, b| put32(b, 36, (4 << 20) + 1),
            "l1_size",
        ),
        (
            "L1 table unaligned",
            |_, b| put64(b, 40, 3 * CS + 8),
            "l1_table_offset",
        ),
        (
            "L1 table too small for the disk",
            |_, b| put32(b, 36, 1),
            "l1_size",
        ),
        (
            "disk too big for QEMU's L1 index",
            |_, b| {
                put32(b, 20, 9);
                put64(b, 24, 1 << 62);
                put32(b, 36, 0);
                put64(b, 40, 0);
                put64(b, 48, 512);
            },
            "size",
        ),
    ]
}

/// Cases that break the header's size or its extension area.
fn extension_cases() -> Vec<(&'static str, Patch, &'static str)> {
    vec![
        (
            "raw data file bit without a data file",
            |_, b| put64(b, 88, features::AUTOCLEAR_DATA_FILE_RAW),
            "inconsistent",
        ),
        (
            "truncated v3 header",
            |_, b| b.truncate(90),
            "version 3 header",
        ),
        ("truncated v2 header", |_, b| b.truncate(40), "header"),
        (
            "extension longer than the area",
            |_, b| {
                put32(b, 112, 0x1234_5678);
                put32(b, 116, 70_000);
            },
            "extension length",
        ),
        (
            "end marker with a length past the area",
            |_, b| {
                put32(b, 112, 0);
                put32(b, 116, 70_000);
            },
            "extension length",
        ),
        (
            "backing format of 16 bytes",
            |h, b| {
                h.extensions = vec![HeaderExtension::BackingFormat(b"0123456789abcdef".to_vec())];
                *b = h.encode(CS).unwrap();
            },
            "backing format name length",
        ),
        (
            "encryption header pointer without LUKS",
            |_, b| {
                put32(b, 112, 0x0537_be77);
                put32(b, 116, 16);
            },
            "inconsistent",
        ),
        (
            "encryption header pointer of 8 bytes",
            |_, b| {
                put32(b, 32, 2);
                put32(b, 112, 0x0537_be77);
                put32(b, 116, 8);
            },
            "encryption header pointer length",
        ),
        (
            "encryption header unaligned",
            |_, b| {
                put32(b, 32, 2);
                put32(b, 112, 0x0537_be77);
                put32(b, 116, 16);
                put64(b, 120, 4096);
            },
            "encryption header offset",
        ),
    ]
}

#[test]
fn header_limits_are_enforced() {
    let cases: Vec<_> = field_cases()
        .into_iter()
        .chain(layout_cases())
        .chain(extension_cases())
        .collect();
    for (name, patch, field) in &cases {
        let mut h = base();
        let mut bytes = h.encode(CS).unwrap();
        Header::decode(&bytes)
            .unwrap_or_else(|e| panic!("{name}: the base header must be valid: {e}"));
        patch(&mut h, &mut bytes);
        match Header::decode(&bytes) {
            Ok(_) => panic!("{name}: accepted"),
            Err(e) => assert_eq!(field_of(&e), *field, "{name}: wrong error: {e}"),
        }
    }
}

#[test]
fn bitmaps_extension_limits_apply_only_when_consistent() {
    let valid = BitmapsExtension {
        nb_bitmaps: 1,
        reserved: 0,
        directory_size: 32,
        directory_offset: 4 * CS,
    };
    let cases: &[Case<BitmapsExtension>] = &[
        ("reserved field", |e| e.reserved = 1, "bitmaps extension"),
        ("no bitmaps", |e| e.nb_bitmaps = 0, "nb_bitmaps"),
        ("65536 bitmaps", |e| e.nb_bitmaps = 65_536, "nb_bitmaps"),
        (
            "directory unaligned",
            |e| e.directory_offset = 4 * CS + 8,
            "bitmap_directory_offset",
        ),
        (
            "directory over 64 MiB",
            |e| e.directory_size = 1024 * 65_535 + 1,
            "bitmap_directory_size",
        ),
        (
            "empty directory",
            |e| e.directory_size = 0,
            "bitmap_directory_size",
        ),
    ];
    for (name, patch, field) in cases {
        let mut ext = valid;
        patch(&mut ext);
        let mut h = base();
        h.extensions = vec![HeaderExtension::Bitmaps(ext)];
        // Without the autoclear bit QEMU ignores the extension, so must we.
        Header::decode(&h.encode(CS).unwrap())
            .unwrap_or_else(|e| panic!("{name}: inconsistent ext refused: {e}"));
        h.autoclear_features = features::AUTOCLEAR_BITMAPS;
        let err = Header::decode(&h.encode(CS).unwrap()).expect_err(name);
        assert_eq!(field_of(&err), *field, "{name}: wrong error: {err}");
    }
    let mut bytes = base().encode(CS).unwrap();
    put32(&mut bytes, 112, 0x2385_2875);
    put32(&mut bytes, 116, 23);
    let err = Header::decode(&bytes).unwrap_err();
    assert_eq!(field_of(&err), "bitmaps extension length");
}

#[test]
fn unknown_incompatible_bits_are_named_from_the_feature_table() {
    let mut h = base();
    h.extensions = vec![HeaderExtension::FeatureNameTable(FeatureNameTable {
        entries: vec![FeatureNameEntry::new(
            FeatureKind::Incompatible,
            9,
            "time travel",
        )],
        trailing: vec![],
    })];
    let mut bytes = h.encode(CS).unwrap();
    put64(
        &mut bytes,
        72,
        (1 << 9) | (1 << 40) | features::INCOMPAT_DIRTY,
    );
    let err = Header::decode(&bytes).unwrap_err();
    let FormatError::UnsupportedIncompatibleFeatures { features } = &err else {
        panic!("{err}")
    };
    assert_eq!(features.len(), 2);
    assert_eq!(
        (features[0].bit, features[0].name.as_deref()),
        (9, Some("time travel"))
    );
    assert_eq!((features[1].bit, features[1].name.as_deref()), (40, None));
    assert!(err.to_string().contains("bit 9 (time travel)"), "{err}");
}

fn g(bits: u32, extended: bool) -> Geometry {
    Geometry::new(bits, extended, 4, 1 << 30).unwrap()
}

#[test]
fn l1_reserved_bits_and_alignment() {
    let geometry = g(16, false);
    for bit in (0..9).chain(56..63) {
        let raw = 0x50000 | (1u64 << bit);
        let err = L1Entry::decode(raw, &geometry, 4, HostOffset(0x30000)).unwrap_err();
        assert!(
            matches!(err, FormatError::ReservedBits { bits, .. } if bits == 1 << bit),
            "bit {bit}: {err}"
        );
        assert!(
            err.to_string()
                .starts_with("L1 table at 0x30000: entry 4: "),
            "{err}"
        );
    }
    let err = L1Entry::decode(0x50200, &geometry, 0, HostOffset(0)).unwrap_err();
    assert_eq!(field_of(&err), "L2 table offset");
    let err = L1Entry::decode(1 << 63, &geometry, 0, HostOffset(0)).unwrap_err();
    assert_eq!(field_of(&err), "L1 entry");
}

#[test]
fn standard_l2_reserved_bits_and_invalid_combinations() {
    let geometry = g(16, false);
    let at = HostOffset(0x50000);
    for bit in (1..9).chain(56..62) {
        let err = L2Entry::decode(0x70000 | (1u64 << bit), &geometry, 17, at).unwrap_err();
        assert!(
            matches!(err, FormatError::ReservedBits { .. }),
            "bit {bit}: {err}"
        );
        assert!(
            err.to_string()
                .starts_with("L2 table at 0x50000: entry 17: "),
            "{err}"
        );
    }
    let cases: &[(&str, u64, Geometry, &str)] = &[
        (
            "unaligned host offset",
            0x70200,
            geometry,
            "host cluster offset",
        ),
        (
            "COPIED on an unallocated cluster",
            1 << 63,
            geometry,
            "L2 entry",
        ),
        (
            "COPIED on a compressed cluster",
            (1 << 63) | (1 << 62) | 0x1234,
            geometry,
            "L2 entry",
        ),
        (
            "compressed with a data file",
            (1 << 62) | 0x1234,
            geometry.with_data_file(true),
            "L2 entry",
        ),
        (
            "compressed offset bits above 55",
            (1 << 62) | (1 << 57),
            g(9, false),
            "compressed cluster offset",
        ),
    ];
    for (name, raw, geometry, field) in cases {
        let err = L2Entry::decode(*raw, geometry, 0, at).expect_err(name);
        assert_eq!(field_of(&err), *field, "{name}: {err}");
    }
    // Host offset 0 with COPIED is a real cluster only in an external data file.
    let with_data_file = geometry.with_data_file(true);
    assert_eq!(
        L2Entry::decode(1 << 63, &with_data_file, 0, at).unwrap(),
        L2Entry::Normal {
            host: HostOffset(0),
            copied: true
        }
    );
}

#[test]
fn extended_l2_invalid_subcluster_combinations() {
    let geometry = g(16, true);
    let at = HostOffset(0x50000);
    let normal = (1u64 << 63) | 0x70000;
    let cases: &[(&str, u64, u64)] = &[
        (
            "a subcluster both allocated and zero",
            normal,
            (1 << 35) | (1 << 3),
        ),
        ("allocated subclusters without a host offset", 0, 1),
        (
            "a bitmap on a compressed cluster",
            (1 << 62) | 0x1234,
            1 << 40,
        ),
    ];
    for (name, raw, bitmap) in cases {
        let err = ExtendedL2Entry::decode(*raw, *bitmap, &geometry, 2, at).expect_err(name);
        assert!(
            matches!(err, FormatError::InvalidSubclusters { .. }),
            "{name}: {err}"
        );
    }
    let err = ExtendedL2Entry::decode(normal | 1, 0, &geometry, 2, at).unwrap_err();
    assert!(
        matches!(err, FormatError::ReservedBits { bits: 1, .. }),
        "zero flag is reserved: {err}"
    );
    // Zero subclusters with no host offset are fine (they read as zeros).
    assert!(ExtendedL2Entry::decode(0, u64::from(u32::MAX) << 32, &geometry, 2, at).is_ok());
}

#[test]
fn refcount_widths_refuse_values_that_do_not_fit() {
    let mut block = vec![0u8; 64];
    for order in 0..=5u32 {
        let max = refcount::max_value(order).unwrap();
        assert!(matches!(
            refcount::set(&mut block, order, 1, max + 1),
            Err(FormatError::RefcountTooLarge { bits, .. }) if bits == 1 << order
        ));
        let entries = refcount::entries_in(block.len(), order);
        assert_eq!(entries, (64 * 8) >> order);
        assert!(refcount::get(&block, order, entries).is_err());
    }
    assert!(refcount::get(&block, 7, 0).is_err());
    let geometry = g(16, false);
    let err =
        RefcountTableEntry::decode(0x70000 | 0x100, &geometry, 0, HostOffset(CS)).unwrap_err();
    assert!(matches!(err, FormatError::ReservedBits { .. }), "{err}");
    let err = RefcountTableEntry::decode(0x70200 & !0x1ff | 0x1000, &geometry, 0, HostOffset(CS))
        .unwrap_err();
    assert_eq!(field_of(&err), "refcount block offset");
}

fn snapshot_entry() -> SnapshotTableEntry {
    SnapshotTableEntry {
        l1_table_offset: 5 * CS,
        l1_size: 2,
        id: b"1".to_vec(),
        name: b"snap".to_vec(),
        date_sec: 1,
        date_nsec: 2,
        vm_clock_nsec: 3,
        vm_state_size_32: 0,
        extra_data: vec![0; 24],
    }
}

#[test]
fn snapshot_table_limits() {
    let mut bytes = Vec::new();
    snapshot_entry().encode(&mut bytes).unwrap();
    assert!(snapshot::decode_table(&bytes, CS, 1).is_ok());

    let cases: &[Case<Vec<u8>>] = &[
        (
            "1025 bytes of extra data",
            |b| put32(b, 36, 1025),
            "extra_data_size",
        ),
        ("entry cut short", |b| b.truncate(66), "snapshot name"),
        (
            "name length past the table",
            |b| b[15] = 200,
            "snapshot name",
        ),
    ];
    for (name, patch, field) in cases {
        let mut b = bytes.clone();
        patch(&mut b);
        let err = snapshot::decode_table(&b, CS, 1).expect_err(name);
        assert_eq!(field_of(&err), *field, "{name}: {err}");
    }
    let err = snapshot::decode_table(&bytes, CS, 65_537).unwrap_err();
    assert_eq!(field_of(&err), "nb_snapshots");
    let mut cursor = SnapshotTableCursor::new(CS);
    cursor.advance(64 << 20).unwrap();
    let err = cursor.advance(8).unwrap_err();
    assert_eq!(field_of(&err), "snapshot table size");
    let mut big = snapshot_entry();
    big.extra_data = vec![0; 1025];
    assert!(big.encode(&mut Vec::new()).is_err());
}

/// QEMU opens an image whatever its snapshots' L1 tables look like (iotest 080) and judges
/// one only when it is used, in its own words: an entry decodes, and says what QEMU finds.
#[test]
fn snapshot_l1_tables_are_judged_apart_from_their_entries() {
    let cases: &[(&str, u64, u32, Option<SnapshotL1Problem>)] = &[
        ("fine", 5 * CS, 2, None),
        ("empty at 0", 0, 0, None),
        (
            "unaligned",
            5 * CS + 512,
            2,
            Some(SnapshotL1Problem::OffsetInvalid),
        ),
        ("32 MiB", 5 * CS, 4 << 20, None),
        (
            "over 32 MiB",
            5 * CS,
            (4 << 20) + 1,
            Some(SnapshotL1Problem::TooLarge),
        ),
        // Both wrong: QEMU names the size first.
        (
            "both",
            5 * CS + 512,
            u32::MAX,
            Some(SnapshotL1Problem::TooLarge),
        ),
        (
            "ends past 2^63",
            (1 << 63) - CS,
            8192,
            Some(SnapshotL1Problem::OffsetInvalid),
        ),
    ];
    for &(name, offset, size, want) in cases {
        let mut entry = snapshot_entry();
        entry.l1_table_offset = offset;
        entry.l1_size = size;
        let mut bytes = Vec::new();
        entry.encode(&mut bytes).unwrap();
        let (decoded, _) = SnapshotTableEntry::decode(&bytes, CS, 0).expect(name);
        assert_eq!(decoded, entry, "{name}");
        assert_eq!(decoded.l1_table_problem(CS), want, "{name}");
    }
    assert_eq!(
        SnapshotL1Problem::OffsetInvalid.to_string(),
        "Snapshot L1 table offset invalid"
    );
    assert_eq!(
        SnapshotL1Problem::TooLarge.to_string(),
        "Snapshot L1 table too large"
    );
}

#[test]
fn a_check_decodes_snapshot_entries_an_open_refuses() {
    let mut bytes = Vec::new();
    snapshot_entry().encode(&mut bytes).unwrap();

    // 2000 bytes of extra data: an open refuses the entry; a check keeps QEMU's 1 KiB of it,
    // which is all its buffer holds before the ID and name.
    let mut fixed = bytes[..40].to_vec();
    put32(&mut fixed, 36, 2000);
    let at = Location::entry(Structure::SnapshotTable, CS, 0);
    let sizes = SnapshotEntrySizes::decode(&fixed, at).unwrap();
    assert_eq!((sizes.extra_data, sizes.id, sizes.name), (2000, 1, 4));
    assert!(sizes.extra_data_too_large());
    assert_eq!(sizes.kept_extra_data(Strictness::Open), 2000);
    assert_eq!(sizes.kept_extra_data(Strictness::Check), 1024);
    let kept: Vec<u8> = (0..1024).map(|i| i as u8).collect();
    let buf = [&fixed[..], &kept, b"1", b"snap"].concat();
    let err = SnapshotTableEntry::entry_len(&buf, at).unwrap_err();
    assert_eq!(field_of(&err), "extra_data_size");
    let err = SnapshotTableEntry::decode_with(&buf, CS, 0, Strictness::Open).unwrap_err();
    assert_eq!(field_of(&err), "extra_data_size");
    let (decoded, len) = SnapshotTableEntry::decode_with(&buf, CS, 0, Strictness::Check).unwrap();
    assert_eq!(decoded.extra_data, kept);
    assert_eq!(
        (&decoded.id[..], &decoded.name[..]),
        (&b"1"[..], &b"snap"[..])
    );
    assert_eq!(len, buf.len().next_multiple_of(8));
}

fn bitmap_entry(name: &str) -> BitmapDirectoryEntry {
    BitmapDirectoryEntry {
        table_offset: 6 * CS,
        table_size: 1,
        flags: bitmap::FLAG_AUTO,
        bitmap_type: bitmap::TYPE_DIRTY_TRACKING,
        granularity_bits: 16,
        name: name.as_bytes().to_vec(),
        extra_data: vec![],
    }
}

#[test]
fn bitmap_directory_limits() {
    let geometry = g(16, false);
    let ext_for = |dir: &[u8], nb: u32| BitmapsExtension {
        nb_bitmaps: nb,
        reserved: 0,
        directory_size: dir.len() as u64,
        directory_offset: 4 * CS,
    };
    let cases: &[Case<BitmapDirectoryEntry>] = &[
        (
            "empty bitmap table",
            |e| e.table_size = 0,
            "bitmap_table_size",
        ),
        (
            "bitmap table too large",
            |e| e.table_size = 0x0800_0001,
            "bitmap_table_size",
        ),
        (
            "bitmap table at 0",
            |e| e.table_offset = 0,
            "bitmap_table_offset",
        ),
        (
            "bitmap table unaligned",
            |e| e.table_offset = 6 * CS + 512,
            "bitmap_table_offset",
        ),
        (
            "granularity 2^8",
            |e| e.granularity_bits = 8,
            "granularity_bits",
        ),
        (
            "granularity 2^32",
            |e| e.granularity_bits = 32,
            "granularity_bits",
        ),
        ("reserved flag", |e| e.flags |= 1 << 3, "flags"),
        ("empty name", |e| e.name.clear(), "name_size"),
        ("1024-byte name", |e| e.name = vec![b'n'; 1024], "name_size"),
        ("type 2", |e| e.bitmap_type = 2, "type"),
    ];
    for (name, patch, field) in cases {
        let mut entry = bitmap_entry("b");
        patch(&mut entry);
        let dir = bitmap::encode_directory(&[entry]).unwrap();
        let err = bitmap::decode_directory(&dir, &ext_for(&dir, 1), &geometry).expect_err(name);
        assert_eq!(field_of(&err), *field, "{name}: {err}");
    }
    let two = bitmap::encode_directory(&[bitmap_entry("a"), bitmap_entry("a")]).unwrap();
    assert_eq!(
        field_of(&bitmap::decode_directory(&two, &ext_for(&two, 2), &geometry).unwrap_err()),
        "inconsistent"
    );
    let two = bitmap::encode_directory(&[bitmap_entry("a"), bitmap_entry("b")]).unwrap();
    assert_eq!(
        field_of(&bitmap::decode_directory(&two, &ext_for(&two, 1), &geometry).unwrap_err()),
        "inconsistent"
    );
    assert_eq!(
        field_of(&bitmap::decode_directory(&two, &ext_for(&two, 3), &geometry).unwrap_err()),
        "inconsistent"
    );
    let mut padded = bitmap::encode_directory(&[bitmap_entry("a")]).unwrap();
    *padded.last_mut().unwrap() = 1;
    assert_eq!(
        field_of(&bitmap::decode_directory(&padded, &ext_for(&padded, 1), &geometry).unwrap_err()),
        "padding"
    );
    let short = &two[..30];
    let err = bitmap::decode_directory(short, &ext_for(&two, 2), &geometry).unwrap_err();
    assert!(matches!(err, FormatError::Truncated { .. }), "{err}");

    let at = HostOffset(6 * CS);
    for raw in [1u64 << 60, 0x70000 | 2, 0x70000 | 1] {
        let err = BitmapTableEntry::decode(raw, &geometry, 0, at).unwrap_err();
        assert!(
            matches!(err, FormatError::ReservedBits { .. }),
            "{raw:#x}: {err}"
        );
    }
    assert_eq!(
        field_of(&BitmapTableEntry::decode(0x70200, &geometry, 0, at).unwrap_err()),
        "bitmap data offset"
    );
}

#[test]
fn compressed_descriptors_refuse_what_does_not_fit() {
    // 512-byte clusters leave one bit of sector count: at most two sectors.
    assert!(CompressedDescriptor::for_range(0, 1024, 9).is_ok());
    assert!(CompressedDescriptor::for_range(1, 1024, 9).is_err());
    assert!(CompressedDescriptor::for_range(0, 4 << 20, 21).is_ok());
    assert!(CompressedDescriptor::for_range(1 << 49, 512, 21).is_err());
    assert!(CompressedDescriptor::for_range(0, 512, 8).is_err());
    let at = Location::at(Structure::L2Table, 0);
    assert!(CompressedDescriptor::decode(0, 22, at).is_err());
}

#[test]
fn header_encode_refuses_what_does_not_fit_or_contradicts_the_version() {
    let mut h = base();
    h.backing_file = Some(vec![b'x'; 1023]);
    assert!(h.encode(CS).is_ok());
    assert!(matches!(
        h.encode(1024),
        Err(FormatError::DoesNotFit { .. })
    ));
    h.backing_file = Some(vec![b'x'; 1024]);
    assert!(h.encode(CS).is_err());
    let mut v2 = Header::new(2, 16, 0);
    v2.incompatible_features = features::INCOMPAT_DIRTY;
    assert!(v2.encode(CS).is_err());
    let mut short = base();
    short.header_length = 104;
    assert!(
        short.encode(CS).is_err(),
        "the 7-byte tail contradicts header_length 104"
    );
}

/// QEMU's rule for a bitmap table's size against the disk: its data is at most 512 MiB, and a
/// bitmap saved cleanly covers the whole disk; one left in use may be short (not saved after
/// a resize). The file's length plays no part.
#[test]
fn bitmap_table_size_against_the_disk() {
    let at = Location::at(Structure::BitmapDirectory, 0);
    let two_mib = 2u64 << 20;
    let entry = |table_size: u32, granularity_bits: u8, flags: u32| BitmapDirectoryEntry {
        table_size,
        granularity_bits,
        flags,
        ..bitmap_entry("b")
    };
    // 2 TiB at 512 bytes a bit is 512 MiB of data: 256 table entries of 2 MiB clusters.
    let largest = entry(256, 9, bitmap::FLAG_AUTO);
    largest.check_table_size(2 << 40, two_mib, at).unwrap();
    let err = entry(257, 9, bitmap::FLAG_AUTO)
        .check_table_size(2 << 40, two_mib, at)
        .unwrap_err();
    assert!(matches!(err, FormatError::LimitExceeded { .. }), "{err}");
    // One entry of 64 KiB clusters at 64 KiB a bit covers 32 GiB.
    entry(1, 16, 0).check_table_size(32 << 30, CS, at).unwrap();
    let short = entry(1, 16, 0).check_table_size((32 << 30) + 512, CS, at);
    assert_eq!(field_of(&short.unwrap_err()), "bitmap_table_size");
    entry(1, 16, bitmap::FLAG_IN_USE)
        .check_table_size(64 << 30, CS, at)
        .unwrap();
}
