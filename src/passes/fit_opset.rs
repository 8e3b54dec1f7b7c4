//! `fit-opset(opset=26,ir=13)`: lowers the model's `ai.onnx` opset import and its IR version
//! to what the runtime loads, when that changes the meaning of no node.
//!
//! Why: `onnx.helper.make_model` of onnx 1.23 stamps IR version 14 and opset 28, both newer
//! than any released ONNX Runtime loads. ONNX Runtime 1.31.1 refuses the model outright
//! ("Unsupported model IR version: 14, max supported IR version: 13"; "Current official
//! support for domain ai.onnx is till opset 26"), even when every op in it, and every op
//! the autodiff adds, is defined the same way at opset 26.
//!
//! When a node may move from opset `from` down to `to`: its op's schema at `to` is the one at
//! `from`, or every version between them only lets the op take more tensor types
//! ([`crate::validate::WIDENINGS`], generated from onnx's schemas: same attributes and
//! defaults, inputs, outputs and text) and the model uses none of the types they add.
//! Which types the model uses is over-approximated by every type it declares or names:
//! value infos, initializers, tensor attributes, and the `to`/`dtype`-like attributes of
//! casts and generators. A node's output type comes from its inputs, its attributes or its
//! op's definition, so no node can use a type outside that set and the op's fixed ones.
//!
//! The IR version moves to `ir` when no type the model uses is newer (the IR versions since
//! 9 add only tensor types, and 14 the opaque type outside ONNX-ML builds). Anything that
//! blocks the move is named, node by node; the model is then left as it was, and the
//! recipe and `inspect` say why ONNX Runtime will refuse it.
//!
//! `rewrite` runs this pass last when its input is newer than ONNX Runtime loads, and the
//! ONNX Runtime engine applies [`fit_for_ort`] in memory to such a step file.

use std::borrow::Cow;
use std::collections::BTreeSet;

use super::{Pass, PassContext, PassError, PassReport};
use crate::ir::{normalize_domain, Model};
use crate::proto::{type_proto, AttributeProto, ModelProto, NodeProto, TensorProto, TypeProto};
use crate::runtime::{ORT_MAX_IR_VERSION, ORT_MAX_OPSET};

pub const PASS: &str = "fit-opset";

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct FitOpset {
    /// The newest ai.onnx opset to declare.
    pub opset: i64,
    /// The newest IR version to declare.
    pub ir: i64,
}

impl Default for FitOpset {
    fn default() -> Self {
        FitOpset {
            opset: ORT_MAX_OPSET,
            ir: ORT_MAX_IR_VERSION,
        }
    }
}

impl FitOpset {
    pub fn from_options(options: &super::PassOptions) -> Result<FitOpset, PassError> {
        options.only(&["opset", "ir"])?;
        let default = FitOpset::default();
        let fit = FitOpset {
            opset: options.parse("opset")?.unwrap_or(default.opset),
            ir: options.parse("ir")?.unwrap_or(default.ir),
        };
        if fit.opset < 1 || fit.ir < 3 {
            return Err(PassError::Spec {
                spec: PASS.into(),
                message: format!(
                    "opset={} ir={}: the opset must be at least 1 and the IR version at least 3 (the first with opset imports)",
                    fit.opset, fit.ir
                ),
            });
        }
        Ok(fit)
    }

    /// Whether `model` declares more than this fit allows.
    pub fn exceeded_by(&self, model: &ModelProto) -> bool {
        model.ir_version() > self.ir || default_opset(&model.opset_import) > Some(self.opset)
    }
}

/// The ai.onnx opset an import list declares.
fn default_opset(imports: &[crate::proto::OperatorSetIdProto]) -> Option<i64> {
    imports
        .iter()
        .find(|o| normalize_domain(o.domain()).is_empty())
        .map(|o| o.version())
}

/// What keeps a model at its versions: one line each, naming the node or the type.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Blockers(pub Vec<String>);

impl std::fmt::Display for Blockers {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}", self.0.join("; "))
    }
}

/// What [`fit`] did: the versions before and after.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Moved {
    pub opset: (i64, i64),
    pub ir: (i64, i64),
}

