//! Image names as qemu-img takes them: a plain path, a path behind the `file:` protocol
//! prefix, a `json:{...}` pseudo-filename, or (with `--image-opts`) a `key=value,...` list of
//! block-layer options. All of them come down to a file, the format driver to read it with,
//! and the driver options left over for the subcommand. Only the drivers this tool has are
//! accepted (`qcow2`, `raw`, the `file` protocol, and NBD exports: the `nbd` driver and the
//! NBD names `nbd://`, `nbd+unix://`, `nbd:...`, which become one normalized NBD name the
//! storage opener connects by); QEMU's other block drivers and protocols are refused with
//! the words QEMU uses for a driver it lacks.
//!
//! A name is untrusted input: `json:` text is bounded in size and nesting, and every refusal
//! is a typed error naming what is wrong.

use std::collections::BTreeMap;
use std::ffi::OsStr;
use std::path::{Path, PathBuf};
use std::sync::Mutex;

use crate::options;

/// The longest `json:` text accepted (QEMU has no limit; this only bounds memory).
pub const MAX_JSON_LEN: usize = 1 << 20;

/// The deepest nesting of objects and arrays accepted in `json:` text.
pub const MAX_JSON_DEPTH: usize = 16;

/// Runtime options of the qcow2 driver that tune QEMU's caches, checks or locking: they
/// change no data, and this tool sizes and checks on its own terms, so they are accepted and
/// have no effect.
const QCOW2_NOOP_OPTIONS: &[&str] = &[
    "l2-cache-size",
    "l2-cache-entry-size",
    "refcount-cache-size",
    "cache-size",
    "cache-clean-interval",
    "lazy-refcounts",
    "pass-discard-request",
    "pass-discard-snapshot",
    "pass-discard-other",
    "discard-no-unref",
    "overlap-check",
    "overlap-check.template",
    "overlap-check.main-header",
    "overlap-check.active-l1",
    "overlap-check.active-l2",
    "overlap-check.refcount-table",
    "overlap-check.refcount-block",
    "overlap-check.snapshot-table",
    "overlap-check.inactive-l1",
    "overlap-check.inactive-l2",
    "overlap-check.bitmap-directory",
];

/// Options every node takes in QEMU; none changes what this tool reads or writes.
const NODE_NOOP_OPTIONS: &[&str] = &[
    "node-name",
    "cache.direct",
    "cache.no-flush",
    "discard",
    "detect-zeroes",
    "read-only",
    "auto-read-only",
    "force-share",
];

/// Options of the `file` protocol that change no data.
const FILE_NOOP_OPTIONS: &[&str] = &[
    "aio",
    "aio-max-batch",
    "drop-cache",
    "x-check-cache-dropped",
    "locking",
];

/// Driver options kept for the subcommand rather than checked here (see [`driver_options`]).
/// A feature that takes a driver option adds its key here.
const PASS_THROUGH: &[&str] = &[];

/// True for `encrypt.key-secret` of the image or of a layer below it (`backing.` repeated).
fn is_key_secret(key: &str) -> bool {
    let mut rest = key;
    while let Some(r) = rest.strip_prefix("backing.") {
        rest = r;
    }
    rest == "encrypt.key-secret"
}

/// Why an image name was refused. The texts after `Could not open` are QEMU's.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum NameError {
    /// The name could not be read as QEMU would read it.
    #[error("Could not open '{name}': {reason}")]
    Open {
        /// The name as given.
        name: String,
        /// Why.
        reason: Reason,
    },
    /// `--image-opts` with `-f`.
    #[error("--image-opts and --format are mutually exclusive")]
    FormatWithImageOpts,
    /// The name is not valid UTF-8 (options and JSON are text).
    #[error("Could not open '{0}': the name is not valid UTF-8")]
    NotUtf8(String),
}

