//! `v / c` for a divisor `c` fixed before a loop, correctly rounded without dividing: the
//! AdamW kernel's bias correction `v' / c` (one of its two divisions an element; with the
//! square root, divisions bound the kernel: 0.55 ns an element against 0.38 without the
//! correction's, AVX-512, benches/README.md "Run W").
//!
//! With `y = RN(1/c)` made once, for each `v`:
//!
//! ```text
//! q0 = RN(v·y)
//! r0 = RN(v - c·q0)            one fused multiply-add
//! q  = RN(q0 + r0·y)           one fused multiply-add
//! ```
//!
//! By Markstein's theorem `q` is `RN(v/c)` when `y` is within half an ulp of `1/c` and
//! `q0` within one ulp of `v/c`, barring underflow and overflow. The kernel does not rest
//! on that: every `q` is checked with one more fused multiply-add ([`KnownDivisor::
//! quotient`]), and a block holding a refused one divides. The theorem is why refusals are
//! rare: none, for every float in range and 57 divisors (`every_quotient_in_range`, run by
//! hand: 1.3 G values a divisor, 40 s in all). So the bits are the division's: what the
//! standard-op graph computes.
//!
//! Underflow and overflow are kept away by range: the divisor in [2^-60, 1] (a bias
//! correction 1 - β^t is in (0, 1]), every `v` of a block in [2^-100, 2^60], so that the
//! quotient lies in [2^-100, 2^120], well inside the normal range, and the check's bound
//! `c·h` is normal. A block with any other value (zero, a subnormal, a huge one, infinity,
//! NaN) divides, as does a divisor out of range.

/// The smallest and largest `v` the division-free quotient takes (see the module's doc).
const LEAST: f32 = 1.0 / (1u128 << 100) as f32;
const MOST: f32 = (1u64 << 60) as f32;

/// A divisor fixed before the loop, with its correctly rounded reciprocal.
#[derive(Clone, Copy, Debug)]
pub(super) struct KnownDivisor {
    c: f32,
    /// `RN(1/c)`.
    y: f32,
}

impl KnownDivisor {
    /// `None` when `c` is out of [2^-60, 1] (NaN included): the caller then divides.
    pub(super) fn new(c: f32) -> Option<KnownDivisor> {
        let least = 1.0 / (1u64 << 60) as f32;
        (least..=1.0)
            .contains(&c)
            .then(|| KnownDivisor { c, y: 1.0 / c })
    }

    pub(super) fn divisor(&self) -> f32 {
        self.c
    }

    /// Whether [`quotient`](Self::quotient) takes `v` (false for NaN).
    #[inline(always)]
    #[allow(clippy::manual_range_contains)] // `&`, not `contains`'s `&&`: no branch per element
    pub(super) fn takes(&self, v: f32) -> bool {
        (v >= LEAST) & (v <= MOST)
    }

