"""A survey of Keras's applications through onnx-ga's autodiff (not a test: nothing here runs
in CI, and nothing is committed from it but the table in README.md).

Each `tf.keras.applications` model (random init, 10 classes, logits, dropout and stochastic
depth off) is exported by tf2onnx as `generate_keras.py`'s `export_kept` does (every Keras
variable its own initializer), differentiated by `onnx-ga rewrite --pipeline autodiff
--loss-fn cross-entropy`, and its gradient graph run by ONNX Runtime on 8 images, against
`tf.GradientTape` of the same mean sparse cross-entropy (`training=True`: batch statistics) in
float32 and float64. Before the export every variable is moved off its initial value by a
little noise, so that each Keras variable is found in the file by its values alone (zero
biases and unit BatchNorm scales would otherwise be indistinguishable), in whatever layout
tf2onnx wrote it.

Per model: the loss difference; the worst trainable variable's gradient error relative to
max(its norm, 1e-3 of the whole gradient's norm), ours and Keras float32's, each against
Keras float64, and ours against Keras float32; and the initializers onnx-ga trains that Keras does not (constants tf2onnx
wrote as initializers, non-trainable variables), which a user must `--freeze`.

    .venv-keras/bin/python graphs/forward/survey_keras.py [NAME ...]   # after cargo build --release

`.venv-keras` is regen_keras.sh's venv plus `pip install onnxruntime==1.19.2`.
"""

import itertools
import os
import subprocess
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import numpy as np  # noqa: E402
import onnx  # noqa: E402
import onnxruntime as ort  # noqa: E402
import tensorflow as tf  # noqa: E402
from onnx import numpy_helper  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import generate_keras  # noqa: E402  (export_kept)
from survey_report import report_each  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BIN = os.path.join(ROOT, "target", "release", "onnx-ga")
A = tf.keras.applications
COMMON = dict(weights=None, classes=10, classifier_activation=None)

# name: (constructor, input side)
MODELS = {
    "mobilenet": (lambda s: A.MobileNet(input_shape=(s, s, 3), alpha=0.25, dropout=0.0, **COMMON), 32),
    "mobilenet_v2": (lambda s: A.MobileNetV2(input_shape=(s, s, 3), alpha=0.35, **COMMON), 32),
    "mobilenet_v3_small": (lambda s: A.MobileNetV3Small(input_shape=(s, s, 3), alpha=0.75,
                                                         dropout_rate=0.0, **COMMON), 32),
    "mobilenet_v3_large": (lambda s: A.MobileNetV3Large(input_shape=(s, s, 3), alpha=0.75,
                                                         minimalistic=True, dropout_rate=0.0,
                                                         **COMMON), 32),
    "resnet50": (lambda s: A.ResNet50(input_shape=(s, s, 3), **COMMON), 32),
    "resnet50_v2": (lambda s: A.ResNet50V2(input_shape=(s, s, 3), **COMMON), 32),
    "resnet_rs50": (lambda s: A.ResNetRS50(input_shape=(s, s, 3), **COMMON), 32),
    "densenet121": (lambda s: A.DenseNet121(input_shape=(s, s, 3), **COMMON), 32),
    "vgg16": (lambda s: A.VGG16(input_shape=(s, s, 3), **COMMON), 32),
    "inception_v3": (lambda s: A.InceptionV3(input_shape=(s, s, 3), **COMMON), 75),
    "inception_resnet_v2": (lambda s: A.InceptionResNetV2(input_shape=(s, s, 3), **COMMON), 75),
    "xception": (lambda s: A.Xception(input_shape=(s, s, 3), **COMMON), 71),
    "nasnet_mobile": (lambda s: A.NASNetMobile(input_shape=(s, s, 3), **COMMON), 32),
    # Dropout and drop-connect (a Dropout with a noise shape) are set to 0 in build().
    "efficientnet_b0": (lambda s: A.EfficientNetB0(input_shape=(s, s, 3), **COMMON), 32),
    "efficientnet_v2_b0": (lambda s: A.EfficientNetV2B0(input_shape=(s, s, 3), **COMMON), 32),
    "convnext_tiny": (lambda s: A.ConvNeXtTiny(input_shape=(s, s, 3), **COMMON), 32),
    "regnet_x002": (lambda s: A.RegNetX002(input_shape=(s, s, 3), **COMMON), 32),
    "regnet_y002": (lambda s: A.RegNetY002(input_shape=(s, s, 3), **COMMON), 32),
}


L = tf.keras.layers


def tokens(vocab=32, length=12):
    inputs = tf.keras.Input((length,), dtype="int32", name="x")
    return inputs, L.Embedding(vocab, 16)(inputs)


def lstm(_):
    x, h = tokens()
    return tf.keras.Model(x, L.Dense(10)(L.LSTM(16)(h)), name="lstm")


