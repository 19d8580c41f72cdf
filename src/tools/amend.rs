//! `qcow2-nbd amend`: change a qcow2 image's options in place, with `qemu-img amend`'s
//! option names, checks, messages and exit codes: `compat`, `lazy_refcounts`,
//! `refcount_bits`, `size`, and `backing_file`/`backing_fmt` (which, as in qemu-img 10, may
//! only name the current ones).

use std::path::PathBuf;
use std::process::ExitCode;

use clap::Args;
use qcow2::crypto::SlotChange;
use qcow2::engine::{AmendError, AmendOptions, EngineError, Format, Image, OpenOptions};
use storage::AnyStorage;

use crate::common::engine_run::{self, OpenError};
use crate::common::options::{self, Kind, OptionsError, Parsed, Spec};
use crate::tools::create::QCOW2_OPTIONS;
use crate::tools::progress::Progress;

/// The options `amend` changes, as qemu-img lists them for qcow2.
const AMEND_NAMES: &[&str] = &[
    "backing_file",
    "backing_fmt",
    "compat",
    "data_file",
    "data_file_raw",
    "lazy_refcounts",
    "refcount_bits",
    "size",
];

/// The key slot options of a LUKS-encrypted image, with qemu-img's help texts.
const KEY_SLOT_OPTIONS: &[Spec] = &[
    Spec {
        name: "encrypt.iter-time",
        kind: Kind::Number,
        help: "Time to spend in PBKDF in milliseconds",
    },
    Spec {
        name: "encrypt.keyslot",
        kind: Kind::Number,
        help: "Select a single keyslot to modify explicitly",
    },
    Spec {
        name: "encrypt.new-secret",
        kind: Kind::Str,
        help: "New secret to set in the matching keyslots. Empty string to erase",
    },
    Spec {
        name: "encrypt.old-secret",
        kind: Kind::Str,
        help: "Select all keyslots that match this password",
    },
    Spec {
        name: "encrypt.state",
        kind: Kind::Str,
        help: "Select new state of affected keyslots (active/inactive)",
    },
];

/// The specs of [`AMEND_NAMES`] (each option's kind and help text are `create`'s) and of
/// the key slot options.
fn amend_options() -> Vec<Spec> {
    let mut specs: Vec<Spec> = QCOW2_OPTIONS
        .iter()
        .filter(|s| AMEND_NAMES.contains(&s.name))
        .copied()
        .chain(KEY_SLOT_OPTIONS.iter().copied())
        .collect();
    specs.sort_by_key(|s| s.name);
    specs
}

/// The key slot change the options ask for, if any; secrets are looked up by id.
fn slot_change(list: &str, force: bool) -> Result<Option<SlotChange>, AmendCliError> {
    let parsed = Parsed::parse(list, &amend_options(), &[]).map_err(AmendCliError::Options)?;
    slot_change_of(&parsed, "encrypt.", force)
}

/// The key slot options of a LUKS volume: qcow2's without the `encrypt.` prefix.
fn luks_amend_options() -> Vec<Spec> {
    KEY_SLOT_OPTIONS
        .iter()
        .map(|s| Spec {
            name: s.name.strip_prefix("encrypt.").unwrap_or(s.name),
            ..*s
        })
        .collect()
}

/// The key slot change parsed options ask for, their names prefixed with `prefix`.
fn slot_change_of(
    parsed: &Parsed,
    prefix: &str,
    force: bool,
) -> Result<Option<SlotChange>, AmendCliError> {
    let key = |name: &str| format!("{prefix}{name}");
    if !KEY_SLOT_OPTIONS
        .iter()
        .any(|s| parsed.has(&key(s.name.strip_prefix("encrypt.").unwrap_or(s.name))))
    {
        return Ok(None);
    }
    let secret = |name: &str| -> Result<Option<Vec<u8>>, AmendCliError> {
        parsed
            .str(&key(name))
            .map(|id| crate::common::secrets::secret(id).map_err(AmendCliError::Slots))
            .transpose()
    };
    let activate = match parsed.str(&key("state")) {
        Some("active") => true,
        Some("inactive") => false,
        Some(other) => {
            return Err(AmendCliError::Slots(format!(
                "Parameter 'state' does not accept value '{other}'"
            )))
        }
        None => return Err(AmendCliError::Slots("Parameter 'state' is missing".into())),
    };
    Ok(Some(SlotChange {
        activate,
        new_password: secret("new-secret")?,
        old_password: secret("old-secret")?,
        keyslot: parsed.num(&key("keyslot")),
        iter_time_ms: parsed.num(&key("iter-time")),
        force,
    }))
}

