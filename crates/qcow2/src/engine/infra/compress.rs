//! Compressed-cluster codecs: raw deflate with a 4 KiB window (QEMU's zlib type) and zstd.
//!
//! Both decoders must produce exactly one cluster and stop there: the stored data is rounded up
//! to 512-byte sectors and may be followed by the start of another compressed cluster, so bytes
//! after the end of the stream are tolerated, as QEMU tolerates them.

use flate2::{Compress, Compression, Decompress, FlushCompress, FlushDecompress, Status};
use thiserror::Error;

/// The codec of an image's compressed clusters (header field `compression_type`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Codec {
    /// Raw deflate, window bits 12 (compression_type 0).
    Zlib,
    /// A zstd frame (compression_type 1).
    Zstd,
}

/// QEMU compresses with a 4 KiB deflate window; larger windows would not decode in QEMU.
const DEFLATE_WINDOW_BITS: u8 = 12;

/// Why a compressed cluster could not be decoded.
#[derive(Debug, Error)]
pub enum CompressError {
    /// The stream is not valid for the codec.
    #[error("{codec:?} data is corrupt: {detail}")]
    Corrupt {
        /// Codec in use.
        codec: Codec,
        /// What the decoder reported.
        detail: String,
    },
    /// The stream ended before a whole cluster was produced.
    #[error("{codec:?} data ends after {produced} of {wanted} bytes")]
    Short {
        /// Codec in use.
        codec: Codec,
        /// Bytes decoded.
        produced: usize,
        /// Bytes a cluster needs.
        wanted: usize,
    },
    /// The encoder failed (out of memory or an internal error).
    #[error("{codec:?} compression failed: {detail}")]
    Encode {
        /// Codec in use.
        codec: Codec,
        /// What the encoder reported.
        detail: String,
    },
}

/// Decode `input` into exactly `output.len()` bytes (one cluster); trailing input is ignored.
pub fn decompress(codec: Codec, input: &[u8], output: &mut [u8]) -> Result<(), CompressError> {
    match codec {
        Codec::Zlib => inflate_raw(input, output),
        Codec::Zstd => zstd_decode(input, output),
    }
}

fn inflate_raw(input: &[u8], output: &mut [u8]) -> Result<(), CompressError> {
    let mut d = Decompress::new_with_window_bits(false, DEFLATE_WINDOW_BITS);
    let status = d
        .decompress(input, output, FlushDecompress::Finish)
        .map_err(|e| CompressError::Corrupt {
            codec: Codec::Zlib,
            detail: e.to_string(),
        })?;
    let produced = usize::try_from(d.total_out()).unwrap_or(usize::MAX);
    // A full output buffer is success whether or not the stream marked its end (BufError just
    // means "no room left"), which is exactly QEMU's rule.
    match status {
        Status::Ok | Status::BufError | Status::StreamEnd if produced == output.len() => Ok(()),
        _ => Err(CompressError::Short {
            codec: Codec::Zlib,
            produced,
            wanted: output.len(),
        }),
    }
}

fn zstd_decode(input: &[u8], output: &mut [u8]) -> Result<(), CompressError> {
    use zstd::stream::raw::{Decoder, InBuffer, Operation, OutBuffer};
    let corrupt = |e: std::io::Error| CompressError::Corrupt {
        codec: Codec::Zstd,
        detail: e.to_string(),
    };
    let mut dec = Decoder::new().map_err(corrupt)?;
    let mut inb = InBuffer::around(input);
    let mut outb = OutBuffer::around(output);
    loop {
        let before = (inb.pos(), outb.pos());
        let hint = dec.run(&mut inb, &mut outb).map_err(corrupt)?;
        if outb.pos() == outb.capacity() {
            return Ok(());
        }
        // hint == 0: the frame is complete but the cluster is not full.
        if hint == 0 || (inb.pos(), outb.pos()) == before {
            return Err(CompressError::Short {
                codec: Codec::Zstd,
                produced: outb.pos(),
                wanted: outb.capacity(),
            });
        }
    }
}

