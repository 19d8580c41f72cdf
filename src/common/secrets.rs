//! Passwords of encrypted images, given as QEMU's tools take them: `--object
//! secret,id=ID,data=TEXT` (or `file=PATH`) defines a secret, and an image names the one
//! that opens it with `encrypt.key-secret=ID` (its backing file's with
//! `backing.encrypt.key-secret=ID`) in an `--image-opts` option string or a `json:{...}` name
//! (flat or nested keys, as QEMU takes both), or in `-o` when it is being created.
//!
//! The command line is read once at start ([`take_from_args`]): secret objects and the
//! encryption keys of image names are noted by file, so the subcommands, which see the file
//! names the image-name reader gives them, ask [`passwords_for`] when they open one.

use qcow2::crypto::Passwords;
use std::collections::HashMap;
use std::ffi::{OsStr, OsString};
use std::path::{Path, PathBuf};
use std::sync::OnceLock;

/// What the command line defined.
#[derive(Default, Debug)]
struct Registry {
    /// Secret id to its bytes.
    secrets: HashMap<String, Vec<u8>>,
    /// Images named in option strings, with the secret ids of their layers by depth.
    images: Vec<(PathBuf, Vec<Option<String>>)>,
}

/// The type of the object `spec` defines (`TYPE,...` or `qom-type=TYPE,...`).
fn object_type(spec: &str) -> Option<String> {
    let parts = crate::common::options::split(spec);
    parts
        .iter()
        .enumerate()
        .find_map(|(i, (key, value))| match value {
            None if i == 0 => Some(key.clone()),
            Some(v) if key == "qom-type" => Some(v.clone()),
            _ => None,
        })
}

static REGISTRY: OnceLock<Registry> = OnceLock::new();

/// Parses `secret,id=ID,data=TEXT|file=PATH[,format=raw]`; `Ok(None)` for other objects.
fn parse_secret(spec: &str) -> Result<Option<(String, Vec<u8>)>, String> {
    let parts = crate::common::options::split(spec);
    let mut kind = None;
    let (mut id, mut data, mut file) = (None, None, None);
    for (i, (key, value)) in parts.iter().enumerate() {
        match (key.as_str(), value.as_deref()) {
            (name, None) if i == 0 => kind = Some(name),
            ("qom-type", Some(v)) => kind = Some(v),
            ("id", Some(v)) => id = Some(v.to_string()),
            ("data", Some(v)) => data = Some(v.as_bytes().to_vec()),
            ("file", Some(v)) => file = Some(v.to_string()),
            ("format", Some("raw")) => {}
            (k, Some(v)) if kind == Some("secret") => {
                return Err(format!(
                    "--object secret: option '{k}={v}' is not supported (only id, data, file, format=raw)"
                ))
            }
            _ => {}
        }
    }
    if kind != Some("secret") {
        return Ok(None);
    }
    let id = id.ok_or_else(|| "Parameter 'id' is missing".to_string())?;
    let bytes = match (data, file) {
        (Some(d), None) => d,
        (None, Some(f)) => std::fs::read(&f).map_err(|e| {
            format!(
                "Unable to read {f}: {}",
                crate::common::os_error::plain_io(&e)
            )
        })?,
        _ => return Err("Either 'data' or 'file' must be provided".to_string()),
    };
    Ok(Some((id, bytes)))
}

/// The file an image name opens and the secret ids of its layers by depth, read by the
/// image-name reader the subcommands use (so an option string and a `json:` name give their
/// keys alike); `None` for a name it refuses, which the subcommand then reports.
fn layer_keys(name: &OsStr, image_opts: bool) -> Option<(PathBuf, Vec<Option<String>>)> {
    let read = storage::opener::parse(name, image_opts).ok()?;
    let mut keys: Vec<Option<String>> = Vec::new();
    for (key, id) in &read.options {
        let mut depth = 0;
        let mut rest = key.as_str();
        while let Some(r) = rest.strip_prefix("backing.") {
            depth += 1;
            rest = r;
        }
        // A chain is never deeper than the engine opens, so neither is the list.
        // A LUKS volume's key is its own `key-secret`, a qcow2 layer's `encrypt.key-secret`.
        let is_key = rest == "encrypt.key-secret" || (depth == 0 && rest == "key-secret");
        if !is_key || depth >= qcow2::engine::backing_name::MAX_CHAIN_DEPTH {
            continue;
        }
        if keys.len() <= depth {
            keys.resize(depth + 1, None);
        }
        keys[depth] = Some(id.clone());
    }
    Some((read.path, keys))
}

