use nbd_proto::wire::reply::{
    decode_offset_data, Descriptor, EXTENDED_HEADER_LEN, STRUCTURED_HEADER_LEN,
};

use super::*;

fn to(mode: Mode, is_read: bool) -> ReplyTo {
    ReplyTo {
        mode,
        cookie: 0xabcd,
        offset: 4096,
        is_read,
    }
}

fn bytes(to: &ReplyTo, o: &Outcome<Vec<u8>>) -> Vec<u8> {
    serialize(to, o).to_bytes()
}

/// Splits a structured or extended byte stream into (header, payload) pairs.
fn chunks(mode: Mode, mut b: &[u8]) -> Vec<(ChunkHeader, Vec<u8>)> {
    let mut out = Vec::new();
    while !b.is_empty() {
        let (h, n) = match mode {
            Mode::Extended => (
                ChunkHeader::decode_extended(&b[..EXTENDED_HEADER_LEN]).unwrap(),
                EXTENDED_HEADER_LEN,
            ),
            _ => (
                ChunkHeader::decode_structured(&b[..STRUCTURED_HEADER_LEN]).unwrap(),
                STRUCTURED_HEADER_LEN,
            ),
        };
        let len = h.length as usize;
        out.push((h, b[n..n + len].to_vec()));
        b = &b[n + len..];
    }
    out
}

fn sample_read() -> Outcome<Vec<u8>> {
    Outcome::Read {
        offset: 4096,
        chunks: vec![
            ReadChunk::Data(vec![1; 100]),
            ReadChunk::Data(vec![2; 28]),
            ReadChunk::Hole(512),
            ReadChunk::Hole(0),
            ReadChunk::Data(vec![3; 10]),
        ],
        df: false,
    }
}

#[test]
fn simple_replies_carry_data_with_holes_filled() {
    let b = bytes(&to(Mode::Simple, true), &sample_read());
    assert_eq!(
        SimpleReply::decode(&b[..16]).unwrap(),
        SimpleReply {
            error: 0,
            cookie: 0xabcd
        }
    );
    let data = &b[16..];
    assert_eq!(data.len(), 650);
    assert!(data[..100].iter().all(|&x| x == 1));
    assert!(data[100..128].iter().all(|&x| x == 2));
    assert!(data[128..640].iter().all(|&x| x == 0));
    assert!(data[640..].iter().all(|&x| x == 3));
}

#[test]
fn simple_errors_have_no_payload() {
    let b = bytes(&to(Mode::Simple, true), &Outcome::Error(Errno::Inval, "x"));
    assert_eq!(b.len(), 16);
    assert_eq!(SimpleReply::decode(&b).unwrap().error, 22);
}

#[test]
fn structured_reads_merge_runs_into_data_and_hole_chunks() {
    let b = bytes(&to(Mode::Structured, true), &sample_read());
    let c = chunks(Mode::Structured, &b);
    let kinds: Vec<(u16, u16)> = c.iter().map(|(h, _)| (h.reply_type, h.flags)).collect();
    assert_eq!(
        kinds,
        [
            (REPLY_TYPE_OFFSET_DATA, 0),
            (REPLY_TYPE_OFFSET_HOLE, 0),
            (REPLY_TYPE_OFFSET_DATA, REPLY_FLAG_DONE)
        ]
    );
    let (off, data) = decode_offset_data(&c[0].1).unwrap();
    assert_eq!((off, data.len()), (4096, 128));
    assert_eq!(
        OffsetHole::decode(&c[1].1).unwrap(),
        OffsetHole {
            offset: 4224,
            size: 512
        }
    );
    assert_eq!(decode_offset_data(&c[2].1).unwrap().0, 4736);
    assert!(c.iter().all(|(h, _)| h.cookie == 0xabcd));
}

#[test]
fn df_reads_send_one_data_chunk() {
    let Outcome::Read { chunks: parts, .. } = sample_read() else {
        unreachable!()
    };
    let o = Outcome::Read {
        offset: 4096,
        chunks: parts,
        df: true,
    };
    let c = chunks(Mode::Structured, &bytes(&to(Mode::Structured, true), &o));
    assert_eq!(c.len(), 1);
    assert_eq!(c[0].0.reply_type, REPLY_TYPE_OFFSET_DATA);
    assert!(c[0].0.is_done());
    assert_eq!(decode_offset_data(&c[0].1).unwrap().1.len(), 650);
}

