//! The verifier (`onnx_ga::ir::verify::verify`) on seeded defects: each is reported with
//! its location (`<body path>: node '<name>' (<op>)`, `<body path>: output <i> '<name>'`,
//! `state '<input>'`), all defects of a model are reported together, and every graph in
//! graphs/ verifies clean.

use std::path::{Path, PathBuf};

use onnx_ga::ir::verify::{verify, VerifyError};
use onnx_ga::ir::{BodyId, Model};
use onnx_ga::proto::attribute_proto::AttributeType;
use onnx_ga::proto::tensor_proto::DataType;
use onnx_ga::proto::{
    AttributeProto, GraphProto, ModelProto, NodeProto, OperatorSetIdProto, StringStringEntryProto,
    TensorProto, ValueInfoProto,
};

// ----------------------------------------------------------------- model building

fn value(name: &str, elem: DataType) -> ValueInfoProto {
    ValueInfoProto {
        name: Some(name.into()),
        r#type: Some(onnx_ga::ir::tensor_type(elem as i32, &[2])),
        ..Default::default()
    }
}

fn float(name: &str) -> ValueInfoProto {
    value(name, DataType::Float)
}

fn node(name: &str, op: &str, inputs: &[&str], outputs: &[&str]) -> NodeProto {
    NodeProto {
        name: Some(name.into()),
        op_type: Some(op.into()),
        input: inputs.iter().map(|s| s.to_string()).collect(),
        output: outputs.iter().map(|s| s.to_string()).collect(),
        ..Default::default()
    }
}

fn graph(
    name: &str,
    nodes: Vec<NodeProto>,
    inputs: Vec<ValueInfoProto>,
    outputs: Vec<ValueInfoProto>,
) -> GraphProto {
    GraphProto {
        name: Some(name.into()),
        node: nodes,
        input: inputs,
        output: outputs,
        ..Default::default()
    }
}

fn graph_attr(name: &str, g: GraphProto) -> AttributeProto {
    AttributeProto {
        name: Some(name.into()),
        r#type: Some(AttributeType::Graph as i32),
        g: Some(g),
        ..Default::default()
    }
}

/// `outputs = If(cond)` with the given branches.
fn if_node(name: &str, outputs: &[&str], then_b: GraphProto, else_b: GraphProto) -> NodeProto {
    let mut n = node(name, "If", &["cond"], outputs);
    n.attribute.push(graph_attr("then_branch", then_b));
    n.attribute.push(graph_attr("else_branch", else_b));
    n
}

fn model_with(g: GraphProto, opsets: &[(&str, i64)]) -> ModelProto {
    ModelProto {
        ir_version: Some(8),
        opset_import: opsets
            .iter()
            .map(|(d, v)| OperatorSetIdProto {
                domain: Some(d.to_string()),
                version: Some(*v),
            })
            .collect(),
        graph: Some(g),
        ..Default::default()
    }
}

fn model(g: GraphProto) -> Model {
    Model::from_proto(model_with(g, &[("", 17)]))
}

fn errors(m: &Model) -> Vec<VerifyError> {
    match verify(m) {
        Ok(()) => Vec::new(),
        Err(e) => e.0,
    }
}

/// Asserts that `errors` are exactly `expected` (location, message substring), in any order.
fn assert_errors(errors: &[VerifyError], expected: &[(&str, &str)]) {
    let shown: Vec<String> = errors.iter().map(|e| e.to_string()).collect();
    assert_eq!(
        errors.len(),
        expected.len(),
        "want {} errors, got:\n{}",
        expected.len(),
        shown.join("\n")
    );
    for (location, message) in expected {
        assert!(
            errors
                .iter()
                .any(|e| e.location == *location && e.message.contains(message)),
            "no error at {location:?} containing {message:?}; got:\n{}",
            shown.join("\n")
        );
    }
}

// ----------------------------------------------------------------- baseline

