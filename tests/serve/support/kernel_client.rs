//! A minimal NBD client that speaks like the Linux kernel after `nbd-client` hands it the
//! socket: fixed newstyle with `NBD_OPT_EXPORT_NAME`, no structured replies, so every answer
//! is a simple reply (and read data follows it unframed). Written from the protocol document
//! only, so it checks the server against the spec rather than against the nbd-proto
//! crate's codec. It can also misbehave on purpose (raw bytes, cut-short requests).

use std::collections::HashMap;
use std::io::{ErrorKind, Read, Write};
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::time::Duration;

const NBDMAGIC: &[u8; 8] = b"NBDMAGIC";
const IHAVEOPT: u64 = 0x4948_4156_454F_5054;
const FLAG_FIXED_NEWSTYLE: u16 = 1;
const FLAG_NO_ZEROES: u16 = 2;
const OPT_EXPORT_NAME: u32 = 1;
const REQUEST_MAGIC: u32 = 0x2560_9513;
const SIMPLE_REPLY_MAGIC: u32 = 0x6744_6698;

/// Transmission flags the tests look at.
pub const TFLAG_READ_ONLY: u16 = 1 << 1;
/// `NBD_FLAG_SEND_FLUSH`.
pub const TFLAG_SEND_FLUSH: u16 = 1 << 2;
/// `NBD_FLAG_SEND_FUA`.
pub const TFLAG_SEND_FUA: u16 = 1 << 3;
/// `NBD_FLAG_SEND_TRIM`.
pub const TFLAG_SEND_TRIM: u16 = 1 << 5;
/// `NBD_FLAG_CAN_MULTI_CONN`.
pub const TFLAG_CAN_MULTI_CONN: u16 = 1 << 8;

/// Command numbers.
pub const CMD_READ: u16 = 0;
/// `NBD_CMD_WRITE`.
pub const CMD_WRITE: u16 = 1;
/// `NBD_CMD_DISC`.
pub const CMD_DISC: u16 = 2;
/// `NBD_CMD_FLUSH`.
pub const CMD_FLUSH: u16 = 3;
/// `NBD_CMD_TRIM`.
pub const CMD_TRIM: u16 = 4;
/// `NBD_CMD_WRITE_ZEROES`.
pub const CMD_WRITE_ZEROES: u16 = 6;
/// `NBD_CMD_FLAG_FUA`.
pub const FLAG_FUA: u16 = 1;

/// Errno values on the wire.
pub const EPERM: u32 = 1;
/// `NBD_EINVAL`.
pub const EINVAL: u32 = 22;

/// A connected client in transmission phase.
pub struct KernelClient {
    pub stream: UnixStream,
    pub size: u64,
    pub flags: u16,
    /// Read lengths of requests not yet answered, by cookie (simple replies carry no length).
    pending_reads: HashMap<u64, usize>,
}

/// One simple reply.
#[derive(Debug, PartialEq, Eq)]
pub struct SimpleReply {
    pub cookie: u64,
    pub error: u32,
    /// Read data (empty for other commands and for errors).
    pub data: Vec<u8>,
}

impl KernelClient {
    /// Connects to `socket` and selects `export` with `NBD_OPT_EXPORT_NAME`.
    pub fn connect(socket: &Path, export: &str) -> KernelClient {
        let mut stream = UnixStream::connect(socket).expect("connect");
        // A safety net so a server bug fails the test instead of hanging it.
        stream
            .set_read_timeout(Some(Duration::from_secs(60)))
            .unwrap();
        let mut greeting = [0u8; 18];
        stream.read_exact(&mut greeting).expect("greeting");
        assert_eq!(&greeting[..8], NBDMAGIC);
        assert_eq!(
            u64::from_be_bytes(greeting[8..16].try_into().unwrap()),
            IHAVEOPT
        );
        let hflags = u16::from_be_bytes([greeting[16], greeting[17]]);
        assert_ne!(hflags & FLAG_FIXED_NEWSTYLE, 0, "fixed newstyle offered");
        let no_zeroes = hflags & FLAG_NO_ZEROES != 0;
        let cflags = u32::from(FLAG_FIXED_NEWSTYLE)
            | if no_zeroes {
                u32::from(FLAG_NO_ZEROES)
            } else {
                0
            };
        let mut msg = cflags.to_be_bytes().to_vec();
        msg.extend_from_slice(&IHAVEOPT.to_be_bytes());
        msg.extend_from_slice(&OPT_EXPORT_NAME.to_be_bytes());
        msg.extend_from_slice(&u32::try_from(export.len()).unwrap().to_be_bytes());
        msg.extend_from_slice(export.as_bytes());
        stream.write_all(&msg).unwrap();
        let mut info = vec![0u8; if no_zeroes { 10 } else { 10 + 124 }];
        stream.read_exact(&mut info).expect("export info");
        KernelClient {
            stream,
            size: u64::from_be_bytes(info[..8].try_into().unwrap()),
            flags: u16::from_be_bytes([info[8], info[9]]),
            pending_reads: HashMap::new(),
        }
    }

