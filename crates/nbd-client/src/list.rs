//! The client side of listing a server's exports, as qemu-nbd's `--list` does it: the
//! export list, then each export's size, flags, block sizes and metadata contexts, over TLS
//! when credentials are given. Every reply is read from an untrusted server: lengths are
//! bounded and checked, and anything the protocol does not allow is an error, never a
//! panic. Blocking I/O: the caller sets the socket's timeouts.

use std::io::{Read, Write};

use nbd_proto::tls::ClientHandshakeError;

use nbd_proto::wire::consts::*;

use crate::creds::TlsClient;

/// Largest option reply accepted: a name or description is at most 4 KiB by the protocol,
/// so anything far bigger is a broken server.
pub const MAX_REPLY: u32 = 64 << 10;

/// Most exports (and metadata contexts per export) listed: bounds the memory a hostile
/// server can make the listing use.
pub const MAX_ITEMS: usize = 65536;

/// Why a listing failed; the texts are QEMU's client's where it has one.
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
    /// Reading the answer to an option failed (QEMU's words; an early end of the stream
    /// told as QEMU tells it).
    #[error("Failed to read option reply: {}", read_failure(.0))]
    ReadReply(std::io::Error),
    /// It answered something the protocol does not allow.
    #[error("Server sent an unexpected reply: {0}")]
    Protocol(String),
    /// It refused the listing.
    #[error("Server does not support export lists")]
    Unsupported,
    /// It answered an option with an error.
    #[error("{}", refusal_text(*.option, *.kind))]
    Refused {
        /// The option.
        option: u32,
        /// The error reply type.
        kind: u32,
        /// The server's message, if it sent one.
        message: String,
    },
    /// The TLS handshake failed.
    #[error(transparent)]
    Tls(#[from] ClientHandshakeError),
}

impl ListError {
    /// The lines QEMU's client prints after the error to help: for a refusal, what to
    /// check and what the server said.
    pub fn hints(&self) -> Vec<String> {
        let mut out = Vec::new();
        if let ListError::Refused { kind, message, .. } = self {
            if *kind == REP_ERR_TLS_REQD {
                out.push("Did you forget a valid tls-creds?".to_owned());
            }
            if !message.is_empty() {
                out.push(format!("server reported: {message}"));
            }
        }
        out
    }
}

/// A failed read of an option reply: an end of the stream the channel did not explain is
/// told in QEMU's words.
fn read_failure(e: &std::io::Error) -> String {
    if e.kind() == std::io::ErrorKind::UnexpectedEof && e.get_ref().is_none() {
        return "Unexpected end-of-file before all data were read".to_owned();
    }
    e.to_string()
}

/// An option's name, as QEMU's messages give it.
pub fn option_name(option: u32) -> &'static str {
    match option {
        OPT_EXPORT_NAME => "export-name",
        OPT_ABORT => "abort",
        OPT_LIST => "list",
        OPT_PEEK_EXPORT => "peek-export",
        OPT_STARTTLS => "starttls",
        OPT_INFO => "info",
        OPT_GO => "go",
        OPT_STRUCTURED_REPLY => "structured-reply",
        OPT_LIST_META_CONTEXT => "list-meta-context",
        OPT_SET_META_CONTEXT => "set-meta-context",
        OPT_EXTENDED_HEADERS => "extended-headers",
        _ => "<unknown>",
    }
}

/// What QEMU's client says when the server answers `option` with error `kind`.
fn refusal_text(option: u32, kind: u32) -> String {
    let name = option_name(option);
    match kind {
        REP_ERR_POLICY => format!("Denied by server for option {option} ({name})"),
        REP_ERR_INVALID => format!("Invalid parameters for option {option} ({name})"),
        REP_ERR_PLATFORM => format!("Server lacks support for option {option} ({name})"),
        REP_ERR_TLS_REQD => format!("TLS negotiation required before option {option} ({name})"),
        REP_ERR_UNKNOWN => "Requested export not available".to_owned(),
        REP_ERR_SHUTDOWN => format!("Server shutting down before option {option} ({name})"),
        REP_ERR_BLOCK_SIZE_REQD => {
            format!("Server requires INFO_BLOCK_SIZE for option {option} ({name})")
        }
        _ => format!("Unknown error code when asking for option {option} ({name})"),
    }
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

/// TLS for a listing: the credentials, and the host name the server's certificate must
/// name (x509 credentials that verify the server need one).
#[derive(Debug, Clone, Copy)]
pub struct ListTls<'a> {
    /// The credentials.
    pub client: &'a TlsClient,
    /// The name to check the certificate against.
    pub hostname: Option<&'a str>,
}

pub(crate) trait Stream: Read + Write {}
impl<T: Read + Write> Stream for T {}

/// Lists the exports of the server at the other end of `stream`, after starting TLS on it
/// with `tls` when given.
pub fn list_exports<S: Read + Write>(
    mut stream: S,
    tls: Option<ListTls<'_>>,
) -> Result<(Mode, Vec<ExportInfo>), ListError> {
    Client { s: &mut stream }.greet()?;
    match tls {
        None => Client { s: &mut stream }.list(),
        Some(tls) => {
            Client { s: &mut stream }.starttls()?;
            let mut secure = tls.client.connect(stream, tls.hostname)?;
            Client { s: &mut secure }.list()
        }
    }
}

