//! What an image name names, and what reading one gives: [`kind`] tells a local file from an
//! NBD export (`nbd://`, `nbd+unix://`, `nbd:...`), a `null-co` device, a `blkdebug`
//! wrapper and a `quorum` node, for the opener and for everyone who must know before opening; [`ImageName`] is
//! a name read ([`super::parse`]), and [`NameError`] / [`Reason`] say why one was refused.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

/// What a name opens.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum NameKind {
    /// A local file (or block device).
    File,
    /// An NBD export.
    Nbd,
    /// A `null-co` device, which stores nothing.
    Null,
    /// A file behind QEMU's `blkdebug` fault injection.
    Blkdebug,
    /// QEMU's `quorum` node over several files.
    Quorum,
}

impl NameKind {
    /// How a refusal names what is not a file (`None` for a file).
    pub fn not_a_file(self) -> Option<&'static str> {
        match self {
            NameKind::File => None,
            NameKind::Nbd => Some("an NBD export"),
            NameKind::Null => Some("a null-co device"),
            NameKind::Blkdebug => Some("a blkdebug fault-injection node"),
            NameKind::Quorum => Some("a quorum node"),
        }
    }
}

/// What `name` opens.
pub fn kind(name: &Path) -> NameKind {
    name.to_str().map_or(NameKind::File, kind_of_text)
}

/// What the name `text` opens.
pub fn kind_of_text(text: &str) -> NameKind {
    if super::nbd_name::is_nbd_name(text) {
        NameKind::Nbd
    } else if crate::null::is_null_name(text) {
        NameKind::Null
    } else if text.starts_with("blkdebug:") || crate::blkdebug::Node::parse(text).is_some() {
        NameKind::Blkdebug
    } else if crate::quorum::QuorumNode::parse(text).is_some() {
        NameKind::Quorum
    } else {
        NameKind::File
    }
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
    Nbd(#[from] super::nbd_name::NbdNameError),
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
    BlkdebugConfig(#[from] crate::blkdebug::ConfigError),
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
    /// A `quorum` node QEMU would refuse (its children or its threshold).
    #[error("{0}")]
    Quorum(#[from] crate::quorum::QuorumError),
    /// A `quorum` option value QEMU would refuse.
    #[error("Parameter '{0}' expects {1}")]
    QuorumValue(String, &'static str),
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
    /// Driver options kept for the subcommand (keys, TLS options, the `compress` mark) (flattened `a.b` keys).
    pub options: BTreeMap<String, String>,
    /// The `backing` node, when the options describe it: its file and driver.
    pub backing: Option<(PathBuf, Option<String>)>,
    /// The qcow2 image's external data file given as the `data-file` node (`file`
    /// protocol), which replaces the one the header names.
    pub data_file: Option<PathBuf>,
}

/// The longest `json:` text accepted (QEMU has no limit; this only bounds memory).
pub const MAX_JSON_LEN: usize = 1 << 20;

/// The deepest nesting of objects and arrays accepted in `json:` text.
pub const MAX_JSON_DEPTH: usize = 16;

/// The option [`ImageName::options`] carries for an image under QEMU's `compress` filter:
/// every write through it becomes compressed clusters.
pub const COMPRESS_OPTION: &str = "compress";
