use std::cell::{Cell, RefCell};
use std::io::IoSlice;
use std::pin::Pin;
use std::rc::Rc;
use std::task::{Context, Poll};

use tokio::io::AsyncWrite;
use tokio::sync::watch;

use nbd_proto::errno::Errno;
use nbd_proto::wire::consts::{
    CMD_BLOCK_STATUS, CMD_DISC, CMD_FLAG_PAYLOAD_LEN, CMD_READ, EXTENDED_REPLY_MAGIC,
    EXTENDED_REQUEST_MAGIC, REPLY_TYPE_BLOCK_STATUS_EXT, REPLY_TYPE_ERROR, REQUEST_MAGIC,
    SIMPLE_REPLY_MAGIC,
};

use super::{transmit, TransmissionEnd};
use crate::control::Control;
use crate::export::{BlockSize, Export, ExportFeatures, Extent, ReadChunk, WriteZeroesFlags};
use crate::mem_export::MemExport;
use crate::negotiate::meta::MetaSelection;
use crate::negotiate::{Mode, Negotiated};

/// A socket's write side that records what was written and in how many calls.
#[derive(Clone, Default)]
struct Recorder {
    bytes: Rc<RefCell<Vec<u8>>>,
    writes: Rc<Cell<usize>>,
}

impl AsyncWrite for Recorder {
    fn poll_write(
        self: Pin<&mut Self>,
        _: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<std::io::Result<usize>> {
        self.writes.set(self.writes.get() + 1);
        self.bytes.borrow_mut().extend_from_slice(buf);
        Poll::Ready(Ok(buf.len()))
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        _: &mut Context<'_>,
        bufs: &[IoSlice<'_>],
    ) -> Poll<std::io::Result<usize>> {
        self.writes.set(self.writes.get() + 1);
        let mut out = self.bytes.borrow_mut();
        let before = out.len();
        for b in bufs {
            out.extend_from_slice(b);
        }
        Poll::Ready(Ok(out.len() - before))
    }

    fn is_write_vectored(&self) -> bool {
        true
    }

    fn poll_flush(self: Pin<&mut Self>, _: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Poll::Ready(Ok(()))
    }

    fn poll_shutdown(self: Pin<&mut Self>, _: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Poll::Ready(Ok(()))
    }
}

fn request(command: u16, cookie: u64, offset: u64, length: u32) -> Vec<u8> {
    let mut r = Vec::with_capacity(28);
    r.extend_from_slice(&REQUEST_MAGIC.to_be_bytes());
    r.extend_from_slice(&0u16.to_be_bytes());
    r.extend_from_slice(&command.to_be_bytes());
    r.extend_from_slice(&cookie.to_be_bytes());
    r.extend_from_slice(&offset.to_be_bytes());
    r.extend_from_slice(&length.to_be_bytes());
    r
}

/// A [`MemExport`] whose reads of the first 4 KiB wait for the runtime's next turn first,
/// as a read from disk would: those requests cannot finish in their first poll.
struct SlowStart(MemExport);

impl Export for SlowStart {
    type Buf = Vec<u8>;

    fn size(&self) -> u64 {
        self.0.size()
    }

    fn features(&self) -> ExportFeatures {
        self.0.features()
    }

    async fn read(&self, offset: u64, len: usize) -> Result<Vec<ReadChunk<Vec<u8>>>, Errno> {
        if offset < 4096 {
            tokio::task::yield_now().await;
        }
        self.0.read(offset, len).await
    }

    async fn write(&self, offset: u64, data: Vec<u8>, fua: bool) -> Result<(), Errno> {
        self.0.write(offset, data, fua).await
    }

    async fn write_zeroes(&self, offset: u64, len: u64, f: WriteZeroesFlags) -> Result<(), Errno> {
        self.0.write_zeroes(offset, len, f).await
    }

    async fn trim(&self, offset: u64, len: u64, fua: bool) -> Result<(), Errno> {
        self.0.trim(offset, len, fua).await
    }

    async fn flush(&self) -> Result<(), Errno> {
        self.0.flush().await
    }

    async fn cache(&self, offset: u64, len: u64) -> Result<(), Errno> {
        self.0.cache(offset, len).await
    }

    async fn block_status(&self, offset: u64, len: u64) -> Result<Vec<Extent>, Errno> {
        self.0.block_status(offset, len).await
    }
}

/// Runs a transmission phase in simple mode over `input`, returning how it ended.
fn run<E: Export + 'static>(export: E, input: &[u8], out: Recorder) -> TransmissionEnd {
    let negotiated = Negotiated {
        export: 0,
        mode: Mode::Simple,
        meta: MetaSelection::default(),
        size: export.size(),
        flags: 0,
        block_size: BlockSize::default(),
    };
    run_negotiated(export, input, out, negotiated)
}

/// Runs a transmission phase as `negotiated` over `input`, returning how it ended.
fn run_negotiated<E: Export + 'static>(
    export: E,
    input: &[u8],
    out: Recorder,
    negotiated: Negotiated,
) -> TransmissionEnd {
    let (_shutdown_tx, shutdown) = watch::channel(false);
    let (_force_tx, force) = watch::channel(false);
    let control = Control::new(shutdown, force);
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let local = tokio::task::LocalSet::new();
    local
        .block_on(
            &rt,
            transmit(input, out, Rc::new(export), &negotiated, &control),
        )
        .unwrap()
}

