//! Changing an image's creation options in place, as `qemu-img amend` does: what may be
//! changed and in which order (`entry.rs`), the compatibility level (`version.rs`), and the
//! zero clusters a downgrade turns into data (`expand.rs`).

mod entry;
mod expand;
mod version;

pub use entry::{AmendError, AmendOptions};
