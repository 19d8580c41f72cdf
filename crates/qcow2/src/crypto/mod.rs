//! qcow2's own encryption, compatible with QEMU's: LUKS1 (`crypt_method` 2, the key slots in
//! an encryption header of its own inside the image file) and the legacy AES-CBC method
//! (`crypt_method` 1, the key being the password itself).
//!
//! The engine sees one seam, [`DataCrypto`]: data clusters are decrypted after they are read
//! and encrypted before they are written, whole 512-byte sectors at a time. A LUKS image
//! numbers its sectors by their place in the image file, a legacy one by their place in the
//! guest disk, as QEMU does.
//!
//! Everything in a LUKS header is untrusted: every length, offset and count is checked
//! before use, and iteration counts are bounded so that a hostile header cannot make an
//! open run for hours.

mod af;
mod cipher;
mod error;
mod hash;
pub mod luks;

pub use cipher::{CipherAlg, CipherMode, IvGen, SectorCipher, SECTOR_SIZE};
pub use error::CryptoError;
pub use hash::HashAlg;
pub use luks::{LuksCreate, LuksHeader, LuksInfo, LuksSlotInfo, SlotChange};

/// Fills `buf` from the operating system's random source.
pub fn random(buf: &mut [u8]) -> Result<(), CryptoError> {
    getrandom::fill(buf).map_err(|e| CryptoError::Random(e.to_string()))
}

/// The passwords of an image chain's encrypted layers, by depth (0 is the image opened, 1 its
/// backing file, ...), as `encrypt.key-secret` and `backing.encrypt.key-secret` give them.
#[derive(Clone, Default, PartialEq, Eq)]
pub struct Passwords(Vec<Option<Vec<u8>>>);

impl std::fmt::Debug for Passwords {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // Never the passwords themselves.
        let given: Vec<bool> = self.0.iter().map(Option::is_some).collect();
        f.debug_tuple("Passwords").field(&given).finish()
    }
}

impl Passwords {
    /// The password of the layer at `depth`.
    pub fn get(&self, depth: usize) -> Option<&[u8]> {
        self.0.get(depth).and_then(|p| p.as_deref())
    }

    /// Sets the password of the layer at `depth`.
    pub fn set(&mut self, depth: usize, password: Vec<u8>) {
        if self.0.len() <= depth {
            self.0.resize(depth + 1, None);
        }
        self.0[depth] = Some(password);
    }

    /// Whether no layer has a password.
    pub fn is_empty(&self) -> bool {
        self.0.iter().all(Option::is_none)
    }
}

/// What unlocks a layer on open.
#[derive(Clone, Copy, Debug)]
pub enum Unlock<'a> {
    /// This password.
    With(&'a [u8]),
    /// Nothing: an encrypted layer is refused.
    Missing,
    /// Nothing, and the data will not be read (QEMU's "no I/O" opens, e.g. to learn a
    /// backing file's size): an encrypted layer opens locked, and any data I/O fails.
    Locked,
}

impl Passwords {
    /// What unlocks the layer at `depth`; `no_io` opens without a password locked.
    pub fn unlock(&self, depth: usize, no_io: bool) -> Unlock<'_> {
        match (self.get(depth), no_io) {
            (Some(p), _) => Unlock::With(p),
            (None, true) => Unlock::Locked,
            (None, false) => Unlock::Missing,
        }
    }
}

/// An unlocked image's data cipher: what the engine calls on every data cluster.
#[derive(Debug)]
pub struct DataCrypto {
    /// `None` for a layer opened locked.
    cipher: Option<SectorCipher>,
    /// Sectors are numbered by their place in the image file (LUKS), not in the guest disk
    /// (legacy AES).
    by_host: bool,
}

