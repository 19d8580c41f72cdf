//! The client against scripted servers: well-formed handshakes, then hostile replies.

use std::io::{Read, Write};
use std::os::unix::net::UnixStream;
use std::time::Duration;

use nbd_proto::wire::consts::*;

use super::{ClientError, NbdClient};
use crate::list::ListError;

fn u32be(b: &[u8]) -> u32 {
    u32::from_be_bytes(b.try_into().unwrap())
}

fn opt_reply(s: &mut UnixStream, opt: u32, kind: u32, data: &[u8]) {
    let mut m = OPTION_REPLY_MAGIC.to_be_bytes().to_vec();
    m.extend_from_slice(&opt.to_be_bytes());
    m.extend_from_slice(&kind.to_be_bytes());
    m.extend_from_slice(&(data.len() as u32).to_be_bytes());
    m.extend_from_slice(data);
    let _ = s.write_all(&m);
}

/// A server that negotiates an export of `size` bytes (structured replies,
/// `base:allocation` as context 1), then answers the first request with `reply`.
fn fake_server(size: u64, go_info_len: Option<u32>, reply: Vec<u8>) -> UnixStream {
    let (client, mut s) = UnixStream::pair().unwrap();
    std::thread::spawn(move || {
        let mut hello = NBDMAGIC.to_be_bytes().to_vec();
        hello.extend_from_slice(&IHAVEOPT.to_be_bytes());
        hello.extend_from_slice(&(FLAG_FIXED_NEWSTYLE | FLAG_NO_ZEROES).to_be_bytes());
        s.write_all(&hello)?;
        let mut flags = [0; 4];
        s.read_exact(&mut flags)?;
        loop {
            let mut h = [0; 16];
            s.read_exact(&mut h)?;
            let opt = u32be(&h[8..12]);
            let mut data = vec![0; u32be(&h[12..16]) as usize];
            s.read_exact(&mut data)?;
            match opt {
                OPT_STRUCTURED_REPLY => opt_reply(&mut s, opt, REP_ACK, &[]),
                OPT_SET_META_CONTEXT => {
                    let mut d = 1u32.to_be_bytes().to_vec();
                    d.extend_from_slice(b"base:allocation");
                    opt_reply(&mut s, opt, REP_META_CONTEXT, &d);
                    opt_reply(&mut s, opt, REP_ACK, &[]);
                }
                OPT_GO => {
                    if let Some(len) = go_info_len {
                        // A reply header claiming `len` bytes, then nothing.
                        let mut m = OPTION_REPLY_MAGIC.to_be_bytes().to_vec();
                        m.extend_from_slice(&opt.to_be_bytes());
                        m.extend_from_slice(&REP_INFO.to_be_bytes());
                        m.extend_from_slice(&len.to_be_bytes());
                        s.write_all(&m)?;
                        return Ok::<(), std::io::Error>(());
                    }
                    let mut d = INFO_EXPORT.to_be_bytes().to_vec();
                    d.extend_from_slice(&size.to_be_bytes());
                    d.extend_from_slice(&(FLAG_HAS_FLAGS | FLAG_SEND_FLUSH).to_be_bytes());
                    opt_reply(&mut s, opt, REP_INFO, &d);
                    opt_reply(&mut s, opt, REP_ACK, &[]);
                    break;
                }
                _ => opt_reply(&mut s, opt, REP_ERR_UNSUP, &[]),
            }
        }
        let mut req = [0; 28];
        s.read_exact(&mut req)?;
        // The replies are built for the first request's handle.
        assert_eq!(&req[8..16], &1u64.to_be_bytes());
        s.write_all(&reply)?;
        Ok(())
    });
    client
}

fn chunk(flags: u16, kind: u16, len: u32, payload: &[u8]) -> Vec<u8> {
    let mut m = STRUCTURED_REPLY_MAGIC.to_be_bytes().to_vec();
    m.extend_from_slice(&flags.to_be_bytes());
    m.extend_from_slice(&kind.to_be_bytes());
    // The handle of a client's first request, so only the reply's content is wrong.
    m.extend_from_slice(&1u64.to_be_bytes());
    m.extend_from_slice(&len.to_be_bytes());
    m.extend_from_slice(payload);
    m
}

fn connect(s: UnixStream) -> Result<NbdClient<UnixStream>, ClientError> {
    s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    NbdClient::handshake(s, "")
}

