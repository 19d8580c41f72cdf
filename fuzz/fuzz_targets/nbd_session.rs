//! A whole NBD connection fed hostile client bytes, from the first byte or after a valid
//! handshake in each reply mode: the server never panics, never allocates a claimed length
//! it has not checked, and always ends the connection.
#![no_main]

use std::rc::Rc;

use libfuzzer_sys::fuzz_target;
use nbd_proto::wire::consts::*;
use nbd_proto::wire::handshake::{ClientFlags, OptionHeader};
use nbd_proto::wire::option_data::{InfoRequest, MetaContextRequest};
use nbd_server::{serve_connection, Control, ExportEntry, Exports, MemExport};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

fn option(out: &mut Vec<u8>, option: u32, data: &[u8]) {
    let length = u32::try_from(data.len()).expect("small option");
    out.extend_from_slice(&OptionHeader { option, length }.encode());
    out.extend_from_slice(data);
}

/// Client bytes that reach transmission: simple (0), structured (1) or extended (2) replies,
/// with both metadata contexts selected when replies can carry them.
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
            queries: vec![b"base:allocation", b"qemu:allocation-depth"],
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

fuzz_target!(|data: &[u8]| {
    let Some((&selector, tail)) = data.split_first() else {
        return;
    };
    let mut input = match selector % 4 {
        3 => Vec::new(),
        mode => handshake(mode),
    };
    input.extend_from_slice(tail);
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("runtime");
    let local = tokio::task::LocalSet::new();
    local.block_on(&rt, async move {
        let export = Rc::new(MemExport::new(1 << 20));
        export.fill(0, &[0x5a; 8192]);
        let exports = Exports::new(vec![ExportEntry::new("", export)]).expect("one export");
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
        });
        let control = Control::new(stop_rx.clone(), stop_rx);
        let _ = serve_connection(server_read, server_write, &exports, control).await;
        feeder.await.expect("feeder");
        drainer.await.expect("drainer");
    });
});
