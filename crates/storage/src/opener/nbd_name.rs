//! The names QEMU takes for an NBD export, read into the address the NBD client connects
//! to: the URIs `nbd://HOST[:PORT]/EXPORT` (also `nbd+tcp://`) and
//! `nbd+unix:///EXPORT?socket=PATH`, and the legacy `nbd:HOST:PORT[:exportname=NAME]` and
//! `nbd:unix:PATH[:exportname=NAME]`.

use std::path::PathBuf;

use nbd_client::{NbdTarget, ServerAddr, DEFAULT_PORT};

/// Why a name is not a usable NBD name.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum NbdNameError {
    /// The URI is malformed.
    #[error("Failed to parse NBD URI '{0}'")]
    BadUri(String),
    /// A Unix-socket URI without `?socket=`.
    #[error("NBD URI '{0}' needs a socket parameter")]
    NoSocket(String),
    /// A port that is not a 16-bit number.
    #[error("invalid port '{0}'")]
    BadPort(String),
    /// `nbd:` text without a server.
    #[error("No server address given in '{0}'")]
    NoServer(String),
}

/// True when `name` is one of the NBD names QEMU takes as a file name (URIs and the
/// legacy `nbd:` form).
pub fn is_nbd_name(name: &str) -> bool {
    ["nbd://", "nbd+tcp://", "nbd+unix://", "nbd:"]
        .iter()
        .any(|p| name.starts_with(p))
}

/// Parses an NBD name: `nbd[+tcp]://HOST[:PORT]/EXPORT`, `nbd+unix:///EXPORT?socket=PATH`,
/// `nbd:unix:PATH[:exportname=NAME]` or `nbd:HOST:PORT[:exportname=NAME]`.
pub fn parse(name: &str) -> Result<NbdTarget, NbdNameError> {
    let bad = || NbdNameError::BadUri(name.to_string());
    if let Some(rest) = name.strip_prefix("nbd+unix://") {
        let (path, query) = rest.split_once('?').unwrap_or((rest, ""));
        if !path.is_empty() && !path.starts_with('/') {
            // A host is not allowed with a Unix socket.
            return Err(bad());
        }
        let mut socket = None;
        for kv in query.split('&').filter(|s| !s.is_empty()) {
            match kv.split_once('=') {
                Some(("socket", v)) => socket = Some(percent_decode(v).ok_or_else(bad)?),
                _ => return Err(bad()),
            }
        }
        let socket = socket.ok_or_else(|| NbdNameError::NoSocket(name.to_string()))?;
        let export = percent_decode(path.strip_prefix('/').unwrap_or(path)).ok_or_else(bad)?;
        return Ok(NbdTarget {
            server: ServerAddr::Unix(PathBuf::from(socket)),
            export,
        });
    }
    if let Some(rest) = name
        .strip_prefix("nbd://")
        .or_else(|| name.strip_prefix("nbd+tcp://"))
    {
        if rest.contains('?') {
            return Err(bad());
        }
        let (hostport, path) = match rest.find('/') {
            Some(i) => (&rest[..i], &rest[i + 1..]),
            None => (rest, ""),
        };
        let (host, port) = split_host_port(hostport)?;
        if host.is_empty() {
            return Err(bad());
        }
        return Ok(NbdTarget {
            server: ServerAddr::Inet { host, port },
            export: percent_decode(path).ok_or_else(bad)?,
        });
    }
    let rest = name.strip_prefix("nbd:").ok_or_else(bad)?;
    let (addr, export) = match rest.find(":exportname=") {
        Some(i) => (&rest[..i], rest[i + ":exportname=".len()..].to_string()),
        None => (rest, String::new()),
    };
    if addr.is_empty() {
        return Err(NbdNameError::NoServer(name.to_string()));
    }
    let server = match addr.strip_prefix("unix:") {
        Some(path) if !path.is_empty() => ServerAddr::Unix(PathBuf::from(path)),
        Some(_) => return Err(NbdNameError::NoServer(name.to_string())),
        None => {
            let (host, port) = split_host_port(addr)?;
            ServerAddr::Inet { host, port }
        }
    };
    Ok(NbdTarget { server, export })
}

/// `HOST[:PORT]` (with `[v6]` brackets allowed).
fn split_host_port(s: &str) -> Result<(String, u16), NbdNameError> {
    let (host, port) = if let Some(rest) = s.strip_prefix('[') {
        let (h, after) = rest
            .split_once(']')
            .ok_or_else(|| NbdNameError::BadUri(s.to_string()))?;
        (h, after.strip_prefix(':'))
    } else {
        match s.rsplit_once(':') {
            Some((h, p)) => (h, Some(p)),
            None => (s, None),
        }
    };
    let port = match port {
        None => DEFAULT_PORT,
        Some(p) => p
            .parse()
            .map_err(|_| NbdNameError::BadPort(p.to_string()))?,
    };
    Ok((host.to_string(), port))
}

/// Decodes `%XX` escapes; None when one is malformed or the result is not UTF-8.
fn percent_decode(s: &str) -> Option<String> {
    let b = s.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        if b[i] == b'%' {
            let hex = std::str::from_utf8(b.get(i + 1..i + 3)?).ok()?;
            out.push(u8::from_str_radix(hex, 16).ok()?);
            i += 3;
        } else {
            out.push(b[i]);
            i += 1;
        }
    }
    String::from_utf8(out).ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_in_every_form_qemu_takes() {
        let unix = |p: &str, e: &str| NbdTarget {
            server: ServerAddr::Unix(p.into()),
            export: e.into(),
        };
        let inet = |h: &str, port: u16, e: &str| NbdTarget {
            server: ServerAddr::Inet {
                host: h.into(),
                port,
            },
            export: e.into(),
        };
        let p = |s: &str| parse(s).unwrap();
        assert_eq!(p("nbd+unix:///?socket=/s"), unix("/s", ""));
        assert_eq!(p("nbd+unix:///ex%20p?socket=/s"), unix("/s", "ex p"));
        assert_eq!(p("nbd://h/e"), inet("h", DEFAULT_PORT, "e"));
        assert_eq!(p("nbd+tcp://h:99"), inet("h", 99, ""));
        assert_eq!(p("nbd://[::1]:5/x"), inet("::1", 5, "x"));
        assert_eq!(p("nbd:unix:/s:exportname=e"), unix("/s", "e"));
        assert_eq!(p("nbd:h:77"), inet("h", 77, ""));
        assert_eq!(p("nbd:h:77:exportname=x"), inet("h", 77, "x"));
        assert!(matches!(
            parse("nbd+unix:///"),
            Err(NbdNameError::NoSocket(_))
        ));
        assert!(matches!(
            parse("nbd://h:99999/"),
            Err(NbdNameError::BadPort(_))
        ));
        assert!(parse("nbd:").is_err());
        assert!(parse("nbd+unix:///?socket=/s&x=1").is_err());
        assert_eq!(p("nbd:unix:/s").display_name(), "nbd+unix://?socket=/s");
        assert_eq!(p("nbd:h:7:exportname=e").display_name(), "nbd://h:7/e");
    }
}
