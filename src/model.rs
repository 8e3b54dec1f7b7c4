//! Model file I/O: decoding, sanity checks, external data, atomic saving.
//!
//! # Loading
//!
//! * [`load_model`] is *lossless*: it decodes the file and leaves external-data references
//!   (`data_location = EXTERNAL` + `external_data` entries) exactly as they are, so
//!   `encode_model(&load_model(p)?)` reproduces the file byte for byte (for every model of
//!   the ONNX backend-test corpus, see `tests/model_io.rs`).
//! * [`load_model_with_data`] additionally inlines every external tensor into `raw_data`
//!   ([`load_external_data`]), resolving `location` relative to the model's folder.
//!
//! Decoding is strict about garbage: prost happily "decodes" many non-ONNX byte strings
//! (unknown fields are skipped), so a decoded model must also have a positive `ir_version`,
//! a `graph` and at least one `opset_import` ([`ModelError::NotAModel`]). A file that was
//! cut short is recognised by a top-level field whose length runs past the end of the file
//! ([`ModelError::Truncated`]).
//!
//! # External data
//!
//! A `location` must be a relative path inside the model's folder: absolute paths, `..`
//! components, and paths that leave the folder after symlinks are followed
//! (canonicalisation) are rejected ([`ModelError::UnsafeLocation`]). `offset` (default 0)
//! and `length` (default: to the end of the file) must lie inside the file. `checksum` is
//! not verified (the onnx Python package does not verify it either). After inlining, the
//! tensor has `raw_data` set, `external_data` empty and `data_location` *absent* (which
//! means DEFAULT), so a model saved with external data and loaded back compares equal to
//! the original in-memory model.
//!
//! # Saving
//!
//! * [`save_model`] writes to a temporary file in the destination folder, fsyncs it and
//!   renames it over `path`: readers see the old file or the new one, never a partial file,
//!   and on any error the destination is untouched. (If `path` is a symlink, the link itself
//!   is replaced.) It does not check that `path` differs from the file the model was read
//!   from; use [`same_file`] for that.
//! * [`save_model_with_external_data`] moves the `raw_data` of every initializer (main
//!   graph, subgraphs, training graphs) of at least `size_threshold_bytes` bytes into one
//!   data file next to the model. Each tensor starts at an offset aligned to
//!   [`EXTERNAL_DATA_ALIGNMENT`] (4096, so that runtimes can mmap it; the gap is zero
//!   padding); `location`, `offset` and `length` are recorded, no checksum. The data file is
//!   written (atomically) first and the model last.

use std::fs;
use std::io::{self, Read, Seek, SeekFrom, Write};
use std::path::{Component, Path, PathBuf};

use prost::Message;

use crate::proto::tensor_proto::DataLocation;
use crate::proto::{
    AttributeProto, GraphProto, ModelProto, NodeProto, SparseTensorProto, StringStringEntryProto,
    TensorProto,
};

/// Offsets of tensors in a data file written by [`save_model_with_external_data`] are
/// multiples of this (bytes).
pub const EXTERNAL_DATA_ALIGNMENT: u64 = 4096;

/// Everything that can go wrong reading or writing a model. Every variant carries the path
/// of the model file (or, for [`load_external_data`] called directly, the model folder).
#[derive(Debug, thiserror::Error)]
pub enum ModelError {
    #[error("{}: model file not found", path.display())]
    NotFound { path: PathBuf },

    #[error("{}: cannot read model file: {source}", path.display())]
    Read { path: PathBuf, source: io::Error },

    #[error("{}: file is empty (0 bytes), not an ONNX model", path.display())]
    Empty { path: PathBuf },

    #[error("{}: truncated ONNX model: {detail}", path.display())]
    Truncated { path: PathBuf, detail: String },

    #[error("{}: not an ONNX model: protobuf decoding failed: {source}", path.display())]
    Decode {
        path: PathBuf,
        source: prost::DecodeError,
    },

    #[error("{}: not an ONNX model: {reason}", path.display())]
    NotAModel { path: PathBuf, reason: String },

