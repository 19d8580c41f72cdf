//! `qcow2-nbd compare [-f FMT] [-F FMT] [-s] [-p] [-q] [-U] A B`: do two images (qcow2 with
//! their backing chains, or raw) show a guest the same bytes? qemu-img compare's messages and
//! exit codes: 0 identical, 1 different, 2 an image could not be opened, 3 block status
//! failed, 4 a read failed.
//!
//! Block status of both images decides what is read: ranges that read as zeros on both sides
//! are skipped, a range allocated on one side only is checked for zeros on that side, and
//! ranges allocated on both are read from both and compared. Reads go in large chunks, several
//! in flight; results are taken in guest order, so the first difference (or error) reported is
//! the one qemu-img's sequential walk reports.

use qcow2::format::GuestOffset;
use std::collections::VecDeque;
use std::future::Future;
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::rc::Rc;

use clap::Args;
use qcow2::engine::{EngineError, Extent, Image};
use storage::{AnyStorage, IoBuf};
use tokio::task::JoinHandle;

use crate::common::engine_run::{self, OpenError};
use crate::common::zeroes::is_zero;
use crate::tools::inflight::BufferPool;
use crate::tools::progress::Progress;

/// How much of the disk one block-status query covers: bounds the extent lists' memory.
const QUERY_BYTES: u64 = 1 << 30;
/// Largest read: large enough that per-request costs vanish, small enough to keep several in
/// flight cheaply.
const CHUNK_BYTES: u64 = 4 << 20;
/// Chunks read and compared at once.
const IN_FLIGHT: usize = 8;
/// Differences are reported at the start of the 512-byte sector holding them, as qemu-img
/// does.
const SECTOR: usize = 512;

/// Arguments of `compare`.
#[derive(Args, Debug)]
pub struct CompareArgs {
    /// Format of the first image (qcow2 or raw); probed when not given.
    #[arg(short = 'f', long = "a-format")]
    pub a_format: Option<String>,
    /// Format of the second image (qcow2 or raw); probed when not given.
    #[arg(short = 'F', long = "b-format")]
    pub b_format: Option<String>,
    /// Strict mode: the images also differ when their sizes differ, or when a range is
    /// allocated differently (data, zeros, unallocated, compressed) even if it reads the same.
    #[arg(short = 's', long = "strict")]
    pub strict: bool,
    /// Show progress on stderr.
    #[arg(short = 'p', long = "progress")]
    pub progress: bool,
    /// Print nothing but errors (the exit status says the result).
    #[arg(short = 'q', long = "quiet")]
    pub quiet: bool,
    #[command(flatten)]
    pub share: crate::common::engine_run::ForceShare,
    /// The first image.
    pub first: PathBuf,
    /// The second image.
    pub second: PathBuf,
}

/// Why the comparison could not finish; each kind has its qemu-img exit code.
#[derive(Debug, thiserror::Error)]
pub enum CompareError {
    /// An image could not be opened.
    #[error(transparent)]
    Open(#[from] OpenError),
    /// Block status of an image failed.
    #[error("Sector allocation test failed for {file}: {source}")]
    BlockStatus {
        /// The image.
        file: String,
        /// What failed.
        source: Box<EngineError>,
    },
    /// Reading an image failed.
    #[error("Error while reading offset {offset} of {file}: {}", io_words(.source))]
    Read {
        /// The image.
        file: String,
        /// The guest offset of the read.
        offset: u64,
        /// What failed.
        source: Box<EngineError>,
    },
    /// A read task died (a bug: tasks return their errors).
    #[error("internal error: a compare task failed: {0}")]
    Task(String),
}

impl CompareError {
    /// qemu-img compare's exit code for this error.
    fn exit_code(&self) -> u8 {
        match self {
            CompareError::Open(_) => 2,
            CompareError::BlockStatus { .. } => 3,
            CompareError::Read { .. } | CompareError::Task(_) => 4,
        }
    }
}

/// Why the walk stopped early.
enum Stop {
    /// The images differ; the message says where.
    Differ(String),
    /// Something failed.
    Failed(CompareError),
}

impl From<CompareError> for Stop {
    fn from(e: CompareError) -> Stop {
        Stop::Failed(e)
    }
}

/// One of the two images.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Side {
    A,
    B,
}

