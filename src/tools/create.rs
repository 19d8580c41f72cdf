//! `qcow2-nbd create`: new qcow2 (or sparse raw) images with `qemu-img create`'s option
//! names, size suffixes, defaults, checks and messages. The qcow2 option table and its checks
//! are shared with `convert -O qcow2`.

use std::path::{Path, PathBuf};
use std::process::ExitCode;

use clap::Args;
use qcow2::engine::compress::Codec;
use qcow2::engine::{
    self as engine, CreateOptions, EngineError, Format, Image, NewEncryption, Preallocation,
};
use storage::{IoBuf, Opener, Storage};

use crate::engine_run::{self, format_name, OpenError};
use crate::options::{self, Kind, OptionsError, Parsed, Spec};
use crate::size_string::{self, ParseSizeError};

/// Options of qcow2 images (`-o help` lists them).
pub const QCOW2_OPTIONS: &[Spec] = &[
    Spec {
        name: "backing_file",
        kind: Kind::Str,
        help: "File name of a base image",
    },
    Spec {
        name: "backing_fmt",
        kind: Kind::Str,
        help: "Image format of the base image",
    },
    Spec {
        name: "cluster_size",
        kind: Kind::Size,
        help: "qcow2 cluster size",
    },
    Spec {
        name: "compat",
        kind: Kind::Str,
        help: "Compatibility level (v2 [0.10] or v3 [1.1])",
    },
    Spec {
        name: "compression_type",
        kind: Kind::Str,
        help: "Compression method used for image cluster compression",
    },
    Spec {
        name: "data_file",
        kind: Kind::Str,
        help: "File name of an external data file",
    },
    Spec {
        name: "data_file_raw",
        kind: Kind::Bool,
        help: "The external data file must stay valid as a raw image",
    },
    Spec {
        name: "encrypt.cipher-alg",
        kind: Kind::Str,
        help: "Name of encryption cipher algorithm",
    },
    Spec {
        name: "encrypt.cipher-mode",
        kind: Kind::Str,
        help: "Name of encryption cipher mode",
    },
    Spec {
        name: "encrypt.format",
        kind: Kind::Str,
        help: "Encrypt the image, format choices: 'aes', 'luks'",
    },
    Spec {
        name: "encrypt.hash-alg",
        kind: Kind::Str,
        help: "Name of encryption hash algorithm",
    },
    Spec {
        name: "encrypt.iter-time",
        kind: Kind::Number,
        help: "Time to spend in PBKDF in milliseconds",
    },
    Spec {
        name: "encrypt.ivgen-alg",
        kind: Kind::Str,
        help: "Name of IV generator algorithm",
    },
    Spec {
        name: "encrypt.ivgen-hash-alg",
        kind: Kind::Str,
        help: "Name of IV generator hash algorithm",
    },
    Spec {
        name: "encrypt.key-secret",
        kind: Kind::Str,
        help: "ID of secret providing qcow AES key or LUKS passphrase",
    },
    Spec {
        name: "encryption",
        kind: Kind::Bool,
        help: "Encrypt the image with format 'aes'. (Deprecated in favor of encrypt.format=aes)",
    },
    Spec {
        name: "extended_l2",
        kind: Kind::Bool,
        help: "Extended L2 tables",
    },
    Spec {
        name: "lazy_refcounts",
        kind: Kind::Bool,
        help: "Postpone refcount updates",
    },
    Spec {
        name: "preallocation",
        kind: Kind::Str,
        help: "Preallocation mode (allowed values: off, metadata, falloc, full)",
    },
    Spec {
        name: "refcount_bits",
        kind: Kind::Number,
        help: "Width of a reference count entry in bits",
    },
    Spec {
        name: "size",
        kind: Kind::Size,
        help: "Virtual disk size",
    },
];

/// qcow2 options QEMU has that we do not implement (refused by name, not as unknown).
pub const QCOW2_UNSUPPORTED: &[&str] = &["extent_size_hint", "nocow"];

/// Options of raw images.
pub const RAW_OPTIONS: &[Spec] = &[
    Spec {
        name: "preallocation",
        kind: Kind::Str,
        help: "Preallocation mode (allowed values: off, falloc, full)",
    },
    Spec {
        name: "size",
        kind: Kind::Size,
        help: "Virtual disk size",
    },
];

