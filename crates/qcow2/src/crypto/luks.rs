//! The LUKS1 header (the on-disk format cryptsetup and QEMU share): parsing and checking it,
//! unlocking the master key with a password, making a new one, and the facts `info` shows.
//!
//! Layout (all integers big-endian): magic, version, cipher name, cipher mode
//! (`mode-ivgen[:hash]`), hash spec, payload offset (sectors), master key length, master key
//! digest, its salt and iterations, UUID, then eight key slots (state, iterations, salt, key
//! material offset in sectors, stripes). A slot's key material is the master key split into
//! `stripes` blocks, encrypted with the payload cipher keyed by PBKDF2(password).

use super::af;
use super::cipher::{CipherAlg, CipherMode, IvGen, SectorCipher, SECTOR_SIZE};
use super::error::CryptoError;
use super::hash::HashAlg;

const MAGIC: [u8; 6] = *b"LUKS\xba\xbe";
/// Bytes of the fixed header (the part before the key material).
pub const HEADER_LEN: usize = 592;
const SLOT_COUNT: usize = 8;
const SLOT_ENABLED: u32 = 0x00AC_71F3;
const SLOT_DISABLED: u32 = 0x0000_DEAD;
/// The only stripe count LUKS1 (and QEMU) uses.
const STRIPES: u32 = 4000;
const DIGEST_LEN: usize = 20;
const SALT_LEN: usize = 32;
/// Where the first key material starts (bytes).
const KEY_SLOT_OFFSET: u64 = 4096;
/// Fewest PBKDF2 iterations a new header gets, as QEMU and cryptsetup.
const MIN_ITERS: u64 = 1000;
/// Most PBKDF2 iterations an opened header may ask for: far above what QEMU or cryptsetup
/// write on today's machines, low enough that a hostile header cannot stall an open for
/// more than seconds per slot.
pub const MAX_ITERS: u32 = 16_000_000;
/// Largest LUKS area read into memory (QEMU's default is just under 2 MiB).
pub const MAX_AREA: u64 = 64 << 20;

/// One key slot.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct KeySlot {
    /// Holds a key.
    pub active: bool,
    /// PBKDF2 iterations.
    pub iterations: u32,
    /// PBKDF2 salt.
    pub salt: [u8; SALT_LEN],
    /// Key material offset in 512-byte sectors from the header's start.
    pub key_offset: u32,
    /// AF stripes.
    pub stripes: u32,
}

/// A checked LUKS1 header.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LuksHeader {
    /// Block cipher.
    pub cipher: CipherAlg,
    /// Its mode.
    pub mode: CipherMode,
    /// IV generator.
    pub ivgen: IvGen,
    /// The text of the cipher mode field, as stored.
    mode_text: String,
    /// PBKDF2 and AF hash.
    pub hash: HashAlg,
    /// Payload offset in sectors (where QEMU's raw LUKS format puts data; qcow2 ignores it).
    pub payload_offset: u32,
    /// Master key bytes.
    pub key_len: u32,
    /// PBKDF2 of the master key.
    pub mk_digest: [u8; DIGEST_LEN],
    /// Its salt.
    pub mk_salt: [u8; SALT_LEN],
    /// Its iterations.
    pub mk_iterations: u32,
    /// The UUID text.
    pub uuid: String,
    /// The key slots.
    pub slots: Vec<KeySlot>,
}

fn corrupt(s: impl Into<String>) -> CryptoError {
    CryptoError::Header(s.into())
}

fn be32(b: &[u8], at: usize) -> u32 {
    u32::from_be_bytes([b[at], b[at + 1], b[at + 2], b[at + 3]])
}

/// A NUL-terminated text field of `len` bytes.
fn text(b: &[u8], at: usize, len: usize, what: &str) -> Result<String, CryptoError> {
    let field = &b[at..at + len];
    let end = field
        .iter()
        .position(|&c| c == 0)
        .ok_or_else(|| corrupt(format!("{what} is not NUL terminated")))?;
    std::str::from_utf8(&field[..end])
        .map(str::to_owned)
        .map_err(|_| corrupt(format!("{what} is not text")))
}

fn unsupported(what: &'static str, name: &str) -> CryptoError {
    CryptoError::Unsupported {
        what,
        name: name.to_owned(),
    }
}

/// Key material bytes of a slot, rounded up to whole sectors.
fn material_len(key_len: u32, stripes: u32) -> u64 {
    (u64::from(key_len) * u64::from(stripes)).div_ceil(SECTOR_SIZE) * SECTOR_SIZE
}

