//! `qcow2-nbd create`: new qcow2 (or sparse raw) images with `qemu-img create`'s option
//! names, size suffixes, defaults, checks and messages. The qcow2 option table and its checks
//! are shared with `convert -O qcow2` (`plan.rs`).

use std::path::{Path, PathBuf};
use std::process::ExitCode;

use clap::Args;
use qcow2::crypto::LuksCreate;
use qcow2::engine::{self as engine, CreateOptions, EngineError, Format, Image, Preallocation};
use storage::opener::name;
use storage::{IoBuf, Opener, Storage};

use crate::common::engine_run::{self, OpenError};
use crate::common::options::{self, OptionsError, Parsed};
use crate::common::size_string::{self, ParseSizeError};

mod file_attrs;
mod plan;
pub use file_attrs::FileAttrs;
pub use plan::*;

/// Arguments of `create`.
#[derive(Args, Debug)]
pub struct CreateArgs {
    /// Format of the new image: qcow2 or raw (default qcow2; raw when invoked as
    /// qemu-img, whose default it is).
    #[arg(short = 'f', long = "format")]
    pub format: Option<String>,
    /// Format options, `key=value,...` (`-o help` lists them); may be repeated.
    #[arg(short = 'o', long = "options")]
    pub options: Vec<String>,
    /// Backing file, stored as given (relative names are relative to the new image).
    #[arg(short = 'b', long = "backing")]
    pub backing: Option<String>,
    /// Format of the backing file (required with -b, as in qemu-img 10).
    #[arg(short = 'F', long = "backing-format")]
    pub backing_format: Option<String>,
    /// Do not open the backing file (then SIZE is required).
    #[arg(short = 'u', long = "backing-unsafe")]
    pub backing_unsafe: bool,
    /// Do not print the "Formatting ..." line.
    #[arg(short = 'q', long)]
    pub quiet: bool,
    /// The image to create (replaced if it exists).
    pub image: Option<PathBuf>,
    /// Virtual size with an optional suffix (k, M, G, T, P, E); defaults to the backing
    /// file's size.
    pub size: Option<String>,
}

impl CreateArgs {
    /// The format asked for, or the default of the tool the binary stands in for.
    pub fn format_name(&self) -> &str {
        match &self.format {
            Some(f) => f,
            None if crate::common::prog::current() == crate::common::prog::Personality::QemuImg => {
                "raw"
            }
            None => "qcow2",
        }
    }
}

/// Why `create` (or the target side of `convert`) failed. Messages follow qemu-img's.
#[derive(Debug, thiserror::Error)]
pub enum CreateError {
    /// A bad `-o` list or value.
    #[error("{image}: {source}")]
    Options {
        /// The image being created.
        image: String,
        /// What is wrong.
        source: OptionsError,
    },
    /// A `-o` list that is malformed as a whole (qemu-img names no image then).
    #[error(transparent)]
    List(OptionsError),
    /// `-o` given without a list to parse (only `-o help` works then).
    #[error("Expecting one image file name")]
    NoImage,
    /// A format we cannot create.
    #[error(transparent)]
    Format(#[from] OpenError),
    /// SIZE that does not parse.
    #[error("Invalid image size specified: '{0}'.")]
    InvalidSize(String),
    /// SIZE beyond what QEMU allows.
    #[error("Invalid image size specified. Must be between 0 and 9223372036854775807.")]
    SizeOutOfRange,
    /// A check on the combination of options failed.
    #[error("{image}: {detail}")]
    Invalid {
        /// The image being created.
        image: String,
        /// qemu-img's message.
        detail: String,
    },
    /// The backing file could not be opened to learn its size.
    #[error("{image}: {source}\nCould not open backing image.")]
    Backing {
        /// The image being created.
        image: String,
        /// Why.
        source: OpenError,
    },
    /// The engine failed to write the image.
    #[error("{image}: {source}")]
    Engine {
        /// The image being created.
        image: String,
        /// What failed.
        source: Box<EngineError>,
    },
    /// Creating a raw file failed.
    #[error("{image}: {what}: {}", engine_run::plain_io(.source))]
    Io {
        /// The image being created.
        image: String,
        /// What was being done.
        what: &'static str,
        /// The error.
        source: std::io::Error,
    },
}

impl CreateError {
    /// Builds [`CreateError::Invalid`] for `image` from qemu-img's message, for `map_err`.
    pub fn invalid(image: &str) -> impl Fn(String) -> CreateError + '_ {
        move |detail| CreateError::Invalid {
            image: image.to_string(),
            detail,
        }
    }
}

