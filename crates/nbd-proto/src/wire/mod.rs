//! Pure encode/decode of every NBD protocol structure: no I/O, every length checked.
//!
//! Decoders take untrusted bytes and return a typed [`WireError`] naming the structure, the
//! field and the byte offset that is wrong; they never panic, which `tests` check with
//! proptest on arbitrary input. Encoders produce exactly what the matching decoder accepts.

pub mod consts;
mod cursor;
mod error;
pub mod handshake;
pub mod option_data;
pub mod reply;
pub mod request;

pub use consts::*;
pub(crate) use cursor::Cursor;
pub use error::WireError;

#[cfg(test)]
mod tests;
