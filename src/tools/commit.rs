//! `qcow2-nbd commit`: copy what the top image (and the images between it and the base)
//! allocates into the base image, then empty the top, like `qemu-img commit`.
//!
//! Only ranges allocated above the base are touched: block status says which, at subcluster
//! granularity; data is copied in large requests, several in flight, and zero ranges become
//! zero writes (zero flags in a qcow2 base, no data written). The top is emptied only after
//! the base holds everything and is flushed, so a crash at any point leaves a chain that
//! reads as before.
//!
//! Opening: the top is opened read-write without its chain (it is emptied at the end and
//! must not change meanwhile), the base read-write with its own backing files (a partial
//! cluster written there copies the rest from them), the images in between read-only, and
//! the whole chain once more for reading with shared locks, so that our own write locks on
//! top and base do not lock us out. Another process holding any of them the way QEMU would
//! refuse makes the commit fail before anything is written.

use qcow2::format::GuestOffset;
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::rc::Rc;
use std::time::{Duration, Instant};

use clap::Args;
use qcow2::engine::{EngineError, Format, Image, OpenOptions, Preallocation};
use storage::AnyStorage;

use crate::common::cache_mode::CacheMode;
use crate::common::engine_run::{self, OpenError};
use crate::common::secrets;
use crate::common::size_string::parse_size;
use crate::tools::inflight::{BufferPool, CopyError, InFlight};
use crate::tools::progress::{self, Progress};
use crate::tools::same_file;

/// How much of the top one block-status query covers.
const QUERY_BYTES: u64 = 1 << 30;
/// Largest copy request.
const REQUEST_BYTES: u64 = 2 << 20;
/// Requests in flight (qemu-img's mirror job keeps up to 16 small ones).
const PARALLEL: usize = 8;

/// Arguments of `commit`.
#[derive(Args, Debug)]
pub struct CommitArgs {
    /// Format of the top image (qcow2 or raw); probed when not given.
    #[arg(short = 'f', long = "format")]
    pub format: Option<String>,
    /// Host cache mode for the images written (none, writeback, writethrough, directsync,
    /// unsafe): none and directsync use O_DIRECT. Everything is flushed before success is
    /// reported, whatever the mode.
    #[arg(short = 't', long = "cache", value_enum, default_value = "writeback")]
    pub cache: CacheMode,
    /// The image to commit into: the top's backing file (the default) or any image deeper
    /// in its chain, a relative name taken beside the image above it. Naming one implies
    /// -d, because the images in between no longer read as they did once the base changed,
    /// and the top must keep its own data.
    #[arg(short = 'b', long = "base")]
    pub base: Option<String>,
    /// Leave the top image as it is instead of emptying it afterwards.
    #[arg(short = 'd', long = "drop")]
    pub drop: bool,
    /// Show progress even when stderr is not a terminal.
    #[arg(short = 'p', long = "progress")]
    pub progress: bool,
    /// No output: neither progress nor "Image committed.".
    #[arg(short = 'q', long = "quiet")]
    pub quiet: bool,
    /// Copy at most this many bytes per second (a size, e.g. 100M).
    #[arg(short = 'r', long = "rate-limit")]
    pub rate: Option<String>,
    /// The top image.
    pub top: PathBuf,
}