    #[error(
        "{}: tensor {tensor}: external data location {location:?} is not allowed: {reason}",
        model.display()
    )]
    UnsafeLocation {
        model: PathBuf,
        tensor: String,
        location: String,
        reason: String,
    },

    #[error(
        "{}: tensor {tensor}: external data file {location:?} not found (looked for {})",
        model.display(),
        file.display()
    )]
    ExternalFileMissing {
        model: PathBuf,
        tensor: String,
        location: String,
        file: PathBuf,
    },

    #[error(
        "{}: tensor {tensor}: external data range (offset {offset}, length {}) lies beyond \
         the end of {location:?} ({file_size} bytes)",
        model.display(),
        length.map_or_else(|| "to end of file".to_string(), |l| l.to_string())
    )]
    ExternalRange {
        model: PathBuf,
        tensor: String,
        location: String,
        offset: u64,
        length: Option<u64>,
        file_size: u64,
    },

    #[error("{}: tensor {tensor}: invalid external data reference: {reason}", model.display())]
    InvalidExternalData {
        model: PathBuf,
        tensor: String,
        reason: String,
    },

    #[error(
        "{}: tensor {tensor}: cannot read external data file {location:?}: {source}",
        model.display()
    )]
    ExternalRead {
        model: PathBuf,
        tensor: String,
        location: String,
        source: io::Error,
    },

    #[error("{}: cannot write: {source}", path.display())]
    Write { path: PathBuf, source: io::Error },

    #[error("{}: cannot save: {reason}", path.display())]
    InvalidSave { path: PathBuf, reason: String },

    #[error("{}: {errors}", path.display())]
    Invalid {
        path: PathBuf,
        errors: crate::validate::ValidationErrors,
    },
}

impl ModelError {
    /// The model file (or folder) the error is about.
    pub fn path(&self) -> &Path {
        match self {
            ModelError::NotFound { path }
            | ModelError::Read { path, .. }
            | ModelError::Empty { path }
            | ModelError::Truncated { path, .. }
            | ModelError::Decode { path, .. }
            | ModelError::NotAModel { path, .. }
            | ModelError::Write { path, .. }
            | ModelError::InvalidSave { path, .. }
            | ModelError::Invalid { path, .. } => path,
            ModelError::UnsafeLocation { model, .. }
            | ModelError::ExternalFileMissing { model, .. }
            | ModelError::ExternalRange { model, .. }
            | ModelError::InvalidExternalData { model, .. }
            | ModelError::ExternalRead { model, .. } => model,
        }
    }
}

// ---------------------------------------------------------------------------------------
// Loading
// ---------------------------------------------------------------------------------------

/// Reads, decodes and validates ([`crate::validate`]) a model, leaving external-data
/// references untouched (lossless; tensors with external data are not sized).
pub fn load_model(path: &Path) -> Result<ModelProto, ModelError> {
    let model = read_model(path)?;
    checked(model, path)
}

/// [`crate::validate::validate`] as a [`ModelError`] naming `path`.
pub fn checked(model: ModelProto, path: &Path) -> Result<ModelProto, ModelError> {
    match crate::validate::validate(&model) {
        Ok(()) => Ok(model),
        Err(errors) => Err(ModelError::Invalid {
            path: path.to_path_buf(),
            errors,
        }),
    }
}

/// Reads and decodes a model, not validated.
fn read_model(path: &Path) -> Result<ModelProto, ModelError> {
    let bytes = crate::input::read_regular(path).map_err(|source| {
        if source.kind() == io::ErrorKind::NotFound {
            ModelError::NotFound {
                path: path.to_path_buf(),
            }
        } else {
            ModelError::Read {
                path: path.to_path_buf(),
                source,
            }
        }
    })?;
    decode_model(&bytes, path)
}

/// Reads a model and inlines all its external data (see [`load_external_data`]); the
/// locations are resolved relative to the folder of `path`.
pub fn load_model_with_data(path: &Path) -> Result<ModelProto, ModelError> {
    let mut model = read_model(path)?;
    resolve_external_data(&mut model, &model_dir(path), path)?;
    checked(model, path)
}

/// [`load_model_with_data`], and the files it read: `path` and the external data files.
pub fn load_model_with_data_listing(path: &Path) -> Result<(ModelProto, Vec<PathBuf>), ModelError> {
    let mut model = read_model(path)?;
    let mut files = vec![path.to_path_buf()];
    files.extend(external_data_files(&model, &model_dir(path)));
    resolve_external_data(&mut model, &model_dir(path), path)?;
    Ok((checked(model, path)?, files))
}

/// The files `model`'s external-data entries name, resolved against `model_dir` (each
/// once; not checked: for comparing paths, e.g. refusing to overwrite an input).
pub fn external_data_files(model: &ModelProto, model_dir: &Path) -> Vec<PathBuf> {
    if !has_external_data(model) {
        return Vec::new();
    }
    let mut model = model.clone();
    let mut files: Vec<PathBuf> = Vec::new();
    let _ = for_each_tensor_mut(&mut model, false, &mut |tensor, _| -> Result<(), ()> {
        if !tensor.is_external() {
            return Ok(());
        }
        for e in &tensor.external_data {
            if e.key.as_deref() == Some("location") {
                let file = model_dir.join(e.value.as_deref().unwrap_or(""));
                if !files.contains(&file) {
                    files.push(file);
                }
            }
        }
        Ok(())
    });
    files
}

