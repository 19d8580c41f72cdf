//! `qcow2-nbd info`: print what a qcow2 image contains, in qemu-img's human or JSON layout.

use std::io::{self, Write};
use std::path::{Path, PathBuf};

use clap::{Args, ValueEnum};
use qcow2::format::header::QCOW2_MAGIC;
use qcow2::inspect::{self, ByteSource, ImageInfo, InspectError};

use qcow2::engine::backing_name::{self as backing_chain, BackingError, ChainGuard, Reference};
use storage::opener::name::NameKind;
use storage::{AnyStorage, Storage};

use crate::common::image_bytes::ImageBytes;

mod untrusted;

/// Output layout.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum OutputFormat {
    /// Lines like `qemu-img info`.
    Human,
    /// JSON with `qemu-img info --output=json`'s key names.
    Json,
}

/// Arguments of `info`.
#[derive(Args, Debug)]
pub struct InfoArgs {
    /// The image file (qcow2 or raw).
    pub image: PathBuf,
    /// The image's format (qcow2 or raw); probed when not given (the qcow2 magic, else raw).
    #[arg(short = 'f', long = "format")]
    pub format: Option<String>,
    /// Output layout.
    #[arg(long, value_enum, default_value_t = OutputFormat::Human)]
    pub output: OutputFormat,
    /// Also show every backing file, following the chain (never `json:` or protocol names).
    #[arg(long)]
    pub backing_chain: bool,
    #[command(flatten)]
    pub share: crate::common::engine_run::ForceShare,
}

