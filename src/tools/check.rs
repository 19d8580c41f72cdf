//! `qcow2-nbd check [-f FMT] [-r leaks|all] [--output human|json] IMG`: `qemu-img check` for qcow2,
//! with its output (findings on stderr, the summary on stdout) and its exit codes: 0 clean,
//! 1 check not completed, 2 corruptions, 3 leaks only, 63 not a format with checks.

use std::io::Write;
use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Args, ValueEnum};
use qcow2::check::{self, CheckError, Repair};
use qcow2::format::header::QCOW2_MAGIC;
use storage::opener::name::NameKind;

use crate::common::image_bytes::ImageBytes;

/// Output layout.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum CheckOutput {
    /// qemu-img's summary lines.
    Human,
    /// qemu-img's JSON object.
    Json,
}

/// Arguments of `check`.
#[derive(Args, Debug)]
pub struct CheckArgs {
    /// Repair leaks only, or all errors (the image is opened read-write).
    #[arg(short = 'r', long = "repair", value_name = "leaks|all", value_parser = parse_repair)]
    pub repair: Option<Repair>,
    /// Output layout.
    #[arg(long, value_enum, default_value_t = CheckOutput::Human)]
    pub output: CheckOutput,
    /// The image's format: qcow2 is checked; raw (which has nothing to check) exits 63, as
    /// qemu-img does. Probed when not given.
    #[arg(short = 'f', long = "format")]
    pub format: Option<String>,
    #[command(flatten)]
    pub share: crate::common::engine_run::ForceShare,
    /// The qcow2 image file.
    pub image: PathBuf,
}

fn parse_repair(s: &str) -> Result<Repair, String> {
    s.parse()
}