def bidirectional_gru(_):
    x, h = tokens()
    h = L.Bidirectional(L.GRU(8, return_sequences=True))(h)
    return tf.keras.Model(x, L.Dense(10)(L.GlobalAveragePooling1D()(h)), name="bigru")


def simple_rnn(_):
    x, h = tokens()
    return tf.keras.Model(x, L.Dense(10)(L.SimpleRNN(8)(h)), name="simple_rnn")


def masked(recurrent, name):
    """Embedding(mask_zero=True) before a recurrent layer: padded sequences, as text models
    are trained. tf2onnx writes the layer as a while loop that holds the state on masked
    steps (no `sequence_lens`)."""
    def make(_):
        inputs = tf.keras.Input((12,), dtype="int32", name="x")
        h = recurrent()(L.Embedding(32, 16, mask_zero=True)(inputs))
        return tf.keras.Model(inputs, L.Dense(10)(h), name=name)
    return make


def padded_token_ids(rng, n):
    """Token ids 1..31 with 0-6 trailing zeros (the padding the mask hides)."""
    ids = rng.integers(1, 32, (n, 12)).astype(np.int32)
    for row, pad in zip(ids, rng.integers(0, 7, n)):
        row[12 - pad:] = 0
    return ids


def transformer(_):
    x, h = tokens()
    h = L.LayerNormalization()(h + L.MultiHeadAttention(num_heads=2, key_dim=8)(h, h))
    f = L.Dense(16)(L.Dense(32, activation="gelu")(h))
    h = L.LayerNormalization()(h + f)
    return tf.keras.Model(x, L.Dense(10)(L.GlobalAveragePooling1D()(h)), name="transformer")


def conv1d(_):
    x = tf.keras.Input((16, 4), name="x")
    h = L.Conv1D(8, 3, padding="same", activation="elu")(x)
    h = L.MaxPooling1D(2)(h)
    h = L.Conv1D(8, 3, dilation_rate=2, activation="swish")(h)
    h = L.LeakyReLU(0.1)(L.AveragePooling1D(2)(h))
    return tf.keras.Model(x, L.Dense(10)(L.GlobalMaxPooling1D()(h)), name="conv1d")


def encoder_decoder(_):
    x = tf.keras.Input((16, 16, 3), name="x")
    a = L.Conv2D(8, 3, padding="same", activation="relu")(x)
    h = L.MaxPooling2D(2)(a)
    h = L.SeparableConv2D(16, 3, padding="same", activation="tanh")(h)
    h = L.PReLU()(L.Conv2DTranspose(8, 3, strides=2, padding="same")(h))
    u = L.UpSampling2D(2)(L.AveragePooling2D(2)(a))
    h = L.Concatenate()([h, u])
    h = L.Conv2D(4, 1, activation="sigmoid")(L.ZeroPadding2D(1)(h))
    h = L.Cropping2D(1)(h)
    return tf.keras.Model(x, L.Dense(10)(L.Flatten()(h)), name="encoder_decoder")


def images(side):
    return lambda rng, n: rng.normal(0, 1, (n, side, side, 3)).astype(np.float32)


def token_ids(rng, n):
    return rng.integers(0, 32, (n, 12)).astype(np.int32)


# Keras's layers beyond the applications: name -> (constructor, input maker).
LAYER_MODELS = {
    "lstm": (lstm, token_ids),
    "bidirectional_gru": (bidirectional_gru, token_ids),
    "simple_rnn": (simple_rnn, token_ids),
    "transformer (MultiHeadAttention, LayerNormalization, GELU)": (transformer, token_ids),
    "masked_lstm (Embedding mask_zero, LSTM)": (
        masked(lambda: L.LSTM(16), "masked_lstm"), padded_token_ids),
    "masked_bidirectional_gru (Embedding mask_zero, Bidirectional GRU)": (
        masked(lambda: L.Bidirectional(L.GRU(8)), "masked_bigru"), padded_token_ids),
    "masked_simple_rnn (Embedding mask_zero, SimpleRNN)": (
        masked(lambda: L.SimpleRNN(8), "masked_simple_rnn"), padded_token_ids),
    "conv1d (ELU, swish, LeakyReLU, pooling)": (
        conv1d, lambda rng, n: rng.normal(0, 1, (n, 16, 4)).astype(np.float32)),
    "encoder_decoder (separable, transposed, PReLU, up-sampling, padding, cropping)": (
        encoder_decoder, lambda rng, n: rng.normal(0, 1, (n, 16, 16, 3)).astype(np.float32)),
}


