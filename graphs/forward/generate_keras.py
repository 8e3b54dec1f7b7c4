"""Forward ONNX models exported from real Keras models with tf2onnx, and Keras reference runs.

Writes, per model NAME (keras_mlp, keras_cnn):

  graphs/forward/NAME/keras.onnx     tf2onnx.convert.from_keras with the zero biases kept (below)
  graphs/forward/NAME/default.onnx   plain tf2onnx.convert.from_keras: the biases are gone (the
                                     trap, kept as an exhibit; measured in meta.json)
  graphs/forward/NAME/data.npz       64 samples: `x` (float32, NHWC for the CNN) and `labels`
  fixtures/forward/NAME/...          Keras references keyed by ONNX initializer name, in the ONNX
                                     layout; meta.json describes them

Run through graphs/forward/regen_keras.sh (creates .venv-keras from requirements-keras.txt).
  generate_keras.py                 both models
  generate_keras.py keras_cnn       only the named models
Everything is seeded and single-threaded, each model in its own process (tf2onnx's generated
names count across exports); all written files are byte-identical from run to run but
keras_bn's default.onnx, whose two equal ReLU6 bounds tf2onnx's merge_duplication merges,
keeping one or the other.

Keeping the biases. Keras initialises biases to zero. tf2onnx freezes the Keras function and
runs TF grappler over it with the `constfold` optimizer, which rewrites `BiasAdd(x, zeros)` to
`x`: the exported model has no bias parameters (it still equals Keras's forward at init, so
nothing looks wrong). With grappler's constfold off, the biases survive grappler, but then
tf2onnx's own ONNX optimizer `merge_duplication` merges equal constants: two zero biases of
the same shape become ONE initializer shared by both layers (a tied parameter: a different
model to train). tf2onnx has no option for the first, so `export_kept` replaces
`tf2onnx.tf_loader.tf_optimize_grappler` by the same function without `constfold`, and passes
`optimizers=` (tf2onnx's list without `merge_duplication`) for the second. Both effects are
measured on every run and recorded in meta.json (`export`).
"""

from __future__ import annotations

import collections
import io
import json
import os
import platform
import sys
import zipfile

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
os.environ.setdefault("TF_DETERMINISTIC_OPS", "1")

import numpy as np  # noqa: E402
import onnx  # noqa: E402
import tensorflow as tf  # noqa: E402
import tf2onnx  # noqa: E402
import tf2onnx.optimizer  # noqa: E402
import tf2onnx.tf_loader  # noqa: E402
from onnx import numpy_helper  # noqa: E402

tf.config.threading.set_intra_op_parallelism_threads(1)
tf.config.threading.set_inter_op_parallelism_threads(1)
tf.config.experimental.enable_op_determinism()
tf2onnx.logging.set_level(tf2onnx.logging.ERROR)

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
GRAPHS = os.path.join(ROOT, "graphs", "forward")
FIXTURES = os.path.join(ROOT, "fixtures", "forward")

N_SAMPLES = 64
GRAD_SAMPLES = 8
STEPS = 8
BATCH = 32  # the full batch; onnx-ga's tests take K = 4 micro-batches of 8
OPSET = 17
SGD = dict(learning_rate=0.1)
ADAM = dict(learning_rate=1e-2, beta_1=0.9, beta_2=0.999, epsilon=1e-7, amsgrad=False)

# A Conv2D kernel is HWIO in Keras and OIHW in ONNX (tf2onnx transposes the constant).
HWIO_TO_OIHW = (3, 2, 0, 1)
# A DepthwiseConv2D kernel [H, W, C, M] is a group convolution's [C*M, 1, H, W] in ONNX.
DEPTHWISE = "depthwise"


# A GRU's bias [2, 3H] (input and recurrent halves), which tf2onnx unstacks into one
# initializer [1, 3H] per row: layout (ROW, i).
ROW = "row"

# An LSTM's kernels [in, 4H] (gates i f c o) are ONNX's W, R [1, 4H, in] (gates i o f c);
# its one bias [4H] is the first half of ONNX's B [1, 8H], the recurrent half zeros.
LSTM_KERNEL, LSTM_BIAS = "lstm kernel", "lstm bias"
KERAS_TO_ONNX_GATES = (0, 3, 1, 2)


def _onnx_gates(value):
    blocks = np.split(value, 4, axis=-1)
    return np.concatenate([blocks[g] for g in KERAS_TO_ONNX_GATES], axis=-1)


def to_onnx(value, perm):
    """A Keras variable's value (or gradient) in the layout of its ONNX initializer."""
    if isinstance(perm, tuple) and perm[0] == ROW:
        return value[perm[1]][np.newaxis]
    if perm == LSTM_KERNEL:
        return _onnx_gates(value).T[np.newaxis]
    if perm == LSTM_BIAS:
        return np.concatenate([_onnx_gates(value), np.zeros_like(value)])[np.newaxis]
    if perm == DEPTHWISE:
        h, w, c, m = value.shape
        return np.transpose(value, (2, 3, 0, 1)).reshape(c * m, 1, h, w)
    return np.transpose(value, perm) if perm else value


