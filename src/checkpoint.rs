//! Reader for ONNX Runtime's on-device-training checkpoint (DESIGN.md section 6).
//!
//! The checkpoint is one FlatBuffer file with file identifier `ODTC`, root table `Checkpoint`
//! of the schema `ort_training_checkpoint.fbs` (which takes `Tensor` from `ort.fbs`) in the
//! onnxruntime repository. ONNX Runtime 1.19.2 writes version 2; version 1 is the same layout
//! without external data and is accepted too.
//!
//! Tables and their fields (vtable slot = 4 + 2 * field index):
//!
//! | table | fields, in slot order |
//! |---|---|
//! | `Checkpoint` | `version:int32`, `module_state:ModuleState`, `optimizer_groups:[OptimizerGroup]`, `property_bag:PropertyBag` |
//! | `ModuleState` | `requires_grad_params:[Tensor]`, `frozen_params:[Tensor]`, `is_nominal_state:bool`, `has_external_data:bool` |
//! | `Tensor` | `name:string`, `doc_string:string`, `dims:[int64]`, `data_type:int32` (ONNX enum), `raw_data:[ubyte]`, `string_data:[string]`, `external_data_offset:int64 = -1` |
//! | `OptimizerGroup` | `group_name:string`, `step:int64`, `initial_learning_rate:float`, `optimizer_states:[ParameterOptimizerState]` |
//! | `ParameterOptimizerState` | `param_name:string`, `momentums:[Tensor]` |
//! | `PropertyBag` | `ints:[IntProperty]`, `floats:[FloatProperty]`, `strings:[StringProperty]` |
//! | `IntProperty` / `FloatProperty` / `StringProperty` | `name:string`, `value:int64 / float / string` |
//!
//! External data (measured against ONNX Runtime 1.19.2): when `ModuleState.has_external_data`
//! is set, a tensor whose `external_data_offset` is `>= 0` has no `raw_data`; its bytes lie in
//! the file `<checkpoint path>.data` (the checkpoint's path with `.data` appended) at that
//! absolute byte offset, `element count * element size` bytes long, little-endian. ONNX
//! Runtime rejects a tensor with an external offset when `has_external_data` is false; so do we.
//!
//! A *nominal* checkpoint (`is_nominal_state`, written by `generate_artifacts(...,
//! nominal_checkpoint=True)`) carries only parameter names and data types: no dims, no data.
//!
//! The order of tensors inside the file follows ONNX Runtime's hash maps, not the graph: look
//! tensors up by name ([`Checkpoint::parameter`], [`ParamOptimizerState::momentum`]).
//!
//! Every byte of the input is untrusted: the buffer goes through the `flatbuffers` verifier
//! before any field is read, sizes use checked arithmetic, and nothing here panics.

use std::collections::HashSet;
use std::fmt;
use std::fs::File;
use std::io::{self, Read, Seek, SeekFrom};
use std::path::{Path, PathBuf};

use crate::proto::TensorProto;

/// The FlatBuffer file identifier of an ONNX Runtime training checkpoint.
pub const FILE_IDENTIFIER: [u8; 4] = *b"ODTC";

/// The checkpoint versions this reader understands (ONNX Runtime 1.19.2 writes 2).
pub const SUPPORTED_VERSIONS: [i32; 2] = [1, 2];

/// ONNX `TensorProto.DataType` value of `STRING`.
const DATA_TYPE_STRING: i32 = 8;
/// ONNX `TensorProto.DataType` value of `FLOAT`.
const DATA_TYPE_FLOAT: i32 = 1;

// ----------------------------------------------------------------------------- public types

/// A parsed ONNX Runtime training checkpoint. All tensor data is resolved (inline or from the
/// external data file) and owned.
#[derive(Debug, Clone, PartialEq)]
pub struct Checkpoint {
    /// `Checkpoint.version` (2 for ONNX Runtime 1.19.2).
    pub version: i32,
    /// `ModuleState.is_nominal_state`: tensors carry names and data types only (no dims, no data).
    pub nominal: bool,
    /// `ModuleState.has_external_data`: some tensor bytes were read from `<checkpoint>.data`.
    pub has_external_data: bool,
    /// `ModuleState.requires_grad_params`: the trainable parameters, in file order.
    pub trainable: Vec<CheckpointTensor>,
    /// `ModuleState.frozen_params`: parameters that are not trained (e.g. BN running stats).
    pub frozen: Vec<CheckpointTensor>,
    /// `Checkpoint.optimizer_groups`: empty unless saved with the optimizer state.
    pub optimizer_groups: Vec<OptimizerGroup>,
    /// `Checkpoint.property_bag`: the int properties, then the float ones, then the strings.
    pub properties: Vec<(String, PropertyValue)>,
}

/// One tensor of a checkpoint (a parameter or an optimizer momentum).
#[derive(Debug, Clone, PartialEq)]
pub struct CheckpointTensor {
    pub name: String,
    /// Shape; empty for a scalar (and for every tensor of a nominal checkpoint).
    pub dims: Vec<i64>,
    /// ONNX `TensorProto.DataType` enum value (1 = FLOAT, 7 = INT64, ...).
    pub data_type: i32,
    /// The tensor's bytes, little-endian, row-major (empty in a nominal checkpoint).
    pub raw_data: Vec<u8>,
}

/// `OptimizerGroup`: the optimizer state of one parameter group.
#[derive(Debug, Clone, PartialEq)]
pub struct OptimizerGroup {
    /// `group_name` (`group0` for the training API's single group).
    pub name: String,
    /// Optimizer steps taken so far.
    pub step: i64,
    pub initial_learning_rate: f32,
    pub states: Vec<ParamOptimizerState>,
}