    /// Sends one request (and its payload, for writes).
    pub fn send(
        &mut self,
        cmd: u16,
        flags: u16,
        cookie: u64,
        offset: u64,
        len: u32,
        payload: &[u8],
    ) {
        let msg = Self::encode(cmd, flags, cookie, offset, len, payload);
        if cmd == CMD_READ {
            self.pending_reads.insert(cookie, len as usize);
        }
        self.stream.write_all(&msg).expect("send request");
    }

    /// Sends raw bytes (for malformed traffic).
    pub fn send_raw(&mut self, bytes: &[u8]) {
        self.stream.write_all(bytes).expect("send");
    }

    /// Receives the next reply, whichever request it answers.
    pub fn reply(&mut self) -> SimpleReply {
        self.try_reply().expect("simple reply")
    }

    /// Receives the next reply, or `None` if the server closed the connection first.
    pub fn try_reply(&mut self) -> Option<SimpleReply> {
        let mut h = [0u8; 16];
        match self.stream.read_exact(&mut h) {
            Ok(()) => {}
            Err(e)
                if matches!(
                    e.kind(),
                    ErrorKind::UnexpectedEof | ErrorKind::ConnectionReset
                ) =>
            {
                return None
            }
            Err(e) => panic!("reading a reply: {e}"),
        }
        assert_eq!(
            u32::from_be_bytes(h[..4].try_into().unwrap()),
            SIMPLE_REPLY_MAGIC,
            "only simple replies without structured-reply negotiation"
        );
        let error = u32::from_be_bytes(h[4..8].try_into().unwrap());
        let cookie = u64::from_be_bytes(h[8..16].try_into().unwrap());
        let len = self.pending_reads.remove(&cookie).unwrap_or(0);
        let mut data = vec![0u8; if error == 0 { len } else { 0 }];
        self.stream.read_exact(&mut data).expect("read data");
        Some(SimpleReply {
            cookie,
            error,
            data,
        })
    }

    /// The request bytes for a command (to send from another thread).
    pub fn encode(
        cmd: u16,
        flags: u16,
        cookie: u64,
        offset: u64,
        len: u32,
        payload: &[u8],
    ) -> Vec<u8> {
        let mut msg = Vec::with_capacity(28 + payload.len());
        msg.extend_from_slice(&REQUEST_MAGIC.to_be_bytes());
        msg.extend_from_slice(&flags.to_be_bytes());
        msg.extend_from_slice(&cmd.to_be_bytes());
        msg.extend_from_slice(&cookie.to_be_bytes());
        msg.extend_from_slice(&offset.to_be_bytes());
        msg.extend_from_slice(&len.to_be_bytes());
        msg.extend_from_slice(payload);
        msg
    }

    /// One request and its reply (nothing else in flight).
    pub fn call(
        &mut self,
        cmd: u16,
        flags: u16,
        offset: u64,
        len: u32,
        payload: &[u8],
    ) -> SimpleReply {
        self.send(cmd, flags, 1, offset, len, payload);
        let r = self.reply();
        assert_eq!(r.cookie, 1);
        r
    }

    /// Reads `len` bytes, asserting success.
    pub fn read(&mut self, offset: u64, len: u32) -> Vec<u8> {
        let r = self.call(CMD_READ, 0, offset, len, &[]);
        assert_eq!(r.error, 0, "read at {offset:#x}+{len:#x}");
        r.data
    }

    /// `NBD_CMD_DISC`, then waits for the server to close.
    pub fn disconnect(mut self) {
        self.send(CMD_DISC, 0, 99, 0, 0, &[]);
        assert!(self.is_closed(), "the server closes after DISC");
    }

    /// True if the server closed the connection (EOF or reset) without sending more.
    pub fn is_closed(&mut self) -> bool {
        let mut b = [0u8; 1];
        match self.stream.read(&mut b) {
            Ok(0) => true,
            Err(e) if e.kind() == ErrorKind::ConnectionReset => true,
            Ok(_) => false,
            Err(e) => panic!("unexpected error waiting for close: {e}"),
        }
    }
}
