//! The one metadata loader: reading an image's header, snapshot table, bitmap directory and
//! tables from any byte source, at the strictness of whoever asks. `info` and opening an
//! image for I/O load at [`Strictness::Open`] and refuse what QEMU refuses; `check` loads at
//! [`Strictness::Check`], because it must look at images a normal open refuses in order to
//! report and repair them.
//!
//! The loader only reads and decodes. What a caller then demands of the structures (that
//! they lie apart, that L2 pointers stay inside the file) is the caller's: the engine
//! validates more than `info` needs, the checker reports instead of refusing.

mod error;
mod loader;
mod source;

pub use crate::format::header::Strictness;
pub use error::MetadataError;
pub(crate) use loader::{Loader, BITMAP_TABLE, L1_TABLE, REFCOUNT_TABLE};
pub use source::ByteSource;
pub(crate) use source::{run_ready, MetaSource, StorageSource, SyncSource};
