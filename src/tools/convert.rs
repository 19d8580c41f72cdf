//! `qcow2-nbd convert`: copy what a guest sees of one or more images (each with its whole
//! backing chain, or an internal snapshot; several are concatenated) into a new or existing
//! raw or qcow2 image, optionally compressed or with a backing file of its own.
//!
//! What is copied follows qemu-img (see `plan`): data ranges are read, and of those, runs of
//! zeros are not written (`-S`, see `sparse`) because a new target without a backing file
//! already reads zeros there; an existing target (`-n`) or one with a backing file gets
//! them as zero writes. Data goes in large requests, several in flight, written in guest
//! order so that a qcow2 target's clusters follow guest order as qemu-img's do.

mod copy;
mod error;
mod plan;
mod sparse;

use copy::{copy_all, work_total, Job, REQUEST_BYTES};
pub use error::ConvertError;

use qcow2::format::GuestOffset;
use std::cell::Cell;
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::rc::Rc;

use clap::Args;
use qcow2::engine::{BitmapInfo, Format, Image, OpenOptions};
use storage::AnyStorage;
use tokio::sync::Notify;

use crate::common::cache_mode::CacheMode;
use crate::common::engine_run::{self, OpenError};
use crate::common::options::{self, Parsed};
use crate::tools::create::{self, option_table, CreateError};
use crate::tools::inflight::BufferPool;
use crate::tools::progress::Progress;
use crate::tools::same_file;
use plan::{Settings, Source};
use sparse::SECTOR;

/// qemu-img's default sparse-detection size (`-S 4k`).
const DEFAULT_SPARSE: u64 = 4096;
/// Largest `-S` qemu-img takes.
const MAX_SPARSE: u64 = 16 << 20;

/// Arguments of `convert`.
#[derive(Args, Debug)]
pub struct ConvertArgs {
    /// Format of the sources (qcow2 or raw); probed when not given.
    #[arg(short = 'f', long = "source-format")]
    pub source_format: Option<String>,
    #[command(flatten)]
    pub share: crate::common::engine_run::ForceShare,
    /// Format of the target: raw (the default, as in qemu-img) or qcow2.
    #[arg(short = 'O', long = "target-format", default_value = "raw")]
    pub target_format: String,
    /// Target format options, as for `create` (`-o help` lists them); may be repeated.
    #[arg(short = 'o', long = "target-options")]
    pub options: Vec<String>,
    /// Host cache mode of the target: none, writeback, writethrough, directsync or unsafe
    /// (none and directsync write with O_DIRECT; writethrough and directsync make every
    /// write durable before the next). The default, as in qemu-img, is unsafe: nothing is
    /// flushed, so the copy runs at page-cache speed, and until the system writes the page
    /// cache out a host crash may lose or corrupt the target. Every other mode flushes the
    /// target before convert reports success.
    #[arg(short = 't', long = "cache", value_enum, default_value = "unsafe")]
    pub cache: CacheMode,
    /// Compress every cluster of the (qcow2) target.
    #[arg(short = 'c', long = "compress")]
    pub compress: bool,
    /// Copy an internal snapshot: its id or name, or `snapshot.id=ID` / `snapshot.name=NAME`.
    #[arg(short = 'l', long = "source-snapshot")]
    pub snapshot: Option<String>,
    /// Do not create the target: write into the existing image TARGET (opened as -O says),
    /// which must be at least as large as the sources; ranges that read as zeros are
    /// zeroed in it.
    #[arg(short = 'n', long = "no-create")]
    pub no_create: bool,
    /// With -n: TARGET is an option string (`driver=luks,key-secret=ID,file.filename=F`),
    /// as `--image-opts` makes the sources.
    #[arg(long = "target-image-opts")]
    pub target_image_opts: bool,
    /// Give the new target this backing file (stored as given; -F names its format): only
    /// what the source's own top layer holds is copied, the rest is left to the backing
    /// file, which should read as the source's backing chain does.
    #[arg(short = 'B', long = "backing")]
    pub backing: Option<String>,
    /// Format of the -B backing file (required with -B, as in qemu-img 10).
    #[arg(short = 'F', long = "backing-format")]
    pub backing_format: Option<String>,
    /// Sparse detection: runs of zeros at least SIZE long (a multiple of 512, up to 16M;
    /// default 4k) are not written as data; 0 writes everything, fully allocating the target.
    #[arg(
        short = 'S',
        long = "sparse-size",
        value_name = "SIZE",
        allow_hyphen_values = true
    )]
    pub sparse: Option<String>,
    /// With -n: the existing target already reads as zeros, so zero ranges are skipped.
    #[arg(long = "target-is-zero")]
    pub target_is_zero: bool,
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
    /// Copy offloading (qemu-img's -C): accepted; the data is copied by reads and writes,
    /// which is what qemu-img falls back to where the storage cannot offload.
    #[arg(short = 'C')]
    pub copy_offload: bool,
    /// Go on past read errors of the source (qemu-img's --salvage): refused here.
    #[arg(long)]
    pub salvage: bool,
    /// Copy requests in flight at once (qemu-img's -m).
    #[arg(short = 'm', long = "parallel", default_value_t = 8,
          value_parser = clap::value_parser!(u16).range(1..=64))]
    pub parallel: u16,
    /// The images to copy (several are concatenated, in order), then the image to write
    /// (replaced if it exists, unless -n).
    // Options may come between the names (`convert SRC -O qcow2 DST`), so the names are one
    // list that may take several occurrences; fewer than two is refused in QEMU's words.
    #[arg(value_name = "SOURCE... TARGET")]
    pub files: Vec<PathBuf>,
}