/// Reads the SIZE argument as qemu-img does.
pub fn parse_image_size(s: &str) -> Result<u64, CreateError> {
    match size_string::parse_size(s) {
        Ok(v) if v <= i64::MAX as u64 => Ok(v),
        Ok(_) => Err(CreateError::SizeOutOfRange),
        Err(ParseSizeError::SizeOutOfRange { .. }) => Err(CreateError::SizeOutOfRange),
        Err(_) => Err(CreateError::InvalidSize(s.to_string())),
    }
}

/// Writes a new qcow2 image at `path` (replacing any file there) and preallocates it. The
/// engine refuses preallocation with a backing file, which QEMU allows with extended L2
/// entries (the clusters are reserved, their subclusters stay unallocated), so the image is
/// created first and preallocated without opening its backing file. The image file and
/// the external data file get `attrs` before anything is written to them.
pub async fn create_qcow2(
    path: &Path,
    opts: &CreateOptions,
    attrs: FileAttrs,
) -> Result<(), EngineError> {
    let prepare = |p: &Path| {
        attrs.prepare(p).map_err(|source| EngineError::Open {
            path: p.display().to_string(),
            source,
        })
    };
    prepare(path)?;
    if let Some(data) = &opts.data_file {
        prepare(Path::new(data))?;
    }
    let base = CreateOptions {
        preallocation: Preallocation::Off,
        ..opts.clone()
    };
    // With `data_file_raw` and no preallocation asked for, the engine maps the clusters.
    engine::create_file(&engine_run::opener(), path, &base).await?;
    if opts.preallocation != Preallocation::Off {
        let img = Image::open(
            &engine_run::opener(),
            path,
            &engine::OpenOptions {
                no_backing: true,
                format: Some(Format::Qcow2),
                passwords: opts.passwords(),
                ..engine::OpenOptions::default()
            },
        )
        .await?;
        img.preallocate(opts.preallocation).await?;
        img.close().await?;
    }
    Ok(())
}

/// Writes a new raw image: a sparse file of `size` bytes (rounded up to 512 as QEMU does),
/// reserved (`falloc`) or written with zeros (`full`) when asked, with `attrs` set first.
/// Unless written whole, its first block is written with zeros as QEMU's `file` driver
/// writes it ([`storage::allocate_first_block`]).
pub async fn create_raw(
    path: &Path,
    size: u64,
    prealloc: Preallocation,
    attrs: FileAttrs,
) -> std::io::Result<()> {
    attrs.prepare(path)?;
    let file = engine_run::opener()
        .open(path, storage::OpenOptions::create())
        .await?;
    let size = size
        .checked_next_multiple_of(512)
        .ok_or_else(|| std::io::Error::other("size too large"))?;
    file.set_len(0).await?;
    file.set_len(size).await?;
    match prealloc {
        Preallocation::Off | Preallocation::Metadata => {
            // An optimisation in QEMU, so a failure does not fail the creation there either.
            let _ = storage::allocate_first_block(&file, size).await;
        }
        Preallocation::Falloc => {
            file.write_zeroes_at(0, size, false).await?;
            let _ = storage::allocate_first_block(&file, size).await;
        }
        Preallocation::Full => {
            const CHUNK: u64 = 1 << 20;
            let mut pos = 0;
            while pos < size {
                let n = CHUNK.min(size - pos);
                // n <= 1 MiB.
                let (res, _) = file.write_at(IoBuf::zeroed(n as usize).into(), pos).await;
                res?;
                pos += n;
            }
        }
    }
    file.flush().await
}