#[test]
fn replies_completed_together_go_out_in_one_write_in_completion_order() {
    const N: u64 = 8;
    let export = MemExport::new(1 << 20);
    for i in 0..N {
        export.fill(i * 4096, &vec![i as u8 + 1; 4096]);
    }
    let mut input = Vec::new();
    for i in 0..N {
        input.extend(request(CMD_READ, 100 + i, i * 4096, 4096));
    }
    input.extend(request(CMD_DISC, 999, 0, 0));
    let out = Recorder::default();

    let end = run(export, &input, out.clone());

    assert_eq!(end, TransmissionEnd::Disconnect);
    let bytes = out.bytes.borrow();
    assert_eq!(bytes.len(), N as usize * (16 + 4096));
    for (i, reply) in bytes.chunks(16 + 4096).enumerate() {
        assert_eq!(reply[..4], SIMPLE_REPLY_MAGIC.to_be_bytes());
        assert_eq!(reply[4..8], [0; 4], "reply {i} is an error");
        assert_eq!(reply[8..16], (100 + i as u64).to_be_bytes());
        assert!(
            reply[16..].iter().all(|&b| b == i as u8 + 1),
            "data of reply {i}"
        );
    }
    // The requests were all read before any of them ran, so their replies share a write.
    assert_eq!(out.writes.get(), 1);
}

#[test]
fn requests_that_wait_are_answered_after_those_that_did_not() {
    let export = MemExport::new(1 << 20);
    export.fill(0, &[1; 4096]);
    export.fill(4096, &[2; 4096]);
    let mut input = request(CMD_READ, 7, 0, 4096);
    input.extend(request(CMD_READ, 8, 4096, 4096));
    input.extend(request(CMD_DISC, 9, 0, 0));
    let out = Recorder::default();

    let end = run(SlowStart(export), &input, out.clone());

    assert_eq!(end, TransmissionEnd::Disconnect);
    let bytes = out.bytes.borrow();
    assert_eq!(bytes.len(), 2 * (16 + 4096));
    // The read of the second block did not wait, so it is answered first.
    for (reply, (cookie, fill)) in bytes.chunks(16 + 4096).zip([(8u64, 2u8), (7, 1)]) {
        assert_eq!(reply[..4], SIMPLE_REPLY_MAGIC.to_be_bytes());
        assert_eq!(reply[4..8], [0; 4]);
        assert_eq!(reply[8..16], cookie.to_be_bytes());
        assert!(
            reply[16..].iter().all(|&b| b == fill),
            "data of cookie {cookie}"
        );
    }
}

/// An extended request header followed by `payload`, its length in the header.
fn extended_request(command: u16, flags: u16, cookie: u64, offset: u64, payload: &[u8]) -> Vec<u8> {
    let mut r = Vec::with_capacity(32 + payload.len());
    r.extend_from_slice(&EXTENDED_REQUEST_MAGIC.to_be_bytes());
    r.extend_from_slice(&flags.to_be_bytes());
    r.extend_from_slice(&command.to_be_bytes());
    r.extend_from_slice(&cookie.to_be_bytes());
    r.extend_from_slice(&offset.to_be_bytes());
    r.extend_from_slice(&(payload.len() as u64).to_be_bytes());
    r.extend_from_slice(payload);
    r
}