LAYOUTS = {None: "same", HWIO_TO_OIHW: "HWIO -> OIHW, np.transpose(k, (3, 2, 0, 1))",
           LSTM_KERNEL: "[in, 4H] gates i f c o -> [1, 4H, in] gates i o f c",
           LSTM_BIAS: "[4H] gates i f c o -> [1, 8H]: gates i o f c, then 4H zeros",
           DEPTHWISE: "HWCM -> (C*M)1HW, np.transpose(k, (2, 3, 0, 1)).reshape(C*M, 1, H, W)"}


# ---------------------------------------------------------------------------------------------
# Models and data


def make_mlp(dtype="float32", bias=lambda: "zeros"):
    L = tf.keras.layers
    return tf.keras.Sequential(
        [
            tf.keras.Input((16,), name="x", dtype=dtype),
            L.Dense(32, activation="relu", name="fc1", dtype=dtype, bias_initializer=bias()),
            L.Dense(10, name="logits", dtype=dtype, bias_initializer=bias()),
        ],
        name="keras_mlp",
    )


def make_cnn(dtype="float32", bias=lambda: "zeros"):
    L = tf.keras.layers
    return tf.keras.Sequential(
        [
            tf.keras.Input((8, 8, 3), name="x", dtype=dtype),
            L.Conv2D(8, 3, padding="same", activation="relu", name="conv1", dtype=dtype,
                     bias_initializer=bias()),
            L.MaxPooling2D(2, name="pool", dtype=dtype),
            L.Conv2D(8, 3, padding="same", activation="relu", name="conv2", dtype=dtype,
                     bias_initializer=bias()),
            L.Flatten(name="flatten", dtype=dtype),
            L.Dense(4, name="logits", dtype=dtype, bias_initializer=bias()),
        ],
        name="keras_cnn",
    )


def make_bn(dtype="float32", bias=None):
    """The Keras pieces that export constants as initializers (Rescaling's scale and offset,
    ReLU6's bounds, the unit scale of a BatchNormalization without one) and a depthwise
    kernel that tf2onnx's constant folding renames. Every variable starts from seeded random
    values (biases, BatchNorm scales and shifts included): each is found in the file by its
    values, and no two are equal (tf2onnx could not merge them)."""
    L = tf.keras.layers
    init = tf.keras.initializers
    bias = bias or (lambda: init.RandomNormal(stddev=0.1))
    # A fresh initializer per layer: Keras 2.15 gives one unseeded instance the same values
    # at each use.
    def stats():
        return dict(moving_mean_initializer=init.RandomNormal(stddev=0.1),
                    moving_variance_initializer=init.RandomUniform(0.5, 1.5),
                    beta_initializer=init.RandomNormal(stddev=0.1), dtype=dtype)

    return tf.keras.Sequential(
        [
            tf.keras.Input((8, 8, 3), name="x", dtype=dtype),
            L.Rescaling(0.5, offset=-0.25, name="rescale", dtype=dtype),
            L.Conv2D(8, 3, padding="same", use_bias=False, name="conv1", dtype=dtype),
            L.BatchNormalization(scale=False, name="bn1", **stats()),
            L.ReLU(6.0, name="relu1", dtype=dtype),
            # No bias: before a BatchNorm its gradient is zero (noise that Adam would follow).
            L.DepthwiseConv2D(3, padding="same", use_bias=False, name="dw", dtype=dtype),
            L.BatchNormalization(name="bn2", gamma_initializer=init.RandomUniform(0.5, 1.5),
                                 **stats()),
            L.ReLU(6.0, name="relu2", dtype=dtype),
            L.GlobalAveragePooling2D(name="pool", dtype=dtype),
            L.Dense(4, name="logits", dtype=dtype, bias_initializer=bias()),
        ],
        name="keras_bn",
    )


def token_model(name, dtype, bias, recurrent, steps=12):
    """Tokens [N, steps] -> Embedding(16, 8) `embed` -> recurrent(L, dtype, bias) -> Dense(4)
    `logits`, biases from `bias()` (default RandomNormal(0.1), so each is found by value).
    steps=None: sequences of any length."""
    L = tf.keras.layers
    bias = bias or (lambda: tf.keras.initializers.RandomNormal(stddev=0.1))
    return tf.keras.Sequential(
        [
            tf.keras.Input((steps,), name="x", dtype="int32"),
            L.Embedding(16, 8, name="embed", dtype=dtype),
            *recurrent(L, dtype, bias),
            L.Dense(4, name="logits", dtype=dtype, bias_initializer=bias()),
        ],
        name=name,
    )


def make_lstm(dtype="float32", bias=None):
    """Tokens -> Embedding -> LSTM -> Dense: tf2onnx writes the LSTM as ONNX's LSTM, its
    gates reordered and Keras's one bias as B = [bias, zeros] (ONNX's two)."""
    return token_model("keras_lstm", dtype, bias, lambda L, dtype, bias: [
        L.LSTM(8, name="lstm", dtype=dtype, bias_initializer=bias())])