/// What is wrong with a name.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Reason {
    /// `json:` text that does not parse.
    #[error("Could not parse the JSON options: {0}")]
    Json(String),
    /// `json:` text that is not an object.
    #[error("Invalid JSON object given")]
    NotObject,
    /// `json:` text longer than [`MAX_JSON_LEN`].
    #[error("Could not parse the JSON options: longer than {MAX_JSON_LEN} bytes")]
    TooLong,
    /// `json:` text nested deeper than [`MAX_JSON_DEPTH`].
    #[error("Could not parse the JSON options: nested deeper than {MAX_JSON_DEPTH} levels")]
    TooDeep,
    /// A driver this tool does not have.
    #[error("Unknown driver '{0}'")]
    UnknownDriver(String),
    /// A `PROTOCOL:` prefix this tool does not have.
    #[error("Unknown protocol '{0}'")]
    UnknownProtocol(String),
    /// A `backing` node that is not the image's own backing file: only that one can be
    /// opened here (the node may describe it again, as QEMU's options allow).
    #[error("the backing node names {given}, but the image's backing file is {found}; qcow2-nbd opens only the image's own backing file")]
    OtherBacking {
        /// The file the node names.
        given: String,
        /// The image's backing file, as its header names it (or that it has none).
        found: String,
    },
    /// A format driver option this tool does not know or does not implement.
    #[error("Block format '{driver}' does not support the option '{option}'")]
    FormatOption {
        /// The format driver.
        driver: String,
        /// The option.
        option: String,
    },
    /// A `file` protocol option this tool does not know.
    #[error("Block protocol 'file' doesn't support the option '{0}'")]
    FileOption(String),
    /// Neither a driver nor a file.
    #[error("Must specify either driver or file")]
    Nothing,
    /// A format driver without its `file` node.
    #[error("A block device must be specified for \"file\"")]
    NoFileNode,
    /// A `compress` filter over a format that cannot take compressed writes.
    #[error("Compression is not supported for underlying format")]
    CompressFormat,
    /// `file` given as a string: in QEMU, the name of another node.
    #[error("Cannot find device='{0}' nor node-name='{0}'")]
    NodeRef(String),
    /// The `file` protocol without a file name.
    #[error("The 'file' block driver requires a file name")]
    NoFilename,
    /// An NBD name or `nbd` driver options that do not name an export.
    #[error("{0}")]
    Nbd(#[from] nbd_client::NameError),
    /// An `nbd` driver option this tool does not know or does not implement.
    #[error("Block protocol 'nbd' doesn't support the option '{0}'")]
    NbdOption(String),
    /// A `null-co` file name other than the one QEMU allows.
    #[error("The only allowed filename for this driver is 'null-co://'")]
    NullFilename,
    /// A `null-co` option value QEMU would refuse.
    #[error("Parameter '{0}' expects {1}")]
    NullValue(String, &'static str),
    /// The `tls-creds` of an `nbd` node cannot be used.
    #[error("{0}")]
    TlsCreds(String),
    /// A `blkdebug:` name that is not valid UTF-8.
    #[error("a blkdebug: name must be valid UTF-8")]
    NotUtf8Blkdebug,
    /// A `blkdebug:` name without both its configuration file and image file.
    #[error("blkdebug requires both config file and image path")]
    BlkdebugName,
    /// A `blkdebug:` configuration file that cannot be read or is not valid.
    #[error("{0}")]
    BlkdebugConfig(#[from] storage::blkdebug::ConfigError),
    /// A `blkdebug` node above a format driver with rules: the format driver announces its
    /// events to its file, so only a blkdebug node under it (the format's `file`, or a
    /// `blkdebug:CONFIG:FILE` name) sees them.
    #[error("qcow2-nbd injects errors only under the format driver, through a blkdebug 'file' node or a 'blkdebug:CONFIG:FILE' file name (option '{0}')")]
    BlkdebugRules(String),
    /// A blkdebug rule list member that is not `inject-error.N.KEY` / `set-state.N.KEY` with
    /// a value.
    #[error("Invalid blkdebug rule option '{0}'")]
    BlkdebugRule(String),
    /// A `blkdebug` limit that is not a size or breaks QEMU's constraints.
    #[error("Cannot meet constraints with {0}")]
    BlkdebugLimit(String),
    /// An option given both as a value and as an object with members.
    #[error("Option '{0}' is given both as a value and as an object")]
    Conflict(String),
}

/// An image name, read.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ImageName {
    /// The file to open.
    pub path: PathBuf,
    /// The format driver named, if any (`None`: probe).
    pub format: Option<String>,
    /// Driver options in [`PASS_THROUGH`] that were given (flattened `a.b` keys).
    pub options: BTreeMap<String, String>,
    /// The `backing` node, when the options describe it: its file and driver.
    pub backing: Option<(PathBuf, Option<String>)>,
    /// The qcow2 image's external data file given as the `data-file` node (`file`
    /// protocol), which replaces the one the header names.
    pub data_file: Option<PathBuf>,
}

/// A flattened option value: JSON `null` is kept apart from text.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Val {
    Text(String),
    Null,
}

/// Reads `name` as qemu-img would: an option list with `image_opts`, else a `json:` name, a
/// `file:`-prefixed path or a plain path.
pub fn parse(name: &OsStr, image_opts: bool) -> Result<ImageName, NameError> {
    let shown = name.to_string_lossy().into_owned();
    let text = || {
        name.to_str()
            .ok_or_else(|| NameError::NotUtf8(shown.clone()))
    };
    let open_err = |reason| NameError::Open {
        name: shown.clone(),
        reason,
    };
    if image_opts {
        let flat = flatten_list(text()?);
        return interpret(flat).map_err(open_err);
    }
    match name.to_str().and_then(|s| s.strip_prefix("json:")) {
        Some(json) => {
            let flat = flatten_json(json).map_err(open_err)?;
            interpret(flat).map_err(open_err)
        }
        None => Ok(ImageName {
            path: protocol_path(name).map_err(open_err)?,
            format: None,
            options: BTreeMap::new(),
            backing: None,
            data_file: None,
        }),
    }
}

/// The file a plain name stands for: a colon before the first slash is a protocol prefix, as
/// in QEMU; `file:` is the only protocol here, and a path behind it that itself looks
/// prefixed is made relative with `./` (as QEMU shows it) so that it is never read as one.
pub fn protocol_path(name: &OsStr) -> Result<PathBuf, Reason> {
    if let Some(text) = name.to_str().filter(|n| nbd_client::is_nbd_name(n)) {
        // The storage opener connects by this name; it is also how QEMU shows the export.
        let target = nbd_client::NbdTarget::parse(text)?;
        return Ok(PathBuf::from(target.display_name()));
    }
    let bytes = name.as_encoded_bytes();
    let Some(colon) = protocol_colon(bytes) else {
        return Ok(PathBuf::from(name));
    };
    let protocol = String::from_utf8_lossy(&bytes[..colon]).into_owned();
    if protocol == "null-co" {
        return match name.to_str() {
            Some(storage::null::NULL_CO) => Ok(PathBuf::from(storage::null::NULL_CO)),
            _ => Err(Reason::NullFilename),
        };
    }
    if protocol == "blkdebug" {
        // The storage opener wraps the file by this name; it is also how QEMU shows it.
        let text = name.to_str().ok_or(Reason::NotUtf8Blkdebug)?;
        let Some((config, _)) = storage::blkdebug::split_name(text)
            .filter(|(config, image)| !config.is_empty() && !image.is_empty())
        else {
            return Err(Reason::BlkdebugName);
        };
        // Read here too, so that a bad configuration is refused as the name's fault.
        storage::blkdebug::Rules::read_config(Path::new(config))?;
        return Ok(PathBuf::from(name));
    }
    if protocol != "file" {
        return Err(Reason::UnknownProtocol(protocol));
    }
    let rest = &name.to_string_lossy()[colon + 1..];
    if protocol_colon(rest.as_bytes()).is_some() {
        return Ok(PathBuf::from(format!("./{rest}")));
    }
    Ok(PathBuf::from(rest))
}

/// Where a protocol prefix ends: the first `:` if it comes before any `/`.
fn protocol_colon(bytes: &[u8]) -> Option<usize> {
    let i = bytes.iter().position(|&b| b == b':' || b == b'/')?;
    (bytes[i] == b':').then_some(i)
}

