//! Extended (128-bit) L2 entries: a standard descriptor plus 32 allocation bits and 32 zero
//! bits, one pair per subcluster.

use super::error::{FormatError, Location, Structure};
use super::geometry::{Geometry, HostOffset};
use super::l2::{L2Entry, L2_ZERO};

/// What a subcluster reads as.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum SubclusterState {
    /// Reads from the backing file (or zeros without one).
    Unallocated,
    /// Reads as zeros.
    Zero,
    /// Reads from the host cluster (or, for a compressed cluster, from its compressed data).
    Allocated,
}

/// The bitmap word of an extended entry: allocation bits low, zero bits high.
pub fn pack_bitmap(alloc: u32, zero: u32) -> u64 {
    u64::from(alloc) | (u64::from(zero) << 32)
}

/// The allocation and zero bits of a bitmap word.
pub fn unpack_bitmap(bitmap: u64) -> (u32, u32) {
    // Splitting the word into its halves: truncation is the intent.
    (bitmap as u32, (bitmap >> 32) as u32)
}

/// A bitmap word in which every subcluster reads as zeros.
pub const ALL_ZERO_BITMAP: u64 = 0xffff_ffff << 32;

/// Bits of subclusters `first..=last` (both below 32).
pub fn subcluster_mask(first: u32, last: u32) -> u32 {
    let hi = if last >= 31 {
        u32::MAX
    } else {
        (1u32 << (last + 1)) - 1
    };
    hi & !((1u32 << first) - 1)
}

/// A decoded extended L2 entry.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ExtendedL2Entry {
    /// The first word; never [`L2Entry::Zero`] (zeros live in the bitmap).
    pub entry: L2Entry,
    /// Bit x set: subcluster x is allocated.
    pub alloc: u32,
    /// Bit x set: subcluster x reads as zeros.
    pub zero: u32,
}

impl ExtendedL2Entry {
    /// Decodes entry `index` of the L2 table at `table_offset` from its two words, detecting
    /// every combination the specification forbids.
    pub fn decode(
        raw: u64,
        bitmap: u64,
        geometry: &Geometry,
        index: u64,
        table_offset: HostOffset,
    ) -> Result<ExtendedL2Entry, FormatError> {
        let at = Location::entry(Structure::L2Table, table_offset.0, index);
        let entry = L2Entry::decode(raw, geometry, index, table_offset)?;
        let (alloc, zero) = unpack_bitmap(bitmap);
        match entry {
            L2Entry::Compressed(_) => {
                if bitmap != 0 {
                    return Err(FormatError::InvalidSubclusters {
                        at,
                        alloc,
                        zero,
                        problem:
                            "compressed clusters have no subclusters, so the bitmap must be zero",
                    });
                }
            }
            L2Entry::Zero { .. } => {
                // L2Entry::decode already refuses the zero flag with extended entries.
                return Err(FormatError::ReservedBits {
                    at,
                    field: "L2 entry",
                    bits: raw & L2_ZERO,
                });
            }
            L2Entry::Unallocated | L2Entry::Normal { .. } => {
                let both = alloc & zero;
                if both != 0 {
                    return Err(FormatError::InvalidSubclusters {
                        at,
                        alloc,
                        zero,
                        problem: "a subcluster is marked both allocated and zero",
                    });
                }
                if alloc != 0 && entry == L2Entry::Unallocated {
                    return Err(FormatError::InvalidSubclusters {
                        at,
                        alloc,
                        zero,
                        problem: "allocated subclusters but no host cluster offset",
                    });
                }
            }
        }
        Ok(ExtendedL2Entry { entry, alloc, zero })
    }

    /// Encodes both words.
    pub fn encode(&self, geometry: &Geometry) -> Result<(u64, u64), FormatError> {
        let at = Location::at(Structure::L2Table, 0);
        let bitmap = u64::from(self.alloc) | (u64::from(self.zero) << 32);
        let problem = match self.entry {
            L2Entry::Compressed(_) if bitmap != 0 => {
                Some("compressed clusters have no subclusters")
            }
            L2Entry::Zero { .. } => Some("zero clusters are expressed in the bitmap"),
            L2Entry::Unallocated if self.alloc != 0 => {
                Some("allocated subclusters but no host cluster offset")
            }
            _ if self.alloc & self.zero != 0 => {
                Some("a subcluster is marked both allocated and zero")
            }
            _ => None,
        };
        if let Some(problem) = problem {
            return Err(FormatError::InvalidSubclusters {
                at,
                alloc: self.alloc,
                zero: self.zero,
                problem,
            });
        }
        Ok((self.entry.encode(geometry)?, bitmap))
    }