/// Whether `head` (a file's first bytes, at least six) starts with the LUKS magic: how
/// QEMU's probe tells a LUKS volume.
pub fn is_luks(head: &[u8]) -> bool {
    head.len() >= MAGIC.len() && head[..MAGIC.len()] == MAGIC
}

impl LuksHeader {
    /// The bytes of the LUKS area a header declares (its payload offset): how much of a LUKS
    /// volume to read before [`LuksHeader::parse`]. `head` is the volume's first
    /// [`HEADER_LEN`] bytes.
    pub fn area_len_of(head: &[u8]) -> Result<u64, CryptoError> {
        if head.len() < HEADER_LEN || head[..6] != MAGIC {
            return Err(CryptoError::NotLuks);
        }
        Ok(u64::from(be32(head, 104)) * SECTOR_SIZE)
    }

    /// Parses and checks the first [`HEADER_LEN`] bytes of `area` (the whole LUKS area, key
    /// material included: every slot must lie inside it).
    pub fn parse(area: &[u8]) -> Result<LuksHeader, CryptoError> {
        if area.len() < HEADER_LEN {
            return Err(corrupt(format!(
                "the encryption header is {} bytes, shorter than a LUKS header ({HEADER_LEN})",
                area.len()
            )));
        }
        let b = &area[..HEADER_LEN];
        if b[..6] != MAGIC {
            return Err(CryptoError::NotLuks);
        }
        let version = u16::from_be_bytes([b[6], b[7]]);
        if version != 1 {
            return Err(CryptoError::Version(version));
        }
        let cipher_name = text(b, 8, 32, "cipher name")?;
        let mode_text = text(b, 40, 32, "cipher mode")?;
        let hash_name = text(b, 72, 32, "hash spec")?;
        let payload_offset = be32(b, 104);
        let key_len = be32(b, 108);
        let mut mk_digest = [0u8; DIGEST_LEN];
        mk_digest.copy_from_slice(&b[112..132]);
        let mut mk_salt = [0u8; SALT_LEN];
        mk_salt.copy_from_slice(&b[132..164]);
        let mk_iterations = be32(b, 164);
        let uuid = text(b, 168, 40, "UUID")?;

        let (mode_name, ivgen_name) = mode_text
            .split_once('-')
            .ok_or_else(|| corrupt(format!("unexpected cipher mode format '{mode_text}'")))?;
        // A hash after the IV generator matters only for ESSIV, which we do not implement.
        let ivgen_name = ivgen_name.split(':').next().unwrap_or(ivgen_name);
        let mode = CipherMode::from_name(mode_name)
            .ok_or_else(|| unsupported("cipher mode", mode_name))?;
        let ivgen =
            IvGen::from_name(ivgen_name).ok_or_else(|| unsupported("IV generator", ivgen_name))?;
        let hash = HashAlg::from_name(&hash_name).ok_or_else(|| unsupported("hash", &hash_name))?;
        if cipher_name != "aes" {
            return Err(unsupported("cipher", &cipher_name));
        }
        let cipher = [CipherAlg::Aes128, CipherAlg::Aes192, CipherAlg::Aes256]
            .into_iter()
            .find(|a| mode.key_len(*a) as u64 == u64::from(key_len))
            .ok_or_else(|| {
                corrupt(format!(
                    "master key length {key_len} fits no AES {mode_name}"
                ))
            })?;
        if mk_iterations == 0 {
            return Err(corrupt("LUKS key iteration count is zero"));
        }
        if mk_iterations > MAX_ITERS {
            return Err(corrupt(format!(
                "master key iterations {mk_iterations} exceed the limit {MAX_ITERS}"
            )));
        }
        let header_sectors = (KEY_SLOT_OFFSET / SECTOR_SIZE) as u32;
        if payload_offset < header_sectors {
            return Err(corrupt("LUKS payload is overlapping with the header"));
        }
        let slots = parse_slots(b, area.len(), key_len, payload_offset, header_sectors)?;
        Ok(LuksHeader {
            cipher,
            mode,
            ivgen,
            mode_text,
            hash,
            payload_offset,
            key_len,
            mk_digest,
            mk_salt,
            mk_iterations,
            uuid,
            slots,
        })
    }