/// What a range needs, from the block status of both images there.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Work {
    /// Both read as zeros.
    Skip,
    /// Both hold data: read both and compare.
    Compare,
    /// The other side reads as zeros: this side must too.
    Zeros(Side),
}

impl Work {
    /// qemu-img's rule: zeros on both sides match; a range allocated on both is compared (a
    /// side known to read zeros needs no read); one allocated on one side only must read as
    /// zeros there, the unallocated side reading zeros (nothing below it).
    fn of(a: &Extent, b: &Extent) -> Work {
        if a.zero && b.zero {
            return Work::Skip;
        }
        // Neither present nor zeros: a protocol's hole whose contents it does not know.
        if !a.present && !a.zero || !b.present && !b.zero {
            return Work::Compare;
        }
        match (a.present, b.present) {
            (true, true) if a.zero => Work::Zeros(Side::B),
            (true, true) if b.zero => Work::Zeros(Side::A),
            (true, true) => Work::Compare,
            (false, false) => Work::Skip,
            (true, false) => Work::Zeros(Side::A),
            (false, true) => Work::Zeros(Side::B),
        }
    }
}

/// What strict mode requires to be equal: QEMU's block status flags (allocated, data, zero,
/// compressed, a host offset known, and whether the run goes on to the end of the disk, which
/// QEMU compares too: a run split in one image and not in the other is a mismatch there).
fn strict_status(e: &Extent, disk_end: u64) -> (bool, bool, bool, bool, bool, bool) {
    let eof = e.start + e.len == disk_end;
    (
        e.present,
        e.data,
        e.zero,
        e.compressed,
        e.offset.is_some(),
        eof,
    )
}

/// The two images, their names for messages, and the read buffers in reuse.
struct Images {
    a: Image<AnyStorage>,
    b: Image<AnyStorage>,
    names: [String; 2],
    /// A fresh multi-MiB buffer per chunk costs more in page faults and zeroing than the
    /// comparison itself.
    buffers: BufferPool,
}

impl Images {
    fn image(&self, side: Side) -> &Image<AnyStorage> {
        match side {
            Side::A => &self.a,
            Side::B => &self.b,
        }
    }

    fn name(&self, side: Side) -> &str {
        match side {
            Side::A => &self.names[0],
            Side::B => &self.names[1],
        }
    }

    /// Reads `len` guest bytes of one side at `offset`.
    async fn read(&self, side: Side, offset: u64, len: usize) -> Result<IoBuf, CompareError> {
        let (res, buf) = self
            .image(side)
            .read_into(GuestOffset(offset), self.buffers.take(len))
            .await;
        match res {
            Ok(()) => Ok(buf),
            Err(e) => {
                self.buffers.give(buf);
                Err(CompareError::Read {
                    file: self.name(side).to_string(),
                    offset,
                    source: Box::new(e),
                })
            }
        }
    }

    /// Compares one chunk of both images (`len` bytes at `offset`).
    async fn compare_chunk(self: Rc<Self>, offset: u64, len: usize) -> Result<(), Stop> {
        let (a, b) = tokio::join!(
            self.read(Side::A, offset, len),
            self.read(Side::B, offset, len)
        );
        let (a, b) = (a?, b?);
        let differs = (a[..] != b[..]).then(|| {
            a.chunks(SECTOR)
                .zip(b.chunks(SECTOR))
                .position(|(x, y)| x != y)
                .unwrap_or(0)
        });
        self.buffers.give(a);
        self.buffers.give(b);
        match differs {
            None => Ok(()),
            Some(sector) => Err(mismatch(offset + (sector * SECTOR) as u64)),
        }
    }

