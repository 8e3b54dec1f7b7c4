#!/usr/bin/env python3
"""Convolution backward (issue 14 item 4): standard-op formulations of dX, dW and dB, timed
on standard ONNX Runtime (CPU) at the ResNet-8's convolution geometries.

Each formulation is a small ONNX graph (onnx.helper) computing one gradient from dY, X and W
the way a lowering would write it, W-side rearrangements included (W is a parameter: they
run every step). Sessions run interleaved (one run of each per round, the order shuffled per
round), and the table gives medians. `current` is the whole-batch form that
src/passes/legalize/conv_grad.rs emitted before issue 14 item 4 (since then it emits
`2 channel slices` for dW of a kernel above 1x1, stride 1, one group, an even C >= 16:
benches/README.md, "Convolution backward"); it runs twice (`current` and `current'`, two sessions of the same graph), and
their difference is the run-to-run noise a win must clear. Every formulation is checked
against `current` (max |a-b| / max |b|, float32).

    .venv-ort/bin/python benches/conv_backward.py [--rounds 60] [--threads 1,2] [--batch 8,32]

Prints a markdown table: per geometry, batch and thread count, each formulation's median ms
and its ratio to `current`.
"""

import argparse
import random
import sys
import time

import numpy as np
import onnx
import onnxruntime as ort
from onnx import TensorProto, helper, numpy_helper

OPSET = 18  # Col2Im
INT_MAX = 2**62

# The ResNet-8 (target/bench-realistic/models/resnet/forward.onnx): (name, C, M, k, stride,
# pad, H, dX needed, how many times the step has it).
GEOMETRIES = [
    ("stem 3->16 3x3 s1 @32", 3, 16, 3, 1, 1, 32, False, 1),
    ("l1 16->16 3x3 s1 @32", 16, 16, 3, 1, 1, 32, True, 2),
    ("l2a 16->32 3x3 s2 @32", 16, 32, 3, 2, 1, 32, True, 1),
    ("l2sc 16->32 1x1 s2 @32", 16, 32, 1, 2, 0, 32, True, 1),
    ("l2b 32->32 3x3 s1 @16", 32, 32, 3, 1, 1, 16, True, 1),
    ("l3a 32->64 3x3 s2 @16", 32, 64, 3, 2, 1, 16, True, 1),
    ("l3sc 32->64 1x1 s2 @16", 32, 64, 1, 2, 0, 16, True, 1),
    ("l3b 64->64 3x3 s1 @8", 64, 64, 3, 1, 1, 8, True, 1),
]


class G:
    """A graph under construction: nodes, constants, fresh names."""

    def __init__(self):
        self.nodes, self.inits, self.n = [], [], 0

    def name(self, hint):
        self.n += 1
        return f"{hint}_{self.n}"

    def op(self, op, inputs, hint="t", **attrs):
        out = self.name(hint)
        self.nodes.append(helper.make_node(op, inputs, [out], **attrs))
        return out

    def const(self, array, hint="c"):
        name = self.name(hint)
        self.inits.append(numpy_helper.from_array(np.asarray(array), name))
        return name

    def i64(self, values, hint="shape"):
        return self.const(np.array(values, dtype=np.int64), hint)

    def model(self, inputs, output):
        graph = helper.make_graph(
            self.nodes,
            "g",
            [helper.make_tensor_value_info(n, TensorProto.FLOAT, s) for n, s in inputs],
            [helper.make_tensor_value_info(output, TensorProto.FLOAT, None)],
            initializer=self.inits,
        )
        m = helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)])
        m.ir_version = 8
        return m


def geometry(c, m, k, s, p, h):
    ho = (h + 2 * p - k) // s + 1
    r = (h + 2 * p - k) % s
    return ho, r


# ---------------------------------------------------------------- dX


def dx_convtranspose(g, dy, w, c, m, k, s, p, h):
    """Current: ConvTranspose(dY, W) with the forward geometry and output_padding."""
    _, r = geometry(c, m, k, s, p, h)
    attrs = dict(kernel_shape=[k, k], strides=[s, s], pads=[p] * 4)
    if r:
        attrs["output_padding"] = [r, r]
    return g.op("ConvTranspose", [dy, w], "dX", **attrs)


