//! Why encryption could not be set up or used.

/// Why encryption could not be set up or used. The messages of the ones users meet follow
/// QEMU's wording.
#[derive(Debug, thiserror::Error)]
pub enum CryptoError {
    /// The magic is not LUKS's.
    #[error("Volume is not in LUKS format")]
    NotLuks,
    /// A LUKS version other than 1.
    #[error("LUKS version {0} is not supported")]
    Version(u16),
    /// A LUKS header field that is out of range or inconsistent.
    #[error("LUKS header is corrupt: {0}")]
    Header(String),
    /// A cipher, mode, IV generator or hash we do not implement.
    #[error("Unsupported LUKS {what} '{name}'")]
    Unsupported {
        /// Which field.
        what: &'static str,
        /// Its value.
        name: String,
    },
    /// No key slot opens with the password.
    #[error("Invalid password, cannot unlock any keyslot")]
    InvalidPassword,
    /// An encrypted image opened for I/O without a secret.
    #[error("Parameter 'encrypt.key-secret' is required for cipher")]
    MissingSecret,
    /// A LUKS volume opened for I/O without a secret.
    #[error("Parameter 'key-secret' is required for cipher")]
    MissingVolumeSecret,
    /// A key of the wrong size for its cipher.
    #[error("{alg}: key of {len} bytes is the wrong size")]
    KeyLength {
        /// The cipher.
        alg: &'static str,
        /// The key length given.
        len: usize,
    },
    /// Data that is not whole sectors.
    #[error("encrypted I/O of {len} bytes is not a whole number of 512-byte sectors")]
    Unaligned {
        /// The length.
        len: usize,
    },
    /// The operating system's random source failed.
    #[error("could not get random bytes: {0}")]
    Random(String),
    /// Key slot management (amend) refused.
    #[error("{0}")]
    Slots(String),
}
