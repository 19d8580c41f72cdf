//! The image tools' NBD client (`nbd_client`) reading a hostile server's replies after a
//! valid handshake: simple and structured replies, data and hole chunks, error chunks and
//! block status, to a short script of reads, writes, zeroes, trims, flushes and block status
//! requests.
//!
//! The input: a read size for the stream, what the handshake settles on (structured replies,
//! `base:allocation` and its context id, block sizes, export size and flags), up to eight
//! requests, then every byte the server sends after the handshake. The client must never
//! panic nor allocate beyond its bounds; a block status it returns is never empty nor longer
//! than asked; and what a read returns never depends on what its buffer held before (a reply
//! that leaves part of the buffer unwritten must be refused), which the target checks by
//! running the same script twice over buffers filled differently.
#![no_main]

use libfuzzer_sys::fuzz_target;
use nbd_client::{ClientError, NbdClient};
use nbd_proto::wire::consts::*;

mod hostile;
use hostile::Hostile;

/// Most requests in one script.
const MAX_OPS: usize = 8;

/// Takes `n` bytes off the front of `data`.
fn take<'a>(data: &mut &'a [u8], n: usize) -> Option<&'a [u8]> {
    let (head, rest) = (data.get(..n)?, &data[n..]);
    *data = rest;
    Some(head)
}

fn option_reply(out: &mut Vec<u8>, option: u32, kind: u32, data: &[u8]) {
    out.extend_from_slice(&OPTION_REPLY_MAGIC.to_be_bytes());
    out.extend_from_slice(&option.to_be_bytes());
    out.extend_from_slice(&kind.to_be_bytes());
    out.extend_from_slice(&(data.len() as u32).to_be_bytes());
    out.extend_from_slice(data);
}

/// What the handshake settles on, and the server's side of it.
struct Setup {
    handshake: Vec<u8>,
    size: u64,
}

fn setup(data: &mut &[u8]) -> Option<Setup> {
    let h = take(data, 12)?;
    let flags = h[0];
    let structured = flags & 1 != 0;
    let min_block = 1u32 << (h[1] % 18);
    let max_block = u32::from(h[2]) << 12;
    let sectors = u32::from_be_bytes([h[3], h[4], h[5], h[6]]);
    let size = (u64::from(sectors) << 9) + u64::from(h[7]);
    let context = u32::from_be_bytes([h[8], h[9], h[10], h[11]]);
    let mut export_flags = FLAG_HAS_FLAGS;
    for (bit, flag) in [
        (3, FLAG_READ_ONLY),
        (4, FLAG_SEND_WRITE_ZEROES),
        (5, FLAG_SEND_TRIM),
        (6, FLAG_SEND_FLUSH),
    ] {
        if flags & (1 << bit) != 0 {
            export_flags |= flag;
        }
    }

    let mut s = NBDMAGIC.to_be_bytes().to_vec();
    s.extend_from_slice(&IHAVEOPT.to_be_bytes());
    s.extend_from_slice(&(FLAG_FIXED_NEWSTYLE | FLAG_NO_ZEROES).to_be_bytes());
    if structured {
        option_reply(&mut s, OPT_STRUCTURED_REPLY, REP_ACK, &[]);
        if flags & 2 != 0 {
            let mut d = context.to_be_bytes().to_vec();
            d.extend_from_slice(b"base:allocation");
            option_reply(&mut s, OPT_SET_META_CONTEXT, REP_META_CONTEXT, &d);
        }
        option_reply(&mut s, OPT_SET_META_CONTEXT, REP_ACK, &[]);
    } else {
        option_reply(&mut s, OPT_STRUCTURED_REPLY, REP_ERR_UNSUP, &[]);
    }
    let mut info = INFO_EXPORT.to_be_bytes().to_vec();
    info.extend_from_slice(&size.to_be_bytes());
    info.extend_from_slice(&export_flags.to_be_bytes());
    option_reply(&mut s, OPT_GO, REP_INFO, &info);
    if flags & 4 != 0 {
        let mut info = INFO_BLOCK_SIZE.to_be_bytes().to_vec();
        info.extend_from_slice(&min_block.to_be_bytes());
        info.extend_from_slice(&4096u32.to_be_bytes());
        info.extend_from_slice(&max_block.to_be_bytes());
        option_reply(&mut s, OPT_GO, REP_INFO, &info);
    }
    option_reply(&mut s, OPT_GO, REP_ACK, &[]);
    Some(Setup { handshake: s, size })
}

/// One request of the script.
#[derive(Clone, Copy)]
struct Op {
    kind: u8,
    offset: u64,
    len: u16,
}

/// What one request returned, to compare between the two runs.
#[derive(Debug, PartialEq)]
enum Outcome {
    Failed,
    Read(Vec<u8>),
    Status(u64, bool, bool),
    Done,
}

fn run(op: Op, c: &mut NbdClient<Hostile>, fill: u8) -> Outcome {
    let len = u64::from(op.len);
    let r: Result<Outcome, ClientError> = match op.kind % 6 {
        0 => {
            let mut buf = vec![fill; usize::from(op.len)];
            c.read(&mut buf, op.offset).map(|()| Outcome::Read(buf))
        }
        1 => {
            let ranged = len << 9;
            c.block_status(op.offset, ranged).map(|st| {
                if ranged > 0 {
                    assert!(
                        (1..=ranged).contains(&st.len),
                        "block status of {} bytes for a request of {ranged}",
                        st.len
                    );
                } else {
                    assert_eq!(st.len, 0);
                }
                Outcome::Status(st.len, st.hole, st.zero)
            })
        }
        2 => c
            .write(&vec![0x5a; usize::from(op.len)], op.offset)
            .map(|()| Outcome::Done),
        3 => c
            .write_zeroes(op.offset, len << 4, op.kind & 0x80 != 0)
            .map(|()| Outcome::Done),
        4 => c.trim(op.offset, len << 9).map(|()| Outcome::Done),
        _ => c.flush().map(|()| Outcome::Done),
    };
    r.unwrap_or(Outcome::Failed)
}

/// Runs the script over a fresh client; the outcomes, or None when the handshake failed.
fn session(chunk: usize, stream: &[u8], size: u64, ops: &[Op], fill: u8) -> Option<Vec<Outcome>> {
    let server = Hostile {
        input: stream,
        chunk,
        written: 0,
    };
    let mut c = NbdClient::handshake(server, "").ok()?;
    assert_eq!(c.size(), size, "the size the handshake sent");
    Some(ops.iter().map(|&op| run(op, &mut c, fill)).collect())
}

fuzz_target!(|data: &[u8]| {
    let mut data = data;
    let Some(&[chunk]) = take(&mut data, 1) else {
        return;
    };
    let Some(setup) = setup(&mut data) else {
        return;
    };
    let Some(&[n]) = take(&mut data, 1) else {
        return;
    };
    let mut ops = Vec::new();
    for _ in 0..usize::from(n) % (MAX_OPS + 1) {
        let Some(o) = take(&mut data, 5) else {
            return;
        };
        ops.push(Op {
            kind: o[0],
            offset: u64::from(u16::from_be_bytes([o[1], o[2]])) << 9,
            len: u16::from_be_bytes([o[3], o[4]]),
        });
    }
    let mut stream = setup.handshake;
    stream.extend_from_slice(data);
    let chunk = usize::from(chunk).max(1);
    let a = session(chunk, &stream, setup.size, &ops, 0xaa);
    let b = session(chunk, &stream, setup.size, &ops, 0x55);
    assert_eq!(a, b, "the outcomes depend on what the read buffers held");
});
