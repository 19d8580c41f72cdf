//! A blocking NBD client over a raw Unix socket, built on the crate's own wire codec: it
//! plays the Linux kernel (simple replies), a modern client (structured or extended) and a
//! misbehaving one (anything the tests want to send).

use std::io::{ErrorKind, Read, Write};
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::time::Duration;

use nbd_proto::wire::consts::*;
use nbd_proto::wire::handshake::*;
use nbd_proto::wire::option_data::{InfoReply, InfoRequest, MetaContextEntry, MetaContextRequest};
use nbd_proto::wire::reply::*;
use nbd_proto::wire::request::{Command, RequestHeader};

/// How the client negotiated.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Style {
    /// No structured replies: what the Linux kernel speaks after `nbd-client` hands over.
    Simple,
    /// Structured replies, compact headers.
    Structured,
    /// Extended headers.
    Extended,
}

pub struct RawClient {
    pub stream: UnixStream,
    pub style: Style,
    pub size: u64,
    pub flags: u16,
    /// Context ids by name, after a set.
    pub contexts: Vec<(u32, String)>,
}

/// A whole reply, however it was framed.
#[derive(Debug)]
pub enum Reply {
    Simple(SimpleReply, Vec<u8>),
    Chunks(Vec<(ChunkHeader, Vec<u8>)>),
}

impl Reply {
    /// The error value of the reply (0 on success).
    pub fn error(&self) -> u32 {
        match self {
            Reply::Simple(r, _) => r.error,
            Reply::Chunks(c) => c
                .iter()
                .find(|(h, _)| h.is_error())
                .map(|(h, p)| {
                    ErrorChunk::decode(h.reply_type, p)
                        .expect("valid error chunk")
                        .error
                })
                .unwrap_or(0),
        }
    }

    pub fn cookie(&self) -> u64 {
        match self {
            Reply::Simple(r, _) => r.cookie,
            Reply::Chunks(c) => c[0].0.cookie,
        }
    }

    /// Reassembles read data of `len` bytes starting at `offset`.
    pub fn data(&self, offset: u64, len: usize) -> Vec<u8> {
        match self {
            Reply::Simple(_, d) => d.clone(),
            Reply::Chunks(chunks) => {
                let mut out = vec![0xAAu8; len];
                let mut covered = 0usize;
                for (h, p) in chunks {
                    match h.reply_type {
                        REPLY_TYPE_OFFSET_DATA => {
                            let (at, data) = decode_offset_data(p).expect("data chunk");
                            let start = (at - offset) as usize;
                            out[start..start + data.len()].copy_from_slice(data);
                            covered += data.len();
                        }
                        REPLY_TYPE_OFFSET_HOLE => {
                            let hole = OffsetHole::decode(p).expect("hole chunk");
                            let start = (hole.offset - offset) as usize;
                            out[start..start + hole.size as usize].fill(0);
                            covered += hole.size as usize;
                        }
                        _ => {}
                    }
                }
                assert_eq!(
                    covered, len,
                    "content chunks must cover the request exactly"
                );
                out
            }
        }
    }
}

impl RawClient {
    /// Connects and reads the greeting.
    pub fn connect(path: &Path) -> (UnixStream, Greeting) {
        let mut stream = UnixStream::connect(path).expect("connect");
        // A safety net so a server bug fails the test instead of hanging it.
        stream
            .set_read_timeout(Some(Duration::from_secs(60)))
            .unwrap();
        let mut g = [0u8; GREETING_LEN];
        stream.read_exact(&mut g).expect("greeting");
        (stream, Greeting::decode(&g).expect("valid greeting"))
    }

    /// Negotiates `style` with `OPT_GO` on `export`, selecting `contexts`.
    pub fn open(path: &Path, export: &str, style: Style, contexts: &[&str]) -> Self {
        let (stream, g) = Self::connect(path);
        assert_eq!(g.flags, FLAG_FIXED_NEWSTYLE | FLAG_NO_ZEROES);
        let mut c = RawClient {
            stream,
            style,
            size: 0,
            flags: 0,
            contexts: Vec::new(),
        };
        c.send(
            &ClientFlags {
                fixed_newstyle: true,
                no_zeroes: true,
            }
            .encode(),
        );
        match style {
            Style::Simple => {}
            Style::Structured => {
                assert_eq!(c.option(OPT_STRUCTURED_REPLY, &[])[0].0.reply_type, REP_ACK)
            }
            Style::Extended => {
                assert_eq!(c.option(OPT_EXTENDED_HEADERS, &[])[0].0.reply_type, REP_ACK)
            }
        }
        if !contexts.is_empty() {
            let data = MetaContextRequest {
                name: export.as_bytes(),
                queries: contexts.iter().map(|q| q.as_bytes()).collect(),
            }
            .encode();
            for (h, d) in c.option(OPT_SET_META_CONTEXT, &data) {
                if h.reply_type == REP_META_CONTEXT {
                    let e = MetaContextEntry::decode(&d).unwrap();
                    c.contexts
                        .push((e.id, String::from_utf8(e.name.to_vec()).unwrap()));
                }
            }
        }
        let data = InfoRequest {
            name: export.as_bytes(),
            requests: vec![INFO_BLOCK_SIZE],
        }
        .encode();
        let replies = c.option(OPT_GO, &data);
        assert_eq!(
            replies.last().unwrap().0.reply_type,
            REP_ACK,
            "OPT_GO failed: {replies:?}"
        );
        for (h, d) in &replies {
            if h.reply_type == REP_INFO {
                if let InfoReply::Export { size, flags } = InfoReply::decode(d).unwrap() {
                    c.size = size;
                    c.flags = flags;
                }
            }
        }
        c
    }