/// A client connected to a fake 1 MiB export whose transmission replies are `replies`.
fn serving(replies: Vec<u8>) -> NbdClient<UnixStream> {
    connect(fake_server(1 << 20, None, replies)).expect("the handshake is well formed")
}

#[test]
fn a_hostile_server_gets_typed_errors_not_panics() {
    // An option reply claiming 4 GiB: refused before any allocation.
    let e = connect(fake_server(1 << 20, Some(u32::MAX), vec![])).err();
    assert!(
        matches!(e, Some(ClientError::Handshake(ListError::Protocol(_)))),
        "{e:?}"
    );

    // An export size no offset can reach.
    let e = connect(fake_server(u64::MAX, None, vec![])).err();
    assert!(matches!(e, Some(ClientError::Protocol(_))), "{e:?}");

    // A read answered with a 4 GiB data chunk.
    let mut c = serving(chunk(
        REPLY_FLAG_DONE,
        REPLY_TYPE_OFFSET_DATA,
        u32::MAX,
        &0u64.to_be_bytes(),
    ));
    let e = c.read(&mut [0; 512], 0).unwrap_err();
    assert!(matches!(e, ClientError::Protocol(_)), "{e:?}");

    // Data placed before the offset asked.
    let mut c = serving(chunk(
        REPLY_FLAG_DONE,
        REPLY_TYPE_OFFSET_DATA,
        8 + 512,
        &0u64.to_be_bytes(),
    ));
    let e = c.read(&mut [0; 512], 4096).unwrap_err();
    assert!(matches!(e, ClientError::Protocol(_)), "{e:?}");

    // A read whose reply ends before covering the request.
    let mut c = serving(chunk(REPLY_FLAG_DONE, 0, 0, &[]));
    let e = c.read(&mut [0; 512], 0).unwrap_err();
    assert!(matches!(e, ClientError::Protocol(_)), "{e:?}");

    // Block status with a length no extent list fits, and with an empty extent.
    let mut c = serving(chunk(
        REPLY_FLAG_DONE,
        REPLY_TYPE_BLOCK_STATUS,
        u32::MAX,
        &1u32.to_be_bytes(),
    ));
    let e = c.block_status(0, 4096).unwrap_err();
    assert!(matches!(e, ClientError::Protocol(_)), "{e:?}");
    let mut p = 1u32.to_be_bytes().to_vec();
    p.extend_from_slice(&[0; 8]);
    let mut c = serving(chunk(REPLY_FLAG_DONE, REPLY_TYPE_BLOCK_STATUS, 12, &p));
    let e = c.block_status(0, 4096).unwrap_err();
    assert!(matches!(e, ClientError::Protocol(_)), "{e:?}");

    // An error chunk longer than any message, and garbage instead of a reply.
    let mut c = serving(chunk(REPLY_FLAG_DONE, REPLY_TYPE_ERROR, u32::MAX, &[]));
    assert!(matches!(c.flush().unwrap_err(), ClientError::Protocol(_)));
    let mut c = serving(vec![0xff; 64]);
    assert!(matches!(c.flush().unwrap_err(), ClientError::Protocol(_)));

    // A chunk that says nothing but does not end the reply, and holes covering the
    // request twice over.
    let mut c = serving(chunk(0, REPLY_TYPE_NONE, 0, &[]));
    assert!(matches!(c.flush().unwrap_err(), ClientError::Protocol(_)));
    let mut hole = 0u64.to_be_bytes().to_vec();
    hole.extend_from_slice(&512u32.to_be_bytes());
    let mut twice = chunk(0, REPLY_TYPE_OFFSET_HOLE, 12, &hole);
    twice.extend(chunk(REPLY_FLAG_DONE, REPLY_TYPE_OFFSET_HOLE, 12, &hole));
    let mut c = serving(twice);
    let e = c.read(&mut [0; 512], 0).unwrap_err();
    assert!(matches!(e, ClientError::Protocol(_)), "{e:?}");

    // Past the end of the export: refused before anything is sent.
    let mut c = connect(fake_server(4096, None, vec![])).unwrap();
    assert!(matches!(
        c.read(&mut [0; 512], 4000).unwrap_err(),
        ClientError::OutOfRange { .. }
    ));
}

