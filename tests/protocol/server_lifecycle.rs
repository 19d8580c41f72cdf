//! Server lifecycle: out-of-order replies, graceful shutdown with requests in flight,
//! non-persistent exit, the connection limit and the handshake time limit.
//!
//! Ordering is forced with a gate instead of timing: reads at [`GATE`] block inside the
//! export until the test opens the gate, so "this reply came first" is deterministic.

use std::rc::Rc;
use std::sync::mpsc;
use std::sync::Arc;
use std::time::Duration;

use crate::client::{closed, RawClient, Style};
use nbd_proto::wire::request::Command;
use nbd_proto::Errno;
use nbd_server::{
    Export, ExportEntry, ExportFeatures, Extent, MemExport, MemStats, ReadChunk, ServerConfig,
    WriteZeroesFlags,
};
use test_support::nbd_server::{mem_server, Opts, TestServer};
use test_support::wait_until;
use tokio::sync::Notify;

const GATE: u64 = 65536;

/// A [`MemExport`] whose reads at [`GATE`] wait for the test to open the gate.
struct Gated {
    inner: MemExport,
    entered: mpsc::Sender<()>,
    gate: Arc<Notify>,
}

impl Export for Gated {
    type Buf = Vec<u8>;
    fn size(&self) -> u64 {
        self.inner.size()
    }
    fn features(&self) -> ExportFeatures {
        self.inner.features()
    }
    async fn read(&self, offset: u64, len: usize) -> Result<Vec<ReadChunk<Vec<u8>>>, Errno> {
        if offset == GATE {
            let _ = self.entered.send(());
            self.gate.notified().await;
        }
        self.inner.read(offset, len).await
    }
    async fn write(&self, offset: u64, data: Vec<u8>, fua: bool) -> Result<(), Errno> {
        self.inner.write(offset, data, fua).await
    }
    async fn write_zeroes(
        &self,
        offset: u64,
        len: u64,
        flags: WriteZeroesFlags,
    ) -> Result<(), Errno> {
        self.inner.write_zeroes(offset, len, flags).await
    }
    async fn trim(&self, offset: u64, len: u64, fua: bool) -> Result<(), Errno> {
        self.inner.trim(offset, len, fua).await
    }
    async fn flush(&self) -> Result<(), Errno> {
        self.inner.flush().await
    }
    async fn cache(&self, offset: u64, len: u64) -> Result<(), Errno> {
        self.inner.cache(offset, len).await
    }
    async fn block_status(&self, offset: u64, len: u64) -> Result<Vec<Extent>, Errno> {
        self.inner.block_status(offset, len).await
    }
}

struct GatedServer {
    server: TestServer<MemStats>,
    entered: mpsc::Receiver<()>,
    gate: Arc<Notify>,
}

fn gated_server(opts: Opts) -> GatedServer {
    let (tx, entered) = mpsc::channel();
    let gate = Arc::new(Notify::new());
    let g = Arc::clone(&gate);
    let server = TestServer::start_with(
        opts,
        move || {
            let inner = MemExport::new(1 << 20);
            inner.fill(GATE, b"gated data");
            vec![ExportEntry::new(
                "",
                Rc::new(Gated {
                    inner,
                    entered: tx,
                    gate: g,
                }),
            )]
        },
        |entries| entries[0].export.inner.stats(),
    );
    GatedServer {
        server,
        entered,
        gate,
    }
}

#[test]
fn replies_come_back_in_completion_order() {
    let g = gated_server(Opts::default());
    let mut c = RawClient::open(&g.server.socket, "", Style::Structured, &[]);
    c.request(Command::Read, 0, 1, GATE, 10, &[]);
    g.entered.recv().unwrap();
    c.request(Command::Write, 0, 2, 0, 5, b"later");
    c.request(Command::Read, 0, 3, 0, 5, &[]);
    let second = c.any_reply();
    assert_eq!(
        (second.cookie(), second.error()),
        (2, 0),
        "the write overtakes the blocked read"
    );
    let third = c.any_reply();
    assert_eq!(third.cookie(), 3);
    assert_eq!(third.data(0, 5), b"later");
    g.gate.notify_one();
    let first = c.any_reply();
    assert_eq!(first.cookie(), 1);
    assert_eq!(first.data(GATE, 10), b"gated data");
}

