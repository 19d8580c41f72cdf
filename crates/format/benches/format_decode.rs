//! Hot-path decoders: a whole L2 table (standard and extended) decoded straight from its
//! cached bytes, refcount reads at 16 and 1 bits, and a header with extensions.

use criterion::{black_box, criterion_group, criterion_main, Criterion, Throughput};
use qcow2_format::{l2, refcount, ExtendedL2Entry, Geometry, Header, HostOffset, L2Entry};

fn l2_tables(c: &mut Criterion) {
    let mut group = c.benchmark_group("l2_table_64k");
    group.throughput(Throughput::Bytes(65536));
    let standard = Geometry::new(16, false, 4, 1 << 40).unwrap();
    let mut table = vec![0u8; 65536];
    for i in 0..8192usize {
        let raw = (1u64 << 63) | ((i as u64 + 10) << 16);
        l2::set_entry_at(&mut table, i, false, raw, 0);
    }
    group.bench_function("standard_8192_entries", |b| {
        b.iter(|| {
            let mut allocated = 0u32;
            for i in 0..8192usize {
                let (word, _) = l2::entry_at(&table, i, false).unwrap();
                let e = L2Entry::decode(word, &standard, i as u64, HostOffset(0x50000)).unwrap();
                allocated += u32::from(matches!(e, L2Entry::Normal { .. }));
            }
            black_box(allocated)
        })
    });
    let extended = Geometry::new(16, true, 4, 1 << 40).unwrap();
    let mut table = vec![0u8; 65536];
    for i in 0..4096usize {
        let raw = (1u64 << 63) | ((i as u64 + 10) << 16);
        l2::set_entry_at(&mut table, i, true, raw, 0x0000_ff00_0000_00ff);
    }
    group.bench_function("extended_4096_entries_with_runs", |b| {
        b.iter(|| {
            let mut runs = 0usize;
            for i in 0..4096usize {
                let (word, bitmap) = l2::entry_at(&table, i, true).unwrap();
                let e =
                    ExtendedL2Entry::decode(word, bitmap, &extended, i as u64, HostOffset(0x50000))
                        .unwrap();
                runs += e.runs().count();
            }
            black_box(runs)
        })
    });
    group.finish();
}

fn refcount_blocks(c: &mut Criterion) {
    let mut group = c.benchmark_group("refcount_block_64k");
    let block = vec![0x5au8; 65536];
    for order in [0u32, 4] {
        let entries = refcount::entries_in(block.len(), order);
        group.throughput(Throughput::Elements(entries as u64));
        group.bench_function(format!("get_all_order_{order}"), |b| {
            b.iter(|| {
                let mut sum = 0u64;
                for i in 0..entries {
                    sum = sum.wrapping_add(refcount::get(&block, order, i).unwrap());
                }
                black_box(sum)
            })
        });
    }
    group.finish();
}

fn header(c: &mut Criterion) {
    let mut h = Header::new(3, 16, 1 << 30);
    h.l1_size = 2;
    h.l1_table_offset = 0x30000;
    h.refcount_table_offset = 0x10000;
    h.refcount_table_clusters = 1;
    h.backing_file = Some(b"base.qcow2".to_vec());
    let bytes = h.encode(65536).unwrap();
    c.bench_function("header_decode", |b| {
        b.iter(|| black_box(Header::decode(&bytes).unwrap()))
    });
}

criterion_group!(benches, l2_tables, refcount_blocks, header);
criterion_main!(benches);
