//! The ReLU gradient as one pass, what the fused `ReluGrad` operator computes: the
//! lowering's `Mul(dY, Cast(Greater(Y, 0)))` (`passes/legalize/relu_grad.rs`) is three
//! full passes and two temporaries, a mask of bools and one of floats.
//!
//! ```text
//! ReluGrad(dY, Y) -> dX,   dX = dY · (Y > 0 ? 1 : 0)
//! ```
//!
//! The lowering's own product, element by element, so the same bits (a NaN or an infinite
//! dY where Y <= 0 gives NaN, -0 where dY is negative: as there).

/// The ReLU gradient on onnx-ga's kernel (see the module's comment).
pub const RELU_GRAD: &str = "ReluGrad";

/// `dx = dy · [y > 0]` over the common length.
pub fn relu_grad(dy: &[f32], y: &[f32], dx: &mut [f32]) {
    with_widest_vectors!(relu_grad_portable(dy, y, dx))
}

#[inline(always)]
fn relu_grad_portable(dy: &[f32], y: &[f32], dx: &mut [f32]) {
    for ((out, &g), &v) in dx.iter_mut().zip(dy).zip(y) {
        *out = g * if v > 0.0 { 1.0 } else { 0.0 };
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The lowering's product, bit for bit, at the edges: zero, negative zero, NaN, ±inf.
    #[test]
    fn relu_grad_is_the_masked_product() {
        let y = [1.0f32, 0.0, -0.0, -2.0, f32::NAN, 3.0, -1.0, 0.5];
        let dy = [
            2.0f32,
            3.0,
            -4.0,
            -5.0,
            6.0,
            f32::INFINITY,
            f32::NEG_INFINITY,
            f32::NAN,
        ];
        let mut dx = [0f32; 8];
        relu_grad(&dy, &y, &mut dx);
        // The reference at run time, as the kernel computes: folded at compile time (as an
        // optimised build does with these constants) -inf · 0 gives LLVM's positive NaN,
        // where x86's multiply gives its negative default NaN.
        let (y, dy) = std::hint::black_box((y, dy));
        for i in 0..8 {
            let mask = (y[i] > 0.0) as u8 as f32;
            let want = dy[i] * mask;
            assert_eq!(
                dx[i].to_bits(),
                want.to_bits(),
                "element {i}: {} vs {want}",
                dx[i]
            );
        }
    }
}
