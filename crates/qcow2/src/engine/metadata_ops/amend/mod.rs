//! Changing an image's creation options in place, as `qemu-img amend` does: what may be
//! changed and in which order (`entry.rs`), the compatibility level (`version.rs`), the
//! zero clusters a downgrade turns into data (`expand.rs`), how far it has come
//! (`progress.rs`), and the refcount width
//! (`refcount.rs`, over the checker's count and rebuild).

mod entry;
mod expand;
mod progress;
mod refcount;
mod version;

pub use entry::{AmendError, AmendOptions};