    /// The fixed header's bytes.
    pub fn encode(&self) -> Vec<u8> {
        let mut b = vec![0u8; HEADER_LEN];
        b[..6].copy_from_slice(&MAGIC);
        b[6..8].copy_from_slice(&1u16.to_be_bytes());
        let put_text = |b: &mut [u8], at: usize, s: &str| {
            b[at..at + s.len()].copy_from_slice(s.as_bytes());
        };
        put_text(&mut b, 8, "aes");
        put_text(&mut b, 40, &self.mode_text);
        put_text(&mut b, 72, self.hash.name());
        b[104..108].copy_from_slice(&self.payload_offset.to_be_bytes());
        b[108..112].copy_from_slice(&self.key_len.to_be_bytes());
        b[112..132].copy_from_slice(&self.mk_digest);
        b[132..164].copy_from_slice(&self.mk_salt);
        b[164..168].copy_from_slice(&self.mk_iterations.to_be_bytes());
        put_text(&mut b, 168, &self.uuid);
        for (i, s) in self.slots.iter().enumerate() {
            let at = 208 + 48 * i;
            let state = if s.active {
                SLOT_ENABLED
            } else {
                SLOT_DISABLED
            };
            b[at..at + 4].copy_from_slice(&state.to_be_bytes());
            b[at + 4..at + 8].copy_from_slice(&s.iterations.to_be_bytes());
            b[at + 8..at + 40].copy_from_slice(&s.salt);
            b[at + 40..at + 44].copy_from_slice(&s.key_offset.to_be_bytes());
            b[at + 44..at + 48].copy_from_slice(&s.stripes.to_be_bytes());
        }
        b
    }

    fn cipher_with(&self, key: &[u8]) -> Result<SectorCipher, CryptoError> {
        SectorCipher::new(self.cipher, self.mode, self.ivgen, key)
    }

    fn material_range(&self, slot: &KeySlot) -> std::ops::Range<usize> {
        let start = u64::from(slot.key_offset) * SECTOR_SIZE;
        start as usize..(start + material_len(self.key_len, slot.stripes)) as usize
    }

    /// Whether `key` is the master key (its digest matches).
    fn is_master_key(&self, key: &[u8]) -> bool {
        let mut d = [0u8; DIGEST_LEN];
        self.hash
            .pbkdf2(key, &self.mk_salt, self.mk_iterations, &mut d);
        d == self.mk_digest
    }

    /// The master key slot `i` holds, if `password` opens it.
    fn try_slot(
        &self,
        area: &[u8],
        i: usize,
        password: &[u8],
    ) -> Result<Option<Vec<u8>>, CryptoError> {
        let slot = &self.slots[i];
        if !slot.active {
            return Ok(None);
        }
        let kl = self.key_len as usize;
        let mut derived = vec![0u8; kl];
        self.hash
            .pbkdf2(password, &slot.salt, slot.iterations, &mut derived);
        let mut material = area[self.material_range(slot)].to_vec();
        self.cipher_with(&derived)?.decrypt(0, &mut material)?;
        let split_len = kl * slot.stripes as usize;
        let Some(key) = af::merge(self.hash, &material[..split_len], kl, slot.stripes as usize)
        else {
            return Ok(None);
        };
        Ok(self.is_master_key(&key).then_some(key))
    }

    /// Unlocks the master key with `password`: the first active slot it opens. `area` is
    /// the LUKS area this header was parsed from.
    pub fn unlock(&self, area: &[u8], password: &[u8]) -> Result<(usize, Vec<u8>), CryptoError> {
        for i in 0..self.slots.len() {
            if let Some(k) = self.try_slot(area, i, password)? {
                return Ok((i, k));
            }
        }
        Err(CryptoError::InvalidPassword)
    }

    /// The payload cipher keyed with the master key.
    pub fn data_cipher(&self, master: &[u8]) -> Result<SectorCipher, CryptoError> {
        self.cipher_with(master)
    }