#[test]
fn a_server_error_chunk_is_the_requests_errno() {
    let mut p = (libc::ENOSPC as u32).to_be_bytes().to_vec();
    p.extend_from_slice(&0u16.to_be_bytes());
    let mut c = connect(fake_server(
        1 << 20,
        None,
        chunk(REPLY_FLAG_DONE, REPLY_TYPE_ERROR, 6, &p),
    ))
    .unwrap();
    let e = c.flush().unwrap_err();
    assert!(matches!(e, ClientError::Server { errno } if errno == libc::ENOSPC as u32));
    assert_eq!(std::io::Error::from(e).raw_os_error(), Some(libc::ENOSPC));
}

/// A data chunk of the read's reply: `data` at `offset`.
fn data_chunk(flags: u16, offset: u64, data: &[u8]) -> Vec<u8> {
    let mut p = offset.to_be_bytes().to_vec();
    p.extend_from_slice(data);
    chunk(flags, REPLY_TYPE_OFFSET_DATA, p.len() as u32, &p)
}

/// A hole chunk of the read's reply: `len` zeros at `offset`.
fn hole_chunk(flags: u16, offset: u64, len: u32) -> Vec<u8> {
    let mut p = offset.to_be_bytes().to_vec();
    p.extend_from_slice(&len.to_be_bytes());
    chunk(flags, REPLY_TYPE_OFFSET_HOLE, 12, &p)
}

/// A block status chunk for context `id` with `extents` (length, flags).
fn status_chunk(flags: u16, id: u32, extents: &[(u32, u32)]) -> Vec<u8> {
    let mut p = id.to_be_bytes().to_vec();
    for (len, state) in extents {
        p.extend_from_slice(&len.to_be_bytes());
        p.extend_from_slice(&state.to_be_bytes());
    }
    chunk(flags, REPLY_TYPE_BLOCK_STATUS, p.len() as u32, &p)
}

/// An error chunk with `errno` and no message.
fn error_chunk(flags: u16, errno: u32) -> Vec<u8> {
    let mut p = errno.to_be_bytes().to_vec();
    p.extend_from_slice(&0u16.to_be_bytes());
    chunk(flags, REPLY_TYPE_ERROR, 6, &p)
}

fn simple_reply(errno: u32, handle: u64) -> Vec<u8> {
    let mut m = SIMPLE_REPLY_MAGIC.to_be_bytes().to_vec();
    m.extend_from_slice(&errno.to_be_bytes());
    m.extend_from_slice(&handle.to_be_bytes());
    m
}

#[track_caller]
fn assert_protocol<T: std::fmt::Debug>(r: Result<T, ClientError>, what: &str) {
    assert!(matches!(r, Err(ClientError::Protocol(_))), "{what}: {r:?}");
}

#[test]
fn a_read_reply_whose_chunks_overlap_is_refused() {
    // The same half twice adds up to the request's length, but the other half was never
    // sent: the buffer would keep whatever it held there.
    let mut twice = data_chunk(0, 0, &[7; 256]);
    twice.extend(data_chunk(REPLY_FLAG_DONE, 0, &[7; 256]));
    let mut buf = [0xaa; 512];
    assert_protocol(serving(twice).read(&mut buf, 0), "the same chunk twice");
    let mut partly = data_chunk(0, 0, &[7; 256]);
    partly.extend(hole_chunk(REPLY_FLAG_DONE, 128, 256));
    assert_protocol(
        serving(partly).read(&mut buf, 0),
        "chunks overlapping in part",
    );

    // Chunks in any order that cover the request once are a reply.
    let mut reply = data_chunk(0, 4096 + 384, &[3; 128]);
    reply.extend(hole_chunk(0, 4096, 128));
    reply.extend(data_chunk(REPLY_FLAG_DONE, 4096 + 128, &[5; 256]));
    let mut buf = [0xaa; 512];
    serving(reply).read(&mut buf, 4096).unwrap();
    assert_eq!(buf[..128], [0; 128]);
    assert_eq!(buf[128..384], [5; 256]);
    assert_eq!(buf[384..], [3; 128]);
}

