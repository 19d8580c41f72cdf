//! `qcow2-nbd convert`: copy what a guest sees of an image (its whole backing chain, or an
//! internal snapshot) into a new raw or qcow2 image, optionally compressed.
//!
//! Only data is copied: block status says which ranges are data, and of those, blocks that
//! read as all zeros are skipped too (qemu-img's `-S 4k` behaviour), because a new raw file
//! (sparse after truncation) and a new qcow2 image without a backing file both read as zeros
//! where nothing was written. Data goes in large requests, several in flight, each aligned
//! to the target's cluster so that zero detection and `-c` work on whole clusters.

use std::cell::Cell;
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::rc::Rc;

use clap::Args;
use qcow2::engine::{
    BitmapInfo, ClusterCompressor, EngineError, Format, Image, OpenOptions, PackedCluster,
};
use storage::{AnyStorage, IoBuf};
use tokio::sync::Notify;
use tokio::task::JoinSet;

use crate::create::{self, option_table, CreateError};
use crate::engine_run::{self, OpenError};
use crate::inflight::BufferPool;
use crate::options::{self, OptionsError, Parsed};
use crate::progress::{self, Progress};

/// How much of the source one block-status query covers.
const QUERY_BYTES: u64 = 1 << 30;
/// Largest copy request: big enough for sequential throughput, small enough that eight in
/// flight stay cheap in memory.
const REQUEST_BYTES: u64 = 2 << 20;
/// Zero-detection unit for raw targets (qemu-img's default `-S 4k`).
const RAW_GRAIN: u64 = 4096;

/// Arguments of `convert`.
#[derive(Args, Debug)]
pub struct ConvertArgs {
    /// Format of the source (qcow2 or raw); probed when not given.
    #[arg(short = 'f', long = "source-format")]
    pub source_format: Option<String>,
    #[command(flatten)]
    pub share: crate::engine_run::ForceShare,
    /// Format of the target: raw (the default, as in qemu-img) or qcow2.
    #[arg(short = 'O', long = "target-format", default_value = "raw")]
    pub target_format: String,
    /// Target format options, as for `create` (`-o help` lists them); may be repeated.
    #[arg(short = 'o', long = "target-options")]
    pub options: Vec<String>,
    /// Compress every cluster of the (qcow2) target.
    #[arg(short = 'c', long = "compress")]
    pub compress: bool,
    /// Copy an internal snapshot: its id or name, or `snapshot.id=ID` / `snapshot.name=NAME`.
    #[arg(short = 'l', long = "source-snapshot")]
    pub snapshot: Option<String>,
    /// Show progress even when stderr is not a terminal.
    #[arg(short = 'p', long = "progress")]
    pub progress: bool,
    /// No progress output.
    #[arg(short = 'q', long = "quiet")]
    pub quiet: bool,
    /// Also copy the source's persistent dirty bitmaps (names, granularity, enabled state
    /// and bits) into the (qcow2) target.
    #[arg(long)]
    pub bitmaps: bool,
    /// With --bitmaps, leave out bitmaps left in use by a crash (warned about) instead of
    /// failing.
    #[arg(long = "skip-broken-bitmaps")]
    pub skip_broken_bitmaps: bool,
    /// Write out of order, as requests complete (qemu-img's -W): faster on some storage,
    /// but a qcow2 target's clusters no longer follow guest order.
    #[arg(short = 'W')]
    pub unordered: bool,
    /// Copy requests in flight at once (qemu-img's -m).
    #[arg(short = 'm', long = "parallel", default_value_t = 8,
          value_parser = clap::value_parser!(u16).range(1..=64))]
    pub parallel: u16,
    /// The image to copy.
    pub source: PathBuf,
    /// The image to write (replaced if it exists).
    pub target: PathBuf,
}

