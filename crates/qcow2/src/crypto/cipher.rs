//! The sector ciphers of encrypted data: AES in XTS or CBC mode, each 512-byte sector with its
//! own IV (its sector number, as QEMU's `plain64` and `plain` IV generators make it).

use super::error::CryptoError;
use aes::cipher::{Array, BlockCipherDecrypt, BlockCipherEncrypt, KeyInit};
use aes::{Aes128, Aes192, Aes256};
use cbc::cipher::{BlockModeDecrypt, BlockModeEncrypt, InnerIvInit};
use xts_mode::Xts128;

/// The unit every encrypted byte belongs to; IVs count these.
pub const SECTOR_SIZE: u64 = 512;

/// The block cipher.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CipherAlg {
    /// AES with a 128-bit key.
    Aes128,
    /// AES with a 192-bit key.
    Aes192,
    /// AES with a 256-bit key.
    Aes256,
}

impl CipherAlg {
    /// QEMU's name (`aes-256`), as `info` shows it.
    pub fn name(self) -> &'static str {
        match self {
            CipherAlg::Aes128 => "aes-128",
            CipherAlg::Aes192 => "aes-192",
            CipherAlg::Aes256 => "aes-256",
        }
    }

    /// Key bytes of one cipher instance.
    pub fn key_len(self) -> usize {
        match self {
            CipherAlg::Aes128 => 16,
            CipherAlg::Aes192 => 24,
            CipherAlg::Aes256 => 32,
        }
    }

    /// Parses QEMU's name.
    pub fn from_name(name: &str) -> Option<CipherAlg> {
        match name {
            "aes-128" => Some(CipherAlg::Aes128),
            "aes-192" => Some(CipherAlg::Aes192),
            "aes-256" => Some(CipherAlg::Aes256),
            _ => None,
        }
    }
}

/// The block cipher mode.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CipherMode {
    /// XTS (two keys: data and tweak).
    Xts,
    /// CBC.
    Cbc,
}

impl CipherMode {
    /// The name in LUKS headers and in `info`.
    pub fn name(self) -> &'static str {
        match self {
            CipherMode::Xts => "xts",
            CipherMode::Cbc => "cbc",
        }
    }

    /// Parses the name.
    pub fn from_name(name: &str) -> Option<CipherMode> {
        match name {
            "xts" => Some(CipherMode::Xts),
            "cbc" => Some(CipherMode::Cbc),
            _ => None,
        }
    }

    /// Master key bytes for `alg` in this mode.
    pub fn key_len(self, alg: CipherAlg) -> usize {
        match self {
            CipherMode::Xts => 2 * alg.key_len(),
            CipherMode::Cbc => alg.key_len(),
        }
    }
}

/// How a sector's IV is made from its number.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum IvGen {
    /// The sector number, 64-bit little-endian.
    Plain64,
    /// The sector number's low 32 bits, little-endian.
    Plain,
}

impl IvGen {
    /// The name in LUKS headers and in `info`.
    pub fn name(self) -> &'static str {
        match self {
            IvGen::Plain64 => "plain64",
            IvGen::Plain => "plain",
        }
    }

    /// Parses the name.
    pub fn from_name(name: &str) -> Option<IvGen> {
        match name {
            "plain64" => Some(IvGen::Plain64),
            "plain" => Some(IvGen::Plain),
            _ => None,
        }
    }

    fn iv(self, sector: u64) -> [u8; 16] {
        let mut iv = [0u8; 16];
        match self {
            IvGen::Plain64 => iv[..8].copy_from_slice(&sector.to_le_bytes()),
            IvGen::Plain => iv[..4].copy_from_slice(&(sector as u32).to_le_bytes()),
        }
        iv
    }
}

/// One keyed block cipher of each size.
#[derive(Clone)]
enum Aes {
    A128(Aes128),
    A192(Aes192),
    A256(Aes256),
}

impl Aes {
    fn new(alg: CipherAlg, key: &[u8]) -> Result<Aes, CryptoError> {
        let bad = |_| CryptoError::KeyLength {
            alg: alg.name(),
            len: key.len(),
        };
        Ok(match alg {
            CipherAlg::Aes128 => Aes::A128(Aes128::new_from_slice(key).map_err(bad)?),
            CipherAlg::Aes192 => Aes::A192(Aes192::new_from_slice(key).map_err(bad)?),
            CipherAlg::Aes256 => Aes::A256(Aes256::new_from_slice(key).map_err(bad)?),
        })
    }
}

enum Engine {
    Xts128(Box<Xts128<Aes128>>),
    Xts192(Box<Xts128<Aes192>>),
    Xts256(Box<Xts128<Aes256>>),
    Cbc(Box<Aes>),
}

/// A keyed sector cipher: encrypts and decrypts whole sectors in place.
pub struct SectorCipher {
    engine: Engine,
    ivgen: IvGen,
}

impl std::fmt::Debug for SectorCipher {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // Never the key.
        f.debug_struct("SectorCipher")
            .field("ivgen", &self.ivgen)
            .finish_non_exhaustive()
    }
}