    /// Stores `master` in slot `i` under `password` with `iterations`, writing the key
    /// material into `area` (the header bytes are not rewritten: see [`LuksHeader::encode`]).
    pub fn store_key(
        &mut self,
        area: &mut [u8],
        i: usize,
        password: &[u8],
        master: &[u8],
        iterations: u32,
    ) -> Result<(), CryptoError> {
        let kl = self.key_len as usize;
        let mut salt = [0u8; SALT_LEN];
        super::random(&mut salt)?;
        let mut derived = vec![0u8; kl];
        self.hash.pbkdf2(password, &salt, iterations, &mut derived);
        let stripes = STRIPES;
        let mut material = af::split(self.hash, master, stripes as usize)?;
        let range = {
            let s = &self.slots[i];
            self.material_range(&KeySlot {
                stripes,
                ..s.clone()
            })
        };
        if range.end > area.len() {
            return Err(corrupt("key material past the LUKS area"));
        }
        material.resize(range.len(), 0);
        self.cipher_with(&derived)?.encrypt(0, &mut material)?;
        area[range].copy_from_slice(&material);
        let s = &mut self.slots[i];
        s.active = true;
        s.iterations = iterations;
        s.salt = salt;
        s.stripes = stripes;
        Ok(())
    }

    /// Erases slot `i`: its key material overwritten with random bytes, the slot disabled.
    pub fn erase_slot(&mut self, area: &mut [u8], i: usize) -> Result<(), CryptoError> {
        let range = self.material_range(&self.slots[i]);
        if range.end > area.len() {
            return Err(corrupt("key material past the LUKS area"));
        }
        super::random(&mut area[range])?;
        let s = &mut self.slots[i];
        s.active = false;
        s.iterations = 0;
        s.salt = [0; SALT_LEN];
        Ok(())
    }

    /// The facts `qemu-img info` shows.
    pub fn info(&self) -> LuksInfo {
        LuksInfo {
            ivgen_alg: self.ivgen.name().into(),
            hash_alg: self.hash.name().into(),
            cipher_alg: self.cipher.name().into(),
            uuid: self.uuid.clone(),
            cipher_mode: self.mode.name().into(),
            slots: self
                .slots
                .iter()
                .map(|s| LuksSlotInfo {
                    active: s.active,
                    iters: s.active.then_some(s.iterations),
                    key_offset: u64::from(s.key_offset) * SECTOR_SIZE,
                    stripes: s.active.then_some(s.stripes),
                })
                .collect(),
            payload_offset: u64::from(self.payload_offset) * SECTOR_SIZE,
            master_key_iters: self.mk_iterations,
        }
    }
}

/// What `info` prints of a LUKS header.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LuksInfo {
    /// `plain64`.
    pub ivgen_alg: String,
    /// `sha256`.
    pub hash_alg: String,
    /// `aes-256`.
    pub cipher_alg: String,
    /// The UUID.
    pub uuid: String,
    /// `xts`.
    pub cipher_mode: String,
    /// The eight slots.
    pub slots: Vec<LuksSlotInfo>,
    /// Bytes.
    pub payload_offset: u64,
    /// Master key digest iterations.
    pub master_key_iters: u32,
}

impl LuksInfo {
    /// PBKDF2 iterations a wrong password costs: the master key digest and every active
    /// slot.
    pub fn kdf_iterations(&self) -> u64 {
        let slots: u64 = self
            .slots
            .iter()
            .filter_map(|s| s.iters)
            .map(u64::from)
            .sum();
        slots.saturating_add(self.master_key_iters.into())
    }
}

/// One key slot as `info` prints it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LuksSlotInfo {
    /// Holds a key.
    pub active: bool,
    /// Iterations (active slots only).
    pub iters: Option<u32>,
    /// Bytes from the header's start.
    pub key_offset: u64,
    /// Stripes (active slots only).
    pub stripes: Option<u32>,
}

/// What a new LUKS header is made with (`encrypt.*` options; the defaults are QEMU's).
#[derive(Clone, Debug)]
pub struct LuksCreate {
    /// `encrypt.cipher-alg`.
    pub cipher: CipherAlg,
    /// `encrypt.cipher-mode`.
    pub mode: CipherMode,
    /// `encrypt.ivgen-alg`.
    pub ivgen: IvGen,
    /// `encrypt.hash-alg`.
    pub hash: HashAlg,
    /// `encrypt.iter-time`, milliseconds of PBKDF2 per unlock.
    pub iter_time_ms: u64,
}

impl Default for LuksCreate {
    fn default() -> Self {
        LuksCreate {
            cipher: CipherAlg::Aes256,
            mode: CipherMode::Xts,
            ivgen: IvGen::Plain64,
            hash: HashAlg::Sha256,
            iter_time_ms: 2000,
        }
    }
}