/// Lowers `model`'s versions to `target`'s where that changes no node's meaning; else
/// leaves it and names every blocker.
pub fn fit(model: &mut Model, target: &FitOpset) -> Result<Option<Moved>, Blockers> {
    if !target.exceeded_by(&model.header) {
        return Ok(None);
    }
    let used = used_types(model);
    let mut blockers = Vec::new();
    let from_opset = default_opset(&model.header.opset_import).unwrap_or(0);
    let to_opset = from_opset.min(target.opset);
    if to_opset < from_opset {
        let nodes = model.all_nodes().map(|n| &model.node(n).proto);
        let functions = model.header.functions.iter().flat_map(|f| &f.node);
        for node in nodes.chain(functions) {
            if let Err(why) = node_moves(node, from_opset, to_opset, &used) {
                blockers.push(format!(
                    "node '{}' ({}): {why}",
                    node.name(),
                    node.op_type()
                ));
            }
        }
        for f in &model.header.functions {
            if let Some(v) = default_opset(&f.opset_import).filter(|&v| v > from_opset) {
                blockers.push(format!(
                    "model-local function '{}' imports ai.onnx opset {v}, newer than the model's",
                    f.name()
                ));
            }
        }
    }
    let from_ir = model.header.ir_version();
    let to_ir = from_ir.min(target.ir);
    let needed = used.iter().map(|&t| (ir_version_of(t), t)).max();
    if let Some((needed_ir, dtype)) = needed.filter(|&(v, _)| v > to_ir) {
        blockers.push(format!(
            "the model uses tensor type {} (data type {dtype}), which needs IR version {needed_ir}",
            dtype_name(dtype)
        ));
    }
    if !blockers.is_empty() {
        return Err(Blockers(blockers));
    }
    for import in model.header.opset_import.iter_mut().chain(
        model
            .header
            .functions
            .iter_mut()
            .flat_map(|f| f.opset_import.iter_mut()),
    ) {
        if normalize_domain(import.domain()).is_empty() && import.version() > to_opset {
            import.version = Some(to_opset);
        }
    }
    model.header.ir_version = Some(to_ir);
    Ok(Some(Moved {
        opset: (from_opset, to_opset),
        ir: (from_ir, to_ir),
    }))
}

/// Whether `node`, declared at ai.onnx opset `from`, means the same at `to`; else why not.
fn node_moves(node: &NodeProto, from: i64, to: i64, used: &BTreeSet<i32>) -> Result<(), String> {
    if !normalize_domain(node.domain()).is_empty() {
        return Ok(()); // other domains keep their own imports
    }
    let op = node.op_type();
    let Some(mut since) = crate::validate::since_version(op, from) else {
        return Ok(()); // not an ai.onnx op at `from`: the validator reports it, not us
    };
    let Some(target) = crate::validate::since_version(op, to) else {
        return Err(format!("{op} is not defined at opset {to}"));
    };
    while since > target {
        let (previous, adds) = match crate::validate::widening(op, since) {
            Some(w) => (w.previous, w.adds),
            None => match ADDED_ATTRIBUTES
                .iter()
                .find(|a| a.op == op && a.since == since)
            {
                Some(a) if a.keeps_meaning(node) => (a.previous, a.adds),
                Some(a) => {
                    return Err(format!(
                        "it sets '{}', which opset {since} added (newer than {to})",
                        a.attribute
                    ))
                }
                None => {
                    return Err(format!(
                        "its definition changed in opset {since} (newer than {to})"
                    ))
                }
            },
        };
        if let Some(&t) = adds.iter().find(|t| used.contains(t)) {
            return Err(format!(
                "opset {since} added tensor type {} to it, and the model uses that type",
                dtype_name(t)
            ));
        }
        since = previous;
    }
    Ok(())
}

/// A version that added an attribute, and otherwise only tensor types: a node that leaves
/// the attribute at the value that reproduces the version before means the same at both.
/// Read from onnx 1.23's operator text (the generated widenings cannot see it: the text
/// changed).
struct AddedAttribute {
    op: &'static str,
    since: i64,
    previous: i64,
    attribute: &'static str,
    /// The value that means what the version before did (`None`: any value, the attribute
    /// only acts on the added types).
    keeps: Option<&'static str>,
    adds: &'static [i32],
}

