//! The header's in-place field updates, backing name changes and decode strictness, on a
//! real encoded first cluster.

use super::*;
use crate::extensions::HeaderExtension;
use crate::features;

/// A valid 64 KiB-cluster version 3 header, encoded into its first cluster.
fn image() -> (Header, Vec<u8>) {
    let mut h = Header::new(3, 16, 1 << 30);
    h.l1_size = 16;
    h.l1_table_offset = 3 << 16;
    h.refcount_table_offset = 1 << 16;
    h.refcount_table_clusters = 1;
    let mut buf = h.encode(1 << 16).expect("encodes");
    buf.resize(1 << 16, 0);
    (Header::decode(&buf).expect("decodes"), buf)
}

fn apply<const N: usize>(buf: &mut [u8], u: FieldUpdate<N>) {
    let at = usize::try_from(u.offset).expect("small");
    buf[at..at + N].copy_from_slice(&u.bytes);
}

#[test]
fn field_updates_change_exactly_their_fields() {
    let (before, mut buf) = image();
    apply(&mut buf, size_update(2 << 30));
    apply(&mut buf, l1_update(32, 5 << 16));
    apply(&mut buf, reftable_update(7 << 16, 2));
    apply(&mut buf, snapshots_update(0, 9 << 16));
    apply(&mut buf, incompatible_update(features::INCOMPAT_DIRTY));
    apply(&mut buf, autoclear_update(0));
    let after = Header::decode(&buf).expect("still valid");
    let mut expected = before.clone();
    expected.size = 2 << 30;
    expected.l1_size = 32;
    expected.l1_table_offset = 5 << 16;
    expected.refcount_table_offset = 7 << 16;
    expected.refcount_table_clusters = 2;
    expected.snapshots_offset = 9 << 16;
    expected.incompatible_features = features::INCOMPAT_DIRTY;
    assert_eq!(after, expected);
    apply(&mut buf, nb_snapshots_update(3));
    let h = Header::decode_with(&buf, Strictness::Check).expect("check strictness");
    assert_eq!(h.nb_snapshots, 3);
}

#[test]
fn backing_file_and_format_are_replaced_together() {
    let (mut h, _) = image();
    h.set_backing(Some(b"base.qcow2".to_vec()), Some(b"qcow2".to_vec()));
    let buf = h.encode(1 << 16).expect("encodes");
    let back = Header::decode(&buf).expect("decodes");
    assert_eq!(back.backing_file.as_deref(), Some(&b"base.qcow2"[..]));
    assert_eq!(back.backing_format(), Some(&b"qcow2"[..]));
    let mut h = back;
    h.set_backing(Some(b"other.raw".to_vec()), Some(b"raw".to_vec()));
    let back = Header::decode(&h.encode(1 << 16).expect("encodes")).expect("decodes");
    assert_eq!(back.backing_file.as_deref(), Some(&b"other.raw"[..]));
    assert_eq!(back.backing_format(), Some(&b"raw"[..]));
    let mut h = back;
    h.set_backing(None, Some(b"raw".to_vec()));
    let back = Header::decode(&h.encode(1 << 16).expect("encodes")).expect("decodes");
    assert_eq!(
        (back.backing_file.as_deref(), back.backing_format()),
        (None, None)
    );
    let mut h = Header::new(3, 9, 1 << 20);
    h.set_backing(Some(vec![b'x'; 1023]), Some(b"qcow2".to_vec()));
    assert!(
        h.encode(512).is_err(),
        "a name that does not fit the first cluster is refused"
    );
}

#[test]
fn active_disk_update_switches_size_and_l1_together() {
    let (before, mut buf) = image();
    apply(&mut buf, active_disk_update(3 << 30, 0, 48, 6 << 16));
    let after = Header::decode(&buf).expect("still valid");
    let mut expected = before;
    expected.size = 3 << 30;
    expected.l1_size = 48;
    expected.l1_table_offset = 6 << 16;
    assert_eq!(after, expected);
}

