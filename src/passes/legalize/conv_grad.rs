//! `com.microsoft::ConvGrad(dY, X, W) -> (dX, dW, dB)`: the gradients of `Y = Conv(X, W, B)`,
//! with the forward Conv's attributes. Per spatial axis the forward Conv has kernel `k`,
//! stride `s`, dilation `d`, pads `[b, e]`, span `(k-1)d + 1`; `G` groups, `C/G` input and
//! `M/G` output channels per group, `P` output positions.
//!
//! ```text
//! dB = ReduceSum(dY, all axes but 1)
//! dX = ConvTranspose(dY, W; strides s, dilations d, pads [b, e], group G, output_padding r)
//!      r = (H + b + e - span) mod s: the rows of X the forward Conv's last window left unread
//! dW[g] = Σ_n  dY[n, g] · cols(X)[n, g]ᵀ          (ONNX Runtime's kernel: im2col + GEMM)
//!      cols(X) = Conv(X, I; group C, the forward geometry)    [N, C·k·k, P]
//!      (I: C copies of the k·k identity filters, so channel c·kk + i is tap i of channel c)
//!      = Reshape(Transpose(ReduceSum_n(MatMul(cols [N,G,C/G·kk,P], dYᵀ [N,G,P,M/G]))), W's shape)
//!      with a kernel above 1×1, stride 1, G = 1 and C >= 16 (C even): the same on the two
//!      halves of X's channels, dW[:, half] from Slice(X, half), Concat'ed on the cols axis
//! ```
//!
//! The unfolding Conv has exactly the forward Conv's windows, so no remainder or padding
//! arithmetic is needed; a 1×1 kernel without stride or padding skips it. One batched MatMul
//! per image and group, summed over the batch as the kernel does. (Measured on standard ORT
//! 1.31.1, one thread, N=32, 64→64 channels, 32×32, 3×3: 21 ms against 38 ms for the
//! textbook `Conv(Xᵀ, dYᵀ)ᵀ` with stride and dilation swapped, whose GEMMs are 9 wide; the
//! training build's whole ConvGrad takes 34 ms, dX included.)
//!
//! Slicing the channels (issue 14 item 4; `benches/conv_backward.py`, standard ORT 1.31.1,
//! the ResNet-8's geometries, spinning off as the trainer runs, on a 2-core machine another
//! build was loading): each slice's cols is half as large and its MatMul reads it soon after
//! the unfolding wrote it. dW median ratio to the whole form, batch 8/32 at 1 thread:
//! 16→16 3×3 at 32×32 0.88/0.84 (whole 0.74/3.5 ms), 32→32 at 16×16 0.96/0.89, 64→64 at
//! 8×8 0.95/0.83 (at 2 threads 0.87-0.99); four slices won more at 1 thread but lost at 2
//! (up to 1.04), sixteen lose (1.1-1.5). Strided 3×3 (0.93-1.19) and 1×1 (1.2-3.4) gain
//! nothing and stay whole. Each element is the same per-image GEMM row, and the ResNet-8's
//! gradients came out bit-identical. Its whole gradient graph, interleaved sessions: batch
//! 32 0.93-0.96 at 1 thread, 0.88-0.92 at 2; batch 8 0.99 at 1 thread, 0.92-1.01 at 2.
//! Chunking the batch instead measured as well (0.79-0.81 at batch 32 for 16→16) but needs
//! N, which forward models leave symbolic. Every other standard-op dX or dW tried was
//! slower at 1 thread: `benches/README.md`.
//!
//! ONNX Runtime sessions on the CPU run the sum over the images on onnx-ga's `LeadingSum`
//! kernel (`passes::fused_leading_sum`: ONNX Runtime's own `ReduceSum` of that shape is
//! 7-10x slower on two threads than on one), bit for bit the same.
//!
//! Each gradient is computed only when its output is used. `auto_pad` `SAME_*` becomes
//! explicit pads (ONNX Runtime's own ConvGrad ignores `auto_pad` and computes with zero pads,
//! measured: not the gradient of the forward Conv). Static sizes are needed where the
//! lowering depends on them: X's spatial sizes for dX with a stride above 1 and for
//! `auto_pad` `SAME_*`; W's shape for dW (ONNX Runtime's training graphs declare both).

use super::util::dims;
use super::{node_error, Lowering};
use crate::ir::builder::{attr_int, attr_ints};
use crate::ir::emit::Emit;
use crate::ir::{NodeId, ValueId};
use crate::passes::PassError;