    /// Checks that one chunk of one side reads as zeros.
    async fn zeros_chunk(self: Rc<Self>, side: Side, offset: u64, len: usize) -> Result<(), Stop> {
        let buf = self.read(side, offset, len).await?;
        let nonzero = buf.chunks(SECTOR).position(|s| !is_zero(s));
        self.buffers.give(buf);
        match nonzero {
            None => Ok(()),
            Some(sector) => Err(mismatch(offset + (sector * SECTOR) as u64)),
        }
    }
}

fn mismatch(offset: u64) -> Stop {
    Stop::Differ(format!("Content mismatch at offset {offset}!"))
}

/// Chunks in flight, settled in guest order.
struct Pipeline {
    tasks: VecDeque<(u64, JoinHandle<Result<(), Stop>>)>,
    progress: Rc<Progress<std::io::Stderr>>,
}

impl Pipeline {
    /// Starts a chunk of `len` bytes, first settling the oldest if too many are in flight.
    async fn push<F>(&mut self, len: u64, chunk: F) -> Result<(), Stop>
    where
        F: Future<Output = Result<(), Stop>> + 'static,
    {
        if self.tasks.len() >= IN_FLIGHT {
            self.settle_one().await?;
        }
        self.tasks.push_back((len, tokio::task::spawn_local(chunk)));
        Ok(())
    }

    async fn settle_one(&mut self) -> Result<(), Stop> {
        let Some((len, task)) = self.tasks.pop_front() else {
            return Ok(());
        };
        task.await
            .map_err(|e| CompareError::Task(e.to_string()))??;
        self.progress.advance(len);
        Ok(())
    }

    /// Settles every chunk in flight, in order.
    async fn drain(&mut self) -> Result<(), Stop> {
        while !self.tasks.is_empty() {
            self.settle_one().await?;
        }
        Ok(())
    }

    /// Starts the chunks of `[start, start + len)` that `work` asks for.
    async fn schedule(
        &mut self,
        images: &Rc<Images>,
        start: u64,
        len: u64,
        work: Work,
    ) -> Result<(), Stop> {
        if work == Work::Skip {
            self.progress.advance(len);
            return Ok(());
        }
        let mut off = start;
        while off < start + len {
            // At most CHUNK_BYTES, so it fits in memory and in usize.
            let n = CHUNK_BYTES.min(start + len - off);
            let imgs = images.clone();
            match work {
                Work::Compare => self.push(n, imgs.compare_chunk(off, n as usize)).await?,
                Work::Zeros(side) => {
                    self.push(n, imgs.zeros_chunk(side, off, n as usize))
                        .await?
                }
                Work::Skip => {}
            }
            off += n;
        }
        Ok(())
    }
}

impl Drop for Pipeline {
    fn drop(&mut self) {
        // After a difference or an error the rest is not needed.
        for (_, task) in &self.tasks {
            task.abort();
        }
    }
}

/// Where `a` and `b` (extents covering the same range) overlap: each piece with both statuses.
fn overlaps<'e>(a: &'e [Extent], b: &'e [Extent]) -> Vec<(u64, u64, &'e Extent, &'e Extent)> {
    let (mut i, mut j) = (0, 0);
    let mut out = Vec::new();
    while let (Some(x), Some(y)) = (a.get(i), b.get(j)) {
        let (x_end, y_end) = (x.start + x.len, y.start + y.len);
        let start = x.start.max(y.start);
        let end = x_end.min(y_end);
        if end > start {
            out.push((start, end - start, x, y));
        }
        if x_end == end {
            i += 1;
        }
        if y_end == end {
            j += 1;
        }
    }
    out
}

/// Block status of one side, the error carrying qemu-img's exit code for it.
async fn status(
    images: &Images,
    side: Side,
    offset: u64,
    len: u64,
) -> Result<Vec<Extent>, CompareError> {
    images
        .image(side)
        .block_status(GuestOffset(offset), len)
        .await
        .map_err(|e| CompareError::BlockStatus {
            file: images.name(side).to_string(),
            source: Box::new(e),
        })
}