/// A `key=value,...` list as `--image-opts` takes it: `,,` escapes a comma, a first item
/// without `=` names the file, and a later bare key means `on`.
fn flatten_list(list: &str) -> BTreeMap<String, Val> {
    let mut flat = BTreeMap::new();
    for (i, (key, value)) in options::split(list).into_iter().enumerate() {
        let (key, value) = match value {
            Some(v) => (key, v),
            None if i == 0 => ("file".to_string(), key),
            None => (key, "on".to_string()),
        };
        flat.insert(key, Val::Text(value));
    }
    flat
}

/// Parses `json:` text (QEMU's JSON, which also takes single-quoted strings) into flattened
/// `a.b.c` keys.
fn flatten_json(json: &str) -> Result<BTreeMap<String, Val>, Reason> {
    if json.len() > MAX_JSON_LEN {
        return Err(Reason::TooLong);
    }
    let standard = requote(json)?;
    let value: serde_json::Value =
        serde_json::from_str(&standard).map_err(|e| Reason::Json(e.to_string()))?;
    let serde_json::Value::Object(map) = value else {
        return Err(Reason::NotObject);
    };
    let mut flat = BTreeMap::new();
    for (k, v) in map {
        flatten_value(&k, v, 1, &mut flat)?;
    }
    Ok(flat)
}

fn flatten_value(
    key: &str,
    v: serde_json::Value,
    depth: usize,
    flat: &mut BTreeMap<String, Val>,
) -> Result<(), Reason> {
    use serde_json::Value as J;
    if depth > MAX_JSON_DEPTH {
        return Err(Reason::TooDeep);
    }
    let leaf = match v {
        J::Object(map) => {
            for (k, v) in map {
                flatten_value(&format!("{key}.{k}"), v, depth + 1, flat)?;
            }
            return Ok(());
        }
        J::Array(items) => {
            for (i, v) in items.into_iter().enumerate() {
                flatten_value(&format!("{key}.{i}"), v, depth + 1, flat)?;
            }
            return Ok(());
        }
        J::Null => Val::Null,
        J::Bool(b) => Val::Text(if b { "on" } else { "off" }.to_string()),
        J::Number(n) => Val::Text(n.to_string()),
        J::String(s) => Val::Text(s),
    };
    if flat.insert(key.to_string(), leaf).is_some() {
        return Err(Reason::Conflict(key.to_string()));
    }
    Ok(())
}

/// Rewrites QEMU's JSON dialect into standard JSON (see [`qcow2::qemu_json::requote`]).
fn requote(json: &str) -> Result<String, Reason> {
    qcow2::qemu_json::requote(json).map_err(Reason::Json)
}

/// Takes `key` and every `key.*` member out of `flat`: the value given directly, and the
/// members with the prefix removed.
fn take_node(
    flat: &mut BTreeMap<String, Val>,
    key: &str,
) -> Result<(Option<Val>, BTreeMap<String, Val>), Reason> {
    let direct = flat.remove(key);
    let prefix = format!("{key}.");
    let keys: Vec<String> = flat
        .keys()
        .filter(|k| k.starts_with(&prefix))
        .cloned()
        .collect();
    let mut members = BTreeMap::new();
    for k in keys {
        if let Some(v) = flat.remove(&k) {
            members.insert(k[prefix.len()..].to_string(), v);
        }
    }
    if direct.is_some() && !members.is_empty() {
        return Err(Reason::Conflict(key.to_string()));
    }
    Ok((direct, members))
}

fn text(v: Option<Val>) -> Option<String> {
    match v {
        Some(Val::Text(s)) => Some(s),
        _ => None,
    }
}

/// The `file` node: the `file` protocol's options (a plain string would name another node,
/// and there are no other nodes here).
fn file_node(direct: Option<Val>, mut members: BTreeMap<String, Val>) -> Result<PathBuf, Reason> {
    match direct {
        Some(Val::Text(name)) => return Err(Reason::NodeRef(name)),
        Some(Val::Null) | None if members.is_empty() => return Err(Reason::NoFileNode),
        _ => {}
    }
    if let Some(d) = text(members.remove("driver")) {
        if d != "file" {
            return Err(Reason::UnknownDriver(d));
        }
    }
    let name = text(members.remove("filename")).ok_or(Reason::NoFilename)?;
    check_leftover(&members, "file", FILE_NOOP_OPTIONS)?;
    // A file name given to the `file` driver itself is taken as it is, colons and all.
    Ok(PathBuf::from(name))
}

/// Options of the `nbd` protocol that change nothing here.
const NBD_NOOP_OPTIONS: &[&str] = &["reconnect-delay", "open-timeout"];

/// The `nbd` options about TLS, and `x-dirty-bitmap` (the metadata context block status
/// comes from), kept for [`resolve`] to note against the export.
const NBD_TLS_OPTIONS: &[&str] = &["tls-creds", "tls-hostname", "x-dirty-bitmap"];

/// The `nbd` protocol node (`server.type`, `server.path`, `server.host`, `server.port`,
/// `export`, or the legacy `path`, `host`, `port`): the NBD name the opener connects by,
/// and its TLS options ([`NBD_TLS_OPTIONS`]).
fn nbd_node(
    mut members: BTreeMap<String, Val>,
) -> Result<(PathBuf, BTreeMap<String, String>), Reason> {
    use nbd_client::{NameError, NbdTarget, ServerAddr, DEFAULT_PORT};
    let mut tls = BTreeMap::new();
    for key in NBD_TLS_OPTIONS {
        if let Some(v) = text(members.remove(*key)) {
            tls.insert(key.to_string(), v);
        }
    }
    let export = text(members.remove("export")).unwrap_or_default();
    let kind = text(members.remove("server.type"));
    let path = text(members.remove("server.path")).or_else(|| text(members.remove("path")));
    let host = text(members.remove("server.host")).or_else(|| text(members.remove("host")));
    let port = text(members.remove("server.port")).or_else(|| text(members.remove("port")));
    if let Some(k) = members.keys().find(|k| {
        !NBD_NOOP_OPTIONS.contains(&k.as_str()) && !NODE_NOOP_OPTIONS.contains(&k.as_str())
    }) {
        return Err(Reason::NbdOption(k.clone()));
    }
    let server = match (kind.as_deref(), path, host) {
        (Some("unix") | None, Some(path), None) => ServerAddr::Unix(PathBuf::from(path)),
        (Some("inet") | None, None, Some(host)) => {
            let port = match port {
                None => DEFAULT_PORT,
                Some(p) => p.parse().map_err(|_| NameError::BadPort(p))?,
            };
            ServerAddr::Inet { host, port }
        }
        _ => return Err(Reason::Nbd(NameError::NoServer("nbd".into()))),
    };
    Ok((
        PathBuf::from(NbdTarget { server, export }.display_name()),
        tls,
    ))
}