#[test]
fn empty_reads_end_with_a_none_chunk_never_a_simple_reply() {
    let o: Outcome<Vec<u8>> = Outcome::Read {
        offset: 0,
        chunks: vec![],
        df: false,
    };
    let c = chunks(Mode::Structured, &bytes(&to(Mode::Structured, true), &o));
    assert_eq!(c.len(), 1);
    assert_eq!(
        (c[0].0.reply_type, c[0].0.flags),
        (REPLY_TYPE_NONE, REPLY_FLAG_DONE)
    );
}

#[test]
fn structured_success_without_payload_may_be_simple_but_extended_may_not() {
    let b = bytes(&to(Mode::Structured, false), &Outcome::Done);
    assert_eq!(SimpleReply::decode(&b).unwrap().error, 0);
    let b = bytes(&to(Mode::Extended, false), &Outcome::Done);
    let c = chunks(Mode::Extended, &b);
    assert_eq!(c.len(), 1);
    assert_eq!((c[0].0.reply_type, c[0].0.offset), (REPLY_TYPE_NONE, 4096));
}

#[test]
fn structured_errors_are_error_chunks_with_a_message() {
    for mode in [Mode::Structured, Mode::Extended] {
        let b = bytes(
            &to(mode, true),
            &Outcome::Error(Errno::NoSpc, "past the end"),
        );
        let c = chunks(mode, &b);
        assert_eq!(c.len(), 1);
        assert!(c[0].0.is_done());
        let e = ErrorChunk::decode(c[0].0.reply_type, &c[0].1).unwrap();
        assert_eq!((e.error, e.message), (28, &b"past the end"[..]));
    }
}

#[test]
fn block_status_chunks_use_the_mode_format() {
    let status = Outcome::Status(vec![
        BlockStatusChunk {
            context_id: 1,
            descriptors: vec![Descriptor {
                length: 512,
                status: 3,
            }],
        },
        BlockStatusChunk {
            context_id: 2,
            descriptors: vec![Descriptor {
                length: 1024,
                status: 1,
            }],
        },
    ]);
    let c = chunks(
        Mode::Structured,
        &bytes(&to(Mode::Structured, false), &status),
    );
    assert_eq!(c.len(), 2);
    assert_eq!(c[0].0.reply_type, REPLY_TYPE_BLOCK_STATUS);
    assert!(!c[0].0.is_done() && c[1].0.is_done());
    assert_eq!(
        BlockStatusChunk::decode_compact(&c[1].1)
            .unwrap()
            .context_id,
        2
    );
    let c = chunks(Mode::Extended, &bytes(&to(Mode::Extended, false), &status));
    assert_eq!(c[0].0.reply_type, REPLY_TYPE_BLOCK_STATUS_EXT);
    assert_eq!(
        BlockStatusChunk::decode_extended(&c[0].1)
            .unwrap()
            .descriptors[0]
            .length,
        512
    );
}

#[test]
fn large_holes_in_simple_replies_are_written_as_zeroes() {
    let o: Outcome<Vec<u8>> = Outcome::Read {
        offset: 0,
        chunks: vec![ReadChunk::Hole(300_000)],
        df: false,
    };
    let s = serialize(&to(Mode::Simple, true), &o);
    assert_eq!(s.len(), 16 + 300_000);
    assert!(s.to_bytes()[16..].iter().all(|&b| b == 0));
}

#[tokio::test]
async fn writing_uses_every_byte_even_with_many_slices() {
    let chunks: Vec<ReadChunk<Vec<u8>>> = (0..3000u32)
        .map(|i| {
            if i % 2 == 0 {
                ReadChunk::Data(vec![(i % 251) as u8; 3])
            } else {
                ReadChunk::Hole(5)
            }
        })
        .collect();
    let o = Outcome::Read {
        offset: 0,
        chunks,
        df: true,
    };
    let s = serialize(&to(Mode::Structured, true), &o);
    let mut sink = Vec::new();
    s.write_to(&mut sink).await.unwrap();
    assert_eq!(sink, s.to_bytes());
    assert_eq!(sink.len(), STRUCTURED_HEADER_LEN + 8 + 1500 * 3 + 1500 * 5);
}