def flipped(g, w):
    """W [M, C, k, k] -> [C, M, k, k] rotated by 180 degrees: dX's correlation filter."""
    wt = g.op("Transpose", [w], perm=[1, 0, 2, 3])
    return g.op(
        "Slice",
        [wt, g.i64([-1, -1]), g.i64([-INT_MAX, -INT_MAX]), g.i64([2, 3]), g.i64([-1, -1])],
    )


def zero_insert(g, dy, n, ch, ho, s):
    """[N, ch, ho, ho] -> [N, ch, s*ho, s*ho], dY[o] at row s*o, zeros between and after."""
    t = g.op("Reshape", [dy, g.i64([n, ch, ho, 1, ho, 1])])
    t = g.op("Pad", [t, g.i64([0, 0, 0, 0, 0, 0, 0, 0, 0, s - 1, 0, s - 1])])
    return g.op("Reshape", [t, g.i64([n, ch, ho * s, ho * s])])


def dx_conv_flip(g, dy, w, c, m, k, s, p, h, n):
    """Conv(dY zero-inserted by the stride, W flipped and channel-swapped), full padding."""
    ho, _ = geometry(c, m, k, s, p, h)
    z = dy if s == 1 else zero_insert(g, dy, n, m, ho, s)
    pb = k - 1 - p
    pe = h + p - s * ho
    assert pb >= 0 and pe >= 0, (pb, pe)
    return g.op("Conv", [z, flipped(g, w)], "dX", kernel_shape=[k, k], pads=[pb, pb, pe, pe])