/// Options of the `null-co` driver that change no data (`latency-ns` only delays).
const NULL_NOOP_OPTIONS: &[&str] = &["latency-ns"];

/// The `null-co` protocol node (`size`, `read-zeroes`, or the file name `null-co://`): the
/// name the opener makes the device from.
fn null_node(mut members: BTreeMap<String, Val>) -> Result<PathBuf, Reason> {
    use storage::null::NullTarget;
    let mut target = NullTarget::default();
    if let Some(name) = text(members.remove("filename")) {
        if name != storage::null::NULL_CO {
            return Err(Reason::NullFilename);
        }
    }
    if let Some(size) = text(members.remove("size")) {
        target.size = crate::size_string::parse_size(&size)
            .ok()
            .filter(|&s| s <= storage::MAX_OFFSET)
            .ok_or(Reason::NullValue(
                "size".into(),
                "a non-negative number below 2^63",
            ))?;
    }
    if let Some(z) = text(members.remove("read-zeroes")) {
        target.read_zeroes = crate::options::parse_bool(&z)
            .ok_or(Reason::NullValue("read-zeroes".into(), "'on' or 'off'"))?;
    }
    check_leftover(&members, "null-co", NULL_NOOP_OPTIONS)?;
    Ok(PathBuf::from(target.name()))
}

/// Turns flattened options into the file, the format and the options left for the
/// subcommand.
fn interpret(mut flat: BTreeMap<String, Val>) -> Result<ImageName, Reason> {
    let driver = text(flat.remove("driver"));
    let (file_direct, file_members) = take_node(&mut flat, "file")?;
    let format = match driver.as_deref() {
        None if file_direct.is_none() && file_members.is_empty() => return Err(Reason::Nothing),
        None => None,
        Some("qcow2") | Some("raw") => driver.clone(),
        Some("file") => {
            // The protocol node on its own: its bytes are the image.
            let name = text(flat.remove("filename")).ok_or(Reason::NoFilename)?;
            check_leftover(&flat, "file", FILE_NOOP_OPTIONS)?;
            return Ok(ImageName {
                path: PathBuf::from(name),
                format: Some("raw".into()),
                options: BTreeMap::new(),
                backing: None,
                data_file: None,
            });
        }
        Some("nbd") => {
            // The NBD node on its own: the export's bytes are the image.
            let (path, mut options) = nbd_node(flat)?;
            // Noted so that `info` can show the node as QEMU does: the protocol is the format.
            options.insert("driver".into(), "nbd".into());
            return Ok(ImageName {
                path,
                format: Some("raw".into()),
                options,
                backing: None,
                data_file: None,
            });
        }
        Some("null-co") => {
            // The device on its own: its (absent) bytes are the image.
            return Ok(ImageName {
                path: null_node(flat)?,
                format: Some("raw".into()),
                options: BTreeMap::new(),
                backing: None,
                data_file: None,
            });
        }
        Some("blkdebug") => {
            // A filter above the image: it passes every request on, and the limits it
            // may set only change how requests are cut, never what they return.
            if file_direct.is_some() || !file_members.is_empty() {
                return Err(Reason::FormatOption {
                    driver: "blkdebug".into(),
                    option: "file".into(),
                });
            }
            let (image_direct, image) = take_node(&mut flat, "image")?;
            if let Some(Val::Text(name)) = image_direct {
                return Err(Reason::NodeRef(name));
            }
            if image.is_empty() {
                return Err(Reason::NoFileNode);
            }
            blkdebug_filter_options(&flat)?;
            return interpret(image);
        }
        Some("compress") => return compress_node(file_direct, file_members, &flat),
        Some(other) => return Err(Reason::UnknownDriver(other.to_string())),
    };
    let mut options = BTreeMap::new();
    let path = match file_members.get("driver") {
        Some(Val::Text(d)) if d == "nbd" && file_direct.is_none() => {
            let mut members = file_members;
            members.remove("driver");
            let (path, tls) = nbd_node(members)?;
            options.extend(tls);
            path
        }
        Some(Val::Text(d)) if d == "null-co" && file_direct.is_none() => {
            let mut members = file_members;
            members.remove("driver");
            null_node(members)?
        }
        Some(Val::Text(d)) if d == "blkdebug" && file_direct.is_none() => {
            let mut members = file_members;
            members.remove("driver");
            blkdebug_node(members)?
        }
        _ => file_node(file_direct, file_members)?,
    };
    // A layer's encryption key (`encrypt.key-secret`, `backing.encrypt.key-secret`, ...) is
    // read from the command line by `secrets`, which gives it to the open.
    let keys: Vec<String> = flat.keys().filter(|k| is_key_secret(k)).cloned().collect();
    for key in keys {
        if let Some(Val::Text(v)) = flat.remove(&key) {
            options.insert(key, v);
        }
    }
    for key in PASS_THROUGH {
        if let Some(Val::Text(v)) = flat.remove(*key) {
            options.insert(key.to_string(), v);
        }
    }
    let backing = backing_node(&mut flat)?;
    let shown_driver = format.as_deref().unwrap_or("qcow2");
    // Only qcow2 has a data file; given to raw, the option is refused below as QEMU does.
    let data_file = if shown_driver == "qcow2"
        && flat
            .keys()
            .any(|k| k == "data-file" || k.starts_with("data-file."))
    {
        let (direct, members) = take_node(&mut flat, "data-file")?;
        Some(file_node(direct, members)?)
    } else {
        None
    };
    let noops: &[&str] = if shown_driver == "qcow2" {
        QCOW2_NOOP_OPTIONS
    } else {
        &[]
    };
    check_leftover(&flat, shown_driver, noops)?;
    Ok(ImageName {
        path,
        format,
        options,
        backing,
        data_file,
    })
}

