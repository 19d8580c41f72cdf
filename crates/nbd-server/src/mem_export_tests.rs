use super::*;
use proptest::prelude::*;

fn run<F: std::future::Future>(f: F) -> F::Output {
    tokio::runtime::Builder::new_current_thread()
        .build()
        .unwrap()
        .block_on(f)
}

fn flatten(chunks: Vec<ReadChunk<Vec<u8>>>) -> Vec<u8> {
    let mut out = Vec::new();
    for c in chunks {
        match c {
            ReadChunk::Data(d) => out.extend_from_slice(&d),
            ReadChunk::Hole(n) => out.resize(out.len() + n, 0),
        }
    }
    out
}

fn ext(len: u64, hole: bool, zero: bool, depth: u32) -> Extent {
    Extent {
        len,
        hole,
        zero,
        depth,
    }
}

#[test]
fn fresh_exports_are_one_hole() {
    let m = MemExport::new(10_000);
    assert_eq!(m.extents(), [ext(10_000, true, true, 0)]);
    let chunks = run(m.read(100, 5000)).unwrap();
    assert!(matches!(chunks.as_slice(), [ReadChunk::Hole(5000)]));
}

#[test]
fn writes_allocate_granules_and_read_back() {
    let m = MemExport::new(16384);
    run(m.write(4000, vec![7; 200], false)).unwrap();
    assert_eq!(
        m.extents(),
        [ext(8192, false, false, 1), ext(8192, true, true, 0)]
    );
    let back = flatten(run(m.read(3990, 220)).unwrap());
    assert_eq!(&back[..10], &[0; 10]);
    assert_eq!(&back[10..210], &[7; 200][..]);
    assert_eq!(&back[210..], &[0; 10]);
    assert_eq!(m.stats().writes, 1);
}

#[test]
fn zeroing_whole_granules_deallocates_only_when_allowed() {
    let m = MemExport::new(16384);
    m.fill(0, &[1; 16384]);
    let unmap = WriteZeroesFlags {
        may_unmap: true,
        ..Default::default()
    };
    run(m.write_zeroes(0, 4096, unmap)).unwrap();
    run(m.write_zeroes(4096, 4096, WriteZeroesFlags::default())).unwrap();
    run(m.write_zeroes(8192 + 100, 100, unmap)).unwrap();
    assert_eq!(
        m.extents(),
        [
            ext(4096, true, true, 0),
            ext(4096, false, true, 1),
            ext(8192, false, false, 1)
        ]
    );
    let c = m.contents();
    assert!(c[..8192].iter().all(|&b| b == 0));
    assert!(c[8192..8292].iter().all(|&b| b == 1));
    assert!(c[8292..8392].iter().all(|&b| b == 0));
    assert!(c[8392..].iter().all(|&b| b == 1));
}

#[test]
fn fast_zero_fails_with_enotsup_when_bytes_would_have_to_be_written() {
    let m = MemExport::new(16384);
    m.fill(0, &[1; 16384]);
    let fast = WriteZeroesFlags {
        fast: true,
        ..Default::default()
    };
    assert_eq!(run(m.write_zeroes(100, 4096, fast)), Err(Errno::NotSup));
    assert_eq!(m.contents()[100], 1, "a refused fast zero changes nothing");
    assert_eq!(run(m.write_zeroes(4096, 8192, fast)), Ok(()));
    assert_eq!(m.stats().fast_zero_refusals, 1);
}

#[test]
fn trim_discards_whole_granules_only() {
    let m = MemExport::new(12288);
    m.fill(0, &[5; 12288]);
    run(m.trim(100, 8192, false)).unwrap();
    assert_eq!(
        m.extents(),
        [
            ext(4096, false, false, 1),
            ext(4096, true, true, 0),
            ext(4096, false, false, 1)
        ]
    );
}

#[test]
fn backing_layers_show_through_and_report_depth() {
    let base = MemExport::new(16384);
    base.fill(0, &[9; 8192]);
    let top = MemExport::new(16384).with_backing(base);
    top.fill(4096, &[1; 10]);
    assert_eq!(
        top.extents(),
        [
            ext(4096, false, false, 2),
            ext(4096, false, false, 1),
            ext(8192, true, true, 0)
        ]
    );
    let c = top.contents();
    assert!(c[..4096].iter().all(|&b| b == 9));
    assert_eq!(&c[4096..4106], &[1; 10]);
    assert!(
        c[4106..8192].iter().all(|&b| b == 9),
        "copy-on-write kept the backing bytes"
    );
    // Discarding over a backing file must not expose it again: it becomes allocated zero.
    run(top.trim(0, 4096, false)).unwrap();
    assert!(top.contents()[..4096].iter().all(|&b| b == 0));
    assert_eq!(top.extents()[0], ext(4096, false, true, 1));
}