/// Why `check` could not report.
#[derive(Debug, thiserror::Error)]
enum CheckCliError {
    /// The file could not be opened or is not an image QEMU would open.
    #[error("Could not open '{path}': {source}")]
    Open { path: String, source: CheckError },
    /// The file itself could not be opened (qemu-img names it twice: the image, the file).
    #[error("Could not open '{path}': Could not open '{path}': {}", crate::common::engine_run::plain_io(.source))]
    OpenFile {
        path: String,
        source: std::io::Error,
    },
    /// A LUKS volume that does not open (no secret, a wrong one, a bad header).
    #[error(transparent)]
    OpenVolume(crate::common::engine_run::OpenError),
    /// `-f` names a format we do not have (qemu-img's words for a driver it lacks).
    #[error("Could not open '{path}': Unknown driver '{format}'")]
    UnknownDriver { path: String, format: String },
    /// The image needs incompatible features we do not implement (qemu-img's words).
    #[error("Could not open '{path}': Unsupported qcow2 feature(s): {features}")]
    Unsupported { path: String, features: String },
    /// `-f qcow2` on a file that is not qcow2.
    #[error("Could not open '{path}': Image is not in qcow2 format")]
    NotQcow2 { path: String },
    /// The header fails a check QEMU makes the same way (QEMU's words).
    #[error("Could not open '{path}': {message}")]
    Refused {
        /// The image.
        path: String,
        /// QEMU's words.
        message: String,
    },
    /// An untrusted image declares more than its caps allow (`--untrusted`).
    #[error("Could not open '{path}': {source}")]
    Declared {
        /// The image.
        path: String,
        /// The size past its cap.
        source: qcow2::declared::Exceeded,
    },
    /// `-U` asks to share writes, which a repair cannot allow (qemu-img's words).
    #[error("Could not open '{path}': force-share=on can only be used with read-only images")]
    ForceShareRepair { path: String },
    /// The check stopped before it could report.
    #[error("Check failed: {0}")]
    Failed(CheckError),
    /// The check ran but had internal errors.
    #[error("Check failed")]
    Incomplete,
    /// Writing the report failed.
    #[error("writing the report: {0}")]
    Output(#[from] std::io::Error),
}

/// `--untrusted`: the sizes the image declares against their caps, before the checker
/// walks them. Metadata that does not load is judged by its header alone (the checker then
/// reports the damage); a file that does not open or is not qcow2 is left to the checker.
fn check_declared(
    image: &std::path::Path,
    caps: &qcow2::declared::Caps,
) -> Result<(), qcow2::declared::Exceeded> {
    use qcow2::declared::{check, Declared};
    // Shared with writers: the checker's own open that follows takes the locks it needs.
    let Ok(file) = ImageBytes::open(image, true, None) else {
        return Ok(());
    };
    if let Ok(meta) = qcow2::inspect::inspect(&file) {
        return check(&Declared::of(&meta), caps);
    }
    let Ok((header, file_len)) = qcow2::inspect::read_header(&file) else {
        return Ok(());
    };
    let Ok(geom) = header.geometry() else {
        return Ok(());
    };
    let declared = Declared {
        header: &header,
        geom: &geom,
        file_len,
        snapshots: &[],
        bitmaps: &[],
        bitmap_count: header.bitmaps().map_or(0, |b| u64::from(b.nb_bitmaps)),
        kdf_iterations: None,
    };
    check(&declared, caps)
}

/// Runs `check` and returns qemu-img's exit code for it.
pub fn main(args: &CheckArgs) -> ExitCode {
    match run(args) {
        Ok(code) => ExitCode::from(code),
        Err(e) => {
            eprintln!("{}: {e}", crate::common::prog::name());
            ExitCode::from(1)
        }
    }
}

/// Whether the image is a LUKS volume (named so by `-f`, or probed).
fn is_luks(args: &CheckArgs) -> bool {
    match args.format.as_deref() {
        Some(f) => f == "luks",
        None => matches!(
            crate::common::engine_run::probe_format(&args.image),
            Ok(qcow2::engine::Format::Luks)
        ),
    }
}

/// QEMU's `luks` driver has no checks, but the volume must open (with its secret) before
/// qemu-img learns that.
fn check_luks(args: &CheckArgs) -> Result<(), CheckCliError> {
    let opened = crate::common::engine_run::block_on(crate::common::engine_run::open_read_only(
        &args.image,
        Some(qcow2::engine::Format::Luks),
        None,
        args.share.force_share,
    ))?;
    drop(opened.map_err(CheckCliError::OpenVolume)?);
    Ok(())
}

fn run(args: &CheckArgs) -> Result<u8, CheckCliError> {
    let repair = args.repair.unwrap_or_default();
    let path = args.image.display().to_string();
    if args.share.force_share && args.repair.is_some() {
        return Err(CheckCliError::ForceShareRepair { path });
    }
    let not_checkable = || {
        eprintln!(
            "{}: This image format does not support checks",
            crate::common::prog::name()
        );
        Ok(63)
    };
    if storage::opener::name::kind(&args.image) == NameKind::Nbd {
        // An export opens like a file: a qcow2 image in it is checked as in a file (an image
        // written into an OVA's tar member through qemu-nbd --offset, say); anything else
        // has no checks, as QEMU's raw driver has none.
        let export = ImageBytes::open(&args.image, true, None).map_err(|source| {
            CheckCliError::OpenFile {
                path: path.clone(),
                source,
            }
        })?;
        let magic = export.head(4).unwrap_or_default();
        drop(export);
        if magic != QCOW2_MAGIC.to_be_bytes() || args.format.as_deref() == Some("raw") {
            return not_checkable();
        }
    }
    if is_luks(args) {
        return check_luks(args).map(|()| {
            eprintln!(
                "{}: This image format does not support checks",
                crate::common::prog::name()
            );
            63
        });
    }
    let qcow2_given = match args.format.as_deref() {
        None => false,
        Some("qcow2") => true,
        Some("raw") => {
            // The file must open all the same, as QEMU opens it before asking the driver.
            ImageBytes::open(&args.image, args.share.force_share, None).map_err(|source| {
                CheckCliError::OpenFile {
                    path: path.clone(),
                    source,
                }
            })?;
            return not_checkable();
        }
        Some(other) => {
            return Err(CheckCliError::UnknownDriver {
                path,
                format: other.to_string(),
            })
        }
    };
    let mut log = |f: check::Finding| match f.kind {
        check::FindingKind::Reported => eprintln!("{}: {}", crate::common::prog::name(), f.message),
        _ => eprintln!("{}", f.message),
    };
    if let Some(u) = crate::common::engine_run::untrusted() {
        check_declared(&args.image, &u.caps).map_err(|source| CheckCliError::Declared {
            path: path.clone(),
            source,
        })?;
    }
    let locking = crate::common::engine_run::locking();
    let outcome = match check::check_path(
        &args.image,
        repair,
        locking,
        args.share.force_share,
        &mut log,
    ) {
        Ok(o) => o,
        Err(CheckError::NotQcow2 { .. }) if qcow2_given => {
            return Err(CheckCliError::NotQcow2 { path });
        }
        Err(CheckError::NotQcow2 { .. }) => return not_checkable(),
        Err(CheckError::Io {
            what: "opening the image",
            source,
            ..
        }) => return Err(CheckCliError::OpenFile { path, source }),
        Err(CheckError::Open { source })
            if crate::common::engine_run::unsupported_features(&source).is_some() =>
        {
            let features =
                crate::common::engine_run::unsupported_features(&source).unwrap_or_default();
            return Err(CheckCliError::Unsupported { path, features });
        }
        Err(CheckError::Open { source }) if source.qemu_open_message().is_some() => {
            let message = source.qemu_open_message().unwrap_or_default();
            // Named as the command line gave it (an option list, a `json:` name), as QEMU does.
            let path = crate::common::image_name::given_name(&args.image);
            return Err(CheckCliError::Refused { path, message });
        }
        Err(e @ CheckError::Open { .. }) => {
            return Err(CheckCliError::Open { path, source: e });
        }
        Err(e) => return Err(CheckCliError::Failed(e)),
    };
    let text = match args.output {
        CheckOutput::Human => outcome.to_human(),
        CheckOutput::Json => outcome.report.to_json(&path),
    };
    let mut out = std::io::stdout().lock();
    out.write_all(text.as_bytes())?;
    out.flush()?;
    match outcome.report.exit_code() {
        1 => Err(CheckCliError::Incomplete),
        code => Ok(code),
    }
}
