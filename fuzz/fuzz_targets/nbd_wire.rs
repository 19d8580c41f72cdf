//! NBD wire decoders on untrusted bytes (what a client or server sends us): none panics, and
//! whatever decodes re-encodes to the same bytes.
#![no_main]

use libfuzzer_sys::fuzz_target;
use nbd_proto::wire::handshake::{ClientFlags, OptionHeader, OptionReplyHeader};
use nbd_proto::wire::option_data::{
    InfoReply, InfoRequest, MetaContextEntry, MetaContextRequest, ServerEntry,
};
use nbd_proto::wire::reply::{BlockStatusChunk, ChunkHeader, ErrorChunk, OffsetHole, SimpleReply};
use nbd_proto::wire::request::RequestHeader;

fuzz_target!(|data: &[u8]| {
    let Some((&selector, bytes)) = data.split_first() else {
        return;
    };
    match selector % 12 {
        0 => {
            if let Ok(h) = RequestHeader::decode_compact(bytes) {
                assert_eq!(&h.encode_compact().expect("32-bit length")[..], bytes);
            }
        }
        1 => {
            if let Ok(h) = RequestHeader::decode_extended(bytes) {
                assert_eq!(&h.encode_extended()[..], bytes);
            }
        }
        2 => {
            if let Ok(h) = OptionHeader::decode(bytes) {
                assert_eq!(&h.encode()[..], bytes);
            }
            let _ = OptionReplyHeader::decode(bytes);
        }
        3 => {
            let server_flags = u16::from(bytes.first().copied().unwrap_or(0) & 3);
            let _ = ClientFlags::decode(bytes.get(1..).unwrap_or(&[]), server_flags);
        }
        4 => {
            if let Ok(r) = InfoRequest::decode(bytes) {
                assert_eq!(r.encode(), bytes);
            }
        }
        5 => {
            if let Ok(r) = MetaContextRequest::decode(bytes) {
                assert_eq!(r.encode(), bytes);
            }
        }
        6 => {
            let _ = InfoReply::decode(bytes);
            let _ = ServerEntry::decode(bytes);
            let _ = MetaContextEntry::decode(bytes);
        }
        7 => {
            let _ = SimpleReply::decode(bytes);
            let _ = ChunkHeader::decode_structured(bytes);
            let _ = ChunkHeader::decode_extended(bytes);
        }
        8 => {
            let _ = OffsetHole::decode(bytes);
            let _ = nbd_proto::wire::reply::decode_offset_data(bytes);
        }
        9 => {
            let Some((t, payload)) = bytes.split_at_checked(2) else {
                return;
            };
            let reply_type = u16::from_be_bytes([t[0], t[1]]);
            let _ = ErrorChunk::decode(reply_type, payload);
        }
        10 => {
            if let Ok(c) = BlockStatusChunk::decode_compact(bytes) {
                assert_eq!(c.encode_compact().expect("decoded from compact"), bytes);
            }
        }
        _ => {
            if let Ok(c) = BlockStatusChunk::decode_extended(bytes) {
                assert_eq!(c.encode_extended().expect("decoded from extended"), bytes);
            }
        }
    }
});
