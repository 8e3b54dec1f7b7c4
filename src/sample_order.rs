//! Which data rows each micro-step takes.
//!
//! The rows form one stream, epoch after epoch, and micro-step `g` (counted from the start
//! of training, across resumes) takes stream positions `[g·B, (g+1)·B)`. In order (the
//! default) every epoch is rows `0..N`, so micro-step `g` takes rows `g·B mod N` onwards,
//! wrapping around. Shuffled (`train --shuffle SEED`) epoch `e` is a permutation of `0..N`
//! drawn from `(SEED, e)`: every row once an epoch, a new order each epoch, and the same
//! order on every run, on every rank of a distributed job and after a resume.
//!
//! The permutation is computed row by row with no table, so it costs nothing at any data
//! size (data may be larger than memory: [`crate::dataset`]): a Feistel network permutes the
//! integers below the smallest power of four at or above `N`, and an index that lands at or
//! above `N` is permuted again until it lands below ("cycle walking"). That is a bijection
//! of `0..N` (the walk stays on the index's own cycle of the larger permutation), and as the
//! power of four is under `4N`, a position takes under four walks on average.

/// The order micro-steps take the data's rows in.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum SampleOrder {
    /// Rows `0..N`, every epoch.
    #[default]
    InOrder,
    /// A permutation of `0..N` drawn from the seed and the epoch.
    Shuffled { seed: u64 },
}

/// Feistel rounds: four make a pseudo-random permutation of a good round function; two
/// more cost nothing here.
const ROUNDS: u64 = 6;

impl SampleOrder {
    /// The rows micro-step `step` takes, `batch` of them, from data of `samples` rows.
    pub fn rows(self, samples: usize, batch: usize, step: u64) -> Vec<usize> {
        assert!(samples > 0, "data of no rows has no micro-batches");
        let first = u128::from(step) * batch as u128;
        (0..batch as u128)
            .map(|j| self.row_at(samples, first + j))
            .collect()
    }

    /// The row at `position` of the stream over data of `samples` rows.
    pub fn row_at(self, samples: usize, position: u128) -> usize {
        let n = samples as u128;
        let index = (position % n) as u64;
        match self {
            SampleOrder::InOrder => index as usize,
            SampleOrder::Shuffled { seed } => {
                let epoch = (position / n) as u64;
                EpochPermutation::new(seed, epoch, samples as u64).apply(index) as usize
            }
        }
    }
}

/// One epoch's permutation of `0..n`.
struct EpochPermutation {
    key: u64,
    n: u64,
    /// Bits of each half of the Feistel network's domain, `2^(2·half) >= n`.
    half: u32,
}

impl EpochPermutation {
    fn new(seed: u64, epoch: u64, n: u64) -> EpochPermutation {
        let bits = 64 - n.saturating_sub(1).leading_zeros();
        EpochPermutation {
            key: mix(mix(seed) ^ epoch.wrapping_mul(0x9e37_79b9_7f4a_7c15)),
            n,
            half: bits.div_ceil(2).max(1),
        }
    }

    /// Where `index` (below `n`) goes.
    fn apply(&self, index: u64) -> u64 {
        let mut x = self.feistel(index);
        while x >= self.n {
            x = self.feistel(x);
        }
        x
    }

    /// The Feistel network over `0..2^(2·half)`: each round swaps the halves and mixes one
    /// into the other through a keyed hash; any round function makes it a bijection.
    fn feistel(&self, x: u64) -> u64 {
        let mask = u64::MAX >> (64 - self.half);
        let (mut left, mut right) = (x >> self.half, x & mask);
        for round in 0..ROUNDS {
            let f = mix(self.key ^ mix(right ^ (round << 58))) & mask;
            (left, right) = (right, left ^ f);
        }
        (left << self.half) | right
    }
}

/// SplitMix64's finaliser: a bijective mixing of 64 bits in which every input bit flips
/// about half the output bits.
fn mix(mut z: u64) -> u64 {
    z = z.wrapping_add(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}
