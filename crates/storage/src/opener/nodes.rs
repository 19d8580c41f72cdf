//! The nodes of an image name once flattened: the format driver (`qcow2`, `raw`) over its
//! `file` node, and the protocol and filter nodes this tool has (`file`, `nbd`, `null-co`,
//! `blkdebug`, `compress`), each checked option by option as QEMU checks it and turned into
//! the one name the opener opens.

use std::collections::BTreeMap;
use std::path::PathBuf;

use super::image_opts::{check_leftover, take_node, text, Val, NODE_NOOP_OPTIONS};
use super::name::{ImageName, Reason, COMPRESS_OPTION};

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

/// True for `encrypt.key-secret` of the image or of a layer below it (`backing.` repeated),
/// and for a LUKS volume's own `key-secret`.
fn is_key_secret(key: &str) -> bool {
    if key == "key-secret" {
        return true;
    }
    let mut rest = key;
    while let Some(r) = rest.strip_prefix("backing.") {
        rest = r;
    }
    rest == "encrypt.key-secret"
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
/// comes from), kept for the command line to note against the export.
const NBD_TLS_OPTIONS: &[&str] = &["tls-creds", "tls-hostname", "x-dirty-bitmap"];

/// The `nbd` protocol node (`server.type`, `server.path`, `server.host`, `server.port`,
/// `export`, or the legacy `path`, `host`, `port`): the NBD name the opener connects by,
/// and its TLS options ([`NBD_TLS_OPTIONS`]).
fn nbd_node(
    mut members: BTreeMap<String, Val>,
) -> Result<(PathBuf, BTreeMap<String, String>), Reason> {
    use super::nbd_name::NbdNameError;
    use nbd_client::{NbdTarget, ServerAddr, DEFAULT_PORT};
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
                Some(p) => p.parse().map_err(|_| NbdNameError::BadPort(p))?,
            };
            ServerAddr::Inet { host, port }
        }
        _ => return Err(Reason::Nbd(NbdNameError::NoServer("nbd".into()))),
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
    use crate::null::NullTarget;
    let mut target = NullTarget::default();
    if let Some(name) = text(members.remove("filename")) {
        if name != crate::null::NULL_CO {
            return Err(Reason::NullFilename);
        }
    }
    if let Some(size) = text(members.remove("size")) {
        target.size = crate::size_string::parse_size(&size)
            .ok()
            .filter(|&s| s <= crate::MAX_OFFSET)
            .ok_or(Reason::NullValue(
                "size".into(),
                "a non-negative number below 2^63",
            ))?;
    }
    if let Some(z) = text(members.remove("read-zeroes")) {
        target.read_zeroes = super::image_opts::parse_bool(&z)
            .ok_or(Reason::NullValue("read-zeroes".into(), "'on' or 'off'"))?;
    }
    check_leftover(&members, "null-co", NULL_NOOP_OPTIONS)?;
    Ok(PathBuf::from(target.name()))
}