pub(crate) struct Client<'a> {
    pub(crate) s: &'a mut dyn Stream,
}

/// The error for an error reply `r` to `option`.
pub(crate) fn refused(option: u32, r: Reply) -> ListError {
    ListError::Refused {
        option,
        kind: r.kind,
        message: String::from_utf8_lossy(&r.data).into_owned(),
    }
}

/// One option reply: its type and data.
pub(crate) struct Reply {
    pub(crate) kind: u32,
    pub(crate) data: Vec<u8>,
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

    /// The greeting and the client flags.
    pub(crate) fn greet(&mut self) -> Result<(), ListError> {
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
        self.s.flush()?;
        Ok(())
    }

    /// After a refusal, tells the server the client is leaving (NBD_OPT_ABORT), as QEMU's
    /// client does, rather than just hanging up.
    fn abort_on_refusal<T>(&mut self, r: Result<T, ListError>) -> Result<T, ListError> {
        if let Err(ListError::Refused { .. }) = &r {
            let _ = self.send_option(OPT_ABORT, &[]);
        }
        r
    }

    /// NBD_OPT_STARTTLS, which must be acknowledged before the TLS handshake.
    pub(crate) fn starttls(&mut self) -> Result<(), ListError> {
        let r = self.starttls_inner();
        self.abort_on_refusal(r)
    }

    fn starttls_inner(&mut self) -> Result<(), ListError> {
        self.send_option(OPT_STARTTLS, &[])?;
        let r = self.reply(OPT_STARTTLS)?;
        match r.kind {
            REP_ACK => Ok(()),
            k if k & REP_FLAG_ERROR != 0 => Err(refused(OPT_STARTTLS, r)),
            k => Err(ListError::Protocol(format!(
                "reply type {k} to NBD_OPT_STARTTLS"
            ))),
        }
    }

    /// The whole listing, after the greeting (and TLS).
    fn list(&mut self) -> Result<(Mode, Vec<ExportInfo>), ListError> {
        let r = self.list_inner();
        self.abort_on_refusal(r)
    }

    fn list_inner(&mut self) -> Result<(Mode, Vec<ExportInfo>), ListError> {
        let mode = self.reply_mode()?;
        let mut exports = self.list_names()?;
        for e in &mut exports {
            if !self.info(e)? {
                // As qemu-nbd: a server that cannot answer NBD_OPT_INFO will not answer the
                // rest.
                break;
            }
            if mode != Mode::Simple {
                self.meta_contexts(e)?;
            }
        }
        // A courtesy before hanging up; the server may close first.
        let _ = self.send_option(OPT_ABORT, &[]);
        Ok((mode, exports))
    }

    /// The richest reply mode the server takes.
    fn reply_mode(&mut self) -> Result<Mode, ListError> {
        if self.simple_option(OPT_EXTENDED_HEADERS)? {
            return Ok(Mode::Extended);
        }
        if self.simple_option(OPT_STRUCTURED_REPLY)? {
            return Ok(Mode::Structured);
        }
        Ok(Mode::Simple)
    }

    pub(crate) fn send_option(&mut self, option: u32, data: &[u8]) -> Result<(), ListError> {
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

    pub(crate) fn reply(&mut self, option: u32) -> Result<Reply, ListError> {
        let magic = match self.read_u64() {
            Ok(m) => m,
            Err(ListError::Io(e)) => return Err(ListError::ReadReply(e)),
            Err(e) => return Err(e),
        };
        if magic != OPTION_REPLY_MAGIC {
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
        Ok(Reply { kind, data })
    }

    /// An option without data that is either acknowledged (true) or refused (false).
    pub(crate) fn simple_option(&mut self, option: u32) -> Result<bool, ListError> {
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
                k if k & REP_FLAG_ERROR != 0 => return Err(refused(OPT_LIST, r)),
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
                k if k & REP_FLAG_ERROR != 0 => return Err(refused(OPT_INFO, r)),
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
pub(crate) fn name_field(name: &str) -> Result<Vec<u8>, ListError> {
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
    fn malformed_server_replies_are_errors_not_panics() {
        assert!(split_name(&[]).is_err());
        assert!(split_name(&[0, 0, 0, 9, b'a']).is_err());
        assert!(split_name(&[0xff, 0xff, 0xff, 0xff]).is_err());
        let (name, rest) = split_name(&[0, 0, 0, 1, b'a', b'd']).unwrap();
        assert_eq!((name.as_str(), rest), ("a", &b"d"[..]));
    }

    /// A scripted server: replies `input` whatever is asked, and keeps what it is sent.
    struct Scripted<'a> {
        input: &'a [u8],
        sent: Vec<u8>,
    }

    impl Read for Scripted<'_> {
        fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
            self.input.read(buf)
        }
    }

    impl Write for Scripted<'_> {
        fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
            self.sent.extend_from_slice(buf);
            Ok(buf.len())
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }

