//! What the engine-backed subcommands (`create`, `map`, `convert`) share: the single-threaded
//! runtime the engine expects, format names and probing, and opening images; and what every
//! subcommand shares about image locks (`--locking`, `-U`).

pub use crate::common::os_error::plain_io;
use std::fmt::Display;
use std::future::Future;
use std::path::Path;
use std::process::ExitCode;

use qcow2::engine::{EngineError, Format, Image, OpenOptions};
use qcow2::format::header::QCOW2_MAGIC;
use storage::AnyStorage;

use super::image_bytes;
pub use super::settings::{locking, opener, untrusted, untrusted_settings};

/// `-U`/`--force-share`, as the read-only tools (`info`, `map`, `check`, `convert`) take it.
#[derive(clap::Args, Debug, Clone, Copy, Default)]
pub struct ForceShare {
    /// Open the image even while another process has it open for writing (qemu-img's
    /// `-U`): no lock keeps writers out, so what is read may be inconsistent.
    #[arg(short = 'U', long = "force-share")]
    pub force_share: bool,
}

/// Runs `f` on a current-thread runtime inside a `LocalSet`, as the engine requires.
pub fn block_on<F: Future>(f: F) -> std::io::Result<F::Output> {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    Ok(tokio::task::LocalSet::new().block_on(&rt, f))
}

/// Why an image could not be opened (or its format not determined).
#[derive(Debug, thiserror::Error)]
pub enum OpenError {
    /// A format name other than qcow2, raw or luks.
    #[error("Unknown or unsupported file format '{0}' (qcow2-nbd handles qcow2, raw and luks)")]
    UnknownFormat(String),
    /// A backing file could not be opened: QEMU names the top image and each level down.
    #[error(
        "Could not open '{}': {}Could not open '{path}': {}",
        .images.first().map_or("", String::as_str),
        "Could not open backing file: ".repeat(.images.len()),
        plain_io(.source)
    )]
    Backing {
        /// The images above it, from the top.
        images: Vec<String>,
        /// The backing file.
        path: String,
        /// The error.
        source: std::io::Error,
    },
    /// A format QEMU reads but never creates (`bochs`, `cloop`, `dmg`).
    #[error("Format driver '{0}' does not support image creation")]
    NoCreation(String),
    /// The file could not be opened or read to probe its format.
    #[error("Could not open '{path}': {}", plain_io(.source))]
    Probe {
        /// The file.
        path: String,
        /// The error.
        source: std::io::Error,
    },
    /// The image needs incompatible features we do not implement; the list is worded as
    /// qemu-img words it (named features, then the mask of the unnamed ones in hex).
    #[error("Could not open '{path}': Unsupported qcow2 feature(s): {features}")]
    UnsupportedFeatures {
        /// The image.
        path: String,
        /// The features.
        features: String,
    },
    /// The image's header fails a check QEMU makes the same way, worded as QEMU words it.
    #[error("Could not open '{path}': {message}")]
    Refused {
        /// The image.
        path: String,
        /// QEMU's words.
        message: String,
    },
    /// The engine refused the image.
    #[error(transparent)]
    Engine(Box<EngineError>),
}

/// The qemu-img wording of `e` when it refuses unsupported incompatible features.
pub fn unsupported_features(e: &qcow2::format::error::FormatError) -> Option<String> {
    match e {
        qcow2::format::error::FormatError::UnsupportedIncompatibleFeatures { features } => {
            Some(qemu_feature_list_of(features))
        }
        _ => None,
    }
}

/// qemu-img's list of unsupported incompatible features: the names the image's feature
/// table gives (at most 46 characters each), then `Unknown incompatible feature: MASK` for
/// the bits without a name.
fn qemu_feature_list_of(features: &[qcow2::format::error::UnknownFeature]) -> String {
    let mut parts: Vec<String> = Vec::new();
    let mut unnamed = 0u64;
    for f in features {
        match &f.name {
            Some(name) => parts.push(name.chars().take(46).collect()),
            None => unnamed |= 1u64.checked_shl(f.bit).unwrap_or(0),
        }
    }
    if unnamed != 0 {
        parts.push(format!("Unknown incompatible feature: {unnamed:x}"));
    }
    parts.join(", ")
}

