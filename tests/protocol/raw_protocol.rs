//! The protocol over a raw socket: a kernel-like client (simple replies), structured and
//! extended clients, and everything the spec says about their replies.

use crate::client::{closed, RawClient, Reply, Style};
use nbd_proto::wire::consts::*;
use nbd_proto::wire::handshake::{ClientFlags, ExportNameReply, OptionHeader};
use nbd_proto::wire::reply::{BlockStatusChunk, ChunkHeader, ErrorChunk};
use nbd_proto::wire::request::Command;
use nbd_proto::Errno;
use nbd_server::MemExport;
use std::io::{Read, Write};
use test_support::nbd_server::{mem_server, Opts};

const SIZE: u64 = 1 << 20;

fn pattern(len: usize, seed: u8) -> Vec<u8> {
    (0..len)
        .map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed))
        .collect()
}

#[test]
fn kernel_like_client_reads_writes_trims_and_flushes_with_simple_replies() {
    let server = mem_server(Opts::default(), || MemExport::new(SIZE));
    let mut c = RawClient::open(&server.socket, "", Style::Simple, &[]);
    assert_eq!(c.size, SIZE);
    assert_eq!(
        c.flags & FLAG_SEND_DF,
        0,
        "DF must not be advertised without structured replies"
    );
    for bit in [
        FLAG_SEND_FLUSH,
        FLAG_SEND_FUA,
        FLAG_SEND_TRIM,
        FLAG_SEND_WRITE_ZEROES,
    ] {
        assert_ne!(c.flags & bit, 0, "flag {bit:#x}");
    }

    let data = pattern(65536, 7);
    c.request(Command::Write, 0, 1, 4096, 65536, &data);
    assert_eq!(c.reply(0).error(), 0);
    c.request(Command::Read, 0, 2, 4096, 65536, &[]);
    let r = c.reply(65536);
    assert!(matches!(r, Reply::Simple(..)));
    assert_eq!((r.cookie(), r.error()), (2, 0));
    assert_eq!(r.data(4096, 65536), data);

    // A hole reads as zeroes in a simple reply.
    c.request(Command::Read, 0, 3, 131072, 8192, &[]);
    assert_eq!(c.reply(8192).data(131072, 8192), vec![0; 8192]);

    c.request(Command::Trim, 0, 4, 8192, 16384, &[]);
    assert_eq!(c.reply(0).error(), 0);
    c.request(Command::Flush, 0, 5, 0, 0, &[]);
    assert_eq!(c.reply(0).error(), 0);
    c.request(Command::Write, CMD_FLAG_FUA, 6, 0, 512, &pattern(512, 1));
    assert_eq!(c.reply(0).error(), 0);

    // Errors in simple mode carry no payload and keep the stream in sync.
    c.request(Command::Read, 0, 7, SIZE, 1, &[]);
    let r = c.reply(1);
    assert_eq!(r.error(), Errno::Inval.code());
    c.request(Command::Read, CMD_FLAG_DF, 8, 0, 512, &[]);
    assert_eq!(
        c.reply(512).error(),
        Errno::Inval.code(),
        "DF is invalid without structured replies"
    );
    c.request(Command::BlockStatus, 0, 9, 0, 512, &[]);
    assert_eq!(c.reply(0).error(), Errno::Inval.code());
    c.request(Command::Read, 0, 10, 0, 512, &[]);
    assert_eq!(c.reply(512).data(0, 512), pattern(512, 1));

    c.request(Command::Disc, 0, 11, 0, 0, &[]);
    assert!(closed(&mut c.stream));

    let (report, snaps) = server.stop();
    assert_eq!(report.connections, 1);
    let s = &snaps[0];
    assert_eq!((s.stats.trims, s.stats.fua_writes), (1, 1));
    assert!(s.stats.flushes >= 2, "the FLUSH and the shutdown flush");
    assert_eq!(&s.contents[4096..8192], &data[..4096]);
    assert!(
        s.contents[8192..24576].iter().all(|&b| b == 0),
        "whole granules were trimmed"
    );
    assert_eq!(&s.contents[24576..69632], &data[20480..]);
}

