//! qcow2: the image format as pure, I/O-free types ([`format`]), a synchronous inspector
//! that decodes an image's metadata for `qcow2-nbd info` ([`inspect`]) and the async image
//! engine ([`engine`]); and what a new image of a given shape costs on disk ([`measure`]).

pub mod crypto;
pub mod engine;
pub mod format;
pub mod inspect;
pub mod measure;
pub mod metadata;