/// The option [`ImageName::options`] carries for an image under QEMU's `compress` filter:
/// every write through it becomes compressed clusters ([`compressed_writes`]).
pub const COMPRESS_OPTION: &str = "compress";

/// QEMU's `compress` filter over its `file` node, which must be a qcow2 image (the format
/// that takes compressed writes). Reads and everything but writes pass through unchanged.
fn compress_node(
    file_direct: Option<Val>,
    file_members: BTreeMap<String, Val>,
    flat: &BTreeMap<String, Val>,
) -> Result<ImageName, Reason> {
    if let Some(Val::Text(name)) = file_direct {
        return Err(Reason::NodeRef(name));
    }
    if file_members.is_empty() {
        return Err(Reason::NoFileNode);
    }
    check_leftover(flat, "compress", &[])?;
    let mut inner = interpret(file_members)?;
    if inner.format.as_deref() != Some("qcow2") {
        return Err(Reason::CompressFormat);
    }
    inner.options.insert(COMPRESS_OPTION.into(), "on".into());
    Ok(inner)
}

/// Whether the image that resolved to `path` in this run was given under the `compress`
/// filter.
pub fn compressed_writes(path: &Path) -> bool {
    driver_options(path).contains_key(COMPRESS_OPTION)
}

/// A `blkdebug` node under the format driver (the `file` of a qcow2 or raw node): its rules
/// (`inject-error` and `set-state` lists, a `config` file) checked as a configuration file's
/// are, its limits as [`blkdebug_filter_options`] checks them, and its `image` a `file`
/// node. Its name is the node's JSON name, which the storage opener wraps the file by.
fn blkdebug_node(mut members: BTreeMap<String, Val>) -> Result<PathBuf, Reason> {
    use storage::blkdebug::{Node, MAX_RULES};
    let (image_direct, image) = take_node(&mut members, "image")?;
    let image = file_node(image_direct, image)?;
    let mut node = Node {
        config: text(members.remove("config")),
        image: image.to_string_lossy().into_owned(),
        ..Node::default()
    };
    for (list, rules) in [
        ("inject-error", &mut node.inject),
        ("set-state", &mut node.set_state),
    ] {
        let (direct, items) = take_node(&mut members, list)?;
        if direct.is_some() {
            return Err(Reason::BlkdebugRule(list.into()));
        }
        // `N.key` members, grouped by rule in the order of N.
        let mut by_index: BTreeMap<usize, Vec<(String, String)>> = BTreeMap::new();
        for (key, value) in items {
            let bad = || Reason::BlkdebugRule(format!("{list}.{key}"));
            let (index, field) = key.split_once('.').ok_or_else(bad)?;
            let index: usize = index
                .parse()
                .ok()
                .filter(|&i| i < MAX_RULES)
                .ok_or_else(bad)?;
            let Val::Text(value) = value else {
                return Err(bad());
            };
            by_index
                .entry(index)
                .or_default()
                .push((field.to_string(), value));
        }
        rules.extend(by_index.into_values());
    }
    blkdebug_filter_options(&members)?;
    node.rules()?;
    Ok(PathBuf::from(node.name()))
}

/// Checks the options of a `blkdebug` filter node above the image: limits that are sizes
/// meeting QEMU's constraints, no rules (see [`Reason::BlkdebugRules`]), nothing unknown.
fn blkdebug_filter_options(flat: &BTreeMap<String, Val>) -> Result<(), Reason> {
    let limit = |key: &str| -> Result<u64, Reason> {
        match flat.get(key) {
            None => Ok(0),
            Some(Val::Text(v)) => crate::size_string::parse_size(v)
                .ok()
                .filter(|&n| n < i32::MAX as u64)
                .ok_or_else(|| Reason::BlkdebugLimit(format!("{key} {v}"))),
            Some(Val::Null) => Err(Reason::BlkdebugLimit(format!("{key} null"))),
        }
    };
    let align = limit("align")?;
    if align != 0 && !align.is_power_of_two() {
        return Err(Reason::BlkdebugLimit(format!("align {align}")));
    }
    let unit = align.max(1);
    let multiple = |n: u64, of: u64| n % of.max(1) == 0;
    for (key, of) in [
        ("max-transfer", unit),
        ("opt-write-zero", unit),
        ("opt-discard", unit),
    ] {
        let n = limit(key)?;
        if !multiple(n, of) {
            return Err(Reason::BlkdebugLimit(format!("{key} {n}")));
        }
    }
    for (key, opt) in [
        ("max-write-zero", "opt-write-zero"),
        ("max-discard", "opt-discard"),
    ] {
        let n = limit(key)?;
        if !multiple(n, limit(opt)?.max(unit)) {
            return Err(Reason::BlkdebugLimit(format!("{key} {n}")));
        }
    }
    for key in flat.keys() {
        let root = key.split('.').next().unwrap_or(key);
        if matches!(root, "config" | "inject-error" | "set-state") {
            return Err(Reason::BlkdebugRules(key.clone()));
        }
        if !storage::blkdebug::LIMITS.contains(&root) && !NODE_NOOP_OPTIONS.contains(&root) {
            return Err(Reason::FormatOption {
                driver: "blkdebug".into(),
                option: key.clone(),
            });
        }
    }
    Ok(())
}

/// The `backing` node given as members (`backing.driver`, `backing.file.filename`): the
/// file and driver it names. A node given by reference or as `null`, and a backing node of
/// its own, are left for [`check_leftover`] to refuse.
fn backing_node(
    flat: &mut BTreeMap<String, Val>,
) -> Result<Option<(PathBuf, Option<String>)>, Reason> {
    let has_members = flat.keys().any(|k| k.starts_with("backing."));
    if flat.contains_key("backing") || !has_members {
        return Ok(None);
    }
    if flat.keys().any(|k| k.starts_with("backing.backing")) {
        return Ok(None);
    }
    let (_, mut members) = take_node(flat, "backing")?;
    let driver = text(members.remove("driver"));
    match driver.as_deref() {
        None | Some("qcow2") | Some("raw") => {}
        Some(other) => return Err(Reason::UnknownDriver(other.to_string())),
    }
    let (file_direct, file_members) = take_node(&mut members, "file")?;
    let path = file_node(file_direct, file_members)?;
    let noops: &[&str] = if driver.as_deref() == Some("raw") {
        &[]
    } else {
        QCOW2_NOOP_OPTIONS
    };
    check_leftover(&members, driver.as_deref().unwrap_or("qcow2"), noops)?;
    Ok(Some((path, driver)))
}