#[test]
fn shutdown_stops_accepting_finishes_in_flight_requests_then_flushes() {
    let mut g = gated_server(Opts::default());
    let mut c = RawClient::open(&g.server.socket, "", Style::Simple, &[]);
    c.request(Command::Write, 0, 1, 0, 4, b"kept");
    assert_eq!(c.reply(0).error(), 0);
    c.request(Command::Read, 0, 2, GATE, 10, &[]);
    g.entered.recv().unwrap();

    g.server.signal_shutdown();
    // The listener goes away (and its socket file with it) while the read is in flight.
    let socket = g.server.socket.clone();
    wait_until(
        Duration::from_secs(10),
        "the server stops listening",
        || !socket.exists(),
    );
    assert!(std::os::unix::net::UnixStream::connect(&socket).is_err());

    g.gate.notify_one();
    let r = c.reply(10);
    assert_eq!((r.cookie(), r.error()), (2, 0));
    assert_eq!(
        r.data(GATE, 10),
        b"gated data",
        "the in-flight read completed"
    );
    assert!(
        closed(&mut c.stream),
        "then the server closed the connection"
    );

    let (report, stats) = g.server.join();
    assert!(report.shut_down);
    assert_eq!(stats.flushes, 1, "the export was flushed once at shutdown");
}

#[test]
fn without_persistent_the_server_exits_when_its_client_leaves() {
    let opts = Opts {
        config: ServerConfig {
            persistent: false,
            ..ServerConfig::default()
        },
        ..Opts::default()
    };
    let server = mem_server(opts, || MemExport::new(1 << 20));
    let mut c = RawClient::open(&server.socket, "", Style::Simple, &[]);
    c.request(Command::Write, 0, 1, 0, 3, b"bye");
    assert_eq!(c.reply(0).error(), 0);
    c.request(Command::Disc, 0, 2, 0, 0, &[]);
    drop(c);
    let (report, snaps) = server.join();
    assert!(!report.shut_down);
    assert_eq!(report.connections, 1);
    assert_eq!(&snaps[0].contents[..3], b"bye");
    assert_eq!(snaps[0].stats.flushes, 1, "flushed on exit");
}

#[test]
fn the_connection_limit_holds_further_clients_until_a_slot_frees() {
    let opts = Opts {
        config: ServerConfig {
            persistent: true,
            max_connections: std::num::NonZeroUsize::new(1),
            handshake_timeout: None,
            ..ServerConfig::default()
        },
        ..Opts::default()
    };
    let server = mem_server(opts, || MemExport::new(1 << 20));
    let mut first = RawClient::open(&server.socket, "", Style::Simple, &[]);
    // The second client negotiates (so an idle handshake can never block a real client),
    // but its requests are not served while the limit is taken.
    let mut second = RawClient::open(&server.socket, "", Style::Simple, &[]);
    second.request(Command::Read, 0, 7, 0, 4, &[]);
    second
        .stream
        .set_read_timeout(Some(Duration::from_millis(300)))
        .unwrap();
    let mut buf = [0u8; 4];
    let early = std::io::Read::read(&mut second.stream, &mut buf);
    assert!(
        matches!(&early, Err(e) if e.kind() == std::io::ErrorKind::WouldBlock),
        "a second client was served while the limit is 1: {early:?}"
    );
    first.request(Command::Disc, 0, 1, 0, 0, &[]);
    drop(first);
    second
        .stream
        .set_read_timeout(Some(Duration::from_secs(60)))
        .unwrap();
    let reply = second.reply(4);
    assert_eq!(
        (reply.error(), reply.cookie()),
        (0, 7),
        "served once the first left"
    );
}

#[test]
fn clients_that_stall_the_handshake_are_dropped() {
    let opts = Opts {
        config: ServerConfig {
            persistent: true,
            max_connections: None,
            handshake_timeout: Some(Duration::from_millis(200)),
            ..ServerConfig::default()
        },
        ..Opts::default()
    };
    let server = mem_server(opts, || MemExport::new(1 << 20));
    let (mut idle, _) = RawClient::connect(&server.socket);
    assert!(closed(&mut idle));
    let mut ok = RawClient::open(&server.socket, "", Style::Simple, &[]);
    ok.request(Command::Read, 0, 1, 0, 1, &[]);
    assert_eq!(ok.reply(1).error(), 0);
    drop(ok);
    let (report, _) = server.stop();
    assert_eq!(report.failed_connections, 1);
}

#[test]
fn shutdown_during_the_handshake_closes_the_client() {
    let server = mem_server(Opts::default(), || MemExport::new(1 << 20));
    let (mut waiting, _) = RawClient::connect(&server.socket);
    let (report, _) = server.stop();
    assert!(report.shut_down);
    assert!(closed(&mut waiting));
}