    fn rep(option: u32, kind: u32, data: &[u8]) -> Vec<u8> {
        let mut v = OPTION_REPLY_MAGIC.to_be_bytes().to_vec();
        for w in [option, kind, data.len() as u32] {
            v.extend_from_slice(&w.to_be_bytes());
        }
        v.extend_from_slice(data);
        v
    }

    fn greeting() -> Vec<u8> {
        let mut v = NBDMAGIC.to_be_bytes().to_vec();
        v.extend_from_slice(&IHAVEOPT.to_be_bytes());
        v.extend_from_slice(&(FLAG_FIXED_NEWSTYLE | FLAG_NO_ZEROES).to_be_bytes());
        v
    }

    #[test]
    fn a_listing_is_read_from_the_replies() {
        let mut input = greeting();
        input.extend(rep(OPT_EXTENDED_HEADERS, REP_ACK, &[]));
        input.extend(rep(OPT_LIST, REP_SERVER, b"\0\0\0\x04diska disk"));
        input.extend(rep(OPT_LIST, REP_ACK, &[]));
        let mut export = INFO_EXPORT.to_be_bytes().to_vec();
        export.extend_from_slice(&(1u64 << 20).to_be_bytes());
        export.extend_from_slice(&0x4edu16.to_be_bytes());
        input.extend(rep(OPT_INFO, REP_INFO, &export));
        let mut sizes = INFO_BLOCK_SIZE.to_be_bytes().to_vec();
        for w in [512u32, 4096, 1 << 25] {
            sizes.extend_from_slice(&w.to_be_bytes());
        }
        input.extend(rep(OPT_INFO, REP_INFO, &sizes));
        input.extend(rep(OPT_INFO, REP_ACK, &[]));
        input.extend(rep(
            OPT_LIST_META_CONTEXT,
            REP_META_CONTEXT,
            b"\0\0\0\0qemu:allocation-depth",
        ));
        input.extend(rep(OPT_LIST_META_CONTEXT, REP_ACK, &[]));
        let mut server = Scripted {
            input: &input,
            sent: Vec::new(),
        };
        let (mode, exports) = list_exports(&mut server, None).unwrap();
        assert_eq!(mode, Mode::Extended);
        assert_eq!(
            exports,
            [ExportInfo {
                name: "disk".into(),
                description: "a disk".into(),
                size_flags: Some((1 << 20, 0x4ed)),
                block_sizes: Some((512, 4096, 1 << 25)),
                contexts: vec!["qemu:allocation-depth".into()],
            }]
        );
        // Every prefix of the replies is an error, never a panic or a listing.
        for n in 0..input.len() {
            let mut cut = Scripted {
                input: &input[..n],
                sent: Vec::new(),
            };
            assert!(list_exports(&mut cut, None).is_err(), "{n} bytes");
        }
    }

    #[test]
    fn a_server_requiring_tls_is_told_in_qemus_words() {
        let mut input = greeting();
        input.extend(rep(OPT_EXTENDED_HEADERS, REP_ERR_TLS_REQD, &[]));
        input.extend(rep(OPT_STRUCTURED_REPLY, REP_ERR_TLS_REQD, &[]));
        input.extend(rep(OPT_LIST, REP_ERR_TLS_REQD, b"no"));
        let mut server = Scripted {
            input: &input,
            sent: Vec::new(),
        };
        let e = list_exports(&mut server, None).unwrap_err();
        assert_eq!(
            e.to_string(),
            "TLS negotiation required before option 3 (list)"
        );
        // The client said goodbye: its last message is NBD_OPT_ABORT.
        let mut abort = IHAVEOPT.to_be_bytes().to_vec();
        abort.extend_from_slice(&OPT_ABORT.to_be_bytes());
        abort.extend_from_slice(&0u32.to_be_bytes());
        assert!(server.sent.ends_with(&abort));
        assert_eq!(
            e.hints().last().map(String::as_str),
            Some("server reported: no")
        );
    }

    #[test]
    fn refusals_are_told_in_qemus_words() {
        let e = |option, kind| {
            ListError::Refused {
                option,
                kind,
                message: "why".into(),
            }
            .to_string()
        };
        assert_eq!(
            e(OPT_STARTTLS, REP_ERR_POLICY),
            "Denied by server for option 5 (starttls)"
        );
        assert_eq!(
            e(OPT_LIST, REP_ERR_TLS_REQD),
            "TLS negotiation required before option 3 (list)"
        );
        let tls = ListError::Refused {
            option: OPT_LIST,
            kind: REP_ERR_TLS_REQD,
            message: "why".into(),
        };
        assert_eq!(
            tls.hints(),
            ["Did you forget a valid tls-creds?", "server reported: why"]
        );
        assert!(ListError::Unsupported.hints().is_empty());
        assert_eq!(
            e(99, REP_FLAG_ERROR | 77),
            "Unknown error code when asking for option 99 (<unknown>)"
        );
    }
}