impl AddedAttribute {
    fn keeps_meaning(&self, node: &NodeProto) -> bool {
        let Some(a) = node.attribute.iter().find(|a| a.name() == self.attribute) else {
            return true; // the default
        };
        match self.keeps {
            None => true,
            Some(keeps) => a.s.as_deref() == Some(keeps.as_bytes()),
        }
    }
}

const ADDED_ATTRIBUTES: &[AddedAttribute] = &[
    // `mode`, default DCR: the order SpaceToDepth 13 has (the inverse of DepthToSpace DCR),
    // as the autodiff writes it for DepthToSpace's gradient.
    AddedAttribute {
        op: "SpaceToDepth",
        since: 28,
        previous: 13,
        attribute: "mode",
        keeps: Some("DCR"),
        adds: &[],
    },
    // `stash_type` acts "for float16 and bfloat16 inputs" only, the types Range 27 added.
    AddedAttribute {
        op: "Range",
        since: 27,
        previous: 11,
        attribute: "stash_type",
        keeps: None,
        adds: &[10, 16],
    },
];

/// Every tensor element type `model` declares or names.
fn used_types(model: &Model) -> BTreeSet<i32> {
    let mut used = BTreeSet::new();
    for body in &model.bodies {
        let infos = body
            .inputs
            .iter()
            .chain(&body.outputs)
            .chain(&body.value_info);
        for (_, info) in infos {
            if let Some(ty) = &info.r#type {
                type_dtypes(ty, &mut used);
            }
        }
        for (_, t) in &body.initializers {
            used.insert(t.data_type.unwrap_or(0));
        }
        for (_, s) in &body.sparse_initializers {
            if let Some(t) = &s.values {
                used.insert(t.data_type.unwrap_or(0));
            }
        }
    }
    let nodes = model.all_nodes().map(|n| &model.node(n).proto);
    let functions = model.header.functions.iter().flat_map(|f| &f.node);
    for node in nodes.chain(functions) {
        for a in &node.attribute {
            attribute_dtypes(a, &mut used);
        }
    }
    used.remove(&0);
    used
}

/// The types an attribute names: its tensors, and the data type of a cast or generator
/// (`to`, `dtype`, `output_dtype`, `stash_type`).
fn attribute_dtypes(a: &AttributeProto, used: &mut BTreeSet<i32>) {
    let tensor = |t: &TensorProto, used: &mut BTreeSet<i32>| {
        used.insert(t.data_type.unwrap_or(0));
    };
    if let Some(t) = &a.t {
        tensor(t, used);
    }
    for t in &a.tensors {
        tensor(t, used);
    }
    if let Some(tp) = &a.tp {
        type_dtypes(tp, used);
    }
    if matches!(a.name(), "to" | "dtype" | "output_dtype" | "stash_type") {
        if let Some(i) = a.i {
            used.insert(i32::try_from(i).unwrap_or(i32::MAX));
        }
    }
}

fn type_dtypes(ty: &TypeProto, used: &mut BTreeSet<i32>) {
    match &ty.value {
        Some(type_proto::Value::TensorType(t)) => {
            used.insert(t.elem_type.unwrap_or(0));
        }
        Some(type_proto::Value::SparseTensorType(t)) => {
            used.insert(t.elem_type.unwrap_or(0));
        }
        Some(type_proto::Value::SequenceType(s)) => {
            if let Some(e) = &s.elem_type {
                type_dtypes(e, used);
            }
        }
        Some(type_proto::Value::OptionalType(o)) => {
            if let Some(e) = &o.elem_type {
                type_dtypes(e, used);
            }
        }
        Some(type_proto::Value::MapType(m)) => {
            used.insert(m.key_type.unwrap_or(0));
            if let Some(v) = &m.value_type {
                type_dtypes(v, used);
            }
        }
        // Opaque types came to non-ML builds with IR 14.
        Some(type_proto::Value::OpaqueType(_)) => {
            used.insert(OPAQUE);
        }
        None => {}
    }
}

/// A stand-in data type number for "an opaque type" in the set of used types.
const OPAQUE: i32 = -1;