#[test]
fn emptied_tables_update_moves_l1_and_refcount_tables_only() {
    let (before, mut buf) = image();
    apply(&mut buf, emptied_tables_update(9 << 16, 4 << 16, 2));
    let after = Header::decode(&buf).expect("still valid");
    let mut expected = before;
    expected.l1_table_offset = 9 << 16;
    expected.refcount_table_offset = 4 << 16;
    expected.refcount_table_clusters = 2;
    assert_eq!(after, expected, "l1_size and nb_snapshots around them stay");
}

#[test]
fn refcount_structure_update_keeps_the_fields_between() {
    let (mut before, mut buf) = image();
    before.compatible_features = features::COMPAT_LAZY_REFCOUNTS;
    apply(&mut buf, compatible_update(features::COMPAT_LAZY_REFCOUNTS));
    let u = refcount_structure_update(&before, 8 << 16, 3, 6);
    assert!(u.offset + 52 <= 512, "one sector: the switch cannot tear");
    apply(&mut buf, u);
    let after = Header::decode(&buf).expect("still valid");
    let mut expected = before;
    expected.refcount_table_offset = 8 << 16;
    expected.refcount_table_clusters = 3;
    expected.refcount_order = 6;
    assert_eq!(after, expected);
}

#[test]
fn check_strictness_accepts_what_only_the_checker_can_fix() {
    let (_, mut buf) = image();
    // No refcount table, and a snapshot table that is not cluster aligned.
    apply(&mut buf, reftable_update(1 << 16, 0));
    apply(&mut buf, snapshots_update(1, 12345));
    assert!(Header::decode(&buf).is_err());
    let h = Header::decode_with(&buf, Strictness::Check).expect("a check can look at it");
    assert_eq!(h.refcount_table_clusters, 0);
    assert_eq!((h.nb_snapshots, h.snapshots_offset), (1, 12345));
    // A refcount table offset that is not aligned is refused even by a check.
    apply(&mut buf, reftable_update(12345, 0));
    assert!(Header::decode_with(&buf, Strictness::Check).is_err());
}

#[test]
fn a_prefix_decodes_only_when_it_holds_every_extension_and_the_backing_name() {
    let mut h = Header::new(3, 21, 1 << 30);
    h.l1_size = 1;
    h.l1_table_offset = 3 << 21;
    h.refcount_table_offset = 1 << 21;
    h.refcount_table_clusters = 1;
    h.extensions.push(HeaderExtension::Unknown {
        magic: 0x1234_5678,
        data: vec![7; 300],
    });
    h.set_backing(Some(b"base.qcow2".to_vec()), None);
    let mut whole = h.encode(1 << 21).expect("encodes");
    whole.resize(1 << 21, 0);
    let full = Header::decode(&whole).expect("decodes");
    assert_eq!(
        Header::decode_prefix(&whole[..1 << 16], Strictness::Open),
        Some(full.clone())
    );
    // A prefix that ends inside the extensions, or before the name, decodes to nothing
    // rather than to a header that lost them.
    for cut in [200, 400, whole.iter().rposition(|&b| b != 0).expect("name")] {
        assert_eq!(
            Header::decode_prefix(&whole[..cut], Strictness::Open),
            None,
            "{cut}"
        );
    }
    // Without a backing file, a prefix that ends exactly where the next extension begins.
    h.set_backing(None, None);
    h.extensions.push(HeaderExtension::Unknown {
        magic: 0x8765_4321,
        data: vec![9; 8],
    });
    let mut whole = h.encode(1 << 21).expect("encodes");
    whole.resize(1 << 21, 0);
    let next = whole
        .windows(4)
        .position(|w| w == 0x8765_4321u32.to_be_bytes())
        .expect("second extension");
    assert_eq!(
        Header::decode_prefix(&whole[..next], Strictness::Open),
        None
    );
    assert_eq!(
        Header::decode_prefix(&whole[..1 << 16], Strictness::Open),
        Some(Header::decode(&whole).expect("decodes"))
    );
}
