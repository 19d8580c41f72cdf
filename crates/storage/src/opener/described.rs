//! What a `json:` name an image stores (its backing file or external data file) describes,
//! read by the same parser as every other image name ([`super::parse`]) but held to what an
//! image may name: a file, or a blkdebug node over a file, under a qcow2 or raw node. No file
//! is opened or read here, not even a blkdebug node's `config`, so a caller can refuse the
//! node before anything of it is touched.

use std::path::PathBuf;

use super::image_opts::text;
use super::json::flatten_json;
use super::name::Reason;
use super::nodes::interpret;
use crate::blkdebug::Node;

/// What a `json:` name an image stores describes.
#[derive(Debug)]
pub enum Described {
    /// A file node's file name, as given (QEMU does not make it relative to the image).
    File(PathBuf),
    /// A blkdebug node over a file node; its rules (and its `config` file) not read yet.
    Blkdebug(Node),
}

/// True when `name` is a `json:{...}` pseudo-filename, which [`super::parse`] (or, for a
/// name an image stores, [`describe_name`]) reads as options rather than as a path.
pub fn is_json_name(name: &str) -> bool {
    name.starts_with("json:")
}

/// What `name` describes when it is a `json:` name an image stores (see [`describe`]);
/// `None` for any other name.
pub fn describe_name(name: &str) -> Option<Result<Described, Reason>> {
    name.strip_prefix("json:").map(describe)
}

/// Reads `json` (a `json:` name without the prefix) into the file or blkdebug node it
/// describes. Drivers other than `qcow2`, `raw` and `file` above, and `file` and `blkdebug`
/// below, are refused, and so are nodes an image's name cannot carry (a `backing` or
/// `data-file` node, keys, the `compress` filter).
pub fn describe(json: &str) -> Result<Described, Reason> {
    let flat = flatten_json(json)?;
    let driver_of = |key: &str| text(flat.get(key).cloned());
    match driver_of("driver").as_deref() {
        None | Some("qcow2") | Some("raw") | Some("file") => {}
        Some(other) => return Err(Reason::UnknownDriver(other.into())),
    }
    match driver_of("file.driver").as_deref() {
        None | Some("file") | Some("blkdebug") => {}
        Some(other) => return Err(Reason::UnknownDriver(other.into())),
    }
    let blkdebug = driver_of("file.driver").as_deref() == Some("blkdebug");
    let name = interpret(flat)?;
    let format = name.format.as_deref().unwrap_or("qcow2");
    let unsupported = |option: &str| Reason::FormatOption {
        driver: format.into(),
        option: option.into(),
    };
    if name.backing.is_some() {
        return Err(unsupported("backing"));
    }
    if name.data_file.is_some() {
        return Err(unsupported("data-file"));
    }
    if let Some(option) = name.options.keys().next() {
        return Err(unsupported(option));
    }
    let node = blkdebug
        .then(|| name.path.to_str().and_then(Node::parse))
        .flatten();
    Ok(match node {
        Some(node) => Described::Blkdebug(node),
        None => Described::File(name.path),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn file(json: &str) -> PathBuf {
        match describe(json) {
            Ok(Described::File(path)) => path,
            other => panic!("{json}: {other:?}"),
        }
    }

    #[test]
    fn files_and_blkdebug_nodes_are_described_without_reading_any_file() {
        let plain = "{'driver':'qcow2','file':{'driver':'file','filename':'b.qcow2'}}";
        assert_eq!(file(plain), PathBuf::from("b.qcow2"));
        let dotted = r#"{"driver":"qcow2","file.driver":"file","file.filename":"/b"}"#;
        assert_eq!(file(dotted), PathBuf::from("/b"));
        assert_eq!(
            file(r#"{"driver":"file","filename":"/f"}"#),
            PathBuf::from("/f")
        );
        // The config names a file that does not exist: read, it would be refused.
        let bd = "{'driver':'raw','file':{'driver':'blkdebug','config':'/nonexistent/c',\
                  'inject-error':[{'event':'write_aio','errno':28,'once':true}],\
                  'image':{'driver':'file','filename':'/x/b'}}}";
        let Ok(Described::Blkdebug(node)) = describe(bd) else {
            panic!("{bd}");
        };
        assert_eq!(
            (node.image.as_str(), node.config.as_deref()),
            ("/x/b", Some("/nonexistent/c"))
        );
        assert_eq!(node.inject.len(), 1);
    }

    #[test]
    fn nodes_an_image_name_cannot_carry_are_refused() {
        for (json, reason) in [
            (
                "{'driver':'vmdk','file':{'filename':'b'}}",
                Reason::UnknownDriver("vmdk".into()),
            ),
            (
                "{'driver':'qcow2','file':{'driver':'nbd','path':'/s'}}",
                Reason::UnknownDriver("nbd".into()),
            ),
            (
                "{'driver':'null-co'}",
                Reason::UnknownDriver("null-co".into()),
            ),
            (
                "{'driver':'qcow2','file':'node0'}",
                Reason::NodeRef("node0".into()),
            ),
            (
                "{'driver':'qcow2','file':{'filename':'b'},'backing.file.filename':'c'}",
                Reason::FormatOption {
                    driver: "qcow2".into(),
                    option: "backing".into(),
                },
            ),
            (
                "{'driver':'qcow2','file':{'filename':'b'},'encrypt.key-secret':'k'}",
                Reason::FormatOption {
                    driver: "qcow2".into(),
                    option: "encrypt.key-secret".into(),
                },
            ),
        ] {
            assert_eq!(describe(json).unwrap_err(), reason, "{json}");
        }
    }
}