impl From<EngineError> for OpenError {
    fn from(e: EngineError) -> OpenError {
        match e {
            // A file that cannot be opened reads as qemu-img says it.
            EngineError::Open { path, source } => OpenError::Probe { path, source },
            EngineError::BackingOpen {
                images,
                path,
                source,
            } => OpenError::Backing {
                images,
                path,
                source,
            },
            EngineError::Format {
                image,
                source:
                    qcow2::format::error::FormatError::UnsupportedIncompatibleFeatures { features },
            } => OpenError::UnsupportedFeatures {
                path: image,
                features: qemu_feature_list_of(&features),
            },
            EngineError::DataFileNotUsed { image } => OpenError::Refused {
                path: image,
                message: "'data-file' can only be set for images with an external data file".into(),
            },
            EngineError::Format { image, source } if source.qemu_open_message().is_some() => {
                OpenError::Refused {
                    path: image,
                    message: source.qemu_open_message().unwrap_or_default(),
                }
            }
            other => OpenError::Engine(Box::new(other)),
        }
    }
}

/// Parses a `-f`/`-F`/`-O` format name; only the formats the engine reads are accepted.
pub fn parse_format(name: &str) -> Result<Format, OpenError> {
    Format::from_name(name).ok_or_else(|| OpenError::UnknownFormat(name.to_string()))
}

/// The format of a new image: as [`parse_format`], but a format QEMU only ever reads is
/// refused as QEMU refuses it.
pub fn creation_format(name: &str) -> Result<Format, OpenError> {
    const READ_ONLY_FORMATS: &[&str] = &["bochs", "cloop", "dmg"];
    if READ_ONLY_FORMATS.contains(&name) {
        return Err(OpenError::NoCreation(name.to_string()));
    }
    parse_format(name)
}

/// The block drivers QEMU 10 has (`qemu-img --help` lists them): names a script may record
/// as a backing format (`rebase -u -F host_device`) though this tool reads only qcow2 and raw.
pub const QEMU_DRIVERS: &[&str] = &[
    "blkdebug",
    "blklogwrites",
    "blkverify",
    "bochs",
    "cloop",
    "compress",
    "copy-before-write",
    "copy-on-read",
    "dmg",
    "file",
    "ftp",
    "ftps",
    "gluster",
    "host_cdrom",
    "host_device",
    "http",
    "https",
    "iscsi",
    "iser",
    "luks",
    "nbd",
    "nfs",
    "null-aio",
    "null-co",
    "nvme",
    "parallels",
    "preallocate",
    "qcow",
    "qcow2",
    "qed",
    "quorum",
    "raw",
    "rbd",
    "replication",
    "snapshot-access",
    "ssh",
    "throttle",
    "vdi",
    "vhdx",
    "vmdk",
    "vpc",
    "vvfat",
];

/// The name of a format, as qemu-img prints it.
pub fn format_name(f: Format) -> &'static str {
    match f {
        Format::Qcow2 => "qcow2",
        Format::Raw => "raw",
        Format::Luks => "luks",
    }
}

/// Guesses an image's format the way qemu-img does for the formats we know: the qcow2
/// magic, the LUKS magic, otherwise raw. Used before read-only and read-write opens alike: the name is
/// opened as the storage opener opens every name (a file, an NBD export, a `null-co`
/// device, the file under a `blkdebug` wrapper, whose injected faults change no bytes),
/// read-only and sharing writes for the four bytes it reads; the open that follows takes
/// the locks its subcommand needs.
pub fn probe_format(path: &Path) -> Result<Format, OpenError> {
    let probe_err = |source| OpenError::Probe {
        path: path.display().to_string(),
        source,
    };
    let head = image_bytes::read_head(path, 6).map_err(probe_err)?;
    Ok(if head.get(..4) == Some(&QCOW2_MAGIC.to_be_bytes()[..]) {
        Format::Qcow2
    } else if qcow2::crypto::luks::is_luks(&head) {
        Format::Luks
    } else {
        Format::Raw
    })
}

/// Opens `path` read-only with its backing chain; `format` `None` probes it; `force_share`
/// reads it even while another process writes it (qemu-img's `-U`). O_DIRECT when its name
/// asked for it (`cache.direct`).
pub async fn open_read_only(
    path: &Path,
    format: Option<Format>,
    snapshot: Option<String>,
    force_share: bool,
) -> Result<Image<AnyStorage>, OpenError> {
    let format = match format {
        Some(f) => f,
        None => probe_format(path)?,
    };
    let opts = OpenOptions {
        read_only: true,
        format: Some(format),
        snapshot,
        force_share,
        passwords: crate::common::secrets::passwords_for(path),
        data_file: crate::common::image_name::data_file_for(path),
        direct: crate::common::image_name::direct_for(path),
        untrusted: untrusted(),
        ..OpenOptions::default()
    };
    Ok(Image::open(&opener(), path, &opts).await?)
}

/// Turns a subcommand's result into the process exit status, printing the error the way
/// every subcommand does.
pub fn exit_code<E: Display>(result: Result<(), E>) -> ExitCode {
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("{}: {e}", crate::common::prog::name());
            ExitCode::FAILURE
        }
    }
}