/// `ParameterOptimizerState`: the momentums of one parameter. AdamW stores `momentum0`
/// (first-order moment) and `momentum1` (second-order moment), each shaped like the parameter.
#[derive(Debug, Clone, PartialEq)]
pub struct ParamOptimizerState {
    pub param: String,
    pub momentums: Vec<CheckpointTensor>,
}

/// A value of the checkpoint's property bag.
#[derive(Debug, Clone, PartialEq)]
pub enum PropertyValue {
    Int(i64),
    Float(f32),
    String(String),
}

impl Checkpoint {
    /// The trainable parameters, then the frozen ones.
    pub fn parameters(&self) -> impl Iterator<Item = &CheckpointTensor> {
        self.trainable.iter().chain(self.frozen.iter())
    }

    /// The parameter (trainable or frozen) named `name`.
    pub fn parameter(&self, name: &str) -> Option<&CheckpointTensor> {
        self.parameters().find(|t| t.name == name)
    }

    /// Whether `name` is a trainable parameter (`Some(true)`), a frozen one (`Some(false)`), or
    /// absent (`None`).
    pub fn is_trainable(&self, name: &str) -> Option<bool> {
        if self.trainable.iter().any(|t| t.name == name) {
            Some(true)
        } else if self.frozen.iter().any(|t| t.name == name) {
            Some(false)
        } else {
            None
        }
    }

    /// The optimizer group named `name`.
    pub fn optimizer_group(&self, name: &str) -> Option<&OptimizerGroup> {
        self.optimizer_groups.iter().find(|g| g.name == name)
    }

    /// The property named `name`.
    pub fn property(&self, name: &str) -> Option<&PropertyValue> {
        self.properties
            .iter()
            .find(|(n, _)| n == name)
            .map(|(_, v)| v)
    }
}

impl OptimizerGroup {
    /// The optimizer state of parameter `param`.
    pub fn state(&self, param: &str) -> Option<&ParamOptimizerState> {
        self.states.iter().find(|s| s.param == param)
    }
}

impl ParamOptimizerState {
    /// The momentum named `name` (`momentum0`, `momentum1`).
    pub fn momentum(&self, name: &str) -> Option<&CheckpointTensor> {
        self.momentums.iter().find(|t| t.name == name)
    }
}

/// Error of the typed accessors of [`CheckpointTensor`] (the tensor was already read; the
/// problem is what the caller asked of it).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("checkpoint tensor `{name}`: {problem}")]
pub struct TensorDataError {
    pub name: String,
    pub problem: String,
}

impl CheckpointTensor {
    /// Number of elements (1 for a scalar); `None` if a dim is negative or the product
    /// overflows.
    pub fn element_count(&self) -> Option<usize> {
        element_count(&self.dims).and_then(|n| usize::try_from(n).ok())
    }

    /// The number of bytes `raw_data` must have for `dims` and `data_type`; `None` for string
    /// or unknown data types, negative dims, or overflow.
    pub fn expected_byte_len(&self) -> Option<usize> {
        let count = element_count(&self.dims)?;
        byte_len(self.data_type, count).and_then(|n| usize::try_from(n).ok())
    }

    /// The ONNX name of `data_type` (`"FLOAT"`, ...), or `"unknown"`.
    pub fn data_type_name(&self) -> &'static str {
        data_type_name(self.data_type)
    }

    /// The data as f32 values. Errors unless the tensor is FLOAT and `raw_data` has exactly
    /// `element_count * 4` bytes.
    pub fn as_f32(&self) -> Result<Vec<f32>, TensorDataError> {
        if self.data_type != DATA_TYPE_FLOAT {
            return Err(self.data_error(format!(
                "data type is {} ({}), not FLOAT (1)",
                self.data_type,
                self.data_type_name()
            )));
        }
        let expected = self.expected_byte_len().ok_or_else(|| {
            self.data_error(format!(
                "dims {:?} do not give a valid element count",
                self.dims
            ))
        })?;
        if self.raw_data.len() != expected {
            return Err(self.data_error(format!(
                "raw_data has {} bytes, dims {:?} need {expected}",
                self.raw_data.len(),
                self.dims
            )));
        }
        Ok(self
            .raw_data
            .chunks_exact(4)
            .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect())
    }

    /// The data as an f32 array of shape `dims` (see [`CheckpointTensor::as_f32`]).
    pub fn to_array_f32(&self) -> Result<ndarray::ArrayD<f32>, TensorDataError> {
        let values = self.as_f32()?;
        let shape = self
            .dims
            .iter()
            .map(|&d| usize::try_from(d))
            .collect::<Result<Vec<usize>, _>>()
            .map_err(|_| self.data_error(format!("negative dim in {:?}", self.dims)))?;
        ndarray::ArrayD::from_shape_vec(ndarray::IxDyn(&shape), values)
            .map_err(|e| self.data_error(format!("cannot shape data as {:?}: {e}", self.dims)))
    }

    /// An ONNX `TensorProto` (name, dims, data_type, raw_data) holding this tensor, e.g. to
    /// turn a parameter into an initializer. Meaningless for a nominal checkpoint's tensors,
    /// which have no dims and no data.
    pub fn to_tensor_proto(&self) -> TensorProto {
        TensorProto {
            name: Some(self.name.clone()),
            dims: self.dims.clone(),
            data_type: Some(self.data_type),
            raw_data: Some(self.raw_data.clone()),
            ..Default::default()
        }
    }

    fn data_error(&self, problem: String) -> TensorDataError {
        TensorDataError {
            name: self.name.clone(),
            problem,
        }
    }
}

