//! Safe rules for following backing file names: never a protocol prefix (`nbd:`, `http:`
//! ...), relative names resolved against the image's directory, loops and overly deep chains
//! refused. A `json:` name is followed as QEMU follows it when it describes only nodes this
//! crate has (qcow2 or raw over a file, or over a blkdebug node over a file).

use std::collections::HashSet;
use std::path::{Path, PathBuf};

use storage::opener::described::{describe_name, Described};
use storage::opener::name::Reason;
use storage::opener::protocol_prefix;

/// Longest backing chain we follow. Real chains reach a few hundred layers; a longer one is
/// almost certainly a crafted image trying to exhaust file descriptors or time.
pub const MAX_CHAIN_DEPTH: usize = 1024;

/// Why a backing file is not followed.
#[derive(Debug, thiserror::Error)]
pub enum BackingError {
    /// A `json:` pseudo-protocol name that does not parse or describes nodes this crate does
    /// not have.
    #[error("{image}: refusing to follow backing file name {name:?}: {reason}")]
    Json {
        /// The image naming it.
        image: String,
        /// The name.
        name: String,
        /// What is wrong with it.
        reason: String,
    },
    /// A protocol-prefixed name (`nbd:`, `http:`, ...), which would leave the file system.
    #[error("{image}: refusing to follow backing file name {name:?}: protocol {protocol:?} is not a local file")]
    Protocol {
        /// The image naming it.
        image: String,
        /// The name.
        name: String,
        /// The prefix before ':'.
        protocol: String,
    },
    /// The chain comes back to an image already in it.
    #[error("{image}: backing chain loops back to {path}")]
    Loop {
        /// The image naming it.
        image: String,
        /// The path seen twice.
        path: String,
    },
    /// An untrusted image names a file outside the allowed directories, or something that
    /// is not a file (`--untrusted`).
    #[error("refusing the {kind} {name:?} of '{image}' (named in its {}): {rule}", .kind.place())]
    Refused {
        /// What the image names.
        kind: Reference,
        /// The image naming it.
        image: String,
        /// The name as the image gives it.
        name: String,
        /// The rule it breaks.
        rule: storage::Refusal,
    },
    /// A relative name in an image whose file has no one directory to resolve it against:
    /// a `quorum` node's children may each lie elsewhere, so QEMU gives such a node none.
    #[error("Cannot generate a base directory for quorum nodes")]
    NoBaseDirectory {
        /// The image naming it.
        image: String,
        /// The name.
        name: String,
    },
    /// The chain is deeper than [`MAX_CHAIN_DEPTH`].
    #[error("{image}: backing chain is deeper than {MAX_CHAIN_DEPTH} images")]
    TooDeep {
        /// The image at the limit.
        image: String,
    },
}

/// What an image names a file as.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Reference {
    /// Its backing file (the header's backing file name).
    BackingFile,
    /// Its external data file (the header extension naming it).
    DataFile,
}

impl Reference {
    /// Where in the image the name is kept.
    pub fn place(self) -> &'static str {
        match self {
            Reference::BackingFile => "header",
            Reference::DataFile => "external data file header extension",
        }
    }
}

impl std::fmt::Display for Reference {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Reference::BackingFile => "backing file",
            Reference::DataFile => "external data file",
        })
    }
}

/// [`resolve`] for a name an untrusted image gives (`--untrusted`): a `json:` name's
/// blkdebug node is refused before any file of it is read, and so is a name that is not a
/// file (NBD, `null-co`); the file it resolves to is then judged by [`admit`] once it is
/// canonical.
pub fn resolve_untrusted(
    image: &Path,
    name: &str,
    kind: Reference,
) -> Result<PathBuf, BackingError> {
    let refused = |rule| BackingError::Refused {
        kind,
        image: image.display().to_string(),
        name: name.into(),
        rule,
    };
    let path = match describe_name(name) {
        Some(described) => match described {
            Ok(Described::File(f)) => f,
            Ok(Described::Blkdebug(_)) => {
                return Err(refused(storage::Refusal::NotAFile {
                    what: "a blkdebug fault-injection node",
                }))
            }
            Err(reason) => {
                return Err(BackingError::Json {
                    image: image.display().to_string(),
                    name: name.into(),
                    reason: json_reason(reason),
                })
            }
        },
        None => resolve(image, name)?,
    };
    match path.to_str().and_then(storage::not_a_file) {
        Some(what) => Err(refused(storage::Refusal::NotAFile { what })),
        None => Ok(path),
    }
}

/// Admits the file an untrusted image names, by its canonical path (symlinks followed and
/// `..` resolved by the caller, who may have to do it off its thread): it must lie inside
/// one of `allowed`.
pub fn admit(
    allowed: &storage::AllowDirs,
    image: &Path,
    name: &str,
    kind: Reference,
    canonical: &Path,
) -> Result<(), BackingError> {
    allowed
        .judge(canonical)
        .map_err(|rule| BackingError::Refused {
            kind,
            image: image.display().to_string(),
            name: name.into(),
            rule,
        })
}

