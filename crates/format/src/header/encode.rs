//! Writing the first cluster: header, extensions, end marker and backing file name.

use super::field;
use super::model::{at, Header};
use super::values::QCOW2_MAGIC;
use crate::error::FormatError;
use crate::extensions;
use crate::limits;

impl Header {
    /// Encodes the first cluster: header, extensions, end marker and backing file name
    /// (placed right after the end marker; `backing_file_offset`/`_size` are recomputed).
    /// Fails if it does not fit in `cluster_size` bytes or fields contradict the version.
    pub fn encode(&self, cluster_size: u64) -> Result<Vec<u8>, FormatError> {
        let v3 = self.version >= 3;
        if !(2..=3).contains(&self.version) {
            return Err(FormatError::InvalidValue {
                at: at(field::VERSION as u64),
                field: "version",
                value: self.version.into(),
                reason: "only 2 and 3 can be written",
            });
        }
        if !v3 {
            let v3_only =
                self.incompatible_features | self.compatible_features | self.autoclear_features;
            if v3_only != 0
                || self.refcount_order != 4
                || self.header_length != limits::V2_HEADER_LENGTH
                || !self.unknown_header_tail.is_empty()
                || self.compression_type != 0
            {
                return Err(FormatError::Inconsistent {
                    at: at(field::INCOMPATIBLE_FEATURES as u64),
                    problem: "version 2 headers have no feature bits, refcount order 4, length 72 and zlib",
                });
            }
        } else {
            let expected_tail = (self.header_length as usize).saturating_sub(105);
            let ok = if self.header_length < limits::MIN_V3_HEADER_LENGTH {
                false
            } else if self.header_length == limits::MIN_V3_HEADER_LENGTH {
                self.compression_type == 0 && self.unknown_header_tail.is_empty()
            } else {
                self.unknown_header_tail.len() == expected_tail
            };
            if !ok {
                return Err(FormatError::Inconsistent {
                    at: at(field::HEADER_LENGTH as u64),
                    problem: "header_length does not match compression_type and the unknown header fields",
                });
            }
        }
        let mut out = Vec::with_capacity(4096);
        out.extend_from_slice(&QCOW2_MAGIC.to_be_bytes());
        out.extend_from_slice(&self.version.to_be_bytes());
        out.extend_from_slice(&[0; 12]); // backing file offset and size, filled in below
        out.extend_from_slice(&self.cluster_bits.to_be_bytes());
        out.extend_from_slice(&self.size.to_be_bytes());
        out.extend_from_slice(&self.crypt_method.to_be_bytes());
        out.extend_from_slice(&self.l1_size.to_be_bytes());
        out.extend_from_slice(&self.l1_table_offset.to_be_bytes());
        out.extend_from_slice(&self.refcount_table_offset.to_be_bytes());
        out.extend_from_slice(&self.refcount_table_clusters.to_be_bytes());
        out.extend_from_slice(&self.nb_snapshots.to_be_bytes());
        out.extend_from_slice(&self.snapshots_offset.to_be_bytes());
        if v3 {
            out.extend_from_slice(&self.incompatible_features.to_be_bytes());
            out.extend_from_slice(&self.compatible_features.to_be_bytes());
            out.extend_from_slice(&self.autoclear_features.to_be_bytes());
            out.extend_from_slice(&self.refcount_order.to_be_bytes());
            out.extend_from_slice(&self.header_length.to_be_bytes());
            if self.header_length > limits::MIN_V3_HEADER_LENGTH {
                out.push(self.compression_type);
                out.extend_from_slice(&self.unknown_header_tail);
            }
        }
        extensions::encode_all(&self.extensions, &mut out)?;
        if let Some(name) = &self.backing_file {
            if name.len() > limits::MAX_BACKING_FILE_NAME as usize {
                return Err(FormatError::LimitExceeded {
                    at: at(field::BACKING_FILE_SIZE as u64),
                    field: "backing_file_size",
                    value: name.len() as u64,
                    limit: limits::MAX_BACKING_FILE_NAME.into(),
                    why: "QEMU reads at most 1023 bytes of backing file name",
                });
            }
            let offset = out.len() as u64;
            out[8..16].copy_from_slice(&offset.to_be_bytes());
            out[16..20].copy_from_slice(&(name.len() as u32).to_be_bytes()); // ≤ 1023
            out.extend_from_slice(name);
        }
        if out.len() as u64 > cluster_size {
            return Err(FormatError::DoesNotFit {
                at: at(0),
                what: "header, extensions and backing file name",
                need: out.len() as u64,
                available: cluster_size,
            });
        }
        // cluster_size ≥ out.len(), so it fits in usize.
        out.resize(cluster_size as usize, 0);
        Ok(out)
    }
}