/// Options of raw LUKS volumes (`-f luks`): the `encrypt.*` options of qcow2, unprefixed.
pub const LUKS_OPTIONS: &[Spec] = &[
    Spec {
        name: "cipher-alg",
        kind: Kind::Str,
        help: "Name of encryption cipher algorithm",
    },
    Spec {
        name: "cipher-mode",
        kind: Kind::Str,
        help: "Name of encryption cipher mode",
    },
    Spec {
        name: "hash-alg",
        kind: Kind::Str,
        help: "Name of encryption hash algorithm",
    },
    Spec {
        name: "iter-time",
        kind: Kind::Number,
        help: "Time to spend in PBKDF in milliseconds",
    },
    Spec {
        name: "ivgen-alg",
        kind: Kind::Str,
        help: "Name of IV generator algorithm",
    },
    Spec {
        name: "ivgen-hash-alg",
        kind: Kind::Str,
        help: "Name of IV generator hash algorithm",
    },
    Spec {
        name: "key-secret",
        kind: Kind::Str,
        help: "ID of secret providing LUKS passphrase",
    },
    Spec {
        name: "size",
        kind: Kind::Size,
        help: "Virtual disk size",
    },
];

/// raw options QEMU has that we do not implement.
pub const RAW_UNSUPPORTED: &[&str] = &["extent_size_hint", "nocow"];

