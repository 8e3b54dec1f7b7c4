//! A transpose that keeps the last axis last, what the fused `RowTranspose` operator
//! computes: every row of the last axis moves whole, so the transpose is one copy per row.
//!
//! ```text
//! RowTranspose(X [d_0, .., d_{r-1}]; perm, perm[r-1] = r-1) -> Y [d_perm[0], .., d_perm[r-1]]
//! Y[i_0, .., i_{r-2}, :] = X[j_0, .., j_{r-2}, :]   where j_perm[k] = i_k
//! ```
//!
//! Why: a transformer's attention splits and merges its heads by `Transpose` with perm
//! `[0, 2, 1, 3]` (`[B, T, H, D]` <-> `[B, H, T, D]`), 44 of them a micro-step in the GPT.
//! ONNX Runtime 1.31.1 moves those 64-float rows at 25-36 µs a node for `[4, 64, 4, 64]`
//! (256 KiB), on one thread however many the session has (benches/README.md, "Run AF"). A
//! copy is a copy: the same bits.

/// The transpose on onnx-ga's kernel (see the module's comment).
pub const ROW_TRANSPOSE: &str = "RowTranspose";

/// How one transpose's output rows are read from its input.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RowLayout {
    /// Y's dimensions.
    out_dims: Vec<usize>,
    /// Per leading axis of Y, the input rows between two neighbours along it.
    in_strides: Vec<usize>,
    /// Elements per row (the last axis).
    row: usize,
}

impl RowLayout {
    /// The layout of transposing `dims` by `perm`; `None` unless `perm` is a permutation of
    /// `0..dims.len()` that keeps the last axis last, or a size overflows.
    pub fn new(dims: &[usize], perm: &[usize]) -> Option<RowLayout> {
        let rank = dims.len();
        let mut seen = vec![false; rank];
        for &p in perm {
            if p >= rank || std::mem::replace(&mut seen[p], true) {
                return None;
            }
        }
        if rank == 0 || perm.len() != rank || perm[rank - 1] != rank - 1 {
            return None;
        }
        // The input's strides in rows, axis by axis from the last leading one.
        let mut row_strides = vec![1usize; rank - 1];
        for a in (0..rank.saturating_sub(2)).rev() {
            row_strides[a] = row_strides[a + 1].checked_mul(dims[a + 1])?;
        }
        dims.iter().try_fold(1usize, |n, &d| n.checked_mul(d))?;
        Some(RowLayout {
            out_dims: perm.iter().map(|&p| dims[p]).collect(),
            in_strides: perm[..rank - 1].iter().map(|&p| row_strides[p]).collect(),
            row: dims[rank - 1],
        })
    }

    pub fn out_dims(&self) -> &[usize] {
        &self.out_dims
    }

    /// Elements per row.
    pub fn row(&self) -> usize {
        self.row
    }

    /// Writes Y's rows from `first_row` on into `out` (whole rows), reading X `x`.
    pub fn copy_rows(&self, x: &[f32], first_row: usize, out: &mut [f32]) {
        let (row, lead) = (self.row, &self.out_dims[..self.out_dims.len() - 1]);
        if row == 0 {
            return;
        }
        // Y's leading coordinates of `first_row`, then counted up row by row (an odometer),
        // the input row kept beside them.
        let mut coords = vec![0usize; lead.len()];
        let mut rest = first_row;
        for (c, &d) in coords.iter_mut().zip(lead).rev() {
            *c = rest % d.max(1);
            rest /= d.max(1);
        }
        let mut from: usize = coords
            .iter()
            .zip(&self.in_strides)
            .map(|(c, s)| c * s)
            .sum();
        for dst in out.chunks_exact_mut(row) {
            dst.copy_from_slice(&x[from * row..(from + 1) * row]);
            for a in (0..lead.len()).rev() {
                coords[a] += 1;
                from += self.in_strides[a];
                if coords[a] < lead[a] {
                    break;
                }
                from -= coords[a] * self.in_strides[a];
                coords[a] = 0;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Against the definition, element by element, from any first row.
    #[test]
    fn rows_move_by_the_definition() {
        let cases: [(&[usize], &[usize]); 4] = [
            (&[2, 3, 4, 5], &[0, 2, 1, 3]),
            (&[2, 3, 4, 5], &[2, 0, 1, 3]),
            (&[3, 2, 4], &[1, 0, 2]),
            (&[2, 1, 3, 2, 4], &[3, 0, 2, 1, 4]),
        ];
        for (dims, perm) in cases {
            let layout = RowLayout::new(dims, perm).unwrap();
            let n: usize = dims.iter().product();
            let x: Vec<f32> = (0..n).map(|v| v as f32).collect();
            let out_dims = layout.out_dims().to_vec();
            let rows = n / layout.row();
            for first in [0, 1, rows / 2] {
                let mut out = vec![f32::NAN; (rows - first) * layout.row()];
                layout.copy_rows(&x, first, &mut out);
                for (k, got) in out.iter().enumerate() {
                    // Y's coordinates of element `first·row + k`, then X's.
                    let mut rest = first * layout.row() + k;
                    let mut y = vec![0; dims.len()];
                    for a in (0..dims.len()).rev() {
                        y[a] = rest % out_dims[a];
                        rest /= out_dims[a];
                    }
                    let mut xi = vec![0; dims.len()];
                    for (a, &p) in perm.iter().enumerate() {
                        xi[p] = y[a];
                    }
                    let flat = xi.iter().zip(dims).fold(0, |f, (i, d)| f * d + i);
                    assert_eq!(
                        *got, x[flat],
                        "{dims:?} by {perm:?}, element {k} from row {first}"
                    );
                }
            }
        }
    }

    #[test]
    fn only_permutations_keeping_the_last_axis() {
        assert!(RowLayout::new(&[2, 3, 4], &[0, 2, 1]).is_none());
        assert!(RowLayout::new(&[2, 3, 4], &[0, 0, 2]).is_none());
        assert!(RowLayout::new(&[2, 3, 4], &[1, 0]).is_none());
        assert!(RowLayout::new(&[2, 3, 4], &[1, 0, 3]).is_none());
        assert!(RowLayout::new(&[usize::MAX, 3, 4], &[1, 0, 2]).is_none());
    }
}
