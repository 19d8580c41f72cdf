//! Where the server listens: sockets passed by systemd (or libnbd's `[ server ]`), a Unix
//! socket (`-k`), or TCP on every address `-b` resolves to (port `-p`).

use std::net::{SocketAddr, ToSocketAddrs};
use std::path::PathBuf;

use nbd_server::systemd::ActivatedSocket;
use nbd_server::Listener;

/// qemu-nbd's default TCP port (the IANA-assigned NBD port).
pub const DEFAULT_PORT: u16 = 10809;
/// qemu-nbd's default bind address.
pub const DEFAULT_BIND: &str = "0.0.0.0";

/// Why no listener could be set up.
#[derive(Debug, thiserror::Error)]
pub enum ListenError {
    /// Socket activation together with an explicit address.
    #[error("socket activation (LISTEN_FDS) cannot be combined with -k, -p or -b")]
    ActivationConflict,
    /// A passed socket cannot be used.
    #[error("cannot use the socket passed by the service manager: {0}")]
    Activated(std::io::Error),
    /// The Unix socket cannot be bound.
    #[error("cannot listen on {path}: {source}")]
    Unix {
        /// Socket path.
        path: String,
        /// Why.
        source: std::io::Error,
    },
    /// `-b` does not resolve.
    #[error("cannot resolve {host}: {source}")]
    Resolve {
        /// Host given.
        host: String,
        /// Why.
        source: std::io::Error,
    },
    /// No TCP address could be bound.
    #[error("cannot listen on {addr}: {source}")]
    Tcp {
        /// Address tried (the last one, if several).
        addr: String,
        /// Why.
        source: std::io::Error,
    },
}

/// What the command line asks for.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Endpoint {
    /// `-k PATH`.
    Unix(PathBuf),
    /// `-b HOST -p PORT`.
    Tcp {
        /// Host name or address.
        host: String,
        /// Port.
        port: u16,
    },
}

impl Endpoint {
    /// The endpoint for `-k`, `-b` and `-p` as given.
    pub fn from_flags(socket: Option<PathBuf>, bind: Option<String>, port: Option<u16>) -> Self {
        match socket {
            Some(path) => Endpoint::Unix(path),
            None => Endpoint::Tcp {
                host: bind.unwrap_or_else(|| DEFAULT_BIND.to_owned()),
                port: port.unwrap_or(DEFAULT_PORT),
            },
        }
    }
}

/// Binds the listeners: the activated sockets if there are any (then `explicit` must be
/// false: an address on the command line as well is a mistake), else `endpoint`.
/// Returns them with a description of each for logs.
pub async fn bind(
    activated: Vec<ActivatedSocket>,
    explicit: bool,
    endpoint: &Endpoint,
) -> Result<Vec<(Listener, String)>, ListenError> {
    if !activated.is_empty() {
        if explicit {
            return Err(ListenError::ActivationConflict);
        }
        return activated
            .into_iter()
            .enumerate()
            .map(|(i, s)| {
                Listener::from_activated(s)
                    .map(|l| (l, format!("activated socket {i}")))
                    .map_err(ListenError::Activated)
            })
            .collect();
    }
    match endpoint {
        Endpoint::Unix(path) => {
            let l = Listener::bind_unix(path).map_err(|source| ListenError::Unix {
                path: path.display().to_string(),
                source,
            })?;
            Ok(vec![(l, format!("unix:{}", path.display()))])
        }
        Endpoint::Tcp { host, port } => {
            let addrs: Vec<SocketAddr> = (host.as_str(), *port)
                .to_socket_addrs()
                .map_err(|source| ListenError::Resolve {
                    host: host.clone(),
                    source,
                })?
                .collect();
            let mut out = Vec::new();
            let mut failed = Vec::new();
            for addr in dedup(addrs) {
                match Listener::bind_tcp(addr).await {
                    Ok(l) => {
                        let shown = l.local_tcp_addr().unwrap_or(addr);
                        out.push((l, format!("tcp:{shown}")));
                    }
                    Err(source) => failed.push((addr, source)),
                }
            }
            if out.is_empty() {
                // The error says it; a log line as well would report it twice.
                return Err(match failed.pop() {
                    Some((addr, source)) => ListenError::Tcp {
                        addr: addr.to_string(),
                        source,
                    },
                    None => ListenError::Resolve {
                        host: host.clone(),
                        source: std::io::Error::new(
                            std::io::ErrorKind::NotFound,
                            "no address found",
                        ),
                    },
                });
            }
            // Serving on some of the host's addresses only is worth a warning.
            for (addr, error) in failed {
                tracing::warn!(%addr, %error, "cannot listen");
            }
            Ok(out)
        }
    }
}

/// Removes repeated addresses (resolvers list one per socket type), keeping the order.
fn dedup(addrs: Vec<SocketAddr>) -> Vec<SocketAddr> {
    let mut out: Vec<SocketAddr> = Vec::with_capacity(addrs.len());
    for a in addrs {
        if !out.contains(&a) {
            out.push(a);
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn endpoint_defaults_follow_qemu_nbd() {
        assert_eq!(
            Endpoint::from_flags(None, None, None),
            Endpoint::Tcp {
                host: "0.0.0.0".into(),
                port: 10809
            }
        );
        assert_eq!(
            Endpoint::from_flags(None, Some("::1".into()), Some(7)),
            Endpoint::Tcp {
                host: "::1".into(),
                port: 7
            }
        );
        assert_eq!(
            Endpoint::from_flags(Some("/s".into()), None, None),
            Endpoint::Unix("/s".into())
        );
    }

    #[test]
    fn repeated_addresses_are_bound_once() {
        let a: SocketAddr = "127.0.0.1:1".parse().unwrap();
        let b: SocketAddr = "[::1]:1".parse().unwrap();
        assert_eq!(dedup(vec![a, b, a, b]), [a, b]);
    }
}