#[test]
fn non_fixed_newstyle_export_name_with_and_without_zeroes() {
    let server = mem_server(Opts::default(), || MemExport::new(SIZE));
    for no_zeroes in [false, true] {
        let (mut s, _) = RawClient::connect(&server.socket);
        s.write_all(
            &ClientFlags {
                fixed_newstyle: false,
                no_zeroes,
            }
            .encode(),
        )
        .unwrap();
        s.write_all(
            &OptionHeader {
                option: OPT_EXPORT_NAME,
                length: 0,
            }
            .encode(),
        )
        .unwrap();
        let mut head = [0u8; 10];
        s.read_exact(&mut head).unwrap();
        let r = ExportNameReply::decode(&head).unwrap();
        assert_eq!(r.size, SIZE);
        if !no_zeroes {
            let mut pad = [1u8; 124];
            s.read_exact(&mut pad).unwrap();
            assert_eq!(pad, [0; 124]);
        }
        let mut c = RawClient {
            stream: s,
            style: Style::Simple,
            size: r.size,
            flags: r.flags,
            contexts: vec![],
        };
        c.request(Command::Read, 0, 1, 0, 16, &[]);
        assert_eq!(c.reply(16).data(0, 16), vec![0; 16]);
    }
    // A non-fixed client sending anything but EXPORT_NAME is hung up on.
    let (mut s, _) = RawClient::connect(&server.socket);
    s.write_all(&0u32.to_be_bytes()).unwrap();
    s.write_all(
        &OptionHeader {
            option: OPT_LIST,
            length: 0,
        }
        .encode(),
    )
    .unwrap();
    assert!(closed(&mut s));
}

#[test]
fn structured_reads_send_holes_and_honour_df() {
    let server = mem_server(Opts::default(), || {
        let m = MemExport::new(SIZE);
        m.fill(0, &pattern(4096, 3));
        m.fill(8192, &pattern(4096, 4));
        m
    });
    let mut c = RawClient::open(&server.socket, "", Style::Structured, &[]);
    assert_ne!(c.flags & FLAG_SEND_DF, 0);
    c.request(Command::Read, 0, 1, 0, 12288, &[]);
    let Reply::Chunks(chunks) = c.reply(0) else {
        panic!("READ must get a structured reply")
    };
    let kinds: Vec<u16> = chunks.iter().map(|(h, _)| h.reply_type).collect();
    assert_eq!(
        kinds,
        [
            REPLY_TYPE_OFFSET_DATA,
            REPLY_TYPE_OFFSET_HOLE,
            REPLY_TYPE_OFFSET_DATA
        ]
    );
    assert!(chunks.last().unwrap().0.is_done());
    let r = Reply::Chunks(chunks);
    let mut want = pattern(4096, 3);
    want.extend(vec![0; 4096]);
    want.extend(pattern(4096, 4));
    assert_eq!(r.data(0, 12288), want);

    c.request(Command::Read, CMD_FLAG_DF, 2, 0, 12288, &[]);
    let Reply::Chunks(chunks) = c.reply(0) else {
        panic!()
    };
    assert_eq!(chunks.len(), 1, "DF: one content chunk");
    assert_eq!(Reply::Chunks(chunks).data(0, 12288), want);

    // A zero-length read still gets a structured reply.
    c.request(Command::Read, 0, 3, 0, 0, &[]);
    let Reply::Chunks(chunks) = c.reply(0) else {
        panic!()
    };
    assert_eq!((chunks[0].0.reply_type, chunks.len()), (REPLY_TYPE_NONE, 1));

    // Errors are error chunks with a message.
    c.request(Command::Write, 0, 4, SIZE - 10, 20, &[0; 20]);
    let Reply::Chunks(chunks) = c.reply(0) else {
        panic!()
    };
    let e = ErrorChunk::decode(chunks[0].0.reply_type, &chunks[0].1).unwrap();
    assert_eq!(e.error, Errno::NoSpc.code());
    assert!(!e.message.is_empty());
}

#[test]
fn read_errors_from_the_export_reach_the_client_and_the_connection_survives() {
    let server = mem_server(Opts::default(), || {
        let m = MemExport::new(SIZE);
        m.fail_range(65536, 512, Errno::Io);
        m
    });
    for style in [Style::Simple, Style::Structured, Style::Extended] {
        let mut c = RawClient::open(&server.socket, "", style, &[]);
        c.request(Command::Read, 0, 1, 65536 - 512, 1024, &[]);
        assert_eq!(c.reply(1024).error(), Errno::Io.code(), "{style:?}");
        c.request(Command::Read, 0, 2, 0, 1024, &[]);
        assert_eq!(c.reply(1024).error(), 0, "{style:?}");
    }
}