#[test]
fn every_malformed_reply_is_refused() {
    let read = |reply: Vec<u8>| serving(reply).read(&mut [0; 512], 0);
    let status = |reply: Vec<u8>| serving(reply).block_status(0, 4096);
    let flush = |reply: Vec<u8>| serving(reply).flush();

    assert_protocol(
        read(simple_reply(0, 1)),
        "a simple reply to a structured read",
    );
    assert_protocol(flush(simple_reply(0, 2)), "a reply to another request");
    assert_protocol(
        read(chunk(REPLY_FLAG_DONE, REPLY_TYPE_OFFSET_DATA, 4, &[0; 4])),
        "a data chunk shorter than its offset",
    );
    let mut long_hole = 0u64.to_be_bytes().to_vec();
    long_hole.extend_from_slice(&[0, 0, 2, 0, 0, 0, 0, 0]);
    assert_protocol(
        read(chunk(
            REPLY_FLAG_DONE,
            REPLY_TYPE_OFFSET_HOLE,
            16,
            &long_hole,
        )),
        "a hole chunk of 16 bytes",
    );
    assert_protocol(
        read(data_chunk(REPLY_FLAG_DONE, 256, &[1; 512])),
        "data past the end of the request",
    );
    assert_protocol(
        read(hole_chunk(REPLY_FLAG_DONE, 0, u32::MAX)),
        "a hole past the end of the request",
    );
    assert_protocol(
        flush(data_chunk(REPLY_FLAG_DONE, 0, &[1; 8])),
        "data in a reply to a flush",
    );
    assert_protocol(
        read(status_chunk(REPLY_FLAG_DONE, 1, &[(512, 0)])),
        "block status in a reply to a read",
    );
    assert_protocol(
        status(status_chunk(REPLY_FLAG_DONE, 2, &[(4096, 0)])),
        "block status for a context not negotiated",
    );
    assert_protocol(
        status(chunk(
            REPLY_FLAG_DONE,
            REPLY_TYPE_BLOCK_STATUS,
            13,
            &[0; 13],
        )),
        "a block status chunk that is not whole extents",
    );
    assert_protocol(
        status(chunk(REPLY_FLAG_DONE, REPLY_TYPE_NONE, 0, &[])),
        "a block status reply without extents",
    );
    assert_protocol(
        flush(chunk(REPLY_FLAG_DONE, 77, 0, &[])),
        "a chunk type the protocol does not have",
    );
    assert_protocol(
        flush(chunk(REPLY_FLAG_DONE, REPLY_TYPE_NONE, 4, &[0; 4])),
        "a none chunk with a payload",
    );
    let mut bad_magic = error_chunk(0, 5);
    bad_magic.extend_from_slice(&[0xff; 20]);
    assert_protocol(flush(bad_magic), "a second chunk without the magic");
    assert_protocol(
        flush(chunk(REPLY_FLAG_DONE, REPLY_TYPE_ERROR, 4, &[0, 0, 0, 5])),
        "an error chunk too short for its errno and message length",
    );

    // Bounds: at most MAX_EXTENTS extents and MAX_CHUNKS chunks in one reply.
    let many = vec![(512, 0); super::MAX_EXTENTS as usize];
    let mut extents = status_chunk(0, 1, &many);
    extents.extend(status_chunk(REPLY_FLAG_DONE, 1, &[(512, 0)]));
    assert_protocol(status(extents), "more than MAX_EXTENTS extents");
    let mut chunks = Vec::new();
    for _ in 0..=super::MAX_CHUNKS {
        chunks.extend(error_chunk(0, 5));
    }
    assert_protocol(flush(chunks), "more than MAX_CHUNKS chunks");
}

#[test]
fn a_server_error_is_its_errno_and_a_zero_errno_is_eio() {
    let e = serving(simple_reply(libc::EPERM as u32, 1)).flush();
    assert!(
        matches!(e, Err(ClientError::Server { errno }) if errno == libc::EPERM as u32),
        "{e:?}"
    );
    let e = serving(error_chunk(REPLY_FLAG_DONE, 0)).flush();
    assert!(
        matches!(e, Err(ClientError::Server { errno }) if errno == libc::EIO as u32),
        "{e:?}"
    );
    // An error chunk in a read's reply fails the read even when data chunks covered it.
    let mut reply = data_chunk(0, 0, &[1; 512]);
    reply.extend(error_chunk(REPLY_FLAG_DONE, libc::EIO as u32));
    let e = serving(reply).read(&mut [0; 512], 0);
    assert!(matches!(e, Err(ClientError::Server { .. })), "{e:?}");
}