/// Progress is counted in billionths: qemu-img prints a value once it is more than a point
/// past the last one printed, judged on the exact value, so hundredths would print late.
const PROGRESS_UNITS: u64 = 1_000_000_000;

/// Arguments of `amend`.
#[derive(Args, Debug)]
#[command(
    about = "Change the options of a qcow2 image in place, like `qemu-img amend`",
    long_about = "Change the options of a qcow2 image in place, like `qemu-img amend`.\n\n\
        -o takes compat=0.10|1.1 (downgrading turns zero clusters into data, snapshots' \
        included; refused with extended L2 entries, other refcount widths, persistent \
        bitmaps and snapshots of another size, after the other changes asked for), lazy_refcounts=on|off, refcount_bits=1|2|4|8|16|32|64 (a \
        narrower width is refused when some refcount does not fit), size=SIZE, and \
        backing_file/backing_fmt, which may only name the current backing file (use a \
        rebase to change it), data_file=NAME (renames the external data file of an image \
        that has one; empty drops the name) and data_file_raw=off. Combined, they apply in QEMU's order: upgrade, refcount \
        width, lazy refcounts, size, downgrade. \
        `-o help` lists them. Creation-only options (cluster_size, extended_l2, ...) are \
        refused."
)]
pub struct AmendArgs {
    /// Options to change, `key=value,...` (`-o help` lists them); may be repeated.
    #[arg(short = 'o', long = "options")]
    pub options: Vec<String>,
    /// Format of FILENAME (only qcow2 can be amended).
    #[arg(short = 'f', long = "format", value_name = "FMT")]
    pub format: Option<String>,
    /// Show progress (a bar on stderr; invoked as qemu-img, its `(xx.xx/100%)` lines on
    /// stdout).
    #[arg(short = 'p', long = "progress")]
    pub progress: bool,
    /// Quiet (amend prints nothing on success anyway).
    #[arg(short = 'q', long)]
    pub quiet: bool,
    /// With encrypt.state: overwrite an active key slot, or erase the last one (which
    /// makes the data unreadable for ever).
    #[arg(long)]
    pub force: bool,
    /// The image to change.
    pub filename: Option<PathBuf>,
}