pub(super) fn lower(l: &mut Lowering<'_, '_>, node: NodeId) -> Result<(), PassError> {
    let dy = l.input(node, 0)?;
    let x = l.input(node, 1)?;
    let w = l.input(node, 2)?;
    let conv = ConvAttrs::read(l, node, x, w)?;
    let rank = conv.kernel.len() as i64 + 2;
    let batch_and_spatial: Vec<i64> = std::iter::once(0).chain(2..rank).collect();

    if l.used_output(node, 2).is_some() {
        let db = l.reduce("ReduceSum", dy, &batch_and_spatial, false, "dB");
        l.replace(node, 2, db);
    }
    if l.used_output(node, 0).is_some() {
        let dx = conv.grad_input(l, node, dy, w)?;
        l.replace(node, 0, dx);
    }
    if l.used_output(node, 1).is_some() {
        let dw = conv.grad_weight(l, node, dy, x, w)?;
        l.replace(node, 1, dw);
    }
    Ok(())
}

/// dW on this many slices of X's channels (see `ConvAttrs::channel_slices`).
const CHANNEL_SLICES: i64 = 2;
/// The fewest input channels for which dW is sliced.
const SLICE_CHANNELS: i64 = 16;

/// The forward Conv's attributes, resolved: explicit pads, defaults filled in.
struct ConvAttrs {
    kernel: Vec<i64>,
    strides: Vec<i64>,
    dilations: Vec<i64>,
    /// `[b_0, b_1, ..., e_0, e_1, ...]` as ONNX writes them.
    pads: Vec<i64>,
    group: i64,
    /// Spatial sizes of X, where declared.
    spatial: Vec<Option<i64>>,
}

impl ConvAttrs {
    fn read(
        l: &Lowering<'_, '_>,
        node: NodeId,
        x: ValueId,
        w: ValueId,
    ) -> Result<ConvAttrs, PassError> {
        let model = l.model();
        let w_dims = dims(model, w);
        let kernel = match l.ints_attr(node, "kernel_shape")? {
            Some(k) => k,
            None => w_dims
                .as_ref()
                .filter(|d| d.len() > 2)
                .and_then(|d| d[2..].iter().copied().collect::<Option<Vec<i64>>>())
                .ok_or_else(|| {
                    node_error(
                        model,
                        node,
                        "no 'kernel_shape' attribute and W's shape is not declared".into(),
                    )
                })?,
        };
        let nd = kernel.len();
        let per_axis = |name: &str, default: i64, len: usize| -> Result<Vec<i64>, PassError> {
            match l.ints_attr(node, name)? {
                None => Ok(vec![default; len]),
                Some(v) if v.len() == len => Ok(v),
                Some(v) => Err(l.unsupported(node, name, format!("{v:?} for a {nd}-D kernel"))),
            }
        };
        let strides = per_axis("strides", 1, nd)?;
        let dilations = per_axis("dilations", 1, nd)?;
        let group = l.int_attr(node, "group", 1)?;
        if group < 1 {
            return Err(l.unsupported(node, "group", format!("{group}")));
        }
        let spatial: Vec<Option<i64>> = match dims(model, x) {
            Some(d) if d.len() == nd + 2 => d[2..].to_vec(),
            _ => vec![None; nd],
        };
        let auto_pad = l.string_attr(node, "auto_pad")?.unwrap_or_default();
        let pads = match auto_pad.as_str() {
            "" | "NOTSET" => per_axis("pads", 0, 2 * nd)?,
            "VALID" => vec![0; 2 * nd],
            "SAME_UPPER" | "SAME_LOWER" => {
                let mut pads = vec![0; 2 * nd];
                for i in 0..nd {
                    let size = spatial[i].ok_or_else(|| {
                        node_error(
                            model,
                            node,
                            format!(
                                "auto_pad {auto_pad} needs the size of spatial axis {i} of X ('{}'), which the model does not declare",
                                model.name(x)
                            ),
                        )
                    })?;
                    let out = (size + strides[i] - 1) / strides[i];
                    let span = (kernel[i] - 1) * dilations[i] + 1;
                    let total = ((out - 1) * strides[i] + span - size).max(0);
                    let (small, large) = (total / 2, total - total / 2);
                    (pads[i], pads[nd + i]) = if auto_pad == "SAME_UPPER" {
                        (small, large)
                    } else {
                        (large, small)
                    };
                }
                pads
            }
            other => return Err(l.unsupported(node, "auto_pad", format!("'{other}'"))),
        };
        Ok(ConvAttrs {
            kernel,
            strides,
            dilations,
            pads,
            group,
            spatial,
        })
    }