/// Decodes model bytes; `origin` only names the source in errors.
pub fn decode_model(bytes: &[u8], origin: &Path) -> Result<ModelProto, ModelError> {
    if bytes.is_empty() {
        return Err(ModelError::Empty {
            path: origin.to_path_buf(),
        });
    }
    if let Some(detail) = find_truncation(bytes) {
        return Err(ModelError::Truncated {
            path: origin.to_path_buf(),
            detail,
        });
    }
    let model = ModelProto::decode(bytes).map_err(|source| ModelError::Decode {
        path: origin.to_path_buf(),
        source,
    })?;
    let not_a_model = |reason: String| ModelError::NotAModel {
        path: origin.to_path_buf(),
        reason,
    };
    match model.ir_version {
        None => return Err(not_a_model("no ir_version field".into())),
        Some(v) if v <= 0 => {
            return Err(not_a_model(format!("ir_version is {v}, must be positive")))
        }
        Some(_) => {}
    }
    if model.graph.is_none() {
        return Err(not_a_model("no graph field".into()));
    }
    if model.opset_import.is_empty() {
        return Err(not_a_model("no opset_import entries".into()));
    }
    Ok(model)
}

/// Encodes a model in canonical protobuf order (fields by number), i.e. exactly as the
/// ONNX tooling (C++/Python protobuf) writes it, so `encode_model(&decode_model(b)?) == b`
/// for files written by ONNX tools.
///
/// Use this rather than `model.encode_to_vec()`: prost writes a `oneof` at the position of
/// its lowest field number, so a `TypeProto` whose `value` is `optional_type` (9),
/// `sparse_tensor_type` (8) or `opaque_type` (7) *and* that has a `denotation` (6) would
/// come out as `[value][denotation]` instead of `[denotation][value]`. Both decode to the
/// same message; the fix-up here only restores the canonical byte order.
pub fn encode_model(model: &ModelProto) -> Vec<u8> {
    let mut bytes = model.encode_to_vec();
    reorder_type_protos(&mut bytes, Msg::Model);
    bytes
}

/// The messages on the way from `ModelProto` to every `TypeProto`.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Msg {
    Model,
    Graph,
    Training,
    Function,
    Node,
    Attribute,
    ValueInfo,
    Type,
    /// `TypeProto.Sequence` and `TypeProto.Optional` (elem_type = 1).
    TypeElem,
    /// `TypeProto.Map` (value_type = 2).
    TypeMap,
}

fn child_msg(parent: Msg, field: u64) -> Option<Msg> {
    use Msg::*;
    Some(match (parent, field) {
        (Model, 7) => Graph,
        (Model, 20) => Training,
        (Model, 25) => Function,
        (Training, 1 | 2) => Graph,
        (Function, 7) => Node,
        (Function, 11) => Attribute,
        (Function, 12) => ValueInfo,
        (Graph, 1) => Node,
        (Graph, 11..=13) => ValueInfo,
        (Node, 5) => Attribute,
        (Attribute, 6 | 11) => Graph,
        (Attribute, 14 | 15) => Type,
        (ValueInfo, 2) => Type,
        (Type, 4 | 9) => TypeElem,
        (Type, 5) => TypeMap,
        (TypeElem, 1) => Type,
        (TypeMap, 2) => Type,
        _ => return None,
    })
}

/// Walks prost's output (so well-formed by construction) and moves a `TypeProto`'s
/// `denotation` (6) in front of a `value` oneof member with a higher field number.
fn reorder_type_protos(buf: &mut [u8], msg: Msg) {
    let mut pos = 0usize;
    // (field number, start, end) of the TypeProto fields seen, for the swap.
    let mut value_span: Option<(u64, usize, usize)> = None;
    let mut denotation_span: Option<(usize, usize)> = None;
    while pos < buf.len() {
        let start = pos;
        let Some(key) = read_varint(buf, &mut pos) else {
            return;
        };
        let (field, wire_type) = (key >> 3, key & 7);
        match wire_type {
            0 => {
                if read_varint(buf, &mut pos).is_none() {
                    return;
                }
            }
            1 => pos += 8,
            5 => pos += 4,
            2 => {
                let Some(len) = read_varint(buf, &mut pos) else {
                    return;
                };
                let Some(end) = pos.checked_add(len as usize).filter(|&e| e <= buf.len()) else {
                    return;
                };
                if let Some(child) = child_msg(msg, field) {
                    reorder_type_protos(&mut buf[pos..end], child);
                }
                pos = end;
            }
            _ => return,
        }
        if msg == Msg::Type {
            match field {
                6 => denotation_span = Some((start, pos)),
                1 | 4 | 5 | 7 | 8 | 9 => value_span = Some((field, start, pos)),
                _ => {}
            }
        }
    }
    if let (Some((field, vs, ve)), Some((ds, de))) = (value_span, denotation_span) {
        if field > 6 && ve == ds {
            buf[vs..de].rotate_left(ve - vs);
        }
    }
}