    /// State of subcluster `index` (masked to 0..32, so any index is safe).
    pub fn state(&self, index: u32) -> SubclusterState {
        if let L2Entry::Compressed(_) = self.entry {
            return SubclusterState::Allocated;
        }
        let bit = 1u32 << (index & 31);
        if self.alloc & bit != 0 {
            SubclusterState::Allocated
        } else if self.zero & bit != 0 {
            SubclusterState::Zero
        } else {
            SubclusterState::Unallocated
        }
    }

    /// Bitmask of the subclusters in `state`.
    pub fn mask(&self, state: SubclusterState) -> u32 {
        if let L2Entry::Compressed(_) = self.entry {
            return if state == SubclusterState::Allocated {
                u32::MAX
            } else {
                0
            };
        }
        match state {
            SubclusterState::Allocated => self.alloc,
            SubclusterState::Zero => self.zero,
            SubclusterState::Unallocated => !(self.alloc | self.zero),
        }
    }

    /// The state of subcluster `start` and how many consecutive subclusters from it share
    /// that state (1..=32-start), so a reader can issue one I/O per run. `start` is masked to
    /// 0..32.
    pub fn run_at(&self, start: u32) -> (SubclusterState, u32) {
        let start = start & 31;
        let state = self.state(start);
        let run = (self.mask(state) >> start).trailing_ones().min(32 - start);
        (state, run)
    }

    /// Iterates over the runs of equal state from subcluster 0 to 31.
    pub fn runs(&self) -> impl Iterator<Item = (u32, SubclusterState, u32)> + '_ {
        let mut next = 0u32;
        std::iter::from_fn(move || {
            if next >= 32 {
                return None;
            }
            let (state, len) = self.run_at(next);
            let item = (next, state, len);
            next += len;
            Some(item)
        })
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn subcluster_masks_and_bitmap_halves() {
        assert_eq!(super::subcluster_mask(0, 0), 1);
        assert_eq!(super::subcluster_mask(0, 31), u32::MAX);
        assert_eq!(super::subcluster_mask(3, 5), 0b111000);
        assert_eq!(super::subcluster_mask(31, 31), 1 << 31);
        let word = super::pack_bitmap(0x0000_00f0, 0x0f00_0000);
        assert_eq!(word, 0x0f00_0000_0000_00f0);
        assert_eq!(super::unpack_bitmap(word), (0x0000_00f0, 0x0f00_0000));
        assert_eq!(super::unpack_bitmap(super::ALL_ZERO_BITMAP), (0, u32::MAX));
    }

    use super::*;

    fn geom() -> Geometry {
        Geometry::new(16, true, 4, 1 << 30).unwrap()
    }

    #[test]
    fn runs_cover_all_subclusters() {
        let e = ExtendedL2Entry {
            entry: L2Entry::Normal {
                host: HostOffset(0x50000),
                copied: true,
            },
            alloc: 0b0000_0111,
            zero: 0b0011_0000,
        };
        let runs: Vec<_> = e.runs().collect();
        assert_eq!(
            runs,
            vec![
                (0, SubclusterState::Allocated, 3),
                (3, SubclusterState::Unallocated, 1),
                (4, SubclusterState::Zero, 2),
                (6, SubclusterState::Unallocated, 26),
            ]
        );
        assert_eq!(e.run_at(1), (SubclusterState::Allocated, 2));
    }

    #[test]
    fn full_runs_do_not_overflow() {
        let e = ExtendedL2Entry {
            entry: L2Entry::Normal {
                host: HostOffset(0x50000),
                copied: false,
            },
            alloc: u32::MAX,
            zero: 0,
        };
        assert_eq!(e.run_at(0), (SubclusterState::Allocated, 32));
        assert_eq!(e.run_at(31), (SubclusterState::Allocated, 1));
        assert_eq!(e.runs().count(), 1);
    }

    #[test]
    fn decode_states_of_a_mixed_entry() {
        let e = ExtendedL2Entry::decode(
            0x8000_0000_0005_0000,
            0x0000_0002_0000_0001,
            &geom(),
            0,
            HostOffset(0x30000),
        )
        .unwrap();
        assert_eq!(e.state(0), SubclusterState::Allocated);
        assert_eq!(e.state(1), SubclusterState::Zero);
        assert_eq!(e.state(2), SubclusterState::Unallocated);
    }
}