def gru_layers(L, dtype, bias):
    return [
        L.Bidirectional(L.GRU(6, return_sequences=True, name="gru", dtype=dtype,
                              bias_initializer=bias()), name="bigru", dtype=dtype),
        L.SimpleRNN(5, name="rnn", dtype=dtype, bias_initializer=bias()),
    ]


def make_gru(dtype="float32", bias=None):
    """Tokens -> Embedding -> Bidirectional(GRU, sequences) -> SimpleRNN -> Dense: tf2onnx
    writes each recurrent layer as a Loop (TensorFlow's while loop) over the 12 steps, the
    backward GRU's sequence reversed by ReverseSequence, and each GRU's one bias [2, 3H] as
    two initializers [1, 3H], its input and recurrent halves (rows)."""
    return token_model("keras_gru", dtype, bias, gru_layers)


def make_gru_any_length(dtype="float32", bias=None):
    """keras_gru on sequences of any length (Input((None,))): each Loop's trip count is the
    input's length, known only at run time."""
    return token_model("keras_gru_any_length", dtype, bias, gru_layers, steps=None)


def make_data_mlp(rng):
    x = rng.standard_normal((N_SAMPLES, 16)).astype(np.float32)
    return {"x": x, "labels": rng.integers(0, 10, N_SAMPLES).astype(np.int64)}


def make_data_tokens(rng):
    x = rng.integers(0, 16, (N_SAMPLES, 12)).astype(np.int32)
    return {"x": x, "labels": rng.integers(0, 4, N_SAMPLES).astype(np.int64)}


def make_data_cnn(rng):
    x = rng.standard_normal((N_SAMPLES, 8, 8, 3)).astype(np.float32)
    return {"x": x, "labels": rng.integers(0, 4, N_SAMPLES).astype(np.int64)}


MODELS = {
    "keras_mlp": dict(make=make_mlp, data=make_data_mlp, seed=0,
                      what="Dense(32, relu) -> Dense(10), logits (no softmax)"),
    "keras_bn": dict(make=make_bn, data=make_data_cnn, seed=2,
                     what="Rescaling(0.5, -0.25) -> Conv2D(8,3,same,no bias) -> "
                          "BatchNormalization(scale=False) -> ReLU(6) -> "
                          "DepthwiseConv2D(3,same,no bias) "
                          "-> BatchNormalization -> ReLU(6) -> GlobalAveragePooling2D -> "
                          "Dense(4), NHWC input, logits"),
    "keras_lstm": dict(make=make_lstm, data=make_data_tokens, seed=3,
                       what="Embedding(16, 8) -> LSTM(8) -> Dense(4), int32 tokens [N, 12], "
                            "logits"),
    "keras_gru": dict(make=make_gru, data=make_data_tokens, seed=4,
                      default_layout="gru_default_layout",
                      what="Embedding(16, 8) -> Bidirectional(GRU(6, return_sequences)) -> "
                           "SimpleRNN(5) -> Dense(4), int32 tokens [N, 12], logits"),
    "keras_gru_any_length": dict(
        make=make_gru_any_length, data=make_data_tokens, seed=5, lengths=[7],
        default_layout="gru_default_layout",
        what="keras_gru on tokens [N, T] of any length T: Embedding(16, 8) -> "
             "Bidirectional(GRU(6, return_sequences)) -> SimpleRNN(5) -> Dense(4), logits; "
             "trained at T = 12, gradients at T = 12 and 7"),
    "keras_cnn": dict(make=make_cnn, data=make_data_cnn, seed=1,
                      what="Conv2D(8,3,same,relu) -> MaxPooling2D(2) -> Conv2D(8,3,same,relu) -> "
                           "Flatten -> Dense(4), NHWC input, logits"),
}


# ---------------------------------------------------------------------------------------------
# Helpers


def save_npz(path: str, arrays: dict) -> None:
    """np.savez without compression and with fixed member timestamps (byte-identical reruns)."""
    with zipfile.ZipFile(path, "w", compression=zipfile.ZIP_STORED) as zf:
        for key, arr in arrays.items():
            buf = io.BytesIO()
            a = np.asarray(arr)
            if not a.flags.c_contiguous:
                a = a.copy(order="C")
            np.lib.format.write_array(buf, a, allow_pickle=False)
            info = zipfile.ZipInfo(f"{key}.npy", date_time=(1980, 1, 1, 0, 0, 0))
            info.external_attr = 0o644 << 16
            zf.writestr(info, buf.getvalue())


def op_counts(model: onnx.ModelProto) -> dict:
    return dict(sorted(collections.Counter(n.op_type for n in model.graph.node).items()))


def initializers(model: onnx.ModelProto) -> dict:
    return {i.name: numpy_helper.to_array(i) for i in model.graph.initializer}


