"""Trains a step written by `onnx-ga rewrite` from Python, with nothing but onnxruntime and
the step's own manifest: any host can drive the loop without knowing onnx-ga's naming.

    .venv-ort/bin/python examples/train_step.py STEP.onnx DATA.npz --micro-batch 8 --steps 32 [--save-state S.npz] [--split]

Run it with a Python that has onnxruntime, numpy and onnx: `.venv-ort/bin/python`, which
`bash scripts/install-ort.sh` creates (ONNX Runtime 1.31.1, onnx 1.23.2), or your own with
`pip install onnxruntime numpy onnx`.

The manifest (model metadata) says which graph inputs are state, which output carries each
one's next value, which inputs are data and which output is the loss. Micro-step i takes
samples [i*B, (i+1)*B) of DATA.npz, wrapping around, as `onnx-ga train` does.

By default this runs the exported graph whole, its apply `If` included. With --split it runs
the two specialisations that `onnx-ga rewrite --split` writes next to the step
(STEP.accumulate.onnx, STEP.apply.onnx), as `onnx-ga train` does: the accumulate graph while
the window continues, the apply graph on the micro-step that completes it (the rule in the
manifest's `onnx_ga.apply`: micro_step + 1 >= K or flush). The accumulate graph has no
outputs for the state it leaves unchanged (`onnx_ga.unchanged`): the host keeps those values.
Both ways give bit-identical results; the split is faster.
"""

import argparse
import json
import sys

try:
    import numpy as np
    import onnx
    import onnxruntime as ort
    from onnx import numpy_helper
except ImportError as e:
    sys.exit(
        f"error: {e.name or e} is not installed for {sys.executable}: run this example with "
        ".venv-ort/bin/python (made by `bash scripts/install-ort.sh`), or "
        "`pip install onnxruntime numpy onnx`"
    )


def initial_value(entry, initializers, inputs):
    """The value a state starts at, by its manifest entry."""
    init = entry.get("init")
    if init is None:
        return numpy_helper.to_array(initializers[entry["input"]])
    if init != "zeros":
        sys.exit(f"error: state '{entry['input']}': unknown init {init!r} (this host knows 'zeros')")
    tensor_type = inputs[entry["input"]].type.tensor_type
    shape = [d.dim_value for d in tensor_type.shape.dim]
    if any(not d.HasField("dim_value") for d in tensor_type.shape.dim):
        sys.exit(f"error: state '{entry['input']}' starts at zeros but its shape is not static")
    return np.zeros(shape, dtype=onnx.helper.tensor_dtype_to_np_dtype(tensor_type.elem_type))


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("step")
    p.add_argument("data")
    p.add_argument("--micro-batch", type=int, required=True)
    p.add_argument("--steps", type=int, required=True)
    p.add_argument("--save-state")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--split", action="store_true")
    args = p.parse_args()

    model = onnx.load(args.step)
    meta = {e.key: e.value for e in model.metadata_props}
    state_entries = json.loads(meta["onnx_ga.state"])
    data_inputs = json.loads(meta["onnx_ga.data_inputs"])
    loss_name = meta["onnx_ga.loss"]

    # Initial state: the initializers of the state inputs, except for a state whose entry
    # says `"init": "zeros"` (accumulators, moments, counters): the step stores nothing for
    # it, and it starts as zeros of its graph input's declared element type and static shape.
    initializers = {t.name: t for t in model.graph.initializer}
    inputs = {i.name: i for i in model.graph.input}
    state = {e["input"]: initial_value(e, initializers, inputs) for e in state_entries}

    options = ort.SessionOptions()
    options.intra_op_num_threads = args.threads
    options.log_severity_level = 3  # state inputs with initializers are intended: no warnings

    def session(m):
        s = ort.InferenceSession(m.SerializeToString(), options, providers=["CPUExecutionProvider"])
        return s, [o.name for o in s.get_outputs()]

    if args.split:
        base = args.step[: -len(".onnx")] if args.step.endswith(".onnx") else args.step
        accumulate, apply = (onnx.load(f"{base}.{b}.onnx") for b in ("accumulate", "apply"))
        unchanged = {
            name: set(json.loads({e.key: e.value for e in m.metadata_props}["onnx_ga.unchanged"]))
            for name, m in (("accumulate", accumulate), ("apply", apply))
        }
        runners = {"accumulate": session(accumulate), "apply": session(apply)}
        trigger = json.loads(meta["onnx_ga.apply"])
        k = int(numpy_helper.to_array(initializers[trigger["steps"]]))
        counter = next(e["input"] for e in state_entries if e["role"] == "micro_step")
        micro_step = int(state[counter])
    else:
        runners = {"whole": session(model)}
        unchanged = {"whole": set()}

    data = np.load(args.data)
    samples = data[data_inputs[0]].shape[0]
    window_losses = []
    for i in range(args.steps):
        start = (i * args.micro_batch) % samples
        rows = [(start + j) % samples for j in range(args.micro_batch)]
        feeds = {name: data[name][rows] for name in data_inputs}
        feeds.update(state)
        if args.split:
            applies = micro_step + 1 >= k
            which = "apply" if applies else "accumulate"
            micro_step = 0 if applies else micro_step + 1
        else:
            which = "whole"
        sess, outputs = runners[which]
        values = dict(zip(outputs, sess.run(outputs, feeds)))
        for e in state_entries:
            if e["input"] not in unchanged[which]:
                state[e["input"]] = values[e["output"]]
        window_losses.append(float(values[loss_name]))
        if bool(values.get("ga.applied", False)):
            print(f"micro-step {i + 1}: window applied, mean loss {np.mean(window_losses):.5f}")
            window_losses = []

    if args.save_state:
        np.savez(args.save_state, **state)


if __name__ == "__main__":
    main()
