//! Why `convert` fails: its own refusals in qemu-img's words, and the errors of the image
//! layer and of `create` it passes on.

use qcow2::engine::EngineError;

use crate::common::engine_run::OpenError;
use crate::common::options::OptionsError;
use crate::tools::create::CreateError;

/// Why `convert` failed.
#[derive(Debug, thiserror::Error)]
pub enum ConvertError {
    /// One name only: the target, and nothing to copy.
    #[error("Must specify image file name")]
    NoSource,
    /// A bad `-o` list or value.
    #[error("{0}")]
    Options(#[from] OptionsError),
    /// A target QEMU's null device would have to hold (without `-n`).
    #[error("Protocol driver 'null-co' does not support image creation")]
    CreateNull,
    /// `-C` with `-c`.
    #[error("Cannot enable copy offloading when -c is used")]
    CopyOffloadCompress,
    /// `-C` with an explicit `-S`.
    #[error("Cannot enable copy offloading when -S is used")]
    CopyOffloadSparse,
    /// `-C` with `--salvage`.
    #[error("Cannot use copy offloading in salvaging mode")]
    CopyOffloadSalvage,
    /// `--salvage`, which reads on past I/O errors of the source.
    #[error(
        "--salvage is not supported by qcow2-nbd: a source that cannot be read fails the copy"
    )]
    Salvage,
    /// `-c` with a target that cannot hold compressed clusters.
    #[error("Compression not supported for this file format")]
    CompressRaw,
    /// `-c` with an encrypted target.
    #[error("Compression and encryption not supported at the same time")]
    CompressEncrypted,
    /// `-c` with preallocation.
    #[error("Compression and preallocation not supported at the same time")]
    CompressPrealloc,
    /// A bad `-S`.
    #[error("{0}")]
    Sparse(String),
    /// `-o` with `-n`.
    #[error("-o has no effect when skipping image creation")]
    OptionsWithoutCreate,
    /// `--target-is-zero` without `-n`.
    #[error("--target-is-zero requires use of -n flag")]
    TargetIsZeroNeedsN,
    /// `--target-is-zero` with a target backing file.
    #[error("Cannot use --target-is-zero when the destination image has a backing file")]
    TargetIsZeroWithBacking,
    /// A target backing file with several sources.
    #[error("Having a backing file for the target makes no sense when concatenating multiple input images")]
    BackingWithConcatenation,
    /// `-l` with several sources.
    #[error("No support for concatenating multiple snapshot")]
    SnapshotWithConcatenation,
    /// `--bitmaps` with several sources.
    #[error("Copying bitmaps only possible with single source")]
    BitmapsWithConcatenation,
    /// A target backing file without its format.
    #[error("Use of backing file requires explicit backing format")]
    BackingWithoutFormat,
    /// `-B` for a format without backing files.
    #[error("Backing file not supported for file format '{0}'")]
    NoBackingInFormat(&'static str),
    /// `-F` for a format without backing files.
    #[error("Backing file format not supported for file format '{0}'")]
    NoBackingFormatInFormat(&'static str),
    /// `-n` with a target smaller than the sources.
    #[error("output file is smaller than input file")]
    TargetTooSmall,
    /// A `-l` parameter we cannot read.
    #[error("Invalid snapshot parameter '{0}' (expected ID_OR_NAME, snapshot.id=ID or snapshot.name=NAME)")]
    SnapshotParam(String),
    /// Source and target are one file.
    #[error("{0}: the source and the target are the same file")]
    SameFile(String),
    /// A source could not be opened.
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
    #[error("Cannot copy inconsistent bitmap '{0}'\nTry --skip-broken-bitmaps, or use '{prog} bitmap --remove' to delete it", prog = crate::common::prog::name())]
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
