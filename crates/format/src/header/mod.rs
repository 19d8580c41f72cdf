//! The image header (version 2 and 3): every field, feature bits, `compression_type`, unknown
//! additional fields kept byte-for-byte, header extensions and the backing file name.
//!
//! `model` is the decoded header and what its fields say, `decode` reads and validates it
//! from the first cluster, `encode` writes the first cluster back, `extension_access` finds
//! and replaces what its extensions record, `field` and `update` are the in-place field
//! writes the engine makes, `values` the codes its fields take.

mod decode;
mod encode;
mod extension_access;
pub mod field;
mod model;
mod update;
mod values;

pub use model::Header;
pub use update::{
    active_disk_update, autoclear_update, compatible_update, emptied_tables_update,
    incompatible_update, l1_update, nb_snapshots_update, refcount_structure_update,
    reftable_update, size_update, snapshots_update, FieldUpdate,
};
pub use values::{
    Strictness, COMPRESSION_ZLIB, COMPRESSION_ZSTD, CRYPT_AES, CRYPT_LUKS, CRYPT_NONE, QCOW2_MAGIC,
};

#[cfg(test)]
mod tests;
