//! `serve -L` / `--list`: qemu-nbd's client mode that lists a server's exports. It asks
//! what qemu-nbd's client asks (the export list, then each export's size, flags, block sizes
//! and metadata contexts) and prints it in qemu-nbd's layout, so scripts that read one read
//! the other.

use std::io::{Read, Write};
use std::net::{TcpStream, ToSocketAddrs};
use std::os::unix::net::UnixStream;
use std::time::Duration;

use nbd::wire::consts::*;

use super::listen::Endpoint;

/// How long the server may take to answer any one step; a server that stops answering
/// ends the listing with an error rather than a hang.
const STEP_TIMEOUT: Duration = Duration::from_secs(30);

/// Largest option reply accepted: a name or description is at most 4 KiB by the protocol,
/// so anything far bigger is a broken server.
const MAX_REPLY: u32 = 64 << 10;

/// Most exports (and metadata contexts per export) listed: bounds the memory a hostile
/// server can make the listing use.
const MAX_ITEMS: usize = 65536;

/// Why a listing failed.
#[derive(Debug, thiserror::Error)]
pub enum ListError {
    /// The server could not be reached.
    #[error("Failed to connect to '{target}': {source}")]
    Connect {
        /// Where.
        target: String,
        /// Why.
        source: std::io::Error,
    },
    /// Talking to it failed.
    #[error("Failed to read from the server: {0}")]
    Io(#[from] std::io::Error),
    /// It answered something the protocol does not allow.
    #[error("Server sent an unexpected reply: {0}")]
    Protocol(String),
    /// It refused the listing.
    #[error("Server does not support export lists")]
    Unsupported,
    /// It refused the listing with an error reply.
    #[error("Server refused to list exports (error {0:#x}){1}")]
    Refused(u32, String),
    /// It requires TLS, which the listing does not speak.
    #[error("Server requires TLS; listing over TLS is not supported")]
    TlsRequired,
}

/// One export as listed.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct ExportInfo {
    /// Its name.
    pub name: String,
    /// Its description (empty when none).
    pub description: String,
    /// Size and transmission flags, when the server answered NBD_OPT_INFO.
    pub size_flags: Option<(u64, u16)>,
    /// Minimum, preferred and maximum block sizes, when sent.
    pub block_sizes: Option<(u32, u32, u32)>,
    /// Metadata contexts offered.
    pub contexts: Vec<String>,
}

/// The reply modes negotiated, as qemu-nbd reports them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mode {
    /// Simple replies only.
    Simple,
    /// Structured replies.
    Structured,
    /// Extended headers (64-bit transactions).
    Extended,
}

trait Stream: Read + Write {}
impl<T: Read + Write> Stream for T {}

/// Lists the exports of the server at `endpoint`.
pub fn list(endpoint: &Endpoint) -> Result<(Mode, Vec<ExportInfo>), ListError> {
    let mut stream: Box<dyn Stream> = match endpoint {
        Endpoint::Unix(path) => {
            let s = UnixStream::connect(path).map_err(|source| ListError::Connect {
                target: path.display().to_string(),
                source,
            })?;
            s.set_read_timeout(Some(STEP_TIMEOUT))?;
            s.set_write_timeout(Some(STEP_TIMEOUT))?;
            Box::new(s)
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
            Box::new(s)
        }
    };
    let mut c = Client { s: stream.as_mut() };
    let mode = c.handshake()?;
    let mut exports = c.list_names()?;
    for e in &mut exports {
        if !c.info(e)? {
            // As qemu-nbd: a server that cannot answer NBD_OPT_INFO will not answer the rest.
            break;
        }
        if mode != Mode::Simple {
            c.meta_contexts(e)?;
        }
    }
    // A courtesy before hanging up; the server may close first.
    let _ = c.send_option(OPT_ABORT, &[]);
    Ok((mode, exports))
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

struct Client<'a> {
    s: &'a mut dyn Stream,
}

/// One option reply: its type and data.
struct Reply {
    kind: u32,
    data: Vec<u8>,
}

