//! File tests: every `tests/cases/**/*.onnxtxt` is one test, a document that states a rewrite
//! and shows its result.
//!
//! A case file is ONNX text (`onnx_ga::ir::text`, the language of `onnx.parser`) that opens
//! with `# key: value` lines:
//! - `pipeline:` (required) the pass spec, as `Pipeline::parse` and `step::build_step` take it;
//! - `about:` what the case shows (free text, repeatable);
//! - `loss:`, `seed:`, `grad: PARAM -> GRADIENT` (repeatable): the roles of a gradient graph,
//!   which is then built into a full step (`signature::from_model` + `step::build_step`);
//! - `source: forward`: a forward model for `autodiff` (`signature::forward` + `build_step`);
//! - `source: training-graph`: an ONNX Runtime training graph, roles found from its
//!   accumulators (`signature::from_model` without roles + `build_step`);
//!   without any of these, the pipeline runs alone over the graph with an empty signature,
//!   as the legalize tests run it, and the model is verified after it;
//! - `fixture:` a model file the input was converted from: the parsed input must equal it,
//!   so the text stays a faithful copy of the numeric tests' input;
//! - `expect: error`: the pipeline must fail; the snapshot shows the error.
//!
//! The snapshot (tests/snapshots/suite__file_cases__<dir>__<name>.snap) is the case file itself
//! followed by the result printed by `ir::print`: input and expected output in one document.
//! These are structural snapshots; numeric checks against independent references stay in
//! the topic tests (legalize_ops_a/b against ORT's training build, rewrite_snapshots against
//! the closed form, ...).
//!
//! A new file must be listed in `cases!` below (`every_case_file_is_listed` fails otherwise),
//! so that each case is its own test and one mismatch does not hide the others.

use crate::common;

use std::path::{Path, PathBuf};

use crate::common::root;
use onnx_ga::ir::{print::print_model, verify, Model};
use onnx_ga::passes::{PassContext, Pipeline};
use onnx_ga::proto::ModelProto;
use onnx_ga::signature::{self, ExplicitRoles, Source, TrainingSignature};

/// How a case's graph becomes a rewritten one.
enum Mode {
    /// The pipeline alone over the graph, empty signature.
    Passes,
    /// A gradient graph with explicit roles, built into a step.
    GradientGraph(ExplicitRoles),
    /// A forward model, built into a step (autodiff finds the roles).
    Forward,
    /// An ORT training graph, roles from its accumulators, built into a step.
    TrainingGraph,
}

struct Case {
    path: PathBuf,
    text: String,
    pipeline: String,
    mode: Mode,
    fixture: Option<PathBuf>,
    expect_error: bool,
}

fn cases_dir() -> PathBuf {
    root().join("tests/cases")
}

/// Reads the `# key: value` lines that open the file (they are comments to the parser).
fn read_case(relative: &str) -> Case {
    let path = cases_dir().join(relative);
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    let mut pipeline = None;
    let mut roles = ExplicitRoles::default();
    let mut source = None;
    let mut fixture = None;
    let mut expect_error = false;
    for (index, line) in text.lines().enumerate() {
        let Some(comment) = line.strip_prefix('#') else {
            break;
        };
        let Some((key, value)) = comment.split_once(':') else {
            continue;
        };
        let (key, value) = (key.trim(), value.trim());
        let at = format!("{relative}:{}", index + 1);
        match key {
            "pipeline" => pipeline = Some(value.to_string()),
            "about" => {}
            "loss" => roles.loss = Some(value.to_string()),
            "seed" => roles.seed = Some(value.to_string()),
            "grad" => {
                let (param, grad) = value
                    .split_once("->")
                    .unwrap_or_else(|| panic!("{at}: grad is 'PARAM -> GRADIENT'"));
                roles
                    .grads
                    .push((param.trim().to_string(), grad.trim().to_string()));
            }
            "source" => source = Some(value.to_string()),
            "fixture" => fixture = Some(root().join(value)),
            "expect" if value == "error" => expect_error = true,
            other => panic!("{at}: unknown key '{other}' (known: pipeline, about, loss, seed, grad, source, fixture, expect)"),
        }
    }
    let has_roles = roles.loss.is_some() || roles.seed.is_some() || !roles.grads.is_empty();
    let mode = match (source.as_deref(), has_roles) {
        (None, false) => Mode::Passes,
        (None | Some("gradient-graph"), true) => Mode::GradientGraph(roles),
        (Some("forward"), false) => Mode::Forward,
        (Some("training-graph"), false) => Mode::TrainingGraph,
        (Some(other), _) => panic!("{relative}: source '{other}' (known: forward, training-graph, gradient-graph; roles only with gradient-graph)"),
    };
    Case {
        path,
        text,
        pipeline: pipeline.unwrap_or_else(|| panic!("{relative}: no '# pipeline:' line")),
        mode,
        fixture,
        expect_error,
    }
}