/// Wire types of the top-level `ModelProto` fields (0 = varint, 2 = length-delimited).
fn model_field(number: u64) -> Option<(&'static str, u64)> {
    Some(match number {
        1 => ("ir_version", 0),
        2 => ("producer_name", 2),
        3 => ("producer_version", 2),
        4 => ("domain", 2),
        5 => ("model_version", 0),
        6 => ("doc_string", 2),
        7 => ("graph", 2),
        8 => ("opset_import", 2),
        14 => ("metadata_props", 2),
        20 => ("training_info", 2),
        25 => ("functions", 2),
        26 => ("configuration", 2),
        _ => return None,
    })
}

/// Reads a varint at `pos`; `None` when the buffer ends inside it (or it is over-long).
fn read_varint(bytes: &[u8], pos: &mut usize) -> Option<u64> {
    let mut value = 0u64;
    for shift in (0..70).step_by(7) {
        let b = *bytes.get(*pos)?;
        *pos += 1;
        if shift == 63 && b > 1 {
            return None;
        }
        value |= u64::from(b & 0x7f) << shift;
        if b & 0x80 == 0 {
            return Some(value);
        }
    }
    None
}

/// Walks the top-level fields of a model. Returns a description when a well-formed prefix
/// of `ModelProto` fields ends in a field that runs past the end of the buffer, i.e. the
/// file was cut short. Anything that does not look like a model (unknown field, wrong wire
/// type) stops the walk and is left to the decoder.
fn find_truncation(bytes: &[u8]) -> Option<String> {
    let total = bytes.len();
    let mut pos = 0usize;
    while pos < total {
        let start = pos;
        let key = match read_varint(bytes, &mut pos) {
            Some(k) => k,
            None if start > 0 => {
                return Some(format!(
                    "the file ends inside a field key at byte {start} ({total} bytes)"
                ))
            }
            None => return None,
        };
        let (name, wire_type) = model_field(key >> 3)?;
        if key & 7 != wire_type {
            return None;
        }
        if wire_type == 0 {
            if read_varint(bytes, &mut pos).is_none() {
                return Some(format!(
                    "field {name} at byte {start} is cut off by the end of the file ({total} bytes)"
                ));
            }
        } else {
            let len = match read_varint(bytes, &mut pos) {
                Some(len) => len,
                None => {
                    return Some(format!(
                        "field {name} at byte {start} is cut off by the end of the file ({total} bytes)"
                    ))
                }
            };
            let available = (total - pos) as u64;
            if len > available {
                return Some(format!(
                    "field {name} at byte {start} declares {len} bytes but only {available} remain \
                     (file is {total} bytes)"
                ));
            }
            pos += len as usize;
        }
    }
    None
}

// ---------------------------------------------------------------------------------------
// External data
// ---------------------------------------------------------------------------------------

/// Whether any tensor of the model (anywhere: subgraphs, functions, training graphs,
/// sparse tensors) refers to external data.
pub fn has_external_data(model: &ModelProto) -> bool {
    fn sparse(s: &SparseTensorProto) -> bool {
        s.values.as_ref().is_some_and(TensorProto::is_external)
            || s.indices.as_ref().is_some_and(TensorProto::is_external)
    }
    fn attr(a: &AttributeProto) -> bool {
        a.t.as_ref().is_some_and(TensorProto::is_external)
            || a.tensors.iter().any(TensorProto::is_external)
            || a.sparse_tensor.as_ref().is_some_and(sparse)
            || a.sparse_tensors.iter().any(sparse)
            || a.g.as_ref().is_some_and(graph)
            || a.graphs.iter().any(graph)
    }
    fn node(n: &NodeProto) -> bool {
        n.attribute.iter().any(attr)
    }
    fn graph(g: &GraphProto) -> bool {
        g.initializer.iter().any(TensorProto::is_external)
            || g.sparse_initializer.iter().any(sparse)
            || g.node.iter().any(node)
    }
    model.graph.as_ref().is_some_and(graph)
        || model.training_info.iter().any(|t| {
            t.initialization.as_ref().is_some_and(graph) || t.algorithm.as_ref().is_some_and(graph)
        })
        || model
            .functions
            .iter()
            .any(|f| f.node.iter().any(node) || f.attribute_proto.iter().any(attr))
}