async fn create(args: &CreateArgs) -> Result<(), CreateError> {
    let list = options::join_lists(&args.options).map_err(CreateError::List)?;
    if list.as_deref().is_some_and(options::wants_help) {
        let format = engine_run::creation_format(args.format_name())?;
        print!("{}", creation_help(format, args.image.is_some()));
        return Ok(());
    }
    let named = args.image.as_ref().ok_or(CreateError::NoImage)?;
    // Messages show the name as given; the file is what a `file:` prefix leaves.
    let image = named.display().to_string();
    let format = engine_run::creation_format(args.format_name()).map_err(|e| match e {
        OpenError::NoCreation(_) => CreateError::invalid(&image)(e.to_string()),
        other => CreateError::Format(other),
    })?;
    let file = storage::opener::protocol_path(named.as_os_str()).map_err(|reason| {
        CreateError::Invalid {
            image: image.clone(),
            detail: reason.to_string(),
        }
    })?;
    let image_path = &file;
    let parsed = parse_options(args, format, list.as_deref(), &image)?;
    let size = requested_size(args, &parsed, &image)?;
    match format {
        // QEMU's null device holds no image: refused before anything is announced.
        _ if name::kind(image_path) == name::NameKind::Null => Err(CreateError::invalid(&image)(
            "Protocol driver 'null-co' does not support image creation".into(),
        )),
        Format::Raw => create_raw_image(args, image_path, &image, &parsed, size).await,
        Format::Qcow2 => create_qcow2_image(args, image_path, &image, &parsed, size).await,
        Format::Luks => create_luks_image(args, image_path, &image, &parsed, size).await,
    }
}

/// Creates a LUKS volume (`-f luks`, QEMU's `luks` driver): the file sized to the LUKS
/// area and `size` (reserved or written as `prealloc` says, as QEMU sizes it before the
/// header goes in), then the header and key material at its start.
pub async fn create_luks(
    path: &Path,
    size: u64,
    password: &[u8],
    opts: &LuksCreate,
    prealloc: Preallocation,
    attrs: FileAttrs,
) -> std::io::Result<()> {
    let (area, _) = qcow2::crypto::luks::create(password, opts).map_err(std::io::Error::other)?;
    let area_len = area.len() as u64;
    let total = area_len
        .checked_add(size)
        .ok_or_else(|| std::io::Error::other("size too large"))?;
    attrs.prepare(path)?;
    let file = engine_run::opener()
        .open(path, storage::OpenOptions::create())
        .await?;
    file.set_len(0).await?;
    file.set_len(total).await?;
    match prealloc {
        Preallocation::Off | Preallocation::Metadata => {}
        Preallocation::Falloc => file.write_zeroes_at(0, total, false).await?,
        Preallocation::Full => {
            const CHUNK: u64 = 1 << 20;
            let mut pos = area_len;
            while pos < total {
                let n = CHUNK.min(total - pos);
                // n <= 1 MiB.
                let (res, _) = file.write_at(IoBuf::zeroed(n as usize).into(), pos).await;
                res?;
                pos += n;
            }
        }
    }
    let (res, _) = file.write_at(IoBuf::from_slice(&area).into(), 0).await;
    res?;
    file.flush().await
}

/// `create -f luks`: the "Formatting" line, then the volume.
async fn create_luks_image(
    args: &CreateArgs,
    path: &Path,
    image: &str,
    parsed: &Parsed,
    size: Option<u64>,
) -> Result<(), CreateError> {
    let invalid = CreateError::invalid(image);
    let size = size.ok_or_else(|| invalid("Image creation needs a size parameter".into()))?;
    let prealloc = raw_preallocation(parsed.str("preallocation")).map_err(&invalid)?;
    let attrs = FileAttrs::from_parsed(parsed).map_err(&invalid)?;
    if !args.quiet {
        println!("{}", formatting_line(image, Format::Luks, parsed, size));
    }
    let (password, opts) = luks_volume_settings(parsed).map_err(&invalid)?;
    if std::str::from_utf8(&password).is_err() {
        // QEMU takes a LUKS passphrase as UTF-8 text only, and finds out after it created
        // the file, which it then deletes (a file that was there before included).
        let _ = std::fs::remove_file(path);
        let id = parsed.str("key-secret").unwrap_or_default();
        return Err(invalid(format!("Data from secret {id} is not valid UTF-8")));
    }
    create_luks(path, size, &password, &opts, prealloc, attrs)
        .await
        .map_err(|source| CreateError::Io {
            image: image.to_string(),
            what: "creating the LUKS volume",
            source,
        })
}