/// Why a checkpoint could not be read. Every message names the checkpoint file.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum CheckpointError {
    #[error("cannot read checkpoint {}: {source}", path.display())]
    Io {
        path: PathBuf,
        #[source]
        source: io::Error,
    },
    #[error(
        "checkpoint {}: file is {len} bytes long, too short for an ONNX Runtime training \
         checkpoint (a FlatBuffer with file identifier \"ODTC\" needs at least 8 bytes)",
        path.display()
    )]
    TooShort { path: PathBuf, len: usize },
    #[error(
        "checkpoint {}: file identifier (bytes 4..8) is \"{}\", expected \"ODTC\"; this is not \
         an ONNX Runtime on-device-training checkpoint",
        path.display(),
        found.escape_ascii()
    )]
    WrongIdentifier { path: PathBuf, found: [u8; 4] },
    #[error(
        "checkpoint {}: FlatBuffer verification failed (corrupt or truncated file): {source}",
        path.display()
    )]
    Verification {
        path: PathBuf,
        #[source]
        source: flatbuffers::InvalidFlatbuffer,
    },
    #[error(
        "checkpoint {}: version {version} is not supported (supported: {:?}; ONNX Runtime \
         1.19.2 writes version 2)",
        path.display(),
        SUPPORTED_VERSIONS
    )]
    UnsupportedVersion { path: PathBuf, version: i32 },
    #[error("checkpoint {}: {detail}", path.display())]
    Malformed { path: PathBuf, detail: String },
    #[error("checkpoint {}: tensor `{tensor}` has invalid dims {dims:?}: {detail}", path.display())]
    InvalidDims {
        path: PathBuf,
        tensor: String,
        dims: Vec<i64>,
        detail: String,
    },
    #[error(
        "checkpoint {}: tensor `{tensor}` is a string tensor (data type 8); string tensors are \
         not supported",
        path.display()
    )]
    StringTensor { path: PathBuf, tensor: String },
    #[error(
        "checkpoint {}: tensor `{tensor}` has unsupported data type {data_type} ({})",
        path.display(),
        data_type_name(*data_type)
    )]
    UnsupportedDataType {
        path: PathBuf,
        tensor: String,
        data_type: i32,
    },
    #[error(
        "checkpoint {}: tensor `{tensor}` has {actual} bytes of raw_data, but dims {dims:?} of \
         data type {} need {expected}",
        path.display(),
        data_type_name(*data_type)
    )]
    RawDataSize {
        path: PathBuf,
        tensor: String,
        dims: Vec<i64>,
        data_type: i32,
        expected: u64,
        actual: usize,
    },
    #[error(
        "checkpoint {}: tensor `{tensor}`: external data file {}: {detail}",
        path.display(),
        data_path.display()
    )]
    ExternalData {
        path: PathBuf,
        data_path: PathBuf,
        tensor: String,
        detail: String,
        #[source]
        source: Option<io::Error>,
    },
}

impl CheckpointError {
    /// The checkpoint file the error is about.
    pub fn path(&self) -> &Path {
        match self {
            Self::Io { path, .. }
            | Self::TooShort { path, .. }
            | Self::WrongIdentifier { path, .. }
            | Self::Verification { path, .. }
            | Self::UnsupportedVersion { path, .. }
            | Self::Malformed { path, .. }
            | Self::InvalidDims { path, .. }
            | Self::StringTensor { path, .. }
            | Self::UnsupportedDataType { path, .. }
            | Self::RawDataSize { path, .. }
            | Self::ExternalData { path, .. } => path,
        }
    }
}

// ----------------------------------------------------------------------------- entry points

/// Reads the checkpoint file at `path` (and, if it uses external data, `<path>.data`).
pub fn read_checkpoint(path: &Path) -> Result<Checkpoint, CheckpointError> {
    let bytes = crate::input::read_regular(path).map_err(|source| CheckpointError::Io {
        path: path.to_path_buf(),
        source,
    })?;
    parse_checkpoint(&bytes, path)
}