/// A valid model with an `If` whose branches capture outer values: no errors.
fn valid_if_graph() -> GraphProto {
    let then_b = graph(
        "then_g",
        vec![node("t1", "Relu", &["a"], &["t"])],
        vec![],
        vec![float("t")],
    );
    let else_b = graph(
        "else_g",
        vec![node("e1", "Neg", &["x"], &["e"])],
        vec![],
        vec![float("e")],
    );
    graph(
        "main_g",
        vec![
            node("n1", "Relu", &["x"], &["a"]),
            if_node("if", &["y"], then_b, else_b),
            node("n2", "Add", &["y", "a"], &["z"]),
        ],
        vec![float("x"), value("cond", DataType::Bool)],
        vec![float("z")],
    )
}

#[test]
fn valid_model_with_if_and_captures_verifies() {
    assert_errors(&errors(&model(valid_if_graph())), &[]);
}

#[test]
fn every_generated_graph_verifies() {
    fn onnx_files(dir: &Path, out: &mut Vec<PathBuf>) {
        for entry in std::fs::read_dir(dir).unwrap() {
            let path = entry.unwrap().path();
            if path.is_dir() {
                onnx_files(&path, out);
            } else if path.extension().is_some_and(|e| e == "onnx") {
                out.push(path);
            }
        }
    }
    let mut files = Vec::new();
    onnx_files(
        &Path::new(env!("CARGO_MANIFEST_DIR")).join("graphs"),
        &mut files,
    );
    files.sort();
    // Six models, each with training, eval and optimizer graphs.
    assert!(files.len() >= 18, "found only {files:?}");
    for file in files {
        let proto = onnx_ga::model::load_model_with_data(&file).unwrap_or_else(|e| panic!("{e}"));
        if let Err(e) = verify(&Model::from_proto(proto)) {
            panic!("{}: {e}", file.display());
        }
    }
}

// ----------------------------------------------------------------- definitions

#[test]
fn dangling_input() {
    let g = graph(
        "g",
        vec![node("n1", "Add", &["x", "ghost"], &["y"])],
        vec![float("x")],
        vec![float("y")],
    );
    assert_errors(
        &errors(&model(g)),
        &[(
            "main: node 'n1' (Add)",
            "input 1 'ghost' is not defined by any node, graph input or initializer",
        )],
    );
}

#[test]
fn dangling_graph_output() {
    let g = graph(
        "g",
        vec![node("n1", "Relu", &["x"], &["y"])],
        vec![float("x")],
        vec![float("y"), float("z")],
    );
    assert_errors(
        &errors(&model(g)),
        &[(
            "main: output 1 'z'",
            "is not defined by any node, graph input or initializer",
        )],
    );
}

#[test]
fn dangling_input_in_subgraph() {
    let mut g = valid_if_graph();
    let then_b = graph(
        "then_g",
        vec![node("t1", "Relu", &["nowhere"], &["t"])],
        vec![],
        vec![float("t")],
    );
    g.node[1].attribute[0] = graph_attr("then_branch", then_b);
    assert_errors(
        &errors(&model(g)),
        &[(
            "main/if.then_branch: node 't1' (Relu)",
            "input 0 'nowhere' is not defined by any node, graph input or initializer",
        )],
    );
}

#[test]
fn value_of_sibling_subgraph_used_outside() {
    // `t` lives in then_branch: neither else_branch nor the main graph can see it.
    let then_b = graph(
        "then_g",
        vec![node("t1", "Relu", &["x"], &["t"])],
        vec![],
        vec![float("t")],
    );
    let else_b = graph(
        "else_g",
        vec![node("e1", "Identity", &["t"], &["e"])],
        vec![],
        vec![float("e")],
    );
    let g = graph(
        "g",
        vec![
            if_node("if", &["y"], then_b, else_b),
            node("after", "Add", &["y", "t"], &["z"]),
        ],
        vec![float("x"), value("cond", DataType::Bool)],
        vec![float("z")],
    );
    assert_errors(
        &errors(&model(g)),
        &[
            (
                "main/if.else_branch: node 'e1' (Identity)",
                "input 0 't' is defined in main/if.then_branch, which is not visible here",
            ),
            (
                "main: node 'after' (Add)",
                "input 1 't' is defined in main/if.then_branch, which is not visible here",
            ),
        ],
    );
}

