//! Adaptive gradient clipping (`agc` pass) on standard ONNX Runtime: the clipped window
//! gradient against an independent computation for every ONNX weight layout, identity when
//! inactive, K micro-batches equal one full batch (the mean is clipped, not each
//! micro-batch), every generated model trains with AGC, and the AGC subgraph as a snapshot.

use crate::common;

use std::collections::BTreeMap;
use std::path::Path;

use crate::common::{assert_close, ort_available, read_npz, root};
use ndarray::{ArrayD, IxDyn};
use onnx_ga::data::Tensor;
use onnx_ga::ir::builder::{attr_int, attr_ints, tensor_f32, Builder};
use onnx_ga::ir::{tensor_type, BodyId, Model, ValueId};
use onnx_ga::passes::agc::{self, Selection, Units};
use onnx_ga::proto::{ModelProto, OperatorSetIdProto};
use onnx_ga::signature::{self, ExplicitRoles, TrainingGraph};
use onnx_ga::train::{micro_batch, Trainer};

// ---- a plain gradient graph with one parameter per layout ---------------------------------

/// Deterministic numbers in [-1, 1).
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> f32 {
        self.0 = self
            .0
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        ((self.0 >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
    }

    fn tensor(&mut self, dims: &[i64]) -> Vec<f32> {
        (0..dims.iter().product::<i64>())
            .map(|_| self.next())
            .collect()
    }

    /// Values whose magnitude spreads over two decades, so that unit norms differ widely.
    fn spread(&mut self, dims: &[i64]) -> Vec<f32> {
        (0..dims.iter().product::<i64>())
            .map(|_| self.next() * 10f32.powf(self.next() - 0.5))
            .collect()
    }
}

/// A parameter of the layouts graph: its name, shape, and the unit of each element
/// (written independently of the pass: which output the element's row or filter feeds).
struct Layout {
    name: &'static str,
    dims: Vec<i64>,
    unit_of: fn(&[usize]) -> usize,
}

fn layouts() -> Vec<Layout> {
    vec![
        // Conv W [M, C, kH, kW]: output channel m.
        Layout {
            name: "conv.w",
            dims: vec![4, 3, 3, 3],
            unit_of: |i| i[0],
        },
        Layout {
            name: "conv.b",
            dims: vec![4],
            unit_of: |_| 0,
        },
        // Grouped Conv (group 2) W [M, C/g, kH, kW]: still output channel m.
        Layout {
            name: "gconv.w",
            dims: vec![6, 2, 3, 3],
            unit_of: |i| i[0],
        },
        // Grouped ConvTranspose (group 2) W [C, M/g, kH, kW]: output channel
        // (group of the input channel) * M/g + j.
        Layout {
            name: "convt.w",
            dims: vec![4, 3, 2, 2],
            unit_of: |i| (i[0] / 2) * 3 + i[1],
        },
        // Gemm transB=1: B [N, K], output n is row n.
        Layout {
            name: "gemm_t.w",
            dims: vec![5, 3],
            unit_of: |i| i[0],
        },
        // Gemm transB=0: B [K, N], output n is column n.
        Layout {
            name: "gemm_n.w",
            dims: vec![3, 5],
            unit_of: |i| i[1],
        },
        // Gemm transA=0 with the parameter as A [M, K]: output row m is row m.
        Layout {
            name: "gemm_a.w",
            dims: vec![4, 3],
            unit_of: |i| i[0],
        },
        // MatMul right operand [in, out]: output column j is column j.
        Layout {
            name: "mm_r.w",
            dims: vec![3, 4],
            unit_of: |i| i[1],
        },
        // MatMul left operand [rows, in]: output row i is row i.
        Layout {
            name: "mm_l.w",
            dims: vec![4, 3],
            unit_of: |i| i[0],
        },
        // A bias and a LayerNorm scale: one unit.
        Layout {
            name: "bias",
            dims: vec![5],
            unit_of: |_| 0,
        },
        Layout {
            name: "ln.scale",
            dims: vec![4],
            unit_of: |_| 0,
        },
        // Embedding table (Gather data) [vocab, dim]: per row.
        Layout {
            name: "emb",
            dims: vec![6, 4],
            unit_of: |i| i[0],
        },
    ]
}

fn empty_model(name: &str) -> Model {
    empty_model_opset(name, 17)
}

fn empty_model_opset(name: &str, opset: i64) -> Model {
    let header = ModelProto {
        ir_version: Some(8),
        opset_import: vec![OperatorSetIdProto {
            domain: Some(String::new()),
            version: Some(opset),
        }],
        producer_name: Some("onnx-ga tests".into()),
        ..Default::default()
    };
    let mut model = Model::from_proto(ModelProto {
        graph: Some(Default::default()),
        ..header
    });
    model.body_mut(BodyId::MAIN).rest.name = Some(name.into());
    model
}

const FLOAT: i32 = 1;
const INT64: i32 = 7;

/// Adds parameter `name` (an initializer-backed input) and its gradient input `g.<name>`.
fn param(model: &mut Model, name: &str, dims: &[i64], values: &[f32]) -> ValueId {
    let v = model.add_input(
        BodyId::MAIN,
        name,
        tensor_type(FLOAT, dims),
        Some(tensor_f32(dims, values)),
    );
    model.add_input(
        BodyId::MAIN,
        &format!("g.{name}"),
        tensor_type(FLOAT, dims),
        None,
    );
    v
}

/// Data inputs of the layouts graph: (name, dims, int64?).
const DATA: [(&str, &[i64], bool); 8] = [
    ("img", &[1, 3, 5, 5], false),
    ("img4", &[1, 4, 5, 5], false),
    ("cimg", &[1, 4, 3, 3], false),
    ("a", &[2, 3], false),
    ("bmat", &[3, 2], false),
    ("x4", &[2, 4], false),
    ("x3", &[3, 2], false),
    ("idx", &[3], true),
];

/// One forward consumer per layout; the loss sums every output. The "gradient" of each
/// parameter is a data input, so the window's gradient is known exactly.
fn layouts_graph(seed: u64, opset: i64) -> ModelProto {
    let mut model = empty_model_opset("agc_layouts", opset);
    let main = BodyId::MAIN;
    let mut data = BTreeMap::new();
    for (name, dims, int) in DATA {
        let ty = tensor_type(if int { INT64 } else { FLOAT }, dims);
        data.insert(name, model.add_input(main, name, ty, None));
    }
    let mut rng = Rng(seed);
    let mut p = BTreeMap::new();
    for l in layouts() {
        let values = rng.tensor(&l.dims);
        p.insert(l.name, param(&mut model, l.name, &l.dims, &values));
    }
    let mut b = Builder::new(&mut model, main, "test");
    let outs = vec![
        b.op(
            "Conv",
            &[data["img"], p["conv.w"], p["conv.b"]],
            vec![],
            "conv",
        ),
        b.op(
            "Conv",
            &[data["img4"], p["gconv.w"]],
            vec![attr_int("group", 2)],
            "gconv",
        ),
        b.op(
            "ConvTranspose",
            &[data["cimg"], p["convt.w"]],
            vec![attr_int("group", 2)],
            "convt",
        ),
        {
            let g = b.op(
                "Gemm",
                &[data["a"], p["gemm_t.w"]],
                vec![attr_int("transB", 1)],
                "gemm_t",
            );
            b.op("Add", &[g, p["bias"]], vec![], "gemm_t_bias")
        },
        b.op("Gemm", &[data["a"], p["gemm_n.w"]], vec![], "gemm_n"),
        b.op("Gemm", &[p["gemm_a.w"], data["x3"]], vec![], "gemm_a"),
        b.op("MatMul", &[data["a"], p["mm_r.w"]], vec![], "mm_r"),
        b.op("MatMul", &[p["mm_l.w"], data["bmat"]], vec![], "mm_l"),
        b.op(
            "LayerNormalization",
            &[data["x4"], p["ln.scale"]],
            vec![attr_int("axis", -1)],
            "ln",
        ),
        b.op("Gather", &[p["emb"], data["idx"]], vec![], "emb_rows"),
    ];
    let sums: Vec<ValueId> = outs
        .iter()
        .map(|o| b.op("ReduceSum", &[*o], vec![attr_int("keepdims", 0)], "part"))
        .collect();
    let loss = b.op("Sum", &sums, vec![], "loss");
    model.add_output(main, loss, Some(tensor_type(FLOAT, &[])));
    strip_stamps(&mut model);
    model.to_proto()
}

fn strip_stamps(model: &mut Model) {
    for n in model.all_nodes().collect::<Vec<_>>() {
        model.node_mut(n).proto.metadata_props.clear();
    }
}

fn layouts_roles() -> ExplicitRoles {
    ExplicitRoles {
        loss: Some("loss".into()),
        seed: None,
        grads: layouts()
            .iter()
            .map(|l| (l.name.to_string(), format!("g.{}", l.name)))
            .collect(),
    }
}

fn layouts_training_graph(seed: u64, opset: i64) -> TrainingGraph {
    signature::from_model(
        layouts_graph(seed, opset),
        &layouts_roles(),
        Path::new("agc_layouts.onnx"),
    )
    .unwrap()
}

/// Parameter values and gradients of the layouts graph, and a batch feeding them.
struct Window {
    params: BTreeMap<String, Vec<f32>>,
    grads: BTreeMap<String, Vec<f32>>,
    batch: BTreeMap<String, Tensor>,
}

fn window(seed: u64, zero_unit: bool) -> Window {
    let mut rng = Rng(seed);
    let params = layouts()
        .iter()
        .map(|l| (l.name.to_string(), rng.tensor(&l.dims)))
        .collect();
    let mut rng = Rng(seed ^ 0x9e37_79b9);
    let mut batch = BTreeMap::new();
    for (name, dims, int) in DATA {
        let shape: Vec<usize> = dims.iter().map(|d| *d as usize).collect();
        let t = if int {
            Tensor::I64(ArrayD::from_shape_vec(IxDyn(&shape), vec![0, 5, 2]).unwrap())
        } else {
            Tensor::F32(ArrayD::from_shape_vec(IxDyn(&shape), rng.tensor(dims)).unwrap())
        };
        batch.insert(name.to_string(), t);
    }
    let mut grads = BTreeMap::new();
    for l in layouts() {
        let mut g = rng.spread(&l.dims);
        if zero_unit && l.name == "conv.w" {
            // Output channel 1 gets no gradient: its norm is 0 and it must stay 0.
            g[27..54].iter_mut().for_each(|v| *v = 0.0);
        }
        let shape: Vec<usize> = l.dims.iter().map(|d| *d as usize).collect();
        batch.insert(
            format!("g.{}", l.name),
            Tensor::F32(ArrayD::from_shape_vec(IxDyn(&shape), g.clone()).unwrap()),
        );
        grads.insert(l.name.to_string(), g);
    }
    Window {
        params,
        grads,
        batch,
    }
}

/// The paper's rule, in double precision: per unit, G * clip max(|W|, eps) / |G| when
/// |G| > clip max(|W|, eps). Returns the clipped gradient and (clipped, total) units.
fn clip_reference(
    layout: &Layout,
    w: &[f32],
    g: &[f32],
    clip: f64,
    eps: f64,
) -> (Vec<f64>, usize, usize) {
    let shape: Vec<usize> = layout.dims.iter().map(|d| *d as usize).collect();
    let index = |mut flat: usize| {
        let mut idx = vec![0; shape.len()];
        for (k, d) in shape.iter().enumerate().rev() {
            idx[k] = flat % d;
            flat /= d;
        }
        idx
    };
    let units: Vec<usize> = (0..w.len()).map(|i| (layout.unit_of)(&index(i))).collect();
    let count = units.iter().max().unwrap() + 1;
    let (mut wn, mut gn) = (vec![0f64; count], vec![0f64; count]);
    for (i, u) in units.iter().enumerate() {
        wn[*u] += (w[i] as f64).powi(2);
        gn[*u] += (g[i] as f64).powi(2);
    }
    let factor: Vec<f64> = (0..count)
        .map(|u| {
            let max_norm = clip * wn[u].sqrt().max(eps);
            let g_norm = gn[u].sqrt();
            if g_norm > max_norm {
                max_norm / g_norm
            } else {
                1.0
            }
        })
        .collect();
    let clipped = factor.iter().filter(|f| **f < 1.0).count();
    let out = g
        .iter()
        .zip(&units)
        .map(|(v, u)| *v as f64 * factor[*u])
        .collect();
    (out, clipped, count)
}

fn build(graph: TrainingGraph, spec: &str) -> ModelProto {
    onnx_ga::step::build_step(graph, spec, true)
        .unwrap_or_else(|e| panic!("{spec}: {e}"))
        .model
        .to_proto()
}

fn trainer(step: &ModelProto) -> Trainer {
    common::trainer(step)
}

fn f32s(t: &Tensor) -> Vec<f32> {
    t.as_f32().expect("float tensor").iter().copied().collect()
}

/// One window (K=1) of the layouts graph; returns the window's clipped gradient of every
/// parameter, read from the momentum buffer (b = 0.9 * 0 + G is G exactly).
fn clipped_gradients(
    spec_agc: &str,
    apply: &str,
    opset: i64,
    w: &Window,
) -> BTreeMap<String, Vec<f32>> {
    let spec = format!(
        "grad-accum(steps=1,apply={apply}),{spec_agc}optimizer(kind=momentum,lr=1,momentum=0.9),dce"
    );
    let step = build(layouts_training_graph(7, opset), &spec);
    let mut t = trainer(&step);
    assert!(t.step(&w.batch, false).unwrap().applied);
    layouts()
        .iter()
        .map(|l| {
            (
                l.name.to_string(),
                f32s(&t.state().unwrap()[&format!("ga.momentum.{}", l.name)]),
            )
        })
        .collect()
}

fn check_against_reference(clip: f64, eps: f64, zero_unit: bool) -> (usize, usize) {
    let w = window(7, zero_unit);
    let mut totals = (0, 0);
    let mut worst: f64 = 0.0;
    // Opset 18 takes the ReduceL2 axes as an input rather than an attribute.
    for (apply, opset) in [("if", 17), ("where", 17), ("if", 18)] {
        let got = clipped_gradients(
            &format!("agc(clip={clip},eps={eps},include_final=true),"),
            apply,
            opset,
            &w,
        );
        totals = (0, 0);
        for l in layouts() {
            let (expected, clipped, units) =
                clip_reference(&l, &w.params[l.name], &w.grads[l.name], clip, eps);
            totals.0 += clipped;
            totals.1 += units;
            let shape: Vec<usize> = l.dims.iter().map(|d| *d as usize).collect();
            let actual: Vec<f64> = got[l.name].iter().map(|v| *v as f64).collect();
            for (a, e) in actual.iter().zip(&expected) {
                if *e != 0.0 {
                    worst = worst.max((a - e).abs() / e.abs());
                }
            }
            assert_close(
                &format!("{} (apply={apply}, opset {opset}, clip={clip})", l.name),
                &Tensor::F64(ArrayD::from_shape_vec(IxDyn(&shape), actual).unwrap()),
                &Tensor::F64(ArrayD::from_shape_vec(IxDyn(&shape), expected).unwrap()),
                1e-6,
                0.0,
            );
            assert!(got[l.name].iter().all(|v| v.is_finite()), "{}", l.name);
        }
    }
    eprintln!("clip={clip} eps={eps}: largest relative error {worst:.2e}");
    totals
}

/// Clipping active: a small clip factor clips most units; each parameter's clipped gradient
/// equals the paper's rule computed here in double precision, within 1e-6 relative.
#[test]
fn clipped_gradient_matches_reference_for_every_layout() {
    if !ort_available() {
        return;
    }
    let (clipped, units) = check_against_reference(0.05, 1e-3, true);
    eprintln!("clip=0.05: {clipped} of {units} units clipped");
    assert!(clipped > 0 && clipped < units, "{clipped} of {units}");
    // A clip factor near the typical ratio: a mix of clipped and untouched units.
    let (clipped, units) = check_against_reference(0.6, 1e-3, false);
    eprintln!("clip=0.6: {clipped} of {units} units clipped");
    assert!(clipped > 0 && clipped < units, "{clipped} of {units}");
    // eps above every weight norm: max_norm = clip * eps for every unit.
    let (clipped, units) = check_against_reference(0.05, 10.0, false);
    eprintln!("clip=0.05, eps=10: {clipped} of {units} units clipped");
    assert!(clipped > 0 && clipped < units, "{clipped} of {units}");
}

/// Clipping inactive (a clip factor no gradient reaches): the step is bit for bit the step
/// without AGC, for the whole state (parameters, momentum, counters).
#[test]
fn inactive_clipping_is_bit_identical_to_no_agc() {
    if !ort_available() {
        return;
    }
    let w = window(11, true);
    for apply in ["if", "where"] {
        let run = |agc: &str| {
            let spec = format!(
                "grad-accum(steps=1,apply={apply}),{agc}optimizer(kind=momentum,lr=0.5,momentum=0.9),dce"
            );
            let step = build(layouts_training_graph(7, 17), &spec);
            let mut t = trainer(&step);
            for _ in 0..2 {
                t.step(&w.batch, false).unwrap();
            }
            t.state().unwrap().clone()
        };
        let plain = run("");
        let clipped = run("agc(clip=1e6,include_final=true),");
        assert_eq!(plain, clipped, "apply={apply}");
        // The clipped gradient of the first window is the gradient itself, bit for bit.
        let got = clipped_gradients("agc(clip=1e6,include_final=true),", apply, 17, &w);
        for l in layouts() {
            assert_eq!(
                got[l.name].iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
                w.grads[l.name]
                    .iter()
                    .map(|v| v.to_bits())
                    .collect::<Vec<_>>(),
                "{} (apply={apply})",
                l.name
            );
        }
    }
}

/// The units the pass derives for each layout (the reference above states them per element).
#[test]
fn derived_units_per_layout() {
    let graph = layouts_training_graph(7, 17);
    let plan = agc::plan(
        &graph.model,
        &graph.signature,
        &Selection {
            include_final: true,
            ..Default::default()
        },
    )
    .unwrap();
    let units: BTreeMap<&str, (&Units, i64)> = plan
        .params
        .iter()
        .map(|p| (p.name.as_str(), (&p.units, p.unit_count)))
        .collect();
    let axes = |a: &[i64]| Units::Axes { axes: a.to_vec() };
    let expected = [
        ("conv.w", axes(&[1, 2, 3]), 4),
        ("conv.b", Units::Whole, 1),
        ("gconv.w", axes(&[1, 2, 3]), 6),
        (
            "convt.w",
            Units::View {
                view: vec![2, 2, 3, 4],
                axes: vec![1, 3],
            },
            6,
        ),
        ("gemm_t.w", axes(&[1]), 5),
        ("gemm_n.w", axes(&[0]), 5),
        ("gemm_a.w", axes(&[1]), 4),
        ("mm_r.w", axes(&[0]), 4),
        ("mm_l.w", axes(&[1]), 4),
        ("bias", Units::Whole, 1),
        ("ln.scale", Units::Whole, 1),
        ("emb", axes(&[1]), 6),
    ];
    for (name, u, count) in expected {
        assert_eq!(units[name], (&u, count), "{name}");
    }
    assert!(plan.params.iter().all(|p| p.note.is_none()));
    // Every op feeds the loss directly, so every one is a "final layer".
    assert!(plan.params.iter().all(|p| p.final_layer));
    let default = agc::plan(&graph.model, &graph.signature, &Selection::default()).unwrap();
    assert!(default.params.iter().all(|p| p.excluded.is_some()));
}

/// The parameter through a Transpose (a PyTorch export's `x @ W.T`), consumers that
/// disagree, overrides, exclusion globs, and typos that must not pass silently.
#[test]
fn units_through_transpose_disagreement_and_overrides() {
    let mut model = empty_model("agc_rules");
    let main = BodyId::MAIN;
    let x = model.add_input(main, "x", tensor_type(FLOAT, &[2, 3]), None);
    let y = model.add_input(main, "y", tensor_type(FLOAT, &[5, 2]), None);
    let t = param(&mut model, "t.w", &[5, 3], &[0.5; 15]);
    let s = param(&mut model, "shared.w", &[3, 3], &[0.5; 9]);
    let r = param(&mut model, "reshaped.w", &[3, 3], &[0.5; 9]);
    let mut b = Builder::new(&mut model, main, "test");
    // x @ t.w^T: t.w [out, in] seen through Transpose, per output (row of t.w).
    let tt = b.op("Transpose", &[t], vec![attr_ints("perm", &[1, 0])], "t_T");
    let o1 = b.op("MatMul", &[x, tt], vec![], "o1");
    // shared.w as right operand (per column) and left operand (per row): disagree.
    let o2 = b.op("MatMul", &[x, s], vec![], "o2");
    let o3 = b.op("MatMul", &[s, s], vec![], "o3");
    let shape = b.ints("shape", &[9]);
    let o4 = b.op("Reshape", &[r, shape], vec![], "o4");
    let _unused = y;
    let parts: Vec<ValueId> = [o1, o2, o3, o4]
        .iter()
        .map(|o| b.op("ReduceSum", &[*o], vec![attr_int("keepdims", 0)], "part"))
        .collect();
    let loss = b.op("Sum", &parts, vec![], "loss");
    model.add_output(main, loss, Some(tensor_type(FLOAT, &[])));
    let roles = ExplicitRoles {
        loss: Some("loss".into()),
        seed: None,
        grads: ["t.w", "shared.w", "reshaped.w"]
            .iter()
            .map(|n| (n.to_string(), format!("g.{n}")))
            .collect(),
    };
    let graph = signature::from_model(model.to_proto(), &roles, Path::new("rules.onnx")).unwrap();
    let select = |s: Selection| agc::plan(&graph.model, &graph.signature, &s);
    let plan = select(Selection {
        include_final: true,
        ..Default::default()
    })
    .unwrap();
    let by_name = |plan: &agc::Plan, n: &str| plan.params.iter().find(|p| p.name == n).cloned();
    let t_units = by_name(&plan, "t.w").unwrap();
    assert_eq!(t_units.units, Units::Axes { axes: vec![1] });
    assert!(t_units.rule.contains("MatMul"), "{}", t_units.rule);
    let shared = by_name(&plan, "shared.w").unwrap();
    assert_eq!(shared.units, Units::Whole);
    assert!(
        shared
            .note
            .as_deref()
            .unwrap()
            .contains("consumers disagree"),
        "{:?}",
        shared.note
    );
    let reshaped = by_name(&plan, "reshaped.w").unwrap();
    assert_eq!(reshaped.units, Units::Whole);
    assert!(
        reshaped.note.as_deref().unwrap().contains("Reshape"),
        "{:?}",
        reshaped.note
    );

    let plan = select(Selection {
        include_final: true,
        exclude: vec!["*ped.?".into()],
        axes: vec![("shared.w".into(), Some(vec![-1]))],
    })
    .unwrap();
    let shared = by_name(&plan, "shared.w").unwrap();
    assert_eq!(shared.units, Units::Axes { axes: vec![1] });
    assert_eq!(shared.note, None);
    assert_eq!(
        by_name(&plan, "reshaped.w").unwrap().excluded.as_deref(),
        Some("excluded by '*ped.?'")
    );
    assert!(by_name(&plan, "t.w").unwrap().excluded.is_none());

    let err = select(Selection {
        exclude: vec!["fc9.*".into()],
        ..Default::default()
    })
    .unwrap_err();
    assert!(err.contains("matches no trainable parameter"), "{err}");
    let err = select(Selection {
        axes: vec![("nope".into(), None)],
        ..Default::default()
    })
    .unwrap_err();
    assert!(err.contains("no trainable parameter"), "{err}");
    let err = select(Selection {
        axes: vec![("t.w".into(), Some(vec![2]))],
        ..Default::default()
    })
    .unwrap_err();
    assert!(err.contains("out of range"), "{err}");
}

// ---- the generated models -----------------------------------------------------------------

const MODELS: [&str; 6] = common::SHIPPED_GRAPHS;

fn open(model: &str) -> TrainingGraph {
    signature::open(
        &root().join("graphs").join(model),
        &ExplicitRoles::default(),
    )
    .unwrap_or_else(|e| panic!("{model}: {e}"))
}

fn data(model: &str) -> BTreeMap<String, Tensor> {
    read_npz(&root().join("graphs").join(model).join("data.npz"))
}

/// The units and the final layer of every generated model (the report `inspect --agc`
/// prints), decided from the forward consumer, not from ORT's gradient nodes.
#[test]
fn generated_models_units_and_final_layer() {
    let mut table = String::new();
    for model in MODELS {
        let graph = open(model);
        let plan = agc::plan(&graph.model, &graph.signature, &Selection::default()).unwrap();
        table.push_str(&format!("{model}: final layer {:?}\n", plan.final_layer));
        for p in &plan.params {
            table.push_str(&format!(
                "  {} {:?} {} units={}{}\n",
                p.name,
                p.dims,
                p.units.describe(),
                p.unit_count,
                match &p.excluded {
                    Some(why) => format!(" not clipped: {why}"),
                    None => String::new(),
                }
            ));
            assert!(p.note.is_none(), "{model} {}: {:?}", p.name, p.note);
        }
    }
    insta::assert_snapshot!("generated_units", table);
}

fn spec(steps: usize, agc: &str, lr: &str) -> String {
    format!("grad-accum(steps={steps},normalize=mean),{agc}optimizer({lr}),legalize-ort,dce")
}

fn train(step: &ModelProto, data: &BTreeMap<String, Tensor>, batch: usize, steps: u64) -> Trainer {
    let mut t = trainer(step);
    let samples = t.check_data(data, Path::new("data.npz")).unwrap();
    for i in 0..steps {
        t.step(&micro_batch(data, samples, batch, i), false)
            .unwrap();
    }
    t
}

fn max_abs_diff(a: &Tensor, b: &Tensor) -> f64 {
    f32s(a)
        .iter()
        .zip(f32s(b))
        .map(|(x, y)| (*x as f64 - y as f64).abs())
        .fold(0.0, f64::max)
}

/// K=4 micro-batches of 8 with AGC end within 2e-6 of K=1 batches of 32 with AGC after 8
/// windows: the window's mean gradient is clipped once. (Clipping each micro-batch's g/K
/// would be K times looser and differ.) AGC is active: without it the parameters differ.
#[test]
fn accumulated_agc_equals_full_batch_agc() {
    if !ort_available() {
        return;
    }
    for (model, agc, lr) in [
        ("mlp_ce_adamw", "agc(clip=0.01),", "lr=0.01"),
        ("mlp_mse_sgd", "agc(clip=0.01),", "lr=0.1"),
        ("transformer_block", "agc(clip=0.01),", "lr=0.01"),
    ] {
        let data = data(model);
        let accumulated = train(&build(open(model), &spec(4, agc, lr)), &data, 8, 32);
        let full = train(&build(open(model), &spec(1, agc, lr)), &data, 32, 8);
        let plain = train(&build(open(model), &spec(1, "", lr)), &data, 32, 8);
        let mut effect: f64 = 0.0;
        for p in open(model).signature.trainable() {
            let (a, f) = (
                &accumulated.state().unwrap()[&p.name],
                &full.state().unwrap()[&p.name],
            );
            assert_close(&format!("{model} {}", p.name), a, f, 0.0, 2e-6);
            let diff = max_abs_diff(a, f);
            let moved = max_abs_diff(f, &plain.state().unwrap()[&p.name]);
            eprintln!(
                "{model} {}: |K=4 - K=1| {diff:.1e}, AGC effect {moved:.1e}",
                p.name
            );
            effect = effect.max(moved);
        }
        assert!(effect > 1e-4, "{model}: AGC changed nothing ({effect:e})");
    }
}

/// Every generated model trains 8 windows (K=4 x B=8) with AGC, with the default selection
/// (final layer excluded) and with the final layer clipped too. Two windows cover the 64
/// samples once, so the mean loss of the last two windows is compared with that of the
/// first two (the same data). SGD models get a larger learning rate: AGC bounds each
/// unit's step to lr * clip * |W_u|.
#[test]
fn every_generated_model_trains_with_agc() {
    if !ort_available() {
        return;
    }
    for model in MODELS {
        let data = data(model);
        let sgd = matches!(
            open(model).signature.optimizer.as_ref().map(|o| &o.spec),
            Some(onnx_ga::signature::OptimizerSpec::Sgd)
        );
        let lr = if sgd { "lr=0.5" } else { "lr=0.01" };
        for agc in ["agc(clip=0.01),", "agc(clip=0.01,include_final=true),"] {
            let step = build(open(model), &spec(4, agc, lr));
            let mut t = trainer(&step);
            let samples = t.check_data(&data, Path::new("data.npz")).unwrap();
            let mut losses = Vec::new();
            for i in 0..32u64 {
                let m = t.step(&micro_batch(&data, samples, 8, i), false).unwrap();
                assert!(m.loss.is_finite(), "{model} {agc}: loss {}", m.loss);
                losses.push(m.loss as f64);
            }
            let first = losses[..8].iter().sum::<f64>() / 8.0;
            let last = losses[24..].iter().sum::<f64>() / 8.0;
            eprintln!("{model} {agc} {lr}: first two windows {first:.5}, last two {last:.5}");
            assert!(last < first, "{model} {agc}: loss {first} -> {last}");
        }
    }
}

// ---- snapshot -------------------------------------------------------------------------------

/// conv.w -> Conv -> Flatten -> Gemm(fc.w, transB=1) -> Relu -> MatMul(head.w) -> loss,
/// with gradients as inputs: conv.w and fc.w are clipped, head.w is the final layer.
fn small_model() -> TrainingGraph {
    let mut model = empty_model("agc_small");
    let main = BodyId::MAIN;
    let img = model.add_input(main, "img", tensor_type(FLOAT, &[1, 1, 4, 4]), None);
    let conv = param(&mut model, "conv.w", &[2, 1, 3, 3], &[0.1; 18]);
    let fc = param(&mut model, "fc.w", &[3, 8], &[0.1; 24]);
    let head = param(&mut model, "head.w", &[3, 1], &[0.1; 3]);
    let mut b = Builder::new(&mut model, main, "test");
    let c = b.op("Conv", &[img, conv], vec![], "c");
    let flat = b.op("Flatten", &[c], vec![], "flat");
    let h = b.op("Gemm", &[flat, fc], vec![attr_int("transB", 1)], "h");
    let r = b.op("Relu", &[h], vec![], "r");
    let out = b.op("MatMul", &[r, head], vec![], "out");
    let loss = b.op("ReduceSum", &[out], vec![attr_int("keepdims", 0)], "loss");
    model.add_output(main, loss, Some(tensor_type(FLOAT, &[])));
    strip_stamps(&mut model);
    let roles = ExplicitRoles {
        loss: Some("loss".into()),
        seed: None,
        grads: ["conv.w", "fc.w", "head.w"]
            .iter()
            .map(|n| (n.to_string(), format!("g.{n}")))
            .collect(),
    };
    signature::from_model(model.to_proto(), &roles, Path::new("agc_small.onnx")).unwrap()
}

#[test]
fn snapshot_agc_subgraph() {
    let step = onnx_ga::step::build_step(
        small_model(),
        "grad-accum(steps=2),agc(clip=0.01,eps=0.001),optimizer(kind=sgd,lr=0.1),dce",
        true,
    )
    .unwrap();
    let mut doc = format!("## Pipeline\n{}\n\n## Report\n", step.manifest.pipeline);
    for (pass, report) in &step.reports {
        doc.push_str(&format!("{pass}: {report}\n"));
    }
    doc.push_str("\n## Graph\n");
    doc.push_str(&onnx_ga::ir::print::print_model(&step.model));
    insta::assert_snapshot!("conv_gemm_subgraph", doc);
}

/// Spec errors: agc before grad-accum or after the optimizer, bad options.
#[test]
fn agc_spec_errors() {
    let fails = |spec: &str| match onnx_ga::step::build_step(small_model(), spec, true) {
        Ok(_) => panic!("{spec}: accepted"),
        Err(e) => e.to_string(),
    };
    let e = fails("agc,grad-accum(steps=2),optimizer(kind=sgd,lr=0.1)");
    assert!(e.contains("run grad-accum before agc"), "{e}");
    let e = fails("grad-accum(steps=2),optimizer(kind=sgd,lr=0.1),agc");
    assert!(e.contains("run agc before optimizer"), "{e}");
    let e = fails("grad-accum,agc(clip=0),optimizer(kind=sgd,lr=0.1)");
    assert!(e.contains("clip=0"), "{e}");
    let e = fails("grad-accum,agc(clipp=0.1),optimizer(kind=sgd,lr=0.1)");
    assert!(e.contains("unknown option 'clipp'"), "{e}");
    let e = fails("grad-accum,agc(exclude=nothing*),optimizer(kind=sgd,lr=0.1)");
    assert!(e.contains("matches no trainable parameter"), "{e}");
}

/// The CLI: `rewrite --agc` puts agc right before the optimizer; `inspect --agc` prints the
/// units and exclusions.
#[test]
fn cli_rewrite_and_inspect_agc() {
    use std::process::Command;
    let exe = env!("CARGO_BIN_EXE_onnx-ga");
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("step.onnx");
    let run = Command::new(exe)
        .args(["rewrite", "graphs/cnn_bn", "-o"])
        .arg(&out)
        .args([
            "--accum-steps",
            "4",
            "--lr",
            "0.01",
            "--agc",
            "0.02",
            "--agc-eps",
            "0.0001",
            "--agc-exclude",
            "bn.*",
            "--agc-axes",
            "conv.weight=1,2,3",
        ])
        .current_dir(root())
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&run.stderr);
    assert!(run.status.success(), "{stderr}");
    let pipeline = onnx_ga::state::Manifest::from_model(&onnx_ga::model::load_model(&out).unwrap())
        .unwrap()
        .pipeline;
    let at = |s: &str| {
        pipeline
            .find(s)
            .unwrap_or_else(|| panic!("{s} in {pipeline}"))
    };
    assert!(at("grad-accum(") < at("agc(") && at("agc(") < at("optimizer"));
    assert!(
        pipeline.contains("agc(clip=0.02,eps=0.0001,exclude=bn.*,axes=conv.weight:1/2/3)"),
        "{pipeline}"
    );
    assert!(
        stderr.contains("bn.weight (excluded by 'bn.*')"),
        "{stderr}"
    );

    let run = Command::new(exe)
        .args(["inspect", "graphs/mlp_mse_sgd", "--agc"])
        .current_dir(root())
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&run.stdout);
    assert!(
        run.status.success(),
        "{}",
        String::from_utf8_lossy(&run.stderr)
    );
    let agc_part = &stdout[stdout.find("agc units").expect("agc section")..];
    insta::assert_snapshot!("inspect_mlp_mse_sgd", agc_part);

    let run = Command::new(exe)
        .args([
            "inspect",
            "graphs/mlp_ce_adamw",
            "--agc",
            "--json",
            "--agc-include-final",
        ])
        .current_dir(root())
        .output()
        .unwrap();
    assert!(
        run.status.success(),
        "{}",
        String::from_utf8_lossy(&run.stderr)
    );
    let json: serde_json::Value = serde_json::from_slice(&run.stdout).unwrap();
    let params = json["agc"]["params"].as_array().unwrap();
    assert_eq!(params.len(), 4);
    assert!(params.iter().all(|p| p["excluded"].is_null()), "{params:?}");
    assert_eq!(params[0]["units"]["axes"], serde_json::json!([1]));

    // Selection flags need --agc; --agc with --pipeline is refused.
    let run = Command::new(exe)
        .args(["inspect", "graphs/mlp_ce_adamw", "--agc-include-final"])
        .current_dir(root())
        .output()
        .unwrap();
    assert_eq!(run.status.code(), Some(2));
    let run = Command::new(exe)
        .args(["rewrite", "graphs/mlp_ce_adamw", "-o"])
        .arg(&out)
        .args(["--agc", "0.01", "--pipeline", "grad-accum,optimizer"])
        .current_dir(root())
        .output()
        .unwrap();
    assert_eq!(run.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&run.stderr).contains("--pipeline"));
}