impl DataCrypto {
    /// The legacy method (`crypt_method` 1): AES-128-CBC keyed with the password's first 16
    /// bytes (zero-padded), IVs from guest sector numbers.
    pub fn legacy_aes(password: &[u8]) -> DataCrypto {
        let mut key = [0u8; 16];
        let n = password.len().min(16);
        key[..n].copy_from_slice(&password[..n]);
        let cipher = SectorCipher::new(CipherAlg::Aes128, CipherMode::Cbc, IvGen::Plain64, &key)
            .expect("a 16-byte key fits AES-128");
        DataCrypto {
            cipher: Some(cipher),
            by_host: false,
        }
    }

    /// LUKS: the master key's cipher, IVs from host sector numbers.
    pub fn luks(cipher: SectorCipher) -> DataCrypto {
        DataCrypto {
            cipher: Some(cipher),
            by_host: true,
        }
    }

    /// A LUKS volume (QEMU's `luks` driver): the master key's cipher, IVs from guest sector
    /// numbers, since the volume's disk starts at its payload offset.
    pub fn luks_volume(cipher: SectorCipher) -> DataCrypto {
        DataCrypto {
            cipher: Some(cipher),
            by_host: false,
        }
    }

    /// An encrypted layer opened without its password: every data I/O fails.
    pub fn locked() -> DataCrypto {
        DataCrypto {
            cipher: None,
            by_host: true,
        }
    }

    fn cipher(&self) -> Result<&SectorCipher, CryptoError> {
        self.cipher.as_ref().ok_or(CryptoError::MissingSecret)
    }

    fn first_sector(&self, host: u64, guest: u64) -> Result<u64, CryptoError> {
        let at = if self.by_host { host } else { guest };
        if at % SECTOR_SIZE != 0 {
            return Err(CryptoError::Unaligned { len: at as usize });
        }
        Ok(at / SECTOR_SIZE)
    }

    /// Decrypts `buf`, read from file offset `host`, guest offset `guest`.
    pub fn decrypt(&self, host: u64, guest: u64, buf: &mut [u8]) -> Result<(), CryptoError> {
        self.cipher()?.decrypt(self.first_sector(host, guest)?, buf)
    }

    /// Encrypts `buf`, to be written at file offset `host`, guest offset `guest`.
    pub fn encrypt(&self, host: u64, guest: u64, buf: &mut [u8]) -> Result<(), CryptoError> {
        self.cipher()?.encrypt(self.first_sector(host, guest)?, buf)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pbkdf2_matches_the_rfc_6070_vector() {
        let mut out = [0u8; 20];
        HashAlg::Sha1.pbkdf2(b"password", b"salt", 2, &mut out);
        assert_eq!(
            out,
            [
                0xea, 0x6c, 0x01, 0x4d, 0xc7, 0x2d, 0x6f, 0x8c, 0xcd, 0x1e, 0xd9, 0x2a, 0xce, 0x1d,
                0x41, 0xf0, 0xd8, 0xde, 0x89, 0x57
            ]
        );
    }

    #[test]
    fn sectors_round_trip_and_depend_on_their_number() {
        let key = [7u8; 64];
        let c =
            SectorCipher::new(CipherAlg::Aes256, CipherMode::Xts, IvGen::Plain64, &key).unwrap();
        let plain = vec![0x5au8; 1024];
        let mut a = plain.clone();
        c.encrypt(3, &mut a).unwrap();
        assert_ne!(a, plain);
        assert_ne!(a[..512], a[512..], "each sector has its own IV");
        let mut b = plain.clone();
        c.encrypt(4, &mut b).unwrap();
        assert_eq!(a[512..], b[..512]);
        c.decrypt(3, &mut a).unwrap();
        assert_eq!(a, plain);
        assert!(c.encrypt(0, &mut [0u8; 100]).is_err());
    }

    #[test]
    fn legacy_cbc_round_trips() {
        let d = DataCrypto::legacy_aes(b"astrochicken");
        let mut buf = vec![1u8; 512];
        d.encrypt(999, 512, &mut buf).unwrap();
        d.decrypt(0, 512, &mut buf).unwrap();
        assert_eq!(buf, vec![1u8; 512]);
    }
}