#[test]
fn rewired_to_a_subgraph_value() {
    // The same defect made through the IR's mutation API rather than by name.
    let mut m = model(valid_if_graph());
    let n2 = m
        .body_nodes(BodyId::MAIN)
        .find(|n| m.node(*n).proto.name() == "n2")
        .unwrap();
    let then_body = m.node(m.body_nodes(BodyId::MAIN).nth(1).unwrap()).subgraphs[0].body;
    let t = m.lookup(then_body, "t").unwrap();
    m.set_input(n2, 1, Some(t));
    assert_errors(
        &errors(&m),
        &[(
            "main: node 'n2' (Add)",
            "input 1 't' is defined in main/if.then_branch, which is not visible here",
        )],
    );
}

// ----------------------------------------------------------------- unique names

#[test]
fn duplicate_value_name() {
    let g = graph(
        "g",
        vec![
            node("n1", "Relu", &["x"], &["y"]),
            node("n2", "Neg", &["x"], &["y"]),
        ],
        vec![float("x")],
        vec![float("y")],
    );
    assert_errors(
        &errors(&model(g)),
        &[(
            "main: node 'n2' (Neg)",
            "output 0 'y' is already defined by node 'n1' (Relu) in main",
        )],
    );
}

#[test]
fn node_output_shadows_graph_input() {
    let g = graph(
        "g",
        vec![node("n1", "Relu", &["x"], &["x"])],
        vec![float("x")],
        vec![float("x")],
    );
    assert_errors(
        &errors(&model(g)),
        &[(
            "main: node 'n1' (Relu)",
            "output 0 'x' is already defined by a graph input of main",
        )],
    );
}

#[test]
fn subgraph_redefines_outer_name() {
    // ONNX forbids shadowing: a branch may not define a name of the enclosing graph.
    let mut g = valid_if_graph();
    let then_b = graph(
        "then_g",
        vec![node("t1", "Relu", &["x"], &["a"])],
        vec![],
        vec![float("a")],
    );
    g.node[1].attribute[0] = graph_attr("then_branch", then_b);
    assert_errors(
        &errors(&model(g)),
        &[(
            "main/if.then_branch: node 't1' (Relu)",
            "output 0 'a' is already defined by node 'n1' (Relu) in main",
        )],
    );
}

#[test]
fn sibling_subgraphs_may_reuse_names() {
    // Each branch is its own scope: tf2onnx gives two loop bodies the same names (a
    // Bidirectional layer's two while loops), and ONNX allows it; the main graph may not.
    let mut g = valid_if_graph();
    let then_b = graph(
        "then_g",
        vec![node("same_node", "Relu", &["a"], &["same"])],
        vec![],
        vec![float("same")],
    );
    let else_b = graph(
        "else_g",
        vec![node("same_node", "Neg", &["x"], &["same"])],
        vec![],
        vec![float("same")],
    );
    g.node[1].attribute[0] = graph_attr("then_branch", then_b);
    g.node[1].attribute[1] = graph_attr("else_branch", else_b);
    assert_errors(&errors(&model(g)), &[]);
}

#[test]
fn duplicate_initializer() {
    let mut g = graph(
        "g",
        vec![node("n1", "Add", &["x", "w"], &["y"])],
        vec![float("x")],
        vec![float("y")],
    );
    let w = TensorProto {
        name: Some("w".into()),
        dims: vec![2],
        data_type: Some(DataType::Float as i32),
        raw_data: Some(vec![0; 8]),
        ..Default::default()
    };
    g.initializer = vec![w.clone(), w];
    assert_errors(
        &errors(&model(g)),
        &[(
            "main: initializer 'w'",
            "is already defined by an initializer of main",
        )],
    );
}