/// Inlines every external tensor of `model` (graph and subgraph initializers, sparse
/// initializers, tensors in node attributes incl. subgraphs, functions and training graphs)
/// into `raw_data`, resolving locations relative to `model_dir`. Errors name `model_dir`;
/// [`load_model_with_data`] names the model file instead.
pub fn load_external_data(model: &mut ModelProto, model_dir: &Path) -> Result<(), ModelError> {
    resolve_external_data(model, model_dir, model_dir)
}

fn resolve_external_data(
    model: &mut ModelProto,
    model_dir: &Path,
    label: &Path,
) -> Result<(), ModelError> {
    // Canonicalised lazily: a model without external data needs no folder at all.
    let mut canonical_dir: Option<PathBuf> = None;
    for_each_tensor_mut(model, false, &mut |tensor, context| {
        if !tensor.is_external() {
            return Ok(());
        }
        let name = tensor_label(tensor, context);
        let dir = match &canonical_dir {
            Some(d) => d.clone(),
            None => {
                let d = fs::canonicalize(model_dir).map_err(|source| ModelError::ExternalRead {
                    model: label.to_path_buf(),
                    tensor: name.clone(),
                    location: String::new(),
                    source: io::Error::new(
                        source.kind(),
                        format!("model folder {}: {source}", model_dir.display()),
                    ),
                })?;
                canonical_dir = Some(d.clone());
                d
            }
        };
        let data = read_external(tensor, model_dir, &dir, label, &name)?;
        tensor.raw_data = Some(data);
        tensor.external_data.clear();
        tensor.data_location = None;
        Ok(())
    })
}

/// Why [`confine`] refused a path.
#[derive(Debug)]
pub enum Confinement {
    /// It could not be resolved (e.g. it does not exist).
    Io(io::Error),
    /// After symlinks are followed it lies outside the folder.
    Outside { resolved: PathBuf },
}

/// Where `file` really is once symlinks are followed, when that is inside
/// `canonical_folder` (itself canonical, e.g. from `fs::canonicalize`): the one rule for
/// files a model or checkpoint names next to itself (ONNX external data, the checkpoint's
/// `.data` file), so a symlink cannot make us read from elsewhere.
pub fn confine(canonical_folder: &Path, file: &Path) -> Result<PathBuf, Confinement> {
    let resolved = fs::canonicalize(file).map_err(Confinement::Io)?;
    if resolved.starts_with(canonical_folder) {
        Ok(resolved)
    } else {
        Err(Confinement::Outside { resolved })
    }
}

fn tensor_label(tensor: &TensorProto, context: &str) -> String {
    match tensor.name.as_deref() {
        Some(n) if !n.is_empty() => format!("'{n}' ({context})"),
        _ => format!("<unnamed> ({context})"),
    }
}