fn empty_signature(file: &Path) -> TrainingSignature {
    TrainingSignature {
        source: Source::Plain {
            file: file.to_path_buf(),
        },
        data_inputs: Vec::new(),
        loss: String::new(),
        seed: None,
        params: Vec::new(),
        lazy_reset_grad: None,
        optimizer: None,
    }
}

/// The result of the rewrite as text (or its error, as `Err`).
fn rewrite(case: &Case, proto: ModelProto) -> Result<String, String> {
    // Relative, so that messages naming the file read the same on every machine.
    let relative = case.path.strip_prefix(root()).unwrap_or(&case.path);
    let file = relative;
    let graph = match &case.mode {
        Mode::Passes => {
            let mut model = Model::from_proto(proto);
            let mut signature = empty_signature(file);
            let mut cx = PassContext::new(&mut signature, None);
            let mut pipeline = Pipeline::parse(&case.pipeline).map_err(|e| e.to_string())?;
            pipeline.verify_each = true;
            let reports = pipeline
                .run(&mut model, &mut cx)
                .map_err(|e| e.to_string())?;
            verify::verify(&model).map_err(|e| format!("verify: {e}"))?;
            let mut doc = String::from("## Report\n");
            for (pass, report) in &reports {
                doc.push_str(&format!("{pass}: {report}\n"));
            }
            if !cx.state.is_empty() {
                doc.push_str("\n## State\n");
                for s in &cx.state {
                    let param = s
                        .param
                        .as_ref()
                        .map(|p| format!(" (of {p})"))
                        .unwrap_or_default();
                    doc.push_str(&format!(
                        "{:?} {} -> {}{param}\n",
                        s.role, s.input, s.output
                    ));
                }
            }
            doc.push_str("\n## Graph\n");
            doc.push_str(&print_model(&model));
            return Ok(doc);
        }
        Mode::GradientGraph(roles) => {
            signature::from_model(proto, roles, file).map_err(|e| e.to_string())?
        }
        Mode::TrainingGraph => signature::from_model(proto, &ExplicitRoles::default(), file)
            .map_err(|e| e.to_string())?,
        Mode::Forward => signature::forward(proto, file),
    };
    let step = onnx_ga::step::build_step(graph, &case.pipeline, true).map_err(|e| e.to_string())?;
    Ok(common::step_document(&step))
}

/// The fixture's model and the parsed text agree on everything the text can state.
fn assert_matches_fixture(relative: &str, parsed: &ModelProto, fixture: &Path) {
    let reference =
        onnx_ga::model::load_model(fixture).unwrap_or_else(|e| panic!("{relative}: fixture: {e}"));
    assert_eq!(
        *parsed,
        normalised(reference),
        "{relative}: the text is not a faithful copy of {}",
        fixture.display()
    );
}

/// A model as onnx's text would state it: node domains always present (the parser writes
/// `""` for the default domain, as onnx's does), doc strings dropped (the text has none).
fn normalised(mut model: ModelProto) -> ModelProto {
    model.doc_string = None;
    if let Some(graph) = model.graph.as_mut() {
        graph.doc_string = None;
        for node in &mut graph.node {
            node.doc_string = None;
            node.domain.get_or_insert_with(String::new);
            for a in &mut node.attribute {
                a.doc_string = None;
            }
        }
        for info in graph
            .input
            .iter_mut()
            .chain(&mut graph.output)
            .chain(&mut graph.value_info)
        {
            info.doc_string = None;
        }
    }
    model
}