#[test]
fn block_status_reports_both_contexts_and_honours_req_one() {
    let server = mem_server(Opts::default(), || {
        let base = MemExport::new(SIZE);
        base.fill(0, &[1; 8192]);
        let top = MemExport::new(SIZE).with_backing(base);
        top.fill(4096, &[2; 4096]);
        top
    });
    for style in [Style::Structured, Style::Extended] {
        let mut c = RawClient::open(
            &server.socket,
            "",
            style,
            &["base:allocation", "qemu:allocation-depth"],
        );
        assert_eq!(c.contexts.len(), 2);
        let id = |name: &str| c.contexts.iter().find(|(_, n)| n == name).unwrap().0;
        let (base_id, depth_id) = (id("base:allocation"), id("qemu:allocation-depth"));
        c.request(Command::BlockStatus, 0, 1, 0, SIZE, &[]);
        let Reply::Chunks(chunks) = c.reply(0) else {
            panic!()
        };
        assert_eq!(chunks.len(), 2);
        for (h, p) in &chunks {
            let bs = match style {
                Style::Extended => {
                    assert_eq!(h.reply_type, REPLY_TYPE_BLOCK_STATUS_EXT);
                    BlockStatusChunk::decode_extended(p).unwrap()
                }
                _ => {
                    assert_eq!(h.reply_type, REPLY_TYPE_BLOCK_STATUS);
                    BlockStatusChunk::decode_compact(p).unwrap()
                }
            };
            let got: Vec<(u64, u64)> = bs
                .descriptors
                .iter()
                .map(|d| (d.length, d.status))
                .collect();
            if bs.context_id == base_id {
                // Adjacent data extents of different depth merge for base:allocation.
                assert_eq!(got, [(8192, 0), (SIZE - 8192, 3)]);
            } else {
                assert_eq!(bs.context_id, depth_id);
                assert_eq!(got, [(4096, 2), (4096, 1), (SIZE - 8192, 0)]);
            }
        }
        c.request(Command::BlockStatus, CMD_FLAG_REQ_ONE, 2, 8192, 1000, &[]);
        let Reply::Chunks(chunks) = c.reply(0) else {
            panic!()
        };
        for (_, p) in &chunks {
            let bs = match style {
                Style::Extended => BlockStatusChunk::decode_extended(p).unwrap(),
                _ => BlockStatusChunk::decode_compact(p).unwrap(),
            };
            assert_eq!(bs.descriptors.len(), 1);
            assert_eq!(bs.descriptors[0].length, 1000);
        }
    }
}

#[test]
fn extended_headers_carry_64_bit_effect_lengths_and_payload_lengths() {
    const BIG: u64 = 8 << 30; // 8 GiB: effect lengths beyond 32 bits
    let server = mem_server(Opts::default(), || MemExport::new(BIG));
    let mut c = RawClient::open(&server.socket, "", Style::Extended, &["base:allocation"]);
    assert_eq!(c.size, BIG);
    let data = pattern(4096, 9);
    c.request(
        Command::Write,
        CMD_FLAG_PAYLOAD_LEN,
        1,
        BIG - 4096,
        4096,
        &data,
    );
    let Reply::Chunks(chunks) = c.reply(0) else {
        panic!()
    };
    assert_eq!(
        (chunks[0].0.reply_type, chunks[0].0.offset),
        (REPLY_TYPE_NONE, BIG - 4096)
    );
    // QEMU's client omits PAYLOAD_LEN on writes; like QEMU's server, accept that.
    c.request(Command::Write, 0, 2, 0, 4, b"qemu");
    assert_eq!(c.reply(0).error(), 0);
    // A payload on a command that takes none is skipped, then refused.
    c.request(Command::Trim, CMD_FLAG_PAYLOAD_LEN, 3, 0, 100, &[0; 100]);
    assert_eq!(c.reply(0).error(), Errno::Inval.code());
    // 64-bit zeroing and block status over the whole 8 GiB.
    c.request(Command::WriteZeroes, 0, 4, 0, BIG - 4096, &[]);
    assert_eq!(c.reply(0).error(), 0);
    c.request(Command::BlockStatus, 0, 5, 0, BIG, &[]);
    let Reply::Chunks(chunks) = c.reply(0) else {
        panic!()
    };
    let bs = BlockStatusChunk::decode_extended(&chunks[0].1).unwrap();
    let got: Vec<(u64, u64)> = bs
        .descriptors
        .iter()
        .map(|d| (d.length, d.status))
        .collect();
    assert_eq!(got, [(BIG - 4096, 3), (4096, 0)]);
    c.request(Command::Read, 0, 6, BIG - 4096, 4096, &[]);
    assert_eq!(c.reply(0).data(BIG - 4096, 4096), data);
    // A payload above the maximum gets a hard disconnect, as the spec recommends.
    c.request(
        Command::Write,
        CMD_FLAG_PAYLOAD_LEN,
        7,
        0,
        u64::from(MAX_PAYLOAD) + 1,
        &[],
    );
    assert!(closed(&mut c.stream));
}