/// Resolves `name` (as stored in `image`) to a path, as QEMU's `path_combine` does: absolute
/// names as they are, relative ones against the image's directory (refused, as in QEMU, when
/// the image's file is a `quorum` node, which has none). Refuses `json:` and
/// protocol-prefixed names; a `json:` name becomes the file (or blkdebug node name) it
/// describes (read by the storage opener).
pub fn resolve(image: &Path, name: &str) -> Result<PathBuf, BackingError> {
    if let Some(described) = describe_name(name) {
        return json_name(described).map_err(|reason| BackingError::Json {
            image: image.display().to_string(),
            name: name.into(),
            reason,
        });
    }
    // QEMU's null device (`null-co://`) leaves the process no more than a file does: it
    // stores nothing and reads zeros.
    if name == storage::null::NULL_CO {
        return Ok(PathBuf::from(name));
    }
    if let Some(protocol) = protocol_prefix(name) {
        return Err(BackingError::Protocol {
            image: image.display().to_string(),
            name: name.into(),
            protocol: protocol.into(),
        });
    }
    let path = Path::new(name);
    if path.is_absolute() {
        return Ok(path.to_path_buf());
    }
    if storage::opener::name::kind(image) == storage::opener::name::NameKind::Quorum {
        return Err(BackingError::NoBaseDirectory {
            image: image.display().to_string(),
            name: name.into(),
        });
    }
    // Behind fault injection, the image's own file is what names are relative to.
    let file = image.to_str().and_then(storage::blkdebug::image_file);
    let image = file.as_deref().map_or(image, Path::new);
    Ok(image
        .parent()
        .map_or_else(|| path.to_path_buf(), |dir| dir.join(path)))
}

/// The file a `json:{...}` backing file name describes, as the opener takes it: the `file`
/// node's file name as given (QEMU does not make it relative to the image), or a blkdebug
/// node's name ([`storage::blkdebug::Node`]) once its rules read. The name is read by the
/// storage opener's parser of image names ([`describe_name`]).
fn json_name(described: Result<Described, Reason>) -> Result<PathBuf, String> {
    match described.map_err(json_reason)? {
        Described::File(f) => Ok(f),
        Described::Blkdebug(node) => {
            node.rules().map_err(|e| e.to_string())?;
            Ok(PathBuf::from(node.name()))
        }
    }
}

/// Why a `json:` name is not followed, in this crate's words for a driver it does not have.
fn json_reason(reason: Reason) -> String {
    match reason {
        Reason::UnknownDriver(d) => format!("driver '{d}' is not supported"),
        other => other.to_string(),
    }
}

/// Tracks the images already visited in one chain walk.
#[derive(Debug, Default)]
pub struct ChainGuard {
    seen: HashSet<PathBuf>,
}

impl ChainGuard {
    /// Records `path` (canonicalized when possible, on the calling thread); fails on a
    /// repeat or past the depth limit.
    pub fn enter(&mut self, image: &Path, path: &Path) -> Result<(), BackingError> {
        let key = path.canonicalize().unwrap_or_else(|_| path.to_path_buf());
        self.enter_as(image, path, key)
    }