/// Parses checkpoint bytes. `origin` is the file they came from: it names the file in errors
/// and locates the external data file `<origin>.data` if tensors live there.
pub fn parse_checkpoint(bytes: &[u8], origin: &Path) -> Result<Checkpoint, CheckpointError> {
    let path = || origin.to_path_buf();
    if bytes.len() < 8 {
        return Err(CheckpointError::TooShort {
            path: path(),
            len: bytes.len(),
        });
    }
    let found = [bytes[4], bytes[5], bytes[6], bytes[7]];
    if found != FILE_IDENTIFIER {
        return Err(CheckpointError::WrongIdentifier {
            path: path(),
            found,
        });
    }

    // Legit files have an apparent size (bytes visited, counting shared vtables once per
    // table) well under twice their length; the bound stops DAG-shaped files from making us
    // copy the same data many times.
    let opts = flatbuffers::VerifierOptions {
        max_depth: 64,
        max_tables: (bytes.len() / 4).max(1_000_000),
        max_apparent_size: bytes.len().saturating_mul(4).max(1 << 20),
        ignore_missing_null_terminator: true,
    };
    let root = flatbuffers::root_with_opts::<fb::Checkpoint>(&opts, bytes).map_err(|source| {
        CheckpointError::Verification {
            path: path(),
            source,
        }
    })?;

    let version = root.version();
    if !SUPPORTED_VERSIONS.contains(&version) {
        return Err(CheckpointError::UnsupportedVersion {
            path: path(),
            version,
        });
    }

    let module_state = root
        .module_state()
        .ok_or_else(|| CheckpointError::Malformed {
            path: path(),
            detail: "the checkpoint has no module_state (no parameters)".into(),
        })?;
    let nominal = module_state.is_nominal_state();
    let has_external_data = module_state.has_external_data();
    let mut reader = TensorReader {
        origin,
        nominal,
        has_external_data,
        external: ExternalData::new(origin),
    };

    let trainable = reader.tensors(module_state.requires_grad_params(), "trainable parameter")?;
    let frozen = reader.tensors(module_state.frozen_params(), "frozen parameter")?;
    let mut seen = HashSet::new();
    for t in trainable.iter().chain(frozen.iter()) {
        if !seen.insert(t.name.as_str()) {
            return Err(CheckpointError::Malformed {
                path: path(),
                detail: format!("parameter `{}` appears more than once", t.name),
            });
        }
    }

    let mut optimizer_groups = Vec::new();
    for (gi, group) in root.optimizer_groups().into_iter().flatten().enumerate() {
        let name = group
            .group_name()
            .ok_or_else(|| CheckpointError::Malformed {
                path: path(),
                detail: format!("optimizer group {gi} has no group_name"),
            })?;
        let mut states = Vec::new();
        for (si, state) in group.optimizer_states().into_iter().flatten().enumerate() {
            let param = state
                .param_name()
                .ok_or_else(|| CheckpointError::Malformed {
                    path: path(),
                    detail: format!("optimizer group `{name}`: state {si} has no param_name"),
                })?;
            let momentums = reader.tensors(
                state.momentums(),
                &format!("momentum of `{param}` in optimizer group `{name}`"),
            )?;
            let mut seen = HashSet::new();
            if let Some(dup) = momentums.iter().find(|m| !seen.insert(m.name.as_str())) {
                return Err(CheckpointError::Malformed {
                    path: path(),
                    detail: format!(
                        "optimizer group `{name}`: parameter `{param}` has momentum `{}` twice",
                        dup.name
                    ),
                });
            }
            states.push(ParamOptimizerState {
                param: param.to_owned(),
                momentums,
            });
        }
        optimizer_groups.push(OptimizerGroup {
            name: name.to_owned(),
            step: group.step(),
            initial_learning_rate: group.initial_learning_rate(),
            states,
        });
    }

    let mut properties = Vec::new();
    if let Some(bag) = root.property_bag() {
        let unnamed = |kind: &str, i: usize| CheckpointError::Malformed {
            path: path(),
            detail: format!("{kind} property {i} has no name"),
        };
        for (i, p) in bag.ints().into_iter().flatten().enumerate() {
            let name = p.name().ok_or_else(|| unnamed("int", i))?;
            properties.push((name.to_owned(), PropertyValue::Int(p.value())));
        }
        for (i, p) in bag.floats().into_iter().flatten().enumerate() {
            let name = p.name().ok_or_else(|| unnamed("float", i))?;
            properties.push((name.to_owned(), PropertyValue::Float(p.value())));
        }
        for (i, p) in bag.strings().into_iter().flatten().enumerate() {
            let name = p.name().ok_or_else(|| unnamed("string", i))?;
            let value = p.value().ok_or_else(|| CheckpointError::Malformed {
                path: path(),
                detail: format!("string property `{name}` has no value"),
            })?;
            properties.push((name.to_owned(), PropertyValue::String(value.to_owned())));
        }
    }

    Ok(Checkpoint {
        version,
        nominal,
        has_external_data,
        trainable,
        frozen,
        optimizer_groups,
        properties,
    })
}

/// The external data file of checkpoint `checkpoint`: its path with `.data` appended.
pub fn external_data_path(checkpoint: &Path) -> PathBuf {
    let mut s = checkpoint.as_os_str().to_owned();
    s.push(".data");
    PathBuf::from(s)
}

// ----------------------------------------------------------------------------- tensors

struct TensorReader<'p> {
    origin: &'p Path,
    nominal: bool,
    has_external_data: bool,
    external: ExternalData,
}

impl TensorReader<'_> {
    fn tensors<'a>(
        &mut self,
        list: Option<flatbuffers::Vector<'a, flatbuffers::ForwardsUOffset<fb::Tensor<'a>>>>,
        role: &str,
    ) -> Result<Vec<CheckpointTensor>, CheckpointError> {
        let mut out = Vec::with_capacity(list.map_or(0, |l| l.len()));
        for (i, t) in list.into_iter().flatten().enumerate() {
            out.push(self.tensor(t, role, i)?);
        }
        Ok(out)
    }

    fn tensor(
        &mut self,
        t: fb::Tensor<'_>,
        role: &str,
        index: usize,
    ) -> Result<CheckpointTensor, CheckpointError> {
        let path = || self.origin.to_path_buf();
        let name = t
            .name()
            .ok_or_else(|| CheckpointError::Malformed {
                path: path(),
                detail: format!("{role} tensor {index} has no name"),
            })?
            .to_owned();
        let dims: Vec<i64> = t.dims().map(|d| d.iter().collect()).unwrap_or_default();
        let data_type = t.data_type();
        if data_type == DATA_TYPE_STRING {
            return Err(CheckpointError::StringTensor {
                path: path(),
                tensor: name,
            });
        }
        if element_size(data_type).is_none() {
            return Err(CheckpointError::UnsupportedDataType {
                path: path(),
                tensor: name,
                data_type,
            });
        }
        if let Some(&d) = dims.iter().find(|&&d| d < 0) {
            return Err(CheckpointError::InvalidDims {
                path: path(),
                tensor: name,
                dims,
                detail: format!("dim {d} is negative"),
            });
        }
        let expected = element_count(&dims)
            .and_then(|n| byte_len(data_type, n))
            .ok_or_else(|| CheckpointError::InvalidDims {
                path: path(),
                tensor: name.clone(),
                dims: dims.clone(),
                detail: "the byte size overflows 64 bits".into(),
            })?;
        let inline = t.raw_data();
        let external_offset = t.external_data_offset();

        let raw_data = if external_offset >= 0 {
            if inline.is_some_and(|r| !r.is_empty()) {
                return Err(CheckpointError::Malformed {
                    path: path(),
                    detail: format!(
                        "tensor `{name}` has both raw_data and external_data_offset \
                         {external_offset}"
                    ),
                });
            }
            if !self.has_external_data {
                return Err(CheckpointError::Malformed {
                    path: path(),
                    detail: format!(
                        "tensor `{name}` has external_data_offset {external_offset}, but the \
                         module state does not declare external data (has_external_data is false)"
                    ),
                });
            }
            self.external
                .read(self.origin, &name, external_offset as u64, expected)?
        } else {
            let raw = inline.unwrap_or_default();
            let nominal_empty = self.nominal && raw.is_empty();
            if !nominal_empty && raw.len() as u64 != expected {
                return Err(CheckpointError::RawDataSize {
                    path: path(),
                    tensor: name,
                    dims,
                    data_type,
                    expected,
                    actual: raw.len(),
                });
            }
            raw.to_vec()
        };
        Ok(CheckpointTensor {
            name,
            dims,
            data_type,
            raw_data,
        })
    }
}

