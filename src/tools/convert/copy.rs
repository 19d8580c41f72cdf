//! The copy itself: requests of up to [`REQUEST_BYTES`] read from the sources and written
//! to the target, several in flight, in the order the planner gives the ranges.

use qcow2::format::GuestOffset;
use std::cell::Cell;
use std::rc::Rc;

use qcow2::engine::{ClusterCompressor, EngineError, Image, PackedCluster};
use storage::{AnyStorage, IoBuf};
use tokio::sync::Notify;
use tokio::task::JoinSet;

use super::error::ConvertError;
use super::plan::{self, Chunk, Planner, Settings, Source, Status};
use super::sparse::{self};
use crate::common::zeroes::is_zero;
use crate::tools::inflight::BufferPool;
use crate::tools::progress::Progress;

/// Largest copy request: big enough for sequential throughput, small enough that eight in
/// flight stay cheap in memory (qemu-img's buffer size too).
pub(super) const REQUEST_BYTES: u64 = 2 << 20;

/// A write under way.
type Write = tokio::task::JoinHandle<Result<(), EngineError>>;

/// What a request does.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Work {
    /// Read from the sources and written.
    Data,
    /// Zeros written as data (`-S 0`), nothing read.
    ZeroData,
    /// Made to read as zeros, unless the target already does.
    Zero,
}

/// A request's data, ready to be written.
enum Prepared {
    /// As read: its data runs are written as they are.
    Data(IoBuf),
    /// Compressed clusters and where they go, and the all-zero clusters in between.
    Packed(Vec<(u64, PackedCluster)>, Vec<(u64, u64)>),
    /// Nothing to read.
    Zero,
}

/// Everything a copy task needs.
pub(super) struct Job {
    pub(super) sources: Vec<Source>,
    pub(super) dst: Image<AnyStorage>,
    /// Target cluster size: the unit of compression.
    pub(super) cluster: u64,
    /// The target is qcow2: data is written in whole clusters.
    pub(super) qcow2_target: bool,
    /// Sparse-detection size in bytes; 0 writes everything.
    pub(super) min_sparse: u64,
    /// The target reads zeros wherever nothing is written (a new image without a backing
    /// file, or `--target-is-zero`): zero ranges need no write.
    pub(super) zero_init: bool,
    /// The target is qcow2 version 3: zeroing writes zero flags, even where nothing is
    /// allocated (as QEMU's driver does), rather than leaving such clusters alone.
    pub(super) zero_flags: bool,
    /// With `-c`: compresses clusters on the blocking thread pool, so every core compresses
    /// while the engine's thread keeps reading and writing.
    pub(super) compress: Option<ClusterCompressor>,
    /// The target's name, for errors.
    pub(super) target: String,
    /// Write in guest order (reads still overlap), so that a qcow2 target allocates its
    /// clusters in guest order as qemu-img does, instead of fragmenting by completion order.
    pub(super) ordered: bool,
    /// Every write is made durable before it counts as done (`-t writethrough|directsync`).
    pub(super) writethrough: bool,
    /// Sequence number of the request whose turn it is to write (when `ordered`).
    pub(super) turn: Cell<u64>,
    pub(super) turn_changed: Notify,
    /// Request buffers for reuse: a fresh multi-MiB buffer per request costs more in page
    /// faults and zeroing than the copy itself.
    pub(super) buffers: BufferPool,
}