/// Why `convert` failed.
#[derive(Debug, thiserror::Error)]
pub enum ConvertError {
    /// A bad `-o` list or value.
    #[error("{0}")]
    Options(#[from] OptionsError),
    /// `-c` with a raw target.
    #[error("Compression not supported for this file format")]
    CompressRaw,
    /// `-c` with an encrypted target.
    #[error("Compression and encryption not supported at the same time")]
    CompressEncrypted,
    /// An option that makes no sense for a full copy.
    #[error("Parameter '{0}' is not supported by convert (the target is always a complete copy)")]
    TargetOption(&'static str),
    /// A `-l` parameter we cannot read.
    #[error("Invalid snapshot parameter '{0}' (expected ID_OR_NAME, snapshot.id=ID or snapshot.name=NAME)")]
    SnapshotParam(String),
    /// Source and target are one file.
    #[error("{0}: the source and the target are the same file")]
    SameFile(String),
    /// The source could not be opened.
    #[error(transparent)]
    Source(#[from] OpenError),
    /// The target could not be created.
    #[error(transparent)]
    Create(Box<CreateError>),
    /// Reading the source or writing the target failed.
    #[error("error while converting: {0}")]
    Copy(Box<EngineError>),
    /// `--skip-broken-bitmaps` without `--bitmaps`.
    #[error("Use of --skip-broken-bitmaps requires --bitmaps")]
    SkipWithoutBitmaps,
    /// `--bitmaps` from a source that has none to give.
    #[error("Source lacks bitmap support")]
    SourceWithoutBitmaps,
    /// `--bitmaps` into a target that cannot store them.
    #[error("Format driver '{0}' does not support bitmaps")]
    TargetWithoutBitmaps(&'static str),
    /// A source bitmap left in use by a crash.
    #[error("Cannot copy inconsistent bitmap '{0}'\nTry --skip-broken-bitmaps, or use 'qcow2-nbd bitmap --remove' to delete it")]
    InconsistentBitmap(String),
    /// A copy task died (a bug: tasks return their errors).
    #[error("internal error: a copy task failed: {0}")]
    Task(String),
    /// The runtime could not start.
    #[error("starting the runtime: {0}")]
    Runtime(#[from] std::io::Error),
}

impl From<CreateError> for ConvertError {
    fn from(e: CreateError) -> ConvertError {
        ConvertError::Create(Box::new(e))
    }
}

impl From<EngineError> for ConvertError {
    fn from(e: EngineError) -> ConvertError {
        ConvertError::Copy(Box::new(e))
    }
}

/// Reads `-l`: a plain id or name, `snapshot.id=ID` or `snapshot.name=NAME`.
pub fn snapshot_param(s: &str) -> Result<String, ConvertError> {
    let bad = || ConvertError::SnapshotParam(s.to_string());
    if !s.starts_with("snapshot.") {
        return Ok(s.to_string());
    }
    let pairs = options::split(s);
    match pairs.as_slice() {
        [(k, Some(v))] if (k == "snapshot.id" || k == "snapshot.name") && !v.is_empty() => {
            Ok(v.clone())
        }
        _ => Err(bad()),
    }
}

/// True when `data` is all zero bytes. OR-folding fixed-size chunks lets the compiler
/// vectorize the scan while still stopping early at the first chunk with data.
pub fn is_zero(data: &[u8]) -> bool {
    data.chunks(256)
        .all(|c| c.iter().fold(0u8, |acc, &b| acc | b) == 0)
}

/// A write under way.
type Write = tokio::task::JoinHandle<Result<(), EngineError>>;

/// A request's data, ready to be written.
enum Prepared {
    /// As read: its non-zero grains are written as they are.
    Data(IoBuf),
    /// Compressed clusters and where they go.
    Packed(Vec<(u64, PackedCluster)>),
}

/// Everything a copy task needs.
struct Job {
    src: Image<AnyStorage>,
    dst: Image<AnyStorage>,
    /// Zero-detection (and, with `compress`, compression) unit: a power of two.
    grain: u64,
    /// With `-c`: compresses clusters on the blocking thread pool, so every core compresses
    /// while the engine's thread keeps reading and writing.
    compress: Option<ClusterCompressor>,
    /// The target's name, for errors.
    target: String,
    /// Write in guest order (reads still overlap), so that a qcow2 target allocates its
    /// clusters in guest order as qemu-img does, instead of fragmenting by completion order.
    ordered: bool,
    /// Sequence number of the request whose turn it is to write (when `ordered`).
    turn: Cell<u64>,
    turn_changed: Notify,
    /// Request buffers for reuse: a fresh multi-MiB buffer per request costs more in page
    /// faults and zeroing than the copy itself.
    buffers: BufferPool,
    progress: Rc<Progress<std::io::Stderr>>,
}

impl Job {
    /// Copies `[off, off + len)` (request number `seq`), skipping grains that read as zeros.
    async fn copy(self: Rc<Self>, seq: u64, off: u64, len: u64) -> Result<(), EngineError> {
        // len <= REQUEST_BYTES (or one grain), which fits in memory by construction.
        let (read, buf) = self
            .src
            .read_into(off, self.buffers.take(len as usize))
            .await;
        let prepared = match read {
            Ok(()) => self.prepare(off, buf).await,
            Err(e) => {
                self.buffers.give(buf);
                Err(e)
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
            Ok(Prepared::Packed(packed)) => self.write_packed(packed).await.map(|()| Vec::new()),
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
        if res.is_ok() {
            self.progress.advance(len);
        }
        res
    }

    /// What `buf` (read at `off`) becomes before its turn to write: with `-c`, its clusters
    /// compressed (so requests compress in parallel even when they write in order) and the
    /// buffer back in the pool; otherwise the buffer itself.
    async fn prepare(&self, off: u64, buf: IoBuf) -> Result<Prepared, EngineError> {
        let Some(compressor) = self.compress else {
            return Ok(Prepared::Data(buf));
        };
        let packed = self.pack(compressor, off, &buf).await;
        self.buffers.give(buf);
        Ok(Prepared::Packed(packed?))
    }

    /// Starts writing the non-zero grains of `buf` (read at `off`), one task per run of
    /// them. In ordered mode each task runs until it first waits for the disk, by which time
    /// the target has allocated its clusters, before the next starts: the layout follows
    /// guest order while the data of several requests is copied at once. The buffer goes
    /// back to the pool once written (or once its runs are copied out).
    async fn start_writes(self: &Rc<Self>, off: u64, buf: IoBuf) -> Vec<Write> {
        let grain = self.grain as usize;
        let nonzero: Vec<bool> = buf.chunks(grain).map(|b| !is_zero(b)).collect();
        let mut writes = Vec::new();
        if nonzero.iter().all(|&nz| nz) {
            let job = Rc::clone(self);
            writes.push(tokio::task::spawn_local(async move {
                let (res, buf) = job.dst.write(off, buf, false).await;
                job.buffers.give(buf);
                res
            }));
            self.let_it_allocate().await;
            return writes;
        }
        let mut i = 0;
        while i < nonzero.len() {
            if !nonzero[i] {
                i += 1;
                continue;
            }
            let j = nonzero[i..]
                .iter()
                .position(|&nz| !nz)
                .map_or(nonzero.len(), |k| i + k);
            let (a, b) = (i * grain, (j * grain).min(buf.len()));
            let piece = IoBuf::from_slice(&buf[a..b]);
            let job = Rc::clone(self);
            writes.push(tokio::task::spawn_local(async move {
                job.dst.write(off + a as u64, piece, false).await.0
            }));
            self.let_it_allocate().await;
            i = j;
        }
        self.buffers.give(buf);
        writes
    }

    /// In ordered mode, lets the write just spawned run up to its first wait.
    async fn let_it_allocate(&self) {
        if self.ordered {
            tokio::task::yield_now().await;
        }
    }

    /// Compresses the non-zero grains (clusters) of `buf`, read at `off`, on the blocking
    /// thread pool: their offsets and packed contents, in order.
    async fn pack(
        &self,
        compressor: ClusterCompressor,
        off: u64,
        buf: &IoBuf,
    ) -> Result<Vec<(u64, PackedCluster)>, EngineError> {
        let grain = self.grain as usize;
        // The target may be a little longer than the source (sizes round up to 512): a
        // short last cluster is padded to the target's end.
        let dst_size = self.dst.size();
        let clusters: Vec<(u64, IoBuf)> = buf
            .chunks(grain)
            .enumerate()
            .filter(|(_, block)| !is_zero(block))
            .map(|(i, block)| {
                let at = off + (i * grain) as u64;
                let want = self.grain.min(dst_size - at) as usize;
                let mut data = IoBuf::zeroed(want.max(block.len()));
                data[..block.len()].copy_from_slice(block);
                (at, data)
            })
            .collect();
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
        packed.map_err(|(offset, source)| EngineError::Compressed {
            image: self.target.clone(),
            offset,
            source,
        })
    }

    async fn write_packed(&self, packed: Vec<(u64, PackedCluster)>) -> Result<(), EngineError> {
        for (at, p) in packed {
            self.dst.write_packed(at, p).await?;
        }
        Ok(())
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

/// Copies every data range of the first `size` bytes of `job.src` into `job.dst`.
async fn copy_all(job: Rc<Job>, size: u64, parallel: usize) -> Result<(), ConvertError> {
    let grain = job.grain;
    let request = REQUEST_BYTES.max(grain);
    let mut tasks: JoinSet<Result<(), EngineError>> = JoinSet::new();
    // Everything below `issued` is either skipped (counted at once) or in a request.
    let mut issued = 0u64;
    let mut seq = 0u64;
    let mut pos = 0u64;
    let result: Result<(), ConvertError> = async {
        while pos < size {
            let len = (QUERY_BYTES - pos % QUERY_BYTES).min(size - pos);
            let extents = job.src.block_status(pos, len).await?;
            pos += len;
            // Grain-aligned data ranges, merged. Query ends are grain-aligned too, so no
            // range reaches into the next query.
            let mut ranges: Vec<(u64, u64)> = Vec::new();
            for e in extents.iter().filter(|e| e.data) {
                let s = e.start - e.start % grain;
                let end = (e.start + e.len)
                    .div_ceil(grain)
                    .saturating_mul(grain)
                    .min(size);
                match ranges.last_mut() {
                    Some((_, pe)) if s <= *pe => *pe = (*pe).max(end),
                    _ => ranges.push((s, end)),
                }
            }
            for (s, e) in ranges {
                job.progress.advance(s.saturating_sub(issued));
                issued = e;
                let mut off = s;
                while off < e {
                    let n = (request - off % request).min(e - off);
                    while tasks.len() >= parallel {
                        reap(&mut tasks).await?;
                    }
                    tasks.spawn_local(job.clone().copy(seq, off, n));
                    seq += 1;
                    off += n;
                }
            }
        }
        while !tasks.is_empty() {
            reap(&mut tasks).await?;
        }
        job.progress.advance(size.saturating_sub(issued));
        Ok(())
    }
    .await;
    // On error, stop the requests in flight (the target is incomplete either way).
    tasks.abort_all();
    while tasks.join_next().await.is_some() {}
    result
}

/// True when `a` and `b` are the same existing file.
fn same_file(a: &Path, b: &Path) -> bool {
    match (std::fs::canonicalize(a), std::fs::canonicalize(b)) {
        (Ok(x), Ok(y)) => x == y,
        _ => false,
    }
}

async fn convert(args: &ConvertArgs) -> Result<(), ConvertError> {
    let target_format = engine_run::parse_format(&args.target_format)?;
    let (specs, _) = option_table(target_format);
    let list = options::join_lists(&args.options)?;
    if list.as_deref().is_some_and(options::wants_help) {
        print!("{}", options::help_text(specs));
        return Ok(());
    }
    if args.compress && target_format == Format::Raw {
        return Err(ConvertError::CompressRaw);
    }
    let parsed = target_options(target_format, list.as_deref())?;
    let encrypted = parsed.has("encrypt.format") || parsed.bool("encryption") == Some(true);
    if args.compress && encrypted {
        // Compressed clusters are stored in plain text.
        return Err(ConvertError::CompressEncrypted);
    }
    let (src, size) = open_source(args).await?;
    let bitmaps = bitmaps_to_copy(args, &src, target_format, &parsed).await?;
    let copy_len = src.size().min(size);
    let (dst, grain) = create_target(args, target_format, &parsed, size).await?;
    let progress = Rc::new(Progress::stderr(
        copy_len,
        progress::wanted(args.progress, args.quiet),
    ));
    let job = Rc::new(Job {
        src: src.clone(),
        dst: dst.clone(),
        grain,
        compress: args.compress.then(|| dst.compressor()).transpose()?,
        target: args.target.display().to_string(),
        ordered: target_format == Format::Qcow2 && !args.unordered,
        turn: Cell::new(0),
        turn_changed: Notify::new(),
        buffers: BufferPool::default(),
        progress: progress.clone(),
    });
    copy_all(job, copy_len, usize::from(args.parallel)).await?;
    // After the copy, whose writes would otherwise mark them.
    copy_bitmaps(&src, &dst, &bitmaps, size).await?;
    dst.close().await?;
    progress.finish();
    Ok(())
}

/// The source bitmaps `--bitmaps` copies, checked as qemu-img checks them before anything is
/// created: both images must hold bitmaps, and one left in use by a crash fails the convert
/// unless `--skip-broken-bitmaps` (then it is left out, with a warning).
async fn bitmaps_to_copy(
    args: &ConvertArgs,
    src: &Image<AnyStorage>,
    target: Format,
    parsed: &Parsed,
) -> Result<Vec<BitmapInfo>, ConvertError> {
    if !args.bitmaps {
        return match args.skip_broken_bitmaps {
            true => Err(ConvertError::SkipWithoutBitmaps),
            false => Ok(Vec::new()),
        };
    }
    if !src.facts().qcow2 {
        return Err(ConvertError::SourceWithoutBitmaps);
    }
    let all = src.bitmaps().await?;
    // qemu-img goes through them newest first, before it looks at the target.
    for b in all.iter().rev().filter(|b| b.inconsistent) {
        if !args.skip_broken_bitmaps {
            return Err(ConvertError::InconsistentBitmap(b.name.clone()));
        }
        eprintln!(
            "{}: warning: Skipping inconsistent bitmap '{}'",
            crate::prog::name(),
            b.name
        );
    }
    let v2 = parsed
        .str("compat")
        .is_some_and(|c| c == "0.10" || c == "v2");
    if target == Format::Raw || v2 {
        return Err(ConvertError::TargetWithoutBitmaps(engine_run::format_name(
            target,
        )));
    }
    Ok(all.into_iter().filter(|b| !b.inconsistent).collect())
}

/// Gives the target every bitmap in `list` with the source's bits.
async fn copy_bitmaps(
    src: &Image<AnyStorage>,
    dst: &Image<AnyStorage>,
    list: &[BitmapInfo],
    size: u64,
) -> Result<(), ConvertError> {
    for b in list {
        let data = src.bitmap_data(&b.name).await?;
        dst.add_bitmap(&b.name, Some(b.granularity), b.enabled)?;
        dst.merge_bitmap(&b.name, &data, size)?;
    }
    Ok(())
}

/// Parses the target's `-o` list, refusing the options a complete copy decides itself.
fn target_options(format: Format, list: Option<&str>) -> Result<Parsed, ConvertError> {
    let (specs, unsupported) = option_table(format);
    let parsed = match list {
        Some(l) => Parsed::parse(l, specs, unsupported)?,
        None => Parsed::default(),
    };
    for name in ["backing_file", "backing_fmt", "size"] {
        if parsed.has(name) {
            let spec = specs
                .iter()
                .find(|s| s.name == name)
                .map_or("size", |s| s.name);
            return Err(ConvertError::TargetOption(spec));
        }
    }
    Ok(parsed)
}

/// Opens the source (at the snapshot `-l` names, if any) and returns it with the size of
/// the target.
async fn open_source(args: &ConvertArgs) -> Result<(Image<AnyStorage>, u64), ConvertError> {
    let snapshot = args.snapshot.as_deref().map(snapshot_param).transpose()?;
    let source_format = args
        .source_format
        .as_deref()
        .map(engine_run::parse_format)
        .transpose()?;
    if same_file(&args.source, &args.target) {
        return Err(ConvertError::SameFile(args.target.display().to_string()));
    }
    let src = engine_run::open_read_only(
        &args.source,
        source_format,
        snapshot.clone(),
        args.share.force_share,
    )
    .await?;
    // qemu-img convert -l swaps in the snapshot's L1 table but keeps the active disk's size:
    // the copy is that long, reading zeros past the snapshot's own end (or dropping what the
    // snapshot has past the active end).
    let size = match snapshot {
        Some(_) => {
            engine_run::open_read_only(&args.source, source_format, None, args.share.force_share)
                .await?
                .size()
        }
        None => src.size(),
    };
    Ok((src, size))
}

/// Creates the target image of `size` bytes and opens it for the copy; returns it with its
/// zero-detection grain (the cluster size of a qcow2 target).
async fn create_target(
    args: &ConvertArgs,
    format: Format,
    parsed: &Parsed,
    size: u64,
) -> Result<(Image<AnyStorage>, u64), ConvertError> {
    let target = args.target.display().to_string();
    let invalid = CreateError::invalid(&target);
    let mut plan_passwords = qcow2::crypto::Passwords::default();
    let mut noise = false;
    let grain = match format {
        Format::Raw => {
            let prealloc =
                create::raw_preallocation(parsed.str("preallocation")).map_err(&invalid)?;
            create::create_raw(&args.target, size, prealloc)
                .await
                .map_err(|source| CreateError::Io {
                    image: target.clone(),
                    what: "creating the raw image",
                    source,
                })?;
            RAW_GRAIN
        }
        Format::Qcow2 => {
            let mut plan = create::qcow2_plan(parsed, false).map_err(&invalid)?;
            plan.opts.size = size;
            create::check_qcow2_size(&plan.opts).map_err(&invalid)?;
            plan_passwords = plan.opts.passwords();
            // Preallocated clusters of an encrypted image read as noise, not zeros (QEMU
            // calls such a target not zero-initialized): they are zeroed before the copy,
            // which then skips zeros as usual.
            noise = plan.opts.encryption.is_some()
                && plan.opts.preallocation != qcow2::engine::Preallocation::Off;
            create::create_qcow2(&args.target, &plan.opts)
                .await
                .map_err(|source| CreateError::Engine {
                    image: target.clone(),
                    source: Box::new(source),
                })?;
            plan.opts.cluster_size
        }
    };
    let dst = Image::open(
        &engine_run::opener(),
        &args.target,
        &OpenOptions {
            format: Some(format),
            no_backing: true,
            passwords: plan_passwords,
            ..OpenOptions::default()
        },
    )
    .await
    .map_err(|source| CreateError::Engine {
        image: target.clone(),
        source: Box::new(source),
    })?;
    if noise {
        dst.write_zeroes(0, dst.size(), false, false)
            .await
            .map_err(|source| CreateError::Engine {
                image: target.clone(),
                source: Box::new(source),
            })?;
    }
    Ok((dst, grain))
}

/// Runs `convert` and returns the exit status.
pub fn main(args: &ConvertArgs) -> ExitCode {
    let res = engine_run::block_on(convert(args)).map_err(ConvertError::from);
    engine_run::exit_code(res.and_then(|r| r))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn zero_detection_at_every_alignment() {
        let mut v = vec![0u8; 4096 + 7];
        for start in 0..8 {
            assert!(is_zero(&v[start..]));
        }
        for i in [0, 3, 8, 4095, 4102] {
            v[i] = 1;
            assert!(!is_zero(&v), "byte {i}");
            v[i] = 0;
        }
        assert!(is_zero(&[]));
    }

    #[test]
    fn snapshot_parameters() {
        assert_eq!(snapshot_param("1").unwrap(), "1");
        assert_eq!(snapshot_param("before upgrade").unwrap(), "before upgrade");
        assert_eq!(snapshot_param("snapshot.id=3").unwrap(), "3");
        assert_eq!(snapshot_param("snapshot.name=a,,b").unwrap(), "a,b");
        assert!(snapshot_param("snapshot.id=1,snapshot.name=x").is_err());
        assert!(snapshot_param("snapshot.size=1").is_err());
        assert!(snapshot_param("snapshot.id=").is_err());
    }
}