/// The IR version that introduced tensor element type `dtype` (onnx.proto's history of IR
/// versions); 3 for the types every IR version with opset imports has.
fn ir_version_of(dtype: i32) -> i64 {
    match dtype {
        17..=20 => 9,            // FLOAT8E4M3FN, FLOAT8E4M3FNUZ, FLOAT8E5M2, FLOAT8E5M2FNUZ
        21 | 22 => 10,           // UINT4, INT4
        23 => 11,                // FLOAT4E2M1
        24 => 12,                // FLOAT8E8M0
        25 | 26 => 13,           // UINT2, INT2
        27 | 28 | OPAQUE => 14,  // FLOAT6E2M3, FLOAT6E3M2; opaque types
        d if d > 28 => i64::MAX, // a type newer than the schemas we know
        _ => 3,
    }
}

fn dtype_name(dtype: i32) -> String {
    if dtype == OPAQUE {
        return "opaque".into();
    }
    // The two types of IR version 14 are newer than our onnx.proto.
    match dtype {
        27 => "FLOAT6E2M3".into(),
        28 => "FLOAT6E3M2".into(),
        _ => crate::proto::tensor_proto::DataType::try_from(dtype)
            .map(|d| d.as_str_name().to_string())
            .unwrap_or_else(|_| format!("#{dtype}")),
    }
}

impl Pass for FitOpset {
    fn name(&self) -> &'static str {
        PASS
    }

    fn phase(&self) -> super::Phase {
        super::Phase::Lower
    }

    fn spec(&self) -> String {
        let default = FitOpset::default();
        let mut options = Vec::new();
        if self.opset != default.opset {
            options.push(format!("opset={}", self.opset));
        }
        if self.ir != default.ir {
            options.push(format!("ir={}", self.ir));
        }
        super::spec_text(PASS, &options)
    }

    fn run(
        &mut self,
        model: &mut Model,
        cx: &mut PassContext<'_>,
    ) -> Result<PassReport, PassError> {
        use crate::recipe::Origin;
        let mut section = crate::recipe::Section::new(PASS);
        section.set("opset", self.opset, Origin::Default);
        section.note("opset", "the newest ai.onnx opset ONNX Runtime 1.31 loads");
        section.set("ir", self.ir, Origin::Default);
        section.note("ir", "the newest IR version ONNX Runtime 1.31 loads");
        let report = match fit(model, self) {
            Ok(None) => PassReport::default(),
            Ok(Some(moved)) => PassReport {
                changed: true,
                notes: vec![format!(
                    "ai.onnx opset {} -> {}, IR version {} -> {}",
                    moved.opset.0, moved.opset.1, moved.ir.0, moved.ir.1
                )],
                ..Default::default()
            },
            Err(blockers) => {
                section.set("kept", true, Origin::Default);
                section.note("kept", format!("versions kept: {blockers}"));
                PassReport::default()
            }
        };
        cx.recipe.push(section);
        Ok(report)
    }
}

