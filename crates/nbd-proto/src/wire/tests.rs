//! Round trips of every encoder through its decoder, exact bytes of a few fixed structures
//! against the spec, and "arbitrary bytes never panic" for every decoder.

use super::handshake::*;
use super::option_data::*;
use super::reply::*;
use super::request::*;
use super::*;
use proptest::prelude::*;

#[test]
fn greeting_bytes_match_the_spec() {
    let g = Greeting {
        flags: FLAG_FIXED_NEWSTYLE | FLAG_NO_ZEROES,
    };
    let bytes = g.encode();
    assert_eq!(&bytes[..8], b"NBDMAGIC");
    assert_eq!(&bytes[8..16], b"IHAVEOPT");
    assert_eq!(&bytes[16..], &[0, 3]);
    assert_eq!(Greeting::decode(&bytes), Ok(g));
}

#[test]
fn client_flags_reject_unknown_or_unadvertised_bits() {
    let server = FLAG_FIXED_NEWSTYLE | FLAG_NO_ZEROES;
    let ok = ClientFlags::decode(&3u32.to_be_bytes(), server).unwrap();
    assert!(ok.fixed_newstyle && ok.no_zeroes);
    assert!(ClientFlags::decode(&4u32.to_be_bytes(), server).is_err());
    assert!(ClientFlags::decode(&2u32.to_be_bytes(), FLAG_FIXED_NEWSTYLE).is_err());
    assert!(matches!(
        ClientFlags::decode(&[0, 0, 1], server),
        Err(WireError::Truncated {
            need: 4,
            have: 3,
            ..
        })
    ));
}

#[test]
fn option_header_reports_bad_magic_with_offset() {
    let mut bytes = OptionHeader {
        option: OPT_GO,
        length: 7,
    }
    .encode();
    bytes[0] = b'X';
    let err = OptionHeader::decode(&bytes).unwrap_err();
    assert!(matches!(
        err,
        WireError::BadMagic {
            offset: 0,
            expected: IHAVEOPT,
            ..
        }
    ));
    assert!(err.to_string().contains("option header"));
}

#[test]
fn export_name_reply_pads_unless_no_zeroes() {
    let r = ExportNameReply {
        size: 1 << 30,
        flags: 0x1234,
    };
    assert_eq!(r.encode(false).len(), 134);
    let short = r.encode(true);
    assert_eq!(short.len(), 10);
    assert_eq!(ExportNameReply::decode(&short), Ok(r));
}

#[test]
fn compact_request_layout_matches_the_spec() {
    let h = RequestHeader {
        flags: CMD_FLAG_FUA,
        command: Command::Write,
        cookie: 0x0102_0304_0506_0708,
        offset: 4096,
        length: 512,
    };
    let b = h.encode_compact().unwrap();
    assert_eq!(&b[..4], &[0x25, 0x60, 0x95, 0x13]);
    assert_eq!(&b[4..8], &[0, 1, 0, 1]);
    assert_eq!(&b[24..], &[0, 0, 2, 0]);
    assert_eq!(RequestHeader::decode_compact(&b), Ok(h));
    let big = RequestHeader {
        length: 1 << 32,
        ..h
    };
    assert_eq!(big.encode_compact(), None);
    assert_eq!(
        RequestHeader::decode_extended(&big.encode_extended()),
        Ok(big)
    );
    assert!(RequestHeader::decode_extended(&b).is_err());
}

#[test]
fn unknown_commands_survive_decoding() {
    let h = RequestHeader {
        flags: 0,
        command: Command::Unknown(77),
        cookie: 1,
        offset: 0,
        length: 0,
    };
    let back = RequestHeader::decode_compact(&h.encode_compact().unwrap()).unwrap();
    assert_eq!(back.command, Command::Unknown(77));
    assert_eq!(Command::from_code(CMD_BLOCK_STATUS), Command::BlockStatus);
}