impl Job {
    /// Carries out request number `seq`: `[off, off + len)` of the target.
    async fn run(
        self: Rc<Self>,
        seq: u64,
        off: u64,
        len: u64,
        work: Work,
    ) -> Result<(), EngineError> {
        let prepared = match work {
            Work::Zero => Ok(Prepared::Zero),
            Work::ZeroData => {
                let mut buf = self.buffers.take(len as usize);
                buf.fill(0);
                self.prepare(off, buf).await
            }
            Work::Data => {
                // len <= REQUEST_BYTES, which fits in memory by construction.
                let buf = self.buffers.take(len as usize);
                let (read, buf) = self.read(off, buf).await;
                match read {
                    Ok(()) => self.prepare(off, buf).await,
                    Err(e) => {
                        self.buffers.give(buf);
                        Err(e)
                    }
                }
            }
        };
        if self.ordered {
            // Single-threaded: nothing runs between the check and registering the waiter.
            while self.turn.get() != seq {
                self.turn_changed.notified().await;
            }
        }
        // Even a failed read passes the turn on, so no later request waits forever.
        let started = match prepared {
            Ok(Prepared::Data(buf)) => Ok(self.start_writes(off, buf).await),
            Ok(Prepared::Packed(packed, zeros)) => self.write_packed(packed, zeros).await,
            Ok(Prepared::Zero) => Ok(self.start_zero(off, len).await.into_iter().collect()),
            Err(e) => Err(e),
        };
        if self.ordered {
            self.turn.set(seq + 1);
            self.turn_changed.notify_waiters();
        }
        let (mut res, writes) = match started {
            Ok(writes) => (Ok(()), writes),
            Err(e) => (Err(e), Vec::new()),
        };
        for write in writes {
            let done = write.await.unwrap_or_else(|e| {
                Err(EngineError::Unsupported {
                    image: self.target.clone(),
                    what: format!("write task failed: {e}"),
                })
            });
            res = res.and(done);
        }
        res
    }

    /// Reads target range `[off, off + buf.len())` from the sources that cover it; what lies
    /// past a source's own end (up to its whole sector) reads as zeros.
    async fn read(&self, off: u64, mut buf: IoBuf) -> (Result<(), EngineError>, IoBuf) {
        let (first, start) = plan::locate(&self.sources, off);
        let src = &self.sources[first];
        let end = off + buf.len() as u64;
        if end <= start + src.len {
            // The whole request from one source: read straight into the buffer.
            return src.image.read_into(GuestOffset(off - start), buf).await;
        }
        let mut pos = off;
        let mut index = first;
        let mut src_start = start;
        while pos < end {
            let Some(src) = self.sources.get(index) else {
                buf[(pos - off) as usize..].fill(0);
                break;
            };
            let src_end = (src_start + src.span).min(end);
            let readable = (src_start + src.len).min(src_end);
            if pos < readable {
                match src
                    .image
                    .read(GuestOffset(pos - src_start), (readable - pos) as usize)
                    .await
                {
                    Ok(data) => {
                        let at = (pos - off) as usize;
                        buf[at..at + data.len()].copy_from_slice(&data);
                    }
                    Err(e) => return (Err(e), buf),
                }
                pos = readable;
            }
            if pos < src_end {
                buf[(pos - off) as usize..(src_end - off) as usize].fill(0);
                pos = src_end;
            }
            src_start += src.span;
            index += 1;
        }
        (Ok(()), buf)
    }

    /// What `buf` (target offset `off`) becomes before its turn to write: with `-c`, its
    /// clusters compressed (so requests compress in parallel even when they write in order)
    /// and the buffer back in the pool; otherwise the buffer itself.
    async fn prepare(&self, off: u64, buf: IoBuf) -> Result<Prepared, EngineError> {
        let Some(compressor) = self.compress else {
            return Ok(Prepared::Data(buf));
        };
        let packed = self.pack(compressor, off, &buf).await;
        self.buffers.give(buf);
        let (packed, zeros) = packed?;
        Ok(Prepared::Packed(packed, zeros))
    }