    fn nd(&self) -> usize {
        self.kernel.len()
    }

    /// Per spatial axis: the rows of X after the forward Conv's last window,
    /// `(H + b + e - span) mod s`; zero without striding, `None` where H is unknown.
    fn remainders(&self) -> Vec<Option<i64>> {
        let nd = self.nd();
        (0..nd)
            .map(|i| {
                if self.strides[i] == 1 {
                    return Some(0);
                }
                let span = (self.kernel[i] - 1) * self.dilations[i] + 1;
                self.spatial[i].map(|h| {
                    (h + self.pads[i] + self.pads[nd + i] - span).rem_euclid(self.strides[i])
                })
            })
            .collect()
    }

    /// dX = ConvTranspose(dY, W) with the forward geometry.
    fn grad_input(
        &self,
        l: &mut Lowering<'_, '_>,
        node: NodeId,
        dy: ValueId,
        w: ValueId,
    ) -> Result<ValueId, PassError> {
        let output_padding = self
            .remainders()
            .into_iter()
            .enumerate()
            .map(|(i, r)| {
                r.ok_or_else(|| {
                    node_error(
                        l.model(),
                        node,
                        format!(
                            "dX with stride {} needs the size of spatial axis {i} of X, which the model does not declare",
                            self.strides[i]
                        ),
                    )
                })
            })
            .collect::<Result<Vec<i64>, _>>()?;
        let mut attrs = vec![attr_ints("kernel_shape", &self.kernel)];
        push_unless(&mut attrs, "strides", &self.strides, 1);
        push_unless(&mut attrs, "dilations", &self.dilations, 1);
        push_unless(&mut attrs, "pads", &self.pads, 0);
        push_unless(&mut attrs, "output_padding", &output_padding, 0);
        if self.group != 1 {
            attrs.push(attr_int("group", self.group));
        }
        Ok(l.op("ConvTranspose", &[dy, w], attrs, "dX"))
    }

    /// dW = Σ_n dY[n] · cols(X)[n]ᵀ per group.
    fn grad_weight(
        &self,
        l: &mut Lowering<'_, '_>,
        node: NodeId,
        dy: ValueId,
        x: ValueId,
        w: ValueId,
    ) -> Result<ValueId, PassError> {
        let model = l.model();
        let w_dims = dims(model, w)
            .filter(|d| d.len() == self.nd() + 2)
            .and_then(|d| d.into_iter().collect::<Option<Vec<i64>>>())
            .ok_or_else(|| {
                node_error(
                    model,
                    node,
                    format!(
                        "dW needs the shape of W ('{}'), which the model does not declare",
                        model.name(w)
                    ),
                )
            })?;
        if l.float_type(node, x)? != super::util::FLOAT {
            return Err(node_error(
                l.model(),
                node,
                "dW is lowered for float32 only (as ONNX Runtime's CPU kernel)".into(),
            ));
        }
        let (m, per_group) = (w_dims[0], w_dims[1]);
        let channels = per_group * self.group;
        let summed = match self.channel_slices(channels) {
            None => {
                let filters = self.unfold_filters(l, channels);
                self.dw_images(l, x, dy, filters, m, channels)
            }
            Some(slices) => {
                let per_slice = channels / slices;
                let filters = self.unfold_filters(l, per_slice);
                let axis = l.int64s("channel_axis", &[1]);
                let mut parts = Vec::new();
                for i in 0..slices {
                    let starts = l.int64s("slice_start", &[i * per_slice]);
                    let ends = l.int64s("slice_end", &[(i + 1) * per_slice]);
                    let xs = l.op("Slice", &[x, starts, ends, axis], vec![], "X_channels");
                    parts.push(self.dw_images(l, xs, dy, filters, m, per_slice));
                }
                l.op("Concat", &parts, vec![attr_int("axis", 1)], "dW_t")
            }
        };
        let dw_t = l.op(
            "Transpose",
            &[summed],
            vec![attr_ints("perm", &[0, 2, 1])],
            "dW_t",
        );
        let w_shape = l.int64s("W_shape", &w_dims);
        Ok(l.op("Reshape", &[dw_t, w_shape], vec![], "dW"))
    }