/// Compress one cluster; `None` when the result would not be smaller than `limit` bytes
/// (QEMU then stores the cluster uncompressed).
pub fn compress(
    codec: Codec,
    input: &[u8],
    limit: usize,
) -> Result<Option<Vec<u8>>, CompressError> {
    match codec {
        Codec::Zlib => deflate_raw(input, limit),
        Codec::Zstd => zstd_encode(input, limit),
    }
}

fn deflate_raw(input: &[u8], limit: usize) -> Result<Option<Vec<u8>>, CompressError> {
    let mut c = Compress::new_with_window_bits(Compression::default(), false, DEFLATE_WINDOW_BITS);
    let mut out = vec![0u8; limit];
    let status = c
        .compress(input, &mut out, FlushCompress::Finish)
        .map_err(|e| CompressError::Encode {
            codec: Codec::Zlib,
            detail: e.to_string(),
        })?;
    if status != Status::StreamEnd {
        return Ok(None);
    }
    let n = usize::try_from(c.total_out()).unwrap_or(usize::MAX);
    if n >= limit {
        return Ok(None);
    }
    out.truncate(n);
    Ok(Some(out))
}

fn zstd_encode(input: &[u8], limit: usize) -> Result<Option<Vec<u8>>, CompressError> {
    let mut out = vec![0u8; limit];
    match zstd::bulk::compress_to_buffer(input, &mut out, 0) {
        Ok(n) if n < limit => {
            out.truncate(n);
            Ok(Some(out))
        }
        Ok(_) => Ok(None),
        // The only expected failure is "destination buffer too small".
        Err(e) if e.kind() == std::io::ErrorKind::Other => Ok(None),
        Err(e) => Err(CompressError::Encode {
            codec: Codec::Zstd,
            detail: e.to_string(),
        }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn sample(len: usize, seed: u8) -> Vec<u8> {
        (0..len).map(|i| ((i % 97) as u8) ^ seed).collect()
    }

    #[test]
    fn round_trip_with_trailing_garbage() {
        for codec in [Codec::Zlib, Codec::Zstd] {
            for len in [512usize, 4096, 65536, 2 << 20] {
                let data = sample(len, 31);
                let mut packed = compress(codec, &data, len - 1)
                    .unwrap()
                    .unwrap_or_else(|| panic!("{codec:?} {len} not compressible"));
                packed.extend_from_slice(&[0xA5; 700]);
                let mut out = vec![0u8; len];
                decompress(codec, &packed, &mut out).unwrap();
                assert_eq!(out, data, "{codec:?} {len}");
            }
        }
    }

    #[test]
    fn incompressible_returns_none() {
        let mut x = 0x12345678u32;
        let data: Vec<u8> = (0..65536)
            .map(|_| {
                x ^= x << 13;
                x ^= x >> 17;
                x ^= x << 5;
                x as u8
            })
            .collect();
        for codec in [Codec::Zlib, Codec::Zstd] {
            assert!(compress(codec, &data, data.len() - 1).unwrap().is_none());
        }
    }

    #[test]
    fn short_stream_is_an_error() {
        for codec in [Codec::Zlib, Codec::Zstd] {
            let data = sample(4096, 3);
            let packed = compress(codec, &data, 4095).unwrap().unwrap();
            let mut out = vec![0u8; 8192];
            assert!(decompress(codec, &packed, &mut out).is_err(), "{codec:?}");
        }
    }

    proptest! {
        #[test]
        fn garbage_never_panics(input in proptest::collection::vec(any::<u8>(), 0..2048), zstd in any::<bool>()) {
            let codec = if zstd { Codec::Zstd } else { Codec::Zlib };
            let mut out = vec![0u8; 4096];
            let _ = decompress(codec, &input, &mut out);
        }
    }
}
