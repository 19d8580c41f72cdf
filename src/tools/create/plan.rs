//! What the options of a new image ask for: the option tables of qcow2 and raw (shared with
//! `convert -O` and `measure`), the qcow2 plan with qemu-img's checks and messages, and the
//! "Formatting" line qemu-img prints.

use qcow2::crypto::LuksCreate;
use qcow2::engine::compress::Codec;
use qcow2::engine::{CreateOptions, Format, NewEncryption, Preallocation};

use crate::common::engine_run::format_name;
use crate::common::options::{Kind, OptionsError, Parsed, Spec, Value};

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

/// Options of raw images, as the raw format itself knows them (its file brings the rest).
pub const RAW_OPTIONS: &[Spec] = &[Spec {
    name: "size",
    kind: Kind::Size,
    help: "Virtual disk size",
}];

/// Options of the file an image is written to (QEMU's `file` protocol); every format
/// takes them, its own definition winning where it has one (qcow2's `preallocation`).
pub const FILE_OPTIONS: &[Spec] = &[
    Spec {
        name: "extent_size_hint",
        kind: Kind::Size,
        help: "Extent size hint for the image file, 0 to disable",
    },
    Spec {
        name: "nocow",
        kind: Kind::Bool,
        help: "Turn off copy-on-write (valid only on btrfs)",
    },
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
        name: "detached-header",
        kind: Kind::Bool,
        help: "Create a detached LUKS header",
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
        help: "ID of the secret that provides the keyslot passphrase",
    },
    Spec {
        name: "size",
        kind: Kind::Size,
        help: "Virtual disk size",
    },
];

/// The options of a format alone: what `-o help` lists when no file is named.
pub fn format_options(format: Format) -> &'static [Spec] {
    match format {
        Format::Qcow2 => QCOW2_OPTIONS,
        Format::Raw => RAW_OPTIONS,
        Format::Luks => LUKS_OPTIONS,
    }
}

/// The options a new image of `format` takes: the format's own, then those of the file it
/// is written to that the format does not define itself.
pub fn option_table(format: Format) -> Vec<Spec> {
    let own = format_options(format);
    let mut specs = own.to_vec();
    specs.extend(
        FILE_OPTIONS
            .iter()
            .filter(|f| !own.iter().any(|s| s.name == f.name))
            .copied(),
    );
    specs
}

/// The `-o help` text for a new image of `format`: with a file named, the format's and the
/// file's options together; without, the format's alone and a note saying so (qemu-img's
/// layout).
pub fn creation_help(format: Format, with_file: bool) -> String {
    if with_file {
        return crate::common::options::help_text(&option_table(format));
    }
    let text = crate::common::options::help_text(format_options(format));
    format!(
        "{}\nThe protocol level may support further options.\nSpecify the target filename to include those options.\n",
        text.replacen(
            "Supported options:",
            &format!("Supported {} options:", format_name(format)),
            1
        )
    )
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
        crate::common::secrets::secret(id)
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

/// The password and header settings of a new LUKS volume (`-f luks`), from options named as
/// QEMU's `luks` driver names them (qcow2's `encrypt.*` without the prefix), with its
/// messages.
pub fn luks_volume_settings(p: &Parsed) -> Result<(Vec<u8>, LuksCreate), String> {
    if p.bool("detached-header") == Some(true) {
        return Err("a detached LUKS header is not supported".into());
    }
    // The qcow2 option names, so that one reading serves both.
    let mut prefixed = Parsed::default();
    for spec in QCOW2_OPTIONS
        .iter()
        .filter(|s| s.name.starts_with("encrypt."))
    {
        if let Some(v) = p
            .given(&spec.name["encrypt.".len()..])
            .map(|(_, t)| t.to_string())
        {
            prefixed.set_raw(spec, &v);
        }
    }
    if let Some(spec) = QCOW2_OPTIONS.iter().find(|s| s.name == "encrypt.format") {
        prefixed.set_raw(spec, "luks");
    }
    match encryption_settings(&prefixed).map_err(|e| e.replace("encrypt.", ""))? {
        Some(NewEncryption::Luks { password, opts }) => Ok((password, opts)),
        _ => Err("LUKS options expected".into()),
    }
}

/// The header settings a new LUKS volume's options name: what `measure -O luks` sizes the
/// header by. QEMU reads the whole creation options there, so the secret must be named and
/// defined, though it is not used.
pub fn luks_header_settings(p: &Parsed) -> Result<LuksCreate, String> {
    use qcow2::crypto::{CipherAlg, CipherMode};
    let id = p
        .str("key-secret")
        .ok_or("Parameter 'key-secret' is required for cipher")?;
    crate::common::secrets::secret(id)?;
    let bad = |name: &str, v: &str| format!("Invalid parameter '{v}' for {name}");
    let mut opts = LuksCreate::default();
    if let Some(v) = p.str("cipher-alg") {
        opts.cipher = CipherAlg::from_name(v).ok_or_else(|| bad("cipher-alg", v))?;
    }
    if let Some(v) = p.str("cipher-mode") {
        opts.mode = CipherMode::from_name(v).ok_or_else(|| bad("cipher-mode", v))?;
    }
    Ok(opts)
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
pub(super) fn qcow2_settings(p: &Parsed) -> Result<Qcow2Plan, String> {
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
pub(super) fn check_qcow2_plan(plan: &Qcow2Plan, has_backing: bool) -> Result<(), String> {
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

/// A LUKS volume's options in the order of QEMU's `luks` driver, then its file's.
const LUKS_LINE_ORDER: &[(&str, Option<&str>)] = &[
    ("size", None),
    ("key-secret", None),
    ("cipher-alg", None),
    ("cipher-mode", None),
    ("ivgen-alg", None),
    ("ivgen-hash-alg", None),
    ("hash-alg", None),
    ("iter-time", None),
    ("detached-header", None),
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
        Format::Luks => LUKS_LINE_ORDER,
    };
    let mut s = format!("Formatting '{image}', fmt={}", format_name(format));
    for &(name, default) in order {
        let value = match (name, parsed.given(name)) {
            ("size", _) => (size as i64).to_string(),
            (_, Some((Value::Num(n), _))) => (*n as i64).to_string(),
            (_, Some((Value::Str(t), _))) => t.replace(',', ",,"),
            (_, Some((Value::Bool(_), text))) => text.to_string(),
            (_, None) => match default {
                Some(d) => d.to_string(),
                None => continue,
            },
        };
        s.push_str(&format!(" {name}={value}"));
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    fn plan(list: &str, backing: bool) -> Result<Qcow2Plan, String> {
        let p = Parsed::parse(list, QCOW2_OPTIONS, &[]).map_err(|e| e.to_string())?;
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
                &Parsed::parse("preallocation=falloc", &option_table(Format::Raw), &[]).unwrap(),
                1000
            ),
            "Formatting 'r', fmt=raw size=1000 preallocation=falloc"
        );
    }
}