    /// Starts writing `buf` (target offset `off`): all of it with `-S 0`, else its data runs,
    /// with its zero runs zeroed unless the target reads zeros already. In ordered mode each
    /// task runs until it first waits for the disk, by which time the target has allocated
    /// its clusters, before the next starts: the layout follows guest order while the data
    /// of several requests is copied at once. The buffer goes back to the pool once written
    /// (or once its runs are copied out).
    async fn start_writes(self: &Rc<Self>, off: u64, buf: IoBuf) -> Vec<Write> {
        let runs = if self.min_sparse == 0 {
            vec![sparse::Run {
                start: 0,
                len: buf.len(),
                data: true,
            }]
        } else if self.qcow2_target {
            sparse::widen(
                &sparse::runs(&buf, off, self.min_sparse),
                off,
                self.cluster,
                buf.len(),
            )
        } else {
            sparse::runs(&buf, off, self.min_sparse)
        };
        let mut writes = Vec::new();
        if let [only] = runs.as_slice() {
            if only.data {
                let job = Rc::clone(self);
                writes.push(tokio::task::spawn_local(async move {
                    let (res, buf) = job.dst.write(GuestOffset(off), buf, job.writethrough).await;
                    job.buffers.give(buf);
                    res
                }));
                self.let_it_allocate().await;
                return writes;
            }
        }
        for run in &runs {
            let at = off + run.start as u64;
            if !run.data {
                writes.extend(self.start_zero(at, run.len as u64).await);
                continue;
            }
            let piece = IoBuf::from_slice(&buf[run.start..run.start + run.len]);
            let job = Rc::clone(self);
            writes.push(tokio::task::spawn_local(async move {
                job.dst
                    .write(GuestOffset(at), piece, job.writethrough)
                    .await
                    .0
            }));
            self.let_it_allocate().await;
        }
        self.buffers.give(buf);
        writes
    }

    /// Starts making `[off, off + len)` read as zeros, unless it does already.
    async fn start_zero(self: &Rc<Self>, off: u64, len: u64) -> Option<Write> {
        if self.zero_init || len == 0 {
            return None;
        }
        let job = Rc::clone(self);
        let task = tokio::task::spawn_local(async move {
            if job.zero_flags {
                job.dst
                    .write_zero_flags(GuestOffset(off), len, true)
                    .await?;
            } else {
                job.dst
                    .write_zeroes(GuestOffset(off), len, true, false)
                    .await?;
            }
            job.durable().await
        });
        self.let_it_allocate().await;
        Some(task)
    }

    /// With `writethrough`, makes what was written so far durable.
    async fn durable(&self) -> Result<(), EngineError> {
        match self.writethrough {
            true => self.dst.flush().await,
            false => Ok(()),
        }
    }

    /// In ordered mode, lets the write just spawned run up to its first wait.
    async fn let_it_allocate(&self) {
        if self.ordered {
            tokio::task::yield_now().await;
        }
    }

    /// Compresses the clusters of `buf` (target offset `off`) on the blocking thread pool:
    /// their offsets and packed contents, in order, and the all-zero clusters, which are not
    /// compressed unless `-S 0` asks for every cluster to be written.
    async fn pack(
        &self,
        compressor: ClusterCompressor,
        off: u64,
        buf: &IoBuf,
    ) -> Result<(Vec<(u64, PackedCluster)>, Vec<(u64, u64)>), EngineError> {
        let grain = self.cluster as usize;
        // The target may be a little longer than the source (sizes round up to 512): a
        // short last cluster is padded to the target's end.
        let dst_size = self.dst.size();
        let mut zeros = Vec::new();
        let mut clusters: Vec<(u64, IoBuf)> = Vec::new();
        for (i, block) in buf.chunks(grain).enumerate() {
            let at = off + (i * grain) as u64;
            if self.min_sparse != 0 && is_zero(block) {
                zeros.push((at, block.len() as u64));
                continue;
            }
            let want = self.cluster.min(dst_size - at) as usize;
            let mut data = IoBuf::zeroed(want.max(block.len()));
            data[..block.len()].copy_from_slice(block);
            clusters.push((at, data));
        }
        let packed = tokio::task::spawn_blocking(move || {
            clusters
                .into_iter()
                .map(|(at, data)| {
                    compressor
                        .compress(data)
                        .map(|p| (at, p))
                        .map_err(|e| (at, e))
                })
                .collect::<Result<Vec<_>, _>>()
        })
        .await
        .map_err(|e| EngineError::Unsupported {
            image: self.target.clone(),
            what: format!("compression task failed: {e}"),
        })?;
        let packed = packed.map_err(|(offset, source)| EngineError::Compressed {
            image: self.target.clone(),
            offset,
            source,
        })?;
        Ok((packed, zeros))
    }