#[test]
fn compact_oversized_write_payload_is_skipped_and_refused() {
    let server = mem_server(Opts::default(), || MemExport::new(128 << 20));
    let mut c = RawClient::open(&server.socket, "", Style::Structured, &[]);
    let len = MAX_PAYLOAD as usize + 4096;
    c.request(Command::Write, 0, 1, 0, len as u64, &vec![0xee; len]);
    assert_eq!(c.reply(0).error(), Errno::Inval.code());
    c.request(Command::Read, 0, 2, 0, 4096, &[]);
    assert_eq!(
        c.reply(0).data(0, 4096),
        vec![0; 4096],
        "the refused write changed nothing"
    );
    c.request(Command::Read, 0, 3, 0, u64::from(MAX_PAYLOAD) + 1, &[]);
    assert_eq!(
        c.reply(0).error(),
        Errno::Inval.code(),
        "reads are bounded by the maximum payload"
    );
}

#[test]
fn requests_are_pipelined_and_answered_by_cookie() {
    let server = mem_server(Opts::default(), || MemExport::new(SIZE));
    let mut c = RawClient::open(&server.socket, "", Style::Structured, &[]);
    // Send 64 writes back to back without reading, then 64 reads, then collect.
    for i in 0..64u64 {
        c.request(
            Command::Write,
            0,
            i,
            i * 4096,
            4096,
            &pattern(4096, i as u8),
        );
    }
    for i in 0..64u64 {
        c.request(Command::Read, 0, 1000 + i, i * 4096, 4096, &[]);
    }
    let mut seen = std::collections::BTreeSet::new();
    for _ in 0..128 {
        let r = c.any_reply();
        assert_eq!(r.error(), 0);
        let cookie = r.cookie();
        if cookie >= 1000 {
            let i = cookie - 1000;
            assert_eq!(r.data(i * 4096, 4096), pattern(4096, i as u8));
        }
        assert!(seen.insert(cookie), "cookie {cookie} answered twice");
    }
    assert_eq!(seen.len(), 128);
}

#[test]
fn unknown_options_and_huge_option_payloads_do_not_end_negotiation() {
    let server = mem_server(Opts::default(), || MemExport::new(SIZE));
    let (stream, _) = RawClient::connect(&server.socket);
    let mut c = RawClient {
        stream,
        style: Style::Simple,
        size: 0,
        flags: 0,
        contexts: vec![],
    };
    c.send(
        &ClientFlags {
            fixed_newstyle: true,
            no_zeroes: false,
        }
        .encode(),
    );
    assert_eq!(c.option(99, b"whatever")[0].0.reply_type, REP_ERR_UNSUP);
    // A server without TLS refuses STARTTLS by policy, as qemu-nbd does.
    assert_eq!(c.option(OPT_STARTTLS, &[])[0].0.reply_type, REP_ERR_POLICY);
    // 3 MiB of option data: drained in small pieces, refused as too big.
    assert_eq!(
        c.option(OPT_LIST, &vec![0; 3 << 20])[0].0.reply_type,
        REP_ERR_TOO_BIG
    );
    let list = c.option(OPT_LIST, &[]);
    assert_eq!(list.len(), 2);
    assert_eq!(c.option(OPT_ABORT, &[])[0].0.reply_type, REP_ACK);
    assert!(closed(&mut c.stream));
}

