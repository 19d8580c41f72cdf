use std::cell::{Cell, RefCell};
use std::io::IoSlice;
use std::pin::Pin;
use std::rc::Rc;
use std::task::{Context, Poll};

use tokio::io::AsyncWrite;
use tokio::sync::watch;

use nbd_proto::errno::Errno;
use nbd_proto::wire::consts::{CMD_DISC, CMD_READ, REQUEST_MAGIC, SIMPLE_REPLY_MAGIC};

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