def float_initializer_values(model: onnx.ModelProto) -> list:
    return [numpy_helper.to_array(i) for i in model.graph.initializer
            if i.data_type == onnx.TensorProto.FLOAT]


def float_initializers(model: onnx.ModelProto) -> dict:
    return {k: list(v.shape) for k, v in initializers(model).items() if v.dtype.kind == "f"}


def signature(model):
    return [tf.TensorSpec((None,) + tuple(model.input_shape[1:]), model.inputs[0].dtype,
                          name="x")]


# ---------------------------------------------------------------------------------------------
# Export


def _fresh_names():
    """tf2onnx numbers its generated names (`unk__N`, `const_axes__N`) with a global counter:
    restarting it makes each file independent of what was exported before it."""
    tf2onnx.utils.INTERNAL_NAME = 1


def export_default(model) -> onnx.ModelProto:
    _fresh_names()
    proto, _ = tf2onnx.convert.from_keras(model, input_signature=signature(model), opset=OPSET)
    return proto


def _grappler_without_constfold(input_names, output_names, graph_def):
    """tf2onnx.tf_loader.tf_optimize_grappler (tf2onnx 1.17) with `constfold` left out."""
    from tensorflow.core.protobuf import config_pb2, meta_graph_pb2
    from tensorflow.python.grappler import tf_optimizer

    config = config_pb2.ConfigProto()
    config.graph_options.infer_shapes = True
    rewrite = config.graph_options.rewrite_options
    rewrite.optimizers[:] = ["function", "dependency"]
    rewrite.experimental_disable_folding_quantization_emulation = True
    meta_graph = tf.compat.v1.train.export_meta_graph(graph_def=graph_def)
    fetch = meta_graph_pb2.CollectionDef()
    for t in input_names + output_names:
        fetch.node_list.value.append(t)
    meta_graph.collection_def["train_op"].CopyFrom(fetch)
    return tf_optimizer.OptimizeGraph(config, meta_graph)


# tf2onnx's `remove_back_to_back` optimizer folds a BatchNormalization that follows a Conv
# into the Conv's weight and bias: inference arithmetic, with the batch statistics, the scale
# and the shift gone from the file. export_kept takes that one rewrite out of it (the rest,
# such as cancelling transpose pairs, stays).
CONV_BN_FOLD = ("Conv", "BatchNormalization")


def export_kept(model, merge_duplication=False) -> onnx.ModelProto:
    """The export that keeps every Keras variable as its own initializer."""
    from tf2onnx.optimizer import back_to_back_optimizer

    optimizers = collections.OrderedDict(
        (k, v) for k, v in tf2onnx.optimizer._get_optimizers().items()
        if merge_duplication or k != "merge_duplication"
    )
    _fresh_names()
    original = tf2onnx.tf_loader.tf_optimize_grappler
    tf2onnx.tf_loader.tf_optimize_grappler = _grappler_without_constfold
    fold = back_to_back_optimizer._func_map.pop(CONV_BN_FOLD, None)
    try:
        proto, _ = tf2onnx.convert.from_keras(
            model, input_signature=signature(model), opset=OPSET, optimizers=optimizers
        )
    finally:
        tf2onnx.tf_loader.tf_optimize_grappler = original
        if fold is not None:
            back_to_back_optimizer._func_map[CONV_BN_FOLD] = fold
    return proto


def map_variables(model, proto: onnx.ModelProto) -> dict:
    """ONNX initializer name -> (Keras variable, layout permutation or None).

    tf2onnx names a layer's parameters after the op reading them:
    `<model>/<layer>/MatMul|Conv2D/ReadVariableOp[/resource]:0` for the kernel and
    `<model>/<layer>/BiasAdd/ReadVariableOp[/resource]:0` for the bias. The name picks the
    candidate; the values must then be equal (after HWIO -> OIHW for Conv2D kernels)."""
    inits = initializers(proto)
    mapping = {}
    for var in model.trainable_variables:
        layer, what = var.name.split(":")[0].split("/")[-2:]
        op = "BiasAdd" if what == "bias" else None
        names = [
            n for n in inits
            if f"/{layer}/" in n and (
                (op and f"/{op}/" in n) or (not op and ("/MatMul/" in n or "/Conv2D/" in n))
            )
        ]
        value = var.numpy()
        lstm = {"kernel": ("W0__", LSTM_KERNEL), "recurrent_kernel": ("R0__", LSTM_KERNEL),
                "bias": ("B0__", LSTM_BIAS)}
        if "gru_cell" in var.name or "simple_rnn_cell" in var.name:
            # tf2onnx's while loops read the cell's variables under `Read/ReadVariableOp`
            # names or unstacked: by value.
            names = []
        if "lstm_cell" in var.name:
            prefix, perm = lstm[what]
            (name,) = [n for n in inits if n.startswith(prefix)]
            assert np.array_equal(inits[name], to_onnx(value, perm)), (var.name, name)
            mapping[name] = (var, perm)
            continue
        if not names:
            # BatchNorm's scale and shift, a depthwise kernel (which tf2onnx's constant folding
            # renames): by value alone, which make_bn's seeded random values make unique.
            for perm in (None, HWIO_TO_OIHW, DEPTHWISE):
                if perm is not None and value.ndim != 4:
                    continue
                onnx_value = to_onnx(value, perm)
                names = [n for n, v in inits.items()
                         if v.shape == onnx_value.shape and np.array_equal(v, onnx_value)]
                if names:
                    break
        if not names and value.ndim == 2:
            rows = [[n for n, v in inits.items()
                     if v.shape == (1, value.shape[1]) and np.array_equal(v[0], row)]
                    for row in value]
            if all(len(r) == 1 for r in rows):
                for i, (n,) in enumerate(rows):
                    mapping[n] = (var, (ROW, i))
                continue
        if not names:
            continue  # dropped by the export (recorded by the caller)
        assert len(names) == 1, (var.name, names)
        perm = (DEPTHWISE if "depthwise" in var.name else HWIO_TO_OIHW) if value.ndim == 4 else None
        onnx_value = to_onnx(value, perm)
        assert inits[names[0]].shape == onnx_value.shape, (var.name, names[0])
        assert np.array_equal(inits[names[0]], onnx_value), (var.name, names[0])
        mapping[names[0]] = (var, perm)
    return mapping