/// Turns flattened options into the file, the format and the options left for the
/// subcommand.
pub(super) fn interpret(mut flat: BTreeMap<String, Val>) -> Result<ImageName, Reason> {
    let driver = text(flat.remove("driver"));
    let (file_direct, file_members) = take_node(&mut flat, "file")?;
    let format = match driver.as_deref() {
        None if file_direct.is_none() && file_members.is_empty() => return Err(Reason::Nothing),
        None => None,
        Some("qcow2") | Some("raw") | Some("luks") => driver.clone(),
        Some("compress") => return compress_node(file_direct, file_members, &flat),
        Some(other) => return node_alone(other, flat, file_direct, file_members),
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
        Some(Val::Text(d)) if d == "quorum" && file_direct.is_none() => {
            let mut members = file_members;
            members.remove("driver");
            quorum_node(members)?
        }
        _ => file_node(file_direct, file_members)?,
    };
    // A layer's encryption key (`encrypt.key-secret`, `backing.encrypt.key-secret`, ...) is
    // read from the command line by `secrets`, which gives it to the open.
    // Only QEMU's `luks` driver takes `key-secret` at the top: to any other it is unknown.
    let luks = format.as_deref() == Some("luks");
    let keys: Vec<String> = flat
        .keys()
        .filter(|k| is_key_secret(k) && (luks || *k != "key-secret"))
        .cloned()
        .collect();
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

/// A protocol or filter node with no format driver above it (`driver=file`, `nbd`,
/// `null-co`, `blkdebug`): its bytes are the image.
fn node_alone(
    driver: &str,
    mut flat: BTreeMap<String, Val>,
    file_direct: Option<Val>,
    file_members: BTreeMap<String, Val>,
) -> Result<ImageName, Reason> {
    match driver {
        "file" => {
            // The protocol node on its own: its bytes are the image.
            let name = text(flat.remove("filename")).ok_or(Reason::NoFilename)?;
            check_leftover(&flat, "file", FILE_NOOP_OPTIONS)?;
            Ok(ImageName {
                path: PathBuf::from(name),
                format: Some("raw".into()),
                options: BTreeMap::new(),
                backing: None,
                data_file: None,
            })
        }
        "nbd" => {
            // The NBD node on its own: the export's bytes are the image.
            let (path, mut options) = nbd_node(flat)?;
            // Noted so that `info` can show the node as QEMU does: the protocol is the format.
            options.insert("driver".into(), "nbd".into());
            Ok(ImageName {
                path,
                format: Some("raw".into()),
                options,
                backing: None,
                data_file: None,
            })
        }
        "null-co" => {
            // The device on its own: its (absent) bytes are the image.
            Ok(ImageName {
                path: null_node(flat)?,
                format: Some("raw".into()),
                options: BTreeMap::new(),
                backing: None,
                data_file: None,
            })
        }
        "blkdebug" => {
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
            interpret(image)
        }
        other => Err(Reason::UnknownDriver(other.to_string())),
    }
}

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

/// A `blkdebug` node under the format driver (the `file` of a qcow2 or raw node): its rules
/// (`inject-error` and `set-state` lists, a `config` file) checked as a configuration file's
/// are when the node is opened, its limits as [`blkdebug_filter_options`] checks them, and
/// its `image` a `file` node. Its name is the node's JSON name, which the storage opener
/// wraps the file by.
fn blkdebug_node(mut members: BTreeMap<String, Val>) -> Result<PathBuf, Reason> {
    use crate::blkdebug::{Node, MAX_RULES};
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
    // Its rules are read by whoever opens it ([`super::parse`] for a name given to a tool),
    // so that an image's name can be refused before its `config` file is read.
    Ok(PathBuf::from(node.name()))
}

/// A `quorum` node under the format driver: its `children` (each a `file` node, in the order
/// of their indices) and its `vote-threshold`, checked as QEMU checks them, turned into the
/// node's JSON name ([`crate::quorum::QuorumNode`]), which the storage opener opens. QEMU's
/// default `read-pattern` (`quorum`) is taken; its other options (reading the first child
/// only, rewriting the children that lose a vote, blkverify's mode) are refused.
fn quorum_node(mut members: BTreeMap<String, Val>) -> Result<PathBuf, Reason> {
    use crate::quorum::{check_threshold, QuorumNode};
    let (direct, items) = take_node(&mut members, "children")?;
    if let Some(v) = direct {
        let shown = match v {
            Val::Text(t) => t,
            Val::Null => "null".into(),
        };
        return Err(Reason::NodeRef(shown));
    }
    // `N.key` members, grouped by child in the order of N.
    let mut by_index: BTreeMap<usize, BTreeMap<String, Val>> = BTreeMap::new();
    for (key, value) in items {
        let (index, field) = key
            .split_once('.')
            .and_then(|(i, f)| Some((i.parse::<usize>().ok()?, f)))
            .ok_or_else(|| Reason::FormatOption {
                driver: "quorum".into(),
                option: format!("children.{key}"),
            })?;
        by_index
            .entry(index)
            .or_default()
            .insert(field.to_string(), value);
    }
    // QEMU counts the children from index 0 up to the first one missing.
    if by_index.keys().enumerate().any(|(n, &i)| n != i) {
        return Err(Reason::FormatOption {
            driver: "quorum".into(),
            option: "children".into(),
        });
    }
    let children = by_index
        .into_values()
        .map(|child| file_node(None, child).map(|p| p.to_string_lossy().into_owned()))
        .collect::<Result<Vec<String>, Reason>>()?;
    let threshold = match text(members.remove("vote-threshold")) {
        None => 0,
        Some(t) => t
            .parse::<usize>()
            .map_err(|_| Reason::QuorumValue("vote-threshold".into(), "a number"))?,
    };
    if let Some(p) = text(members.remove("read-pattern")) {
        if p != "quorum" {
            return Err(Reason::FormatOption {
                driver: "quorum".into(),
                option: "read-pattern".into(),
            });
        }
    }
    check_leftover(&members, "quorum", &[])?;
    check_threshold(threshold, children.len())?;
    Ok(PathBuf::from(
        QuorumNode {
            threshold,
            children,
        }
        .name(),
    ))
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
        if !crate::blkdebug::LIMITS.contains(&root) && !NODE_NOOP_OPTIONS.contains(&root) {
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
