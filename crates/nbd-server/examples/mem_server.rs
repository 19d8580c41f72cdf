//! Serves an in-memory export, to try clients against the protocol layer alone and to
//! measure it without any storage underneath:
//!
//! ```sh
//! cargo run --release -p nbd-server --example mem_server -- /tmp/mem.sock 1G
//! nbdinfo --json 'nbd+unix:///?socket=/tmp/mem.sock'
//! ```
//!
//! Arguments: socket path (or `tcp:PORT` for 127.0.0.1), size with an optional K/M/G
//! suffix. Stops on SIGINT/SIGTERM. `RUST_LOG=nbd=debug` shows what clients do.

use std::rc::Rc;

use nbd_server::{shutdown_signal, ExportEntry, Listener, MemExport, Server, ServerConfig};

fn parse_size(s: &str) -> Option<u64> {
    let (digits, shift) = match s.as_bytes().last()? {
        b'K' | b'k' => (&s[..s.len() - 1], 10),
        b'M' | b'm' => (&s[..s.len() - 1], 20),
        b'G' | b'g' => (&s[..s.len() - 1], 30),
        _ => (s, 0),
    };
    digits.parse::<u64>().ok()?.checked_mul(1 << shift)
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::from_default_env())
        .with_writer(std::io::stderr)
        .init();
    let mut args = std::env::args().skip(1);
    let (Some(addr), Some(size)) = (args.next(), args.next()) else {
        return Err("usage: mem_server SOCKET|tcp:PORT SIZE[K|M|G]".into());
    };
    let size = parse_size(&size).ok_or("size must be a number with an optional K/M/G suffix")?;
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    rt.block_on(async move {
        let listener = match addr.strip_prefix("tcp:") {
            Some(port) => Listener::bind_tcp(format!("127.0.0.1:{port}").parse()?).await?,
            None => Listener::bind_unix(&addr)?,
        };
        let config = ServerConfig {
            persistent: true,
            max_connections: None,
            ..ServerConfig::default()
        };
        let export = Rc::new(MemExport::new(size));
        let server = Server::new(vec![ExportEntry::new("", export)], config)?;
        eprintln!("serving {size} bytes on {addr}");
        let report = server
            .serve(vec![listener], async {
                let _ = shutdown_signal().await;
            })
            .await?;
        eprintln!("stopped: {report:?}");
        Ok(())
    })
}