# ---------------------------------------------------------------------------------------------
# Keras references


def ce_loss(logits, labels):
    loss = tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True)  # mean over the batch
    return loss(labels, logits)


def keras_grads(model, mapping, data, n):
    x, y = tf.constant(data["x"][:n]), tf.constant(data["labels"][:n])
    with tf.GradientTape() as tape:
        loss = ce_loss(model(x, training=True), y)
    grads = tape.gradient(loss, model.trainable_variables)
    by_var = {v.name: dense(g) for v, g in zip(model.trainable_variables, grads)}
    out = {"loss": np.float32(loss.numpy())}
    for name, (var, perm) in sorted(mapping.items()):
        g = by_var[var.name]
        out[name] = to_onnx(g, perm)
    return out


def dense(gradient):
    """A gradient as an array (an embedding's comes as IndexedSlices)."""
    return tf.convert_to_tensor(gradient).numpy()


def as_float64(x):
    """Float inputs in float64 for the float64 model; token ids stay as they are."""
    return x.astype(np.float64) if x.dtype == np.float32 else x


def keras_grads64(make, model, data, n):
    """The same gradient in float64 (a float64 copy of the model): the reference's own noise."""
    m64 = make("float64")
    m64.set_weights([w.astype(np.float64) for w in model.get_weights()])
    x = tf.constant(as_float64(data["x"][:n]))
    with tf.GradientTape() as tape:
        loss = ce_loss(m64(x, training=True), tf.constant(data["labels"][:n]))
    grads = tape.gradient(loss, m64.trainable_variables)
    return {v.name.split(":")[0]: dense(g) for v, g in
            zip(m64.trainable_variables, grads)}


def keras_run(make, model, mapping, data, optimizer):
    """STEPS full-batch steps of BATCH samples, step t on rows (arange(BATCH) + BATCH t) mod 64."""
    m = make()
    m.set_weights(model.get_weights())
    losses = []
    for t in range(STEPS):
        rows = (np.arange(BATCH) + BATCH * t) % N_SAMPLES
        x, y = tf.constant(data["x"][rows]), tf.constant(data["labels"][rows])
        with tf.GradientTape() as tape:
            loss = ce_loss(m(x, training=True), y)
        grads = tape.gradient(loss, m.trainable_variables)
        optimizer.apply_gradients(zip(grads, m.trainable_variables))
        losses.append(float(loss.numpy()))
    values = {v.name: v.numpy() for v in m.trainable_variables}
    params = {}
    for name, (var, perm) in sorted(mapping.items()):
        v = values[var.name]
        params[name] = to_onnx(v, perm)
    return params, losses


def variable_values(mapping, params):
    """Keras variable name -> value, from parameters in the layout of `mapping` (as it is,
    or split into rows)."""
    values, rows = {}, collections.defaultdict(dict)
    for name, (var, perm) in mapping.items():
        if isinstance(perm, tuple) and perm[0] == ROW:
            rows[var.name][perm[1]] = params[name][0]
        elif perm is None:
            values[var.name] = params[name]
        else:
            raise ValueError(f"{var.name}: layout {perm} is not inverted here")
    for var, by_row in rows.items():
        values[var] = np.stack([by_row[i] for i in sorted(by_row)])
    return values