#[test]
fn garbage_from_one_client_never_disturbs_another() {
    let server = mem_server(Opts::default(), || MemExport::new(SIZE));
    let mut good = RawClient::open(&server.socket, "", Style::Structured, &[]);
    good.request(Command::Write, 0, 1, 0, 4, b"good");
    assert_eq!(good.reply(0).error(), 0);

    // Bad client flags.
    let (mut s, _) = RawClient::connect(&server.socket);
    s.write_all(&0xffff_ffffu32.to_be_bytes()).unwrap();
    assert!(closed(&mut s));
    // Garbage option magic.
    let (mut s, _) = RawClient::connect(&server.socket);
    s.write_all(&1u32.to_be_bytes()).unwrap();
    s.write_all(b"GARBAGE!GARBAGE!").unwrap();
    assert!(closed(&mut s));
    // Garbage request magic after a good handshake.
    let mut bad = RawClient::open(&server.socket, "", Style::Structured, &[]);
    bad.send(&[0xde; 28]);
    assert!(closed(&mut bad.stream));
    // A request header cut short, then hang up.
    let mut cut = RawClient::open(&server.socket, "", Style::Simple, &[]);
    cut.send(&REQUEST_MAGIC.to_be_bytes());
    cut.send(&[0, 0, 0, 1, 0, 0]);
    drop(cut);
    // A write whose payload stops halfway, then hang up.
    let mut half = RawClient::open(&server.socket, "", Style::Simple, &[]);
    half.request(Command::Write, 0, 9, 8192, 65536, &[0x55; 30000]);
    drop(half);
    // Unknown command and unknown flags: answered with EINVAL, connection stays usable.
    let mut odd = RawClient::open(&server.socket, "", Style::Simple, &[]);
    odd.request(Command::Unknown(200), 0, 1, 0, 0, &[]);
    assert_eq!(odd.reply(0).error(), Errno::Inval.code());
    odd.request(Command::Read, 1 << 14, 2, 0, 1, &[]);
    assert_eq!(odd.reply(1).error(), Errno::Inval.code());

    // The first client never noticed, and a new one is served.
    good.request(Command::Read, 0, 2, 0, 4, &[]);
    assert_eq!(good.reply(0).data(0, 4), b"good");
    let mut fresh = RawClient::open(&server.socket, "", Style::Extended, &[]);
    fresh.request(Command::Read, 0, 1, 8192, 16, &[]);
    assert_eq!(
        fresh.reply(0).data(8192, 16),
        vec![0; 16],
        "a half-sent write is never applied"
    );
    drop((good, odd, fresh));
    let (report, _) = server.stop();
    assert!(report.failed_connections >= 4, "{report:?}");
}

#[test]
fn read_only_exports_refuse_writes_with_eperm() {
    let server = mem_server(Opts::default(), || {
        MemExport::new(SIZE).with_features(nbd_server::ExportFeatures {
            read_only: true,
            ..Default::default()
        })
    });
    let mut c = RawClient::open(&server.socket, "", Style::Structured, &[]);
    assert_ne!(c.flags & FLAG_READ_ONLY, 0);
    assert_eq!(
        c.flags & (FLAG_SEND_TRIM | FLAG_SEND_WRITE_ZEROES | FLAG_SEND_FAST_ZERO),
        0
    );
    c.request(Command::Write, 0, 1, 0, 4, b"nope");
    assert_eq!(c.reply(0).error(), Errno::Perm.code());
    c.request(Command::Trim, 0, 2, 0, 4096, &[]);
    assert_eq!(c.reply(0).error(), Errno::Perm.code());
    c.request(Command::WriteZeroes, 0, 3, 0, 4096, &[]);
    assert_eq!(c.reply(0).error(), Errno::Perm.code());
    c.request(Command::Read, 0, 4, 0, 4, &[]);
    assert_eq!(c.reply(0).data(0, 4), vec![0; 4]);
}

#[test]
fn fast_zero_that_would_be_slow_fails_with_enotsup() {
    let server = mem_server(Opts::default(), || MemExport::new(SIZE));
    let mut c = RawClient::open(&server.socket, "", Style::Structured, &[]);
    assert_ne!(c.flags & FLAG_SEND_FAST_ZERO, 0);
    c.request(Command::WriteZeroes, CMD_FLAG_FAST_ZERO, 1, 100, 4096, &[]);
    assert_eq!(c.reply(0).error(), Errno::NotSup.code());
    c.request(
        Command::WriteZeroes,
        CMD_FLAG_FAST_ZERO | CMD_FLAG_NO_HOLE,
        2,
        0,
        65536,
        &[],
    );
    assert_eq!(c.reply(0).error(), 0);
    drop(c);
    let (_, snaps) = server.stop();
    assert_eq!(snaps[0].stats.fast_zero_refusals, 1);
    assert_eq!(
        snaps[0].extents[0],
        nbd_server::Extent {
            len: 65536,
            hole: false,
            zero: true,
            depth: 1
        }
    );
}

#[test]
fn chunk_headers_echo_the_request_offset_in_extended_mode() {
    let server = mem_server(Opts::default(), || MemExport::new(SIZE));
    let mut c = RawClient::open(&server.socket, "", Style::Extended, &[]);
    c.request(Command::Read, 0, 77, 12345, 100, &[]);
    let Reply::Chunks(chunks) = c.reply(0) else {
        panic!()
    };
    assert!(chunks
        .iter()
        .all(|(h, _): &(ChunkHeader, Vec<u8>)| h.offset == 12345 && h.cookie == 77));
}