/// Checks that a `backing` node describes the image's own backing file: the same file
/// (once both are resolved) and, where the image records one, the same format.
fn check_backing_node(image: &Path, node: &(PathBuf, Option<String>)) -> Result<(), Reason> {
    let (given, driver) = node;
    let other = |found: String| Reason::OtherBacking {
        given: match driver {
            Some(d) => format!("'{}' ({d})", given.display()),
            None => format!("'{}'", given.display()),
        },
        found,
    };
    let header =
        read_header(image).ok_or_else(|| other("unknown (its header cannot be read)".into()))?;
    let Some(name) = header.backing_file.as_deref() else {
        return Err(other("none".into()));
    };
    let name = String::from_utf8_lossy(name).into_owned();
    let resolved = qcow2::engine::backing_name::resolve(image, &name)
        .map_err(|_| other(format!("'{name}'")))?;
    let same_file = match (
        std::fs::canonicalize(&resolved),
        std::fs::canonicalize(given),
    ) {
        (Ok(a), Ok(b)) => a == b,
        _ => resolved == *given,
    };
    let recorded = header
        .backing_format()
        .map(|f| String::from_utf8_lossy(f).into_owned());
    let same_format = match (driver, &recorded) {
        (Some(d), Some(r)) => d == r,
        _ => true,
    };
    if same_file && same_format {
        return Ok(());
    }
    Err(other(match recorded {
        Some(r) => format!("'{name}' ({r})"),
        None => format!("'{name}'"),
    }))
}

/// The qcow2 header of the file at `path`, if it is a local qcow2 image.
fn read_header(path: &Path) -> Option<qcow2::format::Header> {
    use std::io::Read;
    // A backing file name lies within the first cluster, which is at most 2 MiB.
    let mut buf = Vec::new();
    std::fs::File::open(path)
        .ok()?
        .take(2 << 20)
        .read_to_end(&mut buf)
        .ok()?;
    qcow2::format::Header::decode(&buf).ok()
}

/// Refuses any option left that is neither a node option nor one of `noops`.
fn check_leftover(
    flat: &BTreeMap<String, Val>,
    driver: &str,
    noops: &[&str],
) -> Result<(), Reason> {
    match flat
        .keys()
        .find(|k| !noops.contains(&k.as_str()) && !NODE_NOOP_OPTIONS.contains(&k.as_str()))
    {
        Some(k) if driver == "file" => Err(Reason::FileOption(k.clone())),
        Some(k) => Err(Reason::FormatOption {
            driver: driver.to_string(),
            option: k.clone(),
        }),
        None => Ok(()),
    }
}

/// The names read in this run, for [`driver_options`].
static READ: Mutex<Vec<ImageName>> = Mutex::new(Vec::new());

/// Reads `name` (as [`parse`]) and puts what it names in place: `path` becomes the file, and
/// `format` the driver it names (with `--image-opts`, `-f` is refused as qemu-img refuses it).
pub fn resolve(
    path: &mut PathBuf,
    format: &mut Option<String>,
    image_opts: bool,
) -> Result<(), NameError> {
    if image_opts && format.is_some() {
        return Err(NameError::FormatWithImageOpts);
    }
    let read = parse(path.as_os_str(), image_opts)?;
    if let Some(node) = &read.backing {
        check_backing_node(&read.path, node).map_err(|reason| NameError::Open {
            name: path.display().to_string(),
            reason,
        })?;
    }
    let given = path.display().to_string();
    if let Some(id) = read.options.get("tls-creds") {
        let hostname = read.options.get("tls-hostname").cloned();
        crate::nbd_tls::note(&read.path, id, hostname).map_err(|reason| NameError::Open {
            name: given.clone(),
            reason: Reason::TlsCreds(reason),
        })?;
    }
    if let Some(context) = read.options.get("x-dirty-bitmap") {
        nbd_client::register_status_context(&read.path.display().to_string(), context);
    }
    *path = read.path.clone();
    if read.format.is_some() {
        format.clone_from(&read.format);
    }
    if let Ok(mut all) = READ.lock() {
        all.push(read);
    }
    if let Ok(mut names) = GIVEN.lock() {
        names.push((path.clone(), given));
    }
    Ok(())
}

/// The names as given on the command line, by what they resolved to, for [`given_name`].
static GIVEN: Mutex<Vec<(PathBuf, String)>> = Mutex::new(Vec::new());

/// The name that resolved to `path` as the command line gave it (an option list, a `json:`
/// name), which QEMU's errors about the image quote; `path` itself when none did.
pub fn given_name(path: &Path) -> String {
    GIVEN
        .lock()
        .ok()
        .and_then(|names| {
            names
                .iter()
                .find(|(p, _)| p == path)
                .map(|(_, g)| g.clone())
        })
        .unwrap_or_else(|| path.display().to_string())
}

/// [`resolve`] for a name that may be absent.
pub fn resolve_opt(
    path: &mut Option<PathBuf>,
    format: &mut Option<String>,
    image_opts: bool,
) -> Result<(), NameError> {
    match path {
        Some(p) => resolve(p, format, image_opts),
        None => Ok(()),
    }
}

/// The driver options (those in the pass-through list) given with the image that resolved to
/// `path` in this run.
pub fn driver_options(path: &Path) -> BTreeMap<String, String> {
    READ.lock()
        .ok()
        .and_then(|all| {
            all.iter()
                .find(|n| n.path == path)
                .map(|n| n.options.clone())
        })
        .unwrap_or_default()
}

