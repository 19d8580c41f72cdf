//! `qcow2-nbd rebase`: change an image's backing file, like `qemu-img rebase`.
//!
//! Safe mode (the default) keeps what the guest reads: wherever the image does not allocate
//! a range itself and the old chain reads differently from the new backing file, the old
//! contents are copied into the image, in whole subclusters (clusters without extended L2
//! entries) so that no write copies a partial unit from the old chain. Only then, once the
//! copies are durable, is the new name written. `-u` (unsafe) only rewrites the name. With
//! `-c` the copies are written compressed, so the unit is the whole cluster.

use qcow2::format::GuestOffset;
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::rc::Rc;

use clap::Args;
use qcow2::engine::backing_name;
use qcow2::engine::{EngineError, Format, Image, OpenOptions};
use storage::{AnyStorage, IoBuf};

use crate::common::engine_run::{self, OpenError};
use crate::common::zeroes::is_zero;
use crate::tools::inflight::{BufferPool, CopyError, InFlight};
use crate::tools::progress::{self, Progress};

/// How much of the image one block-status query covers.
const QUERY_BYTES: u64 = 1 << 30;
/// Largest compare request; a multiple of every cluster size, so requests never share one.
const REQUEST_BYTES: u64 = 2 << 20;
/// Requests in flight.
const PARALLEL: usize = 8;

/// Arguments of `rebase`.
#[derive(Args, Debug)]
pub struct RebaseArgs {
    /// Format of the image (qcow2; raw images have no backing file); probed when not given.
    #[arg(short = 'f', long = "format")]
    pub format: Option<String>,
    /// Format of the new backing file (qcow2 or raw); required with a non-empty -b.
    #[arg(short = 'F', long = "backing-format")]
    pub backing_format: Option<String>,
    /// The new backing file, as it is to be recorded (a relative name is relative to the
    /// image's directory); "" for none. Required unless -u, where leaving it out also means
    /// none.
    #[arg(short = 'b', long = "backing")]
    pub backing: Option<String>,
    /// Unsafe: only rewrite the backing file name and format, copying nothing; the new
    /// backing file need not exist. Right only when it reads like the old one.
    #[arg(short = 'u', long = "unsafe")]
    pub unsafe_mode: bool,
    /// Write the copied clusters compressed (whole clusters are compared and copied).
    #[arg(short = 'c', long = "compress")]
    pub compress: bool,
    /// Show progress even when stderr is not a terminal.
    #[arg(short = 'p', long = "progress")]
    pub progress: bool,
    /// No progress output.
    #[arg(short = 'q', long = "quiet")]
    pub quiet: bool,
    /// The image whose backing file changes.
    pub image: PathBuf,
}

