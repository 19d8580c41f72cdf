//! The nbd-server crate's server in-process, on a thread of its own with the runtime the product
//! uses, serving exports the test builds: for tests that must see what reached the export
//! (a [`MemExport`]'s contents, allocation and call counts) or that need exports the
//! `qcow2-nbd` binary cannot make (several at once, any feature flags).

use std::net::SocketAddr;
use std::num::NonZeroUsize;
use std::path::{Path, PathBuf};
use std::rc::Rc;
use std::thread::JoinHandle;

use nbd_server::{
    Export, ExportEntry, Extent, Listener, MemExport, MemStats, SendBuf, ServeReport, Server,
    ServerConfig,
};

/// A server running on a background thread until [`TestServer::stop`].
pub struct TestServer<T: Send + 'static> {
    dir: tempfile::TempDir,
    pub socket: PathBuf,
    pub tcp: Option<SocketAddr>,
    stop: Option<tokio::sync::oneshot::Sender<()>>,
    thread: Option<JoinHandle<(ServeReport, T)>>,
}

/// What a test can inspect of a [`MemExport`] after the server stopped.
#[derive(Debug, Clone)]
pub struct Snapshot {
    pub name: String,
    /// Contents, for exports up to 256 MiB (empty for larger ones).
    pub contents: Vec<u8>,
    pub extents: Vec<Extent>,
    pub stats: MemStats,
}

/// Server options for tests: persistent and unlimited unless a test says otherwise, on
/// two threads so that clients cross threads to reach the exports (the first client of a
/// server is served by the worker thread, the second on the exports' own thread).
#[derive(Debug, Clone)]
pub struct Opts {
    pub config: ServerConfig,
    pub tcp: bool,
    pub threads: NonZeroUsize,
}

impl Default for Opts {
    fn default() -> Self {
        Self {
            config: ServerConfig {
                persistent: true,
                max_connections: None,
                handshake_timeout: None,
                ..ServerConfig::default()
            },
            tcp: false,
            threads: NonZeroUsize::new(2).expect("non-zero"),
        }
    }
}

impl<T: Send + 'static> TestServer<T> {
    /// Starts a server whose exports `make` builds on the server thread; after it stops,
    /// `finish` inspects them there and its result is returned by [`TestServer::stop`].
    pub fn start_with<E, M, F>(opts: Opts, make: M, finish: F) -> Self
    where
        E: Export + 'static,
        E::Buf: SendBuf,
        M: FnOnce() -> Vec<ExportEntry<E>> + Send + 'static,
        F: FnOnce(&[ExportEntry<E>]) -> T + Send + 'static,
    {
        // RUST_LOG=nbd=debug shows the server's view when a test fails.
        let _ = tracing_subscriber::fmt()
            .with_env_filter(tracing_subscriber::EnvFilter::from_default_env())
            .with_test_writer()
            .try_init();
        let dir = tempfile::tempdir().expect("temp dir");
        let socket = dir.path().join("nbd.sock");
        let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
        let (ready_tx, ready_rx) = std::sync::mpsc::channel();
        let path = socket.clone();
        let thread = std::thread::spawn(move || {
            crate::run(async move {
                let entries = make();
                let mut listeners = vec![Listener::bind_unix(&path).expect("bind unix socket")];
                let mut tcp = None;
                if opts.tcp {
                    let l = Listener::bind_tcp("127.0.0.1:0".parse().unwrap())
                        .await
                        .expect("bind tcp");
                    tcp = l.local_tcp_addr();
                    listeners.push(l);
                }
                ready_tx.send(tcp).expect("test thread waits");
                let server = Server::new(entries.clone(), opts.config)
                    .expect("valid exports")
                    .with_threads(opts.threads);
                let report = server
                    .serve(listeners, async {
                        let _ = stop_rx.await;
                    })
                    .await
                    .expect("serve");
                (report, finish(&entries))
            })
        });
        let tcp = ready_rx.recv().expect("server thread started");
        Self {
            dir,
            socket,
            tcp,
            stop: Some(stop_tx),
            thread: Some(thread),
        }
    }

    /// `nbd+unix` URI of the default export.
    pub fn uri(&self) -> String {
        crate::nbd_unix_uri(&self.socket, "")
    }

    /// `nbd+unix` URI of a named export.
    pub fn uri_of(&self, export: &str) -> String {
        crate::nbd_unix_uri(&self.socket, export)
    }

    /// A scratch directory that lives as long as the server.
    pub fn dir(&self) -> &Path {
        self.dir.path()
    }

    /// Signals shutdown (if the server still runs) and waits for it.
    pub fn stop(mut self) -> (ServeReport, T) {
        self.finish()
    }

    /// Waits for a server that stops by itself (not persistent).
    pub fn join(mut self) -> (ServeReport, T) {
        // Keep the shutdown sender alive: dropping it would count as a shutdown signal.
        self.thread
            .take()
            .expect("running")
            .join()
            .expect("server thread panicked")
    }

    /// Sends the shutdown signal without waiting.
    pub fn signal_shutdown(&mut self) {
        if let Some(tx) = self.stop.take() {
            let _ = tx.send(());
        }
    }

    fn finish(&mut self) -> (ServeReport, T) {
        self.signal_shutdown();
        self.thread
            .take()
            .expect("running")
            .join()
            .expect("server thread panicked")
    }
}

impl<T: Send + 'static> Drop for TestServer<T> {
    fn drop(&mut self) {
        if self.thread.is_some() && !std::thread::panicking() {
            let _ = self.finish();
        }
    }
}

/// Snapshots of every export.
pub fn snapshots(entries: &[ExportEntry<MemExport>]) -> Vec<Snapshot> {
    entries
        .iter()
        .map(|e| Snapshot {
            name: e.name.clone(),
            contents: if e.export.size() <= 256 << 20 {
                e.export.contents()
            } else {
                Vec::new()
            },
            extents: e.export.extents(),
            stats: e.export.stats(),
        })
        .collect()
}

/// A server with one default export built by `make`.
pub fn mem_server<M>(opts: Opts, make: M) -> TestServer<Vec<Snapshot>>
where
    M: FnOnce() -> MemExport + Send + 'static,
{
    TestServer::start_with(
        opts,
        move || vec![ExportEntry::new("", Rc::new(make()))],
        snapshots,
    )
}
