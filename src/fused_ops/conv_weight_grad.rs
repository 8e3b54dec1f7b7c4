//! A 2-D convolution's weight gradient, image by image, what the fused `ConvWeightGrad`
//! operator computes: the unfolding ([`super::IM2COL`]), the per-image product by dY and the
//! sum over the images that `passes/legalize/conv_grad.rs` writes as three nodes, in one.
//!
//! ```text
//! ConvWeightGrad(X [N, C, H, W], dY [N, M, Ho, Wo]; kernel_shape [kh, kw], strides,
//!                pads, dilations) -> dWᵀ [1, C·kh·kw, M]
//! dWᵀ = P_0 + P_1 + .. + P_{N-1}     (added in image order, starting from P_0)
//! P_n = Im2Col(X)[n] · dY[n]ᵀ         (cols [C·kh·kw, Ho·Wo] by [Ho·Wo, M]: ONNX Runtime's
//!                                      GEMM, the one its MatMul of the three-node form runs)
//! ```
//!
//! Why: the three-node form writes every image's columns to memory before the product
//! reads them back, 40 MB a micro-step on the ResNet-8 at B 32, and the per-image products
//! another `[N, C·kh·kw, M]` before the sum reads them. Here each image's columns are made
//! into a buffer that stays in cache, the GEMM reads them there, and its product is added
//! to the sum at once. Each thread takes a block of X's channels (rows of dWᵀ) through all
//! the images: the GEMM computes each output element the same way whatever the rows around
//! it, so the blocks change no bit.
//!
//! The same bits as the three nodes: the same columns (bit-identical for finite inputs, see
//! [`super::IM2COL`]), the same GEMM per image, and the sum adding each element's images in
//! order from image 0, as ONNX Runtime's `ReduceSum` and [`super::LEADING_SUM`] do.

/// The weight gradient on onnx-ga's kernel (see the module's comment).
pub const CONV_WEIGHT_GRAD: &str = "ConvWeightGrad";

/// Input slots of [`CONV_WEIGHT_GRAD`].
pub mod conv_weight_grad_slot {
    pub const X: usize = 0;
    pub const DY: usize = 1;
}
