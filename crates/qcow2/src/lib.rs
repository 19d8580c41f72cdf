//! qcow2: the metadata loader ([`metadata`]), a synchronous inspector that decodes an image's
//! metadata for `qcow2-nbd info` ([`inspect`]), the async image engine ([`engine`]), the
//! checker and repairer `qcow2-nbd check` runs ([`check`], a tool over the engine's layers
//! and overlap index rather than a part of the engine); and
//! what a new image of a given shape costs on disk ([`measure`]). The format itself, as pure
//! I/O-free types, is the `qcow2-format` crate ([`format`]).

pub mod check;
pub mod crypto;
pub mod declared;
pub mod engine;
/// The on-disk format as pure types: the `qcow2-format` crate, re-exported so that
/// `qcow2::format` and the engine's `crate::format` name one thing.
pub use qcow2_format as format;
pub mod inspect;
pub mod measure;
pub mod metadata;
pub mod qemu_json;