def gru_default_layout(default: onnx.ModelProto, values: dict) -> dict:
    """keras_gru's `default.onnx` (grappler's constant folding on): tf2onnx writes the
    Bidirectional GRU as ONNX's GRU, gates z r h as Keras's: W [2, 3H, in] the two kernels
    transposed (forward, backward), R [2, 3H, H] the recurrent kernels, B [2, 6H] each
    bias's input row then recurrent row; every other variable as it is, found by value.
    Returns initializer name -> value for `values` (Keras variable name -> value)."""
    inits = initializers(default)
    # By direction: "forward_gru" -> {"kernel:0": ..., "recurrent_kernel:0": ..., "bias:0": ...}
    cell = {dirn: {k.split("/")[-1]: v for k, v in values.items() if f"/{dirn}/" in k}
            for dirn in ("forward_gru", "backward_gru")}
    assert all(cell.values()), values.keys()
    out = {}
    for prefix, build in (
        ("W__", lambda c: c["kernel:0"].T),
        ("R__", lambda c: c["recurrent_kernel:0"].T),
        ("B__", lambda c: np.concatenate([c["bias:0"][0], c["bias:0"][1]])),
    ):
        (name,) = [n for n in inits if n.startswith(prefix)]
        out[name] = np.stack([build(cell["forward_gru"]), build(cell["backward_gru"])])
    for var, value in values.items():
        if "_gru/" in var:
            continue
        names = [n for n, v in inits.items() if v.shape == value.shape and n not in out]
        (name,) = [n for n in names if np.array_equal(inits[n], value)] or names
        out[name] = value
    return out


def adam_first_step_ratio(make, model, data):
    """Keras's first Adam update over the textbook one (lr sqrt(1-b2)/(1-b1) m/(sqrt(v)+eps) with
    the decimal betas), float64, on elements with |g| > 1e-4: measures that Keras computes
    the bias corrections 1 - b^t from betas rounded to float32 (`tf.cast` of a Python float
    goes through float32) while its moments use 1 - b in the variable's dtype."""
    m = make("float64")
    m.set_weights([w.astype(np.float64) for w in model.get_weights()])
    before = [v.numpy().copy() for v in m.trainable_variables]
    rows = np.arange(BATCH)
    with tf.GradientTape() as tape:
        loss = ce_loss(m(tf.constant(as_float64(data["x"][rows])), training=True),
                       tf.constant(data["labels"][rows]))
    grads = [dense(g) for g in tape.gradient(loss, m.trainable_variables)]
    tf.keras.optimizers.Adam(**ADAM).apply_gradients(
        zip([tf.constant(g) for g in grads], m.trainable_variables))
    b1, b2, lr, eps = ADAM["beta_1"], ADAM["beta_2"], ADAM["learning_rate"], ADAM["epsilon"]
    ratios = []
    for w0, v, g in zip(before, m.trainable_variables, grads):
        textbook = lr * np.sqrt(1 - b2) / (1 - b1) * ((1 - b1) * g) / (np.sqrt((1 - b2) * g * g) + eps)
        keep = np.abs(g) > 1e-4
        ratios.append((w0 - v.numpy())[keep] / textbook[keep])
    r = np.concatenate(ratios)
    return float(r.min()), float(r.max())


def bias_init_workarounds(make) -> dict:
    """The plain export (grappler's constfold and merge_duplication on) of the same model with
    non-zero bias initialisers: the float initializers and how many nodes read each."""
    out = {}
    for label, bias in (
        ("Constant(1e-3)", lambda: tf.keras.initializers.Constant(1e-3)),
        ("RandomUniform(-1e-3, 1e-3), one unseeded instance per layer",
         lambda: tf.keras.initializers.RandomUniform(-1e-3, 1e-3)),
    ):
        tf.keras.utils.set_random_seed(99)
        proto = export_default(make(bias=bias))
        out[label] = sharing(proto)
    return out


def sharing(proto: onnx.ModelProto) -> dict:
    """Bias initializers and how many nodes read each. Which of several merged initializers
    tf2onnx keeps (and so the name) varies from run to run; the counts do not."""
    readers = collections.Counter(x for n in proto.graph.node for x in n.input)
    biases = [k for k in float_initializers(proto) if "/BiasAdd/" in k]
    return {"float_initializers": len(float_initializers(proto)),
            "bias_initializers": len(biases),
            "nodes_reading_each_bias": sorted(readers[k] for k in biases)}


def relative_l2(a, b):
    return float(np.linalg.norm(np.asarray(a, np.float64) - b) / max(np.linalg.norm(b), 1e-30))


# ---------------------------------------------------------------------------------------------


def versions():
    import keras
    return {
        "python": platform.python_version(),
        "tensorflow": tf.__version__,
        "keras": keras.__version__,
        "tf2onnx": tf2onnx.__version__,
        "onnx": onnx.__version__,
        "numpy": np.__version__,
    }


