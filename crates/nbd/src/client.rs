//! An NBD client for the image tools: the names QEMU takes for an NBD export, and a
//! connection that reads, writes, zeroes, trims, flushes and asks block status.
//!
//! The server is untrusted: every length, offset and count it sends is checked against
//! what was asked, a reply never makes us allocate more than the request it answers, and
//! anything the protocol does not allow is a [`ClientError`], never a panic. Blocking I/O
//! with timeouts on the socket, so every wait ends; one request is in flight at a time.

use std::io::{Read, Write};
use std::net::TcpStream;
use std::os::unix::net::UnixStream;
use std::path::PathBuf;
use std::time::Duration;

use crate::list::{name_field, refused, Client as OptClient, ListError};
use crate::wire::consts::*;

/// The port NBD servers listen on unless told otherwise.
pub const DEFAULT_PORT: u16 = 10809;

/// Largest request sent: bigger reads and writes are split. QEMU's servers take 32 MiB.
pub const MAX_REQUEST: u32 = 32 << 20;

/// Largest zero, trim or block status request: the biggest 32-bit length in whole 4 KiB
/// blocks, so a split never leaves the rest unaligned.
pub const MAX_RANGE: u32 = 0xffff_f000;

/// Most chunks accepted in one structured reply: a 32 MiB read in 512-byte pieces is
/// 65536; a server that never ends a reply is cut off here.
pub const MAX_CHUNKS: u32 = 1 << 17;

/// Most extents accepted in one block status chunk (each is 8 bytes): bounds a reply.
pub const MAX_EXTENTS: u32 = 1 << 16;

/// How long a read from or write to the server may wait before the request fails.
pub const DEFAULT_IO_TIMEOUT: Duration = Duration::from_secs(300);

/// Where the server listens.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ServerAddr {
    /// A Unix socket.
    Unix(PathBuf),
    /// A TCP host and port.
    Inet {
        /// Host name or address.
        host: String,
        /// Port.
        port: u16,
    },
}

/// An NBD export: its server and its name.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NbdTarget {
    /// The server.
    pub server: ServerAddr,
    /// The export name (empty: the default export).
    pub export: String,
}

/// Why a name is not a usable NBD name.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum NameError {
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

impl NbdTarget {
    /// Parses an NBD name: `nbd[+tcp]://HOST[:PORT]/EXPORT`, `nbd+unix:///EXPORT?socket=PATH`,
    /// `nbd:unix:PATH[:exportname=NAME]` or `nbd:HOST:PORT[:exportname=NAME]`.
    pub fn parse(name: &str) -> Result<NbdTarget, NameError> {
        let bad = || NameError::BadUri(name.to_string());
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
            let socket = socket.ok_or_else(|| NameError::NoSocket(name.to_string()))?;
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
            return Err(NameError::NoServer(name.to_string()));
        }
        let server = match addr.strip_prefix("unix:") {
            Some(path) if !path.is_empty() => ServerAddr::Unix(PathBuf::from(path)),
            Some(_) => return Err(NameError::NoServer(name.to_string())),
            None => {
                let (host, port) = split_host_port(addr)?;
                ServerAddr::Inet { host, port }
            }
        };
        Ok(NbdTarget { server, export })
    }

    /// The name QEMU shows for this export (`nbd+unix://?socket=PATH`,
    /// `nbd://HOST:PORT/EXPORT`).
    pub fn display_name(&self) -> String {
        match &self.server {
            ServerAddr::Unix(path) => {
                let export = if self.export.is_empty() {
                    String::new()
                } else {
                    format!("/{}", self.export)
                };
                format!("nbd+unix://{export}?socket={}", path.display())
            }
            ServerAddr::Inet { host, port } => {
                let host = if host.contains(':') {
                    format!("[{host}]")
                } else {
                    host.clone()
                };
                let export = if self.export.is_empty() {
                    String::new()
                } else {
                    format!("/{}", self.export)
                };
                format!("nbd://{host}:{port}{export}")
            }
        }
    }
}

