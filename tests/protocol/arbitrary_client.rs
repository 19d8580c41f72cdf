//! Arbitrary client bytes, before or after a valid handshake, never panic a connection and
//! always end it: the server answers, refuses, or hangs up, but never gets stuck or crashes.

use std::rc::Rc;

use nbd_proto::wire::consts::*;
use nbd_proto::wire::handshake::{ClientFlags, OptionHeader};
use nbd_proto::wire::option_data::{InfoRequest, MetaContextRequest};
use nbd_server::{serve_connection, Control, ExportEntry, Exports, MemExport};
use proptest::prelude::*;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

fn option(out: &mut Vec<u8>, option: u32, data: &[u8]) {
    out.extend_from_slice(
        &OptionHeader {
            option,
            length: data.len() as u32,
        }
        .encode(),
    );
    out.extend_from_slice(data);
}

/// A valid handshake reaching transmission in the given mode (0 simple, 1 structured,
/// 2 extended), with `base:allocation` selected when possible.
fn handshake(mode: u8) -> Vec<u8> {
    let mut out = ClientFlags {
        fixed_newstyle: true,
        no_zeroes: true,
    }
    .encode()
    .to_vec();
    match mode {
        1 => option(&mut out, OPT_STRUCTURED_REPLY, &[]),
        2 => option(&mut out, OPT_EXTENDED_HEADERS, &[]),
        _ => {}
    }
    if mode > 0 {
        let q = MetaContextRequest {
            name: b"",
            queries: vec![b"base:allocation"],
        };
        option(&mut out, OPT_SET_META_CONTEXT, &q.encode());
    }
    let go = InfoRequest {
        name: b"",
        requests: vec![],
    };
    option(&mut out, OPT_GO, &go.encode());
    out
}

/// Feeds `input` to one connection, then closes the client's side, reading everything the
/// server sends; returns when the connection ends, with the export's call counters and
/// what the server sent.
fn run_connection(input: Vec<u8>) -> (nbd_server::MemStats, Vec<u8>) {
    test_support::run(async move {
        let export = Rc::new(MemExport::new(1 << 20));
        let stats_of = Rc::clone(&export);
        export.fill(0, &[0x5a; 8192]);
        let exports = Exports::new(vec![ExportEntry::new("", export)]).unwrap();
        let (client, server) = tokio::io::duplex(1 << 16);
        let (server_read, server_write) = tokio::io::split(server);
        let (mut client_read, mut client_write) = tokio::io::split(client);
        let (_stop_tx, stop_rx) = tokio::sync::watch::channel(false);
        let feeder = tokio::task::spawn_local(async move {
            // The server may hang up before reading everything: that is allowed.
            let _ = client_write.write_all(&input).await;
            let _ = client_write.shutdown().await;
        });
        let drainer = tokio::task::spawn_local(async move {
            let mut sink = Vec::new();
            let _ = client_read.read_to_end(&mut sink).await;
            sink
        });
        let _ = serve_connection(
            server_read,
            server_write,
            &exports,
            Control::new(stop_rx.clone(), stop_rx),
        )
        .await;
        feeder.await.unwrap();
        let sent = drainer.await.unwrap();
        (stats_of.stats(), sent)
    })
}

#[test]
fn the_harness_reaches_the_export() {
    for mode in 0..3u8 {
        let mut input = handshake(mode);
        let w = nbd_proto::wire::request::RequestHeader {
            flags: 0,
            command: nbd_proto::wire::request::Command::Write,
            cookie: 1,
            offset: 0,
            length: 4,
        };
        match mode {
            2 => input.extend_from_slice(&w.encode_extended()),
            _ => input.extend_from_slice(&w.encode_compact().unwrap()),
        }
        input.extend_from_slice(b"abcd");
        let (stats, sent) = run_connection(input);
        assert_eq!(stats.writes, 1, "mode {mode}");
        assert!(sent.starts_with(b"NBDMAGIC"));
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(300))]

    #[test]
    fn arbitrary_bytes_from_the_first_byte(input in proptest::collection::vec(any::<u8>(), 0..512)) {
        let _ = run_connection(input);
    }

    #[test]
    fn arbitrary_bytes_after_a_valid_handshake(mode in 0u8..3, tail in proptest::collection::vec(any::<u8>(), 0..512)) {
        let mut input = handshake(mode);
        input.extend_from_slice(&tail);
        let _ = run_connection(input);
    }

    /// Well-framed requests with arbitrary fields: the most likely to reach deep code.
    #[test]
    fn arbitrary_request_fields_after_a_valid_handshake(
        mode in 0u8..3,
        reqs in proptest::collection::vec((any::<u16>(), 0u16..10, any::<u64>(), prop_oneof![any::<u64>(), 0u64..20_000]), 1..8),
    ) {
        let mut input = handshake(mode);
        for (i, (flags, command, offset, length)) in reqs.into_iter().enumerate() {
            let h = nbd_proto::wire::request::RequestHeader {
                flags,
                command: nbd_proto::wire::request::Command::from_code(command),
                cookie: i as u64,
                offset: offset % (2 << 20),
                length,
            };
            match (mode, h.encode_compact()) {
                (2, _) => input.extend_from_slice(&h.encode_extended()),
                (_, Some(b)) => input.extend_from_slice(&b),
                (_, None) => {}
            }
            if command == CMD_WRITE && length < 20_000 {
                input.resize(input.len() + length as usize, 0xc3);
            }
        }
        let _ = run_connection(input);
    }
}
