//! LUKS's anti-forensic splitter: a key is stored as `stripes` blocks, all of which are needed
//! to recover it, so wiping any part of a key slot destroys the key.

use super::error::CryptoError;
use super::hash::HashAlg;

/// Replaces `block` by its diffusion: each digest-sized piece `i` becomes
/// `H(be32(i) || piece)`, the last (shorter) piece truncated.
fn diffuse(hash: HashAlg, block: &mut [u8]) {
    let ds = hash.digest_len();
    for (i, piece) in block.chunks_mut(ds).enumerate() {
        let d = hash.digest(&[&(i as u32).to_be_bytes(), piece]);
        let n = piece.len();
        piece.copy_from_slice(&d[..n]);
    }
}

fn xor_into(acc: &mut [u8], other: &[u8]) {
    for (a, b) in acc.iter_mut().zip(other) {
        *a ^= b;
    }
}

/// Recovers a `len`-byte key from `stripes` blocks in `split` (`len * stripes` bytes).
pub fn merge(hash: HashAlg, split: &[u8], len: usize, stripes: usize) -> Option<Vec<u8>> {
    if len == 0 || stripes == 0 || split.len() != len.checked_mul(stripes)? {
        return None;
    }
    let mut d = vec![0u8; len];
    let (body, last) = split.split_at(len * (stripes - 1));
    for s in body.chunks_exact(len) {
        xor_into(&mut d, s);
        diffuse(hash, &mut d);
    }
    xor_into(&mut d, last);
    Some(d)
}

/// Splits `key` into `stripes` blocks (random but the last).
pub fn split(hash: HashAlg, key: &[u8], stripes: usize) -> Result<Vec<u8>, CryptoError> {
    let len = key.len();
    let mut out = vec![0u8; len * stripes];
    super::random(&mut out[..len * (stripes - 1)])?;
    let mut d = vec![0u8; len];
    for s in out[..len * (stripes - 1)].chunks_exact(len) {
        xor_into(&mut d, s);
        diffuse(hash, &mut d);
    }
    xor_into(&mut d, key);
    out[len * (stripes - 1)..].copy_from_slice(&d);
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn split_then_merge_gives_the_key_back() {
        let key: Vec<u8> = (0..64u8).collect();
        let s = split(HashAlg::Sha256, &key, 40).unwrap();
        assert_eq!(merge(HashAlg::Sha256, &s, 64, 40).unwrap(), key);
        let mut broken = s.clone();
        broken[5] ^= 1;
        assert_ne!(merge(HashAlg::Sha256, &broken, 64, 40).unwrap(), key);
        assert!(merge(HashAlg::Sha256, &s[1..], 64, 40).is_none());
    }
}