def entry(name):
    """(constructor, input maker) of a survey model, by name or its name's first word."""
    if name in MODELS:
        make, side = MODELS[name]
        return make, side, images(side)
    for key, (make, data) in LAYER_MODELS.items():
        if name in (key, key.split()[0]):
            return make, None, data
    raise KeyError(name)


def build(name, dtype):
    make, side, data = entry(name)
    tf.keras.backend.set_floatx(dtype)
    try:
        model = make(side)
    finally:
        tf.keras.backend.set_floatx("float32")
    for layer in model.submodules:
        if isinstance(layer, tf.keras.layers.Dropout):
            layer.rate = 0.0
    return model, data


def perturb(model, rng):
    """Every variable a little off its initial value (unique values to find it by); BatchNorm
    and Normalization statistics stay statistics (variances positive)."""
    for v in model.variables:
        value = v.numpy()
        if not np.issubdtype(value.dtype, np.floating):
            continue
        if "variance" in v.name:
            v.assign(rng.uniform(0.5, 1.5, value.shape).astype(value.dtype))
        elif "count" in v.name:
            continue
        else:
            scale = 0.05 * (float(np.std(value)) or 1.0)
            v.assign(value + rng.normal(0, scale, value.shape).astype(value.dtype))


def layouts(value):
    """(how tf2onnx may have laid a Keras variable out, that layout of `value`)."""
    yield "same", value
    # PReLU's alpha, which tf2onnx folds into Neg(alpha) (the same training: the gradient
    # and every update negate with it).
    yield "negated", -value
    if value.ndim == 4:
        yield "HWIO->OIHW", np.transpose(value, (3, 2, 0, 1))
        h, w, c, m = value.shape  # a depthwise kernel: group convolution weight [C*M, 1, H, W]
        yield "HWCM->(CM)1HW", np.transpose(value, (2, 3, 0, 1)).reshape(c * m, 1, h, w)
    if value.ndim == 3:  # a Conv1D kernel [k, in, out]: a 2-D convolution's [out, in, 1, k]
        yield "KIO->OIK", np.transpose(value, (2, 1, 0))
        # MultiHeadAttention's kernels ([d, heads, key_dim], [heads, key_dim, d]), which
        # tf2onnx's Einsum lowering transposes (and reshapes).
        for perm in itertools.permutations(range(3)):
            yield f"perm {perm}", np.transpose(value, perm)
    if value.ndim == 2:
        yield "transposed", value.T
    # An LSTM's kernels and bias, its gates reordered (generate_keras.to_onnx).
    if value.ndim == 2 and value.shape[1] % 4 == 0:
        yield "lstm kernel", generate_keras.to_onnx(value, generate_keras.LSTM_KERNEL)
    if value.ndim == 1 and value.size % 4 == 0:
        yield "lstm bias", generate_keras.to_onnx(value, generate_keras.LSTM_BIAS)


def find(value, inits, used):
    """The initializer holding `value` in some layout: (name, layout) or None."""
    for name, init in inits.items():
        if name in used or init.dtype != value.dtype:
            continue
        for layout, v in layouts(value):
            if v.shape == init.shape and np.array_equal(v, init):
                return name, layout
            if v.size == init.size and np.array_equal(v.reshape(init.shape), init):
                return name, layout + " reshaped"
    return None


def find_rows(value, inits, used):
    """A 2-D variable tf2onnx unstacked into one initializer per row (a GRU's input and
    recurrent biases, folded out of Keras's one [2, 3H] bias): [(name, "row i")] or None."""
    if value.ndim != 2:
        return None
    hits = []
    for i, row in enumerate(value):
        hit = next((name for name, init in inits.items()
                    if name not in used and init.size == row.size and init.dtype == row.dtype
                    and np.array_equal(init.reshape(-1), row)), None)
        if hit is None:
            return None
        hits.append((hit, f"row {i}"))
    return hits


def in_layout(layout, value, shape):
    if layout.startswith("row "):
        return value[int(layout.split()[1])].reshape(shape)
    layout = layout.split(" reshaped")[0]
    for name, v in layouts(value):
        if layout == name:
            return v.reshape(shape)
    raise ValueError(layout)


def keras_gradients(model, x, labels):
    loss_fn = tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    with tf.GradientTape() as tape:
        loss = loss_fn(labels, model(x, training=True))
    grads = tape.gradient(loss, model.trainable_variables)
    # An embedding's gradient comes as IndexedSlices.
    return float(loss.numpy()), [tf.convert_to_tensor(g).numpy() for g in grads]