impl Client<'_> {
    fn read_u16(&mut self) -> Result<u16, ListError> {
        let mut b = [0; 2];
        self.s.read_exact(&mut b)?;
        Ok(u16::from_be_bytes(b))
    }

    fn read_u32(&mut self) -> Result<u32, ListError> {
        let mut b = [0; 4];
        self.s.read_exact(&mut b)?;
        Ok(u32::from_be_bytes(b))
    }

    fn read_u64(&mut self) -> Result<u64, ListError> {
        let mut b = [0; 8];
        self.s.read_exact(&mut b)?;
        Ok(u64::from_be_bytes(b))
    }

    /// The greeting and the client flags; then the richest reply mode the server takes.
    fn handshake(&mut self) -> Result<Mode, ListError> {
        if self.read_u64()? != NBDMAGIC {
            return Err(ListError::Protocol("not an NBD server".into()));
        }
        if self.read_u64()? != IHAVEOPT {
            // Oldstyle servers have no options, so no list.
            return Err(ListError::Unsupported);
        }
        let flags = self.read_u16()?;
        if flags & FLAG_FIXED_NEWSTYLE == 0 {
            return Err(ListError::Unsupported);
        }
        let mut mine = FLAG_C_FIXED_NEWSTYLE;
        if flags & FLAG_NO_ZEROES != 0 {
            mine |= FLAG_C_NO_ZEROES;
        }
        self.s.write_all(&mine.to_be_bytes())?;
        if self.simple_option(OPT_EXTENDED_HEADERS)? {
            return Ok(Mode::Extended);
        }
        if self.simple_option(OPT_STRUCTURED_REPLY)? {
            return Ok(Mode::Structured);
        }
        Ok(Mode::Simple)
    }

    fn send_option(&mut self, option: u32, data: &[u8]) -> Result<(), ListError> {
        let len = u32::try_from(data.len())
            .map_err(|_| ListError::Protocol("option data too long".into()))?;
        let mut msg = Vec::with_capacity(16 + data.len());
        msg.extend_from_slice(&IHAVEOPT.to_be_bytes());
        msg.extend_from_slice(&option.to_be_bytes());
        msg.extend_from_slice(&len.to_be_bytes());
        msg.extend_from_slice(data);
        self.s.write_all(&msg)?;
        self.s.flush()?;
        Ok(())
    }

    fn reply(&mut self, option: u32) -> Result<Reply, ListError> {
        if self.read_u64()? != OPTION_REPLY_MAGIC {
            return Err(ListError::Protocol("bad option reply magic".into()));
        }
        let answered = self.read_u32()?;
        if answered != option {
            return Err(ListError::Protocol(format!(
                "reply to option {answered} while waiting for {option}"
            )));
        }
        let kind = self.read_u32()?;
        let len = self.read_u32()?;
        if len > MAX_REPLY {
            return Err(ListError::Protocol(format!("{len}-byte option reply")));
        }
        let mut data = vec![0; len as usize];
        self.s.read_exact(&mut data)?;
        if kind == REP_ERR_TLS_REQD {
            return Err(ListError::TlsRequired);
        }
        Ok(Reply { kind, data })
    }

    /// An option without data that is either acknowledged (true) or refused (false).
    fn simple_option(&mut self, option: u32) -> Result<bool, ListError> {
        self.send_option(option, &[])?;
        let r = self.reply(option)?;
        match r.kind {
            REP_ACK => Ok(true),
            k if k & REP_FLAG_ERROR != 0 => Ok(false),
            k => Err(ListError::Protocol(format!(
                "reply type {k} to option {option}"
            ))),
        }
    }

    fn list_names(&mut self) -> Result<Vec<ExportInfo>, ListError> {
        self.send_option(OPT_LIST, &[])?;
        let mut out = Vec::new();
        loop {
            let r = self.reply(OPT_LIST)?;
            match r.kind {
                REP_ACK => return Ok(out),
                REP_SERVER => {
                    if out.len() >= MAX_ITEMS {
                        return Err(ListError::Protocol("too many exports".into()));
                    }
                    let (name, rest) = split_name(&r.data)?;
                    out.push(ExportInfo {
                        name,
                        description: String::from_utf8_lossy(rest).into_owned(),
                        ..ExportInfo::default()
                    });
                }
                REP_ERR_UNSUP => return Err(ListError::Unsupported),
                k if k & REP_FLAG_ERROR != 0 => {
                    let msg = String::from_utf8_lossy(&r.data).into_owned();
                    return Err(ListError::Refused(
                        k,
                        if msg.is_empty() {
                            msg
                        } else {
                            format!(": {msg}")
                        },
                    ));
                }
                k => {
                    return Err(ListError::Protocol(format!(
                        "reply type {k} to NBD_OPT_LIST"
                    )))
                }
            }
        }
    }

    /// NBD_OPT_INFO for `e`, asking for block sizes; false if the server does not take it.
    fn info(&mut self, e: &mut ExportInfo) -> Result<bool, ListError> {
        let mut data = name_field(&e.name)?;
        data.extend_from_slice(&1u16.to_be_bytes());
        data.extend_from_slice(&INFO_BLOCK_SIZE.to_be_bytes());
        self.send_option(OPT_INFO, &data)?;
        loop {
            let r = self.reply(OPT_INFO)?;
            match r.kind {
                REP_ACK => return Ok(true),
                REP_INFO => {
                    let d = &r.data;
                    let kind = d.get(..2).map(|b| u16::from_be_bytes([b[0], b[1]]));
                    match (kind, d.len()) {
                        (Some(INFO_EXPORT), 12) => {
                            let size = u64::from_be_bytes(d[2..10].try_into().unwrap_or([0; 8]));
                            let flags = u16::from_be_bytes([d[10], d[11]]);
                            e.size_flags = Some((size, flags));
                        }
                        (Some(INFO_BLOCK_SIZE), 14) => {
                            let word = |at: usize| {
                                u32::from_be_bytes(d[at..at + 4].try_into().unwrap_or([0; 4]))
                            };
                            e.block_sizes = Some((word(2), word(6), word(10)));
                        }
                        (Some(INFO_EXPORT | INFO_BLOCK_SIZE), n) => {
                            return Err(ListError::Protocol(format!("{n}-byte NBD_REP_INFO")));
                        }
                        // Other information (name, description) is not shown.
                        _ => {}
                    }
                }
                REP_ERR_UNSUP => return Ok(false),
                k if k & REP_FLAG_ERROR != 0 => {
                    let msg = String::from_utf8_lossy(&r.data).into_owned();
                    return Err(ListError::Refused(
                        k,
                        format!(" for export '{}': {msg}", e.name),
                    ));
                }
                k => {
                    return Err(ListError::Protocol(format!(
                        "reply type {k} to NBD_OPT_INFO"
                    )))
                }
            }
        }
    }

    /// Every metadata context of `e`; then, as qemu-nbd's client does, the `qemu:` ones
    /// asked for by name if a server listed some contexts but none of those.
    fn meta_contexts(&mut self, e: &mut ExportInfo) -> Result<(), ListError> {
        let mut queries: &[&str] = &[];
        let mut asked_qemu = false;
        loop {
            let mut data = name_field(&e.name)?;
            let n = u32::try_from(queries.len()).unwrap_or(0);
            data.extend_from_slice(&n.to_be_bytes());
            for q in queries {
                data.extend_from_slice(&name_field(q)?);
            }
            self.send_option(OPT_LIST_META_CONTEXT, &data)?;
            loop {
                let r = self.reply(OPT_LIST_META_CONTEXT)?;
                match r.kind {
                    REP_META_CONTEXT if r.data.len() >= 4 => {
                        if e.contexts.len() >= MAX_ITEMS {
                            return Err(ListError::Protocol("too many meta contexts".into()));
                        }
                        let name = String::from_utf8_lossy(&r.data[4..]).into_owned();
                        asked_qemu |= name.starts_with("qemu:");
                        e.contexts.push(name);
                    }
                    REP_ACK => break,
                    // A server without metadata contexts: nothing to show.
                    k if k & REP_FLAG_ERROR != 0 => return Ok(()),
                    k => {
                        return Err(ListError::Protocol(format!(
                            "reply type {k} to NBD_OPT_LIST_META_CONTEXT"
                        )))
                    }
                }
            }
            if asked_qemu || e.contexts.is_empty() {
                return Ok(());
            }
            asked_qemu = true;
            queries = &["qemu:"];
        }
    }
}