#[test]
fn info_request_length_must_match_the_count() {
    let req = InfoRequest {
        name: b"disk",
        requests: vec![INFO_NAME, INFO_BLOCK_SIZE],
    };
    let mut bytes = req.encode();
    assert_eq!(InfoRequest::decode(&bytes), Ok(req));
    bytes.push(0);
    assert!(matches!(
        InfoRequest::decode(&bytes),
        Err(WireError::Invalid {
            field: "number of information requests",
            ..
        })
    ));
    // Name length pointing past the data.
    let lying = [0, 0, 0, 9, b'a', 0, 0];
    assert!(matches!(
        InfoRequest::decode(&lying),
        Err(WireError::Truncated { .. })
    ));
}

#[test]
fn strings_longer_than_4096_bytes_are_refused() {
    let long = vec![b'x'; MAX_STRING_LEN + 1];
    let req = InfoRequest {
        name: &long,
        requests: vec![],
    };
    assert!(matches!(
        InfoRequest::decode(&req.encode()),
        Err(WireError::Invalid {
            field: "export name",
            ..
        })
    ));
}

#[test]
fn meta_context_request_bounds_the_query_count_before_allocating() {
    let mut bytes = Vec::new();
    bytes.extend_from_slice(&0u32.to_be_bytes());
    bytes.extend_from_slice(&u32::MAX.to_be_bytes());
    assert!(matches!(
        MetaContextRequest::decode(&bytes),
        Err(WireError::Invalid {
            field: "number of queries",
            ..
        })
    ));
    let req = MetaContextRequest {
        name: b"",
        queries: vec![b"base:allocation", b"qemu:"],
    };
    assert_eq!(MetaContextRequest::decode(&req.encode()), Ok(req));
}

#[test]
fn info_replies_have_the_spec_lengths() {
    let export = InfoReply::Export { size: 5, flags: 1 };
    assert_eq!(export.encode().len(), 12);
    let bs = InfoReply::BlockSize {
        minimum: 1,
        preferred: 4096,
        maximum: MAX_PAYLOAD,
    };
    assert_eq!(bs.encode().len(), 14);
    assert!(InfoReply::decode(&export.encode()[..11]).is_err());
    let mut long = bs.encode();
    long.push(0);
    assert!(matches!(
        InfoReply::decode(&long),
        Err(WireError::Trailing { .. })
    ));
}

#[test]
fn structured_chunk_layout_matches_the_spec() {
    let h = ChunkHeader {
        flags: REPLY_FLAG_DONE,
        reply_type: REPLY_TYPE_OFFSET_HOLE,
        cookie: 9,
        offset: 0,
        length: 12,
    };
    let b = h.encode_structured().unwrap();
    assert_eq!(&b[..4], &[0x66, 0x8e, 0x33, 0xef]);
    assert_eq!(&b[4..8], &[0, 1, 0, 2]);
    assert_eq!(ChunkHeader::decode_structured(&b), Ok(h));
    let e = ChunkHeader { offset: 77, ..h };
    let b = e.encode_extended();
    assert_eq!(&b[..4], &[0x6e, 0x8a, 0x27, 0x8c]);
    assert_eq!(ChunkHeader::decode_extended(&b), Ok(e));
}

#[test]
fn error_chunks_check_message_length_and_error_value() {
    let c = ErrorChunk {
        error: 22,
        message: b"bad",
        offset: Some(4096),
    };
    let p = c.encode();
    assert_eq!(p.len(), 4 + 2 + 3 + 8);
    assert_eq!(ErrorChunk::decode(c.reply_type(), &p), Ok(c));
    let mut lying = ErrorChunk {
        error: 5,
        message: b"x",
        offset: None,
    }
    .encode();
    lying[5] = 200;
    assert!(ErrorChunk::decode(REPLY_TYPE_ERROR, &lying).is_err());
    assert!(ErrorChunk::decode(REPLY_TYPE_ERROR, &[0, 0, 0, 0, 0, 0]).is_err());
    assert!(ErrorChunk::decode(REPLY_TYPE_OFFSET_DATA, &p).is_err());
}

