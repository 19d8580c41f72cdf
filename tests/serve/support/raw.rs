//! A raw NBD client's handshake steps, for tests that must send what real clients never do
//! (floods, stalls, replies left unread).

use std::io::{Read, Write};
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::time::Duration;

/// NBD_OPT_GO.
pub const OPT_GO: u32 = 7;
/// NBD_OPT_LIST.
pub const OPT_LIST: u32 = 3;
/// NBD_OPT_STRUCTURED_REPLY.
pub const OPT_STRUCTURED_REPLY: u32 = 8;
/// NBD_OPT_LIST_META_CONTEXT.
pub const OPT_LIST_META_CONTEXT: u32 = 9;
/// NBD_OPT_SET_META_CONTEXT.
pub const OPT_SET_META_CONTEXT: u32 = 10;
/// NBD_REP_ACK.
pub const REP_ACK: u32 = 1;

/// Connects, reads the greeting and sends fixed-newstyle, no-zeroes client flags: the
/// connection is ready for options.
pub fn negotiating(socket: &Path) -> UnixStream {
    let mut s = UnixStream::connect(socket).unwrap();
    // A safety net so a server bug fails the test instead of hanging it.
    s.set_read_timeout(Some(Duration::from_secs(60))).unwrap();
    let mut greeting = [0u8; 18];
    s.read_exact(&mut greeting).unwrap();
    assert_eq!(&greeting[..16], b"NBDMAGICIHAVEOPT");
    s.write_all(&3u32.to_be_bytes()).unwrap();
    s
}

/// An option on the wire.
pub fn option(opt: u32, data: &[u8]) -> Vec<u8> {
    let mut m = b"IHAVEOPT".to_vec();
    m.extend_from_slice(&opt.to_be_bytes());
    m.extend_from_slice(&u32::try_from(data.len()).unwrap().to_be_bytes());
    m.extend_from_slice(data);
    m
}

/// Reads option replies up to the one that ends the option (an ACK or an error, which has
/// the high bit set), and returns its type.
pub fn finish_option(s: &mut UnixStream) -> u32 {
    loop {
        let mut head = [0u8; 20];
        s.read_exact(&mut head).unwrap();
        let kind = u32::from_be_bytes(head[12..16].try_into().unwrap());
        let len = u32::from_be_bytes(head[16..20].try_into().unwrap()) as usize;
        let mut data = vec![0u8; len];
        s.read_exact(&mut data).unwrap();
        if kind == REP_ACK || kind & 0x8000_0000 != 0 {
            return kind;
        }
    }
}

/// NBD_OPT_GO for the default export ("", no information requests); panics if refused.
pub fn go(s: &mut UnixStream) {
    let mut data = 0u32.to_be_bytes().to_vec();
    data.extend_from_slice(&0u16.to_be_bytes());
    s.write_all(&option(OPT_GO, &data)).unwrap();
    assert_eq!(finish_option(s), REP_ACK, "NBD_OPT_GO refused");
}
