//! SplitMix64, the one deterministic random source of the workspace: the fault storage picks
//! crash subsets and torn sectors with it, and tests (through `test-support`) draw their
//! operations from it, so a run is reproducible from the seed it prints without a crate
//! just for this.

/// SplitMix64: a small deterministic random source.
#[derive(Debug, Clone, Default)]
pub struct Rng(pub u64);

impl Rng {
    /// The next 64 random bits.
    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    /// A number in `0..n` (0 when `n` is 0, so an empty range needs no special case).
    pub fn below(&mut self, n: u64) -> u64 {
        self.next_u64() % n.max(1)
    }

    /// A position in `0..len` (0 when `len` is 0).
    pub fn index(&mut self, len: usize) -> usize {
        let len = u64::try_from(len).expect("usize fits in u64");
        usize::try_from(self.below(len)).expect("below a usize")
    }

    /// Fisher–Yates shuffle of `items`.
    pub fn shuffle<T>(&mut self, items: &mut [T]) {
        for i in (1..items.len()).rev() {
            items.swap(i, self.index(i + 1));
        }
    }

    /// `n` random bytes.
    pub fn bytes(&mut self, n: usize) -> Vec<u8> {
        let mut v = Vec::with_capacity(n + 8);
        while v.len() < n {
            v.extend_from_slice(&self.next_u64().to_le_bytes());
        }
        v.truncate(n);
        v
    }
}