/// `model` with its versions lowered to what ONNX Runtime loads (borrowed unchanged when
/// they are within it); an error naming every blocker when they cannot move.
pub fn fit_for_ort(model: &ModelProto) -> Result<Cow<'_, ModelProto>, PassError> {
    let target = FitOpset::default();
    if !target.exceeded_by(model) {
        return Ok(Cow::Borrowed(model));
    }
    let mut ir = Model::from_proto(model.clone());
    fit(&mut ir, &target).map_err(|blockers| PassError::Other {
        pass: PASS.into(),
        message: format!(
            "ONNX Runtime 1.31 loads ai.onnx opset <= {} and IR version <= {}; this model declares opset {} and IR version {}, and cannot move down: {blockers}",
            target.opset,
            target.ir,
            default_opset(&model.opset_import).unwrap_or(0),
            model.ir_version()
        ),
    })?;
    Ok(Cow::Owned(ir.to_proto()))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn model(text: &str) -> Model {
        Model::from_proto(crate::ir::text::parse_model(text).unwrap())
    }

    const GRAPH: &str = "g (float[N,4] x) => (float[N,4] y) {\n";

    #[test]
    fn a_cast_at_opset_28_moves_to_26_with_ir_13() {
        let mut m = model(&format!(
            "<ir_version: 14, opset_import: [\"\" : 28]>\n{GRAPH}  h = Cast<to = 10>(x)\n  y = Cast<to = 1>(h)\n}}\n"
        ));
        let moved = fit(&mut m, &FitOpset::default()).unwrap().unwrap();
        assert_eq!(
            moved,
            Moved {
                opset: (28, 26),
                ir: (14, 13)
            }
        );
        assert_eq!(m.opset(""), Some(26));
        assert_eq!(m.header.ir_version(), 13);
    }

    #[test]
    fn versions_within_the_target_are_left_alone() {
        let text =
            format!("<ir_version: 8, opset_import: [\"\" : 17]>\n{GRAPH}  y = Relu(x)\n}}\n");
        let mut m = model(&text);
        assert_eq!(fit(&mut m, &FitOpset::default()), Ok(None));
        assert_eq!((m.opset(""), m.header.ir_version()), (Some(17), 8));
    }

    #[test]
    fn an_op_whose_text_changed_keeps_the_versions_and_is_named() {
        // Mod 28 gives fmod = 0 a meaning for floats; its text changed, so it never moves.
        let mut m = model(&format!(
            "<ir_version: 14, opset_import: [\"\" : 28]>\n{GRAPH}  y = Mod(x, x)\n}}\n"
        ));
        let Err(blockers) = fit(&mut m, &FitOpset::default()) else {
            panic!("Mod moved");
        };
        assert!(
            blockers
                .to_string()
                .contains("(Mod): its definition changed in opset 28"),
            "{blockers}"
        );
        assert_eq!((m.opset(""), m.header.ir_version()), (Some(28), 14));
    }

    #[test]
    fn a_widening_whose_added_type_the_model_uses_blocks() {
        // Celu 28 added float16; a float16 Celu does not exist at opset 26.
        let mut m = model(
            "<ir_version: 14, opset_import: [\"\" : 28]>\n\
             g (float16[N,4] x) => (float16[N,4] y) {\n  y = Celu(x)\n}\n",
        );
        let blockers = fit(&mut m, &FitOpset::default()).unwrap_err();
        assert!(
            blockers.to_string().contains("added tensor type FLOAT16"),
            "{blockers}"
        );
        // The same op on float32 moves.
        let mut m = model(&format!(
            "<ir_version: 14, opset_import: [\"\" : 28]>\n{GRAPH}  y = Celu(x)\n}}\n"
        ));
        assert!(fit(&mut m, &FitOpset::default()).unwrap().is_some());
    }

    #[test]
    fn a_type_of_ir_14_keeps_the_ir_version() {
        // FLOAT6E2M3 (27) came with IR version 14.
        let mut m = model(&format!(
            "<ir_version: 14, opset_import: [\"\" : 28]>\n{GRAPH}  h = Cast<to = 27>(x)\n  y = Cast<to = 1>(h)\n}}\n"
        ));
        let blockers = fit(&mut m, &FitOpset::default()).unwrap_err();
        let text = blockers.to_string();
        assert!(
            text.contains("FLOAT6E2M3") && text.contains("IR version 14"),
            "{text}"
        );
    }

    #[test]
    fn an_added_attribute_left_at_the_old_meaning_moves() {
        let at_28 = |attrs: &str| {
            model(&format!(
                "<ir_version: 14, opset_import: [\"\" : 28]>\n\
                 g (float[1,4,2,2] x) => (float[1,16,1,1] y) {{\n  y = SpaceToDepth<blocksize = 2{attrs}>(x)\n}}\n"
            ))
        };
        assert!(fit(&mut at_28(""), &FitOpset::default()).unwrap().is_some());
        assert!(fit(&mut at_28(", mode = \"DCR\""), &FitOpset::default())
            .unwrap()
            .is_some());
        let text = fit(&mut at_28(", mode = \"CRD\""), &FitOpset::default())
            .unwrap_err()
            .to_string();
        assert!(
            text.contains("it sets 'mode', which opset 28 added"),
            "{text}"
        );
    }

    #[test]
    fn an_op_newer_than_the_target_is_named() {
        let mut m = model(&format!(
            "<ir_version: 13, opset_import: [\"\" : 26]>\n{GRAPH}  y = CumProd(x, x)\n}}\n"
        ));
        let target = FitOpset { opset: 25, ir: 13 };
        let text = fit(&mut m, &target).unwrap_err().to_string();
        assert!(
            text.contains("CumProd is not defined at opset 25"),
            "{text}"
        );
    }
}
