//! The codes the header's fields take, and how strict a decode is.

/// "QFI\xfb".
pub const QCOW2_MAGIC: u32 = 0x5146_49fb;

/// How much of the header (and of a snapshot table entry) a decode insists on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Strictness {
    /// Everything QEMU checks before it opens an image.
    Open,
    /// What `qemu-img check` needs to look at an image: the refcount table may be empty, and
    /// the snapshot table's placement and a snapshot entry's extra data past QEMU's limit are
    /// left to the checker, which reports and repairs them.
    Check,
}
/// compression_type: zlib (deflate).
pub const COMPRESSION_ZLIB: u8 = 0;
/// compression_type: zstd.
pub const COMPRESSION_ZSTD: u8 = 1;
/// crypt_method: none.
pub const CRYPT_NONE: u32 = 0;
/// crypt_method: legacy AES-CBC.
pub const CRYPT_AES: u32 = 1;
/// crypt_method: LUKS.
pub const CRYPT_LUKS: u32 = 2;