impl ConvertArgs {
    /// The source images, in order.
    fn sources(&self) -> &[PathBuf] {
        &self.files[..self.files.len().saturating_sub(1)]
    }

    /// The image written.
    fn target(&self) -> &Path {
        self.files.last().map_or(Path::new(""), PathBuf::as_path)
    }
}

/// Reads `-S`: bytes, a multiple of 512 up to 16 MiB (0 turns sparse detection off).
pub fn sparse_size(text: Option<&str>) -> Result<u64, ConvertError> {
    let Some(text) = text else {
        return Ok(DEFAULT_SPARSE);
    };
    let v = crate::common::size_string::cvtnum("buffer size for sparse output", text)
        .map_err(ConvertError::Sparse)?;
    if v % SECTOR != 0 || v > MAX_SPARSE {
        return Err(ConvertError::Sparse(format!(
            "Invalid buffer size for sparse output specified. Valid sizes are multiples of \
             {SECTOR} up to {MAX_SPARSE}. Select 0 to disable sparse detection (fully \
             allocates output)."
        )));
    }
    Ok(v)
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

/// The target's backing file and its format, from `-B`/`-F` or `-o backing_file/backing_fmt`
/// (`-B` and `-F` win, as they are applied last in qemu-img).
fn target_backing(args: &ConvertArgs, parsed: &Parsed) -> (Option<String>, Option<String>) {
    let name = args
        .backing
        .clone()
        .or_else(|| parsed.str("backing_file").map(str::to_string));
    let fmt = args
        .backing_format
        .clone()
        .or_else(|| parsed.str("backing_fmt").map(str::to_string));
    (name, fmt)
}

/// The flags qemu-img refuses on their own or together, checked in its order so that the
/// same mistakes get the same message.
fn check_flags(args: &ConvertArgs) -> Result<(), ConvertError> {
    if args.copy_offload {
        if args.compress {
            return Err(ConvertError::CopyOffloadCompress);
        }
        if args.sparse.is_some() {
            return Err(ConvertError::CopyOffloadSparse);
        }
        if args.salvage {
            return Err(ConvertError::CopyOffloadSalvage);
        }
    }
    if args.salvage {
        return Err(ConvertError::Salvage);
    }
    if args.skip_broken_bitmaps && !args.bitmaps {
        return Err(ConvertError::SkipWithoutBitmaps);
    }
    if args.no_create && !args.options.is_empty() {
        return Err(ConvertError::OptionsWithoutCreate);
    }
    if args.target_is_zero && !args.no_create {
        return Err(ConvertError::TargetIsZeroNeedsN);
    }
    Ok(())
}

/// `-c` against a target that cannot take compressed clusters.
fn check_compress(
    args: &ConvertArgs,
    target_format: Format,
    parsed: &Parsed,
) -> Result<(), ConvertError> {
    if target_format == Format::Raw && !args.no_create {
        return Err(ConvertError::CompressRaw);
    }
    if parsed.str("preallocation").is_some_and(|p| p != "off") {
        return Err(ConvertError::CompressPrealloc);
    }
    if parsed.has("encrypt.format") || parsed.bool("encryption") == Some(true) {
        // Compressed clusters are stored in plain text.
        return Err(ConvertError::CompressEncrypted);
    }
    Ok(())
}

/// `-n`: the existing target must take what the copy writes.
fn check_existing_target(
    args: &ConvertArgs,
    dst: &Image<AnyStorage>,
    target_format: Format,
    total: u64,
) -> Result<(), ConvertError> {
    if args.bitmaps && !dst.supports_persistent_bitmaps() {
        return Err(ConvertError::TargetWithoutBitmaps(engine_run::format_name(
            target_format,
        )));
    }
    if args.compress && !dst.facts().qcow2 {
        return Err(ConvertError::CompressRaw);
    }
    if dst.size() < total {
        return Err(ConvertError::TargetTooSmall);
    }
    Ok(())
}

async fn convert(args: &ConvertArgs) -> Result<(), ConvertError> {
    // qemu-img's order of checks, so that the same mistakes get the same message.
    let min_sparse = sparse_size(args.sparse.as_deref())?;
    check_flags(args)?;
    let list = options::join_lists(&args.options)?;
    if list.as_deref().is_some_and(options::wants_help) {
        let format = engine_run::creation_format(&args.target_format)?;
        // A target is named only when a source is named before it.
        print!("{}", create::creation_help(format, args.files.len() >= 2));
        return Ok(());
    }
    if args.files.len() < 2 {
        return Err(ConvertError::NoSource);
    }
    // A format QEMU only reads is refused as QEMU refuses it as a target. QEMU opens the
    // sources first, but we cannot open those formats, so the target is judged first.
    let target_format = match args.no_create {
        true => engine_run::parse_format(&args.target_format)?,
        false => engine_run::creation_format(&args.target_format)?,
    };
    let parsed = target_options(target_format, list.as_deref())?;
    let (mut sources, size) = open_sources(args).await?;
    let (backing, backing_fmt) = match args.no_create {
        true => (args.backing.clone(), None),
        false => target_backing(args, &parsed),
    };
    if target_format == Format::Raw && !args.no_create {
        if args.backing.is_some() {
            return Err(ConvertError::NoBackingInFormat("raw"));
        }
        if args.backing_format.is_some() {
            return Err(ConvertError::NoBackingFormatInFormat("raw"));
        }
    }
    if args.target_is_zero && backing.is_some() {
        return Err(ConvertError::TargetIsZeroWithBacking);
    }
    if sources.len() > 1 && backing.is_some() {
        return Err(ConvertError::BackingWithConcatenation);
    }
    let backing = match (&backing, &backing_fmt, args.no_create) {
        (Some(name), Some(fmt), false) => Some((name.clone(), engine_run::parse_format(fmt)?)),
        (Some(_), None, false) => return Err(ConvertError::BackingWithoutFormat),
        _ => None,
    };
    if args.compress {
        check_compress(args, target_format, &parsed)?;
    }
    if args.bitmaps && sources.len() > 1 {
        return Err(ConvertError::BitmapsWithConcatenation);
    }
    let src0 = sources[0].image.clone();
    let bitmaps = bitmaps_to_copy(args, &src0, target_format, &parsed).await?;
    let total = plan::total_span(&sources);
    let dst = match args.no_create {
        true => open_target(args.target(), target_format, min_sparse, args.cache).await?,
        false => create_target(args, target_format, &parsed, total, backing, min_sparse).await?,
    };
    if args.no_create {
        check_existing_target(args, &dst, target_format, total)?;
    }
    let target_has_backing =
        args.backing.is_some() || (!args.no_create && parsed.has("backing_file"));
    let cluster = dst.facts().cluster_size;
    let settings = Settings {
        target_backing: target_has_backing,
        target_backing_len: match args.no_create {
            false => dst.chain_sizes().get(1).copied(),
            true => None,
        },
        compress_cluster: args.compress.then_some(cluster),
        request: if args.compress {
            cluster
        } else {
            REQUEST_BYTES
        },
        full_allocation: min_sparse == 0,
    };
    // A source shorter than its span (the size -l keeps) reads zeros past its end.
    for s in &mut sources {
        s.len = s.len.min(s.image.size());
    }
    let progress = Progress::for_tool(
        work_total(&sources, settings).await?,
        args.progress,
        args.quiet,
    );
    let job = Rc::new(Job {
        sources,
        dst: dst.clone(),
        cluster,
        qcow2_target: dst.facts().qcow2,
        min_sparse,
        zero_init: args.target_is_zero
            || (!args.no_create && min_sparse != 0 && !target_has_backing),
        zero_flags: dst.supports_persistent_bitmaps(),
        compress: args.compress.then(|| dst.compressor()).transpose()?,
        target: args.target().display().to_string(),
        ordered: dst.facts().qcow2 && !args.unordered,
        writethrough: args.cache.writethrough(),
        turn: Cell::new(0),
        turn_changed: Notify::new(),
        buffers: BufferPool::default(),
    });
    copy_all(job, settings, usize::from(args.parallel), &progress).await?;
    // After the copy, whose writes would otherwise mark them.
    copy_bitmaps(&src0, &dst, &bitmaps, size).await?;
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
        return Ok(Vec::new());
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
            crate::common::prog::name(),
            b.name
        );
    }
    let v2 = parsed
        .str("compat")
        .is_some_and(|c| c == "0.10" || c == "v2");
    if !args.no_create && (target == Format::Raw || v2) {
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

/// Parses the target's `-o` list (its `size` is the sources' total, whatever it says).
fn target_options(format: Format, list: Option<&str>) -> Result<Parsed, ConvertError> {
    Ok(match list {
        Some(l) => Parsed::parse(l, &option_table(format), &[])?,
        None => Parsed::default(),
    })
}

/// Opens the sources (the first at the snapshot `-l` names, if any), each placed after the
/// ones before it; returns them with the size of the first as the target sees it.
async fn open_sources(args: &ConvertArgs) -> Result<(Vec<Source>, u64), ConvertError> {
    let snapshot = args.snapshot.as_deref().map(snapshot_param).transpose()?;
    let source_format = args
        .source_format
        .as_deref()
        .map(engine_run::parse_format)
        .transpose()?;
    for path in args.sources() {
        if same_file(path, args.target()) {
            return Err(ConvertError::SameFile(args.target().display().to_string()));
        }
    }
    let mut out = Vec::new();
    for path in args.sources() {
        let image =
            engine_run::open_read_only(path, source_format, None, args.share.force_share).await?;
        let size = image.size();
        out.push(Source::new(image, size));
    }
    if let Some(snap) = snapshot {
        if out.len() > 1 {
            return Err(ConvertError::SnapshotWithConcatenation);
        }
        // qemu-img convert -l swaps in the snapshot's L1 table but keeps the active disk's
        // size: the copy is that long, reading zeros past the snapshot's own end (or
        // dropping what the snapshot has past the active end).
        let image = engine_run::open_read_only(
            &args.sources()[0],
            source_format,
            Some(snap),
            args.share.force_share,
        )
        .await?;
        let active = out[0].span;
        let mut s = Source::new(image, active);
        s.span = active;
        out[0] = s;
    }
    let size = out[0].span;
    Ok((out, size))
}

/// Opens an existing target (`-n`) for writing, with its backing chain.
async fn open_target(
    path: &Path,
    format: Format,
    min_sparse: u64,
    cache: CacheMode,
) -> Result<Image<AnyStorage>, ConvertError> {
    open_target_with(
        path,
        format,
        min_sparse,
        cache,
        crate::common::secrets::passwords_for(path),
    )
    .await
}

/// Opens the target in `cache` mode with the passwords of its encryption, if any.
async fn open_target_with(
    path: &Path,
    format: Format,
    min_sparse: u64,
    cache: CacheMode,
    passwords: qcow2::crypto::Passwords,
) -> Result<Image<AnyStorage>, ConvertError> {
    Ok(Image::open(
        &engine_run::opener(),
        path,
        &OpenOptions {
            format: Some(format),
            discard_passthrough: min_sparse != 0,
            passwords,
            direct: cache.direct(),
            ignore_flush: cache.ignore_flush(),
            ..OpenOptions::default()
        },
    )
    .await
    .map_err(OpenError::from)?)
}

/// Creates the target image of `size` bytes (with `backing`, if any) and opens it for the
/// copy, with its backing file.
async fn create_target(
    args: &ConvertArgs,
    format: Format,
    parsed: &Parsed,
    size: u64,
    backing: Option<(String, Format)>,
    min_sparse: u64,
) -> Result<Image<AnyStorage>, ConvertError> {
    let path = args.target();
    if storage::opener::name::kind(path) == storage::opener::name::NameKind::Null {
        return Err(ConvertError::CreateNull);
    }
    let target = path.display().to_string();
    let invalid = CreateError::invalid(&target);
    let mut passwords = qcow2::crypto::Passwords::default();
    let mut noise = false;
    match format {
        Format::Luks => {
            let prealloc =
                create::raw_preallocation(parsed.str("preallocation")).map_err(&invalid)?;
            let attrs = create::FileAttrs::from_parsed(parsed).map_err(&invalid)?;
            let (password, opts) = create::luks_volume_settings(parsed).map_err(&invalid)?;
            create::create_luks(path, size, &password, &opts, prealloc, attrs)
                .await
                .map_err(|source| CreateError::Io {
                    image: target.clone(),
                    what: "creating the LUKS volume",
                    source,
                })?;
            // Unwritten sectors of a new volume read as noise: the copy writes zeros too.
            noise = true;
            passwords.set(0, password);
        }
        Format::Raw => {
            let prealloc =
                create::raw_preallocation(parsed.str("preallocation")).map_err(&invalid)?;
            let attrs = create::FileAttrs::from_parsed(parsed).map_err(&invalid)?;
            create::create_raw(path, size, prealloc, attrs)
                .await
                .map_err(|source| CreateError::Io {
                    image: target.clone(),
                    what: "creating the raw image",
                    source,
                })?;
        }
        Format::Qcow2 => {
            let mut plan = create::qcow2_plan(parsed, backing.is_some()).map_err(&invalid)?;
            plan.opts.size = size;
            plan.opts.backing = backing;
            create::check_qcow2_size(&plan.opts).map_err(&invalid)?;
            let attrs = create::FileAttrs::from_parsed(parsed).map_err(&invalid)?;
            create::create_qcow2(path, &plan.opts, attrs)
                .await
                .map_err(|source| CreateError::Engine {
                    image: target.clone(),
                    source: Box::new(source),
                })?;
            // Preallocated clusters of an encrypted image read as noise, not zeros (QEMU
            // calls such a target not zero-initialized): they are zeroed before the copy,
            // which then skips zeros as usual.
            noise = plan.opts.encryption.is_some()
                && plan.opts.preallocation != qcow2::engine::Preallocation::Off;
            passwords = plan.opts.passwords();
        }
    }
    if passwords.is_empty() {
        passwords = crate::common::secrets::passwords_for(path);
    }
    let dst = open_target_with(path, format, min_sparse, args.cache, passwords).await?;
    if noise {
        dst.write_zeroes(GuestOffset(0), dst.size(), false, false)
            .await
            .map_err(|source| CreateError::Engine {
                image: target.clone(),
                source: Box::new(source),
            })?;
    }
    Ok(dst)
}

/// Runs `convert` and returns the exit status.
pub fn main(args: &ConvertArgs) -> ExitCode {
    let res = engine_run::block_on(convert(args)).map_err(ConvertError::from);
    engine_run::exit_code(res.and_then(|r| r))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::common::zeroes::is_zero;

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