/// Why `commit` failed.
#[derive(Debug, thiserror::Error)]
pub enum CommitError {
    /// An image could not be opened (or its format is unknown).
    #[error(transparent)]
    Open(#[from] OpenError),
    /// The top has no backing file to commit into.
    #[error("Image does not have a backing file")]
    NoBackingFile,
    /// `-b` names no image of the chain below the top.
    #[error("Did not find '{base}' in the backing chain of '{top}'")]
    BaseNotInChain {
        /// The name given.
        base: String,
        /// The top image.
        top: String,
    },
    /// A bad `-r`.
    #[error("Invalid rate limit specified: '{0}'.")]
    Rate(String),
    /// Growing the base to the top's size failed.
    #[error("Could not grow '{base}' to {size} bytes: {source}")]
    Grow {
        /// The base image.
        base: String,
        /// The size asked for.
        size: u64,
        /// The error.
        source: Box<EngineError>,
    },
    /// Copying into the base failed (the top is unchanged). Said as QEMU's commit job says
    /// it (the system's words for the failure), which scripts match; the base and the
    /// failing request are in the debug log.
    #[error("Block job failed: {}", job_failure(source))]
    Copy {
        /// The base image.
        base: String,
        /// The error.
        source: CopyError,
    },
    /// The base holds everything, but emptying the top failed. Said as QEMU says it (the
    /// system's words for the failure, which scripts match); the failing request is in the
    /// debug log.
    #[error("Failed to empty {top}: {}", os_words(source.as_ref()))]
    Empty {
        /// The top image.
        top: String,
        /// The error.
        source: Box<EngineError>,
    },
    /// The runtime could not start.
    #[error("starting the runtime: {0}")]
    Runtime(#[from] std::io::Error),
}

/// The system's words for the I/O error under `e`, as QEMU's block job reports it; the whole
/// text when no I/O error is under it.
fn job_failure(e: &CopyError) -> String {
    os_words(e)
}

/// The system's words for the I/O error under `e`, as QEMU reports a failed request; the
/// whole text when no I/O error is under it.
fn os_words(e: &(dyn std::error::Error + 'static)) -> String {
    let mut cause: Option<&(dyn std::error::Error + 'static)> = Some(e);
    while let Some(c) = cause {
        if let Some(code) = c
            .downcast_ref::<std::io::Error>()
            .and_then(std::io::Error::raw_os_error)
        {
            let text = std::io::Error::from_raw_os_error(code).to_string();
            return text
                .find(" (os error ")
                .map_or(text.clone(), |i| text[..i].to_string());
        }
        cause = c.source();
    }
    e.to_string()
}

/// The images of one commit, open the way the module documentation says.
struct Opened {
    /// The top, read-write, without its chain.
    top: Image<AnyStorage>,
    /// The whole chain, for reading.
    reader: Image<AnyStorage>,
    /// The images between top and base, read-only: held so nobody writes them meanwhile.
    _between: Vec<Image<AnyStorage>>,
    /// Index of the base in the reader's chain.
    base_depth: usize,
    /// The base's file and format.
    base_path: PathBuf,
    base_format: Format,
    /// The passwords of the base's chain.
    base_keys: qcow2::crypto::Passwords,
}

/// Copies `args.rate` bytes per second at most.
struct Throttle {
    start: Instant,
    bytes_per_sec: u64,
}

impl Throttle {
    /// Waits until `done` bytes are within the rate.
    async fn admit(&self, done: u64) {
        let due = Duration::from_secs_f64(done as f64 / self.bytes_per_sec as f64);
        if let Some(wait) = due.checked_sub(self.start.elapsed()) {
            tokio::time::sleep(wait).await;
        }
    }
}

/// Opens a file of the chain read-write (`no_backing`: without its own backing files).
async fn open_rw(
    path: &Path,
    format: Format,
    no_backing: bool,
    cache: CacheMode,
    passwords: qcow2::crypto::Passwords,
) -> Result<Image<AnyStorage>, OpenError> {
    let opts = OpenOptions {
        format: Some(format),
        no_backing,
        direct: cache.direct(),
        passwords,
        untrusted: crate::common::engine_run::untrusted(),
        ..OpenOptions::default()
    };
    Ok(Image::open(&engine_run::opener(), path, &opts).await?)
}

/// Opens a file read-only; `shared` lets others (our own writers) hold every permission.
async fn open_ro(
    path: &Path,
    format: Format,
    no_backing: bool,
    shared: bool,
    passwords: qcow2::crypto::Passwords,
) -> Result<Image<AnyStorage>, OpenError> {
    let opts = OpenOptions {
        read_only: true,
        format: Some(format),
        no_backing,
        force_share: shared,
        passwords,
        untrusted: crate::common::engine_run::untrusted(),
        ..OpenOptions::default()
    };
    Ok(Image::open(&engine_run::opener(), path, &opts).await?)
}

/// The depth of the image `-b` names in `chain` (below the top), as QEMU looks it up: an
/// absolute name as it is, a relative one against the directory of the image whose backing
/// file the layer is (as backing file names are stored), never against the working
/// directory.
fn find_base(chain: &[String], base: &str) -> Option<usize> {
    let given = Path::new(base);
    chain.iter().enumerate().skip(1).find_map(|(i, name)| {
        let layer = Path::new(name);
        let wanted = if given.is_absolute() {
            given.to_path_buf()
        } else {
            let overlay = qcow2::engine::backing_name::resolve(Path::new(&chain[i - 1]), base);
            match overlay {
                Ok(p) => p,
                Err(_) => return None,
            }
        };
        same_file(&wanted, layer).then_some(i)
    })
}

async fn open_chain(args: &CommitArgs) -> Result<Opened, CommitError> {
    let format = match &args.format {
        Some(f) => engine_run::parse_format(f)?,
        None => engine_run::probe_format(&args.top)?,
    };
    if format == Format::Raw {
        return Err(CommitError::NoBackingFile);
    }
    let keys = |depth| secrets::passwords_below(&args.top, depth);
    let top = open_rw(&args.top, format, true, args.cache, keys(0)).await?;
    let reader = open_ro(&args.top, format, false, true, keys(0)).await?;
    let chain = reader.facts().chain;
    let formats = reader.chain_formats();
    let base_depth = match &args.base {
        None if chain.len() < 2 => return Err(CommitError::NoBackingFile),
        None => 1,
        Some(b) => find_base(&chain, b).ok_or_else(|| CommitError::BaseNotInChain {
            base: b.clone(),
            top: args.top.display().to_string(),
        })?,
    };
    let mut between = Vec::new();
    for i in 1..base_depth {
        between.push(open_ro(Path::new(&chain[i]), formats[i], true, false, keys(i)).await?);
    }
    Ok(Opened {
        top,
        reader,
        _between: between,
        base_depth,
        base_path: PathBuf::from(&chain[base_depth]),
        base_format: formats[base_depth],
        base_keys: keys(base_depth),
    })
}

/// Opens the base for writing, grown to `size` first if it is smaller (as QEMU grows it).
async fn open_base(
    o: &Opened,
    size: u64,
    cache: CacheMode,
) -> Result<Image<AnyStorage>, CommitError> {
    let base = open_rw(
        &o.base_path,
        o.base_format,
        false,
        cache,
        o.base_keys.clone(),
    )
    .await?;
    if base.size() >= size {
        return Ok(base);
    }
    // The engine grows either format; the new space reads as zeros.
    base.resize(size, Preallocation::Off)
        .await
        .map_err(|e| CommitError::Grow {
            base: o.base_path.display().to_string(),
            size,
            source: Box::new(e),
        })?;
    Ok(base)
}

/// Everything a copy request needs.
struct Job {
    reader: Image<AnyStorage>,
    base: Image<AnyStorage>,
    buffers: BufferPool,
    progress: Progress<std::io::Stderr>,
}

impl Job {
    /// Copies `[off, off + len)` from the chain into the base.
    async fn copy(self: Rc<Self>, off: u64, len: u64) -> Result<(), EngineError> {
        // len <= REQUEST_BYTES by construction.
        let (read, buf) = self
            .reader
            .read_into(GuestOffset(off), self.buffers.take(len as usize))
            .await;
        let res = match read {
            Ok(()) => {
                let (res, buf) = self.base.write(GuestOffset(off), buf, false).await;
                self.buffers.give(buf);
                res
            }
            Err(e) => {
                self.buffers.give(buf);
                Err(e)
            }
        };
        if res.is_ok() {
            self.progress.advance(len);
        }
        res
    }

    /// Makes `[off, off + len)` of the base read as zeros, in metadata where it can.
    async fn zero(self: Rc<Self>, off: u64, len: u64) -> Result<(), EngineError> {
        self.base
            .write_zeroes(GuestOffset(off), len, true, false)
            .await?;
        self.progress.advance(len);
        Ok(())
    }
}

/// Copies every range allocated above `base_depth` into the base.
async fn copy_above_base(
    job: &Rc<Job>,
    base_depth: usize,
    throttle: Option<&Throttle>,
    inflight: &mut InFlight,
) -> Result<(), CopyError> {
    let size = job.reader.size();
    let mut issued = 0u64;
    let mut copied = 0u64;
    let mut pos = 0u64;
    while pos < size {
        let len = QUERY_BYTES.min(size - pos);
        let extents = job.reader.block_status(GuestOffset(pos), len).await?;
        pos += len;
        for e in extents.iter().filter(|e| e.present && e.depth < base_depth) {
            job.progress.advance(e.start.saturating_sub(issued));
            issued = e.start + e.len;
            if e.zero {
                inflight.spawn(job.clone().zero(e.start, e.len)).await?;
                continue;
            }
            let (mut off, end) = (e.start, e.start + e.len);
            while off < end {
                let n = (REQUEST_BYTES - off % REQUEST_BYTES).min(end - off);
                if let Some(t) = throttle {
                    t.admit(copied).await;
                }
                inflight.spawn(job.clone().copy(off, n)).await?;
                copied += n;
                off += n;
            }
        }
    }
    inflight.finish().await?;
    job.progress.advance(size.saturating_sub(issued));
    Ok(())
}

async fn commit(args: &CommitArgs) -> Result<(), CommitError> {
    let throttle = match &args.rate {
        None => None,
        Some(r) => match parse_size(r) {
            Ok(0) | Err(_) => return Err(CommitError::Rate(r.clone())),
            Ok(bytes_per_sec) => Some(Throttle {
                start: Instant::now(),
                bytes_per_sec,
            }),
        },
    };
    let opened = open_chain(args).await?;
    let size = opened.reader.size();
    let base = open_base(&opened, size, args.cache).await?;
    let base_name = opened.base_path.display().to_string();
    let job = Rc::new(Job {
        reader: opened.reader.clone(),
        base: base.clone(),
        buffers: BufferPool::default(),
        progress: Progress::stderr(size, progress::wanted(args.progress, args.quiet)),
    });
    let mut inflight = InFlight::new(PARALLEL);
    let copied = copy_above_base(&job, opened.base_depth, throttle.as_ref(), &mut inflight).await;
    if copied.is_err() {
        inflight.stop().await;
    }
    let copy_err = |source: CopyError| {
        tracing::debug!("committing into '{base_name}' failed: {source}");
        CommitError::Copy {
            base: base_name.clone(),
            source,
        }
    };
    copied.map_err(copy_err)?;
    // The base must hold everything durably before the top lets go of anything.
    base.close().await.map_err(|e| copy_err(e.into()))?;
    job.progress.finish();
    let empty_err = |e: EngineError| {
        tracing::debug!("emptying '{}' failed: {e}", args.top.display());
        CommitError::Empty {
            top: args.top.display().to_string(),
            source: Box::new(e),
        }
    };
    if !args.drop && args.base.is_none() {
        opened.top.make_empty().await.map_err(empty_err)?;
    }
    // Even a top left as it is was opened for writing: its bitmaps go back as they were.
    opened.top.close().await.map_err(empty_err)?;
    if !args.quiet {
        println!("Image committed.");
    }
    Ok(())
}

/// Runs `commit` and returns the exit status.
pub fn main(args: &CommitArgs) -> ExitCode {
    let res = engine_run::block_on(commit(args)).map_err(CommitError::from);
    engine_run::exit_code(res.and_then(|r| r))
}