/// The option table for a format.
pub fn option_table(format: Format) -> (&'static [Spec], &'static [&'static str]) {
    match format {
        Format::Qcow2 => (QCOW2_OPTIONS, QCOW2_UNSUPPORTED),
        Format::Raw => (RAW_OPTIONS, RAW_UNSUPPORTED),
    }
}

/// Arguments of `create`.
#[derive(Args, Debug)]
pub struct CreateArgs {
    /// Format of the new image: qcow2 (the default here) or raw.
    #[arg(short = 'f', long = "format", default_value = "qcow2")]
    pub format: String,
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

/// What a new qcow2 image will be, decided from the options.
#[derive(Debug, Clone)]
pub struct Qcow2Plan {
    /// The engine's creation options (size and backing filled in by the caller).
    pub opts: CreateOptions,
}

/// The encryption settings that mean nothing without `encrypt.format`, taken from the
/// "Formatting" line's list.
fn encrypt_settings() -> impl Iterator<Item = &'static str> {
    QCOW2_LINE_ORDER
        .iter()
        .map(|(name, _)| *name)
        .filter(|n| n.starts_with("encrypt.") && *n != "encrypt.format")
}

/// The encryption the options ask for, with qemu-img's messages; the secret must have been
/// defined with `--object secret`.
pub fn encryption_settings(p: &Parsed) -> Result<Option<NewEncryption>, String> {
    use qcow2::crypto::{CipherAlg, CipherMode, HashAlg, IvGen, LuksCreate};
    let format = match (p.bool("encryption"), p.str("encrypt.format")) {
        (Some(true), Some(_)) => {
            return Err(
                "Options \"encryption\" and \"encrypt.format\" are mutually exclusive".into(),
            )
        }
        (Some(true), None) => "aes",
        (_, Some(f)) => f,
        (_, None) => {
            if encrypt_settings().any(|n| p.has(n)) {
                // QEMU reads the settings as one structure whose kind encrypt.format gives.
                return Err("Parameter 'encrypt.format' is missing".into());
            }
            return Ok(None);
        }
    };
    let password = || -> Result<Vec<u8>, String> {
        let id = p
            .str("encrypt.key-secret")
            .ok_or("Parameter 'encrypt.key-secret' is required for cipher")?;
        crate::secrets::secret(id)
    };
    let bad = |name: &str, v: &str| format!("Invalid parameter '{v}' for {name}");
    match format {
        "aes" => Ok(Some(NewEncryption::LegacyAes {
            password: password()?,
        })),
        "luks" => {
            let mut opts = LuksCreate::default();
            if let Some(v) = p.str("encrypt.cipher-alg") {
                opts.cipher = CipherAlg::from_name(v).ok_or_else(|| bad("cipher-alg", v))?;
            }
            if let Some(v) = p.str("encrypt.cipher-mode") {
                opts.mode = CipherMode::from_name(v).ok_or_else(|| bad("cipher-mode", v))?;
            }
            if let Some(v) = p.str("encrypt.ivgen-alg") {
                opts.ivgen = IvGen::from_name(v).ok_or_else(|| bad("ivgen-alg", v))?;
            }
            if let Some(v) = p.str("encrypt.hash-alg") {
                opts.hash = HashAlg::from_name(v).ok_or_else(|| bad("hash-alg", v))?;
            }
            if let Some(ms) = p.num("encrypt.iter-time") {
                opts.iter_time_ms = ms.max(1);
            }
            Ok(Some(NewEncryption::Luks {
                password: password()?,
                opts,
            }))
        }
        other => Err(format!(
            "Parameter 'encrypt.format' does not accept value '{other}'"
        )),
    }
}

/// Decides the qcow2 settings from parsed options, with qemu-img's checks and messages (size
/// and backing file are checked by the caller, which knows them).
pub fn qcow2_plan(p: &Parsed, has_backing: bool) -> Result<Qcow2Plan, String> {
    let plan = qcow2_settings(p)?;
    check_qcow2_plan(&plan, has_backing)?;
    Ok(plan)
}

/// The qcow2 settings the options name, unchecked: what qemu-img's "Formatting" line shows
/// before the driver refuses a combination.
fn qcow2_settings(p: &Parsed) -> Result<Qcow2Plan, String> {
    let version = match p.str("compat") {
        None | Some("1.1") | Some("v3") => 3,
        Some("0.10") | Some("v2") => 2,
        Some(other) => {
            return Err(OptionsError::BadValue {
                name: "version",
                value: other.into(),
            }
            .to_string())
        }
    };
    let preallocation = match p.str("preallocation") {
        None => Preallocation::Off,
        Some(s) => Preallocation::from_name(s).ok_or_else(|| {
            OptionsError::BadValue {
                name: "preallocation",
                value: s.into(),
            }
            .to_string()
        })?,
    };
    let compression = match p.str("compression_type") {
        None | Some("zlib") => Codec::Zlib,
        Some("zstd") => Codec::Zstd,
        Some(other) => {
            return Err(OptionsError::BadValue {
                name: "compression-type",
                value: other.into(),
            }
            .to_string())
        }
    };
    let extended_l2 = p.bool("extended_l2").unwrap_or(false);
    let lazy_refcounts = p.bool("lazy_refcounts").unwrap_or(false);
    let cluster_size = p.num("cluster_size").unwrap_or(65536);
    let refcount_bits = p.num("refcount_bits").unwrap_or(16);
    let encryption = encryption_settings(p)?;
    Ok(Qcow2Plan {
        opts: CreateOptions {
            size: 0,
            cluster_size,
            extended_l2,
            // Out of range values saturate; the check refuses them.
            refcount_bits: u32::try_from(refcount_bits).unwrap_or(u32::MAX),
            compression,
            lazy_refcounts,
            version,
            preallocation,
            backing: None,
            data_file: p.str("data_file").map(str::to_string),
            data_file_raw: p.bool("data_file_raw").unwrap_or(false),
            encryption,
        },
    })
}

/// qemu-img's checks of a combination of qcow2 settings, with its messages.
fn check_qcow2_plan(plan: &Qcow2Plan, has_backing: bool) -> Result<(), String> {
    let o = &plan.opts;
    let (version, extended_l2, lazy_refcounts) = (o.version, o.extended_l2, o.lazy_refcounts);
    let (cluster_size, refcount_bits) = (o.cluster_size, u64::from(o.refcount_bits));
    let (preallocation, compression) = (o.preallocation, o.compression);
    const V3: &str = "(use version=v3 or greater)";
    if version < 3 && extended_l2 {
        return Err(format!(
            "Extended L2 entries are only supported with compatibility level 1.1 and above {V3}"
        ));
    }
    if !cluster_size.is_power_of_two() || !(512..=2 << 20).contains(&cluster_size) {
        return Err("Cluster size must be a power of two between 512 and 2048k".into());
    }
    if extended_l2 && cluster_size < 16384 {
        return Err(
            "Extended L2 entries are only supported with cluster sizes of at least 16384 bytes"
                .into(),
        );
    }
    if has_backing && preallocation != Preallocation::Off && !extended_l2 {
        return Err(
            "Backing file and preallocation can only be used at the same time if extended_l2 is on"
                .into(),
        );
    }
    if version < 3 && lazy_refcounts {
        return Err(format!(
            "Lazy refcounts only supported with compatibility level 1.1 and above {V3}"
        ));
    }
    if refcount_bits > 64 || !refcount_bits.is_power_of_two() {
        return Err("Refcount width must be a power of two and may not exceed 64 bits".into());
    }
    if version < 3 && refcount_bits != 16 {
        return Err(format!(
            "Different refcount widths than 16 bits require compatibility level 1.1 or above {V3}"
        ));
    }
    if version < 3 && compression != Codec::Zlib {
        return Err(format!(
            "Non-zlib compression type is only supported with compatibility level 1.1 and above {V3}"
        ));
    }
    if o.data_file_raw && o.data_file.is_none() {
        return Err("data-file-raw requires data-file".into());
    }
    if o.data_file_raw && has_backing {
        return Err("Backing file and data-file-raw cannot be used at the same time".into());
    }
    if version < 3 && o.data_file.is_some() {
        return Err(format!(
            "External data files are only supported with compatibility level 1.1 and above {V3}"
        ));
    }
    Ok(())
}

/// The `preallocation` of a raw image, with qemu-img's messages.
pub fn raw_preallocation(text: Option<&str>) -> Result<Preallocation, String> {
    match text.map(|t| (t, Preallocation::from_name(t))) {
        None => Ok(Preallocation::Off),
        Some((_, Some(Preallocation::Metadata))) => {
            Err("Unsupported preallocation mode: metadata".into())
        }
        Some((_, Some(p))) => Ok(p),
        Some((t, None)) => Err(OptionsError::BadValue {
            name: "preallocation",
            value: t.into(),
        }
        .to_string()),
    }
}

/// QEMU's limit: the L1 table may not exceed 32 MiB, which caps the virtual size per
/// cluster size.
pub fn check_qcow2_size(opts: &CreateOptions) -> Result<(), String> {
    let entry_bytes = if opts.extended_l2 { 16 } else { 8 };
    let per_l2 = u128::from(opts.cluster_size) * u128::from(opts.cluster_size / entry_bytes);
    let l1_entries = u128::from(opts.size).div_ceil(per_l2);
    if l1_entries * 8 > 32 << 20 {
        return Err(
            "The image size is too large for file format 'qcow2' (try using a larger cluster size)"
                .into(),
        );
    }
    Ok(())
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

/// The options of qcow2 images in the order qemu-img lists them in its "Formatting" line (the
/// qcow2 driver's table, then the file protocol's), with the defaults it shows when an option
/// is not given.
const QCOW2_LINE_ORDER: &[(&str, Option<&str>)] = &[
    ("encryption", None),
    ("encrypt.format", None),
    ("encrypt.key-secret", None),
    ("encrypt.cipher-alg", None),
    ("encrypt.cipher-mode", None),
    ("encrypt.ivgen-alg", None),
    ("encrypt.ivgen-hash-alg", None),
    ("encrypt.hash-alg", None),
    ("encrypt.iter-time", None),
    ("cluster_size", Some("65536")),
    ("extended_l2", Some("off")),
    ("preallocation", None),
    ("compression_type", Some("zlib")),
    ("size", None),
    ("compat", None),
    ("backing_file", None),
    ("backing_fmt", None),
    ("data_file", None),
    ("data_file_raw", None),
    ("lazy_refcounts", Some("off")),
    ("refcount_bits", Some("16")),
    ("nocow", None),
    ("extent_size_hint", None),
];

/// The same for raw images: the raw driver's `size`, then the file protocol's options.
const RAW_LINE_ORDER: &[(&str, Option<&str>)] = &[
    ("size", None),
    ("nocow", None),
    ("preallocation", None),
    ("extent_size_hint", None),
];

/// The line qemu-img prints before creating an image: every option given or with a default,
/// in the format's order; text with `,` doubled, numbers and sizes as the signed value read
/// (as QEMU prints them), booleans as written. `size` is the size the image gets.
pub fn formatting_line(image: &str, format: Format, parsed: &Parsed, size: u64) -> String {
    let order = match format {
        Format::Qcow2 => QCOW2_LINE_ORDER,
        Format::Raw => RAW_LINE_ORDER,
    };
    let mut s = format!("Formatting '{image}', fmt={}", format_name(format));
    for &(name, default) in order {
        let value = match (name, parsed.given(name)) {
            ("size", _) => (size as i64).to_string(),
            (_, Some((options::Value::Num(n), _))) => (*n as i64).to_string(),
            (_, Some((options::Value::Str(t), _))) => t.replace(',', ",,"),
            (_, Some((options::Value::Bool(_), text))) => text.to_string(),
            (_, None) => match default {
                Some(d) => d.to_string(),
                None => continue,
            },
        };
        s.push_str(&format!(" {name}={value}"));
    }
    s
}

/// Writes a new qcow2 image at `path` (replacing any file there) and preallocates it. The
/// engine refuses preallocation with a backing file, which QEMU allows with extended L2
/// entries (the clusters are reserved, their subclusters stay unallocated), so the image is
/// created first and preallocated without opening its backing file.
pub async fn create_qcow2(path: &Path, opts: &CreateOptions) -> Result<(), EngineError> {
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
/// reserved (`falloc`) or written with zeros (`full`) when asked.
pub async fn create_raw(path: &Path, size: u64, prealloc: Preallocation) -> std::io::Result<()> {
    let file = engine_run::opener()
        .open(path, storage::OpenOptions::create())
        .await?;
    let size = size
        .checked_next_multiple_of(512)
        .ok_or_else(|| std::io::Error::other("size too large"))?;
    file.set_len(0).await?;
    file.set_len(size).await?;
    match prealloc {
        Preallocation::Off | Preallocation::Metadata => {}
        Preallocation::Falloc => file.write_zeroes_at(0, size, false).await?,
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
    if args.format == "luks" {
        return create_luks_image(args).await;
    }
    let format = engine_run::parse_format(&args.format)?;
    let (specs, _) = option_table(format);
    let list = options::join_lists(&args.options).map_err(|source| CreateError::Options {
        image: args
            .image
            .as_ref()
            .map_or_else(String::new, |p| p.display().to_string()),
        source,
    })?;
    if list.as_deref().is_some_and(options::wants_help) {
        print!("{}", options::help_text(specs));
        return Ok(());
    }
    let named = args.image.as_ref().ok_or(CreateError::NoImage)?;
    // Messages show the name as given; the file is what a `file:` prefix leaves.
    let image = named.display().to_string();
    let file = crate::image_name::protocol_path(named.as_os_str()).map_err(|reason| {
        CreateError::Invalid {
            image: image.clone(),
            detail: reason.to_string(),
        }
    })?;
    let image_path = &file;
    let parsed = parse_options(args, format, list.as_deref(), &image)?;
    let size = requested_size(args, &parsed, &image)?;
    match format {
        Format::Raw => create_raw_image(args, image_path, &image, &parsed, size).await,
        Format::Qcow2 => create_qcow2_image(args, image_path, &image, &parsed, size).await,
    }
}

/// Creates a raw LUKS volume (`-f luks`): the LUKS header and key material, then the
/// payload. Only created here, never opened: the encryption this project serves is
/// qcow2's own.
async fn create_luks_image(args: &CreateArgs) -> Result<(), CreateError> {
    let image_path = args.image.as_ref().ok_or(CreateError::NoImage)?;
    let image = image_path.display().to_string();
    let options_error = |source| CreateError::Options {
        image: image.clone(),
        source,
    };
    let list = options::join_lists(&args.options).map_err(options_error)?;
    if list.as_deref().is_some_and(options::wants_help) {
        print!("{}", options::help_text(LUKS_OPTIONS));
        return Ok(());
    }
    let parsed = match list.as_deref() {
        Some(l) => Parsed::parse(l, LUKS_OPTIONS, &[]).map_err(options_error)?,
        None => Parsed::default(),
    };
    let invalid = CreateError::invalid(&image);
    let size = match (&args.size, parsed.num("size")) {
        (Some(s), _) => {
            size_string::parse_size(s).map_err(|_| CreateError::InvalidSize(s.clone()))?
        }
        (None, Some(n)) => n,
        (None, None) => return Err(invalid("Image creation needs a size parameter".into())),
    };
    if !args.quiet {
        let mut line = format!("Formatting '{image}', fmt=luks size={size}");
        for name in [
            "key-secret",
            "cipher-alg",
            "cipher-mode",
            "ivgen-alg",
            "ivgen-hash-alg",
            "hash-alg",
            "iter-time",
        ] {
            if let Some(v) = parsed.given(name).map(|(_, t)| t.to_string()) {
                line.push_str(&format!(" {name}={v}"));
            }
        }
        println!("{line}");
    }
    // The qcow2 option names, so that one reading serves both.
    let mut prefixed = Parsed::default();
    for spec in QCOW2_OPTIONS
        .iter()
        .filter(|s| s.name.starts_with("encrypt."))
    {
        if let Some(v) = parsed
            .given(&spec.name["encrypt.".len()..])
            .map(|(_, t)| t.to_string())
        {
            prefixed.set_raw(spec, &v);
        }
    }
    prefixed.set_raw(
        QCOW2_OPTIONS
            .iter()
            .find(|s| s.name == "encrypt.format")
            .expect("listed"),
        "luks",
    );
    let luks = encryption_settings(&prefixed).map_err(|e| invalid(e.replace("encrypt.", "")))?;
    let Some(NewEncryption::Luks { password, opts }) = luks else {
        return Err(invalid("LUKS options expected".into()));
    };
    let io = |what| {
        let image = image.clone();
        move |source| CreateError::Io {
            image: image.clone(),
            what,
            source,
        }
    };
    let (area, _) =
        qcow2::crypto::luks::create(&password, &opts).map_err(|e| invalid(e.to_string()))?;
    let size = size.div_ceil(512) * 512;
    let file = engine_run::opener()
        .open(image_path, storage::OpenOptions::create())
        .await
        .map_err(io("creating the LUKS volume"))?;
    file.set_len(0).await.map_err(io("truncating"))?;
    let (res, _) = file.write_at(IoBuf::from_slice(&area).into(), 0).await;
    res.map_err(io("writing the LUKS header"))?;
    file.set_len(area.len() as u64 + size)
        .await
        .map_err(io("sizing the LUKS volume"))?;
    file.flush().await.map_err(io("flushing"))
}

/// Parses the `-o` list and lets `-b` and `-F` override it, as qemu-img does.
fn parse_options(
    args: &CreateArgs,
    format: Format,
    list: Option<&str>,
    image: &str,
) -> Result<Parsed, CreateError> {
    let (specs, unsupported) = option_table(format);
    let mut parsed = match list {
        Some(l) => Parsed::parse(l, specs, unsupported).map_err(|source| CreateError::Options {
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
    create_raw(path, size, prealloc)
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
    create_qcow2(path, &plan.opts)
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
    let resolved = match nbd::client::NbdTarget::parse(name) {
        Ok(target) if nbd::client::is_nbd_name(name) => Ok(PathBuf::from(target.display_name())),
        _ => engine::backing_name::resolve(path, name),
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
        passwords: crate::secrets::passwords_for(&resolved),
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
    if a == b {
        return true;
    }
    match (std::fs::canonicalize(a), std::fs::canonicalize(b)) {
        (Ok(x), Ok(y)) => x == y,
        _ => false,
    }
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

    fn plan(list: &str, backing: bool) -> Result<Qcow2Plan, String> {
        let p = Parsed::parse(list, QCOW2_OPTIONS, QCOW2_UNSUPPORTED).map_err(|e| e.to_string())?;
        qcow2_plan(&p, backing)
    }

    #[test]
    fn defaults_are_qemu_img_defaults() {
        let p = plan("size=1M", false).unwrap();
        let d = CreateOptions::default();
        assert_eq!(p.opts.cluster_size, 65536);
        assert_eq!(p.opts.cluster_size, d.cluster_size);
        assert_eq!(p.opts.refcount_bits, 16);
        assert_eq!(p.opts.version, 3);
        assert!(!p.opts.extended_l2 && !p.opts.lazy_refcounts);
        assert_eq!(p.opts.compression, Codec::Zlib);
        assert_eq!(p.opts.preallocation, Preallocation::Off);
    }

    #[test]
    fn options_are_read() {
        let p = plan(
            "cluster_size=128k,extended_l2=on,refcount_bits=64,compression_type=zstd,lazy_refcounts=on,preallocation=falloc,compat=v3",
            false,
        )
        .unwrap();
        assert_eq!(p.opts.cluster_size, 128 << 10);
        assert!(p.opts.extended_l2 && p.opts.lazy_refcounts);
        assert_eq!(p.opts.refcount_bits, 64);
        assert_eq!(p.opts.compression, Codec::Zstd);
        assert_eq!(p.opts.preallocation, Preallocation::Falloc);
        assert_eq!(plan("compat=0.10", false).unwrap().opts.version, 2);
    }

    #[test]
    fn qemu_img_checks_and_messages() {
        let e = |l: &str, b: bool| plan(l, b).unwrap_err();
        assert_eq!(
            e("compat=0.9", false),
            "Parameter 'version' does not accept value '0.9'"
        );
        assert_eq!(
            e("compression_type=lz4", false),
            "Parameter 'compression-type' does not accept value 'lz4'"
        );
        assert_eq!(
            e("preallocation=yes", false),
            "Parameter 'preallocation' does not accept value 'yes'"
        );
        assert_eq!(
            e("cluster_size=1000", false),
            "Cluster size must be a power of two between 512 and 2048k"
        );
        assert_eq!(
            e("cluster_size=4M", false),
            "Cluster size must be a power of two between 512 and 2048k"
        );
        assert_eq!(
            e("cluster_size=4k,extended_l2=on", false),
            "Extended L2 entries are only supported with cluster sizes of at least 16384 bytes"
        );
        assert!(e("compat=0.10,extended_l2=on", false)
            .starts_with("Extended L2 entries are only supported with compatibility level 1.1"));
        assert!(
            e("compat=0.10,lazy_refcounts=on", false).starts_with("Lazy refcounts only supported")
        );
        assert!(e("compat=0.10,refcount_bits=8", false).starts_with("Different refcount widths"));
        assert!(
            e("compat=0.10,compression_type=zstd", false).starts_with("Non-zlib compression type")
        );
        for bits in ["3", "0", "128"] {
            assert_eq!(
                e(&format!("refcount_bits={bits}"), false),
                "Refcount width must be a power of two and may not exceed 64 bits"
            );
        }
        assert_eq!(
            e("preallocation=metadata", true),
            "Backing file and preallocation can only be used at the same time if extended_l2 is on"
        );
        assert!(plan("preallocation=metadata,extended_l2=on", true).is_ok());
    }

    #[test]
    fn size_limits() {
        let mut o = CreateOptions {
            size: 1 << 50,
            ..CreateOptions::default()
        };
        assert!(check_qcow2_size(&o).is_ok());
        o.cluster_size = 512;
        assert!(check_qcow2_size(&o).is_err());
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

    #[test]
    fn formatting_line_matches_qemu_img() {
        let p = Parsed::parse(
            "preallocation=metadata,extended_l2=on,backing_file=b.qcow2,backing_fmt=qcow2",
            QCOW2_OPTIONS,
            &[],
        )
        .unwrap();
        assert_eq!(
            formatting_line("t.qcow2", Format::Qcow2, &p, 2097152),
            "Formatting 't.qcow2', fmt=qcow2 cluster_size=65536 extended_l2=on preallocation=metadata compression_type=zlib size=2097152 backing_file=b.qcow2 backing_fmt=qcow2 lazy_refcounts=off refcount_bits=16"
        );
        assert_eq!(
            formatting_line(
                "r",
                Format::Raw,
                &Parsed::parse("preallocation=falloc", RAW_OPTIONS, &[]).unwrap(),
                1000
            ),
            "Formatting 'r', fmt=raw size=1000 preallocation=falloc"
        );
    }
}