#[test]
fn injected_failures_hit_overlapping_requests_only() {
    let m = MemExport::new(8192);
    m.fail_range(4096, 10, Errno::Io);
    assert_eq!(run(m.read(4000, 100)).unwrap_err(), Errno::Io);
    assert_eq!(run(m.write(4105, vec![0; 1], false)), Err(Errno::Io));
    assert!(run(m.read(0, 4096)).is_ok());
    assert!(run(m.read(4106, 10)).is_ok());
}

#[test]
fn out_of_range_calls_are_errors_not_panics() {
    let m = MemExport::new(100);
    assert_eq!(run(m.read(90, 20)).unwrap_err(), Errno::Inval);
    assert_eq!(run(m.write(u64::MAX, vec![1], false)), Err(Errno::NoSpc));
    assert_eq!(run(m.block_status(100, 1)), Err(Errno::Inval));
    assert_eq!(run(m.trim(u64::MAX, 2, false)), Err(Errno::Inval));
}

#[derive(Debug, Clone)]
enum Op {
    Write(u64, Vec<u8>),
    Zero(u64, u64, bool),
    Trim(u64, u64),
}

fn op(size: u64) -> impl Strategy<Value = Op> {
    let off = 0..size;
    prop_oneof![
        (off.clone(), proptest::collection::vec(any::<u8>(), 1..3000))
            .prop_map(|(o, d)| Op::Write(o, d)),
        (off.clone(), 1u64..9000, any::<bool>()).prop_map(|(o, l, u)| Op::Zero(o, l, u)),
        (off, 1u64..9000).prop_map(|(o, l)| Op::Trim(o, l)),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(200))]

    /// Against a flat byte model: writes and zeroes are exact; a trim may zero whole
    /// granules or leave them (both are allowed), so the model just forgets those bytes.
    #[test]
    fn behaves_like_a_byte_array(ops in proptest::collection::vec(op(20_000), 1..30), backing in any::<bool>()) {
        let size = 20_000u64;
        let m = if backing {
            let base = MemExport::new(size).with_granularity(512);
            base.fill(0, &vec![0xee; size as usize]);
            MemExport::new(size).with_backing(base).with_granularity(1024)
        } else {
            MemExport::new(size)
        };
        let mut model: Vec<Option<u8>> = vec![Some(if backing { 0xee } else { 0 }); size as usize];
        for op in ops {
            match op {
                Op::Write(o, d) => {
                    let n = d.len().min((size - o) as usize);
                    run(m.write(o, d[..n].to_vec(), false)).unwrap();
                    for (i, b) in d[..n].iter().enumerate() { model[o as usize + i] = Some(*b); }
                }
                Op::Zero(o, l, unmap) => {
                    let l = l.min(size - o);
                    let f = WriteZeroesFlags { may_unmap: unmap, ..Default::default() };
                    run(m.write_zeroes(o, l, f)).unwrap();
                    for b in &mut model[o as usize..(o + l) as usize] { *b = Some(0); }
                }
                Op::Trim(o, l) => {
                    let l = l.min(size - o);
                    run(m.trim(o, l, false)).unwrap();
                    for b in &mut model[o as usize..(o + l) as usize] { *b = None; }
                }
            }
        }
        let got = flatten(run(m.read(0, size as usize)).unwrap());
        prop_assert_eq!(got.clone(), m.contents());
        for (i, want) in model.iter().enumerate() {
            if let Some(w) = want { prop_assert_eq!(got[i], *w, "byte {}", i); }
        }
        let total: u64 = m.extents().iter().map(|e| e.len).sum();
        prop_assert_eq!(total, size);
        for (start, e) in m.extents().iter().scan(0u64, |p, e| { let s = *p; *p += e.len; Some((s, *e)) }) {
            if e.zero {
                prop_assert!(got[start as usize..(start + e.len) as usize].iter().all(|&b| b == 0));
            }
        }
    }
}