#[test]
fn duplicate_node_name() {
    let g = graph(
        "g",
        vec![
            node("n", "Relu", &["x"], &["a"]),
            node("n", "Neg", &["a"], &["y"]),
        ],
        vec![float("x")],
        vec![float("y")],
    );
    assert_errors(
        &errors(&model(g)),
        &[(
            "main: node 'n' (Neg)",
            "node name is used by another node too",
        )],
    );
}

// ----------------------------------------------------------------- cycles

#[test]
fn cycle() {
    // `late` only depends on the cycle and is not blamed for it.
    let g = graph(
        "g",
        vec![
            node("late", "Identity", &["a"], &["y"]),
            node("n1", "Add", &["x", "b"], &["a"]),
            node("n2", "Neg", &["a"], &["b"]),
        ],
        vec![float("x")],
        vec![float("y")],
    );
    assert_errors(
        &errors(&model(g)),
        &[(
            "main: node 'n1' (Add)",
            "is part of a cycle: 'n1' -> 'n2' -> 'n1'",
        )],
    );
}

#[test]
fn self_loop() {
    let g = graph(
        "g",
        vec![node("loop", "Add", &["x", "a"], &["a"])],
        vec![float("x")],
        vec![float("a")],
    );
    assert_errors(
        &errors(&model(g)),
        &[(
            "main: node 'loop' (Add)",
            "is part of a cycle: 'loop' -> 'loop'",
        )],
    );
}

#[test]
fn cycle_through_a_subgraph_capture() {
    // The If's branch reads `c`, which is computed from the If's own output.
    let then_b = graph(
        "then_g",
        vec![node("t1", "Identity", &["c"], &["t"])],
        vec![],
        vec![float("t")],
    );
    let else_b = graph(
        "else_g",
        vec![node("e1", "Identity", &["x"], &["e"])],
        vec![],
        vec![float("e")],
    );
    let g = graph(
        "g",
        vec![
            if_node("if", &["y"], then_b, else_b),
            node("n1", "Relu", &["y"], &["c"]),
        ],
        vec![float("x"), value("cond", DataType::Bool)],
        vec![float("c")],
    );
    assert_errors(
        &errors(&model(g)),
        &[(
            "main: node 'if' (If)",
            "is part of a cycle: 'if' -> 'n1' -> 'if'",
        )],
    );
}

#[test]
fn two_cycles_are_two_errors() {
    let g = graph(
        "g",
        vec![
            node("a1", "Relu", &["a2o"], &["a1o"]),
            node("a2", "Relu", &["a1o"], &["a2o"]),
            node("b1", "Relu", &["b3o"], &["b1o"]),
            node("b2", "Relu", &["b1o"], &["b2o"]),
            node("b3", "Add", &["b2o", "a1o"], &["b3o"]),
        ],
        vec![],
        vec![float("b3o")],
    );
    assert_errors(
        &errors(&model(g)),
        &[
            (
                "main: node 'a1' (Relu)",
                "is part of a cycle: 'a1' -> 'a2' -> 'a1'",
            ),
            (
                "main: node 'b1' (Relu)",
                "is part of a cycle: 'b1' -> 'b2' -> 'b3' -> 'b1'",
            ),
        ],
    );
}

// ----------------------------------------------------------------- If branches

#[test]
fn if_branch_output_count_mismatch() {
    let then_b = graph(
        "then_g",
        vec![node("t1", "Relu", &["x"], &["t"])],
        vec![],
        vec![float("t")],
    );
    let else_b = graph(
        "else_g",
        vec![
            node("e1", "Neg", &["x"], &["e"]),
            node("e2", "Abs", &["x"], &["f"]),
        ],
        vec![],
        vec![float("e"), float("f")],
    );
    let g = graph(
        "g",
        vec![if_node("if", &["y"], then_b, else_b)],
        vec![float("x"), value("cond", DataType::Bool)],
        vec![float("y")],
    );
    assert_errors(
        &errors(&model(g)),
        &[(
            "main: node 'if' (If)",
            "else_branch has 2 outputs but the If node has 1",
        )],
    );
}