fn read_external(
    tensor: &TensorProto,
    model_dir: &Path,
    canonical_dir: &Path,
    label: &Path,
    name: &str,
) -> Result<Vec<u8>, ModelError> {
    let invalid = |reason: String| ModelError::InvalidExternalData {
        model: label.to_path_buf(),
        tensor: name.to_string(),
        reason,
    };
    let (mut location, mut offset, mut length) = (None, None, None);
    for StringStringEntryProto { key, value } in &tensor.external_data {
        let value = value.as_deref().unwrap_or("");
        match key.as_deref().unwrap_or("") {
            "location" => location = Some(value),
            "offset" => {
                offset = Some(value.trim().parse::<u64>().map_err(|_| {
                    invalid(format!("offset {value:?} is not a non-negative integer"))
                })?)
            }
            "length" => {
                length = Some(value.trim().parse::<u64>().map_err(|_| {
                    invalid(format!("length {value:?} is not a non-negative integer"))
                })?)
            }
            _ => {} // checksum, basepath, ...: not used.
        }
    }
    let location = match location {
        Some(l) if !l.is_empty() => l,
        _ => {
            return Err(invalid(
                "data_location is EXTERNAL but there is no location entry".into(),
            ))
        }
    };
    let unsafe_location = |reason: &str| ModelError::UnsafeLocation {
        model: label.to_path_buf(),
        tensor: name.to_string(),
        location: location.to_string(),
        reason: reason.to_string(),
    };
    let rel = Path::new(location);
    // `starts_with('/')`/`'\\'` also catches paths that are absolute on another platform.
    if rel.is_absolute() || location.starts_with('/') || location.starts_with('\\') {
        return Err(unsafe_location("absolute paths are not allowed"));
    }
    for c in rel.components() {
        match c {
            Component::ParentDir => return Err(unsafe_location("'..' components are not allowed")),
            Component::RootDir | Component::Prefix(_) => {
                return Err(unsafe_location("absolute paths are not allowed"))
            }
            Component::CurDir | Component::Normal(_) => {}
        }
    }
    if location.split(['/', '\\']).any(|c| c == "..") {
        return Err(unsafe_location("'..' components are not allowed"));
    }
    let joined = model_dir.join(rel);
    let resolved = confine(canonical_dir, &joined).map_err(|e| match e {
        Confinement::Outside { resolved } => unsafe_location(&format!(
            "it resolves to {}, outside the model folder {}",
            resolved.display(),
            canonical_dir.display()
        )),
        Confinement::Io(source) if source.kind() == io::ErrorKind::NotFound => {
            ModelError::ExternalFileMissing {
                model: label.to_path_buf(),
                tensor: name.to_string(),
                location: location.to_string(),
                file: joined.clone(),
            }
        }
        Confinement::Io(source) => ModelError::ExternalRead {
            model: label.to_path_buf(),
            tensor: name.to_string(),
            location: location.to_string(),
            source,
        },
    })?;
    let read_err = |source: io::Error| ModelError::ExternalRead {
        model: label.to_path_buf(),
        tensor: name.to_string(),
        location: location.to_string(),
        source,
    };
    let mut file = crate::input::open_regular(&resolved).map_err(read_err)?;
    let meta = file.metadata().map_err(read_err)?;
    if !meta.is_file() {
        return Err(read_err(io::Error::other("not a regular file")));
    }
    let file_size = meta.len();
    let offset = offset.unwrap_or(0);
    let end = match length {
        Some(l) => offset.checked_add(l),
        None => Some(file_size),
    };
    let end = match end {
        Some(e) if offset <= file_size && e <= file_size => e,
        _ => {
            return Err(ModelError::ExternalRange {
                model: label.to_path_buf(),
                tensor: name.to_string(),
                location: location.to_string(),
                offset,
                length,
                file_size,
            })
        }
    };
    // Never more than the tensor's declared shape holds: a length claiming more is an error,
    // and without a length ("to the end of the file") the read stops there (a file far
    // larger than the tensor would only exhaust memory).
    let mut end = end;
    if let Some(holds) = crate::input::tensor_byte_len(&tensor.dims, tensor.data_type()) {
        if end - offset > holds {
            if length.is_some() {
                return Err(invalid(format!(
                    "its external data length is {} bytes, but a tensor of dims {:?} holds {holds}",
                    end - offset,
                    tensor.dims
                )));
            }
            end = offset + holds;
        }
    }
    let len = usize::try_from(end - offset)
        .map_err(|_| invalid(format!("length {} does not fit in memory", end - offset)))?;
    file.seek(SeekFrom::Start(offset)).map_err(read_err)?;
    let mut data = vec![0u8; len];
    file.read_exact(&mut data).map_err(read_err)?;
    Ok(data)
}

// ---------------------------------------------------------------------------------------
// Tensor traversal
// ---------------------------------------------------------------------------------------

/// Calls `f(tensor, context)` for every `TensorProto` in the model; `context` describes
/// where the tensor sits (for error messages). With `initializers_only`, only the dense
/// initializers of every graph (main graph, subgraphs, training graphs) are visited;
/// otherwise also sparse initializers (values and indices), tensors in node attributes
/// (also inside functions) and function attribute defaults.
pub fn for_each_tensor_mut<E>(
    model: &mut ModelProto,
    initializers_only: bool,
    f: &mut dyn FnMut(&mut TensorProto, &str) -> Result<(), E>,
) -> Result<(), E> {
    let mut v = Visitor {
        initializers_only,
        f,
    };
    if let Some(g) = model.graph.as_mut() {
        v.graph(g, "main graph")?;
    }
    for (i, info) in model.training_info.iter_mut().enumerate() {
        if let Some(g) = info.initialization.as_mut() {
            v.graph(g, &format!("training_info[{i}].initialization"))?;
        }
        if let Some(g) = info.algorithm.as_mut() {
            v.graph(g, &format!("training_info[{i}].algorithm"))?;
        }
    }
    for func in model.functions.iter_mut() {
        let fname = format!("function '{}'", func.name.as_deref().unwrap_or(""));
        for node in func.node.iter_mut() {
            v.node(node, &fname)?;
        }
        if !initializers_only {
            for attr in func.attribute_proto.iter_mut() {
                v.attribute(
                    attr,
                    &format!("default of attribute '{}' of {fname}", attr_name(attr)),
                )?;
            }
        }
    }
    Ok(())
}

fn attr_name(attr: &AttributeProto) -> String {
    attr.name.clone().unwrap_or_default()
}

