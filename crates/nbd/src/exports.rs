//! The set of named exports a server offers, and how a client's name selects one.

use std::rc::Rc;

use crate::export::{BlockSizeError, Export};
use crate::wire::MAX_STRING_LEN;

/// One named export.
pub struct ExportEntry<E> {
    /// Name clients ask for (`""` is the conventional default, as in qemu-nbd).
    pub name: String,
    /// Description sent with `NBD_INFO_DESCRIPTION` and in `OPT_LIST` replies.
    pub description: String,
    /// The export itself, shared by every connection.
    pub export: Rc<E>,
}

impl<E> ExportEntry<E> {
    /// An export named `name` without description.
    pub fn new(name: impl Into<String>, export: Rc<E>) -> Self {
        Self {
            name: name.into(),
            description: String::new(),
            export,
        }
    }

    /// Sets the description.
    pub fn with_description(mut self, description: impl Into<String>) -> Self {
        self.description = description.into();
        self
    }
}

impl<E> Clone for ExportEntry<E> {
    fn clone(&self) -> Self {
        Self {
            name: self.name.clone(),
            description: self.description.clone(),
            export: Rc::clone(&self.export),
        }
    }
}

/// Why a list of exports cannot be served.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ExportsError {
    /// No export at all.
    #[error("no export to serve")]
    Empty,
    /// Two exports share a name.
    #[error("export name {0:?} is used twice")]
    DuplicateName(String),
    /// A name or description exceeds the protocol's 4096-byte string limit.
    #[error("export {name:?}: {field} is {len} bytes, the NBD limit is 4096")]
    TooLong {
        /// Export concerned.
        name: String,
        /// `name` or `description`.
        field: &'static str,
        /// Its length.
        len: usize,
    },
    /// The export advertises block sizes the spec forbids.
    #[error("export {name:?}: {source}")]
    BlockSize {
        /// Export concerned.
        name: String,
        /// What is wrong.
        source: BlockSizeError,
    },
}

/// A validated, non-empty list of exports with unique names.
pub struct Exports<E> {
    entries: Vec<ExportEntry<E>>,
}

impl<E> Clone for Exports<E> {
    fn clone(&self) -> Self {
        Self {
            entries: self.entries.clone(),
        }
    }
}

impl<E: Export> Exports<E> {
    /// Validates names, descriptions and block sizes.
    pub fn new(entries: Vec<ExportEntry<E>>) -> Result<Self, ExportsError> {
        if entries.is_empty() {
            return Err(ExportsError::Empty);
        }
        for (i, e) in entries.iter().enumerate() {
            for (field, len) in [("name", e.name.len()), ("description", e.description.len())] {
                if len > MAX_STRING_LEN {
                    return Err(ExportsError::TooLong {
                        name: e.name.clone(),
                        field,
                        len,
                    });
                }
            }
            if entries[..i].iter().any(|o| o.name == e.name) {
                return Err(ExportsError::DuplicateName(e.name.clone()));
            }
            e.export
                .features()
                .block_size
                .validate()
                .map_err(|source| ExportsError::BlockSize {
                    name: e.name.clone(),
                    source,
                })?;
        }
        Ok(Self { entries })
    }
}

impl<E> Exports<E> {
    /// All exports, in the order given.
    pub fn entries(&self) -> &[ExportEntry<E>] {
        &self.entries
    }

    /// The export a client's name selects: an exact, byte-for-byte match, as qemu-nbd
    /// matches names. The empty name is a name like any other: it reaches an export only
    /// if one is called "" (the default of `serve`), so a client that forgot the name of a
    /// named export is told so instead of silently getting some other disk.
    pub fn find(&self, name: &[u8]) -> Option<usize> {
        self.entries.iter().position(|e| e.name.as_bytes() == name)
    }

    /// The export at `index` (as returned by [`Exports::find`]).
    pub fn get(&self, index: usize) -> Option<&ExportEntry<E>> {
        self.entries.get(index)
    }
}