def survey(name, workdir):
    rng = np.random.default_rng(0)
    tf.keras.utils.set_random_seed(0)
    model, data = build(name, "float32")
    perturb(model, rng)
    x = data(rng, 8)
    labels = rng.integers(0, 10, 8).astype(np.int64)
    proto = generate_keras.export_kept(model)
    path = os.path.join(workdir, f"{name}.onnx")
    onnx.save(proto, path)
    inits = {i.name: numpy_helper.to_array(i) for i in proto.graph.initializer}
    # Each trainable variable with its initializer (or one per row); a variable tf2onnx
    # rewrote beyond a layout (a recurrent layer's gates reordered) is not found and not
    # compared. `found` holds (variable index, initializer, layout) per piece.
    found, used, lost = [], set(), []
    for k, v in enumerate(model.trainable_variables):
        hit = find(v.numpy(), inits, used)
        hits = [hit] if hit is not None else find_rows(v.numpy(), inits, used)
        if hits is None:
            lost.append(v.name)
            continue
        for init, layout in hits:
            used.add(init)
            found.append((k, init, layout))
    gradient_graph = os.path.join(workdir, f"{name}.grad.onnx")
    r = subprocess.run([BIN, "rewrite", path, "-o", gradient_graph, "--pipeline", "autodiff",
                        "--loss-fn", "cross-entropy"], capture_output=True, text=True)
    if r.returncode != 0:
        return f"rewrite failed: {r.stderr.strip().splitlines()[-1][:300]}"
    options = ort.SessionOptions()
    options.intra_op_num_threads = 1
    options.log_severity_level = 3
    session = ort.InferenceSession(gradient_graph, options)
    input_name = proto.graph.input[0].name
    outputs = [o.name for o in session.get_outputs()]
    out = dict(zip(outputs, session.run(None, {input_name: x, "labels": labels})))
    trained = {o[:-len("_grad")] for o in outputs if o.endswith("_grad")}
    loss32, g32 = keras_gradients(model, x, labels)
    model64, _ = build(name, "float64")
    model64.set_weights([w.astype(np.float64) if np.issubdtype(w.dtype, np.floating) else w
                         for w in model.get_weights()])
    _, g64 = keras_gradients(model64, x.astype(np.float64) if x.dtype == np.float32 else x,
                             labels)
    whole = np.sqrt(sum(np.sum(g ** 2) for g in g64))
    names = [v.name for v in model.trainable_variables]
    missing = [names[k] for k, init, _ in found if init not in trained]
    if missing:
        return f"no gradient for {len(missing)} trainable variables: {missing[:3]}"
    def distance(ours, reference):
        return np.linalg.norm(ours - reference) / max(np.linalg.norm(reference), 1e-3 * whole)

    def piece(g, init, layout):
        return in_layout(layout, g, inits[init].shape)

    worst = max(
        (distance(out[f"{init}_grad"], piece(g64[k], init, layout)),
         distance(piece(g32[k], init, layout), piece(g64[k], init, layout)), names[k])
        for k, init, layout in found)
    from_keras32 = max(
        distance(out[f"{init}_grad"], piece(g32[k], init, layout)) for k, init, layout in found)
    extra = sorted(trained - used)
    extra_note = ""
    if lost:
        extra_note += (f"; {len(lost)} variables not found by value, not compared "
                       f"({lost[:3]}); trains {len(trained)} of Keras's "
                       f"{len(model.trainable_variables)}")
        extra = []
    if extra:
        sizes = [inits[e].size for e in extra]
        extra_note = (f"; also trains {len(extra)} initializers Keras does not "
                      f"({sum(s == 1 for s in sizes)} one-element; e.g. {extra[:3]}; "
                      f"larger: {[e for e, s in zip(extra, sizes) if s > 1][:3]})")
    # Which names tf2onnx gives variables: a read (`.../ReadVariableOp...`) or, where its
    # constant folding reshaped or transposed one, a `const_fold_opt__N`.
    folded = [init for _, init, _ in found if "ReadVariableOp" not in init]
    if folded:
        extra_note += f"; {len(folded)} initializers named {folded[:2]}"
    compared = len({k for k, _, _ in found})
    return (f"{compared} variables, {model.count_params()} weights, loss "
            f"{abs(float(out['loss']) - loss32):.1e} from Keras, worst gradient {worst[0]:.1e} "
            f"from float64 (Keras float32 {worst[1]:.1e}, {worst[2]}), "
            f"{from_keras32:.1e} from Keras float32{extra_note}")


def main(names):
    tf.config.threading.set_intra_op_parallelism_threads(1)
    tf.config.threading.set_inter_op_parallelism_threads(1)
    tf2onnx_level = __import__("tf2onnx").logging
    tf2onnx_level.set_level(tf2onnx_level.ERROR)
    if not names:
        # Each model in its own process: tf2onnx's names and TensorFlow's graphs accumulate.
        for name in [*MODELS, *(key.split()[0] for key in LAYER_MODELS)]:
            subprocess.run([sys.executable, __file__, name])
        return
    report_each(names, survey)


if __name__ == "__main__":
    main(sys.argv[1:])