fn run_case(relative: &str) {
    let case = read_case(relative);
    let proto = onnx_ga::ir::text::parse_model(&case.text)
        .unwrap_or_else(|e| panic!("tests/cases/{relative}:{e}"));
    if let Some(fixture) = &case.fixture {
        assert_matches_fixture(relative, &proto, fixture);
    }
    let result = match (rewrite(&case, proto), case.expect_error) {
        (Ok(doc), false) => doc,
        (Err(e), true) => format!("## Error\n{e}\n"),
        (Ok(_), true) => panic!("{relative}: 'expect: error' but the pipeline succeeded"),
        (Err(e), false) => panic!("{relative}: {e}"),
    };
    let document = format!(
        "{}\n# ---- after `{}` ----\n\n{result}",
        case.text.trim_end(),
        case.pipeline
    );
    let name = relative.trim_end_matches(".onnxtxt").replace('/', "__");
    let mut settings = insta::Settings::clone_current();
    settings.set_input_file(&case.path);
    settings.set_prepend_module_to_snapshot(true);
    settings.bind(|| insta::assert_snapshot!(name, document));
}

/// Every .onnxtxt under `dir`, relative to tests/cases, with `/` separators.
fn case_files(dir: &Path, out: &mut Vec<String>) {
    for entry in std::fs::read_dir(dir).unwrap() {
        let path = entry.unwrap().path();
        if path.is_dir() {
            case_files(&path, out);
        } else if path.extension().and_then(|e| e.to_str()) == Some("onnxtxt") {
            let relative = path.strip_prefix(cases_dir()).unwrap();
            out.push(relative.to_string_lossy().replace('\\', "/"));
        }
    }
}

#[test]
fn every_case_file_is_listed() {
    let mut found = Vec::new();
    case_files(&cases_dir(), &mut found);
    found.sort();
    let mut listed: Vec<String> = CASES.iter().map(|c| c.to_string()).collect();
    listed.sort();
    let missing: Vec<&String> = found.iter().filter(|f| !listed.contains(f)).collect();
    let stale: Vec<&String> = listed.iter().filter(|l| !found.contains(l)).collect();
    assert!(
        missing.is_empty() && stale.is_empty(),
        "tests/cases and cases! differ: files not listed {missing:?}, listed without a file {stale:?}"
    );
}