/// Compares `[0, end)`, which both images have (in strict mode, all they have). Errors of block status wait for the chunks
/// before them, so the first problem in guest order is the one reported.
async fn compare_common(
    images: &Rc<Images>,
    pipe: &mut Pipeline,
    end: u64,
    strict: bool,
) -> Result<(), Stop> {
    let mut pos = 0;
    while pos < end {
        let len = (QUERY_BYTES - pos % QUERY_BYTES).min(end - pos);
        let statuses = match status(images, Side::A, pos, len).await {
            Ok(a) => status(images, Side::B, pos, len).await.map(|b| (a, b)),
            Err(e) => Err(e),
        };
        let (a, b) = match statuses {
            Ok(s) => s,
            Err(e) => {
                pipe.drain().await?;
                return Err(e.into());
            }
        };
        // Runs of the same work, merged so that reads stay large where the images' extents
        // are split differently.
        let mut run: Option<(u64, u64, Work)> = None;
        for (start, n, x, y) in overlaps(&a, &b) {
            if strict && strict_status(x, end) != strict_status(y, end) {
                if let Some((s, l, w)) = run.take() {
                    pipe.schedule(images, s, l, w).await?;
                }
                pipe.drain().await?;
                return Err(Stop::Differ(format!(
                    "Strict mode: Offset {start} block status mismatch!"
                )));
            }
            let work = Work::of(x, y);
            match &mut run {
                Some((s, l, w)) if *w == work && *s + *l == start => *l += n,
                _ => {
                    if let Some((s, l, w)) = run.replace((start, n, work)) {
                        pipe.schedule(images, s, l, w).await?;
                    }
                }
            }
        }
        if let Some((s, l, w)) = run {
            pipe.schedule(images, s, l, w).await?;
        }
        pos += len;
    }
    pipe.drain().await
}

/// Checks that `side` reads as zeros over `[start, end)`, the part only it has.
async fn check_tail(
    images: &Rc<Images>,
    pipe: &mut Pipeline,
    side: Side,
    start: u64,
    end: u64,
) -> Result<(), Stop> {
    let mut pos = start;
    while pos < end {
        let len = (QUERY_BYTES - pos % QUERY_BYTES).min(end - pos);
        let extents = match status(images, side, pos, len).await {
            Ok(e) => e,
            Err(e) => {
                pipe.drain().await?;
                return Err(e.into());
            }
        };
        for e in extents {
            let work = match !e.zero {
                true => Work::Zeros(side),
                false => Work::Skip,
            };
            pipe.schedule(images, e.start, e.len, work).await?;
        }
        pos += len;
    }
    pipe.drain().await
}

/// Opens one image read-only, as every read-only subcommand does.
async fn open(
    path: &Path,
    format: Option<&str>,
    force_share: bool,
) -> Result<Image<AnyStorage>, CompareError> {
    let format = format.map(engine_run::parse_format).transpose()?;
    Ok(engine_run::open_read_only(path, format, None, force_share).await?)
}

/// Compares the images; `Ok(None)` when identical, `Ok(Some(message))` when they differ.
async fn compare(args: &CompareArgs) -> Result<Option<String>, CompareError> {
    let a = open(
        &args.first,
        args.a_format.as_deref(),
        args.share.force_share,
    )
    .await?;
    let b = open(
        &args.second,
        args.b_format.as_deref(),
        args.share.force_share,
    )
    .await?;
    let (size_a, size_b) = (a.size(), b.size());
    let progress = Rc::new(Progress::stderr(
        size_a.max(size_b),
        args.progress && !args.quiet,
    ));
    if args.strict && size_a != size_b {
        return Ok(Some("Strict mode: Image size mismatch!".into()));
    }
    let images = Rc::new(Images {
        a,
        b,
        // As given on the command line, which is how qemu-img names them.
        names: [
            crate::common::image_name::given_name(&args.first),
            crate::common::image_name::given_name(&args.second),
        ],
        buffers: BufferPool::default(),
    });
    let mut pipe = Pipeline {
        tasks: VecDeque::new(),
        progress: progress.clone(),
    };
    let mut result = compare_common(&images, &mut pipe, size_a.min(size_b), args.strict).await;
    if result.is_ok() && size_a != size_b {
        say(args.quiet, "Warning: Image size mismatch!");
        let (side, end) = match size_a > size_b {
            true => (Side::A, size_a),
            false => (Side::B, size_b),
        };
        result = check_tail(&images, &mut pipe, side, size_a.min(size_b), end).await;
    }
    progress.finish();
    match result {
        Ok(()) => Ok(None),
        Err(Stop::Differ(message)) => Ok(Some(message)),
        Err(Stop::Failed(e)) => Err(e),
    }
}

