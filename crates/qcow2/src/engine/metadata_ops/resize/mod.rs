//! Changing the virtual disk size, as `qemu-img resize` does: the checks QEMU makes before
//! anything changes and raw files (`entry.rs`), growing with its preallocation modes
//! (`grow.rs`), and shrinking (`shrink.rs`).

mod entry;
mod grow;
mod shrink;

pub use entry::ResizeError;