def generate(name: str, spec: dict) -> dict:
    gdir, fdir = os.path.join(GRAPHS, name), os.path.join(FIXTURES, name)
    os.makedirs(gdir, exist_ok=True)
    os.makedirs(fdir, exist_ok=True)
    tf.keras.utils.set_random_seed(spec["seed"])
    data = spec["data"](np.random.default_rng(spec["seed"]))
    save_npz(os.path.join(gdir, "data.npz"), data)
    model = spec["make"]()
    keras_vars = {v.name: list(v.shape) for v in model.trainable_variables}
    before = [w.copy() for w in model.get_weights()]

    default = export_default(model)
    merged = export_kept(model, merge_duplication=True)
    kept = export_kept(model)
    for path, proto in (("default.onnx", default), ("keras.onnx", kept)):
        onnx.checker.check_model(proto)
        onnx.save(proto, os.path.join(gdir, path))
    assert all(np.array_equal(a, b) for a, b in zip(before, model.get_weights()))

    mapping = map_variables(model, kept)
    assert {var.name for var, _ in mapping.values()} == {
        v.name for v in model.trainable_variables}, "every Keras variable is kept"
    default_mapping = map_variables(model, default)
    unmapped = [v for v in model.trainable_variables
                if v.name not in {var.name for var, _ in default_mapping.values()}]
    # A variable whose (non-zero) values are all in the file in another layout is rewritten,
    # not dropped: grappler's constant folding lets tf2onnx write a GRU's while loop as
    # ONNX's GRU, its gates in ONNX's order.
    default_values = np.concatenate([v.ravel() for v in float_initializer_values(default)])
    rewritten = sorted(v.name for v in unmapped
                       if v.numpy().any() and np.isin(v.numpy(), default_values).all())
    dropped = sorted(v.name for v in unmapped if v.name not in rewritten)

    grads = keras_grads(model, mapping, data, GRAD_SAMPLES)
    # A call with training=True moved BatchNorm's statistics: back to the exported ones.
    model.set_weights(before)
    save_npz(os.path.join(fdir, "grads.npz"), grads)
    # A model of any sequence length: the same file's gradients at other lengths (the first
    # T tokens of each sample, stored as `x` with them).
    for steps in spec.get("lengths", []):
        short = {"x": data["x"][:GRAD_SAMPLES, :steps], "labels": data["labels"]}
        save_npz(os.path.join(fdir, f"grads_t{steps}.npz"),
                 {"x": short["x"], **keras_grads(model, mapping, short, GRAD_SAMPLES)})
    g64 = keras_grads64(spec["make"], model, data, GRAD_SAMPLES)
    f64_agreement = {}
    for onnx_name, (var, perm) in mapping.items():
        g = g64[var.name.split(":")[0]]
        f64_agreement[onnx_name] = relative_l2(grads[onnx_name], to_onnx(g, perm))
    x8 = tf.constant(data["x"][:GRAD_SAMPLES])
    save_npz(os.path.join(fdir, "forward.npz"),
             {"x": data["x"][:GRAD_SAMPLES], "logits": model(x8, training=False).numpy()})

    runs = {}
    sgd, sgd_losses = keras_run(spec["make"], model, mapping, data,
                                tf.keras.optimizers.SGD(**SGD))
    save_npz(os.path.join(fdir, "run_sgd.npz"), sgd)
    adam, adam_losses = keras_run(spec["make"], model, mapping, data,
                                  tf.keras.optimizers.Adam(**ADAM))
    save_npz(os.path.join(fdir, "run_adam.npz"), adam)
    # The same Adam run on a float64 copy of the model (parameters stored in float64): Keras's
    # formula without its float32 rounding, which Adam amplifies on elements whose gradient is
    # near its noise (measured: up to 2.8e-6 between Keras's float32 and float64 runs).
    model64 = spec["make"]("float64")
    model64.set_weights([w.astype(np.float64) for w in model.get_weights()])
    data64 = {"x": as_float64(data["x"]), "labels": data["labels"]}
    adam64, adam64_losses = keras_run(lambda: spec["make"]("float64"), model64, mapping, data64,
                                      tf.keras.optimizers.Adam(**ADAM))
    save_npz(os.path.join(fdir, "run_adam64.npz"), adam64)
    adam_noise = max(float(np.abs(adam[k] - adam64[k]).max()) for k in adam)
    runs = {"run_sgd.npz": {"optimizer": "tf.keras.optimizers.SGD", **SGD, "losses": sgd_losses},
            "run_adam.npz": {"optimizer": "tf.keras.optimizers.Adam", **ADAM,
                             "losses": adam_losses},
            "run_adam64.npz": {"optimizer": "tf.keras.optimizers.Adam", **ADAM,
                               "dtype": "float64 model (make('float64'))",
                               "losses": adam64_losses,
                               "max_abs_from_run_adam.npz": adam_noise}}
    ratio = adam_first_step_ratio(spec["make"], model, data)
    if spec.get("default_layout"):
        # The default export in its own layout: the initial values must be the file's
        # (which checks the layout), then the SGD run's.
        layout = globals()[spec["default_layout"]]
        initial = layout(default, variable_values(mapping, {
            n: initializers(kept)[n] for n in mapping}))
        inits = initializers(default)
        for name, value in initial.items():
            assert np.array_equal(inits[name], value), name
        save_npz(os.path.join(fdir, "default_run_sgd.npz"),
                 layout(default, variable_values(mapping, sgd)))
        runs["default_run_sgd.npz"] = {
            "of": "run_sgd.npz", "layout": layout.__doc__.split("Returns")[0].strip()}

    return {
        "model": name,
        "what": spec["what"],
        "seed": f"tf.keras.utils.set_random_seed({spec['seed']}); data np.random.default_rng({spec['seed']})",
        "keras_variables": keras_vars,
        "initializer_of_keras_variable": {
            f"{var.name}" + (f"[{perm[1]}]" if perm not in LAYOUTS else ""): {
                "onnx": n, "layout": LAYOUTS.get(perm, "row of [2, 3H] as [1, 3H]")}
            for n, (var, perm) in sorted(mapping.items())},
        "export": {
            "opset": OPSET,
            "keras.onnx": {
                "how": "tf2onnx.convert.from_keras(model, input_signature=[TensorSpec((None, ...), "
                       "float32, name='x')], opset=17, optimizers=<tf2onnx's list without "
                       "merge_duplication>), with tf2onnx.tf_loader.tf_optimize_grappler "
                       "replaced by the same without 'constfold', and remove_back_to_back's "
                       "Conv + BatchNormalization fold taken out",
                "ops": op_counts(kept), "float_initializers": float_initializers(kept)},
            "default.onnx": {
                "how": "tf2onnx.convert.from_keras(model, input_signature=..., opset=17)",
                "ops": op_counts(default), "float_initializers": float_initializers(default),
                "dropped_keras_variables": dropped,
                **({"rewritten_keras_variables": rewritten} if rewritten else {})},
            "default_export_with_nonzero_bias_init": bias_init_workarounds(spec["make"]),
            "constfold_off_merge_duplication_on": {
                "ops": op_counts(merged), **sharing(merged),
                "note": "not written: tf2onnx's merge_duplication merges equal-valued "
                        "initializers (zero biases of the same shape become one, shared)"},
        },
        "inputs": {i.name: [d.dim_param or d.dim_value for d in i.type.tensor_type.shape.dim]
                   for i in kept.graph.input},
        "outputs": [o.name for o in kept.graph.output],
        "data": {"file": f"graphs/forward/{name}/data.npz", "samples": N_SAMPLES,
                 "x": list(data["x"].shape), "labels": "int64 class indices"},
        "loss": "tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True): mean over the "
                "batch (onnx-ga: --loss-fn cross-entropy, class axis -1, reduction mean)",
        "files": {
            "grads.npz": f"'loss' and the tf.GradientTape gradient of every variable (ONNX name and "
                         f"layout), samples [0,{GRAD_SAMPLES}), float32, training=True",
            "forward.npz": f"x[0:{GRAD_SAMPLES}] and Keras's logits (training=False)",
            **{f"grads_t{t}.npz": f"'x' (x[0:{GRAD_SAMPLES}, 0:{t}]: the first {t} tokens), "
                                  f"'loss' and the gradients on it, as grads.npz"
               for t in spec.get("lengths", [])},
            **{k: f"parameters after {STEPS} full-batch steps of {BATCH}, step t on rows "
                  f"(arange({BATCH}) + {BATCH}*t) mod {N_SAMPLES}" for k in runs},
        },
        "runs": runs,
        "grads_float32_vs_float64_relative_l2": f64_agreement,
        "keras_adam_first_update_over_textbook": {
            "min_max": ratio,
            "why": "Keras 2.15 Adam: alpha = lr sqrt(1 - b2^t) / (1 - b1^t) with b1, b2 cast from "
                   "Python floats through float32 (0.999 -> 0.99900001287), moments with "
                   "1 - b in the variable dtype: the update is 6.7e-6 relatively smaller than "
                   "with the decimal betas (sqrt(1 - f32(0.999)) / sqrt(0.001) / "
                   "((1 - f32(0.9)) / 0.1)), in float64 too"},
        "versions": versions(),
    }


def main(argv):
    names = argv or list(MODELS)
    if len(names) > 1:
        # One process per model: TF's and tf2onnx's name counters carry over between exports,
        # so the bytes of a file would depend on which models ran before it.
        import subprocess
        for name in names:
            subprocess.run([sys.executable, os.path.abspath(__file__), name], check=True)
        return
    for name in names:
        meta = generate(name, MODELS[name])
        with open(os.path.join(FIXTURES, name, "meta.json"), "w") as f:
            json.dump(meta, f, indent=1, sort_keys=False)
            f.write("\n")
        print(name, "dropped by default:", meta["export"]["default.onnx"]["dropped_keras_variables"],
              "rewritten:", meta["export"]["default.onnx"].get("rewritten_keras_variables", []))
        print(name, "f32 vs f64:", max(meta["grads_float32_vs_float64_relative_l2"].values()),
              "adam ratio:", meta["keras_adam_first_update_over_textbook"]["min_max"],
              "adam f32 vs f64:", meta["runs"]["run_adam64.npz"]["max_abs_from_run_adam.npz"])


if __name__ == "__main__":
    main(sys.argv[1:])