/// `HOST[:PORT]` (with `[v6]` brackets allowed).
fn split_host_port(s: &str) -> Result<(String, u16), NameError> {
    let (host, port) = if let Some(rest) = s.strip_prefix('[') {
        let (h, after) = rest
            .split_once(']')
            .ok_or_else(|| NameError::BadUri(s.to_string()))?;
        (h, after.strip_prefix(':'))
    } else {
        match s.rsplit_once(':') {
            Some((h, p)) => (h, Some(p)),
            None => (s, None),
        }
    };
    let port = match port {
        None => DEFAULT_PORT,
        Some(p) => p.parse().map_err(|_| NameError::BadPort(p.to_string()))?,
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

/// Why a connection or a request failed.
#[derive(Debug, thiserror::Error)]
pub enum ClientError {
    /// The server could not be reached.
    #[error("Failed to connect to '{target}': {}", os_text(source))]
    Connect {
        /// Where.
        target: String,
        /// Why.
        source: std::io::Error,
    },
    /// The handshake failed or was refused.
    #[error(transparent)]
    Handshake(#[from] ListError),
    /// Talking to the server failed.
    #[error("Failed to talk to the NBD server: {0}")]
    Io(#[from] std::io::Error),
    /// The server answered something the protocol does not allow.
    #[error("NBD server sent an invalid reply: {0}")]
    Protocol(String),
    /// The server failed the request with this errno.
    #[error("NBD server failed the request: {}", std::io::Error::from_raw_os_error(*.errno as i32))]
    Server {
        /// The NBD error value (the same numbers as Linux's errno).
        errno: u32,
    },
    /// The export is read-only and a write was asked.
    #[error("the NBD export is read-only")]
    ReadOnly,
    /// A request beyond the end of the export.
    #[error("request at {offset} for {len} bytes is past the end of the export ({size} bytes)")]
    OutOfRange {
        /// Where.
        offset: u64,
        /// How much.
        len: u64,
        /// The export's size.
        size: u64,
    },
}

impl From<ClientError> for std::io::Error {
    fn from(e: ClientError) -> std::io::Error {
        match e {
            ClientError::Io(e) => e,
            ClientError::Server { errno } if errno > 0 && errno < 4096 => {
                std::io::Error::from_raw_os_error(errno as i32)
            }
            ClientError::ReadOnly => std::io::Error::from_raw_os_error(libc::EROFS),
            e => std::io::Error::other(e),
        }
    }
}

/// The socket of a connection.
enum Conn {
    Unix(UnixStream),
    Tcp(TcpStream),
}

impl Read for Conn {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        match self {
            Conn::Unix(s) => s.read(buf),
            Conn::Tcp(s) => s.read(buf),
        }
    }
}

impl Write for Conn {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        match self {
            Conn::Unix(s) => s.write(buf),
            Conn::Tcp(s) => s.write(buf),
        }
    }
    fn flush(&mut self) -> std::io::Result<()> {
        match self {
            Conn::Unix(s) => s.flush(),
            Conn::Tcp(s) => s.flush(),
        }
    }
}

/// One connection to an export, in the transmission phase.
pub struct NbdClient<S = Box<dyn ReadWrite>> {
    s: S,
    size: u64,
    flags: u16,
    structured: bool,
    /// The id the server gave `base:allocation`, when it offers it.
    allocation: Option<u32>,
    max_request: u32,
    /// The server's minimum block size (1 when it sent none).
    min_block: u32,
    next_handle: u64,
}

/// A byte stream the client can talk over.
pub trait ReadWrite: Read + Write + Send {}
impl<T: Read + Write + Send> ReadWrite for T {}

/// What the chunks of one structured reply have said so far.
#[derive(Default)]
struct Sofar {
    /// The first error a chunk reported.
    error: Option<u32>,
    /// Bytes of the read that data and hole chunks have filled.
    covered: u64,
}

/// One stretch of block status: its length and whether it is a hole / reads as zeros.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Status {
    /// Bytes.
    pub len: u64,
    /// Not allocated.
    pub hole: bool,
    /// Reads as zeros.
    pub zero: bool,
}

impl NbdClient {
    /// Connects to `target` and negotiates; `timeout` bounds every read and write.
    pub fn connect(target: &NbdTarget, timeout: Duration) -> Result<NbdClient, ClientError> {
        let conn = match &target.server {
            ServerAddr::Unix(path) => {
                let s = UnixStream::connect(path).map_err(|source| ClientError::Connect {
                    target: path.display().to_string(),
                    source,
                })?;
                s.set_read_timeout(Some(timeout))?;
                s.set_write_timeout(Some(timeout))?;
                Conn::Unix(s)
            }
            ServerAddr::Inet { host, port } => {
                let s = TcpStream::connect((host.as_str(), *port)).map_err(|source| {
                    ClientError::Connect {
                        target: format!("{host}:{port}"),
                        source,
                    }
                })?;
                s.set_read_timeout(Some(timeout))?;
                s.set_write_timeout(Some(timeout))?;
                let _ = s.set_nodelay(true);
                Conn::Tcp(s)
            }
        };
        NbdClient::handshake(Box::new(conn) as Box<dyn ReadWrite>, &target.export)
    }
}

impl<S: Read + Write> NbdClient<S> {
    /// Negotiates export `export` over `s`: structured replies and `base:allocation` when
    /// the server offers them, then NBD_OPT_GO.
    pub fn handshake(mut s: S, export: &str) -> Result<NbdClient<S>, ClientError> {
        let mut o = OptClient { s: &mut s };
        o.greet()?;
        let structured = o.simple_option(OPT_STRUCTURED_REPLY)?;
        let mut allocation = None;
        if structured {
            let mut data = name_field(export)?;
            data.extend_from_slice(&1u32.to_be_bytes());
            data.extend_from_slice(&name_field(BASE_ALLOC)?);
            o.send_option(OPT_SET_META_CONTEXT, &data)?;
            loop {
                let r = o.reply(OPT_SET_META_CONTEXT)?;
                match r.kind {
                    REP_ACK => break,
                    REP_META_CONTEXT => {
                        let id = r
                            .data
                            .get(..4)
                            .map(|b| u32::from_be_bytes([b[0], b[1], b[2], b[3]]))
                            .ok_or_else(|| proto("short NBD_REP_META_CONTEXT"))?;
                        if &r.data[4..] == BASE_ALLOC.as_bytes() {
                            allocation = Some(id);
                        }
                    }
                    k if k & REP_FLAG_ERROR != 0 => break,
                    k => return Err(proto(format!("reply type {k} to SET_META_CONTEXT"))),
                }
            }
        }
        let mut data = name_field(export)?;
        data.extend_from_slice(&1u16.to_be_bytes());
        data.extend_from_slice(&INFO_BLOCK_SIZE.to_be_bytes());
        o.send_option(OPT_GO, &data)?;
        let mut size_flags = None;
        let mut max_request = MAX_REQUEST;
        let mut min_block = 1;
        loop {
            let r = o.reply(OPT_GO)?;
            match r.kind {
                REP_ACK => break,
                REP_INFO => {
                    let d = &r.data;
                    match (
                        d.get(..2).map(|b| u16::from_be_bytes([b[0], b[1]])),
                        d.len(),
                    ) {
                        (Some(INFO_EXPORT), 12) => {
                            let size = u64::from_be_bytes(d[2..10].try_into().unwrap_or([0; 8]));
                            size_flags = Some((size, u16::from_be_bytes([d[10], d[11]])));
                        }
                        (Some(INFO_BLOCK_SIZE), 14) => {
                            let min = u32::from_be_bytes(d[2..6].try_into().unwrap_or([0; 4]));
                            let max = u32::from_be_bytes(d[10..14].try_into().unwrap_or([0; 4]));
                            // Only a power of two up to 64 KiB is a minimum to honour.
                            if min.is_power_of_two() && min <= 1 << 16 {
                                min_block = min;
                            }
                            // A maximum under one sector is not one to follow.
                            if max >= 512 {
                                max_request = max.min(MAX_REQUEST);
                            }
                        }
                        (Some(INFO_EXPORT | INFO_BLOCK_SIZE), n) => {
                            return Err(proto(format!("{n}-byte NBD_REP_INFO")));
                        }
                        _ => {}
                    }
                }
                k if k & REP_FLAG_ERROR != 0 => return Err(refused(OPT_GO, r).into()),
                k => return Err(proto(format!("reply type {k} to NBD_OPT_GO"))),
            }
        }
        let (size, flags) = size_flags.ok_or_else(|| proto("no export size sent"))?;
        if size > i64::MAX as u64 {
            return Err(proto(format!("export size {size} too large")));
        }
        Ok(NbdClient {
            s,
            size,
            flags,
            structured,
            allocation,
            max_request,
            min_block,
            next_handle: 1,
        })
    }

    /// The export's size in bytes.
    pub fn size(&self) -> u64 {
        self.size
    }

    /// Whether the server refuses writes.
    pub fn read_only(&self) -> bool {
        self.flags & FLAG_READ_ONLY != 0
    }

    /// Whether block status (`base:allocation`) was negotiated.
    pub fn has_block_status(&self) -> bool {
        self.allocation.is_some()
    }

    /// Whether the server takes NBD_CMD_WRITE_ZEROES.
    pub fn can_write_zeroes(&self) -> bool {
        self.flags & FLAG_SEND_WRITE_ZEROES != 0
    }

    fn check_range(&self, offset: u64, len: u64) -> Result<(), ClientError> {
        match offset.checked_add(len) {
            Some(end) if end <= self.size => Ok(()),
            _ => Err(ClientError::OutOfRange {
                offset,
                len,
                size: self.size,
            }),
        }
    }

    fn send(
        &mut self,
        kind: u16,
        flags: u16,
        offset: u64,
        len: u32,
        data: &[u8],
    ) -> Result<u64, ClientError> {
        let handle = self.next_handle;
        self.next_handle = self.next_handle.wrapping_add(1);
        let mut msg = Vec::with_capacity(28 + data.len());
        msg.extend_from_slice(&REQUEST_MAGIC.to_be_bytes());
        msg.extend_from_slice(&flags.to_be_bytes());
        msg.extend_from_slice(&kind.to_be_bytes());
        msg.extend_from_slice(&handle.to_be_bytes());
        msg.extend_from_slice(&offset.to_be_bytes());
        msg.extend_from_slice(&len.to_be_bytes());
        msg.extend_from_slice(data);
        self.s.write_all(&msg)?;
        self.s.flush()?;
        Ok(handle)
    }

    fn read_exact(&mut self, buf: &mut [u8]) -> Result<(), ClientError> {
        self.s.read_exact(buf)?;
        Ok(())
    }

    /// Reads the whole reply to request `handle`; `read` (the read's buffer and offset)
    /// receives data, `status` receives block status descriptors.
    fn reply(
        &mut self,
        handle: u64,
        mut read: Option<(&mut [u8], u64)>,
        mut status: Option<&mut Vec<Status>>,
    ) -> Result<(), ClientError> {
        let mut magic = [0; 4];
        self.read_exact(&mut magic)?;
        match u32::from_be_bytes(magic) {
            SIMPLE_REPLY_MAGIC => {
                let mut h = [0; 12];
                self.read_exact(&mut h)?;
                let errno = u32::from_be_bytes(h[..4].try_into().unwrap_or([0; 4]));
                self.check_handle(handle, &h[4..12])?;
                if errno != 0 {
                    return Err(ClientError::Server { errno });
                }
                if let Some((buf, _)) = read.as_mut() {
                    if self.structured {
                        return Err(proto("simple reply to a read with structured replies"));
                    }
                    self.read_exact(buf)?;
                }
                Ok(())
            }
            STRUCTURED_REPLY_MAGIC if self.structured => {
                let mut sofar = Sofar::default();
                let mut chunks = 0u32;
                loop {
                    chunks += 1;
                    if chunks > MAX_CHUNKS {
                        return Err(proto("reply of too many chunks"));
                    }
                    let mut h = [0; 16];
                    self.read_exact(&mut h)?;
                    let flags = u16::from_be_bytes([h[0], h[1]]);
                    let kind = u16::from_be_bytes([h[2], h[3]]);
                    self.check_handle(handle, &h[4..12])?;
                    let len = u32::from_be_bytes(h[12..16].try_into().unwrap_or([0; 4]));
                    let done = flags & REPLY_FLAG_DONE != 0;
                    self.chunk(kind, len, done, &mut read, &mut status, &mut sofar)?;
                    if flags & REPLY_FLAG_DONE != 0 {
                        break;
                    }
                    let mut magic = [0; 4];
                    self.read_exact(&mut magic)?;
                    if u32::from_be_bytes(magic) != STRUCTURED_REPLY_MAGIC {
                        return Err(proto("bad structured reply magic"));
                    }
                }
                if let Some(errno) = sofar.error {
                    return Err(ClientError::Server { errno });
                }
                if let Some((buf, _)) = read {
                    if sofar.covered != buf.len() as u64 {
                        return Err(proto("read reply does not cover the request"));
                    }
                }
                Ok(())
            }
            m => Err(proto(format!("bad reply magic {m:#x}"))),
        }
    }

    fn check_handle(&self, handle: u64, got: &[u8]) -> Result<(), ClientError> {
        let got = u64::from_be_bytes(got.try_into().unwrap_or([0; 8]));
        if got != handle {
            return Err(proto(format!("reply for request {got}, expected {handle}")));
        }
        Ok(())
    }

    /// One structured reply chunk of `len` payload bytes.
    fn chunk(
        &mut self,
        kind: u16,
        len: u32,
        done: bool,
        read: &mut Option<(&mut [u8], u64)>,
        status: &mut Option<&mut Vec<Status>>,
        sofar: &mut Sofar,
    ) -> Result<(), ClientError> {
        match kind {
            REPLY_TYPE_NONE if len == 0 && done => Ok(()),
            REPLY_TYPE_OFFSET_DATA | REPLY_TYPE_OFFSET_HOLE => {
                let Some((buf, base)) = read.as_mut() else {
                    return Err(proto("data chunk in a reply that is not a read"));
                };
                let mut off = [0; 8];
                if len < 8 {
                    return Err(proto("short data chunk"));
                }
                self.read_exact(&mut off)?;
                let off = u64::from_be_bytes(off);
                let n = if kind == REPLY_TYPE_OFFSET_DATA {
                    u64::from(len - 8)
                } else {
                    if len != 12 {
                        return Err(proto("malformed hole chunk"));
                    }
                    let mut l = [0; 4];
                    self.read_exact(&mut l)?;
                    u64::from(u32::from_be_bytes(l))
                };
                let start = off
                    .checked_sub(*base)
                    .ok_or_else(|| proto("chunk before the request"))?;
                let end = start
                    .checked_add(n)
                    .filter(|&e| e <= buf.len() as u64)
                    .ok_or_else(|| proto("chunk past the request"))?;
                let dest = &mut buf[start as usize..end as usize];
                if kind == REPLY_TYPE_OFFSET_DATA {
                    self.s.read_exact(dest)?;
                } else {
                    dest.fill(0);
                }
                sofar.covered += n;
                if sofar.covered > buf.len() as u64 {
                    return Err(proto("read reply covers more than the request"));
                }
                Ok(())
            }
            REPLY_TYPE_BLOCK_STATUS => {
                let Some(out) = status.as_mut() else {
                    return Err(proto("block status chunk in a reply that is not one"));
                };
                if len < 12 || (len - 4) % 8 != 0 || (len - 4) / 8 > MAX_EXTENTS {
                    return Err(proto(format!("{len}-byte block status chunk")));
                }
                let mut id = [0; 4];
                self.read_exact(&mut id)?;
                if Some(u32::from_be_bytes(id)) != self.allocation {
                    return Err(proto("block status for a context not asked"));
                }
                for _ in 0..(len - 4) / 8 {
                    let mut e = [0; 8];
                    self.read_exact(&mut e)?;
                    let elen = u32::from_be_bytes(e[..4].try_into().unwrap_or([0; 4]));
                    let flags = u32::from_be_bytes(e[4..].try_into().unwrap_or([0; 4]));
                    if elen == 0 {
                        return Err(proto("empty extent"));
                    }
                    if out.len() >= MAX_EXTENTS as usize {
                        return Err(proto("too many extents"));
                    }
                    out.push(Status {
                        len: u64::from(elen),
                        hole: flags & STATE_HOLE != 0,
                        zero: flags & STATE_ZERO != 0,
                    });
                }
                Ok(())
            }
            k if k & REPLY_TYPE_FLAG_ERROR != 0 => {
                if len < 6 || len > 6 + MAX_STRING_LEN as u32 + 8 {
                    return Err(proto(format!("{len}-byte error chunk")));
                }
                let mut payload = vec![0; len as usize];
                self.read_exact(&mut payload)?;
                let errno = u32::from_be_bytes(payload[..4].try_into().unwrap_or([0; 4]));
                // A zero errno in an error chunk is itself a protocol error; report EIO.
                sofar
                    .error
                    .get_or_insert(if errno == 0 { libc::EIO as u32 } else { errno });
                Ok(())
            }
            k => Err(proto(format!(
                "unexpected reply chunk type {k} ({len} bytes)"
            ))),
        }
    }

    /// Reads `buf.len()` bytes at `offset`.
    pub fn read(&mut self, buf: &mut [u8], offset: u64) -> Result<(), ClientError> {
        self.check_range(offset, buf.len() as u64)?;
        let max = self.max_request as usize;
        for (i, piece) in buf.chunks_mut(max).enumerate() {
            let off = offset + (i * max) as u64;
            let h = self.send(CMD_READ, 0, off, piece.len() as u32, &[])?;
            self.reply(h, Some((piece, off)), None)?;
        }
        Ok(())
    }

    /// Writes `data` at `offset`.
    pub fn write(&mut self, data: &[u8], offset: u64) -> Result<(), ClientError> {
        if self.read_only() {
            return Err(ClientError::ReadOnly);
        }
        self.check_range(offset, data.len() as u64)?;
        let max = self.max_request as usize;
        for (i, piece) in data.chunks(max).enumerate() {
            let off = offset + (i * max) as u64;
            let h = self.send(CMD_WRITE, 0, off, piece.len() as u32, piece)?;
            self.reply(h, None, None)?;
        }
        Ok(())
    }

    /// Zeroes or trims `[offset, offset + len)` in requests the server takes.
    fn ranged(&mut self, cmd: u16, flags: u16, offset: u64, len: u64) -> Result<(), ClientError> {
        if self.read_only() {
            return Err(ClientError::ReadOnly);
        }
        self.check_range(offset, len)?;
        let mut done = 0;
        while done < len {
            let n = (len - done).min(u64::from(MAX_RANGE)) as u32;
            let h = self.send(cmd, flags, offset + done, n, &[])?;
            self.reply(h, None, None)?;
            done += u64::from(n);
        }
        Ok(())
    }

    /// Makes `[offset, offset + len)` read as zeros; with `unmap`, lets the server free it.
    /// Without NBD_CMD_WRITE_ZEROES, zeros are written.
    pub fn write_zeroes(&mut self, offset: u64, len: u64, unmap: bool) -> Result<(), ClientError> {
        if self.can_write_zeroes() {
            let flags = if unmap { 0 } else { CMD_FLAG_NO_HOLE };
            return self.ranged(CMD_WRITE_ZEROES, flags, offset, len);
        }
        self.check_range(offset, len)?;
        let zeros = vec![0; (self.max_request as u64).min(len) as usize];
        let mut done = 0;
        while done < len {
            let n = (len - done).min(zeros.len() as u64) as usize;
            self.write(&zeros[..n], offset + done)?;
            done += n as u64;
        }
        Ok(())
    }

    /// Lets the server free `[offset, offset + len)`; a no-op when it does not trim.
    pub fn trim(&mut self, offset: u64, len: u64) -> Result<(), ClientError> {
        if self.flags & FLAG_SEND_TRIM == 0 || len == 0 {
            return Ok(());
        }
        self.ranged(CMD_TRIM, 0, offset, len)
    }

    /// Makes what was written durable; a no-op when the server has no flush.
    pub fn flush(&mut self) -> Result<(), ClientError> {
        if self.flags & FLAG_SEND_FLUSH == 0 {
            return Ok(());
        }
        let h = self.send(CMD_FLUSH, 0, 0, 0, &[])?;
        self.reply(h, None, None)
    }

    /// Block status of the stretch starting at `offset` (at most `len` bytes): whether it
    /// is a hole and whether it reads as zeros, and its length (never more than `len`,
    /// never zero). All data when the server has no `base:allocation`.
    pub fn block_status(&mut self, offset: u64, len: u64) -> Result<Status, ClientError> {
        self.check_range(offset, len)?;
        let all_data = Status {
            len,
            hole: false,
            zero: false,
        };
        if self.allocation.is_none() || len == 0 {
            return Ok(all_data);
        }
        let n = len.min(u64::from(MAX_RANGE)).max(1) as u32;
        let h = self.send(CMD_BLOCK_STATUS, CMD_FLAG_REQ_ONE, offset, n, &[])?;
        let mut out = Vec::new();
        self.reply(h, None, Some(&mut out))?;
        let first = out
            .first()
            .copied()
            .ok_or_else(|| proto("block status reply without extents"))?;
        // A server whose extents do not follow its own minimum block (an unaligned file
        // end) is read in whole blocks, as QEMU's client reads it: a short extent grows
        // to a block and counts as data, a long one is cut back to whole blocks.
        let min = u64::from(self.min_block);
        let status = if first.len % min == 0 {
            first
        } else if first.len > min {
            Status {
                len: first.len / min * min,
                ..first
            }
        } else {
            Status {
                len: min,
                hole: false,
                zero: false,
            }
        };
        Ok(Status {
            len: status.len.min(len),
            ..status
        })
    }

    /// Tells the server we are done (best effort).
    pub fn disconnect(&mut self) {
        let _ = self.send(CMD_DISC, 0, 0, 0, &[]);
    }
}

const BASE_ALLOC: &str = "base:allocation";

/// An OS error as QEMU words it: its text without Rust's `(os error N)`.
fn os_text(e: &std::io::Error) -> String {
    let text = e.to_string();
    match text.find(" (os error ") {
        Some(i) => text[..i].to_string(),
        None => text,
    }
}

fn proto(msg: impl Into<String>) -> ClientError {
    ClientError::Protocol(msg.into())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::net::UnixStream;

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
        let p = |s: &str| NbdTarget::parse(s).unwrap();
        assert_eq!(p("nbd+unix:///?socket=/s"), unix("/s", ""));
        assert_eq!(p("nbd+unix:///ex%20p?socket=/s"), unix("/s", "ex p"));
        assert_eq!(p("nbd://h/e"), inet("h", DEFAULT_PORT, "e"));
        assert_eq!(p("nbd+tcp://h:99"), inet("h", 99, ""));
        assert_eq!(p("nbd://[::1]:5/x"), inet("::1", 5, "x"));
        assert_eq!(p("nbd:unix:/s:exportname=e"), unix("/s", "e"));
        assert_eq!(p("nbd:h:77"), inet("h", 77, ""));
        assert_eq!(p("nbd:h:77:exportname=x"), inet("h", 77, "x"));
        assert!(matches!(
            NbdTarget::parse("nbd+unix:///"),
            Err(NameError::NoSocket(_))
        ));
        assert!(matches!(
            NbdTarget::parse("nbd://h:99999/"),
            Err(NameError::BadPort(_))
        ));
        assert!(NbdTarget::parse("nbd:").is_err());
        assert!(NbdTarget::parse("nbd+unix:///?socket=/s&x=1").is_err());
        assert_eq!(p("nbd:unix:/s").display_name(), "nbd+unix://?socket=/s");
        assert_eq!(p("nbd:h:7:exportname=e").display_name(), "nbd://h:7/e");
    }

    fn u32be(b: &[u8]) -> u32 {
        u32::from_be_bytes(b.try_into().unwrap())
    }

    fn opt_reply(s: &mut UnixStream, opt: u32, kind: u32, data: &[u8]) {
        let mut m = OPTION_REPLY_MAGIC.to_be_bytes().to_vec();
        m.extend_from_slice(&opt.to_be_bytes());
        m.extend_from_slice(&kind.to_be_bytes());
        m.extend_from_slice(&(data.len() as u32).to_be_bytes());
        m.extend_from_slice(data);
        let _ = s.write_all(&m);
    }

    /// A server that negotiates an export of `size` bytes (structured replies,
    /// `base:allocation` as context 1), then answers the first request with `reply`.
    fn fake_server(size: u64, go_info_len: Option<u32>, reply: Vec<u8>) -> UnixStream {
        let (client, mut s) = UnixStream::pair().unwrap();
        std::thread::spawn(move || {
            let mut hello = NBDMAGIC.to_be_bytes().to_vec();
            hello.extend_from_slice(&IHAVEOPT.to_be_bytes());
            hello.extend_from_slice(&(FLAG_FIXED_NEWSTYLE | FLAG_NO_ZEROES).to_be_bytes());
            s.write_all(&hello)?;
            let mut flags = [0; 4];
            s.read_exact(&mut flags)?;
            loop {
                let mut h = [0; 16];
                s.read_exact(&mut h)?;
                let opt = u32be(&h[8..12]);
                let mut data = vec![0; u32be(&h[12..16]) as usize];
                s.read_exact(&mut data)?;
                match opt {
                    OPT_STRUCTURED_REPLY => opt_reply(&mut s, opt, REP_ACK, &[]),
                    OPT_SET_META_CONTEXT => {
                        let mut d = 1u32.to_be_bytes().to_vec();
                        d.extend_from_slice(b"base:allocation");
                        opt_reply(&mut s, opt, REP_META_CONTEXT, &d);
                        opt_reply(&mut s, opt, REP_ACK, &[]);
                    }
                    OPT_GO => {
                        if let Some(len) = go_info_len {
                            // A reply header claiming `len` bytes, then nothing.
                            let mut m = OPTION_REPLY_MAGIC.to_be_bytes().to_vec();
                            m.extend_from_slice(&opt.to_be_bytes());
                            m.extend_from_slice(&REP_INFO.to_be_bytes());
                            m.extend_from_slice(&len.to_be_bytes());
                            s.write_all(&m)?;
                            return Ok::<(), std::io::Error>(());
                        }
                        let mut d = INFO_EXPORT.to_be_bytes().to_vec();
                        d.extend_from_slice(&size.to_be_bytes());
                        d.extend_from_slice(&(FLAG_HAS_FLAGS | FLAG_SEND_FLUSH).to_be_bytes());
                        opt_reply(&mut s, opt, REP_INFO, &d);
                        opt_reply(&mut s, opt, REP_ACK, &[]);
                        break;
                    }
                    _ => opt_reply(&mut s, opt, REP_ERR_UNSUP, &[]),
                }
            }
            let mut req = [0; 28];
            s.read_exact(&mut req)?;
            // The replies are built for the first request's handle.
            assert_eq!(&req[8..16], &1u64.to_be_bytes());
            s.write_all(&reply)?;
            Ok(())
        });
        client
    }

    fn chunk(flags: u16, kind: u16, len: u32, payload: &[u8]) -> Vec<u8> {
        let mut m = STRUCTURED_REPLY_MAGIC.to_be_bytes().to_vec();
        m.extend_from_slice(&flags.to_be_bytes());
        m.extend_from_slice(&kind.to_be_bytes());
        // The handle of a client's first request, so only the reply's content is wrong.
        m.extend_from_slice(&1u64.to_be_bytes());
        m.extend_from_slice(&len.to_be_bytes());
        m.extend_from_slice(payload);
        m
    }

    fn connect(s: UnixStream) -> Result<NbdClient<UnixStream>, ClientError> {
        s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
        NbdClient::handshake(s, "")
    }

    /// A client connected to a fake 1 MiB export whose transmission replies are `replies`.
    fn serving(replies: Vec<u8>) -> NbdClient<UnixStream> {
        connect(fake_server(1 << 20, None, replies)).expect("the handshake is well formed")
    }

    #[test]
    fn a_hostile_server_gets_typed_errors_not_panics() {
        // An option reply claiming 4 GiB: refused before any allocation.
        let e = connect(fake_server(1 << 20, Some(u32::MAX), vec![])).err();
        assert!(
            matches!(e, Some(ClientError::Handshake(ListError::Protocol(_)))),
            "{e:?}"
        );

        // An export size no offset can reach.
        let e = connect(fake_server(u64::MAX, None, vec![])).err();
        assert!(matches!(e, Some(ClientError::Protocol(_))), "{e:?}");

        // A read answered with a 4 GiB data chunk.
        let mut c = serving(chunk(
            REPLY_FLAG_DONE,
            REPLY_TYPE_OFFSET_DATA,
            u32::MAX,
            &0u64.to_be_bytes(),
        ));
        let e = c.read(&mut [0; 512], 0).unwrap_err();
        assert!(matches!(e, ClientError::Protocol(_)), "{e:?}");

        // Data placed before the offset asked.
        let mut c = serving(chunk(
            REPLY_FLAG_DONE,
            REPLY_TYPE_OFFSET_DATA,
            8 + 512,
            &0u64.to_be_bytes(),
        ));
        let e = c.read(&mut [0; 512], 4096).unwrap_err();
        assert!(matches!(e, ClientError::Protocol(_)), "{e:?}");

        // A read whose reply ends before covering the request.
        let mut c = serving(chunk(REPLY_FLAG_DONE, 0, 0, &[]));
        let e = c.read(&mut [0; 512], 0).unwrap_err();
        assert!(matches!(e, ClientError::Protocol(_)), "{e:?}");

        // Block status with a length no extent list fits, and with an empty extent.
        let mut c = serving(chunk(
            REPLY_FLAG_DONE,
            REPLY_TYPE_BLOCK_STATUS,
            u32::MAX,
            &1u32.to_be_bytes(),
        ));
        let e = c.block_status(0, 4096).unwrap_err();
        assert!(matches!(e, ClientError::Protocol(_)), "{e:?}");
        let mut p = 1u32.to_be_bytes().to_vec();
        p.extend_from_slice(&[0; 8]);
        let mut c = serving(chunk(REPLY_FLAG_DONE, REPLY_TYPE_BLOCK_STATUS, 12, &p));
        let e = c.block_status(0, 4096).unwrap_err();
        assert!(matches!(e, ClientError::Protocol(_)), "{e:?}");

        // An error chunk longer than any message, and garbage instead of a reply.
        let mut c = serving(chunk(REPLY_FLAG_DONE, REPLY_TYPE_ERROR, u32::MAX, &[]));
        assert!(matches!(c.flush().unwrap_err(), ClientError::Protocol(_)));
        let mut c = serving(vec![0xff; 64]);
        assert!(matches!(c.flush().unwrap_err(), ClientError::Protocol(_)));

        // A chunk that says nothing but does not end the reply, and holes covering the
        // request twice over.
        let mut c = serving(chunk(0, REPLY_TYPE_NONE, 0, &[]));
        assert!(matches!(c.flush().unwrap_err(), ClientError::Protocol(_)));
        let mut hole = 0u64.to_be_bytes().to_vec();
        hole.extend_from_slice(&512u32.to_be_bytes());
        let mut twice = chunk(0, REPLY_TYPE_OFFSET_HOLE, 12, &hole);
        twice.extend(chunk(REPLY_FLAG_DONE, REPLY_TYPE_OFFSET_HOLE, 12, &hole));
        let mut c = serving(twice);
        let e = c.read(&mut [0; 512], 0).unwrap_err();
        assert!(matches!(e, ClientError::Protocol(_)), "{e:?}");

        // Past the end of the export: refused before anything is sent.
        let mut c = connect(fake_server(4096, None, vec![])).unwrap();
        assert!(matches!(
            c.read(&mut [0; 512], 4000).unwrap_err(),
            ClientError::OutOfRange { .. }
        ));
    }

    #[test]
    fn a_server_error_chunk_is_the_requests_errno() {
        let mut p = (libc::ENOSPC as u32).to_be_bytes().to_vec();
        p.extend_from_slice(&0u16.to_be_bytes());
        let mut c = connect(fake_server(
            1 << 20,
            None,
            chunk(REPLY_FLAG_DONE, REPLY_TYPE_ERROR, 6, &p),
        ))
        .unwrap();
        let e = c.flush().unwrap_err();
        assert!(matches!(e, ClientError::Server { errno } if errno == libc::ENOSPC as u32));
        assert_eq!(std::io::Error::from(e).raw_os_error(), Some(libc::ENOSPC));
    }
}
