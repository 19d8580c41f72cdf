//! The images a server offers: the positional IMAGE (with `-x`, `-D`, `-r`, `-f`, `-B`), or
//! one per `--export` definition. They are opened all or none and closed all at the end.

use std::path::{Path, PathBuf};

use qcow2::engine::{EngineError, Format, Image, OpenOptions};
use storage::{AnyStorage, FileOpener};

use super::args::ServeArgs;
use super::error::ServeError;
use super::export_option::{ExportSpec, MAX_EXPORTS};

/// One image to serve and how clients see it.
#[derive(Debug, Clone)]
pub struct ImageSpec {
    /// The export name.
    pub name: String,
    /// The export description.
    pub description: String,
    /// The image file.
    pub path: PathBuf,
    /// Opened and served read-only.
    pub read_only: bool,
    /// The format; `None` accepts qcow2 only.
    pub format: Option<Format>,
    /// The format was not given and probing guessed raw (the positional IMAGE only, as
    /// qemu-nbd probes): the export then guards its first sector (see
    /// [`crate::daemon::image_export::ExportPolicy::probed_raw`]).
    pub probed: bool,
    /// Opened as untrusted (`untrusted=on`, or `--untrusted` for the whole server).
    pub untrusted: bool,
    /// The `-B` / `bitmap=` bitmaps offered.
    pub bitmaps: Vec<String>,
    /// The `-s` overlay over `path`, which is opened instead.
    pub overlay: Option<PathBuf>,
    /// Where it was asked for, which its errors name.
    pub origin: Origin,
}

/// Where an image to serve was asked for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Origin {
    /// The positional IMAGE: its errors keep the messages they always had.
    Image,
    /// An `--export` definition: errors name the definition.
    ExportFlag,
    /// A control command (`block-export-add`): errors are plain, and the registry puts the
    /// command and its arguments before them.
    Command,
}

/// The images the command line asks for. `internal_snapshot` (`-l`) makes the positional
/// image read-only, as qemu-nbd does.
pub fn image_specs(
    args: &ServeArgs,
    internal_snapshot: bool,
) -> Result<Vec<ImageSpec>, ServeError> {
    let Some(image) = &args.image else {
        return from_export_specs(&args.exports);
    };
    refuse_nbd_name(image)?;
    let read_only = args.read_only || internal_snapshot;
    let (format, probed) = match args.format {
        Some(f) => (Some(Format::from(f)), false),
        None => probe(image, read_only),
    };
    Ok(vec![ImageSpec {
        name: args.export_name.clone(),
        description: args.description.clone(),
        path: image.clone(),
        read_only,
        format,
        probed,
        bitmaps: args.bitmaps.clone(),
        untrusted: false,
        overlay: None,
        origin: Origin::Image,
    }])
}

/// The format of an image given without one, guessed as qemu-nbd guesses it: qcow2 by its
/// magic, otherwise raw, with QEMU's warning when the export is writable (a guest could
/// write a format header into a raw image and have it read as that format next time, so
/// the export refuses such writes). A file that cannot be read is left to the open, which
/// says why.
fn probe(path: &Path, read_only: bool) -> (Option<Format>, bool) {
    match crate::common::engine_run::probe_format(path) {
        Ok(Format::Raw) => {
            if !read_only {
                eprintln!(
                    "WARNING: Image format was not specified for '{}' and probing guessed raw.\n         \
                     Automatically detecting the format is dangerous for raw images, write \
                     operations on block 0 will be restricted.\n         \
                     Specify the 'raw' format explicitly to remove the restrictions.",
                    path.display()
                );
            }
            (Some(Format::Raw), true)
        }
        Ok(f) => (Some(f), false),
        Err(_) => (None, false),
    }
}

/// Refuses an NBD name as an image to serve (see [`ServeError::NbdName`]).
pub fn refuse_nbd_name(path: &Path) -> Result<(), ServeError> {
    match storage::opener::name::kind(path) {
        storage::opener::name::NameKind::Nbd => {
            Err(ServeError::NbdName(path.display().to_string()))
        }
        _ => Ok(()),
    }
}