    /// Records `path`, known as `key` (its canonical name where the caller could find it);
    /// fails on a repeat or past the depth limit.
    pub fn enter_as(
        &mut self,
        image: &Path,
        path: &Path,
        key: PathBuf,
    ) -> Result<(), BackingError> {
        if self.seen.len() >= MAX_CHAIN_DEPTH {
            return Err(BackingError::TooDeep {
                image: image.display().to_string(),
            });
        }
        if !self.seen.insert(key) {
            return Err(BackingError::Loop {
                image: image.display().to_string(),
                path: path.display().to_string(),
            });
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn resolves_relative_names_against_the_image_directory() {
        let top = Path::new("/images/vm/top.qcow2");
        assert_eq!(
            resolve(top, "base.qcow2").unwrap(),
            PathBuf::from("/images/vm/base.qcow2")
        );
        assert_eq!(
            resolve(top, "../b.qcow2").unwrap(),
            PathBuf::from("/images/vm/../b.qcow2")
        );
        assert_eq!(
            resolve(top, "/other/b.qcow2").unwrap(),
            PathBuf::from("/other/b.qcow2")
        );
        assert_eq!(
            resolve(Path::new("top.qcow2"), "b.qcow2").unwrap(),
            PathBuf::from("b.qcow2")
        );
    }

    #[test]
    fn relative_names_have_no_directory_on_a_quorum_node() {
        let node = storage::quorum::QuorumNode {
            threshold: 1,
            children: vec!["/a/top.qcow2".into(), "/b/top.qcow2".into()],
        };
        let image = PathBuf::from(node.name());
        assert!(matches!(
            resolve(&image, "base.qcow2"),
            Err(BackingError::NoBaseDirectory { .. })
        ));
        assert_eq!(
            resolve(&image, "/c/base.qcow2").unwrap(),
            Path::new("/c/base.qcow2")
        );
    }

    #[test]
    fn refuses_json_and_protocol_names() {
        let top = Path::new("top.qcow2");
        assert!(matches!(
            resolve(top, "json:{\"file\":{}}"),
            Err(BackingError::Json { .. })
        ));
        assert!(matches!(
            resolve(top, "nbd:127.0.0.1:10809"),
            Err(BackingError::Protocol { .. })
        ));
    }

    #[test]
    fn untrusted_names_are_files_or_refused_before_any_file_is_read() {
        let top = Path::new("/img/top.qcow2");
        let kind = Reference::BackingFile;
        assert_eq!(
            resolve_untrusted(top, "b.qcow2", kind).unwrap(),
            PathBuf::from("/img/b.qcow2")
        );
        let file = r#"json:{"driver":"raw","file":{"driver":"file","filename":"/x/b"}}"#;
        assert_eq!(
            resolve_untrusted(top, file, kind).unwrap(),
            PathBuf::from("/x/b")
        );
        // The config names a file that does not exist: read, it would fail differently.
        let bd = r#"json:{"driver":"raw","file":{"driver":"blkdebug","config":"/nonexistent/c",
                  "image":{"driver":"file","filename":"/x/b"}}}"#;
        let null = r#"json:{"driver":"raw","file":{"driver":"file","filename":"null-co://"}}"#;
        let nbd = r#"json:{"driver":"raw","file":{"filename":"nbd+unix:///?socket=/s"}}"#;
        for name in [bd, null, nbd] {
            match resolve_untrusted(top, name, kind) {
                Err(BackingError::Refused {
                    rule: storage::Refusal::NotAFile { .. },
                    ..
                }) => {}
                other => panic!("{name}: {other:?}"),
            }
        }
        let allow = storage::AllowDirs::default();
        let e = admit(&allow, top, "b", kind, Path::new("/img/b")).unwrap_err();
        assert!(e.to_string().contains("no --allow-dir was given"), "{e}");
    }

    #[test]
    fn guard_detects_loops_and_depth() {
        let mut guard = ChainGuard::default();
        let img = Path::new("x");
        let enter =
            |guard: &mut ChainGuard, p: &str| guard.enter_as(img, Path::new(p), PathBuf::from(p));
        enter(&mut guard, "/nonexistent/a").unwrap();
        assert!(matches!(
            enter(&mut guard, "/nonexistent/a"),
            Err(BackingError::Loop { .. })
        ));
        for i in 1..MAX_CHAIN_DEPTH {
            enter(&mut guard, &format!("/nonexistent/{i}")).unwrap();
        }
        assert!(matches!(
            enter(&mut guard, "/nonexistent/last"),
            Err(BackingError::TooDeep { .. })
        ));
    }

    #[test]
    fn json_names_become_the_file_or_blkdebug_node_they_describe() {
        let top = Path::new("dir/top.qcow2");
        let plain = "json:{'driver':'qcow2','file':{'driver':'file','filename':'b.qcow2'}}";
        assert_eq!(resolve(top, plain).unwrap(), PathBuf::from("b.qcow2"));
        let dotted = r#"json:{"driver":"qcow2","file.driver":"file","file.filename":"/b"}"#;
        assert_eq!(resolve(top, dotted).unwrap(), PathBuf::from("/b"));
        let bd = "json:{'driver':'qcow2','file':{'driver':'blkdebug',\
                  'inject-error':[{'event':'write_aio','errno':28,'once':true}],\
                  'image':{'driver':'file','filename':'/x/b.qcow2'}}}";
        let path = resolve(top, bd).unwrap();
        let node = storage::blkdebug::Node::parse(path.to_str().unwrap()).unwrap();
        assert_eq!(node.image, "/x/b.qcow2");
        let rules = node.rules().unwrap();
        assert_eq!((rules.inject.len(), rules.inject[0].errno), (1, 28));
        assert!(rules.inject[0].once);
        // Names below the node are relative to its file's directory.
        assert_eq!(
            resolve(&path, "c.qcow2").unwrap(),
            PathBuf::from("/x/c.qcow2")
        );
    }

    #[test]
    fn json_names_with_other_nodes_or_bad_rules_are_refused() {
        let top = Path::new("top.qcow2");
        for name in [
            "json:{'driver':'vmdk','file':{'driver':'file','filename':'b'}}",
            "json:{'driver':'qcow2','file':{'driver':'nbd','path':'/s'}}",
            "json:{'driver':'qcow2','file':'node0'}",
            "json:{'driver':'qcow2','file':{'filename':'b'},'backing':null}",
            "json:{'driver':'qcow2','file':{'driver':'blkdebug',\
             'inject-error':[{'event':'nope'}],'image':{'filename':'b'}}}",
            "json:{'driver':'qcow2','file':{'driver':'blkdebug','image':'n'}}",
            "json:[1]",
            "json:{'driver':",
        ] {
            assert!(
                matches!(resolve(top, name), Err(BackingError::Json { .. })),
                "{name}"
            );
        }
    }
}