struct Visitor<'a, E> {
    initializers_only: bool,
    f: &'a mut dyn FnMut(&mut TensorProto, &str) -> Result<(), E>,
}

impl<E> Visitor<'_, E> {
    fn graph(&mut self, g: &mut GraphProto, where_: &str) -> Result<(), E> {
        let gname = match g.name.as_deref() {
            Some(n) if !n.is_empty() => format!("graph '{n}'"),
            _ => where_.to_string(),
        };
        let ctx = format!("initializer of {gname}");
        for t in g.initializer.iter_mut() {
            (self.f)(t, &ctx)?;
        }
        if !self.initializers_only {
            let ctx = format!("sparse initializer of {gname}");
            for s in g.sparse_initializer.iter_mut() {
                self.sparse(s, &ctx)?;
            }
        }
        for node in g.node.iter_mut() {
            self.node(node, &gname)?;
        }
        Ok(())
    }

    fn node(&mut self, node: &mut NodeProto, owner: &str) -> Result<(), E> {
        let nname = format!(
            "node '{}' ({}) in {owner}",
            node.name.as_deref().unwrap_or(""),
            node.op_type.as_deref().unwrap_or("")
        );
        for attr in node.attribute.iter_mut() {
            let ctx = format!("attribute '{}' of {nname}", attr_name(attr));
            self.attribute(attr, &ctx)?;
        }
        Ok(())
    }

    fn attribute(&mut self, attr: &mut AttributeProto, ctx: &str) -> Result<(), E> {
        if !self.initializers_only {
            if let Some(t) = attr.t.as_mut() {
                (self.f)(t, ctx)?;
            }
            for t in attr.tensors.iter_mut() {
                (self.f)(t, ctx)?;
            }
            if let Some(s) = attr.sparse_tensor.as_mut() {
                self.sparse(s, ctx)?;
            }
            for s in attr.sparse_tensors.iter_mut() {
                self.sparse(s, ctx)?;
            }
        }
        if let Some(g) = attr.g.as_mut() {
            self.graph(g, &format!("subgraph of {ctx}"))?;
        }
        for g in attr.graphs.iter_mut() {
            self.graph(g, &format!("subgraph of {ctx}"))?;
        }
        Ok(())
    }

    fn sparse(&mut self, s: &mut SparseTensorProto, ctx: &str) -> Result<(), E> {
        if let Some(t) = s.values.as_mut() {
            (self.f)(t, &format!("values of {ctx}"))?;
        }
        if let Some(t) = s.indices.as_mut() {
            (self.f)(t, &format!("indices of {ctx}"))?;
        }
        Ok(())
    }
}

// ---------------------------------------------------------------------------------------
// Saving
// ---------------------------------------------------------------------------------------

/// Saves `model` atomically (temporary file in the same folder, fsync, rename). External
/// references are written as they are.
pub fn save_model(model: &ModelProto, path: &Path) -> Result<(), ModelError> {
    write_atomically(path, &encode_model(model))
}

/// The most bytes one model file may hold: protobuf's limit on a message (2 GiB), which
/// ONNX Runtime and the onnx package enforce when they parse one. A model over it must
/// keep its initializers in external data.
pub const MAX_MODEL_FILE_BYTES: usize = (1 << 31) - 1;

/// Why an engine cannot parse a model of `len` encoded bytes, if it cannot: over
/// [`MAX_MODEL_FILE_BYTES`], protobuf refuses it before anything else is read.
pub fn too_large_to_parse(len: usize) -> Option<String> {
    (len > MAX_MODEL_FILE_BYTES).then(|| {
        format!(
            "the model is {len} bytes in one piece, over protobuf's limit of {MAX_MODEL_FILE_BYTES} on one message, which the engine cannot parse; a step trained split (without --no-split) gives its sessions no parameters to hold"
        )
    })
}

/// Whether `model` in one file would pass [`MAX_MODEL_FILE_BYTES`] (its encoded length,
/// computed without encoding it).
pub fn over_file_limit(model: &ModelProto) -> bool {
    model.encoded_len() > MAX_MODEL_FILE_BYTES
}

/// The smallest initializer `rewrite` and `export` move into external data (bytes): smaller
/// ones stay inline, where they cost less than their entry would.
pub const EXTERNAL_DATA_MIN_BYTES: usize = 1024;

/// Saves `model` with the `raw_data` of every initializer of at least
/// `size_threshold_bytes` bytes moved into `data_file_name` (a plain file name) next to
/// `path`; see the module docs for the layout. `model` itself is not modified. The model
/// must not already refer to external data (load it with [`load_model_with_data`]).
pub fn save_model_with_external_data(
    model: &ModelProto,
    path: &Path,
    data_file_name: &str,
    size_threshold_bytes: usize,
) -> Result<(), ModelError> {
    commit_staged(stage_model_with_external_data(
        model.clone(),
        path,
        data_file_name,
        size_threshold_bytes,
    )?)
}