/// Why `amend` failed, in qemu-img's words.
#[derive(Debug, thiserror::Error)]
enum AmendCliError {
    #[error("Must specify options (-o)")]
    NoOptions,
    #[error("Expecting one image file name")]
    NoImage,
    #[error("{0}")]
    Options(OptionsError),
    #[error("Invalid parameter '{0}'\nThis option is only supported for image creation")]
    CreationOnly(String),
    #[error("Unknown compatibility level {0}")]
    Compat(String),
    #[error("Format driver '{0}' does not support option amendment")]
    NotAmendable(String),
    #[error(transparent)]
    Open(#[from] OpenError),
    #[error("{}", engine_reason(.0))]
    Engine(EngineError),
    #[error("{0}")]
    Runtime(std::io::Error),
    /// A key slot change refused, in QEMU's words.
    #[error("{0}")]
    Slots(String),
}

/// An amend that failed; a snapshot's L1 table that stopped it is named on a line of its
/// own first, as qemu-img names it.
fn engine_failed(e: EngineError) -> AmendCliError {
    if let EngineError::Amend {
        source: AmendError::ZeroExpansion(problem),
        ..
    } = &e
    {
        eprintln!("{}: {problem}", crate::common::prog::name());
    }
    AmendCliError::Engine(e)
}

/// QEMU's reason alone where it has one, anything else in full.
fn engine_reason(e: &EngineError) -> String {
    match e {
        EngineError::Amend { source, .. } => source.to_string(),
        EngineError::Resize { source, .. } => source.to_string(),
        EngineError::Bitmap { source, .. } => source.to_string(),
        EngineError::Crypto { source, .. } => source.to_string(),
        other => other.to_string(),
    }
}

/// The `-o help` text of amend.
fn amend_help() -> String {
    options::help_text(&amend_options()).replacen(
        "Supported options:",
        "Amend options for 'qcow2':",
        1,
    )
}

/// Checks that images of format `name` can be amended (only qcow2 can), in qemu-img's
/// words for a format it does not know, or knows but cannot amend.
fn amendable_format(name: &str) -> Result<Format, AmendCliError> {
    match engine_run::parse_format(name) {
        Ok(Format::Qcow2) => Ok(Format::Qcow2),
        Ok(Format::Luks) => Ok(Format::Luks),
        Ok(Format::Raw) => Err(AmendCliError::NotAmendable("raw".into())),
        Err(_) if engine_run::QEMU_DRIVERS.contains(&name) => {
            Err(AmendCliError::NotAmendable(name.to_string()))
        }
        Err(e) => Err(e.into()),
    }
}

/// `amend -o help` for a LUKS volume.
fn luks_amend_help() -> String {
    options::help_text(&luks_amend_options()).replacen(
        "Supported options:",
        "Amend options for 'luks':",
        1,
    )
}

/// `amend` of a LUKS volume: only its key slots change.
async fn amend_luks(
    args: &AmendArgs,
    path: &std::path::Path,
    list: &str,
) -> Result<(), AmendCliError> {
    let parsed = Parsed::parse(list, &luks_amend_options(), &[]).map_err(AmendCliError::Options)?;
    let passwords = crate::common::secrets::passwords_for(path);
    let open = OpenOptions {
        format: Some(Format::Luks),
        passwords: passwords.clone(),
        untrusted: crate::common::engine_run::untrusted(),
        ..OpenOptions::default()
    };
    let img: Image<AnyStorage> = Image::open(&engine_run::opener(), path, &open)
        .await
        .map_err(OpenError::from)?;
    let outcome = async {
        let Some(change) = slot_change_of(&parsed, "", args.force)? else {
            return Ok(());
        };
        let password = passwords.get(0).ok_or_else(|| {
            AmendCliError::Slots("Parameter 'key-secret' is required for cipher".into())
        })?;
        img.change_key_slots(password, &change)
            .await
            .map_err(AmendCliError::Engine)
    }
    .await;
    let closed = img.close().await.map_err(AmendCliError::Engine);
    outcome.and(closed)
}

/// Runs `qcow2-nbd amend`.
pub fn main(args: &AmendArgs) -> ExitCode {
    let result = engine_run::block_on(run(args))
        .map_err(AmendCliError::Runtime)
        .and_then(|r| r);
    engine_run::exit_code(result)
}

/// The `-o` list as amend reads it.
fn parse(list: &str) -> Result<AmendOptions, AmendCliError> {
    let parsed = Parsed::parse(list, &amend_options(), &[]).map_err(|e| match e {
        OptionsError::UnknownParameter(name) if QCOW2_OPTIONS.iter().any(|s| s.name == name) => {
            AmendCliError::CreationOnly(name)
        }
        other => AmendCliError::Options(other),
    })?;
    let version = match parsed.str("compat") {
        None => None,
        Some("0.10" | "v2") => Some(2),
        Some("1.1" | "v3") => Some(3),
        Some(other) => return Err(AmendCliError::Compat(other.to_string())),
    };
    Ok(AmendOptions {
        version,
        lazy_refcounts: parsed.bool("lazy_refcounts"),
        refcount_bits: parsed.num("refcount_bits"),
        size: parsed.num("size"),
        backing_file: parsed.str("backing_file").map(str::to_string),
        backing_fmt: parsed.str("backing_fmt").map(str::to_string),
        data_file: parsed.str("data_file").map(str::to_string),
        data_file_raw: parsed.bool("data_file_raw"),
    })
}

async fn run(args: &AmendArgs) -> Result<(), AmendCliError> {
    let list = options::join_lists(&args.options).map_err(AmendCliError::Options)?;
    let Some(list) = list else {
        return Err(AmendCliError::NoOptions);
    };
    // With a format named, help needs no image; without, the image's format decides.
    let named = args.format.as_deref().map(amendable_format).transpose()?;
    if named == Some(Format::Luks) && options::wants_help(&list) {
        print!("{}", luks_amend_help());
        return Ok(());
    }
    if named.is_some() && options::wants_help(&list) {
        print!("{}", amend_help());
        return Ok(());
    }
    let path = args.filename.as_ref().ok_or(AmendCliError::NoImage)?;
    let format = match named {
        Some(f) => f,
        None => amendable_format(engine_run::format_name(engine_run::probe_format(path)?))?,
    };
    if format == Format::Luks {
        if options::wants_help(&list) {
            print!("{}", luks_amend_help());
            return Ok(());
        }
        return amend_luks(args, path, &list).await;
    }
    if named.is_none() && options::wants_help(&list) {
        print!("{}", amend_help());
        return Ok(());
    }
    let open = OpenOptions {
        format: Some(Format::Qcow2),
        passwords: crate::common::secrets::passwords_for(path),
        data_file: crate::common::image_name::data_file_for(path),
        untrusted: crate::common::engine_run::untrusted(),
        ..OpenOptions::default()
    };
    // Opened before the options are read, as qemu-img does: a dirty lazy-refcount image is
    // repaired by the open even when the options are then refused.
    let img: Image<AnyStorage> = Image::open(&engine_run::opener(), path, &open)
        .await
        .map_err(OpenError::from)?;
    let outcome = async {
        let opts = parse(&list)?;
        if let Some(change) = slot_change(&list, args.force)? {
            let passwords = crate::common::secrets::passwords_for(path);
            let password = passwords.get(0).ok_or_else(|| {
                AmendCliError::Slots("Parameter 'encrypt.key-secret' is required for cipher".into())
            })?;
            img.change_key_slots(password, &change)
                .await
                .map_err(AmendCliError::Engine)?;
            if opts == AmendOptions::default() {
                return Ok(());
            }
        }
        // As qemu-img: from 0 before the changes start to 100 after they end, done or not.
        let progress = Progress::for_tool(PROGRESS_UNITS, args.progress, args.quiet);
        let report =
            |percent: f64| progress.set((percent * PROGRESS_UNITS as f64 / 100.0).round() as u64);
        let done = img.amend_with_progress(&opts, &report).await;
        progress.finish();
        done.map_err(engine_failed)
    }
    .await;
    let closed = img.close().await.map_err(AmendCliError::Engine);
    outcome.and(closed)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn options_read_as_qemu_img_reads_them() {
        let o = parse("compat=v2,lazy_refcounts=off,size=8M").unwrap();
        assert_eq!(o.version, Some(2));
        assert_eq!(o.lazy_refcounts, Some(false));
        assert_eq!(o.size, Some(8 << 20));
        assert_eq!(parse("compat=1.1").unwrap().version, Some(3));
        assert_eq!(parse("refcount_bits=64").unwrap().refcount_bits, Some(64));
        let err = |l: &str| parse(l).unwrap_err().to_string();
        assert_eq!(err("compat=2"), "Unknown compatibility level 2");
        assert!(err("cluster_size=4k").contains("only supported for image creation"));
        assert!(err("extended_l2=on").contains("only supported for image creation"));
        assert_eq!(err("bogus=1"), "Invalid parameter 'bogus'");
        assert_eq!(
            parse("data_file=x").unwrap().data_file.as_deref(),
            Some("x")
        );
        assert_eq!(
            parse("data_file_raw=off").unwrap().data_file_raw,
            Some(false)
        );
    }
}