/// Parses the `-o` list and lets `-b` and `-F` override it, as qemu-img does.
fn parse_options(
    args: &CreateArgs,
    format: Format,
    list: Option<&str>,
    image: &str,
) -> Result<Parsed, CreateError> {
    let specs = option_table(format);
    let mut parsed = match list {
        Some(l) => Parsed::parse(l, &specs, &[]).map_err(|source| CreateError::Options {
            image: image.to_string(),
            source,
        })?,
        None => Parsed::default(),
    };
    if format == Format::Qcow2 {
        if let Some(b) = &args.backing {
            parsed.set_str(&QCOW2_OPTIONS[0], b);
        }
        if let Some(f) = &args.backing_format {
            parsed.set_str(&QCOW2_OPTIONS[1], f);
        }
    } else if args.backing.is_some() || args.backing_format.is_some() {
        return Err(CreateError::Invalid {
            image: image.to_string(),
            detail: "Backing file not supported for file format 'raw'".into(),
        });
    }
    Ok(parsed)
}

/// The size asked for, by the SIZE argument or `-o size` (not both); `None` leaves it to the
/// backing file.
fn requested_size(
    args: &CreateArgs,
    parsed: &Parsed,
    image: &str,
) -> Result<Option<u64>, CreateError> {
    let size = match &args.size {
        Some(s) => Some(parse_image_size(s)?),
        None => None,
    };
    let Some(s) = parsed.num("size") else {
        return Ok(size);
    };
    if size.is_some() {
        return Err(CreateError::Invalid {
            image: image.to_string(),
            detail: "The image size must be specified only once".into(),
        });
    }
    if s > i64::MAX as u64 {
        return Err(CreateError::SizeOutOfRange);
    }
    Ok(Some(s))
}

async fn create_raw_image(
    args: &CreateArgs,
    path: &Path,
    image: &str,
    parsed: &Parsed,
    size: Option<u64>,
) -> Result<(), CreateError> {
    let invalid = CreateError::invalid(image);
    let prealloc_text = parsed.str("preallocation");
    let size = size.ok_or_else(|| invalid("Image creation needs a size parameter".into()))?;
    if !args.quiet {
        println!("{}", formatting_line(image, Format::Raw, parsed, size));
    }
    let prealloc = raw_preallocation(prealloc_text).map_err(&invalid)?;
    let attrs = FileAttrs::from_parsed(parsed).map_err(&invalid)?;
    create_raw(path, size, prealloc, attrs)
        .await
        .map_err(|source| CreateError::Io {
            image: image.to_string(),
            what: "creating the raw image",
            source,
        })
}

async fn create_qcow2_image(
    args: &CreateArgs,
    path: &Path,
    image: &str,
    parsed: &Parsed,
    size: Option<u64>,
) -> Result<(), CreateError> {
    let invalid = CreateError::invalid(image);
    let mut with_backing = CreateOptions::default();
    let size = set_backing(args, path, image, parsed, &mut with_backing, size).await?;
    let size = size.ok_or_else(|| invalid("Image creation needs a size parameter".into()))?;
    // qemu-img announces the image before its driver reads and checks the settings, so a
    // refused value or combination still prints the line.
    if !args.quiet {
        println!("{}", formatting_line(image, Format::Qcow2, parsed, size));
    }
    let mut plan = qcow2_settings(parsed).map_err(&invalid)?;
    plan.opts.backing = with_backing.backing;
    plan.opts.size = size;
    check_qcow2_plan(&plan, parsed.str("backing_file").is_some()).map_err(&invalid)?;
    check_qcow2_size(&plan.opts).map_err(&invalid)?;
    let attrs = FileAttrs::from_parsed(parsed).map_err(&invalid)?;
    create_qcow2(path, &plan.opts, attrs)
        .await
        .map_err(|source| CreateError::Engine {
            image: image.to_string(),
            source: Box::new(source),
        })
}