    /// How many slices of X's channels dW is computed on, `None` for one: a kernel larger
    /// than 1×1 without stride, one group, at least `SLICE_CHANNELS` input channels divisible
    /// by `CHANNEL_SLICES` (measured, the header).
    fn channel_slices(&self, channels: i64) -> Option<i64> {
        let sliced = self.group == 1
            && self.kernel.iter().any(|k| *k > 1)
            && self.strides.iter().all(|s| *s == 1)
            && channels >= SLICE_CHANNELS
            && channels % CHANNEL_SLICES == 0;
        sliced.then_some(CHANNEL_SLICES)
    }

    /// `Σ_n cols(X)[n, g] · dY[n, g]ᵀ` over the images of `x` and `dy`: `[G, C/G·kk, M/G]`.
    fn dw_images(
        &self,
        l: &mut Lowering<'_, '_>,
        x: ValueId,
        dy: ValueId,
        filters: Option<ValueId>,
        m: i64,
        channels: i64,
    ) -> ValueId {
        let g = self.group;
        let rows = channels / g * self.kernel.iter().product::<i64>();
        let cols = match filters {
            Some(f) => self.unfold(l, x, f, channels),
            None => x,
        };
        let cols_shape = l.int64s("cols_shape", &[0, g, rows, -1]);
        let cols = l.op("Reshape", &[cols, cols_shape], vec![], "cols");
        let dy_shape = l.int64s("dY_shape", &[0, g, m / g, -1]);
        let dy_groups = l.op("Reshape", &[dy, dy_shape], vec![], "dY_groups");
        let dy_t = l.op(
            "Transpose",
            &[dy_groups],
            vec![attr_ints("perm", &[0, 1, 3, 2])],
            "dY_t",
        );
        let per_image = l.op("MatMul", &[cols, dy_t], vec![], "dW_per_image");
        l.reduce("ReduceSum", per_image, &[0], false, "dW_t")
    }

    /// The identity filters of [`Self::unfold`], `None` where X is its own unfolding (a 1×1
    /// kernel without stride or padding).
    fn unfold_filters(&self, l: &mut Lowering<'_, '_>, channels: i64) -> Option<ValueId> {
        let nd = self.nd();
        if self.kernel.iter().all(|k| *k == 1)
            && self.strides.iter().all(|s| *s == 1)
            && self.pads.iter().all(|p| *p == 0)
        {
            return None;
        }
        let taps: i64 = self.kernel.iter().product();
        let mut identity = vec![0f32; (taps * taps) as usize];
        for i in 0..taps as usize {
            identity[i * taps as usize + i] = 1.0;
        }
        let filter_dims: Vec<i64> = [taps, 1]
            .into_iter()
            .chain(self.kernel.iter().copied())
            .collect();
        let mut filters = l.constant(
            "identity_taps",
            crate::ir::builder::tensor_f32(&filter_dims, &identity),
        );
        if channels > 1 {
            let repeats: Vec<i64> = std::iter::once(channels)
                .chain(std::iter::repeat_n(1, nd + 1))
                .collect();
            let repeats = l.int64s("repeats", &repeats);
            filters = l.op("Tile", &[filters, repeats], vec![], "identity_taps");
        }
        Some(filters)
    }

    /// cols(X) `[N, C·kk, *P]`: channel `c·kk + i` holds tap `i` of channel `c` at every
    /// output position, by a Conv with the forward geometry and the identity `filters`
    /// ([`Self::unfold_filters`], C·kk of them).
    fn unfold(
        &self,
        l: &mut Lowering<'_, '_>,
        x: ValueId,
        filters: ValueId,
        channels: i64,
    ) -> ValueId {
        let mut attrs = vec![
            attr_int("group", channels),
            attr_ints("kernel_shape", &self.kernel),
        ];
        push_unless(&mut attrs, "strides", &self.strides, 1);
        push_unless(&mut attrs, "dilations", &self.dilations, 1);
        push_unless(&mut attrs, "pads", &self.pads, 0);
        l.op("Conv", &[x, filters], attrs, "cols")
    }
}

/// Adds `name = values` unless every value is the ONNX default.
fn push_unless(
    attrs: &mut Vec<crate::proto::AttributeProto>,
    name: &str,
    values: &[i64],
    default: i64,
) {
    if values.iter().any(|v| *v != default) {
        attrs.push(attr_ints(name, values));
    }
}