    /// `v / c` for a `v` it [`takes`](Self::takes), and whether that is the correctly
    /// rounded quotient, checked: when false, the caller divides.
    ///
    /// The check makes the bits certain whatever the error of the first approximation:
    /// `q` is `RN(v/c)` when `v/c` lies within half an ulp of `q` on its side (a quarter on
    /// the lower side of a power of two, where the ulp below halves). `r = RN(v - c·q)` (one
    /// fused multiply-add) is compared with `c·h`, `h` that half-ulp: exact, a float
    /// times a power of two, normal for every `v` in range. Rounding is monotone, so
    /// `|r| < c·h` implies `|v - c·q| < c·h`, i.e. `|v/c - q| < h`: a strict test,
    /// a tie or a wrong `q` falls back.
    #[inline(always)]
    pub(super) fn quotient(&self, v: f32) -> (f32, bool) {
        let q0 = v * self.y;
        let r0 = (-self.c).mul_add(q0, v);
        let q = r0.mul_add(self.y, q0);
        let r = (-self.c).mul_add(q, v);
        // Half an ulp of q (positive, normal: q >= v >= 2^-100), a quarter below a power of
        // two.
        let bits = q.to_bits();
        let half = f32::from_bits((bits & 0x7f80_0000).wrapping_sub(24 << 23));
        let below = match bits & 0x7f_ffff {
            0 => half * 0.5,
            _ => half,
        };
        let bound = match r >= 0.0 {
            true => self.c * half,
            false => self.c * below,
        };
        (q, r.abs() < bound)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The same bits as the division, for divisors from the bias corrections of the usual
    /// betas at steps 1 to 10 000 and a few others, over values of every class: a sweep
    /// of exponents and mantissas, the range's edges, zeros, subnormals, infinity and NaN.
    #[test]
    fn the_quotient_is_the_divisions() {
        let mut divisors: Vec<f32> = Vec::new();
        for beta in [0.9f32, 0.99, 0.999, 0.9999, 0.95, 0.5] {
            let mut power = 1.0f32;
            for t in 1..=10_000 {
                power *= beta;
                if t % 37 == 1 || t < 20 {
                    divisors.push(1.0 - power);
                }
            }
        }
        divisors.extend([
            1.0,
            0.75,
            1.0 / 3.0,
            2f32.powi(-60),
            1.0 - f32::EPSILON / 2.0,
        ]);
        // Blocks in range (exponents across it, random mantissas), then mixed ones: a
        // xorshift over the positive patterns, and the edges with every class.
        let mut state = 0x2545_f491u32;
        let mut next = move || {
            state ^= state << 13;
            state ^= state >> 17;
            state ^= state << 5;
            state
        };
        let mut values: Vec<f32> = (0..1 << 15)
            .map(|_| {
                let x = next();
                let exponent = (127 - 100 + x % 161) << 23;
                f32::from_bits(exponent | (next() & 0x7f_ffff))
            })
            .collect();
        values.extend((0..1 << 12).map(|_| f32::from_bits(next() & 0x7fff_ffff)));
        for edge in [LEAST, MOST] {
            let bits = edge.to_bits();
            values.extend([edge, f32::from_bits(bits - 1), f32::from_bits(bits + 1)]);
        }
        values.extend([
            0.0,
            1e-45,
            f32::MIN_POSITIVE,
            1.0,
            f32::MAX,
            f32::INFINITY,
            f32::NAN,
        ]);
        let mut taken = 0;
        for &c in &divisors {
            let d = KnownDivisor::new(c).expect("in range");
            for &v in &values {
                assert_eq!(d.takes(v), (LEAST..=MOST).contains(&v), "{v:e}");
                if d.takes(v) {
                    let (q, exact) = d.quotient(v);
                    taken += exact as usize;
                    assert!(exact, "{v:e} / {c:e}: the check refused the quotient");
                    assert_eq!(q.to_bits(), (v / c).to_bits(), "{v:e} / {c:e}");
                }
            }
        }
        assert!(taken > divisors.len() * (1 << 15), "{taken}");
        assert!(KnownDivisor::new(2f32.powi(-61)).is_none());
        assert!(KnownDivisor::new(1.5).is_none());
        assert!(KnownDivisor::new(f32::NAN).is_none());
    }

    /// The check alone makes the bits certain: with a reciprocal far enough off that the
    /// one correction often misses the rounding, every quotient it accepts is still the
    /// division's, and it refuses the others.
    #[test]
    fn the_check_refuses_a_wrong_quotient() {
        let mut state = 0x7f4a_7c15u32;
        let values: Vec<f32> = (0..1 << 16)
            .map(|_| {
                state ^= state << 13;
                state ^= state >> 17;
                state ^= state << 5;
                f32::from_bits((127 - 30 + state % 60) << 23 | (state >> 9))
            })
            .collect();
        for c in [0.1f32, 1.0 - 0.999f32.powi(3), 0.75, 1.0 / 3.0] {
            for off in [1i32 << 11, -(1 << 11)] {
                let y = f32::from_bits(((1.0 / c).to_bits() as i32 + off) as u32);
                let d = KnownDivisor { c, y };
                let (mut accepted, mut refused) = (0, 0);
                for &v in &values {
                    let (q, exact) = d.quotient(v);
                    match exact {
                        true => {
                            accepted += 1;
                            assert_eq!(q.to_bits(), (v / c).to_bits(), "{v:e} / {c:e}");
                        }
                        false => refused += 1,
                    }
                }
                assert!(
                    accepted > 0 && refused > 0,
                    "c {c}, off {off}: {accepted} {refused}"
                );
            }
        }
    }

    /// Every float in range against the division, for the divisors of the test above
    /// that the usual betas make at steps 1, 2, 10, 100, 1000 and a few others: 1.3 G
    /// values each, seconds a divisor with the widest vectors. By hand:
    /// `cargo test --release --lib every_quotient_in_range -- --ignored`.
    #[test]
    #[ignore]
    fn every_quotient_in_range() {
        #[inline(always)]
        fn sweep(d: KnownDivisor, c: f32, first: u32, last: u32) -> u64 {
            (first..=last)
                .map(|bits| {
                    let v = f32::from_bits(bits);
                    let (q, exact) = d.quotient(v);
                    (!exact || q.to_bits() != (v / c).to_bits()) as u64
                })
                .sum()
        }
        let mut divisors = vec![1.0f32, 0.75, 1.0 / 3.0, 2f32.powi(-60)];
        for beta in [0.9f32, 0.99, 0.999, 0.9999, 0.95] {
            for t in [1, 2, 3, 10, 100, 1000, 10_000] {
                divisors.push(1.0 - beta.powi(t));
            }
        }
        divisors.extend((1..=18).map(|k| 1.0 - 0.999f32.powi(k * 7 + 4)));
        let (first, last) = (LEAST.to_bits(), MOST.to_bits());
        for &c in &divisors {
            let d = KnownDivisor::new(c).expect("in range");
            let mismatches = with_widest_vectors!(sweep(d, c, first, last));
            assert_eq!(mismatches, 0, "divisor {c:e}");
        }
        eprintln!(
            "{} divisors, every value in range: the same bits",
            divisors.len()
        );
    }
}