/// The lazily opened `<checkpoint>.data` file.
struct ExternalData {
    data_path: PathBuf,
    file: Option<(File, u64)>,
}

impl ExternalData {
    fn new(checkpoint: &Path) -> Self {
        ExternalData {
            data_path: external_data_path(checkpoint),
            file: None,
        }
    }

    fn read(
        &mut self,
        origin: &Path,
        tensor: &str,
        offset: u64,
        len: u64,
    ) -> Result<Vec<u8>, CheckpointError> {
        let data_path = self.data_path.clone();
        let err = |detail: String, source: Option<io::Error>| CheckpointError::ExternalData {
            path: origin.to_path_buf(),
            data_path: data_path.clone(),
            tensor: tensor.to_owned(),
            detail,
            source,
        };
        if self.file.is_none() {
            // Confined to the checkpoint's folder like ONNX external data (a symlink
            // pointing elsewhere is refused), by the same rule.
            let folder = match origin.parent() {
                Some(p) if !p.as_os_str().is_empty() => p,
                _ => Path::new("."),
            };
            let canonical = std::fs::canonicalize(folder).map_err(|e| {
                err(
                    format!(
                        "cannot resolve the checkpoint folder {}: {e}",
                        folder.display()
                    ),
                    Some(e),
                )
            })?;
            let resolved =
                crate::model::confine(&canonical, &self.data_path).map_err(|c| match c {
                    crate::model::Confinement::Io(e) => {
                        err(format!("cannot open it: {e}"), Some(e))
                    }
                    crate::model::Confinement::Outside { resolved } => err(
                        format!(
                            "it resolves to {}, outside the checkpoint folder {}: refused",
                            resolved.display(),
                            canonical.display()
                        ),
                        None,
                    ),
                })?;
            let file = crate::input::open_regular(&resolved)
                .map_err(|e| err(format!("cannot open it: {e}"), Some(e)))?;
            let size = file
                .metadata()
                .map_err(|e| err(format!("cannot stat it: {e}"), Some(e)))?
                .len();
            self.file = Some((file, size));
        }
        let Some((file, size)) = self.file.as_mut() else {
            return Err(err("internal error: file not open".into(), None));
        };
        let end = offset
            .checked_add(len)
            .filter(|&end| end <= *size)
            .ok_or_else(|| {
                err(
                    format!(
                        "the tensor needs bytes {offset}..{} but the file has {size} bytes",
                        offset.saturating_add(len)
                    ),
                    None,
                )
            })?;
        let n = usize::try_from(len)
            .map_err(|_| err(format!("{len} bytes do not fit in memory"), None))?;
        let mut buf = vec![0u8; n];
        file.seek(SeekFrom::Start(offset))
            .and_then(|_| file.read_exact(&mut buf))
            .map_err(|e| err(format!("cannot read bytes {offset}..{end}: {e}"), Some(e)))?;
        Ok(buf)
    }
}

// ----------------------------------------------------------------------------- data types

/// Element count of `dims` (1 for a scalar); `None` on a negative dim or overflow.
fn element_count(dims: &[i64]) -> Option<u64> {
    dims.iter()
        .try_fold(1u64, |acc, &d| acc.checked_mul(u64::try_from(d).ok()?))
}

/// Storage size of one element, as (numerator bits): sub-byte types are packed.
fn element_size(data_type: i32) -> Option<ElementSize> {
    use ElementSize::{Bits, Bytes};
    Some(match data_type {
        1 => Bytes(4),                // FLOAT
        2 | 3 | 9 => Bytes(1),        // UINT8, INT8, BOOL
        4 | 5 | 10 | 16 => Bytes(2),  // UINT16, INT16, FLOAT16, BFLOAT16
        6 | 12 => Bytes(4),           // INT32, UINT32
        7 | 11 | 13 | 14 => Bytes(8), // INT64, DOUBLE, UINT64, COMPLEX64
        15 => Bytes(16),              // COMPLEX128
        17..=20 | 24 => Bytes(1),     // FLOAT8 variants, FLOAT8E8M0
        21..=23 => Bits(4),           // UINT4, INT4, FLOAT4E2M1 (two per byte)
        25 | 26 => Bits(2),           // UINT2, INT2 (four per byte)
        _ => return None,             // UNDEFINED, STRING, unknown
    })
}

#[derive(Clone, Copy)]
enum ElementSize {
    Bytes(u64),
    Bits(u64),
}

/// Bytes needed by `count` elements of `data_type`; `None` for string/unknown or overflow.
fn byte_len(data_type: i32, count: u64) -> Option<u64> {
    match element_size(data_type)? {
        ElementSize::Bytes(b) => count.checked_mul(b),
        ElementSize::Bits(bits) => Some(count.checked_mul(bits)?.div_ceil(8)),
    }
}