/// Why `rebase` failed.
#[derive(Debug, thiserror::Error)]
pub enum RebaseError {
    /// Neither -b nor -u.
    #[error("Must specify backing file (-b) or use unsafe mode (-u)")]
    NoBacking,
    /// A backing file name without -F.
    #[error("Could not change the backing file to '{0}': backing format must be specified")]
    NoBackingFormat(String),
    /// `-c` for an image that cannot hold compressed clusters.
    #[error("Compression not supported for this file format")]
    CompressUnsupported,
    /// A raw image, which cannot name a backing file.
    #[error("Could not change the backing file to '{0}': Operation not supported")]
    RawImage(String),
    /// The image (or its old chain) could not be opened.
    #[error(transparent)]
    Open(#[from] OpenError),
    /// A name the engine would never follow.
    #[error(transparent)]
    Name(#[from] backing_name::BackingError),
    /// The new backing file could not be opened.
    #[error("Could not open new backing file '{name}': {source}")]
    NewBacking {
        /// The name given.
        name: String,
        /// The error.
        source: OpenError,
    },
    /// Copying the differences failed (the image still names its old backing file).
    #[error("Could not rebase '{image}': {source}")]
    Copy {
        /// The image.
        image: String,
        /// The error.
        source: CopyError,
    },
    /// Writing the new name failed.
    #[error("Could not change the backing file to '{name}': {source}")]
    Rename {
        /// The new name ("" for none).
        name: String,
        /// The error.
        source: Box<EngineError>,
    },
    /// The runtime could not start.
    #[error("starting the runtime: {0}")]
    Runtime(#[from] std::io::Error),
}

/// The new backing file as the header will record it: `None` for no backing file.
struct Target {
    name: Option<String>,
    format: Option<Format>,
    /// With `-u`, a format QEMU has and we do not read, recorded as named.
    other_format: Option<String>,
}

/// Reads -b, -F and -u into what is recorded, refusing what QEMU refuses (but before
/// anything is copied, where qemu-img copies first and fails at the end).
fn target(args: &RebaseArgs) -> Result<Target, RebaseError> {
    let name = match &args.backing {
        None if !args.unsafe_mode => return Err(RebaseError::NoBacking),
        None => None,
        Some(b) if b.is_empty() => None,
        Some(b) => Some(b.clone()),
    };
    let format = match (&name, &args.backing_format) {
        (Some(n), None) => return Err(RebaseError::NoBackingFormat(n.clone())),
        // Unsafe mode opens nothing, so any format QEMU knows may be recorded.
        (Some(_), Some(f))
            if args.unsafe_mode
                && engine_run::parse_format(f).is_err()
                && engine_run::QEMU_DRIVERS.contains(&f.as_str()) =>
        {
            return Ok(Target {
                name,
                format: None,
                other_format: Some(f.clone()),
            });
        }
        (Some(_), Some(f)) => Some(engine_run::parse_format(f)?),
        (None, _) => None,
    };
    Ok(Target {
        name,
        format,
        other_format: None,
    })
}

/// Everything a compare request needs.
struct Job {
    /// The image, read through its old chain and written.
    image: Image<AnyStorage>,
    /// The new backing file (`None`: reads as zeros).
    new: Option<Image<AnyStorage>>,
    /// Compare and write unit: the image's subcluster, or with `compress` its cluster.
    unit: u64,
    /// Write what is copied compressed, a cluster at a time.
    compress: bool,
    /// The old backing file's size (0 without one): past it the old chain reads zeros.
    old_end: u64,
    buffers: BufferPool,
    progress: Progress<std::io::Stderr>,
}

impl Job {
    /// Copies into the image the units of `[off, off + len)` (unit-aligned, not allocated
    /// in the image) where the old chain and the new backing file differ.
    async fn rebase_range(self: Rc<Self>, off: u64, len: u64) -> Result<(), EngineError> {
        let old_zero = reads_zero(&self.image, off, len).await?;
        let new_len = self
            .new
            .as_ref()
            .map_or(0, |n| n.size().saturating_sub(off).min(len));
        let new_zero = match &self.new {
            Some(n) if new_len > 0 => reads_zero(n, off, new_len).await?,
            _ => true,
        };
        if !(old_zero && new_zero) {
            self.compare_and_copy(off, len, old_zero, new_len).await?;
        }
        self.progress.advance(len);
        Ok(())
    }

    /// Reads both sides of `[off, off + len)` and writes the differing units.
    async fn compare_and_copy(
        &self,
        off: u64,
        len: u64,
        old_zero: bool,
        new_len: u64,
    ) -> Result<(), EngineError> {
        // len <= REQUEST_BYTES by construction.
        let old_valid = if old_zero { 0 } else { len as usize };
        let old = self
            .read_side(&self.image, off, len as usize, old_valid)
            .await?;
        // Without a new backing file the new side reads as zeros: no buffer is needed to
        // say so.
        let new = match &self.new {
            Some(n) => match self.read_side(n, off, len as usize, new_len as usize).await {
                Ok(b) => Some(b),
                Err(e) => {
                    self.buffers.give(old);
                    return Err(e);
                }
            },
            None => None,
        };
        let res = self.write_differences(off, &old, new.as_deref()).await;
        self.buffers.give(old);
        if let Some(new) = new {
            self.buffers.give(new);
        }
        res
    }

    /// A buffer of `len` bytes whose first `valid` bytes are read from `img` at `off`, the
    /// rest zeros (what a shorter backing file reads as).
    async fn read_side(
        &self,
        img: &Image<AnyStorage>,
        off: u64,
        len: usize,
        valid: usize,
    ) -> Result<IoBuf, EngineError> {
        let valid = valid.min(len);
        if valid == 0 {
            return Ok(self.zeroed(len));
        }
        // The read fills the first `valid` bytes; only the rest is zeroed below.
        let buf = self.buffers.take(valid);
        let (res, mut buf) = img.read_into(GuestOffset(off), buf).await;
        if let Err(e) = res {
            self.buffers.give(buf);
            return Err(e);
        }
        buf.resize(len);
        buf[valid..].fill(0);
        Ok(buf)
    }

    fn zeroed(&self, len: usize) -> IoBuf {
        let mut b = self.buffers.take(len);
        b.fill(0);
        b
    }

    /// Writes the old contents of every run of units where `old` and `new` differ (`new`
    /// absent: reads as zeros). As in qemu-img, a run that starts past the end of the old
    /// backing file (where the old chain reads zeros without asking it) is written as zeros,
    /// every other run as data, zeros included, so the image allocates what QEMU's would.
    async fn write_differences(
        &self,
        off: u64,
        old: &[u8],
        new: Option<&[u8]>,
    ) -> Result<(), EngineError> {
        let unit = self.unit as usize;
        let differs: Vec<bool> = match new {
            Some(new) => old
                .chunks(unit)
                .zip(new.chunks(unit))
                .map(|(a, b)| a != b)
                .collect(),
            None => old.chunks(unit).map(|a| !is_zero(a)).collect(),
        };
        let mut i = 0;
        while i < differs.len() {
            if !differs[i] {
                i += 1;
                continue;
            }
            let j = differs[i..]
                .iter()
                .position(|&d| !d)
                .map_or(differs.len(), |k| i + k);
            let (a, b) = (i * unit, (j * unit).min(old.len()));
            let at = off + a as u64;
            if at >= self.old_end {
                // Flags even without an old backing file: the new one must not show through.
                self.image
                    .write_zero_flags(GuestOffset(at), (b - a) as u64, false)
                    .await?;
            } else if self.compress {
                // Units are clusters here; the last one may end with the disk.
                for (k, cluster) in old[a..b].chunks(unit).enumerate() {
                    let cat = at + (k * unit) as u64;
                    self.image
                        .write_compressed(GuestOffset(cat), IoBuf::from_slice(cluster))
                        .await?;
                }
            } else {
                self.image
                    .write(GuestOffset(at), IoBuf::from_slice(&old[a..b]), false)
                    .await
                    .0?;
            }
            i = j;
        }
        Ok(())
    }
}

/// True when block status says `[off, off + len)` of `img` reads as zeros.
async fn reads_zero(img: &Image<AnyStorage>, off: u64, len: u64) -> Result<bool, EngineError> {
    Ok(img
        .block_status(GuestOffset(off), len)
        .await?
        .iter()
        .all(|e| !e.data))
}

/// The ranges of `[pos, pos + len)` to compare, unit-aligned: what the image does not
/// allocate itself, and, when the new backing file is the old chain's layer `same_from`,
/// only what the old chain does not read from that layer or below (there both sides read the
/// same files). A range past the end of a shorter layer above `same_from` reads as zeros in
/// the old chain without reaching it (block status gives the deepest layer that covers it),
/// so it is compared too.
async fn ranges_to_compare(
    image: &Image<AnyStorage>,
    pos: u64,
    len: u64,
    unit: u64,
    same_from: Option<usize>,
) -> Result<Vec<(u64, u64)>, EngineError> {
    let size = image.size();
    let mut ranges: Vec<(u64, u64)> = Vec::new();
    for e in image.block_status(GuestOffset(pos), len).await? {
        let own = e.present && e.depth == 0;
        let shared = same_from.is_some_and(|k| e.depth >= k);
        if own || shared {
            continue;
        }
        // A unit is allocated in the image as a whole or not at all, so widening to unit
        // edges never reaches into what the image allocates.
        let s = e.start - e.start % unit;
        let end = (e.start + e.len)
            .div_ceil(unit)
            .saturating_mul(unit)
            .min(size);
        match ranges.last_mut() {
            Some((_, pe)) if s <= *pe => *pe = (*pe).max(end),
            _ => ranges.push((s, end)),
        }
    }
    Ok(ranges)
}

/// Compares the whole image and copies what differs.
async fn copy_differences(
    job: &Rc<Job>,
    same_from: Option<usize>,
    inflight: &mut InFlight,
) -> Result<(), CopyError> {
    let size = job.image.size();
    // Within the chain, qemu-img's requests end where the old backing file does (its
    // allocation query stops there), which decides which runs it writes as zeros: so do ours.
    let split = same_from.map(|_| job.old_end.div_ceil(job.unit).saturating_mul(job.unit));
    let mut issued = 0u64;
    let mut pos = 0u64;
    while pos < size {
        let len = QUERY_BYTES.min(size - pos);
        let ranges = ranges_to_compare(&job.image, pos, len, job.unit, same_from).await?;
        pos += len;
        for (s, end) in ranges {
            job.progress.advance(s.saturating_sub(issued));
            issued = end;
            let mut off = s;
            while off < end {
                let mut n = (REQUEST_BYTES - off % REQUEST_BYTES).min(end - off);
                if let Some(at) = split.filter(|&at| off < at && at < off + n) {
                    n = at - off;
                }
                inflight.spawn(job.clone().rebase_range(off, n)).await?;
                off += n;
            }
        }
    }
    inflight.finish().await?;
    job.progress.advance(size.saturating_sub(issued));
    Ok(())
}

/// Opens the image read-write (`no_backing` for unsafe mode) and refuses raw images.
async fn open_image(
    args: &RebaseArgs,
    t: &Target,
    no_backing: bool,
) -> Result<Image<AnyStorage>, RebaseError> {
    let format = match &args.format {
        Some(f) => engine_run::parse_format(f)?,
        None => engine_run::probe_format(&args.image)?,
    };
    // qemu-img refuses compression before anything else it could refuse.
    if args.compress && format == Format::Raw {
        return Err(RebaseError::CompressUnsupported);
    }
    if format == Format::Raw {
        return Err(RebaseError::RawImage(t.name.clone().unwrap_or_default()));
    }
    let opts = OpenOptions {
        format: Some(format),
        no_backing,
        passwords: crate::common::secrets::passwords_for(&args.image),
        untrusted: crate::common::engine_run::untrusted(),
        ..OpenOptions::default()
    };
    Image::open(&engine_run::opener(), &args.image, &opts)
        .await
        .map_err(|e| RebaseError::Open(e.into()))
}

/// Opens the new backing file read-only, its name taken relative to the image's directory.
async fn open_new_backing(
    args: &RebaseArgs,
    t: &Target,
) -> Result<Option<(Image<AnyStorage>, PathBuf)>, RebaseError> {
    let (Some(name), Some(format)) = (&t.name, t.format) else {
        return Ok(None);
    };
    let path = backing_name::resolve(&args.image, name)?;
    let img = engine_run::open_read_only(&path, Some(format), None, false)
        .await
        .map_err(|source| RebaseError::NewBacking {
            name: name.clone(),
            source,
        })?;
    Ok(Some((img, path)))
}

/// The depth in `image`'s chain of the file `new` is, opened in the same format.
fn same_layer(image: &Image<AnyStorage>, new: &Path, format: Option<Format>) -> Option<usize> {
    let formats = image.chain_formats();
    let chain = image.facts().chain;
    chain.iter().enumerate().skip(1).find_map(|(i, name)| {
        let same = match (std::fs::canonicalize(name), std::fs::canonicalize(new)) {
            (Ok(a), Ok(b)) => a == b,
            _ => false,
        };
        (same && Some(formats[i]) == format).then_some(i)
    })
}

async fn rebase(args: &RebaseArgs) -> Result<(), RebaseError> {
    let t = target(args)?;
    let shown = t.name.clone().unwrap_or_default();
    let rename_err = |e| RebaseError::Rename {
        name: shown.clone(),
        source: Box::new(e),
    };
    if args.unsafe_mode {
        let image = open_image(args, &t, true).await?;
        let format = t.other_format.as_deref().or(t.format.map(Format::name));
        image
            .set_backing_file_format_name(t.name.as_deref(), format)
            .await
            .map_err(rename_err)?;
        return image.close().await.map_err(rename_err);
    }
    let image = open_image(args, &t, false).await?;
    if args.compress && image.compressor().is_err() {
        return Err(RebaseError::CompressUnsupported);
    }
    let new = open_new_backing(args, &t).await?;
    let same_from = new
        .as_ref()
        .and_then(|(_, path)| same_layer(&image, path, t.format));
    let job = Rc::new(Job {
        image: image.clone(),
        new: new.map(|(img, _)| img),
        unit: match args.compress {
            true => image.facts().cluster_size,
            false => image.facts().subcluster_size,
        },
        compress: args.compress,
        old_end: image.chain_sizes().get(1).copied().unwrap_or(0),
        buffers: BufferPool::default(),
        progress: Progress::stderr(image.size(), progress::wanted(args.progress, args.quiet)),
    });
    let mut inflight = InFlight::new(PARALLEL);
    let copied = copy_differences(&job, same_from, &mut inflight).await;
    if copied.is_err() {
        inflight.stop().await;
    }
    copied.map_err(|source| RebaseError::Copy {
        image: args.image.display().to_string(),
        source,
    })?;
    // Flushes every copy before the header names the new file.
    image
        .set_backing_file(t.name.as_deref(), t.format)
        .await
        .map_err(rename_err)?;
    image.close().await.map_err(rename_err)?;
    job.progress.finish();
    Ok(())
}

/// Runs `rebase` and returns the exit status.
pub fn main(args: &RebaseArgs) -> ExitCode {
    let res = engine_run::block_on(rebase(args)).map_err(RebaseError::from);
    engine_run::exit_code(res.and_then(|r| r))
}
