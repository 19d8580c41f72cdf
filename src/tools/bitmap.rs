//! `qcow2-nbd bitmap`: change an image's persistent dirty bitmaps, with `qemu-img bitmap`'s
//! options. The operations run in the order given; the first that fails stops the rest,
//! and what succeeded before it is kept (stored when the image is closed), as qemu-img does.

use std::path::PathBuf;
use std::process::ExitCode;

use clap::parser::ValueSource;
use clap::{ArgAction, ArgMatches, Args};
use qcow2::engine::{EngineError, Format, Image, OpenOptions};
use storage::AnyStorage;

use crate::common::engine_run::{self, OpenError};

/// `qcow2-nbd bitmap` options.
#[derive(Args, Debug)]
#[command(
    about = "Change the persistent dirty bitmaps of a qcow2 image, like `qemu-img bitmap`",
    long_about = "Change the persistent dirty bitmaps of a qcow2 image, like `qemu-img bitmap`.\n\n\
        Give one or more operations; they run in the order given on BITMAP. If one fails, the \
        rest are not run and the ones before it are kept.\n\n\
        A bitmap left \"in use\" by a crash (see `info`) cannot be trusted: it can only be \
        removed."
)]
pub struct BitmapArgs {
    /// Create BITMAP, empty, recording every later write (see -g).
    #[arg(long, action = ArgAction::Append, num_args = 0, default_missing_value = "true")]
    add: Vec<bool>,
    /// Delete BITMAP.
    #[arg(long, action = ArgAction::Append, num_args = 0, default_missing_value = "true")]
    remove: Vec<bool>,
    /// Clear every bit of BITMAP.
    #[arg(long, action = ArgAction::Append, num_args = 0, default_missing_value = "true")]
    clear: Vec<bool>,
    /// Make BITMAP record later writes.
    #[arg(long, action = ArgAction::Append, num_args = 0, default_missing_value = "true")]
    enable: Vec<bool>,
    /// Make BITMAP stop recording writes.
    #[arg(long, action = ArgAction::Append, num_args = 0, default_missing_value = "true")]
    disable: Vec<bool>,
    /// Set in BITMAP every bit set in bitmap SOURCE (of this image, or of -b's).
    #[arg(long, value_name = "SOURCE")]
    merge: Vec<String>,
    /// Granularity of a bitmap made by --add: bytes of disk per bit, a power of two from
    /// 512 to 2G (default: the cluster size, within 4K..64K).
    #[arg(short = 'g', long, value_name = "SIZE", value_parser = parse_size)]
    granularity: Option<u64>,
    /// Image holding --merge's SOURCE bitmap (default: this image).
    #[arg(short = 'b', long = "source-file", value_name = "SRC_FILENAME")]
    source_file: Option<PathBuf>,
    /// Format of -b's image (default: probed).
    #[arg(short = 'F', long = "source-format", value_name = "SRC_FMT")]
    source_format: Option<String>,
    /// Format of FILENAME (only qcow2 holds bitmaps).
    #[arg(short = 'f', long = "format", value_name = "FMT")]
    pub(crate) format: Option<String>,
    /// The image to change.
    pub(crate) filename: PathBuf,
    /// The bitmap to change.
    bitmap: String,
}

fn parse_size(s: &str) -> Result<u64, String> {
    crate::common::size_string::parse_size(s).map_err(|e| e.to_string())
}

/// One operation, in command-line order.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Op {
    Add,
    Remove,
    Clear,
    Enable,
    Disable,
    Merge(String),
}

impl Op {
    /// qemu-img's name of the operation, for messages.
    fn name(&self) -> &'static str {
        match self {
            Op::Add => "add",
            Op::Remove => "remove",
            Op::Clear => "clear",
            Op::Enable => "enable",
            Op::Disable => "disable",
            Op::Merge(_) => "merge",
        }
    }
}

/// The operations in the order the command line gave them (clap keeps each flag's
/// positions, not the order between flags).
fn ops_in_order(args: &BitmapArgs, matches: &ArgMatches) -> Vec<Op> {
    let mut ops: Vec<(usize, Op)> = Vec::new();
    for (id, op) in [
        ("add", Op::Add),
        ("remove", Op::Remove),
        ("clear", Op::Clear),
        ("enable", Op::Enable),
        ("disable", Op::Disable),
    ] {
        // A flag not given still has its default's index.
        if matches.value_source(id) != Some(ValueSource::CommandLine) {
            continue;
        }
        if let Some(at) = matches.indices_of(id) {
            ops.extend(at.map(|i| (i, op.clone())));
        }
    }
    if let Some(at) = matches.indices_of("merge") {
        ops.extend(at.zip(&args.merge).map(|(i, s)| (i, Op::Merge(s.clone()))));
    }
    ops.sort_by_key(|(i, _)| *i);
    ops.into_iter().map(|(_, op)| op).collect()
}