    pub fn send(&mut self, bytes: &[u8]) {
        self.stream.write_all(bytes).expect("send");
    }

    /// Sends an option and reads replies until a final one (ACK or error).
    pub fn option(&mut self, option: u32, data: &[u8]) -> Vec<(OptionReplyHeader, Vec<u8>)> {
        let mut msg = OptionHeader {
            option,
            length: data.len() as u32,
        }
        .encode()
        .to_vec();
        msg.extend_from_slice(data);
        self.send(&msg);
        self.option_replies()
    }

    pub fn option_replies(&mut self) -> Vec<(OptionReplyHeader, Vec<u8>)> {
        let mut out = Vec::new();
        loop {
            let mut h = [0u8; OPTION_REPLY_HEADER_LEN];
            self.stream.read_exact(&mut h).expect("option reply");
            let h = OptionReplyHeader::decode(&h).expect("valid option reply");
            let mut d = vec![0u8; h.length as usize];
            self.stream.read_exact(&mut d).expect("option reply data");
            let last = h.reply_type == REP_ACK || h.is_error();
            out.push((h, d));
            if last {
                return out;
            }
        }
    }

    /// Sends one request header (compact or extended per style) and payload.
    pub fn request(
        &mut self,
        command: Command,
        flags: u16,
        cookie: u64,
        offset: u64,
        length: u64,
        payload: &[u8],
    ) {
        let h = RequestHeader {
            flags,
            command,
            cookie,
            offset,
            length,
        };
        let mut msg = match self.style {
            Style::Extended => h.encode_extended().to_vec(),
            _ => h.encode_compact().expect("32-bit length").to_vec(),
        };
        msg.extend_from_slice(payload);
        self.send(&msg);
    }

    /// Reads one whole reply; `read_len` is the data length if this answers a READ that
    /// might be a successful simple reply.
    pub fn reply(&mut self, read_len: usize) -> Reply {
        match self.style {
            Style::Extended => Reply::Chunks(self.chunks_until_done(true)),
            Style::Simple => self.simple(read_len),
            Style::Structured => {
                let mut magic = [0u8; 4];
                self.stream.read_exact(&mut magic).expect("reply");
                if u32::from_be_bytes(magic) == SIMPLE_REPLY_MAGIC {
                    let mut h = magic.to_vec();
                    h.resize(SIMPLE_REPLY_LEN, 0);
                    self.stream.read_exact(&mut h[4..]).expect("simple reply");
                    Reply::Simple(
                        SimpleReply::decode(&h).expect("valid simple reply"),
                        Vec::new(),
                    )
                } else {
                    let mut b = magic.to_vec();
                    b.resize(STRUCTURED_HEADER_LEN, 0);
                    self.stream
                        .read_exact(&mut b[4..])
                        .expect("structured chunk");
                    let h = ChunkHeader::decode_structured(&b).expect("valid structured chunk");
                    let mut p = vec![0u8; h.length as usize];
                    self.stream.read_exact(&mut p).expect("chunk payload");
                    let mut chunks = vec![(h, p)];
                    if !h.is_done() {
                        chunks.extend(self.chunks_until_done(false));
                    }
                    Reply::Chunks(chunks)
                }
            }
        }
    }

    fn simple(&mut self, read_len: usize) -> Reply {
        let mut h = [0u8; SIMPLE_REPLY_LEN];
        self.stream.read_exact(&mut h).expect("simple reply");
        let r = SimpleReply::decode(&h).expect("valid simple reply");
        let mut data = vec![0u8; if r.error == 0 { read_len } else { 0 }];
        self.stream.read_exact(&mut data).expect("read data");
        Reply::Simple(r, data)
    }

    fn chunks_until_done(&mut self, extended: bool) -> Vec<(ChunkHeader, Vec<u8>)> {
        let mut out = Vec::new();
        loop {
            let h = if extended {
                let mut b = [0u8; EXTENDED_HEADER_LEN];
                self.stream.read_exact(&mut b).expect("extended chunk");
                ChunkHeader::decode_extended(&b).expect("valid extended chunk")
            } else {
                let mut b = [0u8; STRUCTURED_HEADER_LEN];
                self.stream.read_exact(&mut b).expect("structured chunk");
                ChunkHeader::decode_structured(&b).expect("valid structured chunk")
            };
            let mut p = vec![0u8; h.length as usize];
            self.stream.read_exact(&mut p).expect("chunk payload");
            let done = h.is_done();
            out.push((h, p));
            if done {
                return out;
            }
        }
    }

    /// Reads one whole reply from a stream where several requests may be in flight: returns
    /// the first complete reply (chunks of one cookie until its DONE).
    pub fn any_reply(&mut self) -> Reply {
        self.reply(0)
    }
}

/// True if the server closed `stream` (EOF or reset).
pub fn closed(stream: &mut UnixStream) -> bool {
    let mut b = [0u8; 64];
    loop {
        match stream.read(&mut b) {
            Ok(0) => return true,
            Ok(_) => continue,
            Err(e) if e.kind() == ErrorKind::ConnectionReset => return true,
            Err(e) => panic!("unexpected error waiting for close: {e}"),
        }
    }
}
