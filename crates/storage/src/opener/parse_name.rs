//! Image names as qemu-img takes them, and what each names. A name is a plain path, a path
//! behind the `file:` protocol prefix, an NBD name (`nbd://`, `nbd+unix://`, `nbd:...`), a
//! `null-co://` device, a `blkdebug:CONFIG:FILE` wrapper, a `json:{...}` pseudo-filename
//! ([`super::json`]), or (with `--image-opts`) a `key=value,...` list of block-layer options
//! ([`super::image_opts`]). All of them come down to one name the opener opens ([`kind`]
//! tells what it opens), the format driver to read it with, and the driver options left over
//! for the subcommand ([`super::nodes`]). Only the drivers this tool has are accepted;
//! QEMU's other block drivers and protocols are refused with the words QEMU uses for a driver
//! it lacks.
//!
//! A name is untrusted input: `json:` text is bounded in size and nesting, and every refusal
//! is a typed error naming what is wrong.

use std::collections::BTreeMap;
use std::ffi::OsStr;
use std::path::{Path, PathBuf};

use super::image_opts::flatten_list;
use super::json::flatten_json;
use super::name::{ImageName, NameError, Reason};
use super::nbd_name;
use super::nodes::interpret;

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
    let flat = if image_opts {
        Some(flatten_list(text()?))
    } else {
        match name.to_str().and_then(|s| s.strip_prefix("json:")) {
            Some(json) => Some(flatten_json(json).map_err(open_err)?),
            None => None,
        }
    };
    match flat {
        Some(flat) => {
            let read = interpret(flat).map_err(open_err)?;
            // A blkdebug node's rules, read here so that a bad rule or `config` file is
            // refused as the name's fault.
            if let Some(node) = read.path.to_str().and_then(crate::blkdebug::Node::parse) {
                node.rules().map_err(|e| open_err(e.into()))?;
            }
            Ok(read)
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
    if let Some(text) = name.to_str().filter(|n| nbd_name::is_nbd_name(n)) {
        // The storage opener connects by this name; it is also how QEMU shows the export.
        let target = nbd_name::parse(text)?;
        return Ok(PathBuf::from(target.display_name()));
    }
    let bytes = name.as_encoded_bytes();
    let Some(colon) = protocol_colon(bytes) else {
        return Ok(PathBuf::from(name));
    };
    let protocol = String::from_utf8_lossy(&bytes[..colon]).into_owned();
    if protocol == "null-co" {
        return match name.to_str() {
            Some(crate::null::NULL_CO) => Ok(PathBuf::from(crate::null::NULL_CO)),
            _ => Err(Reason::NullFilename),
        };
    }
    if protocol == "blkdebug" {
        // The storage opener wraps the file by this name; it is also how QEMU shows it.
        let text = name.to_str().ok_or(Reason::NotUtf8Blkdebug)?;
        let Some((config, _)) = crate::blkdebug::split_name(text)
            .filter(|(config, image)| !config.is_empty() && !image.is_empty())
        else {
            return Err(Reason::BlkdebugName);
        };
        // Read here too, so that a bad configuration is refused as the name's fault.
        crate::blkdebug::Rules::read_config(Path::new(config))?;
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

/// The protocol prefix of `name`, if it has one: a ':' before any '/' (QEMU's rule), so
/// `./a:b` is a file and `nbd:host` is not.
pub fn protocol_prefix(name: &str) -> Option<&str> {
    protocol_colon(name.as_bytes()).map(|colon| &name[..colon])
}

/// Where a protocol prefix ends: the first `:` if it comes before any `/`.
fn protocol_colon(bytes: &[u8]) -> Option<usize> {
    let i = bytes.iter().position(|&b| b == b':' || b == b'/')?;
    (bytes[i] == b':').then_some(i)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::opener::name::{NameKind, COMPRESS_OPTION, MAX_JSON_LEN};

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
    fn protocol_prefixes_follow_qemus_rule() {
        assert_eq!(protocol_prefix("nbd:localhost:10809"), Some("nbd"));
        assert_eq!(protocol_prefix("http://x/y"), Some("http"));
        assert_eq!(protocol_prefix("./a:b.qcow2"), None);
        assert_eq!(protocol_prefix("/abs/a:b"), None);
        assert_eq!(protocol_prefix("base.qcow2"), None);
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
            Reason::BlkdebugConfig(crate::blkdebug::ConfigError::Read(_))
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
    fn option_lists_of_a_luks_volume() {
        // A LUKS volume's key is its own `key-secret`, which no other driver takes.
        let n = p("driver=luks,key-secret=s,file.filename=/t/v", true).unwrap();
        assert_eq!(
            (n.path.as_path(), n.format.as_deref()),
            (Path::new("/t/v"), Some("luks"))
        );
        assert_eq!(n.options.get("key-secret").map(String::as_str), Some("s"));
        assert_eq!(
            reason("driver=qcow2,file.filename=/t/y,key-secret=s", true),
            Reason::FormatOption {
                driver: "qcow2".into(),
                option: "key-secret".into()
            }
        );
    }

    #[test]
    fn option_lists_of_a_quorum_node() {
        assert_eq!(
            reason("driver=quorum,children.0.file.filename=a", true),
            Reason::UnknownDriver("quorum".into())
        );
        // A quorum node under the format: its children in index order, its threshold
        // checked as QEMU checks it.
        let quorum = "driver=qcow2,file.driver=quorum,file.children.1.filename=/t/b,\
                      file.children.0.filename=/t/a";
        let n = p(&format!("{quorum},file.vote-threshold=2"), true).unwrap();
        assert_eq!(
            crate::quorum::QuorumNode::parse(n.path.to_str().unwrap()),
            Some(crate::quorum::QuorumNode {
                threshold: 2,
                children: vec!["/t/a".into(), "/t/b".into()],
            })
        );
        assert_eq!(crate::opener::name::kind(&n.path), NameKind::Quorum);
        for (extra, why) in [
            (
                "",
                Reason::Quorum(crate::quorum::QuorumError::ThresholdZero),
            ),
            (
                ",file.vote-threshold=3",
                Reason::Quorum(crate::quorum::QuorumError::ThresholdTooHigh),
            ),
            (
                ",file.vote-threshold=1,file.read-pattern=fifo",
                Reason::FormatOption {
                    driver: "quorum".into(),
                    option: "read-pattern".into(),
                },
            ),
        ] {
            assert_eq!(reason(&format!("{quorum}{extra}"), true), why, "{extra}");
        }
        // A name cannot make every read fan out to more children than the bound.
        let many: String = (0..=crate::quorum::MAX_CHILDREN)
            .map(|i| format!(",file.children.{i}.filename=/t/c{i}"))
            .collect();
        assert_eq!(
            reason(
                &format!("driver=qcow2,file.driver=quorum{many},file.vote-threshold=1"),
                true
            ),
            Reason::Quorum(crate::quorum::QuorumError::TooManyChildren)
        );
    }

    #[test]
    fn option_lists_of_an_nbd_node() {
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
