//! Bad graphs are refused at load, before anything is written: each edit of a shipped
//! training graph (unknown or empty op types, attributes of the wrong type, bad opset
//! imports, initializers whose data does not match their dims, duplicate names) makes
//! `rewrite` exit 2 naming the file and the node or tensor, and write nothing. Also: the
//! checkpoint's `.data` file is confined to its folder like ONNX external data, and a step
//! whose apply `If` is not the one its manifest describes (swapped branches) or whose
//! manifest lists no state is refused by `train`.

use crate::common;

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use crate::common::root;
use onnx_ga::proto::attribute_proto::AttributeType;
use onnx_ga::proto::{ModelProto, OperatorSetIdProto, TensorProto};
use prost::Message;

fn onnx_ga(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_onnx-ga"))
        .args(args)
        .output()
        .expect("run onnx-ga")
}

/// A copy of graphs/mlp_ce_adamw with its training model edited by `edit`.
fn edited(dir: &Path, edit: impl FnOnce(&mut ModelProto)) -> PathBuf {
    let src = root().join("graphs/mlp_ce_adamw");
    let folder = dir.join("artifacts");
    std::fs::create_dir_all(&folder).unwrap();
    for f in ["checkpoint", "optimizer_model.onnx", "eval_model.onnx"] {
        std::fs::copy(src.join(f), folder.join(f)).unwrap();
    }
    let mut model =
        ModelProto::decode(&std::fs::read(src.join("training_model.onnx")).unwrap()[..]).unwrap();
    edit(&mut model);
    std::fs::write(folder.join("training_model.onnx"), model.encode_to_vec()).unwrap();
    folder
}

fn node<'a>(m: &'a mut ModelProto, name: &str) -> &'a mut onnx_ga::proto::NodeProto {
    m.graph
        .as_mut()
        .unwrap()
        .node
        .iter_mut()
        .find(|n| n.name() == name)
        .unwrap()
}

fn init<'a>(m: &'a mut ModelProto, name: &str) -> &'a mut TensorProto {
    m.graph
        .as_mut()
        .unwrap()
        .initializer
        .iter_mut()
        .find(|t| t.name() == name)
        .unwrap()
}

fn opset(domain: &str, version: Option<i64>) -> OperatorSetIdProto {
    OperatorSetIdProto {
        domain: Some(domain.into()),
        version,
    }
}

const GRAD_SEED: &str = "onnx::loss::2_grad";
const SEED_INIT: &str = "initializer 'onnx::loss::2_grad'";

type Edit = Box<dyn Fn(&mut ModelProto)>;

