//! Property test: random sequences of operations on each backend behave like a Vec model.

mod common;

use common::{open, read, write, Backend};
use proptest::prelude::*;
use storage::Storage;
use test_support::run;

#[derive(Debug, Clone)]
enum Op {
    Write { offset: u64, len: usize, fill: u8 },
    Zero { offset: u64, len: u64, unmap: bool },
    Discard { offset: u64, len: u64 },
    SetLen { len: u64 },
    Read { offset: u64, len: usize },
    Flush,
}

const SPAN: u64 = 300_000;

fn op() -> impl Strategy<Value = Op> {
    // Offsets and lengths cluster around sector and block edges as well as anywhere.
    let offset = prop_oneof![
        0..SPAN,
        (0..SPAN / 512).prop_map(|s| s * 512),
        (1..SPAN / 4096).prop_map(|b| b * 4096 - 1)
    ]
    .prop_map(|o| o.min(SPAN));
    let len = prop_oneof![
        1..20_000usize,
        (1..8usize).prop_map(|n| n * 4096),
        Just(1usize)
    ];
    prop_oneof![
        4 => (offset.clone(), len.clone(), any::<u8>()).prop_map(|(offset, len, fill)| Op::Write { offset, len, fill }),
        1 => (offset.clone(), len.clone(), any::<bool>()).prop_map(|(offset, len, unmap)| Op::Zero { offset, len: len as u64, unmap }),
        1 => (offset.clone(), len.clone()).prop_map(|(offset, len)| Op::Discard { offset, len: len as u64 }),
        1 => (0..SPAN).prop_map(|len| Op::SetLen { len }),
        3 => (offset, len).prop_map(|(offset, len)| Op::Read { offset, len }),
        1 => Just(Op::Flush),
    ]
}

async fn check(backend: Backend, ops: &[Op]) {
    let s = open(backend).await;
    let mut model: Vec<u8> = Vec::new();
    for (i, op) in ops.iter().enumerate() {
        match *op {
            Op::Write { offset, len, fill } => {
                let data = vec![fill; len];
                write(&s, offset, &data).await;
                let (o, e) = (offset as usize, offset as usize + len);
                if model.len() < e {
                    model.resize(e, 0);
                }
                model[o..e].copy_from_slice(&data);
            }
            Op::Zero { offset, len, unmap } => {
                s.write_zeroes_at(offset, len, unmap).await.unwrap();
                let (o, e) = (offset as usize, (offset + len) as usize);
                if model.len() < e {
                    model.resize(e, 0);
                }
                model[o..e].fill(0);
            }
            Op::Discard { offset, len } => {
                s.discard_at(offset, len).await.unwrap();
                // Either zeros or unchanged are allowed: check, then adopt what is there.
                let (o, e) = (offset as usize, ((offset + len) as usize).min(model.len()));
                if o < e {
                    let got = read(&s, offset, e - o).await;
                    for (j, (&g, &m)) in got.iter().zip(&model[o..e]).enumerate() {
                        assert!(
                            g == 0 || g == m,
                            "{backend:?} op {i}: discard gave {g} at {}",
                            o + j
                        );
                    }
                    model[o..e].copy_from_slice(&got);
                }
            }
            Op::SetLen { len } => {
                s.set_len(len).await.unwrap();
                model.resize(len as usize, 0);
            }
            Op::Read { offset, len } => {
                let got = read(&s, offset, len).await;
                let mut want = vec![0u8; len];
                let o = offset as usize;
                if o < model.len() {
                    let n = (model.len() - o).min(len);
                    want[..n].copy_from_slice(&model[o..o + n]);
                }
                assert!(
                    got == want,
                    "{backend:?} op {i}: read {len} at {offset} differs"
                );
            }
            Op::Flush => s.flush().await.unwrap(),
        }
        assert_eq!(
            s.len().await.unwrap(),
            model.len() as u64,
            "{backend:?} op {i} ({op:?}): length"
        );
    }
    assert!(
        read(&s, 0, model.len()).await == model,
        "{backend:?}: final contents differ"
    );
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 48, ..ProptestConfig::default() })]

    #[test]
    fn random_op_sequences_match_a_vec_model(ops in prop::collection::vec(op(), 1..40)) {
        run(async {
            for backend in Backend::ALL {
                check(backend, &ops).await;
            }
        });
    }
}
