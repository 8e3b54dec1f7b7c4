//! A sum over leading axes in one pass, what the fused `LeadingSum` operator computes: X
//! seen as a `[P, R]` matrix (P the product of the summed leading axes, R of the rest),
//! the sum of its rows.
//!
//! ```text
//! LeadingSum(X; axes = j, keepdims) -> Y,   Y[r] = X[0, r] + X[1, r] + .. + X[P-1, r]
//! ```
//!
//! Backward graphs sum over the batch this way: a linear layer's bias gradient, and the
//! convolutions' weight gradients summed over the images. ONNX Runtime 1.31.1's own
//! `ReduceSum` of this shape spreads the columns over its threads in pieces too small to
//! pay (on two threads 10x slower than on one for `[32, 18432]`). Here each of the session's
//! threads takes one block of columns (at least 512 wide) and adds the rows' pieces into it
//! front to back: X is read once, in rows.
//!
//! Each column adds its rows in order, starting from row 0, as ONNX Runtime's reduction
//! does: the same bits (benches/README.md, "Run AA"; the test of `fused_leading_sum`).

/// The sum over leading axes on onnx-ga's kernel (see the module's comment).
pub const LEADING_SUM: &str = "LeadingSum";

/// Columns summed together, row by row (256 KiB of sums, which stay in L2): X is read in
/// its order, which the hardware prefetchers follow. Narrow panels down all the rows read
/// each row's piece apart from the next and ran slower: 2048 columns (8 KiB of sums) 1.4x
/// the time on `[32, 18432]` from memory, blocks of 64 columns 2x on `[512, 1024]`.
const PANEL: usize = 1 << 16;

/// `out[c] = Σ_r x[r · columns + first + c]` for `r` in `0..rows`, in row order, over the
/// columns `first .. first + out.len()` of a `[rows, columns]` matrix `x`.
pub fn leading_sum(x: &[f32], (rows, columns): (usize, usize), first: usize, out: &mut [f32]) {
    with_widest_vectors!(leading_sum_portable(x, (rows, columns), first, out))
}

#[inline(always)]
fn leading_sum_portable(x: &[f32], (rows, columns): (usize, usize), first: usize, out: &mut [f32]) {
    if rows == 0 {
        out.fill(0.0);
        return;
    }
    let row = |r: usize, start: usize, len: usize| {
        let at = r * columns + first + start;
        &x[at..at + len]
    };
    for (p, panel) in out.chunks_mut(PANEL).enumerate() {
        let (start, len) = (p * PANEL, panel.len());
        panel.copy_from_slice(row(0, start, len));
        for r in 1..rows {
            for (a, v) in panel.iter_mut().zip(row(r, start, len)) {
                *a += v;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every column's rows added in order from row 0, bit for bit, whatever the block a
    /// column falls in (whole blocks, the tail, a range starting mid-row).
    #[test]
    fn each_column_adds_its_rows_in_order() {
        for (rows, columns) in [(1, 5), (3, 64), (7, 130), (32, 200), (0, 9)] {
            let x: Vec<f32> = (0..rows * columns)
                .map(|i| ((i * 7919) % 1000) as f32 * 1.37e-3 - 0.61)
                .collect();
            for first in [0, 3.min(columns)] {
                let mut out = vec![f32::NAN; columns - first];
                leading_sum(&x, (rows, columns), first, &mut out);
                for (c, got) in out.iter().enumerate() {
                    let want = (1..rows)
                        .fold(if rows == 0 { 0.0 } else { x[first + c] }, |s, r| {
                            s + x[r * columns + first + c]
                        });
                    assert_eq!(
                        got.to_bits(),
                        want.to_bits(),
                        "{rows}x{columns}, column {c}"
                    );
                }
            }
        }
    }

    /// -0 in every row stays -0 (the sum starts from row 0, not from +0).
    #[test]
    fn negative_zeros_stay_negative() {
        let x = [-0.0f32; 6];
        let mut out = [1.0f32; 3];
        leading_sum(&x, (2, 3), 0, &mut out);
        assert!(out.iter().all(|v| v.to_bits() == (-0.0f32).to_bits()));
    }
}