#[test]
fn if_branch_elem_type_mismatch() {
    let then_b = graph(
        "then_g",
        vec![node("t1", "Relu", &["x"], &["t"])],
        vec![],
        vec![float("t")],
    );
    let else_b = graph(
        "else_g",
        vec![node("e1", "Shape", &["x"], &["e"])],
        vec![],
        vec![value("e", DataType::Int64)],
    );
    let g = graph(
        "g",
        vec![if_node("if", &["y"], then_b, else_b)],
        vec![float("x"), value("cond", DataType::Bool)],
        vec![float("y")],
    );
    assert_errors(
        &errors(&model(g)),
        &[(
            "main: node 'if' (If)",
            "branch output 0: then_branch gives float but else_branch gives int64",
        )],
    );
}

#[test]
fn if_branch_with_inputs() {
    let mut g = valid_if_graph();
    let then_b = graph(
        "then_g",
        vec![node("t1", "Relu", &["p"], &["t"])],
        vec![float("p")],
        vec![float("t")],
    );
    g.node[1].attribute[0] = graph_attr("then_branch", then_b);
    assert_errors(
        &errors(&model(g)),
        &[(
            "main: node 'if' (If)",
            "then_branch declares 1 inputs; If branches take none",
        )],
    );
}

#[test]
fn if_without_else_branch() {
    let mut g = valid_if_graph();
    g.node[1].attribute.truncate(1);
    assert_errors(
        &errors(&model(g)),
        &[(
            "main: node 'if' (If)",
            "If needs both a then_branch and an else_branch graph attribute",
        )],
    );
}

// ----------------------------------------------------------------- opsets

#[test]
fn undeclared_domain() {
    let mut n = node("n1", "Foo", &["x"], &["y"]);
    n.domain = Some("com.example".into());
    let g = graph("g", vec![n], vec![float("x")], vec![float("y")]);
    assert_errors(
        &errors(&model(g)),
        &[(
            "main: node 'n1' (Foo)",
            "domain 'com.example' is not declared in opset_import",
        )],
    );
}

#[test]
fn undeclared_domain_in_subgraph() {
    let mut g = valid_if_graph();
    let mut t1 = node("t1", "Bar", &["a"], &["t"]);
    t1.domain = Some("com.example".into());
    let then_b = graph("then_g", vec![t1], vec![], vec![float("t")]);
    g.node[1].attribute[0] = graph_attr("then_branch", then_b);
    assert_errors(
        &errors(&model(g)),
        &[(
            "main/if.then_branch: node 't1' (Bar)",
            "domain 'com.example' is not declared in opset_import",
        )],
    );
}

#[test]
fn default_domain_undeclared() {
    let g = graph(
        "g",
        vec![node("n1", "Relu", &["x"], &["y"])],
        vec![float("x")],
        vec![float("y")],
    );
    let m = Model::from_proto(model_with(g, &[("com.microsoft", 1)]));
    assert_errors(
        &errors(&m),
        &[(
            "main: node 'n1' (Relu)",
            "domain '' is not declared in opset_import",
        )],
    );
}

#[test]
fn declared_custom_domain_is_fine() {
    let mut n = node("n1", "Foo", &["x"], &["y"]);
    n.domain = Some("com.example".into());
    let g = graph("g", vec![n], vec![float("x")], vec![float("y")]);
    let m = Model::from_proto(model_with(g, &[("", 17), ("com.example", 1)]));
    assert_errors(&errors(&m), &[]);
}

// ----------------------------------------------------------------- state manifest
// The manifest's invariants are the state module's (the IR verifier knows nothing of
// training): `state::verify_step` checks them with the verifier's.