/// The external data file given with the image that resolved to `path` in this run (its
/// `data-file` node), if any.
pub fn data_file_for(path: &Path) -> Option<PathBuf> {
    READ.lock().ok().and_then(|all| {
        all.iter()
            .find(|n| n.path == path)
            .and_then(|n| n.data_file.clone())
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn p(s: &str, opts: bool) -> Result<ImageName, NameError> {
        parse(OsStr::new(s), opts)
    }

    fn reason(s: &str, opts: bool) -> Reason {
        match p(s, opts) {
            Err(NameError::Open { reason, .. }) => reason,
            other => panic!("{s}: expected a refusal, got {other:?}"),
        }
    }

    #[test]
    fn plain_and_file_prefixed_paths() {
        assert_eq!(
            p("/a/b:c.qcow2", false).unwrap().path,
            Path::new("/a/b:c.qcow2")
        );
        assert_eq!(p("file:/a/b:c", false).unwrap().path, Path::new("/a/b:c"));
        assert_eq!(p("file:x:y", false).unwrap().path, Path::new("./x:y"));
        assert_eq!(p("file:x", false).unwrap().path, Path::new("x"));
        let conf = tempfile::NamedTempFile::new().unwrap();
        std::fs::write(conf.path(), "[inject-error]\nevent = \"read_aio\"\n").unwrap();
        let name = format!("blkdebug:{}:/i/img", conf.path().display());
        assert_eq!(p(&name, false).unwrap().path, Path::new(&name));
        assert!(matches!(
            reason("blkdebug:/nonexistent/conf:img", false),
            Reason::BlkdebugConfig(storage::blkdebug::ConfigError::Read(_))
        ));
        assert_eq!(reason("blkdebug:conf", false), Reason::BlkdebugName);
        assert_eq!(reason("blkdebug:conf:", false), Reason::BlkdebugName);
        assert_eq!(
            reason("ssh://host/x", false),
            Reason::UnknownProtocol("ssh".into())
        );
    }

    #[test]
    fn json_names_in_both_quotings() {
        let n = p(
            r#"json:{'driver':'qcow2','file':{'driver':'file','filename':'/t/it''s'}}"#,
            false,
        );
        // A doubled quote is not an escape in QEMU's JSON: this does not parse.
        assert!(matches!(
            n,
            Err(NameError::Open {
                reason: Reason::Json(_),
                ..
            })
        ));
        let n = p(
            r#"json:{'driver':'qcow2','file':{'driver':'file','filename':'/t/a "b\'c'}}"#,
            false,
        )
        .unwrap();
        assert_eq!(n.path, Path::new("/t/a \"b'c"));
        assert_eq!(n.format.as_deref(), Some("qcow2"));
        let n = p(r#"json:{"driver":"raw","file.filename":"/t/r"}"#, false).unwrap();
        assert_eq!(
            (n.path.as_path(), n.format.as_deref()),
            (Path::new("/t/r"), Some("raw"))
        );
        let n = p(r#"json:{"file":{"filename":"/t/q"}}"#, false).unwrap();
        assert_eq!((n.path.as_path(), n.format), (Path::new("/t/q"), None));
        let n = p(r#"json:{"driver":"file","filename":"/t/f"}"#, false).unwrap();
        assert_eq!(
            (n.path.as_path(), n.format.as_deref()),
            (Path::new("/t/f"), Some("raw"))
        );
    }

    #[test]
    fn json_refusals() {
        assert_eq!(reason("json:[1]", false), Reason::NotObject);
        assert!(matches!(reason("json:{", false), Reason::Json(_)));
        assert!(matches!(reason("json:{'a':'\\", false), Reason::Json(_)));
        assert_eq!(reason("json:{}", false), Reason::Nothing);
        assert_eq!(
            reason(
                "json:{'driver':'blkdebug','inject-error':[{'event':'read_aio'}],\
                 'image':{'driver':'qcow2','file':{'filename':'x'}}}",
                false
            ),
            Reason::BlkdebugRules("inject-error.0.event".into())
        );
        assert_eq!(
            reason(
                "driver=blkdebug,image.driver=qcow2,image.file.filename=x,align=3",
                true
            ),
            Reason::BlkdebugLimit("align 3".into())
        );
        assert_eq!(
            reason(
                "driver=blkdebug,image.driver=qcow2,image.file.filename=x,align=4k,max-transfer=6k",
                true
            ),
            Reason::BlkdebugLimit("max-transfer 6144".into())
        );
        let n = p(
            "driver=blkdebug,image.driver=qcow2,image.file.driver=file,\
             image.file.filename=/t/x,align=4k,max-transfer=64k",
            true,
        )
        .unwrap();
        assert_eq!(
            (n.path.as_path(), n.format.as_deref()),
            (Path::new("/t/x"), Some("qcow2"))
        );
        assert_eq!(
            reason(
                "json:{'driver':'qcow2','file':{'driver':'nvme','size':1}}",
                false
            ),
            Reason::UnknownDriver("nvme".into())
        );
        assert_eq!(
            reason(
                "json:{'driver':'qcow2','file.filename':'x','bogus':1}",
                false
            ),
            Reason::FormatOption {
                driver: "qcow2".into(),
                option: "bogus".into()
            }
        );
        assert_eq!(
            reason(
                "json:{'driver':'qcow2','file':'x','file.filename':'y'}",
                false
            ),
            Reason::Conflict("file".into())
        );
        assert_eq!(
            reason("json:{'driver':'qcow2','file':'x'}", false),
            Reason::NodeRef("x".into())
        );
        assert_eq!(reason("json:{'driver':'qcow2'}", false), Reason::NoFileNode);
        assert_eq!(
            reason("json:{'driver':'qcow2','filename':'x'}", false),
            Reason::NoFileNode
        );
        let deep = format!(
            "json:{{'driver':'qcow2','file.filename':'x','a':{}1{}}}",
            "[".repeat(40),
            "]".repeat(40)
        );
        assert_eq!(reason(&deep, false), Reason::TooDeep);
        let long = format!("json:{{'file.filename':'{}'}}", "x".repeat(MAX_JSON_LEN));
        assert_eq!(reason(&long, false), Reason::TooLong);
        // serde_json's own recursion limit answers first for very deep text: still an error.
        let deeper = format!("json:{}", "[".repeat(100_000));
        assert!(matches!(reason(&deeper, false), Reason::Json(_)));
    }

    #[test]
    fn option_lists() {
        let n = p("driver=qcow2,file.driver=file,file.filename=/t/a,,b", true).unwrap();
        assert_eq!(
            (n.path.as_path(), n.format.as_deref()),
            (Path::new("/t/a,b"), Some("qcow2"))
        );
        let n = p("driver=raw,file.filename=/t/x", true).unwrap();
        assert_eq!(
            (n.path.as_path(), n.format.as_deref()),
            (Path::new("/t/x"), Some("raw"))
        );
        // A first item without `=` is the `file` option: a node name, which QEMU looks up.
        assert_eq!(
            reason("/t/x,driver=raw", true),
            Reason::NodeRef("/t/x".into())
        );
        let n = p(
            "driver=qcow2,file.filename=/t/y,l2-cache-entry-size=4096",
            true,
        )
        .unwrap();
        assert_eq!(n.path, Path::new("/t/y"));
        assert_eq!(
            reason("driver=qcow2,file.filename=/t/y,l2-cache-entries=s", true),
            Reason::FormatOption {
                driver: "qcow2".into(),
                option: "l2-cache-entries".into()
            }
        );
        // A layer's key is kept for the open, at any depth of the chain.
        let n = p(
            "driver=qcow2,file.filename=/t/y,encrypt.key-secret=s,backing.encrypt.key-secret=b",
            true,
        )
        .unwrap();
        assert_eq!(
            n.options.get("encrypt.key-secret").map(String::as_str),
            Some("s")
        );
        assert_eq!(
            n.options
                .get("backing.encrypt.key-secret")
                .map(String::as_str),
            Some("b")
        );
        assert_eq!(
            reason("driver=quorum,children.0.file.filename=a", true),
            Reason::UnknownDriver("quorum".into())
        );
        // NBD: the export's name, as the opener connects by it and QEMU shows it.
        let nbd = p("driver=nbd,host=127.0.0.1", true).unwrap();
        assert_eq!(nbd.path, PathBuf::from("nbd://127.0.0.1:10809"));
        assert_eq!(nbd.format.as_deref(), Some("raw"));
        let nbd = p(
            "driver=qcow2,file.driver=nbd,file.server.type=unix,file.server.path=/s,file.export=e",
            true,
        )
        .unwrap();
        assert_eq!(nbd.path, PathBuf::from("nbd+unix:///e?socket=/s"));
        assert_eq!(nbd.format.as_deref(), Some("qcow2"));
        assert_eq!(
            p("nbd:unix:/s:exportname=x", false).unwrap().path,
            PathBuf::from("nbd+unix:///x?socket=/s")
        );
        assert_eq!(
            reason(
                "driver=nbd,server.type=unix,server.path=/s,tls-creds=t,tls-x=1",
                true
            ),
            Reason::NbdOption("tls-x".into())
        );
        assert!(matches!(
            reason("driver=nbd,server.type=unix", true),
            Reason::Nbd(_)
        ));
        assert_eq!(reason("driver=qcow2", true), Reason::NoFileNode);
        assert_eq!(
            reason("driver=qcow2,file.driver=file", true),
            Reason::NoFilename
        );
        assert_eq!(
            reason("driver=qcow2,file.filename=x,file.bogus=1", true),
            Reason::FileOption("bogus".into())
        );
    }

    #[test]
    fn resolve_refuses_format_with_image_opts() {
        let mut path = PathBuf::from("driver=qcow2,file.filename=/t/z");
        // Only the image's own format: -f with --image-opts is refused before the name is read.
        let mut format = Some("qcow2".to_string());
        assert_eq!(
            resolve(&mut path, &mut format, true),
            Err(NameError::FormatWithImageOpts)
        );
        let mut format = None;
        resolve(&mut path, &mut format, true).unwrap();
        assert_eq!(
            (path.as_path(), format.as_deref()),
            (Path::new("/t/z"), Some("qcow2"))
        );
    }

    #[test]
    fn null_co_devices_are_named_by_their_options() {
        let n = p("null-co://", false).unwrap();
        assert_eq!(
            (n.path.as_path(), n.format),
            (Path::new("null-co://"), None)
        );
        assert_eq!(reason("null-co://x", false), Reason::NullFilename);
        let n = p(
            "json:{'driver':'null-co','size':1048576,'read-zeroes':true}",
            false,
        )
        .unwrap();
        assert_eq!(n.path, Path::new("null-co://?size=1048576&read-zeroes=on"));
        assert_eq!(n.format.as_deref(), Some("raw"));
        let n = p("driver=raw,file.driver=null-co,file.size=4k", true).unwrap();
        assert_eq!(n.path, Path::new("null-co://?size=4096&read-zeroes=off"));
        assert_eq!(
            reason("driver=null-co,read-zeroes=maybe", true),
            Reason::NullValue("read-zeroes".into(), "'on' or 'off'")
        );
        assert!(matches!(
            reason("driver=null-co,bogus=1", true),
            Reason::FormatOption { .. }
        ));
    }

    #[test]
    fn the_compress_filter_marks_a_qcow2_image_for_compressed_writes() {
        let n = p(
            "driver=compress,file.driver=qcow2,file.file.filename=/t/c",
            true,
        )
        .unwrap();
        assert_eq!(
            (n.path.as_path(), n.format.as_deref()),
            (Path::new("/t/c"), Some("qcow2"))
        );
        assert_eq!(
            n.options.get(COMPRESS_OPTION).map(String::as_str),
            Some("on")
        );
        assert_eq!(
            reason(
                "driver=compress,file.driver=raw,file.file.filename=/t/r",
                true
            ),
            Reason::CompressFormat
        );
        assert_eq!(reason("driver=compress", true), Reason::NoFileNode);
        assert!(matches!(
            reason(
                "driver=compress,file.driver=qcow2,file.file.filename=/t/c,x=1",
                true
            ),
            Reason::FormatOption { .. }
        ));
    }
}
