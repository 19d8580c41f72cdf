//! `serve -L` / `--list`: qemu-nbd's client mode that lists a server's exports. The
//! protocol side is [`nbd_client::list`]; here the server is reached (Unix socket or TCP, with
//! `--tls-creds` over TLS) and the listing printed in qemu-nbd's layout, so scripts that
//! read one read the other.

use std::net::{TcpStream, ToSocketAddrs};
use std::os::unix::net::UnixStream;
use std::time::Duration;

use nbd_client::list::{list_exports, ListTls};
pub use nbd_client::list::{ExportInfo, ListError, Mode};
use nbd_client::TlsClient;
use nbd_proto::wire::consts::*;

use super::listen::Endpoint;

/// How long the server may take to answer any one step; a server that stops answering
/// ends the listing with an error rather than a hang.
const STEP_TIMEOUT: Duration = Duration::from_secs(30);

/// Lists the exports of the server at `endpoint`, over TLS with `tls` (and the host name
/// its certificate must name: `hostname`, else the TCP host; a Unix socket has none).
pub fn list(
    endpoint: &Endpoint,
    tls: Option<&TlsClient>,
    hostname: Option<&str>,
) -> Result<(Mode, Vec<ExportInfo>), ListError> {
    match endpoint {
        Endpoint::Unix(path) => {
            let s = UnixStream::connect(path).map_err(|source| ListError::Connect {
                target: path.display().to_string(),
                source,
            })?;
            s.set_read_timeout(Some(STEP_TIMEOUT))?;
            s.set_write_timeout(Some(STEP_TIMEOUT))?;
            list_exports(s, tls.map(|client| ListTls { client, hostname }))
        }
        Endpoint::Tcp { host, port } => {
            let target = format!("{host}:{port}");
            let s = connect_tcp(host, *port).map_err(|source| ListError::Connect {
                target: target.clone(),
                source,
            })?;
            s.set_read_timeout(Some(STEP_TIMEOUT))?;
            s.set_write_timeout(Some(STEP_TIMEOUT))?;
            s.set_nodelay(true)?;
            let hostname = hostname.or(Some(host.as_str()));
            list_exports(s, tls.map(|client| ListTls { client, hostname }))
        }
    }
}

fn connect_tcp(host: &str, port: u16) -> std::io::Result<TcpStream> {
    let mut last = None;
    for addr in (host, port).to_socket_addrs()? {
        match TcpStream::connect_timeout(&addr, STEP_TIMEOUT) {
            Ok(s) => return Ok(s),
            Err(e) => last = Some(e),
        }
    }
    Err(last.unwrap_or_else(|| std::io::Error::other("no address found")))
}

/// The listing as qemu-nbd prints it.
pub fn render(mode: Mode, exports: &[ExportInfo]) -> String {
    const FLAG_NAMES: [(u16, &str); 12] = [
        (FLAG_READ_ONLY, "readonly"),
        (FLAG_SEND_FLUSH, "flush"),
        (FLAG_SEND_FUA, "fua"),
        (FLAG_ROTATIONAL, "rotational"),
        (FLAG_SEND_TRIM, "trim"),
        (FLAG_SEND_WRITE_ZEROES, "zeroes"),
        (FLAG_SEND_DF, "df"),
        (FLAG_CAN_MULTI_CONN, "multi"),
        (FLAG_SEND_RESIZE, "resize"),
        (FLAG_SEND_CACHE, "cache"),
        (FLAG_SEND_FAST_ZERO, "fast-zero"),
        (FLAG_BLOCK_STATUS_PAYLOAD, "block-status-payload"),
    ];
    let mut out = format!("exports available: {}\n", exports.len());
    for e in exports {
        out.push_str(&format!(" export: '{}'\n", e.name));
        if !e.description.is_empty() {
            out.push_str(&format!("  description: {}\n", e.description));
        }
        if let Some((size, flags)) = e.size_flags {
            if flags & FLAG_HAS_FLAGS != 0 {
                out.push_str(&format!("  size:  {size}\n  flags: {flags:#x} ("));
                for (bit, name) in FLAG_NAMES {
                    if flags & bit != 0 {
                        out.push_str(&format!(" {name}"));
                    }
                }
                out.push_str(" )\n");
            }
        }
        if let Some((min, opt, max)) = e.block_sizes.filter(|b| b.0 != 0) {
            out.push_str(&format!(
                "  min block: {min}\n  opt block: {opt}\n  max block: {max}\n"
            ));
        }
        let size = if mode == Mode::Extended {
            "64-bit"
        } else {
            "32-bit"
        };
        out.push_str(&format!("  transaction size: {size}\n"));
        if !e.contexts.is_empty() {
            out.push_str(&format!(
                "  available meta contexts: {}\n",
                e.contexts.len()
            ));
            for c in &e.contexts {
                out.push_str(&format!("   {c}\n"));
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_listing_is_laid_out_as_qemu_nbd_prints_it() {
        let e = ExportInfo {
            name: "disk".into(),
            description: "a disk".into(),
            size_flags: Some((1 << 20, FLAG_HAS_FLAGS | FLAG_SEND_FLUSH | FLAG_SEND_CACHE)),
            block_sizes: Some((1, 4096, 33554432)),
            contexts: vec!["base:allocation".into()],
        };
        assert_eq!(
            render(Mode::Extended, &[e]),
            "exports available: 1\n export: 'disk'\n  description: a disk\n  size:  1048576\n  \
             flags: 0x405 ( flush cache )\n  min block: 1\n  opt block: 4096\n  \
             max block: 33554432\n  transaction size: 64-bit\n  available meta contexts: 1\n   \
             base:allocation\n"
        );
        assert_eq!(render(Mode::Simple, &[]), "exports available: 0\n");
    }
}