#[test]
fn bad_graphs_are_refused_at_load_naming_what_is_wrong() {
    let cases: Vec<(&str, Edit, &[&str])> = vec![
        (
            "unknown op",
            Box::new(|m| node(m, "Relu_1").op_type = Some("Reluu".into())),
            &["node 'Relu_1'", "unknown op 'Reluu'"],
        ),
        (
            "empty op type",
            Box::new(|m| node(m, "Relu_1").op_type = Some(String::new())),
            &["node 'Relu_1'", "empty op type"],
        ),
        (
            "attribute of the wrong type",
            Box::new(|m| {
                let a = node(m, "Gemm_0")
                    .attribute
                    .iter_mut()
                    .find(|a| a.name() == "transB")
                    .unwrap();
                a.r#type = Some(AttributeType::Float as i32);
                a.i = None;
                a.f = Some(1.0);
            }),
            &[
                "node 'Gemm_0'",
                "attribute 'transB' is FLOAT",
                "expects INT",
            ],
        ),
        (
            "missing required attribute",
            Box::new(|m| {
                let n = node(m, "Gemm_2_Grad/ReduceSum_3");
                n.input.truncate(1);
                n.op_type = Some("Cast".into());
            }),
            &["required attribute 'to' of Cast is missing"],
        ),
        (
            "no default-domain opset",
            Box::new(|m| m.opset_import.retain(|o| !o.domain().is_empty())),
            &[
                "node 'Gemm_0'",
                "domain 'ai.onnx' is not in the model's opset imports",
            ],
        ),
        (
            "zero opset version",
            Box::new(|m| m.opset_import[0].version = Some(0)),
            &["opset_import", "version 0"],
        ),
        (
            "negative opset version",
            Box::new(|m| m.opset_import[0].version = Some(-3)),
            &["opset_import", "version -3"],
        ),
        (
            "duplicate opset import",
            Box::new(|m| m.opset_import.push(opset("ai.onnx", Some(13)))),
            &["opset_import", "more than once"],
        ),
        (
            "op not at this opset",
            Box::new(|m| m.opset_import[0].version = Some(1)),
            &["is not defined at opset 1"],
        ),
        (
            "raw data shorter than dims",
            Box::new(|m| {
                // One float as raw bytes, where the dims claim three.
                let t = init(m, GRAD_SEED);
                t.float_data.clear();
                t.raw_data = Some(1.0f32.to_le_bytes().to_vec());
                t.dims = vec![3];
            }),
            &[SEED_INIT, "raw_data holds 4 bytes", "need 12"],
        ),
        (
            "dims whose product overflows",
            Box::new(|m| init(m, GRAD_SEED).dims = vec![1 << 40, 1 << 40]),
            &[SEED_INIT, "overflows"],
        ),
        (
            "raw data of another dtype",
            Box::new(|m| init(m, GRAD_SEED).data_type = Some(11)),
            &[SEED_INIT, "DOUBLE"],
        ),
        (
            "invalid data type",
            Box::new(|m| init(m, GRAD_SEED).data_type = Some(99)),
            &[SEED_INIT, "data type 99"],
        ),
        (
            "duplicate initializer",
            Box::new(|m| {
                let t = init(m, GRAD_SEED).clone();
                m.graph.as_mut().unwrap().initializer.push(t);
            }),
            &[SEED_INIT, "duplicate initializer"],
        ),
        (
            "output defined twice",
            Box::new(|m| {
                let out = node(m, "Gemm_0").output[0].clone();
                node(m, "Relu_1").output[0] = out;
            }),
            &["node 'Relu_1'", "single static assignment"],
        ),
    ];
    let mut failures = Vec::new();
    for (what, edit, expected) in &cases {
        let dir = tempfile::tempdir().unwrap();
        let folder = edited(dir.path(), edit);
        let out_path = dir.path().join("step.onnx");
        let out = onnx_ga(&[
            "rewrite",
            folder.to_str().unwrap(),
            "-o",
            out_path.to_str().unwrap(),
            "--lr",
            "0.01",
        ]);
        let stderr = String::from_utf8_lossy(&out.stderr);
        let ok = out.status.code() == Some(2)
            && stderr.contains("training_model.onnx")
            && expected.iter().all(|e| stderr.contains(e))
            && !stderr.contains("panicked")
            && !out_path.exists();
        if !ok {
            failures.push(format!("{what}: exit {:?}\n{stderr}", out.status.code()));
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n---\n"));
}

#[test]
fn every_shipped_graph_and_forward_model_validates() {
    for g in common::SHIPPED_GRAPHS {
        for f in [
            "training_model.onnx",
            "optimizer_model.onnx",
            "eval_model.onnx",
        ] {
            let p = root().join("graphs").join(g).join(f);
            if p.exists() {
                onnx_ga::model::load_model_with_data(&p)
                    .unwrap_or_else(|e| panic!("{}: {e}", p.display()));
            }
        }
    }
    for entry in std::fs::read_dir(root().join("graphs/forward")).unwrap() {
        for entry in std::fs::read_dir(entry.unwrap().path())
            .into_iter()
            .flatten()
        {
            let p = entry.unwrap().path();
            if p.extension().is_some_and(|e| e == "onnx") {
                onnx_ga::model::load_model_with_data(&p)
                    .unwrap_or_else(|e| panic!("{}: {e}", p.display()));
            }
        }
    }
}

#[test]
fn checkpoint_data_symlink_out_of_the_folder_is_refused() {
    let data = root().join("tests/data/checkpoint");
    let dir = tempfile::tempdir().unwrap();
    let inside = dir.path().join("inside");
    let outside = dir.path().join("outside");
    std::fs::create_dir_all(&inside).unwrap();
    std::fs::create_dir_all(&outside).unwrap();
    std::fs::copy(data.join("external.ckpt"), inside.join("external.ckpt")).unwrap();
    std::fs::copy(data.join("external.ckpt.data"), outside.join("x.data")).unwrap();
    std::os::unix::fs::symlink("../outside/x.data", inside.join("external.ckpt.data")).unwrap();
    let err = onnx_ga::checkpoint::read_checkpoint(&inside.join("external.ckpt")).unwrap_err();
    let text = err.to_string();
    assert!(
        text.contains("outside the checkpoint folder") && text.contains("external.ckpt"),
        "{text}"
    );
    // A link that stays inside the folder is fine.
    std::fs::remove_file(inside.join("external.ckpt.data")).unwrap();
    std::fs::copy(data.join("external.ckpt.data"), inside.join("real.data")).unwrap();
    std::os::unix::fs::symlink("real.data", inside.join("external.ckpt.data")).unwrap();
    let ckpt = onnx_ga::checkpoint::read_checkpoint(&inside.join("external.ckpt")).unwrap();
    assert!(ckpt.has_external_data);
}

/// A written step with `edit` applied to its proto.
fn step_edited(dir: &Path, edit: impl FnOnce(&mut ModelProto)) -> PathBuf {
    let step = dir.join("step.onnx");
    let out = onnx_ga(&[
        "rewrite",
        root().join("graphs/mlp_ce_adamw").to_str().unwrap(),
        "-o",
        step.to_str().unwrap(),
        "--lr",
        "0.01",
        "--accum-steps",
        "2",
    ]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let mut model = ModelProto::decode(&std::fs::read(&step).unwrap()[..]).unwrap();
    edit(&mut model);
    let edited = dir.join("edited.onnx");
    std::fs::write(&edited, model.encode_to_vec()).unwrap();
    edited
}

fn train(step: &Path, extra: &[&str]) -> Output {
    let data = root().join("graphs/mlp_ce_adamw/data.npz");
    let mut args = common::cli_train(step, &data, "4", &["--engine", "tract", "--quiet"]);
    args.extend(extra);
    onnx_ga(&args)
}

#[test]
fn a_step_whose_apply_if_is_not_the_manifests_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let swapped = step_edited(dir.path(), |m| {
        let g = m.graph.as_mut().unwrap();
        let n = g
            .node
            .iter_mut()
            .find(|n| n.op_type() == "If" && n.name() == "ga.apply_window")
            .unwrap();
        for a in &mut n.attribute {
            a.name = Some(match a.name() {
                "then_branch" => "else_branch".into(),
                _ => "then_branch".into(),
            });
        }
    });
    for extra in [&[][..], &["--no-split"][..]] {
        let out = train(&swapped, extra);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{extra:?}: {stderr}");
        assert!(
            stderr.contains("ga.apply_window") && stderr.contains("swapped"),
            "{stderr}"
        );
    }
    // A condition that is not the manifest's (always apply) is refused too.
    let rewired = step_edited(dir.path(), |m| {
        let g = m.graph.as_mut().unwrap();
        let n = g
            .node
            .iter_mut()
            .find(|n| n.op_type() == "If" && n.name() == "ga.apply_window")
            .unwrap();
        n.input[0] = "ga.flush".into();
    });
    let out = train(&rewired, &[]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{stderr}");
    assert!(stderr.contains("not the apply region"), "{stderr}");
    // The unedited step trains.
    let fine = step_edited(dir.path(), |_| {});
    let out = train(&fine, &[]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

#[test]
fn a_step_whose_manifest_lists_no_state_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let empty = step_edited(dir.path(), |m| {
        for p in &mut m.metadata_props {
            if p.key() == onnx_ga::state::STATE_KEY {
                p.value = Some("[]".into());
            }
        }
    });
    let out = train(&empty, &[]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{stderr}");
    assert!(stderr.contains("lists no state"), "{stderr}");
}