/// PBKDF2 iterations `hash` runs in `ms` milliseconds here (at least [`MIN_ITERS`], at most
/// [`MAX_ITERS`]); `divisor` spreads them as QEMU does for the master key digest.
pub fn iterations_for(hash: HashAlg, ms: u64, divisor: u64) -> u32 {
    const PROBE: u32 = 20_000;
    let start = std::time::Instant::now();
    let mut out = [0u8; 32];
    hash.pbkdf2(b"probe", &[0u8; SALT_LEN], PROBE, &mut out);
    let nanos = start.elapsed().as_nanos().max(1);
    let per_sec = u128::from(PROBE) * 1_000_000_000 / nanos;
    let iters = per_sec * u128::from(ms) / 1000 / u128::from(divisor.max(1));
    iters.clamp(u128::from(MIN_ITERS), u128::from(MAX_ITERS)) as u32
}

/// Sectors of one key slot's material for a `key_len`-byte master key, rounded to the 4 KiB
/// alignment QEMU keeps.
fn slot_sectors(key_len: usize) -> u64 {
    let header_sectors = KEY_SLOT_OFFSET / SECTOR_SIZE;
    material_len(key_len as u32, STRIPES)
        .div_ceil(SECTOR_SIZE)
        .div_ceil(header_sectors)
        * header_sectors
}

/// Bytes of the LUKS area a new header with `opts` takes (header and eight key slots), as
/// `measure` counts it.
pub fn area_len(opts: &LuksCreate) -> u64 {
    let slots = slot_sectors(opts.mode.key_len(opts.cipher));
    (KEY_SLOT_OFFSET / SECTOR_SIZE + SLOT_COUNT as u64 * slots) * SECTOR_SIZE
}

/// A new LUKS area (header plus eight key material regions, QEMU's layout) with `password`
/// in slot 0, and its master key.
pub fn create(password: &[u8], opts: &LuksCreate) -> Result<(Vec<u8>, Vec<u8>), CryptoError> {
    let key_len = opts.mode.key_len(opts.cipher);
    let mut master = vec![0u8; key_len];
    super::random(&mut master)?;
    let mut mk_salt = [0u8; SALT_LEN];
    super::random(&mut mk_salt)?;
    let mk_iterations = iterations_for(opts.hash, opts.iter_time_ms, 8);
    let mut mk_digest = [0u8; DIGEST_LEN];
    opts.hash
        .pbkdf2(&master, &mk_salt, mk_iterations, &mut mk_digest);
    let header_sectors = KEY_SLOT_OFFSET / SECTOR_SIZE;
    let split_sectors = slot_sectors(key_len);
    let slots = (0..SLOT_COUNT as u64)
        .map(|i| KeySlot {
            active: false,
            iterations: 0,
            salt: [0; SALT_LEN],
            key_offset: (header_sectors + i * split_sectors) as u32,
            stripes: STRIPES,
        })
        .collect();
    let payload_offset = (header_sectors + SLOT_COUNT as u64 * split_sectors) as u32;
    let mut uuid_bytes = [0u8; 16];
    super::random(&mut uuid_bytes)?;
    // A version 4 (random) UUID.
    uuid_bytes[6] = (uuid_bytes[6] & 0x0f) | 0x40;
    uuid_bytes[8] = (uuid_bytes[8] & 0x3f) | 0x80;
    let hex: String = uuid_bytes.iter().map(|b| format!("{b:02x}")).collect();
    let uuid = format!(
        "{}-{}-{}-{}-{}",
        &hex[..8],
        &hex[8..12],
        &hex[12..16],
        &hex[16..20],
        &hex[20..]
    );
    let mut h = LuksHeader {
        cipher: opts.cipher,
        mode: opts.mode,
        ivgen: opts.ivgen,
        mode_text: format!("{}-{}", opts.mode.name(), opts.ivgen.name()),
        hash: opts.hash,
        payload_offset,
        key_len: key_len as u32,
        mk_digest,
        mk_salt,
        mk_iterations,
        uuid,
        slots,
    };
    let mut area = vec![0u8; (u64::from(payload_offset) * SECTOR_SIZE) as usize];
    let iters = iterations_for(opts.hash, opts.iter_time_ms, 1);
    h.store_key(&mut area, 0, password, &master, iters)?;
    area[..HEADER_LEN].copy_from_slice(&h.encode());
    Ok((area, master))
}