    /// Writes compressed clusters in order and starts zeroing the zero clusters between.
    async fn write_packed(
        self: &Rc<Self>,
        packed: Vec<(u64, PackedCluster)>,
        zeros: Vec<(u64, u64)>,
    ) -> Result<Vec<Write>, EngineError> {
        for (at, p) in packed {
            self.dst.write_packed(GuestOffset(at), p).await?;
            self.durable().await?;
        }
        let mut writes = Vec::new();
        for (at, len) in zeros {
            writes.extend(self.start_zero(at, len).await);
        }
        Ok(writes)
    }
}

/// Waits for one task, turning a panic into an error.
async fn reap(tasks: &mut JoinSet<Result<(), EngineError>>) -> Result<(), ConvertError> {
    match tasks.join_next().await {
        None => Ok(()),
        Some(Ok(r)) => Ok(r?),
        Some(Err(e)) => Err(ConvertError::Task(e.to_string())),
    }
}

/// True when `chunk` counts as copying work for the progress shown (qemu-img counts what it
/// reads or writes as data).
fn counts(chunk: &Chunk, settings: &Settings) -> bool {
    chunk.status == Status::Data || (settings.full_allocation && chunk.status == Status::Zero)
}

/// Copies the sources into `job.dst` as the plan says, `parallel` requests at a time.
pub(super) async fn copy_all(
    job: Rc<Job>,
    settings: Settings,
    parallel: usize,
    progress: &Progress<Box<dyn std::io::Write>>,
) -> Result<(), ConvertError> {
    let mut tasks: JoinSet<Result<(), EngineError>> = JoinSet::new();
    let mut seq = 0u64;
    let result: Result<(), ConvertError> = async {
        let mut planner = Planner::new(&job.sources, settings);
        // Consecutive clusters to compress go in one request; each is still handled alone.
        let mut pending: Option<(u64, u64, Work)> = None;
        loop {
            let chunk = planner.next().await?;
            if let Some(c) = &chunk {
                if counts(c, &settings) {
                    progress.advance(c.len);
                }
            }
            let work = chunk.map(|c| {
                let w = match c.status {
                    Status::Data => Some(Work::Data),
                    Status::Zero if settings.full_allocation => Some(Work::ZeroData),
                    Status::Zero => Some(Work::Zero),
                    Status::Backing => None,
                };
                (c, w)
            });
            if let (Some((p_off, p_len, p_work)), Some((c, Some(w)))) = (pending, work) {
                if job.compress.is_some()
                    && p_work == w
                    && w != Work::Zero
                    && p_off + p_len == c.start
                    && p_len + c.len <= REQUEST_BYTES
                {
                    pending = Some((p_off, p_len + c.len, p_work));
                    continue;
                }
            }
            if let Some((off, len, w)) = pending.take() {
                while tasks.len() >= parallel {
                    reap(&mut tasks).await?;
                }
                tasks.spawn_local(job.clone().run(seq, off, len, w));
                seq += 1;
            }
            match work {
                None => break,
                Some((c, Some(w))) => pending = Some((c.start, c.len, w)),
                Some((_, None)) => {}
            }
        }
        while !tasks.is_empty() {
            reap(&mut tasks).await?;
        }
        Ok(())
    }
    .await;
    // On error, stop the requests in flight (the target is incomplete either way).
    tasks.abort_all();
    while tasks.join_next().await.is_some() {}
    result
}

/// How many bytes of the plan count for progress (a first pass, as qemu-img makes one).
pub(super) async fn work_total(sources: &[Source], settings: Settings) -> Result<u64, EngineError> {
    let mut planner = Planner::new(sources, settings);
    let mut total = 0u64;
    while let Some(c) = planner.next().await? {
        if counts(&c, &settings) {
            total += c.len;
        }
    }
    Ok(total)
}