/// Extended reply chunks as (cookie, type, payload).
fn extended_chunks(bytes: &[u8]) -> Vec<(u64, u16, Vec<u8>)> {
    let mut out = Vec::new();
    let mut rest = bytes;
    while !rest.is_empty() {
        assert_eq!(rest[..4], EXTENDED_REPLY_MAGIC.to_be_bytes());
        let kind = u16::from_be_bytes([rest[6], rest[7]]);
        let cookie = u64::from_be_bytes(rest[8..16].try_into().unwrap());
        let len = usize::try_from(u64::from_be_bytes(rest[24..32].try_into().unwrap())).unwrap();
        out.push((cookie, kind, rest[32..32 + len].to_vec()));
        rest = &rest[32 + len..];
    }
    out
}

#[test]
fn a_block_status_payload_answers_for_the_contexts_it_names_and_a_bad_one_is_refused() {
    let export = MemExport::new(1 << 20);
    export.fill(0, &[1; 4096]);
    let negotiated = Negotiated {
        export: 0,
        mode: Mode::Extended,
        meta: MetaSelection {
            base_allocation: true,
            allocation_depth: true,
            dirty_bitmaps: 0,
        },
        size: export.size(),
        flags: 0,
        block_size: BlockSize::default(),
    };
    let payload = |len: u64, ids: &[u32]| {
        let mut p = len.to_be_bytes().to_vec();
        ids.iter()
            .for_each(|id| p.extend_from_slice(&id.to_be_bytes()));
        p
    };
    let mut input = Vec::new();
    for (cookie, ids) in [(1u64, &[2u32][..]), (2, &[2, 2]), (3, &[1])] {
        let p = payload(8192, ids);
        input.extend(extended_request(
            CMD_BLOCK_STATUS,
            CMD_FLAG_PAYLOAD_LEN,
            cookie,
            0,
            &p,
        ));
    }
    input.extend(extended_request(CMD_DISC, 0, 9, 0, &[]));
    let out = Recorder::default();

    let end = run_negotiated(export, &input, out.clone(), negotiated);

    assert_eq!(end, TransmissionEnd::Disconnect);
    let chunks = extended_chunks(&out.bytes.borrow());
    let of = |cookie| chunks.iter().filter(move |c| c.0 == cookie);
    // Only the context named, allocation depth (id 2), over the effect length.
    let first: Vec<_> = of(1).collect();
    assert_eq!(first.len(), 1, "{first:?}");
    assert_eq!(first[0].1, REPLY_TYPE_BLOCK_STATUS_EXT);
    assert_eq!(first[0].2[..4], 2u32.to_be_bytes());
    // A context named twice is refused, and its payload was consumed: the next request
    // is read from the right place and answered for base:allocation (id 1) only.
    let second: Vec<_> = of(2).collect();
    assert_eq!(second.len(), 1);
    assert_eq!(second[0].1, REPLY_TYPE_ERROR);
    assert_eq!(second[0].2[..4], Errno::Inval.code().to_be_bytes());
    let third: Vec<_> = of(3).collect();
    assert_eq!(third.len(), 1);
    assert_eq!(third[0].2[..4], 1u32.to_be_bytes());
}

/// A reply waiting in the writer's queue, carrying `data` bytes of read data.
fn queued(data: usize) -> super::Queued<Vec<u8>> {
    super::Queued {
        to: super::reply_writer::ReplyTo {
            mode: Mode::Structured,
            cookie: 1,
            offset: 0,
            is_read: true,
        },
        outcome: super::reply_writer::Outcome::Read {
            offset: 0,
            chunks: vec![ReadChunk::Data(vec![0; data]), ReadChunk::Hole(1 << 20)],
            df: false,
        },
        _held: None,
    }
}

#[test]
fn large_replies_are_written_alone_small_ones_together() {
    let sizes = |s: &[usize]| s.iter().map(|&n| queued(n)).collect::<Vec<_>>();
    // A large reply leaves the queue, buffer and all, before the replies after it are written.
    assert_eq!(super::group_len(&sizes(&[1 << 20, 4096, 4096])), 1);
    assert_eq!(super::group_len(&sizes(&[4096, 1 << 20])), 1);
    // Small ones share a write up to the group's bytes; holes cost nothing.
    let small = sizes(&[4096; 64]);
    assert_eq!(super::group_len(&small), super::GROUP_BYTES / 4096);
    assert_eq!(super::group_len(&sizes(&[0; 5])), 5);
}