/// An engine error as qemu-img words a failed read: strerror's text for an I/O error of
/// the file, anything else in full.
fn io_words(e: &EngineError) -> String {
    match e {
        EngineError::Io { source, .. } => engine_run::plain_io(source),
        other => other.to_string(),
    }
}

thread_local! {
    /// Result lines not yet printed (see [`say`]).
    static HELD: std::cell::RefCell<Vec<String>> = const { std::cell::RefCell::new(Vec::new()) };
}

/// Prints a result line unless `-q`. qemu-img writes these through C's stdio, which holds
/// them until exit when stdout is not a terminal, so an error message printed later still
/// comes first when both streams go to one pipe; the lines are held the same way.
fn say(quiet: bool, line: &str) {
    use std::io::IsTerminal;
    if quiet {
        return;
    }
    if std::io::stdout().is_terminal() {
        println!("{line}");
    } else {
        HELD.with(|h| h.borrow_mut().push(line.to_string()));
    }
}

/// Prints the lines [`say`] held.
fn release() {
    for line in HELD.with(|h| std::mem::take(&mut *h.borrow_mut())) {
        println!("{line}");
    }
}

/// Runs `compare` and returns qemu-img compare's exit status.
pub fn main(args: &CompareArgs) -> ExitCode {
    let code = run(args);
    release();
    code
}

fn run(args: &CompareArgs) -> ExitCode {
    match engine_run::block_on(compare(args)) {
        Err(e) => {
            eprintln!("{}: starting the runtime: {e}", crate::common::prog::name());
            ExitCode::from(2)
        }
        Ok(Ok(None)) => {
            say(args.quiet, "Images are identical.");
            ExitCode::SUCCESS
        }
        Ok(Ok(Some(message))) => {
            say(args.quiet, &message);
            ExitCode::from(1)
        }
        Ok(Err(e)) => {
            eprintln!("{}: {e}", crate::common::prog::name());
            ExitCode::from(e.exit_code())
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ext(start: u64, len: u64, present: bool, data: bool, zero: bool) -> Extent {
        Extent {
            start,
            len,
            data,
            zero,
            present,
            depth: 0,
            compressed: false,
            offset: data.then_some(start),
        }
    }

    #[test]
    fn work_follows_qemu_img() {
        let data = ext(0, 1, true, true, false);
        let zero_cluster = ext(0, 1, true, false, true);
        let hole = ext(0, 1, false, false, true);
        assert_eq!(Work::of(&data, &data), Work::Compare);
        assert_eq!(Work::of(&zero_cluster, &hole), Work::Skip);
        assert_eq!(Work::of(&data, &hole), Work::Zeros(Side::A));
        assert_eq!(Work::of(&hole, &data), Work::Zeros(Side::B));
        assert_eq!(Work::of(&zero_cluster, &data), Work::Zeros(Side::B));
        assert_eq!(Work::of(&data, &zero_cluster), Work::Zeros(Side::A));
    }

    #[test]
    fn overlaps_cover_both_lists() {
        let a = [
            ext(0, 100, true, true, false),
            ext(100, 50, false, false, true),
        ];
        let b = [
            ext(0, 30, true, true, false),
            ext(30, 90, true, false, true),
            ext(120, 30, true, true, false),
        ];
        let got: Vec<(u64, u64)> = overlaps(&a, &b).iter().map(|o| (o.0, o.1)).collect();
        assert_eq!(got, vec![(0, 30), (30, 70), (100, 20), (120, 30)]);
    }
}
