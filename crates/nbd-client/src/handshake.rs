//! Connecting and negotiating: structured replies, `base:allocation` and the export's size,
//! flags and block sizes, through `list.rs`'s option code.

use std::io::{Read, Write};
use std::net::TcpStream;
use std::os::unix::net::UnixStream;
use std::time::Duration;

use nbd_proto::wire::consts::*;

use crate::error::{proto, ClientError};
use crate::limits::MAX_REQUEST;
use crate::list::{name_field, refused, Client as OptClient, ListError};
use crate::name::{NbdTarget, ServerAddr};
use crate::session::{NbdClient, ReadWrite};

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
        let context = crate::status_context::status_context_for(&target.display_name());
        let Some(tls) = crate::tls::tls_for(&target.display_name()) else {
            let mut conn = Box::new(conn) as Box<dyn ReadWrite>;
            OptClient { s: &mut conn }.greet()?;
            return NbdClient::negotiate(conn, &target.export, context.as_deref());
        };
        // The host connected to is what the certificate must name, unless told otherwise.
        let hostname = tls.hostname.clone().or(match &target.server {
            ServerAddr::Inet { host, .. } => Some(host.clone()),
            ServerAddr::Unix(_) => None,
        });
        let mut conn = conn;
        let mut o = OptClient { s: &mut conn };
        o.greet()?;
        o.starttls()?;
        let secure = tls
            .client
            .connect(conn, hostname.as_deref())
            .map_err(ListError::from)?;
        let channel = crate::tls::TlsChannel(secure);
        NbdClient::negotiate(
            Box::new(channel) as Box<dyn ReadWrite>,
            &target.export,
            context.as_deref(),
        )
    }
}

impl<S: Read + Write> NbdClient<S> {
    /// Negotiates export `export` over `s`: structured replies and `base:allocation` when
    /// the server offers them, then NBD_OPT_GO.
    pub fn handshake(mut s: S, export: &str) -> Result<NbdClient<S>, ClientError> {
        OptClient { s: &mut s }.greet()?;
        NbdClient::negotiate(s, export, None)
    }

    /// The negotiation after the greeting (and after TLS, when it is used). After a
    /// refusal the client says it is leaving (NBD_OPT_ABORT), as QEMU's client does, rather
    /// than just hanging up. Block status comes from `context` when given (QEMU's
    /// `x-dirty-bitmap`), else from `base:allocation`.
    fn negotiate(
        mut s: S,
        export: &str,
        context: Option<&str>,
    ) -> Result<NbdClient<S>, ClientError> {
        let r = NbdClient::negotiate_inner(&mut s, export, context.unwrap_or(BASE_ALLOCATION));
        match r {
            Ok((size, flags, structured, allocation, max_request, min_block)) => Ok(NbdClient {
                s,
                size,
                flags,
                structured,
                allocation,
                max_request,
                min_block,
                depth_context: context == Some(ALLOCATION_DEPTH),
                next_handle: 1,
            }),
            Err(e) => {
                if let ClientError::Handshake(ListError::Refused { .. }) = &e {
                    let _ = OptClient { s: &mut s }.send_option(OPT_ABORT, &[]);
                }
                Err(e)
            }
        }
    }

    #[allow(clippy::type_complexity)]
    fn negotiate_inner(
        s: &mut S,
        export: &str,
        context: &str,
    ) -> Result<(u64, u16, bool, Option<u32>, u32, u32), ClientError> {
        let mut o = OptClient { s };
        let structured = o.simple_option(OPT_STRUCTURED_REPLY)?;
        let mut allocation = None;
        if structured {
            let mut data = name_field(export)?;
            data.extend_from_slice(&1u32.to_be_bytes());
            data.extend_from_slice(&name_field(context)?);
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
                        if &r.data[4..] == context.as_bytes() {
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
        if allocation.is_none() && context != BASE_ALLOCATION {
            return Err(ClientError::NoStatusContext(context.to_owned()));
        }
        let (size, flags) = size_flags.ok_or_else(|| proto("no export size sent"))?;
        if size > i64::MAX as u64 {
            return Err(proto(format!("export size {size} too large")));
        }
        Ok((size, flags, structured, allocation, max_request, min_block))
    }
}