/// The key slots of the fixed header `b`, each checked against the header, the payload and
/// the other slots (`area_len` is the whole encryption area's length).
fn parse_slots(
    b: &[u8],
    area_len: usize,
    key_len: u32,
    payload_offset: u32,
    header_sectors: u32,
) -> Result<Vec<KeySlot>, CryptoError> {
    let mut slots = Vec::with_capacity(SLOT_COUNT);
    for i in 0..SLOT_COUNT {
        let s = &b[208 + 48 * i..208 + 48 * (i + 1)];
        let state = be32(s, 0);
        let mut salt = [0u8; SALT_LEN];
        salt.copy_from_slice(&s[8..40]);
        let slot = KeySlot {
            active: match state {
                SLOT_ENABLED => true,
                SLOT_DISABLED => false,
                _ => {
                    return Err(corrupt(format!(
                        "Keyslot {i} state (active/disable) is corrupted"
                    )))
                }
            },
            iterations: be32(s, 4),
            salt,
            key_offset: be32(s, 40),
            stripes: be32(s, 44),
        };
        if slot.stripes != STRIPES {
            return Err(corrupt(format!(
                "Keyslot {i} is corrupted (stripes {} != {STRIPES})",
                slot.stripes
            )));
        }
        if slot.active && slot.iterations == 0 {
            return Err(corrupt(format!("Keyslot {i} iteration count is zero")));
        }
        if slot.active && slot.iterations > MAX_ITERS {
            return Err(corrupt(format!(
                "Keyslot {i} iterations {} exceed the limit {MAX_ITERS}",
                slot.iterations
            )));
        }
        if slot.key_offset < header_sectors {
            return Err(corrupt(format!(
                "Keyslot {i} is overlapping with the LUKS header"
            )));
        }
        let start = u64::from(slot.key_offset) * SECTOR_SIZE;
        let end = start + material_len(key_len, slot.stripes);
        if end > u64::from(payload_offset) * SECTOR_SIZE {
            return Err(corrupt(format!(
                "Keyslot {i} is overlapping with the encrypted payload"
            )));
        }
        if end > area_len as u64 {
            return Err(corrupt(format!(
                "Keyslot {i} key material ends at {end}, past the encryption header ({} bytes)",
                area_len
            )));
        }
        for (j, other) in slots.iter().enumerate() {
            let o: &KeySlot = other;
            let ostart = u64::from(o.key_offset) * SECTOR_SIZE;
            let oend = ostart + material_len(key_len, o.stripes);
            if start < oend && ostart < end {
                return Err(corrupt(format!(
                    "Keyslots {j} and {i} are overlapping in the header"
                )));
            }
        }
        slots.push(slot);
    }
    Ok(slots)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn fast() -> LuksCreate {
        LuksCreate {
            iter_time_ms: 1,
            ..LuksCreate::default()
        }
    }

    #[test]
    fn a_new_header_unlocks_with_its_password_only() {
        let (area, master) = create(b"astrochicken", &fast()).unwrap();
        assert_eq!(area.len(), 2068480, "QEMU's layout for aes-256-xts");
        assert_eq!(area_len(&fast()), 2068480);
        let aes128 = LuksCreate {
            cipher: CipherAlg::Aes128,
            ..fast()
        };
        assert_eq!(area_len(&aes128), 1052672);
        let h = LuksHeader::parse(&area).unwrap();
        assert_eq!(h.unlock(&area, b"astrochicken").unwrap(), (0, master));
        assert!(matches!(
            h.unlock(&area, b"platypus"),
            Err(CryptoError::InvalidPassword)
        ));
        assert_eq!(h.info().slots[1].key_offset, 262144);
    }

    #[test]
    fn hostile_headers_are_refused_not_trusted() {
        let (area, _) = create(b"pw", &fast()).unwrap();
        let mut short = area.clone();
        short.truncate(100_000);
        assert!(LuksHeader::parse(&short).is_err(), "slot past the area");
        let mut bad = area.clone();
        bad[164..168].copy_from_slice(&u32::MAX.to_be_bytes());
        assert!(LuksHeader::parse(&bad).is_err(), "iterations bounded");
        let mut bad = area.clone();
        bad[108..112].copy_from_slice(&1000u32.to_be_bytes());
        assert!(LuksHeader::parse(&bad).is_err(), "key length");
        let mut bad = area.clone();
        bad[40..72].fill(b'x');
        assert!(LuksHeader::parse(&bad).is_err(), "unterminated mode");
        assert!(matches!(
            LuksHeader::parse(&area[..10]),
            Err(CryptoError::Header(_))
        ));
    }
}