/// Takes secret objects out of the command line and notes the encryption keys that
/// `--image-opts` strings and `json:` names give for each file (the strings themselves stay, for the image-name
/// reader); every other argument is kept.
pub fn take_from_args(args: Vec<OsString>) -> Result<Vec<OsString>, String> {
    let mut reg = Registry::default();
    let mut tls_objects = Vec::new();
    let image_opts = args
        .iter()
        .any(|a| a == "--image-opts" || a == "--target-image-opts");
    // The server takes its TLS objects itself; every other subcommand is a client.
    let serving = args
        .iter()
        .skip(1)
        .find(|a| !a.to_string_lossy().starts_with('-'))
        .is_some_and(|a| a == "serve");
    let mut out = Vec::with_capacity(args.len());
    let mut it = args.into_iter().peekable();
    let mut prev: Option<OsString> = None;
    while let Some(a) = it.next() {
        let text = a.to_str().map(str::to_owned);
        let object = match text.as_deref() {
            Some("--object") => it.peek().and_then(|v| v.to_str()).map(str::to_owned),
            Some(t) => t.strip_prefix("--object=").map(str::to_owned),
            None => None,
        };
        if let Some(spec) = object {
            if let Some((id, bytes)) = parse_secret(&spec)? {
                if text.as_deref() == Some("--object") {
                    it.next();
                }
                reg.secrets.insert(id, bytes);
                continue;
            }
            if !serving && object_type(&spec).is_some_and(|t| crate::common::tls::is_creds_type(&t))
            {
                if text.as_deref() == Some("--object") {
                    it.next();
                }
                tls_objects.push(spec);
                continue;
            }
        }
        let after_o = prev
            .as_ref()
            .is_some_and(|p| p == "-o" || p == "--options" || p == "--object");
        let image_name = match text.as_deref() {
            Some(t) if image_opts => !after_o && !t.starts_with('-') && t.contains('='),
            Some(t) => storage::opener::described::is_json_name(t),
            None => false,
        };
        if image_name {
            if let Some((file, keys)) = layer_keys(&a, image_opts) {
                reg.images.push((file, keys));
            }
        }
        prev = Some(a.clone());
        out.push(a);
    }
    let _ = REGISTRY.set(reg);
    crate::common::tls::set_objects(tls_objects);
    Ok(out)
}

/// The bytes of secret `id`, as QEMU's error says when there is none.
pub fn secret(id: &str) -> Result<Vec<u8>, String> {
    REGISTRY
        .get()
        .and_then(|r| r.secrets.get(id).cloned())
        .ok_or_else(|| format!("No secret with id '{id}'"))
}

/// The passwords the command line gave for the chain of the image at `path`.
pub fn passwords_for(path: &Path) -> Passwords {
    let mut out = Passwords::default();
    let Some(reg) = REGISTRY.get() else {
        return out;
    };
    let same = |p: &Path| {
        p == path
            || matches!(
                (p.canonicalize(), path.canonicalize()),
                (Ok(a), Ok(b)) if a == b
            )
    };
    if let Some((_, keys)) = reg.images.iter().find(|(p, _)| same(p)) {
        for (depth, id) in keys.iter().enumerate() {
            if let Some(bytes) = id.as_ref().and_then(|id| reg.secrets.get(id)) {
                out.set(depth, bytes.clone());
            }
        }
    }
    out
}

/// The passwords for the layer at `depth` of `top`'s chain opened as an image of its own
/// (its own backing files below it).
pub fn passwords_below(top: &Path, depth: usize) -> Passwords {
    let all = passwords_for(top);
    let mut out = Passwords::default();
    for d in depth..depth + qcow2::engine::backing_name::MAX_CHAIN_DEPTH {
        if let Some(p) = all.get(d) {
            out.set(d - depth, p.to_vec());
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn option_strings_and_json_names_name_the_file_and_the_keys_by_depth() {
        let keys = |name: &str, opts| layer_keys(OsStr::new(name), opts).unwrap();
        let (f, k) = keys(
            "driver=qcow2,file.filename=/t/a,,b.qcow2,backing.encrypt.key-secret=s0,encrypt.key-secret=s1",
            true,
        );
        assert_eq!(f, PathBuf::from("/t/a,b.qcow2"));
        assert_eq!(k, vec![Some("s1".into()), Some("s0".into())]);
        // A name the reader refuses gives no keys; the subcommand reports the refusal.
        let refused = "driver=qcow2,file=/t/x.qcow2,encrypt.key-secret=sec0";
        assert!(layer_keys(OsStr::new(refused), true).is_none());
        for name in [
            r#"json:{"driver":"qcow2","file":{"driver":"file","filename":"/t/j"},"encrypt.key-secret":"a","backing.backing.encrypt.key-secret":"c"}"#,
            r#"json:{"driver":"qcow2","file.filename":"/t/j","encrypt":{"key-secret":"a"},"backing":{"backing":{"encrypt":{"key-secret":"c"}}}}"#,
        ] {
            let (f, k) = keys(name, false);
            assert_eq!(f, PathBuf::from("/t/j"), "{name}");
            assert_eq!(k, vec![Some("a".into()), None, Some("c".into())], "{name}");
        }
        assert!(layer_keys(OsStr::new("json:{"), false).is_none());
    }

    #[test]
    fn secrets_parse_and_other_objects_are_left_alone() {
        assert_eq!(
            parse_secret("secret,id=sec0,data=astro,,chicken").unwrap(),
            Some(("sec0".into(), b"astro,chicken".to_vec()))
        );
        assert_eq!(parse_secret("tls-creds-x509,id=t0,dir=/x").unwrap(), None);
        assert!(parse_secret("secret,id=s").is_err());
        assert!(parse_secret("secret,id=s,data=x,keyid=k").is_err());
    }
}