/// Why the command stopped.
#[derive(Debug, thiserror::Error)]
enum BitmapCmdError {
    #[error("Need at least one of --add, --remove, --clear, --enable, --disable, or --merge")]
    NoOperation,
    #[error("granularity only supported with --add")]
    GranularityWithoutAdd,
    #[error("Merge bitmap source file only supported with --merge")]
    SourceWithoutMerge,
    #[error("-F only supported with -b")]
    SourceFormatWithoutSource,
    #[error("'{0}' images have no persistent bitmaps (only qcow2 has)")]
    NotQcow2(&'static str),
    #[error(transparent)]
    Open(#[from] OpenError),
    #[error("Operation {op} on bitmap {bitmap} failed: {why}")]
    Operation {
        op: &'static str,
        bitmap: String,
        why: String,
    },
    #[error("storing the bitmaps: {0}")]
    Close(EngineError),
    #[error("{0}")]
    Runtime(std::io::Error),
}

/// Runs `qcow2-nbd bitmap`.
pub fn main(args: &BitmapArgs, matches: &ArgMatches) -> ExitCode {
    engine_run::exit_code(run(args, ops_in_order(args, matches)))
}

fn run(args: &BitmapArgs, ops: Vec<Op>) -> Result<(), BitmapCmdError> {
    if ops.is_empty() {
        return Err(BitmapCmdError::NoOperation);
    }
    if args.granularity.is_some() && !ops.contains(&Op::Add) {
        return Err(BitmapCmdError::GranularityWithoutAdd);
    }
    let merging = ops.iter().any(|o| matches!(o, Op::Merge(_)));
    if args.source_file.is_some() && !merging {
        return Err(BitmapCmdError::SourceWithoutMerge);
    }
    if args.source_format.is_some() && args.source_file.is_none() {
        return Err(BitmapCmdError::SourceFormatWithoutSource);
    }
    if let Some(f) = &args.format {
        match engine_run::parse_format(f)? {
            Format::Qcow2 => {}
            other => return Err(BitmapCmdError::NotQcow2(engine_run::format_name(other))),
        }
    }
    engine_run::block_on(apply(args, ops)).map_err(BitmapCmdError::Runtime)?
}

async fn apply(args: &BitmapArgs, ops: Vec<Op>) -> Result<(), BitmapCmdError> {
    // Bitmaps are the image's own: like qemu-img, neither this image nor a merge's source
    // opens its backing chain (the source may be backed by this very image).
    let opts = OpenOptions {
        format: Some(Format::Qcow2),
        no_backing: true,
        untrusted: crate::common::engine_run::untrusted(),
        ..OpenOptions::default()
    };
    let img: Image<AnyStorage> = Image::open(&engine_run::opener(), &args.filename, &opts)
        .await
        .map_err(OpenError::from)?;
    let mut outcome = Ok(());
    for op in ops {
        if let Err(why) = apply_one(&img, args, &op).await {
            outcome = Err(BitmapCmdError::Operation {
                op: op.name(),
                bitmap: args.bitmap.clone(),
                why,
            });
            break;
        }
    }
    // What succeeded is kept, as qemu-img keeps it.
    let closed = img.close().await.map_err(BitmapCmdError::Close);
    outcome.and(closed)
}

/// Runs one operation; the error is the reason alone, as qemu-img words it.
async fn apply_one(img: &Image<AnyStorage>, args: &BitmapArgs, op: &Op) -> Result<(), String> {
    let name = &args.bitmap;
    let res = match op {
        Op::Add => img.add_bitmap(name, args.granularity, true),
        Op::Remove => img.remove_bitmap(name),
        Op::Clear => img.clear_bitmap(name),
        Op::Enable => img.set_bitmap_enabled(name, true),
        Op::Disable => img.set_bitmap_enabled(name, false),
        Op::Merge(source) => match merge_source(img, args, source).await {
            Ok((data, disk)) => img.merge_bitmap(name, &data, disk),
            Err(e) => return Err(e),
        },
    };
    res.map_err(|e| reason(&e))
}

/// The source bitmap of a merge and the size of the disk it covers.
async fn merge_source(
    img: &Image<AnyStorage>,
    args: &BitmapArgs,
    source: &str,
) -> Result<(qcow2::format::BitmapData, u64), String> {
    let Some(file) = &args.source_file else {
        let data = img.bitmap_data(source).await.map_err(|e| reason(&e))?;
        return Ok((data, img.size()));
    };
    let format = match &args.source_format {
        Some(f) => Some(engine_run::parse_format(f).map_err(|e| e.to_string())?),
        None => None,
    };
    let format = match format {
        Some(f) => f,
        None => engine_run::probe_format(file).map_err(|e| e.to_string())?,
    };
    let opts = OpenOptions {
        read_only: true,
        format: Some(format),
        no_backing: true,
        passwords: crate::common::secrets::passwords_for(file),
        ..OpenOptions::default()
    };
    let src: Image<AnyStorage> = Image::open(&engine_run::opener(), file, &opts)
        .await
        .map_err(|e| OpenError::from(e).to_string())?;
    let data = src.bitmap_data(source).await.map_err(|e| reason(&e))?;
    Ok((data, src.size()))
}

/// An engine error as the reason an operation failed: a bitmap error in QEMU's words
/// alone, anything else in full.
fn reason(e: &EngineError) -> String {
    match e {
        EngineError::Bitmap { source, .. } => source.to_string(),
        other => other.to_string(),
    }
}