/// A 32-bit length and the bytes of `name`.
fn name_field(name: &str) -> Result<Vec<u8>, ListError> {
    let len = u32::try_from(name.len())
        .map_err(|_| ListError::Protocol("export name too long".into()))?;
    let mut out = len.to_be_bytes().to_vec();
    out.extend_from_slice(name.as_bytes());
    Ok(out)
}

/// The name at the start of an NBD_REP_SERVER, and what follows it (the description).
fn split_name(data: &[u8]) -> Result<(String, &[u8]), ListError> {
    let bad = || ListError::Protocol("malformed NBD_REP_SERVER".into());
    let len = data
        .get(..4)
        .map(|b| u32::from_be_bytes([b[0], b[1], b[2], b[3]]) as usize)
        .ok_or_else(bad)?;
    let name = data
        .get(4..4usize.checked_add(len).ok_or_else(bad)?)
        .ok_or_else(bad)?;
    Ok((String::from_utf8_lossy(name).into_owned(), &data[4 + len..]))
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

    #[test]
    fn malformed_server_replies_are_errors_not_panics() {
        assert!(split_name(&[]).is_err());
        assert!(split_name(&[0, 0, 0, 9, b'a']).is_err());
        assert!(split_name(&[0xff, 0xff, 0xff, 0xff]).is_err());
        let (name, rest) = split_name(&[0, 0, 0, 1, b'a', b'd']).unwrap();
        assert_eq!((name.as_str(), rest), ("a", &b"d"[..]));
    }
}