/// Why `info` failed.
#[derive(Debug, thiserror::Error)]
pub enum InfoError {
    /// The file could not be opened or examined.
    #[error("{path}: {source}")]
    Open {
        /// The file.
        path: String,
        /// The error.
        source: io::Error,
    },
    /// The file itself could not be opened (qemu-img names it twice: the image, the file).
    #[error("Could not open '{path}': Could not open '{path}': {}", crate::common::engine_run::plain_io(.source))]
    OpenFile {
        /// The file.
        path: String,
        /// The error.
        source: io::Error,
    },
    /// An NBD export could not be reached or negotiated (qemu-img's words).
    #[error("Could not open '{path}': {source}")]
    OpenNbd {
        /// The NBD name.
        path: String,
        /// The error.
        source: io::Error,
    },
    /// The image is not valid qcow2 (or a read failed).
    #[error("{path}: {source}")]
    Inspect {
        /// The file.
        path: String,
        /// The error.
        source: InspectError,
    },
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
    /// Following the backing chain came back to an image already shown (qemu-img's words).
    #[error("Backing file '{0}' creates an infinite loop.")]
    Loop(String),
    /// A backing file cannot be followed safely.
    #[error(transparent)]
    Backing(#[from] BackingError),
    /// `-f` names a format we do not have (qemu-img's words for a driver it lacks).
    #[error("Could not open '{path}': Unknown driver '{format}'")]
    UnknownDriver {
        /// The file.
        path: String,
        /// The name given.
        format: String,
    },
    /// The image needs incompatible features we do not implement (qemu-img's words).
    #[error("Could not open '{path}': Unsupported qcow2 feature(s): {features}")]
    Unsupported {
        /// The file.
        path: String,
        /// The features, as qemu-img lists them.
        features: String,
    },
    /// `-f qcow2` on a file that is not qcow2 (qemu-img's words).
    #[error("Could not open '{0}': Image is not in qcow2 format")]
    NotQcow2(String),
    /// The backing format is one we cannot read.
    #[error("{path}: backing file format {format:?} is not supported (only qcow2 and raw)")]
    UnsupportedFormat {
        /// The backing file.
        path: String,
        /// Its format.
        format: String,
    },
    /// Writing the output failed.
    #[error("writing output: {0}")]
    Output(#[from] io::Error),
    /// Serializing JSON failed.
    #[error("encoding JSON: {0}")]
    Json(#[from] serde_json::Error),
}

/// How to read a file in the chain.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Format {
    Qcow2,
    Raw,
    Luks,
}

/// Opens an image read-only through the storage opener, holding the read lock QEMU would
/// (shared with every writer when `force_share`) for as long as it is open; an NBD name
/// connects to its export, a `null-co` name makes its device, and a `blkdebug` name wraps
/// its file (fault injection changes no metadata: the wrapped file is what is described;
/// QEMU also lists the blkdebug node as a child, which is not shown here).
/// For a file an untrusted image names (`confine`), the descriptor opened must lie inside
/// the allowed directories (where the kernel says it is, so a symlink swapped in after the
/// name was judged cannot lead outside).
fn open_confined(
    path: &Path,
    force_share: bool,
    confine: Option<&'static storage::AllowDirs>,
) -> Result<ImageBytes, InfoError> {
    ImageBytes::open(path, force_share, confine).map_err(|source| {
        let refused_lock = source
            .get_ref()
            .is_some_and(|e| e.is::<storage::LockError>());
        if storage::opener::name::kind(path) == NameKind::Nbd {
            InfoError::OpenNbd {
                path: crate::common::image_name::given_name(path),
                source,
            }
        } else if refused_lock
            || (confine.is_some() && source.kind() == io::ErrorKind::PermissionDenied)
        {
            InfoError::Open {
                path: path.display().to_string(),
                source,
            }
        } else {
            let wrapped = path.to_str().and_then(storage::blkdebug::image_file);
            InfoError::OpenFile {
                path: wrapped
                    .as_deref()
                    .map_or(path, Path::new)
                    .display()
                    .to_string(),
                source,
            }
        }
    })
}

/// Bytes the file occupies on disk, as `qemu-img info` reports `actual-size`.
fn allocated_size(image: &ImageBytes) -> Option<u64> {
    match image.storage() {
        // A device that stores nothing occupies nothing.
        AnyStorage::Null(_) => Some(0),
        storage => storage.allocated_size(),
    }
}

/// Builds the report for one file, with everything that needs the path filled in.
fn describe(
    path: &Path,
    format: Format,
    force_share: bool,
    confine: Option<&'static storage::AllowDirs>,
    caps: Option<qcow2::declared::Caps>,
) -> Result<ImageInfo, InfoError> {
    let file = open_confined(path, force_share, confine)?;
    let name = path.display().to_string();
    let mut info = match format {
        Format::Qcow2 => {
            let meta = inspect::inspect(&file).map_err(|source| {
                let format = match &source {
                    qcow2::metadata::MetadataError::Format(f) => Some(f),
                    _ => None,
                };
                let unsupported = format.and_then(crate::common::engine_run::unsupported_features);
                let refused = format.and_then(|f| f.qemu_open_message());
                match (unsupported, refused) {
                    (Some(features), _) => InfoError::Unsupported {
                        path: name.clone(),
                        features,
                    },
                    (None, Some(message)) => InfoError::Refused {
                        path: name.clone(),
                        message,
                    },
                    (None, None) => InfoError::Inspect {
                        path: name.clone(),
                        source,
                    },
                }
            })?;
            if let Some(caps) = caps {
                qcow2::declared::check(&qcow2::declared::Declared::of(&meta), &caps).map_err(
                    |source| InfoError::Declared {
                        path: name.clone(),
                        source,
                    },
                )?;
            }
            let mut info = ImageInfo::from_metadata(&meta, &name);
            if let Some(backing) = &info.backing_filename {
                // qemu-img shows where the name points even without opening it; a name we
                // would never follow, and a `json:` name (which QEMU takes as it is), are
                // shown as stored; a relative name in an image with no directory of its own
                // (over a `quorum` node) points nowhere QEMU can tell.
                info.full_backing_filename = if storage::opener::described::is_json_name(backing) {
                    Some(backing.clone())
                } else {
                    match backing_chain::resolve(path, backing) {
                        Ok(p) => Some(p.display().to_string()),
                        Err(BackingError::NoBaseDirectory { .. }) => None,
                        Err(_) => Some(backing.clone()),
                    }
                };
            }
            info
        }
        Format::Raw => {
            let len = file.byte_len().map_err(|source| InfoError::Open {
                path: name.clone(),
                source,
            })?;
            ImageInfo::raw(&name, len)
        }
        Format::Luks => luks_volume(&file, &name)?,
    };
    if let Some(actual) = allocated_size(&file) {
        info.set_actual_size(actual);
    }
    match file.storage() {
        AnyStorage::Nbd(_) => info.set_file_protocol("nbd"),
        AnyStorage::Null(_) => info.set_null_co(),
        _ => {}
    }
    Ok(info)
}

/// The report of a LUKS volume: its header read and checked as an open reads it (no key
/// slot is tried: `info` shows the header without the secret, as qemu-img does).
fn luks_volume(file: &ImageBytes, name: &str) -> Result<ImageInfo, InfoError> {
    use qcow2::crypto::luks::{HEADER_LEN, MAX_AREA};
    let open_err = |source| InfoError::Open {
        path: name.to_string(),
        source,
    };
    let refused = |e: qcow2::crypto::CryptoError| InfoError::Refused {
        path: name.to_string(),
        message: e.to_string(),
    };
    let len = file.byte_len().map_err(open_err)?;
    let mut head = vec![0u8; HEADER_LEN];
    file.read_exact_at(0, &mut head).map_err(open_err)?;
    let area_len = qcow2::crypto::LuksHeader::area_len_of(&head).map_err(refused)?;
    if area_len > MAX_AREA || area_len > len {
        return Err(InfoError::Refused {
            path: name.to_string(),
            message: "LUKS payload is overlapping with the header".into(),
        });
    }
    // area_len <= MAX_AREA, so it fits memory and usize.
    let mut area = vec![0u8; area_len as usize];
    file.read_exact_at(0, &mut area).map_err(open_err)?;
    let header = qcow2::crypto::LuksHeader::parse(&area).map_err(refused)?;
    Ok(ImageInfo::luks(name, len, Some(&header.info())))
}

/// Decides how to read a backing file: its recorded format, or a safe probe (qcow2 magic,
/// else raw) when the image does not record one.
fn backing_format(
    path: &Path,
    recorded: Option<&str>,
    confine: Option<&'static storage::AllowDirs>,
) -> Result<Format, InfoError> {
    match recorded {
        Some("qcow2") => Ok(Format::Qcow2),
        Some("raw") => Ok(Format::Raw),
        Some(other) => Err(InfoError::UnsupportedFormat {
            path: path.display().to_string(),
            format: other.into(),
        }),
        None => {
            let file = open_confined(path, true, confine)?;
            let mut magic = [0u8; 6];
            let read = file.read_exact_at(0, &mut magic).is_ok();
            let is_qcow2 = read && magic[..4] == QCOW2_MAGIC.to_be_bytes();
            Ok(if is_qcow2 {
                Format::Qcow2
            } else if read && qcow2::crypto::luks::is_luks(&magic) {
                Format::Luks
            } else {
                Format::Raw
            })
        }
    }
}

/// The image's own format: `-f` as given (a qcow2 file is checked for its magic, as QEMU
/// checks it), or probed.
fn image_format(image: &Path, given: Option<&str>) -> Result<Format, InfoError> {
    let probed = || backing_format(image, None, None);
    match given {
        None => probed(),
        Some("raw") => Ok(Format::Raw),
        Some("luks") => Ok(Format::Luks),
        Some("qcow2") => match probed()? {
            Format::Qcow2 => Ok(Format::Qcow2),
            _ => Err(InfoError::NotQcow2(image.display().to_string())),
        },
        Some(other) => Err(InfoError::UnknownDriver {
            path: image.display().to_string(),
            format: other.to_string(),
        }),
    }
}

/// The name QEMU gives an image opened with options a plain file name cannot carry: its
/// `json:{...}` pseudo-filename. Of the options taken here, only the key secret of a qcow2
/// image is one QEMU counts as part of what the image is.
fn pseudo_filename(image: &Path, format: Format) -> Option<String> {
    if format != Format::Qcow2 {
        return None;
    }
    let options = crate::common::image_name::driver_options(image);
    let secret = options.get("encrypt.key-secret")?;
    let node = serde_json::json!({
        "driver": "qcow2",
        "encrypt.key-secret": secret,
        "file": { "driver": "file", "filename": image.display().to_string() },
    });
    Some(format!("json:{}", qcow2::qemu_json::to_compact(&node)))
}

/// Collects the reports for the image (of format `format`, probed when `None`) and, with
/// `backing_chain`, every backing file. Under `--untrusted` (`confine`) each report lists
/// the files its image names, a refused one ends the walk, and the first refusal is
/// returned with the reports.
pub fn collect(
    image: &Path,
    format: Option<&str>,
    backing_chain: bool,
    force_share: bool,
    untrusted: Option<qcow2::engine::Untrusted>,
) -> Result<(Vec<ImageInfo>, Option<BackingError>), InfoError> {
    let confine = untrusted.map(|u| u.allow);
    let caps = untrusted.map(|u| u.caps);
    let mut guard = ChainGuard::default();
    guard.enter(image, image)?;
    let top = image_format(image, format)?;
    let mut infos = vec![describe(image, top, force_share, None, caps)?];
    if let Some(name) = pseudo_filename(image, top) {
        infos[0].filename = name;
    }
    if crate::common::image_name::driver_options(image)
        .get("driver")
        .is_some_and(|d| d == "nbd")
    {
        infos[0].set_protocol_node("nbd");
    }
    let mut refusal = None;
    let mut current = image.to_path_buf();
    loop {
        let last = infos.last_mut().expect("non-empty");
        let mut admitted_backing = None;
        if let Some(allowed) = confine {
            let mut reports = Vec::new();
            for j in untrusted::references(&current, last, allowed) {
                match j.verdict {
                    Ok(p) if j.kind == Reference::BackingFile => admitted_backing = Some(p),
                    Ok(_) => {}
                    Err(e) => {
                        refusal.get_or_insert(e);
                    }
                }
                reports.push(j.report);
            }
            last.untrusted_references = Some(reports);
        }
        // Under `--untrusted` the whole chain is judged, as opening it for I/O would be;
        // only `--backing-chain` shows the images below the top.
        if !(backing_chain || confine.is_some()) || refusal.is_some() {
            break;
        }
        let Some(name) = last.backing_filename.clone() else {
            break;
        };
        let recorded = last.backing_filename_format.clone();
        let next = match admitted_backing {
            Some(p) => p,
            None => backing_chain::resolve(&current, &name)?,
        };
        guard.enter(&current, &next).map_err(|e| match e {
            BackingError::Loop { path, .. } => InfoError::Loop(path),
            e => InfoError::Backing(e),
        })?;
        let format = backing_format(&next, recorded.as_deref(), confine)?;
        infos.push(describe(&next, format, force_share, confine, caps)?);
        current = next;
    }
    if !backing_chain {
        infos.truncate(1);
    }
    Ok((infos, refusal))
}

/// Runs `info`.
pub fn run(args: &InfoArgs) -> Result<(), InfoError> {
    let (infos, refusal) = collect(
        &args.image,
        args.format.as_deref(),
        args.backing_chain,
        args.share.force_share,
        crate::common::engine_run::untrusted(),
    )?;
    // Refused (`--untrusted`): JSON still shows what was refused and why, for a management
    // tool; the human layout shows only the refusal. Either way the status is 1.
    if let Some(refusal) = refusal {
        if args.output == OutputFormat::Json {
            print_json(&infos, args.backing_chain)?;
        }
        return Err(InfoError::Backing(refusal));
    }
    let mut out = io::stdout().lock();
    match args.output {
        OutputFormat::Json => {
            drop(out);
            return print_json(&infos, args.backing_chain);
        }
        OutputFormat::Human => {
            for (i, info) in infos.iter().enumerate() {
                if i > 0 {
                    writeln!(out)?;
                }
                write!(out, "{}", info.to_human())?;
            }
        }
    }
    out.flush()?;
    Ok(())
}

/// Prints the reports in qemu-img's JSON layout: a list with `--backing-chain`.
fn print_json(infos: &[ImageInfo], backing_chain: bool) -> Result<(), InfoError> {
    let mut out = io::stdout().lock();
    if backing_chain {
        let value = serde_json::to_value(infos)?;
        writeln!(out, "{}", qcow2::qemu_json::to_pretty(&value))?;
    } else {
        for info in infos {
            let value = serde_json::to_value(info)?;
            writeln!(out, "{}", qcow2::qemu_json::to_pretty(&value))?;
        }
    }
    out.flush()?;
    Ok(())
}