/// A change of key slots (`amend -o encrypt.state=...`), as QEMU's amend takes it.
#[derive(Clone, Debug, Default)]
pub struct SlotChange {
    /// `state=active` (add a key) or `inactive` (erase keys).
    pub activate: bool,
    /// `new-secret`: the password to add.
    pub new_password: Option<Vec<u8>>,
    /// `old-secret`: erase the slots this password opens.
    pub old_password: Option<Vec<u8>>,
    /// `keyslot`: the slot to add to or erase.
    pub keyslot: Option<u64>,
    /// `iter-time` in milliseconds for a new key.
    pub iter_time_ms: Option<u64>,
    /// `--force`: overwrite an active slot, or erase the last one.
    pub force: bool,
}

fn refuse(s: impl Into<String>) -> CryptoError {
    CryptoError::Slots(s.into())
}

impl LuksHeader {
    fn active_count(&self) -> usize {
        self.slots.iter().filter(|s| s.active).count()
    }

    fn slot_index(&self, k: u64) -> Result<usize, CryptoError> {
        usize::try_from(k)
            .ok()
            .filter(|&i| i < self.slots.len())
            .ok_or_else(|| {
                refuse(format!(
                    "Invalid keyslot {k} specified, must be between 0 and {}",
                    self.slots.len() - 1
                ))
            })
    }

    /// Applies `c` to the header and the key material in `area`; `password` is the one the
    /// image was opened with (it unlocks the master key a new slot stores). The messages are
    /// QEMU's.
    pub fn change_slots(
        &mut self,
        area: &mut [u8],
        password: &[u8],
        c: &SlotChange,
    ) -> Result<(), CryptoError> {
        if c.activate {
            let new = c
                .new_password
                .as_deref()
                .ok_or_else(|| refuse("'new-secret' is required to activate a keyslot"))?;
            if c.old_password.is_some() {
                return Err(refuse(
                    "'old-secret' must not be given when activating keyslots",
                ));
            }
            let slot = match c.keyslot {
                Some(k) => self.slot_index(k)?,
                None => self
                    .slots
                    .iter()
                    .position(|s| !s.active)
                    .ok_or_else(|| refuse("Can't add a keyslot - all keyslots are in use"))?,
            };
            if !c.force && self.slots[slot].active {
                return Err(refuse(format!(
                    "Refusing to overwrite active keyslot {slot} - please erase it first"
                )));
            }
            let (_, master) = self.unlock(area, password)?;
            let iters = iterations_for(self.hash, c.iter_time_ms.unwrap_or(2000), 1);
            return self.store_key(area, slot, new, &master, iters);
        }
        if c.new_password.is_some() {
            return Err(refuse(
                "'new-secret' must not be given when erasing keyslots",
            ));
        }
        if c.iter_time_ms.is_some() {
            return Err(refuse(
                "'iter-time' must not be given when erasing keyslots",
            ));
        }
        if let Some(k) = c.keyslot {
            let slot = self.slot_index(k)?;
            if let Some(old) = &c.old_password {
                if self.try_slot(area, slot, old)?.is_none() {
                    return Err(refuse(format!(
                        "Given keyslot {slot} doesn't contain the given old password for erase operation"
                    )));
                }
            }
            if !c.force && !self.slots[slot].active {
                return Err(refuse(format!(
                    "Given keyslot {slot} is already erased (inactive) "
                )));
            }
            if !c.force && self.active_count() == 1 {
                return Err(refuse(format!(
                    "Attempt to erase the only active keyslot {slot} which will erase all the data in the image irreversibly - refusing operation"
                )));
            }
            return self.erase_slot(area, slot);
        }
        let Some(old) = &c.old_password else {
            return Err(refuse(
                "To erase keyslot(s), either explicit keyslot index or the password currently contained in them must be given",
            ));
        };
        let mut matching = Vec::new();
        for i in 0..self.slots.len() {
            if self.try_slot(area, i, old)?.is_some() {
                matching.push(i);
            }
        }
        if matching.is_empty() {
            return Err(refuse(
                "No keyslots match given (old) password for erase operation",
            ));
        }
        if !c.force && matching.len() == self.active_count() {
            return Err(refuse(
                "All the active keyslots match the (old) password that was given and erasing them will erase all the data in the image irreversibly - refusing operation",
            ));
        }
        for i in matching {
            self.erase_slot(area, i)?;
        }
        Ok(())
    }
}