/// The ONNX name of a `TensorProto.DataType` value.
pub fn data_type_name(data_type: i32) -> &'static str {
    match data_type {
        0 => "UNDEFINED",
        1 => "FLOAT",
        2 => "UINT8",
        3 => "INT8",
        4 => "UINT16",
        5 => "INT16",
        6 => "INT32",
        7 => "INT64",
        8 => "STRING",
        9 => "BOOL",
        10 => "FLOAT16",
        11 => "DOUBLE",
        12 => "UINT32",
        13 => "UINT64",
        14 => "COMPLEX64",
        15 => "COMPLEX128",
        16 => "BFLOAT16",
        17 => "FLOAT8E4M3FN",
        18 => "FLOAT8E4M3FNUZ",
        19 => "FLOAT8E5M2",
        20 => "FLOAT8E5M2FNUZ",
        21 => "UINT4",
        22 => "INT4",
        23 => "FLOAT4E2M1",
        24 => "FLOAT8E8M0",
        25 => "UINT2",
        26 => "INT2",
        _ => "unknown",
    }
}

impl fmt::Display for PropertyValue {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            PropertyValue::Int(v) => write!(f, "{v}"),
            PropertyValue::Float(v) => write!(f, "{v}"),
            PropertyValue::String(v) => write!(f, "{v:?}"),
        }
    }
}

// ----------------------------------------------------------------------------- FlatBuffer tables

/// Hand-written accessors for the tables of `ort_training_checkpoint.fbs`.
///
/// Each table's `Verifiable` impl visits every field that its accessors read, with the same
/// type; `flatbuffers::root_with_opts` runs it over the whole tree before the root is handed
/// out. That is what makes the `unsafe` `Table::get` calls below sound: every offset they
/// follow was bounds- and alignment-checked by the verifier. Fields the reader never reads
/// (`Tensor.doc_string`, `Tensor.string_data`) are neither verified nor read.
mod fb {
    use flatbuffers::{
        Follow, ForwardsUOffset, InvalidFlatbuffer, Table, VOffsetT, Vector, Verifiable, Verifier,
    };

    /// Vtable slot of field `index` (0-based, schema order).
    const fn slot(index: u16) -> VOffsetT {
        4 + 2 * index
    }

    type Str<'a> = ForwardsUOffset<&'a str>;
    type TableVec<'a, T> = ForwardsUOffset<Vector<'a, ForwardsUOffset<T>>>;