#[test]
fn block_status_payloads_check_their_shape() {
    let c = BlockStatusChunk {
        context_id: 1,
        descriptors: vec![
            Descriptor {
                length: 4096,
                status: 3,
            },
            Descriptor {
                length: 512,
                status: 0,
            },
        ],
    };
    let compact = c.encode_compact().unwrap();
    assert_eq!(compact.len(), 4 + 16);
    assert_eq!(BlockStatusChunk::decode_compact(&compact), Ok(c.clone()));
    let ext = c.encode_extended().unwrap();
    assert_eq!(ext.len(), 8 + 32);
    assert_eq!(BlockStatusChunk::decode_extended(&ext), Ok(c.clone()));
    assert!(BlockStatusChunk::decode_compact(&compact[..8]).is_err());
    assert!(BlockStatusChunk::decode_compact(&compact[..4]).is_err());
    let mut wrong_count = ext.clone();
    wrong_count[7] = 3;
    assert!(BlockStatusChunk::decode_extended(&wrong_count).is_err());
    let wide = BlockStatusChunk {
        context_id: 1,
        descriptors: vec![Descriptor {
            length: 1 << 32,
            status: 0,
        }],
    };
    assert_eq!(wide.encode_compact(), None);
    let empty = BlockStatusChunk {
        context_id: 1,
        descriptors: vec![],
    };
    assert_eq!(empty.encode_compact(), None);
    assert_eq!(empty.encode_extended(), None);
}