fn step_errors(m: &Model) -> Vec<VerifyError> {
    match onnx_ga::state::verify_step(m) {
        Ok(()) => Vec::new(),
        Err(e) => e.0,
    }
}

fn with_state(manifest: &str) -> Model {
    let g = graph(
        "g",
        vec![
            node("n1", "Add", &["x", "w"], &["y"]),
            node("n2", "Neg", &["w"], &["w_next"]),
        ],
        vec![float("x"), float("w")],
        vec![float("y"), float("w_next")],
    );
    let mut proto = model_with(g, &[("", 17)]);
    proto.metadata_props.push(StringStringEntryProto {
        key: Some("onnx_ga.state".into()),
        value: Some(manifest.into()),
    });
    Model::from_proto(proto)
}

#[test]
fn state_manifest_consistent() {
    let m = with_state(r#"[{"input": "w", "output": "w_next", "role": "param", "param": null}]"#);
    assert_errors(&step_errors(&m), &[]);
}

#[test]
fn state_input_not_a_graph_input() {
    let m = with_state(
        r#"[{"input": "w", "output": "w_next", "role": "param"},
            {"input": "acc", "output": "y", "role": "accumulator"}]"#,
    );
    assert_errors(&step_errors(&m), &[("state 'acc'", "is not a graph input")]);
}

#[test]
fn state_output_missing() {
    let m = with_state(r#"[{"input": "w", "output": "w_new", "role": "param"}]"#);
    assert_errors(
        &step_errors(&m),
        &[("state 'w'", "its next value 'w_new' is not a graph output")],
    );
}

#[test]
fn state_paired_twice() {
    let m = with_state(
        r#"[{"input": "w", "output": "w_next", "role": "param"},
            {"input": "w", "output": "y", "role": "param"},
            {"input": "x", "output": "w_next", "role": "param"}]"#,
    );
    assert_errors(
        &step_errors(&m),
        &[
            ("state 'w'", "appears twice in the state manifest"),
            (
                "state 'x'",
                "output 'w_next' is the next value of two states",
            ),
        ],
    );
}

#[test]
fn state_manifest_not_json() {
    let m = with_state("{not json");
    assert_errors(
        &step_errors(&m),
        &[("metadata 'onnx_ga.state'", "is not a JSON array")],
    );
}

// ----------------------------------------------------------------- collect-all

#[test]
fn every_defect_of_a_model_is_reported() {
    let mut foreign = node("n3", "Foo", &["b"], &["c"]);
    foreign.domain = Some("com.example".into());
    let g = graph(
        "g",
        vec![
            node("n1", "Add", &["x", "ghost"], &["a"]),
            node("n2", "Relu", &["a"], &["b"]),
            foreign,
            node("n4", "Neg", &["c"], &["b"]),
            node("n5", "Mul", &["e"], &["d"]),
            node("n6", "Abs", &["d"], &["e"]),
        ],
        vec![float("x")],
        vec![float("c")],
    );
    let m = model(g);
    let all = errors(&m);
    assert_errors(
        &all,
        &[
            ("main: node 'n1' (Add)", "input 1 'ghost' is not defined"),
            (
                "main: node 'n3' (Foo)",
                "domain 'com.example' is not declared",
            ),
            (
                "main: node 'n4' (Neg)",
                "output 0 'b' is already defined by node 'n2' (Relu) in main",
            ),
            (
                "main: node 'n5' (Mul)",
                "is part of a cycle: 'n5' -> 'n6' -> 'n5'",
            ),
        ],
    );
    // The error value says how many and lists each with its location.
    let text = verify(&m).unwrap_err().to_string();
    assert!(
        text.starts_with("the graph fails verification (4 errors):"),
        "{text}"
    );
    for e in &all {
        assert!(
            text.contains(&format!("\n  {}: {}", e.location, e.message)),
            "{text}"
        );
    }
}