/// Puts the backing file (`backing_file` and `backing_fmt`) into `opts`, with qemu-img's
/// checks, and returns the size of the new image: `size` if given, else the backing file's.
/// Unless `-u`, the backing file is opened even when the size is known, so that one that
/// cannot be opened is refused as qemu-img refuses it.
async fn set_backing(
    args: &CreateArgs,
    path: &Path,
    image: &str,
    parsed: &Parsed,
    opts: &mut CreateOptions,
    size: Option<u64>,
) -> Result<Option<u64>, CreateError> {
    let invalid = CreateError::invalid(image);
    let backing_fmt = parsed.str("backing_fmt");
    let Some(name) = parsed.str("backing_file") else {
        if backing_fmt.is_some() {
            return Err(invalid(
                "Backing format cannot be used without backing file".into(),
            ));
        }
        return Ok(size);
    };
    let fmt = backing_fmt.map(engine_run::parse_format).transpose()?;
    // An NBD name given here is the user's own choice, so its export is read for the size
    // (names stored in images are still not followed: see `backing_name`).
    let export = (name::kind_of_text(name) == name::NameKind::Nbd)
        .then(|| storage::opener::protocol_path(std::ffi::OsStr::new(name)).ok())
        .flatten();
    let resolved = match export {
        Some(export) => Ok(export),
        None => engine::backing_name::resolve(path, name),
    };
    if let Ok(r) = &resolved {
        if same_file(r, path) {
            return Err(invalid(
                "Error: Trying to create an image with the same filename as the backing file"
                    .into(),
            ));
        }
    }
    let without_format = || invalid("Backing file specified without backing format".into());
    if args.backing_unsafe {
        let fmt = fmt.ok_or_else(without_format)?;
        opts.backing = Some((name.to_string(), fmt));
        return Ok(size);
    }
    let resolved = resolved.map_err(|e| CreateError::Backing {
        image: image.to_string(),
        source: OpenError::from(EngineError::Backing(e)),
    })?;
    // Without a format the backing file is still opened first, as qemu-img does: one that
    // cannot be opened is reported as such, one that can is named by the format found.
    let fmt = match fmt {
        Some(fmt) => fmt,
        None => {
            let found =
                engine_run::probe_format(&resolved).map_err(|source| CreateError::Backing {
                    image: image.to_string(),
                    source,
                })?;
            return Err(invalid(format!(
                "Backing file specified without backing format\nDetected format of {}.",
                engine_run::format_name(found)
            )));
        }
    };
    opts.backing = Some((name.to_string(), fmt));
    // Only its size is needed: an encrypted backing file opens without its password, as
    // QEMU opens it without I/O.
    let opts = engine::OpenOptions {
        read_only: true,
        format: Some(fmt),
        no_io: true,
        passwords: crate::common::secrets::passwords_for(&resolved),
        ..engine::OpenOptions::default()
    };
    let backing = Image::open(&engine_run::opener(), &resolved, &opts)
        .await
        .map_err(|source| CreateError::Backing {
            image: image.to_string(),
            source: OpenError::from(source),
        })?;
    Ok(size.or(Some(backing.size())))
}

/// True when `a` and `b` name the same file: equal as written, or equal once canonicalized.
fn same_file(a: &Path, b: &Path) -> bool {
    a == b || crate::tools::same_file(a, b)
}

/// Runs `create` and returns the exit status.
pub fn main(args: &CreateArgs) -> ExitCode {
    let res = engine_run::block_on(create(args)).map_err(|source| CreateError::Io {
        image: String::new(),
        what: "starting the runtime",
        source,
    });
    engine_run::exit_code(res.and_then(|r| r))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_are_read_as_qemu_img_reads_them() {
        assert!(matches!(
            parse_image_size("1Q"),
            Err(CreateError::InvalidSize(_))
        ));
        assert!(matches!(
            parse_image_size("100E"),
            Err(CreateError::SizeOutOfRange)
        ));
        assert_eq!(parse_image_size("1G").unwrap(), 1 << 30);
    }
}