def phase_taps(k, s, p):
    """Per axis: for output phase a (rows s*q + a), the (offset of the dY row from q, tap)
    pairs: dX[s*q + a] = sum over them of dY[q + offset] * W[tap]."""
    phases = []
    for a in range(s):
        phases.append([((a + p - t) // s, t) for t in range(k) if (a + p - t) % s == 0])
    return phases


def dx_polyphase(g, dy, w, c, m, k, s, p, h, n):
    """One Conv of dY to C*s*s channels (each output phase's sub-filter, zero-padded to a
    common window), then DepthToSpace: no multiplications by inserted zeros."""
    ho, _ = geometry(c, m, k, s, p, h)
    phases = phase_taps(k, s, p)
    offs = [o for ph in phases for o, _ in ph]
    lo, hi = min(offs), max(offs)
    L = hi - lo + 1
    assert s * ho == h and lo <= 0 and hi >= 0
    # index into W^T [C, M, k*k + 1] (the last entry a zero) for [s*s phases, L*L window]
    zero = k * k
    idx = np.full((s, s, L, L), zero, dtype=np.int64)
    for ah in range(s):
        for aw in range(s):
            for oh, th in phases[ah]:
                for ow, tw in phases[aw]:
                    idx[ah, aw, oh - lo, ow - lo] = th * k + tw
    wt = g.op("Transpose", [w], perm=[1, 0, 2, 3])
    wt = g.op("Reshape", [wt, g.i64([c, m, k * k])])
    wt = g.op("Pad", [wt, g.i64([0, 0, 0, 0, 0, 1])])
    wp = g.op("Gather", [wt, g.i64(idx.reshape(s * s, L * L))], axis=2)  # [C, M, ss, LL]
    wp = g.op("Transpose", [wp], perm=[0, 2, 1, 3])
    wp = g.op("Reshape", [wp, g.i64([c * s * s, m, L, L])])
    y = g.op("Conv", [dy, wp], kernel_shape=[L, L], pads=[-lo, -lo, hi, hi])
    return g.op("DepthToSpace", [y], "dX", blocksize=s, mode="CRD")


def dx_1x1_matmul_insert(g, dy, w, c, m, k, s, p, h, n):
    """1x1, no pads: W^T applied per position (Conv 1x1 at dY's size), then zero-insertion."""
    ho, _ = geometry(c, m, k, s, p, h)
    wt = g.op("Transpose", [w], perm=[1, 0, 2, 3])
    y = g.op("Conv", [dy, wt], kernel_shape=[1, 1])
    return zero_insert(g, y, n, c, ho, s) if s * ho == h else None


def dx_1x1_matmul_insert_mm(g, dy, w, c, m, k, s, p, h, n):
    """1x1, no pads: MatMul(W^T [C, M], dY [N, M, P]), then zero-insertion."""
    ho, _ = geometry(c, m, k, s, p, h)
    w2 = g.op("Reshape", [w, g.i64([m, c])])
    w2 = g.op("Transpose", [w2], perm=[1, 0])
    d = g.op("Reshape", [dy, g.i64([n, m, ho * ho])])
    y = g.op("MatMul", [w2, d])
    y = g.op("Reshape", [y, g.i64([n, c, ho, ho])])
    return zero_insert(g, y, n, c, ho, s)


def dx_col2im(g, dy, w, c, m, k, s, p, h, n):
    """ConvTranspose's own algorithm in two standard ops: one batched MatMul
    W^T [Ckk, M] x dY [N, M, P], then Col2Im (opset 18) adds the taps back into the image."""
    w2 = g.op("Reshape", [w, g.i64([m, c * k * k])])
    w2 = g.op("Transpose", [w2], perm=[1, 0])
    d = g.op("Reshape", [dy, g.i64([0, m, -1])])
    cols = g.op("MatMul", [w2, d])
    return g.op("Col2Im", [cols, g.i64([h, h]), g.i64([k, k])], "dX",
                strides=[s, s], pads=[p] * 4)


# ---------------------------------------------------------------- dW


def identity_unfold(g, x, c, k, s, p):
    """cols(X) [N, C*k*k, Ho, Wo] by a grouped Conv with identity taps (as conv_grad.rs)."""
    if k == 1 and s == 1 and p == 0:
        return x
    taps = k * k
    ident = np.eye(taps, dtype=np.float32).reshape(taps, 1, k, k)
    f = g.const(np.tile(ident, (c, 1, 1, 1)), "identity_taps")
    attrs = dict(group=c, kernel_shape=[k, k])
    if s != 1:
        attrs["strides"] = [s, s]
    if p:
        attrs["pads"] = [p] * 4
    return g.op("Conv", [x, f], "cols", **attrs)


def dw_im2col(g, x, dy, c, m, k, s, p, h, n, unfold=identity_unfold):
    """Current: MatMul(cols [N, Ckk, P], dY^T [N, P, M]), ReduceSum over N, Transpose."""
    cols = unfold(g, x, c, k, s, p)
    cols = g.op("Reshape", [cols, g.i64([0, 1, c * k * k, -1])])
    d = g.op("Reshape", [dy, g.i64([0, 1, m, -1])])
    dt = g.op("Transpose", [d], perm=[0, 1, 3, 2])
    mm = g.op("MatMul", [cols, dt])
    sm = g.op("ReduceSum", [mm, g.i64([0])], keepdims=0)
    t = g.op("Transpose", [sm], perm=[0, 2, 1])
    return g.op("Reshape", [t, g.i64([m, c, k, k])], "dW")


def dw_im2col_mt(g, x, dy, c, m, k, s, p, h, n, unfold=identity_unfold):
    """MatMul(dY [N, M, P], cols^T [N, P, Ckk]): the sum is already in W's layout."""
    cols = unfold(g, x, c, k, s, p)
    cols = g.op("Reshape", [cols, g.i64([0, c * k * k, -1])])
    ct = g.op("Transpose", [cols], perm=[0, 2, 1])
    d = g.op("Reshape", [dy, g.i64([0, m, -1])])
    mm = g.op("MatMul", [d, ct])
    sm = g.op("ReduceSum", [mm, g.i64([0])], keepdims=0)
    return g.op("Reshape", [sm, g.i64([m, c, k, k])], "dW")


def dw_one_gemm(g, x, dy, c, m, k, s, p, h, n, unfold=identity_unfold):
    """One GEMM over the batch: cols as [Ckk, N*P] and dY as [M, N*P] (both transposed)."""
    cols = unfold(g, x, c, k, s, p)
    cols = g.op("Reshape", [cols, g.i64([0, c * k * k, -1])])
    ct = g.op("Transpose", [cols], perm=[1, 0, 2])
    ct = g.op("Reshape", [ct, g.i64([c * k * k, -1])])
    d = g.op("Reshape", [dy, g.i64([0, m, -1])])
    dt = g.op("Transpose", [d], perm=[1, 0, 2])
    dt = g.op("Reshape", [dt, g.i64([m, -1])])
    mm = g.op("Gemm", [dt, ct], transB=1)
    return g.op("Reshape", [mm, g.i64([m, c, k, k])], "dW")


def dw_einsum(g, x, dy, c, m, k, s, p, h, n, unfold=identity_unfold):
    """Einsum('nkp,nmp->mk') over cols and dY."""
    cols = unfold(g, x, c, k, s, p)
    cols = g.op("Reshape", [cols, g.i64([0, c * k * k, -1])])
    d = g.op("Reshape", [dy, g.i64([0, m, -1])])
    e = g.op("Einsum", [cols, d], equation="nkp,nmp->mk")
    return g.op("Reshape", [e, g.i64([m, c, k, k])], "dW")


def slice_unfold(g, x, c, k, s, p):
    """1x1, no pads: cols(X) is X sampled every s rows and columns, a strided Slice."""
    assert k == 1 and p == 0
    if s == 1:
        return x
    return g.op(
        "Slice", [x, g.i64([0, 0]), g.i64([INT_MAX, INT_MAX]), g.i64([2, 3]), g.i64([s, s])]
    )


def shift_unfold_exact(g, x, c, k, s, p, h):
    """cols(X) by copies: Pad once, one strided Slice per tap (ending at its last window),
    stacked on a new axis 2 ([N, C, kk, Ho, Wo]: channel c*kk + i is tap i of channel c,
    as the identity Conv's)."""
    if k == 1 and s == 1 and p == 0:
        return x
    ho = (h + 2 * p - k) // s + 1
    xp = g.op("Pad", [x, g.i64([0, 0, p, p, 0, 0, p, p])]) if p else x
    taps = []
    for i in range(k):
        for j in range(k):
            t = g.op("Slice", [xp, g.i64([i, j]), g.i64([i + s * (ho - 1) + 1, j + s * (ho - 1) + 1]),
                               g.i64([2, 3]), g.i64([s, s])])
            taps.append(g.op("Unsqueeze", [t, g.i64([2])]))
    return g.op("Concat", taps, axis=2)


def dw_chunked(g, x, dy, c, m, k, s, p, h, n, chunk):
    """The current form on chunks of `chunk` images (Split on N, Sum): each chunk's cols
    is read by its MatMul while still in cache. Needs N, which forward models leave
    symbolic: measured, not usable by the lowering."""
    if n <= chunk:
        return None
    parts = n // chunk
    xs = [g.name("xs") for _ in range(parts)]
    ds = [g.name("ds") for _ in range(parts)]
    g.nodes.append(helper.make_node("Split", [x], xs, axis=0, num_outputs=parts))
    g.nodes.append(helper.make_node("Split", [dy], ds, axis=0, num_outputs=parts))
    outs = [dw_im2col(g, xi, di, c, m, k, s, p, h, chunk) for xi, di in zip(xs, ds)]
    return g.op("Sum", outs, "dW")


def dw_channel_chunks(g, x, dy, c, m, k, s, p, h, n, parts):
    """The current form on `parts` slices of X's channels (static, whatever the batch; the
    lowering's choice with parts = 2 where it wins):
    each slice's cols [N, C/parts*kk, P] is read by its MatMul while still in cache; the
    slices' [C/parts*kk, M] results are concatenated."""
    if c % parts or parts == 1:
        return None
    cc = c // parts
    outs = []
    for i in range(parts):
        xi = g.op("Slice", [x, g.i64([i * cc]), g.i64([(i + 1) * cc]), g.i64([1])])
        cols = identity_unfold(g, xi, cc, k, s, p)
        cols = g.op("Reshape", [cols, g.i64([0, cc * k * k, -1])])
        d = g.op("Reshape", [dy, g.i64([0, m, -1])])
        dt = g.op("Transpose", [d], perm=[0, 2, 1])
        mm = g.op("MatMul", [cols, dt])
        outs.append(g.op("ReduceSum", [mm, g.i64([0])], keepdims=0))
    cat = g.op("Concat", outs, axis=0)  # [C*kk, M]
    t = g.op("Transpose", [cat], perm=[1, 0])
    return g.op("Reshape", [t, g.i64([m, c, k, k])], "dW")


def dw_swapped(g, x, dy, c, m, k, s, p, h, n):
    """Conv(X^T [C, N, H, W], dY^T [M, N, Ho, Wo]; strides 1, dilations s), cropped to k."""
    ho, _ = geometry(c, m, k, s, p, h)
    xt = g.op("Transpose", [x], perm=[1, 0, 2, 3])
    dt = g.op("Transpose", [dy], perm=[1, 0, 2, 3])
    attrs = dict(kernel_shape=[ho, ho], pads=[p] * 4)
    if s != 1:
        attrs["dilations"] = [s, s]
    y = g.op("Conv", [xt, dt], **attrs)  # [C, M, k + r, k + r]
    if h + 2 * p - (ho - 1) * s != k:
        y = g.op("Slice", [y, g.i64([0, 0]), g.i64([k, k]), g.i64([2, 3])])
    return g.op("Transpose", [y], "dW", perm=[1, 0, 2, 3])


# ---------------------------------------------------------------- dB


def db_reduce(g, dy, m, n):
    """Current: ReduceSum(dY, [0, 2, 3])."""
    return g.op("ReduceSum", [dy, g.i64([0, 2, 3])], "dB", keepdims=0)


def db_two_step(g, dy, m, n):
    """ReduceSum over the spatial axes, then over the batch."""
    t = g.op("ReduceSum", [dy, g.i64([2, 3])], keepdims=0)
    return g.op("ReduceSum", [t, g.i64([0])], "dB", keepdims=0)


def db_flat(g, dy, m, n):
    """Reshape to [N, M, P], ReduceSum over [0, 2]."""
    t = g.op("Reshape", [dy, g.i64([0, m, -1])])
    return g.op("ReduceSum", [t, g.i64([0, 2])], "dB", keepdims=0)


# ---------------------------------------------------------------- harness


def cases(c, m, k, s, p, h, n, need_dx):
    """(gradient, formulation, model, feeds) for one geometry and batch."""
    ho, _ = geometry(c, m, k, s, p, h)
    rng = np.random.default_rng(1000 * c + 10 * m + k + s + h + n)
    x = rng.standard_normal((n, c, h, h), dtype=np.float32)
    w = rng.standard_normal((m, c, k, k), dtype=np.float32)
    dy = rng.standard_normal((n, m, ho, ho), dtype=np.float32)
    out = []

    def add(grad, label, build, inputs):
        g = G()
        res = build(g)
        if res is None:
            return
        feeds = {"dY": dy, "X": x, "W": w}
        shapes = {"dY": dy.shape, "X": x.shape, "W": w.shape}
        model = g.model([(i, list(shapes[i])) for i in inputs], res)
        # ORT checks the graph when it builds the session (the output's shape is left open).
        out.append((grad, label, model, {i: feeds[i] for i in inputs}))

    if need_dx:
        ct = lambda g: dx_convtranspose(g, "dY", "W", c, m, k, s, p, h)
        add("dX", "current", ct, ["dY", "W"])
        add("dX", "current'", ct, ["dY", "W"])
        if k > 1:
            add("dX", "conv flip" + (" zero-ins" if s > 1 else ""),
                lambda g: dx_conv_flip(g, "dY", "W", c, m, k, s, p, h, n), ["dY", "W"])
        add("dX", "MatMul+Col2Im",
            lambda g: dx_col2im(g, "dY", "W", c, m, k, s, p, h, n), ["dY", "W"])
        if s > 1 and k > 1:
            add("dX", "polyphase+D2S",
                lambda g: dx_polyphase(g, "dY", "W", c, m, k, s, p, h, n), ["dY", "W"])
        if k == 1 and p == 0 and s > 1:
            add("dX", "1x1 conv+zero-ins",
                lambda g: dx_1x1_matmul_insert(g, "dY", "W", c, m, k, s, p, h, n), ["dY", "W"])
            add("dX", "MatMul+zero-ins",
                lambda g: dx_1x1_matmul_insert_mm(g, "dY", "W", c, m, k, s, p, h, n), ["dY", "W"])

    im = lambda g: dw_im2col(g, "X", "dY", c, m, k, s, p, h, n)
    add("dW", "current", im, ["X", "dY"])
    add("dW", "current'", im, ["X", "dY"])
    add("dW", "swapped Conv", lambda g: dw_swapped(g, "X", "dY", c, m, k, s, p, h, n), ["X", "dY"])
    add("dW", "MatMul(dY,colsT)", lambda g: dw_im2col_mt(g, "X", "dY", c, m, k, s, p, h, n), ["X", "dY"])
    add("dW", "one Gemm", lambda g: dw_one_gemm(g, "X", "dY", c, m, k, s, p, h, n), ["X", "dY"])
    add("dW", "Einsum", lambda g: dw_einsum(g, "X", "dY", c, m, k, s, p, h, n), ["X", "dY"])
    ho = (h + 2 * p - k) // s + 1
    add("dW", "Pad+Slice unfold",
        lambda g: dw_im2col(g, "X", "dY", c, m, k, s, p, h, n,
                            unfold=lambda g, x, c, k, s, p: shift_unfold_exact(g, x, c, k, s, p, h)),
        ["X", "dY"])
    for parts in (2, 4, 8, 16):
        add("dW", f"{parts} channel slices",
            lambda g: dw_channel_chunks(g, "X", "dY", c, m, k, s, p, h, n, parts), ["X", "dY"])
    for chunk in (1, 2, 4, 8):
        add("dW", f"chunks of {chunk}",
            lambda g: dw_chunked(g, "X", "dY", c, m, k, s, p, h, n, chunk), ["X", "dY"])
    if k == 1 and p == 0:
        add("dW", "Slice unfold",
            lambda g: dw_im2col(g, "X", "dY", c, m, k, s, p, h, n, unfold=slice_unfold), ["X", "dY"])
        add("dW", "Slice+MatMul(dY,colsT)",
            lambda g: dw_im2col_mt(g, "X", "dY", c, m, k, s, p, h, n, unfold=slice_unfold), ["X", "dY"])

    add("dB", "current", lambda g: db_reduce(g, "dY", m, n), ["dY"])
    add("dB", "current'", lambda g: db_reduce(g, "dY", m, n), ["dY"])
    add("dB", "two ReduceSums", lambda g: db_two_step(g, "dY", m, n), ["dY"])
    add("dB", "flat ReduceSum", lambda g: db_flat(g, "dY", m, n), ["dY"])
    return out


def session(model, threads, spin=False):
    so = ort.SessionOptions()
    so.intra_op_num_threads = threads
    so.inter_op_num_threads = 1
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    # As the trainer's sessions: spinning off (src/engine/ort.rs, SessionOptions::spin);
    # --spin for ONNX Runtime's default.
    so.add_session_config_entry("session.intra_op.allow_spinning", "1" if spin else "0")
    return ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])


def rel_diff(a, b):
    return float(np.max(np.abs(a - b)) / max(np.max(np.abs(b)), 1e-30))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=60)
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--batch", default="8,32")
    ap.add_argument("--spin", action="store_true", help="let intra-op threads spin")
    ap.add_argument("--only", default="", help="substring of a geometry name")
    args = ap.parse_args()
    threads = [int(t) for t in args.threads.split(",")]
    batches = [int(b) for b in args.batch.split(",")]
    print(f"onnxruntime {ort.__version__}, onnx {onnx.__version__}, {args.rounds} interleaved rounds, "
          "median ms; ratio = median / current's median; noise = |current' / current - 1|\n")
    print("| geometry | B | T | grad | formulation | ms | ratio | rel diff |")
    print("|---|---|---|---|---|---|---|---|")
    worst = 0.0
    for name, c, m, k, s, p, h, need_dx, _ in GEOMETRIES:
        if args.only and args.only not in name:
            continue
        for n in batches:
            cs = cases(c, m, k, s, p, h, n, need_dx)
            for t in threads:
                sess = [session(model, t, args.spin) for _, _, model, _ in cs]
                outs = [se.run(None, f)[0] for se, (_, _, _, f) in zip(sess, cs)]
                ref = {}
                for (grad, label, _, _), o in zip(cs, outs):
                    if label == "current":
                        ref[grad] = o
                diffs = [rel_diff(o, ref[grad]) for (grad, _, _, _), o in zip(cs, outs)]
                worst = max(worst, max(diffs))
                for se, (_, _, _, f) in zip(sess, cs):  # warm up
                    for _ in range(3):
                        se.run(None, f)
                times = [[] for _ in cs]
                order = list(range(len(cs)))
                rnd = random.Random(n * 10 + t)
                for _ in range(args.rounds):
                    rnd.shuffle(order)
                    for i in order:
                        t0 = time.perf_counter()
                        sess[i].run(None, cs[i][3])
                        times[i].append(time.perf_counter() - t0)
                med = [float(np.median(x)) * 1e3 for x in times]
                base = {}
                for (grad, label, _, _), mm in zip(cs, med):
                    if label == "current":
                        base[grad] = mm
                for (grad, label, _, _), mm, d in zip(cs, med, diffs):
                    print(f"| {name} | {n} | {t} | {grad} | {label} | {mm:.3f} | "
                          f"{mm / base[grad]:.2f} | {d:.1e} |")
                sys.stdout.flush()
    print(f"\nworst relative difference against current: {worst:.1e}")
    if worst > 1e-4:
        print("MISMATCH: a formulation disagrees with the current one", file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    main()