/// `inspect --agc` with `--agc-exclude` and `--agc-axes` shows the plan `rewrite --agc`
/// builds with them: the same lines for every parameter.
#[test]
fn inspect_agc_plan_with_selection_equals_the_rewrites() {
    let selection = ["--agc-exclude", "bn.*", "--agc-axes", "conv.weight=1,2,3"];
    let inspect = std::process::Command::new(env!("CARGO_BIN_EXE_onnx-ga"))
        .args(["inspect", "graphs/cnn_bn", "--agc"])
        .args(selection)
        .current_dir(root())
        .output()
        .unwrap();
    let shown = String::from_utf8_lossy(&inspect.stdout).into_owned()
        + &String::from_utf8_lossy(&inspect.stderr);
    assert!(inspect.status.success(), "{shown}");
    for line in [
        "conv.weight  [4,3,3,3]    axes [1,2,3]     4 units  clipped; overridden (axes=...)",
        "bn.weight    [4]          whole             1 unit  not clipped (excluded by 'bn.*')",
    ] {
        assert!(shown.contains(line), "{line}\n---\n{shown}");
    }
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("step.onnx");
    let rewrite = std::process::Command::new(env!("CARGO_BIN_EXE_onnx-ga"))
        .args(["rewrite", "graphs/cnn_bn", "-o"])
        .arg(&out)
        .args(["--lr", "0.01", "--agc", "0.02"])
        .args(selection)
        .current_dir(root())
        .output()
        .unwrap();
    let said = String::from_utf8_lossy(&rewrite.stderr);
    assert!(rewrite.status.success(), "{said}");
    // inspect: one line per parameter after "agc units"; rewrite: "clipped N: ...; not
    // clipped: ..." in the agc pass's report.
    let units = shown.split("agc units").nth(1).expect("an agc section");
    let report = said
        .lines()
        .find(|l| l.starts_with("agc("))
        .expect("the agc report");
    let not_clipped = report
        .split("not clipped:")
        .nth(1)
        .expect("a not-clipped list");
    for name in [
        "conv.weight",
        "conv.bias",
        "bn.weight",
        "bn.bias",
        "fc.weight",
        "fc.bias",
    ] {
        let in_inspect = units
            .lines()
            .find(|l| l.trim_start().starts_with(&format!("{name} ")))
            .map(|l| !l.contains("not clipped"));
        let in_rewrite = !not_clipped.contains(&format!("{name} "));
        assert_eq!(
            in_inspect,
            Some(in_rewrite),
            "{name}:\n{units}\n---\n{report}"
        );
    }
}