#[test]
fn hole_and_data_payloads() {
    let h = OffsetHole {
        offset: 1 << 40,
        size: 65536,
    };
    assert_eq!(OffsetHole::decode(&h.encode()), Ok(h));
    assert!(OffsetHole::decode(&OffsetHole { size: 0, ..h }.encode()).is_err());
    let mut data = encode_offset_data_prefix(512).to_vec();
    assert!(decode_offset_data(&data).is_err());
    data.extend_from_slice(b"abc");
    assert_eq!(decode_offset_data(&data), Ok((512, &b"abc"[..])));
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(2000))]

    #[test]
    fn arbitrary_bytes_never_panic(bytes in proptest::collection::vec(any::<u8>(), 0..200), kind in any::<u16>()) {
        let _ = Greeting::decode(&bytes);
        let _ = ClientFlags::decode(&bytes, FLAG_FIXED_NEWSTYLE | FLAG_NO_ZEROES);
        let _ = OptionHeader::decode(&bytes);
        let _ = OptionReplyHeader::decode(&bytes);
        let _ = ExportNameReply::decode(&bytes);
        let _ = InfoRequest::decode(&bytes);
        let _ = MetaContextRequest::decode(&bytes);
        let _ = InfoReply::decode(&bytes);
        let _ = ServerEntry::decode(&bytes);
        let _ = MetaContextEntry::decode(&bytes);
        let _ = RequestHeader::decode_compact(&bytes);
        let _ = RequestHeader::decode_extended(&bytes);
        let _ = SimpleReply::decode(&bytes);
        let _ = ChunkHeader::decode_structured(&bytes);
        let _ = ChunkHeader::decode_extended(&bytes);
        let _ = decode_offset_data(&bytes);
        let _ = OffsetHole::decode(&bytes);
        let _ = ErrorChunk::decode(kind, &bytes);
        let _ = BlockStatusChunk::decode_compact(&bytes);
        let _ = BlockStatusChunk::decode_extended(&bytes);
    }

    #[test]
    fn length_prefixed_fields_never_overread(len in any::<u32>(), tail in proptest::collection::vec(any::<u8>(), 0..64)) {
        let mut bytes = len.to_be_bytes().to_vec();
        bytes.extend_from_slice(&tail);
        prop_assert!(InfoRequest::decode(&bytes).is_err() || (len as usize) <= tail.len());
        let _ = MetaContextRequest::decode(&bytes);
        let _ = ServerEntry::decode(&bytes);
    }

    #[test]
    fn requests_round_trip(flags in any::<u16>(), code in any::<u16>(), cookie in any::<u64>(), offset in any::<u64>(), length in any::<u64>()) {
        let h = RequestHeader { flags, command: Command::from_code(code), cookie, offset, length };
        prop_assert_eq!(RequestHeader::decode_extended(&h.encode_extended()), Ok(h));
        if let Some(b) = h.encode_compact() {
            prop_assert_eq!(RequestHeader::decode_compact(&b), Ok(h));
        } else {
            prop_assert!(length > u64::from(u32::MAX));
        }
    }

    #[test]
    fn option_framing_round_trips(option in any::<u32>(), reply_type in any::<u32>(), length in any::<u32>()) {
        let h = OptionHeader { option, length };
        let enc = h.encode();
        prop_assert_eq!(OptionHeader::decode(&enc), Ok(h));
        let r = OptionReplyHeader { option, reply_type, length };
        let enc = r.encode();
        prop_assert_eq!(OptionReplyHeader::decode(&enc), Ok(r));
    }

    #[test]
    fn option_payloads_round_trip(
        name in proptest::collection::vec(any::<u8>(), 0..300),
        infos in proptest::collection::vec(any::<u16>(), 0..20),
        queries in proptest::collection::vec(proptest::collection::vec(any::<u8>(), 0..50), 0..8),
        details in proptest::collection::vec(any::<u8>(), 0..50),
        id in any::<u32>(),
    ) {
        let info = InfoRequest { name: &name, requests: infos };
        let enc = info.encode();
        prop_assert_eq!(InfoRequest::decode(&enc), Ok(info));
        let q: Vec<&[u8]> = queries.iter().map(Vec::as_slice).collect();
        let meta = MetaContextRequest { name: &name, queries: q };
        let enc = meta.encode();
        prop_assert_eq!(MetaContextRequest::decode(&enc), Ok(meta));
        let server = ServerEntry { name: &name, details: &details };
        let enc = server.encode();
        prop_assert_eq!(ServerEntry::decode(&enc), Ok(server));
        let ctx = MetaContextEntry { id, name: &name };
        let enc = ctx.encode();
        prop_assert_eq!(MetaContextEntry::decode(&enc), Ok(ctx));
        for reply in [
            InfoReply::Name(&name),
            InfoReply::Description(&details),
            InfoReply::Export { size: u64::from(id) << 7, flags: id as u16 },
            InfoReply::BlockSize { minimum: id, preferred: id ^ 1, maximum: !id },
            InfoReply::Unknown { kind: 9, data: &details },
        ] {
            let enc = reply.encode();
            prop_assert_eq!(InfoReply::decode(&enc), Ok(reply));
        }
    }

    #[test]
    fn reply_payloads_round_trip(
        cookie in any::<u64>(), offset in any::<u64>(), error in 1u32..,
        message in proptest::collection::vec(any::<u8>(), 0..100),
        lens in proptest::collection::vec((1u64.., any::<u64>()), 1..20),
    ) {
        let s = SimpleReply { error, cookie };
        let enc = s.encode();
        prop_assert_eq!(SimpleReply::decode(&enc), Ok(s));
        for off in [None, Some(offset)] {
            let e = ErrorChunk { error, message: &message, offset: off };
            let enc = e.encode();
            prop_assert_eq!(ErrorChunk::decode(e.reply_type(), &enc), Ok(e));
        }
        let descriptors: Vec<Descriptor> = lens.iter().map(|&(length, status)| Descriptor { length, status }).collect();
        let c = BlockStatusChunk { context_id: error, descriptors };
        prop_assert_eq!(BlockStatusChunk::decode_extended(&c.encode_extended().unwrap()), Ok(c.clone()));
        if let Some(compact) = c.encode_compact() {
            prop_assert_eq!(BlockStatusChunk::decode_compact(&compact), Ok(c));
        }
    }
}