fn xts<C: KeyInit + BlockCipherEncrypt<BlockSize = aes::cipher::consts::U16>>(
    key: &[u8],
) -> Option<Box<Xts128<C>>> {
    let (k1, k2) = key.split_at(key.len() / 2);
    Some(Box::new(Xts128::new(
        C::new_from_slice(k1).ok()?,
        C::new_from_slice(k2).ok()?,
    )))
}

impl SectorCipher {
    /// Keys `alg` in `mode` with `key` (twice the cipher's key for XTS).
    pub fn new(
        alg: CipherAlg,
        mode: CipherMode,
        ivgen: IvGen,
        key: &[u8],
    ) -> Result<SectorCipher, CryptoError> {
        if key.len() != mode.key_len(alg) {
            return Err(CryptoError::KeyLength {
                alg: alg.name(),
                len: key.len(),
            });
        }
        let bad = || CryptoError::KeyLength {
            alg: alg.name(),
            len: key.len(),
        };
        let engine = match (mode, alg) {
            (CipherMode::Xts, CipherAlg::Aes128) => Engine::Xts128(xts(key).ok_or_else(bad)?),
            (CipherMode::Xts, CipherAlg::Aes192) => Engine::Xts192(xts(key).ok_or_else(bad)?),
            (CipherMode::Xts, CipherAlg::Aes256) => Engine::Xts256(xts(key).ok_or_else(bad)?),
            (CipherMode::Cbc, _) => Engine::Cbc(Box::new(Aes::new(alg, key)?)),
        };
        Ok(SectorCipher { engine, ivgen })
    }

    fn check(buf: &[u8]) -> Result<(), CryptoError> {
        if buf.len() as u64 % SECTOR_SIZE != 0 {
            return Err(CryptoError::Unaligned { len: buf.len() });
        }
        Ok(())
    }

    /// Encrypts `buf` (whole sectors), the first of which is sector `first`.
    pub fn encrypt(&self, first: u64, buf: &mut [u8]) -> Result<(), CryptoError> {
        Self::check(buf)?;
        for (i, sector) in buf.chunks_exact_mut(SECTOR_SIZE as usize).enumerate() {
            let iv = self.ivgen.iv(first.wrapping_add(i as u64));
            match &self.engine {
                Engine::Xts128(x) => x.encrypt_sector(sector, iv.into()),
                Engine::Xts192(x) => x.encrypt_sector(sector, iv.into()),
                Engine::Xts256(x) => x.encrypt_sector(sector, iv.into()),
                Engine::Cbc(a) => match a.as_ref() {
                    Aes::A128(c) => cbc_encrypt(c, &iv, sector),
                    Aes::A192(c) => cbc_encrypt(c, &iv, sector),
                    Aes::A256(c) => cbc_encrypt(c, &iv, sector),
                },
            }
        }
        Ok(())
    }

    /// Decrypts `buf` (whole sectors), the first of which is sector `first`.
    pub fn decrypt(&self, first: u64, buf: &mut [u8]) -> Result<(), CryptoError> {
        Self::check(buf)?;
        for (i, sector) in buf.chunks_exact_mut(SECTOR_SIZE as usize).enumerate() {
            let iv = self.ivgen.iv(first.wrapping_add(i as u64));
            match &self.engine {
                Engine::Xts128(x) => x.decrypt_sector(sector, iv.into()),
                Engine::Xts192(x) => x.decrypt_sector(sector, iv.into()),
                Engine::Xts256(x) => x.decrypt_sector(sector, iv.into()),
                Engine::Cbc(a) => match a.as_ref() {
                    Aes::A128(c) => cbc_decrypt(c, &iv, sector),
                    Aes::A192(c) => cbc_decrypt(c, &iv, sector),
                    Aes::A256(c) => cbc_decrypt(c, &iv, sector),
                },
            }
        }
        Ok(())
    }
}

fn cbc_encrypt<C>(c: &C, iv: &[u8; 16], sector: &mut [u8])
where
    C: BlockCipherEncrypt<BlockSize = aes::cipher::consts::U16> + Clone,
{
    let mut mode = cbc::Encryptor::<C>::inner_iv_init(c.clone(), &(*iv).into());
    for block in sector.chunks_exact_mut(16) {
        if let Ok(block) = <&mut Array<u8, _>>::try_from(block) {
            mode.encrypt_block(block);
        }
    }
}

fn cbc_decrypt<C>(c: &C, iv: &[u8; 16], sector: &mut [u8])
where
    C: BlockCipherDecrypt<BlockSize = aes::cipher::consts::U16> + Clone,
{
    let mut mode = cbc::Decryptor::<C>::inner_iv_init(c.clone(), &(*iv).into());
    for block in sector.chunks_exact_mut(16) {
        if let Ok(block) = <&mut Array<u8, _>>::try_from(block) {
            mode.decrypt_block(block);
        }
    }
}