/// The `--export` definitions, checked as a whole: at least one, at most [`MAX_EXPORTS`],
/// names unique (before any image is opened).
fn from_export_specs(specs: &[ExportSpec]) -> Result<Vec<ImageSpec>, ServeError> {
    if specs.is_empty() {
        return Err(ServeError::NoImage);
    }
    if specs.len() > MAX_EXPORTS {
        return Err(ServeError::TooManyExports {
            given: specs.len(),
            max: MAX_EXPORTS,
        });
    }
    for (i, s) in specs.iter().enumerate() {
        refuse_nbd_name(&s.file)?;
        if specs[..i].iter().any(|o| o.name == s.name) {
            return Err(ServeError::DuplicateExport(s.name.clone()));
        }
    }
    Ok(specs
        .iter()
        .map(|s| ImageSpec {
            name: s.name.clone(),
            description: s.description.clone(),
            path: s.file.clone(),
            read_only: s.read_only,
            format: s.format.map(Format::from),
            probed: false,
            bitmaps: s.bitmaps.clone(),
            untrusted: s.untrusted,
            overlay: None,
            origin: Origin::ExportFlag,
        })
        .collect())
}

impl ImageSpec {
    /// The server-wide open options with this image's own settings.
    pub fn open_options(&self, server: &OpenOptions) -> OpenOptions {
        OpenOptions {
            read_only: self.read_only,
            format: self.format,
            passwords: crate::common::secrets::passwords_for(&self.path),
            untrusted: match self.untrusted {
                true => Some(crate::common::engine_run::untrusted_settings()),
                false => server.untrusted,
            },
            ..server.clone()
        }
    }

    /// The file opened and how: the image, or the `-s` overlay over it (always qcow2).
    fn opened(&self, server: &OpenOptions) -> (&Path, OpenOptions) {
        match &self.overlay {
            None => (&self.path, self.open_options(server)),
            Some(overlay) => {
                let opts = self.open_options(server);
                // The overlay's backing file is the image itself, which the operator chose:
                // only what the image names is confined.
                let untrusted = opts.untrusted.map(|u| qcow2::engine::Untrusted {
                    allow: u.allow.and_file(&self.path),
                    ..u
                });
                let opts = OpenOptions {
                    format: Some(Format::Qcow2),
                    untrusted,
                    ..opts
                };
                (overlay, opts)
            }
        }
    }

    fn open_error(&self, source: EngineError) -> ServeError {
        if self.origin != Origin::ExportFlag {
            return ServeError::Open(source);
        }
        ServeError::ExportOpen {
            name: self.name.clone(),
            path: self.path.display().to_string(),
            source: Box::new(source),
        }
    }

    /// The error for a bitmap this image cannot offer.
    pub fn bitmap_error(&self, reason: String) -> ServeError {
        if self.origin != Origin::ExportFlag {
            return ServeError::Bitmap(reason);
        }
        ServeError::ExportBitmap {
            name: self.name.clone(),
            reason,
        }
    }

    fn close_error(&self, source: EngineError) -> ServeError {
        if self.origin != Origin::ExportFlag {
            return ServeError::Close(source);
        }
        ServeError::ExportClose {
            name: self.name.clone(),
            source: Box::new(source),
        }
    }
}

/// An image open for serving.
pub struct OpenImage {
    /// What it was opened from.
    pub spec: ImageSpec,
    /// The image.
    pub image: Image<AnyStorage>,
}

/// Opens every image, in order. If one cannot be opened (missing, damaged, locked by
/// another process), those already open are closed again before the error is returned, so
/// a failed start leaves no image locked or with its bitmaps marked in use.
pub async fn open_all(
    opener: &FileOpener,
    specs: Vec<ImageSpec>,
    server: &OpenOptions,
) -> Result<Vec<OpenImage>, ServeError> {
    let mut opened = Vec::with_capacity(specs.len());
    for spec in specs {
        let (path, options) = spec.opened(server);
        match Image::open(opener, path, &options).await {
            Ok(image) => {
                log_open(&spec, &image);
                opened.push(OpenImage { spec, image });
            }
            Err(e) => {
                let error = spec.open_error(e);
                if let Err(c) = close_all(opened).await {
                    tracing::error!(error = %c, "closing the images opened before failed too");
                }
                return Err(error);
            }
        }
    }
    Ok(opened)
}

fn log_open(spec: &ImageSpec, image: &Image<AnyStorage>) {
    let facts = image.facts();
    tracing::info!(
        export = %spec.name,
        image = %spec.path.display(),
        size = facts.size,
        cluster_size = facts.cluster_size,
        layers = facts.chain.len(),
        read_only = facts.read_only,
        cache = ?image.cache_sizes(),
        "image open"
    );
}

/// Closes every image (writing back its caches and bitmaps), each one even if another
/// failed: the first failure is returned, later ones are logged.
pub async fn close_all(opened: Vec<OpenImage>) -> Result<(), ServeError> {
    let mut first = None;
    for o in opened {
        if let Err(e) = o.image.close().await {
            let e = o.spec.close_error(e);
            if first.is_some() {
                tracing::error!(error = %e, "closing an image failed");
            } else {
                first = Some(e);
            }
        }
    }
    first.map_or(Ok(()), Err)
}