/// One `#[test]` per case file: `name => "dir/file.onnxtxt"`.
macro_rules! cases {
    ($($name:ident => $file:literal),* $(,)?) => {
        $(#[test] fn $name() { run_case($file); })*
        const CASES: &[&str] = &[$($file),*];
    };
}

cases! {
    dce_if_branches => "dce/if_branches.onnxtxt",
    errors_layer_norm_axis_out_of_range => "errors/layer_norm_axis_out_of_range.onnxtxt",
    errors_layer_norm_grad_axis_unknown_rank => "errors/layer_norm_grad_axis_unknown_rank.onnxtxt",
    errors_loop_body_draws_random => "errors/loop_body_draws_random.onnxtxt",
    errors_loop_body_signature => "errors/loop_body_signature.onnxtxt",
    errors_missing_gradient => "errors/missing_gradient.onnxtxt",
    errors_unknown_com_microsoft_op => "errors/unknown_com_microsoft_op.onnxtxt",
    errors_unsupported_reduction => "errors/unsupported_reduction.onnxtxt",
    forward_loop_at_run_time => "forward/loop_at_run_time.onnxtxt",
    forward_loop_too_long_to_unroll => "forward/loop_too_long_to_unroll.onnxtxt",
    forward_loop_unrolled => "forward/loop_unrolled.onnxtxt",
    forward_mlp_mse_sgd => "forward/mlp_mse_sgd.onnxtxt",
    forward_own_loss_autodiff => "forward/own_loss_autodiff.onnxtxt",
    forward_rnn_at_run_time => "forward/rnn_at_run_time.onnxtxt",
    legalize_accumulate => "legalize/accumulate.onnxtxt",
    legalize_accumulate_no_reset => "legalize/accumulate_no_reset.onnxtxt",
    legalize_accumulate_reset => "legalize/accumulate_reset.onnxtxt",
    legalize_adamw_mode0_step1 => "legalize/adamw_mode0_step1.onnxtxt",
    legalize_adamw_mode0_wd_step5 => "legalize/adamw_mode0_wd_step5.onnxtxt",
    legalize_adamw_mode1_nobias_step5 => "legalize/adamw_mode1_nobias_step5.onnxtxt",
    legalize_adamw_mode1_step1 => "legalize/adamw_mode1_step1.onnxtxt",
    legalize_adamw_mode1_wd_step5 => "legalize/adamw_mode1_wd_step5.onnxtxt",
    legalize_adamw_signal_false => "legalize/adamw_signal_false.onnxtxt",
    legalize_bias_fast_gelu_grad_dx => "legalize/bias_fast_gelu_grad_dx.onnxtxt",
    legalize_bias_gelu_grad_dx => "legalize/bias_gelu_grad_dx.onnxtxt",
    legalize_bn_grad_dx_only => "legalize/bn_grad_dx_only.onnxtxt",
    legalize_bn_grad_nc => "legalize/bn_grad_nc.onnxtxt",
    legalize_bn_grad_nchw => "legalize/bn_grad_nchw.onnxtxt",
    legalize_bn_internal_nc => "legalize/bn_internal_nc.onnxtxt",
    legalize_bn_internal_nchw => "legalize/bn_internal_nchw.onnxtxt",
    legalize_bn_internal_opset13 => "legalize/bn_internal_opset13.onnxtxt",
    legalize_conv_grad_1d => "legalize/conv_grad_1d.onnxtxt",
    legalize_conv_grad_3d => "legalize/conv_grad_3d.onnxtxt",
    legalize_conv_grad_depthwise => "legalize/conv_grad_depthwise.onnxtxt",
    legalize_conv_grad_depthwise_mult => "legalize/conv_grad_depthwise_mult.onnxtxt",
    legalize_conv_grad_dilated => "legalize/conv_grad_dilated.onnxtxt",
    legalize_conv_grad_dilated_strided => "legalize/conv_grad_dilated_strided.onnxtxt",
    legalize_conv_grad_dw_db => "legalize/conv_grad_dw_db.onnxtxt",
    legalize_conv_grad_dw_only => "legalize/conv_grad_dw_only.onnxtxt",
    legalize_conv_grad_dx_only => "legalize/conv_grad_dx_only.onnxtxt",
    legalize_conv_grad_group2 => "legalize/conv_grad_group2.onnxtxt",
    legalize_conv_grad_padded => "legalize/conv_grad_padded.onnxtxt",
    legalize_conv_grad_same_lower => "legalize/conv_grad_same_lower.onnxtxt",
    legalize_conv_grad_same_upper => "legalize/conv_grad_same_upper.onnxtxt",
    legalize_conv_grad_strided => "legalize/conv_grad_strided.onnxtxt",
    legalize_conv_grad_strided_nopad => "legalize/conv_grad_strided_nopad.onnxtxt",
    legalize_div_grad_broadcast => "legalize/div_grad_broadcast.onnxtxt",
    legalize_div_grad_same_shape => "legalize/div_grad_same_shape.onnxtxt",
    legalize_dropout_grad => "legalize/dropout_grad.onnxtxt",
    legalize_dropout_grad_default_ratio => "legalize/dropout_grad_default_ratio.onnxtxt",
    legalize_fast_gelu_grad => "legalize/fast_gelu_grad.onnxtxt",
    legalize_fused_matmul_2d => "legalize/fused_matmul_2d.onnxtxt",
    legalize_fused_matmul_batched => "legalize/fused_matmul_batched.onnxtxt",
    legalize_fused_matmul_broadcast => "legalize/fused_matmul_broadcast.onnxtxt",
    legalize_gather_elements_grad => "legalize/gather_elements_grad.onnxtxt",
    legalize_gather_grad_axis1 => "legalize/gather_grad_axis1.onnxtxt",
    legalize_gather_grad_embedding => "legalize/gather_grad_embedding.onnxtxt",
    legalize_gather_nd_grad => "legalize/gather_nd_grad.onnxtxt",
    legalize_gelu => "legalize/gelu.onnxtxt",
    legalize_gelu_grad => "legalize/gelu_grad.onnxtxt",
    legalize_layer_norm_grad_axis_m2 => "legalize/layer_norm_grad_axis_m2.onnxtxt",
    legalize_layer_norm_grad_dx_only => "legalize/layer_norm_grad_dx_only.onnxtxt",
    legalize_layer_norm_grad_last => "legalize/layer_norm_grad_last.onnxtxt",
    legalize_layer_norm_grad_two_axes => "legalize/layer_norm_grad_two_axes.onnxtxt",
    legalize_leaky_relu_grad => "legalize/leaky_relu_grad.onnxtxt",
    legalize_leaky_relu_grad_default => "legalize/leaky_relu_grad_default.onnxtxt",
    legalize_loop_as_scan => "legalize/loop_as_scan.onnxtxt",
    legalize_while_as_scan => "legalize/while_as_scan.onnxtxt",
    legalize_log_softmax_grad_13_axis1 => "legalize/log_softmax_grad_13_axis1.onnxtxt",
    legalize_log_softmax_grad_13_last => "legalize/log_softmax_grad_13_last.onnxtxt",
    legalize_log_softmax_grad_v1 => "legalize/log_softmax_grad_v1.onnxtxt",
    legalize_max_pool_grad_ceil => "legalize/max_pool_grad_ceil.onnxtxt",
    legalize_max_pool_grad_indices_input => "legalize/max_pool_grad_indices_input.onnxtxt",
    legalize_max_pool_grad_k2s2 => "legalize/max_pool_grad_k2s2.onnxtxt",
    legalize_max_pool_grad_k3s2 => "legalize/max_pool_grad_k3s2.onnxtxt",
    legalize_max_pool_grad_nonsquare => "legalize/max_pool_grad_nonsquare.onnxtxt",
    legalize_max_pool_grad_padded => "legalize/max_pool_grad_padded.onnxtxt",
    legalize_quick_gelu_grad => "legalize/quick_gelu_grad.onnxtxt",
    legalize_quick_gelu_grad_alpha => "legalize/quick_gelu_grad_alpha.onnxtxt",
    legalize_relu_grad => "legalize/relu_grad.onnxtxt",
    legalize_scale_float => "legalize/scale_float.onnxtxt",
    legalize_scale_float1_down => "legalize/scale_float1_down.onnxtxt",
    legalize_scale_int64_down => "legalize/scale_int64_down.onnxtxt",
    legalize_sce_grad_mean => "legalize/sce_grad_mean.onnxtxt",
    legalize_sce_grad_mean_all_ignored => "legalize/sce_grad_mean_all_ignored.onnxtxt",
    legalize_sce_grad_mean_kdim => "legalize/sce_grad_mean_kdim.onnxtxt",
    legalize_sce_grad_mean_weight => "legalize/sce_grad_mean_weight.onnxtxt",
    legalize_sce_grad_mean_weight_ignore => "legalize/sce_grad_mean_weight_ignore.onnxtxt",
    legalize_sce_grad_none => "legalize/sce_grad_none.onnxtxt",
    legalize_sce_grad_none_weight_ignore => "legalize/sce_grad_none_weight_ignore.onnxtxt",
    legalize_sce_grad_sum => "legalize/sce_grad_sum.onnxtxt",
    legalize_sce_grad_sum_weight_ignore => "legalize/sce_grad_sum_weight_ignore.onnxtxt",
    legalize_sgd => "legalize/sgd.onnxtxt",
    legalize_sgd_signal_true => "legalize/sgd_signal_true.onnxtxt",
    legalize_sigmoid_grad => "legalize/sigmoid_grad.onnxtxt",
    legalize_simplified_layer_norm_grad => "legalize/simplified_layer_norm_grad.onnxtxt",
    legalize_simplified_layer_norm_grad_two_axes => "legalize/simplified_layer_norm_grad_two_axes.onnxtxt",
    legalize_softmax_grad_13_axis1 => "legalize/softmax_grad_13_axis1.onnxtxt",
    legalize_softmax_grad_13_last => "legalize/softmax_grad_13_last.onnxtxt",
    legalize_softmax_grad_v1 => "legalize/softmax_grad_v1.onnxtxt",
    legalize_tanh_grad => "legalize/tanh_grad.onnxtxt",
    steps_adamw_where => "steps/adamw_where.onnxtxt",
    steps_agc => "steps/agc.onnxtxt",
    steps_clip_norm => "steps/clip_norm.onnxtxt",
    steps_loss_scale_dynamic => "steps/loss_scale_dynamic.onnxtxt",
    steps_loss_scale_static => "steps/loss_scale_static.onnxtxt",
    steps_momentum_sum => "steps/momentum_sum.onnxtxt",
    steps_precision_bf16 => "steps/precision_bf16.onnxtxt",
    steps_precision_fp16 => "steps/precision_fp16.onnxtxt",
    steps_sgd_mean => "steps/sgd_mean.onnxtxt",
    steps_weighted_nesterov => "steps/weighted_nesterov.onnxtxt",
    training_graph_accumulators_sgd => "training_graph/accumulators_sgd.onnxtxt",
}