/// Renames staged files into place ([`crate::atomic::commit_all`]), an error naming the file.
pub fn commit_staged(staged: Vec<crate::atomic::Staged>) -> Result<(), ModelError> {
    crate::atomic::commit_all(staged).map_err(|(path, source)| ModelError::Write { path, source })
}

/// [`save_model_with_external_data`] of a model given away, whose data moves into the data
/// file instead of being copied: both files complete under temporary names, the data file
/// first, for [`crate::atomic::commit_all`] to rename (so that a caller writing several
/// files leaves none of them on an error).
pub fn stage_model_with_external_data(
    mut model: ModelProto,
    path: &Path,
    data_file_name: &str,
    size_threshold_bytes: usize,
) -> Result<Vec<crate::atomic::Staged>, ModelError> {
    let invalid = |reason: String| ModelError::InvalidSave {
        path: path.to_path_buf(),
        reason,
    };
    let plain = Path::new(data_file_name);
    let mut comps = plain.components();
    if data_file_name.is_empty()
        || data_file_name.contains(['/', '\\'])
        || !matches!(
            (comps.next(), comps.next()),
            (Some(Component::Normal(_)), None)
        )
    {
        return Err(invalid(format!(
            "data file name {data_file_name:?} must be a plain file name"
        )));
    }
    if path.file_name().is_some_and(|n| n == plain.as_os_str()) {
        return Err(invalid(format!(
            "data file name {data_file_name:?} is the model file itself"
        )));
    }
    if has_external_data(&model) {
        return Err(invalid(
            "the model still refers to external data; load it with load_model_with_data first"
                .into(),
        ));
    }

    let dir = model_dir(path);
    let data_path = dir.join(plain);
    let write_err = |path: &Path| {
        let path = path.to_path_buf();
        move |source: io::Error| ModelError::Write { path, source }
    };
    let data = crate::atomic::Staged::new(&data_path, |writer| {
        let mut pos: u64 = 0;
        for_each_tensor_mut(&mut model, true, &mut |t, _| {
            let big = t
                .raw_data
                .as_ref()
                .is_some_and(|r| r.len() >= size_threshold_bytes);
            if !big {
                return Ok(());
            }
            let raw = t.raw_data.take().unwrap_or_default();
            let offset = pos.div_ceil(EXTERNAL_DATA_ALIGNMENT) * EXTERNAL_DATA_ALIGNMENT;
            io::copy(&mut io::repeat(0).take(offset - pos), writer)?;
            writer.write_all(&raw)?;
            pos = offset + raw.len() as u64;
            let entry = |k: &str, v: String| StringStringEntryProto {
                key: Some(k.to_string()),
                value: Some(v),
            };
            t.external_data = vec![
                entry("location", data_file_name.to_string()),
                entry("offset", offset.to_string()),
                entry("length", raw.len().to_string()),
            ];
            t.data_location = Some(DataLocation::External as i32);
            Ok(())
        })
    })
    .map_err(write_err(&data_path))?;
    let bytes = encode_model(&model);
    drop(model);
    let file =
        crate::atomic::Staged::new(path, |w| w.write_all(&bytes)).map_err(write_err(path))?;
    Ok(vec![data, file])
}

/// Whether `a` and `b` name the same existing file (following symlinks; hard links count
/// on Unix). `false` when either does not exist.
pub fn same_file(a: &Path, b: &Path) -> bool {
    let (Ok(ma), Ok(mb)) = (fs::metadata(a), fs::metadata(b)) else {
        return false;
    };
    #[cfg(unix)]
    {
        use std::os::unix::fs::MetadataExt;
        ma.dev() == mb.dev() && ma.ino() == mb.ino()
    }
    #[cfg(not(unix))]
    {
        let _ = (ma, mb);
        matches!((fs::canonicalize(a), fs::canonicalize(b)), (Ok(x), Ok(y)) if x == y)
    }
}

/// The folder that holds `path` ("." for a bare file name).
fn model_dir(path: &Path) -> PathBuf {
    match path.parent() {
        Some(p) if !p.as_os_str().is_empty() => p.to_path_buf(),
        _ => PathBuf::from("."),
    }
}

fn write_atomically(path: &Path, bytes: &[u8]) -> Result<(), ModelError> {
    crate::atomic::write(path, bytes).map_err(|source| ModelError::Write {
        path: path.to_path_buf(),
        source,
    })
}