    macro_rules! table {
        ($name:ident) => {
            #[derive(Clone, Copy)]
            pub(super) struct $name<'a>(Table<'a>);

            impl<'a> Follow<'a> for $name<'a> {
                type Inner = $name<'a>;
                unsafe fn follow(buf: &'a [u8], loc: usize) -> Self::Inner {
                    // SAFETY: forwarded contract of `Follow::follow`: `loc` holds a verified
                    // table of this type.
                    $name(unsafe { Table::new(buf, loc) })
                }
            }
        };
    }

    /// Reads field `$slot` of `$self` as `$ty`.
    macro_rules! field {
        ($self:ident, $ty:ty, $slot:expr) => {
            // SAFETY: the table was verified with `$ty` at `$slot` (see the module docs).
            unsafe { $self.0.get::<$ty>($slot, None) }
        };
        ($self:ident, $ty:ty, $slot:expr, $default:expr) => {
            // SAFETY: as above.
            unsafe { $self.0.get::<$ty>($slot, Some($default)) }.unwrap_or($default)
        };
    }

    // Checkpoint { version:int32; module_state:ModuleState; optimizer_groups:[OptimizerGroup];
    //              property_bag:PropertyBag; }
    table!(Checkpoint);
    const CHECKPOINT_VERSION: VOffsetT = slot(0);
    const CHECKPOINT_MODULE_STATE: VOffsetT = slot(1);
    const CHECKPOINT_OPTIMIZER_GROUPS: VOffsetT = slot(2);
    const CHECKPOINT_PROPERTY_BAG: VOffsetT = slot(3);

    impl<'a> Checkpoint<'a> {
        pub(super) fn version(&self) -> i32 {
            field!(self, i32, CHECKPOINT_VERSION, 0)
        }
        pub(super) fn module_state(&self) -> Option<ModuleState<'a>> {
            field!(
                self,
                ForwardsUOffset<ModuleState<'a>>,
                CHECKPOINT_MODULE_STATE
            )
        }
        pub(super) fn optimizer_groups(
            &self,
        ) -> Option<Vector<'a, ForwardsUOffset<OptimizerGroup<'a>>>> {
            field!(
                self,
                TableVec<'a, OptimizerGroup<'a>>,
                CHECKPOINT_OPTIMIZER_GROUPS
            )
        }
        pub(super) fn property_bag(&self) -> Option<PropertyBag<'a>> {
            field!(
                self,
                ForwardsUOffset<PropertyBag<'a>>,
                CHECKPOINT_PROPERTY_BAG
            )
        }
    }

    impl Verifiable for Checkpoint<'_> {
        fn run_verifier(v: &mut Verifier, pos: usize) -> Result<(), InvalidFlatbuffer> {
            v.visit_table(pos)?
                .visit_field::<i32>("version", CHECKPOINT_VERSION, false)?
                .visit_field::<ForwardsUOffset<ModuleState>>(
                    "module_state",
                    CHECKPOINT_MODULE_STATE,
                    false,
                )?
                .visit_field::<TableVec<OptimizerGroup>>(
                    "optimizer_groups",
                    CHECKPOINT_OPTIMIZER_GROUPS,
                    false,
                )?
                .visit_field::<ForwardsUOffset<PropertyBag>>(
                    "property_bag",
                    CHECKPOINT_PROPERTY_BAG,
                    false,
                )?
                .finish();
            Ok(())
        }
    }

    // ModuleState { requires_grad_params:[Tensor]; frozen_params:[Tensor];
    //               is_nominal_state:bool; has_external_data:bool; }
    table!(ModuleState);
    const MODULE_REQUIRES_GRAD: VOffsetT = slot(0);
    const MODULE_FROZEN: VOffsetT = slot(1);
    const MODULE_NOMINAL: VOffsetT = slot(2);
    const MODULE_EXTERNAL: VOffsetT = slot(3);

    impl<'a> ModuleState<'a> {
        pub(super) fn requires_grad_params(
            &self,
        ) -> Option<Vector<'a, ForwardsUOffset<Tensor<'a>>>> {
            field!(self, TableVec<'a, Tensor<'a>>, MODULE_REQUIRES_GRAD)
        }
        pub(super) fn frozen_params(&self) -> Option<Vector<'a, ForwardsUOffset<Tensor<'a>>>> {
            field!(self, TableVec<'a, Tensor<'a>>, MODULE_FROZEN)
        }
        pub(super) fn is_nominal_state(&self) -> bool {
            field!(self, bool, MODULE_NOMINAL, false)
        }
        pub(super) fn has_external_data(&self) -> bool {
            field!(self, bool, MODULE_EXTERNAL, false)
        }
    }

    impl Verifiable for ModuleState<'_> {
        fn run_verifier(v: &mut Verifier, pos: usize) -> Result<(), InvalidFlatbuffer> {
            v.visit_table(pos)?
                .visit_field::<TableVec<Tensor>>(
                    "requires_grad_params",
                    MODULE_REQUIRES_GRAD,
                    false,
                )?
                .visit_field::<TableVec<Tensor>>("frozen_params", MODULE_FROZEN, false)?
                .visit_field::<bool>("is_nominal_state", MODULE_NOMINAL, false)?
                .visit_field::<bool>("has_external_data", MODULE_EXTERNAL, false)?
                .finish();
            Ok(())
        }
    }

    // Tensor (ort.fbs) { name:string; doc_string:string; dims:[int64]; data_type:int32;
    //                    raw_data:[uint8]; string_data:[string]; external_data_offset:int64 = -1; }
    table!(Tensor);
    const TENSOR_NAME: VOffsetT = slot(0);
    const TENSOR_DIMS: VOffsetT = slot(2);
    const TENSOR_DATA_TYPE: VOffsetT = slot(3);
    const TENSOR_RAW_DATA: VOffsetT = slot(4);
    const TENSOR_EXTERNAL_DATA_OFFSET: VOffsetT = slot(6);

    impl<'a> Tensor<'a> {
        pub(super) fn name(&self) -> Option<&'a str> {
            field!(self, Str<'a>, TENSOR_NAME)
        }
        pub(super) fn dims(&self) -> Option<Vector<'a, i64>> {
            field!(self, ForwardsUOffset<Vector<'a, i64>>, TENSOR_DIMS)
        }
        pub(super) fn data_type(&self) -> i32 {
            field!(self, i32, TENSOR_DATA_TYPE, 0)
        }
        pub(super) fn raw_data(&self) -> Option<&'a [u8]> {
            field!(self, ForwardsUOffset<&'a [u8]>, TENSOR_RAW_DATA)
        }
        pub(super) fn external_data_offset(&self) -> i64 {
            field!(self, i64, TENSOR_EXTERNAL_DATA_OFFSET, -1)
        }
    }

    impl Verifiable for Tensor<'_> {
        fn run_verifier(v: &mut Verifier, pos: usize) -> Result<(), InvalidFlatbuffer> {
            v.visit_table(pos)?
                .visit_field::<Str>("name", TENSOR_NAME, false)?
                .visit_field::<ForwardsUOffset<DimsVector>>("dims", TENSOR_DIMS, false)?
                .visit_field::<i32>("data_type", TENSOR_DATA_TYPE, false)?
                .visit_field::<ForwardsUOffset<Vector<u8>>>("raw_data", TENSOR_RAW_DATA, false)?
                .visit_field::<i64>("external_data_offset", TENSOR_EXTERNAL_DATA_OFFSET, false)?
                .finish();
            Ok(())
        }
    }

    /// Verifies `Tensor.dims` (`[int64]`) like FlatBuffers' C++ verifier, which ONNX Runtime
    /// uses: the length prefix must be 4-aligned and the elements inside the buffer, but the
    /// elements need not be 8-aligned. ONNX Runtime 1.19.2 writes nominal checkpoints whose
    /// empty `dims` vectors are not 8-aligned, which the `flatbuffers` crate's own `Vector<i64>`
    /// check rejects. Reading is alignment-independent (`read_scalar_at` copies bytes).
    struct DimsVector;

    impl Verifiable for DimsVector {
        fn run_verifier(v: &mut Verifier, pos: usize) -> Result<(), InvalidFlatbuffer> {
            let len = v.get_uoffset(pos)? as usize;
            let start = pos.saturating_add(flatbuffers::SIZE_UOFFSET);
            v.range_in_buffer(start, len.saturating_mul(core::mem::size_of::<i64>()))
        }
    }

    // OptimizerGroup { group_name:string; step:int64; initial_learning_rate:float;
    //                  optimizer_states:[ParameterOptimizerState]; }
    table!(OptimizerGroup);
    const GROUP_NAME: VOffsetT = slot(0);
    const GROUP_STEP: VOffsetT = slot(1);
    const GROUP_LR: VOffsetT = slot(2);
    const GROUP_STATES: VOffsetT = slot(3);

    impl<'a> OptimizerGroup<'a> {
        pub(super) fn group_name(&self) -> Option<&'a str> {
            field!(self, Str<'a>, GROUP_NAME)
        }
        pub(super) fn step(&self) -> i64 {
            field!(self, i64, GROUP_STEP, 0)
        }
        pub(super) fn initial_learning_rate(&self) -> f32 {
            field!(self, f32, GROUP_LR, 0.0)
        }
        pub(super) fn optimizer_states(
            &self,
        ) -> Option<Vector<'a, ForwardsUOffset<ParameterOptimizerState<'a>>>> {
            field!(
                self,
                TableVec<'a, ParameterOptimizerState<'a>>,
                GROUP_STATES
            )
        }
    }

    impl Verifiable for OptimizerGroup<'_> {
        fn run_verifier(v: &mut Verifier, pos: usize) -> Result<(), InvalidFlatbuffer> {
            v.visit_table(pos)?
                .visit_field::<Str>("group_name", GROUP_NAME, false)?
                .visit_field::<i64>("step", GROUP_STEP, false)?
                .visit_field::<f32>("initial_learning_rate", GROUP_LR, false)?
                .visit_field::<TableVec<ParameterOptimizerState>>(
                    "optimizer_states",
                    GROUP_STATES,
                    false,
                )?
                .finish();
            Ok(())
        }
    }

    // ParameterOptimizerState { param_name:string; momentums:[Tensor]; }
    table!(ParameterOptimizerState);
    const STATE_PARAM: VOffsetT = slot(0);
    const STATE_MOMENTUMS: VOffsetT = slot(1);

    impl<'a> ParameterOptimizerState<'a> {
        pub(super) fn param_name(&self) -> Option<&'a str> {
            field!(self, Str<'a>, STATE_PARAM)
        }
        pub(super) fn momentums(&self) -> Option<Vector<'a, ForwardsUOffset<Tensor<'a>>>> {
            field!(self, TableVec<'a, Tensor<'a>>, STATE_MOMENTUMS)
        }
    }

    impl Verifiable for ParameterOptimizerState<'_> {
        fn run_verifier(v: &mut Verifier, pos: usize) -> Result<(), InvalidFlatbuffer> {
            v.visit_table(pos)?
                .visit_field::<Str>("param_name", STATE_PARAM, false)?
                .visit_field::<TableVec<Tensor>>("momentums", STATE_MOMENTUMS, false)?
                .finish();
            Ok(())
        }
    }

    // PropertyBag { ints:[IntProperty]; floats:[FloatProperty]; strings:[StringProperty]; }
    table!(PropertyBag);
    const BAG_INTS: VOffsetT = slot(0);
    const BAG_FLOATS: VOffsetT = slot(1);
    const BAG_STRINGS: VOffsetT = slot(2);

    impl<'a> PropertyBag<'a> {
        pub(super) fn ints(&self) -> Option<Vector<'a, ForwardsUOffset<IntProperty<'a>>>> {
            field!(self, TableVec<'a, IntProperty<'a>>, BAG_INTS)
        }
        pub(super) fn floats(&self) -> Option<Vector<'a, ForwardsUOffset<FloatProperty<'a>>>> {
            field!(self, TableVec<'a, FloatProperty<'a>>, BAG_FLOATS)
        }
        pub(super) fn strings(&self) -> Option<Vector<'a, ForwardsUOffset<StringProperty<'a>>>> {
            field!(self, TableVec<'a, StringProperty<'a>>, BAG_STRINGS)
        }
    }

    impl Verifiable for PropertyBag<'_> {
        fn run_verifier(v: &mut Verifier, pos: usize) -> Result<(), InvalidFlatbuffer> {
            v.visit_table(pos)?
                .visit_field::<TableVec<IntProperty>>("ints", BAG_INTS, false)?
                .visit_field::<TableVec<FloatProperty>>("floats", BAG_FLOATS, false)?
                .visit_field::<TableVec<StringProperty>>("strings", BAG_STRINGS, false)?
                .finish();
            Ok(())
        }
    }

    // IntProperty { name:string; value:int64; }  FloatProperty { name:string; value:float; }
    // StringProperty { name:string; value:string; }
    const PROPERTY_NAME: VOffsetT = slot(0);
    const PROPERTY_VALUE: VOffsetT = slot(1);

    table!(IntProperty);
    impl<'a> IntProperty<'a> {
        pub(super) fn name(&self) -> Option<&'a str> {
            field!(self, Str<'a>, PROPERTY_NAME)
        }
        pub(super) fn value(&self) -> i64 {
            field!(self, i64, PROPERTY_VALUE, 0)
        }
    }
    impl Verifiable for IntProperty<'_> {
        fn run_verifier(v: &mut Verifier, pos: usize) -> Result<(), InvalidFlatbuffer> {
            v.visit_table(pos)?
                .visit_field::<Str>("name", PROPERTY_NAME, false)?
                .visit_field::<i64>("value", PROPERTY_VALUE, false)?
                .finish();
            Ok(())
        }
    }

    table!(FloatProperty);
    impl<'a> FloatProperty<'a> {
        pub(super) fn name(&self) -> Option<&'a str> {
            field!(self, Str<'a>, PROPERTY_NAME)
        }
        pub(super) fn value(&self) -> f32 {
            field!(self, f32, PROPERTY_VALUE, 0.0)
        }
    }
    impl Verifiable for FloatProperty<'_> {
        fn run_verifier(v: &mut Verifier, pos: usize) -> Result<(), InvalidFlatbuffer> {
            v.visit_table(pos)?
                .visit_field::<Str>("name", PROPERTY_NAME, false)?
                .visit_field::<f32>("value", PROPERTY_VALUE, false)?
                .finish();
            Ok(())
        }
    }

    table!(StringProperty);
    impl<'a> StringProperty<'a> {
        pub(super) fn name(&self) -> Option<&'a str> {
            field!(self, Str<'a>, PROPERTY_NAME)
        }
        pub(super) fn value(&self) -> Option<&'a str> {
            field!(self, Str<'a>, PROPERTY_VALUE)
        }
    }
    impl Verifiable for StringProperty<'_> {
        fn run_verifier(v: &mut Verifier, pos: usize) -> Result<(), InvalidFlatbuffer> {
            v.visit_table(pos)?
                .visit_field::<Str>("name", PROPERTY_NAME, false)?
                .visit_field::<Str>("value", PROPERTY_VALUE, false)?
                .finish();
            Ok(())
        }
    }
}
