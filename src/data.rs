//! Host tensors and state files: `.npz` (NumPy archives) for training data, state and
//! fixtures; `.safetensors` for state, by extension ([`read_state`], [`write_state`]). Writes
//! are atomic: a temporary file in the target folder, then a rename.

use std::borrow::Cow;
use std::collections::{BTreeMap, BTreeSet};
use std::io::BufReader;
use std::path::{Path, PathBuf};

use ndarray::{ArrayD, IxDyn};
use ndarray_npy::NpzWriter;

/// A host tensor of one of the element types our graphs exchange with a host.
#[derive(Clone, Debug, PartialEq)]
pub enum Tensor {
    F32(ArrayD<f32>),
    F64(ArrayD<f64>),
    I64(ArrayD<i64>),
    I32(ArrayD<i32>),
    Bool(ArrayD<bool>),
}

impl Tensor {
    pub fn shape(&self) -> &[usize] {
        match self {
            Tensor::F32(a) => a.shape(),
            Tensor::F64(a) => a.shape(),
            Tensor::I64(a) => a.shape(),
            Tensor::I32(a) => a.shape(),
            Tensor::Bool(a) => a.shape(),
        }
    }

    /// How many elements are NaN or infinite (none in an integer or bool tensor).
    pub fn non_finite_count(&self) -> usize {
        match self {
            Tensor::F32(a) => a.iter().filter(|v| !v.is_finite()).count(),
            Tensor::F64(a) => a.iter().filter(|v| !v.is_finite()).count(),
            Tensor::I64(_) | Tensor::I32(_) | Tensor::Bool(_) => 0,
        }
    }

    /// The rows (indices along the first axis) holding a NaN or infinite element, in order
    /// (none in an integer or bool tensor, or a scalar).
    pub fn non_finite_rows(&self) -> Vec<usize> {
        fn rows<T: Copy>(a: &ArrayD<T>, finite: impl Fn(T) -> bool) -> Vec<usize> {
            if a.ndim() == 0 {
                return Vec::new();
            }
            let bad = |(_, r): &(usize, ndarray::ArrayViewD<T>)| !r.iter().all(|v| finite(*v));
            a.outer_iter()
                .enumerate()
                .filter(bad)
                .map(|(i, _)| i)
                .collect()
        }
        match self {
            Tensor::F32(a) => rows(a, f32::is_finite),
            Tensor::F64(a) => rows(a, f64::is_finite),
            Tensor::I64(_) | Tensor::I32(_) | Tensor::Bool(_) => Vec::new(),
        }
    }

    /// The ONNX `TensorProto.DataType` of the elements.
    pub fn elem_type(&self) -> i32 {
        use crate::proto::tensor_proto::DataType as D;
        (match self {
            Tensor::F32(_) => D::Float,
            Tensor::F64(_) => D::Double,
            Tensor::I64(_) => D::Int64,
            Tensor::I32(_) => D::Int32,
            Tensor::Bool(_) => D::Bool,
        }) as i32
    }

    pub fn as_f32(&self) -> Option<&ArrayD<f32>> {
        match self {
            Tensor::F32(a) => Some(a),
            _ => None,
        }
    }

    pub fn as_i64(&self) -> Option<&ArrayD<i64>> {
        match self {
            Tensor::I64(a) => Some(a),
            _ => None,
        }
    }

    /// The given rows of the first axis, in that order.
    pub fn rows(&self, rows: &[usize]) -> Tensor {
        let axis = ndarray::Axis(0);
        match self {
            Tensor::F32(a) => Tensor::F32(a.select(axis, rows)),
            Tensor::F64(a) => Tensor::F64(a.select(axis, rows)),
            Tensor::I64(a) => Tensor::I64(a.select(axis, rows)),
            Tensor::I32(a) => Tensor::I32(a.select(axis, rows)),
            Tensor::Bool(a) => Tensor::Bool(a.select(axis, rows)),
        }
    }

    /// The tensor as an initializer value.
    pub fn to_tensor_proto(&self, name: &str) -> crate::proto::TensorProto {
        let raw: Vec<u8> = match self {
            Tensor::F32(a) => a.iter().flat_map(|v| v.to_le_bytes()).collect(),
            Tensor::F64(a) => a.iter().flat_map(|v| v.to_le_bytes()).collect(),
            Tensor::I64(a) => a.iter().flat_map(|v| v.to_le_bytes()).collect(),
            Tensor::I32(a) => a.iter().flat_map(|v| v.to_le_bytes()).collect(),
            Tensor::Bool(a) => a.iter().map(|v| *v as u8).collect(),
        };
        crate::proto::TensorProto {
            name: Some(name.to_string()),
            dims: self.shape().iter().map(|d| *d as i64).collect(),
            data_type: Some(self.elem_type()),
            raw_data: Some(raw),
            ..Default::default()
        }
    }

    /// Reads an initializer (raw or typed storage) into a host tensor.
    pub fn from_tensor_proto(t: &crate::proto::TensorProto) -> Result<Tensor, String> {
        use crate::proto::tensor_proto::DataType as D;
        let shape: Vec<usize> = t
            .dims
            .iter()
            .map(|d| usize::try_from(*d).map_err(|_| format!("negative dimension {d}")))
            .collect::<Result<_, _>>()?;
        let count: usize = shape.iter().product();
        let raw = t.raw_data();
        fn build<T: Clone>(
            shape: &[usize],
            values: Vec<T>,
            count: usize,
        ) -> Result<ArrayD<T>, String> {
            if values.len() != count {
                return Err(format!(
                    "holds {} values for shape {shape:?} ({count} elements)",
                    values.len()
                ));
            }
            ArrayD::from_shape_vec(IxDyn(shape), values).map_err(|e| e.to_string())
        }
        macro_rules! le {
            ($ty:ty, $n:expr) => {
                raw.chunks_exact($n)
                    .map(|c| <$ty>::from_le_bytes(c.try_into().expect("chunk size")))
                    .collect::<Vec<$ty>>()
            };
        }
        Ok(match D::try_from(t.data_type()) {
            Ok(D::Float) if t.raw_data.is_some() => Tensor::F32(build(&shape, le!(f32, 4), count)?),
            Ok(D::Float) => Tensor::F32(build(&shape, t.float_data.clone(), count)?),
            Ok(D::Double) if t.raw_data.is_some() => {
                Tensor::F64(build(&shape, le!(f64, 8), count)?)
            }
            Ok(D::Double) => Tensor::F64(build(&shape, t.double_data.clone(), count)?),
            Ok(D::Int64) if t.raw_data.is_some() => Tensor::I64(build(&shape, le!(i64, 8), count)?),
            Ok(D::Int64) => Tensor::I64(build(&shape, t.int64_data.clone(), count)?),
            Ok(D::Int32) if t.raw_data.is_some() => Tensor::I32(build(&shape, le!(i32, 4), count)?),
            Ok(D::Int32) => Tensor::I32(build(&shape, t.int32_data.clone(), count)?),
            Ok(D::Bool) if t.raw_data.is_some() => {
                Tensor::Bool(build(&shape, raw.iter().map(|b| *b != 0).collect(), count)?)
            }
            Ok(D::Bool) => Tensor::Bool(build(
                &shape,
                t.int32_data.iter().map(|b| *b != 0).collect(),
                count,
            )?),
            _ => {
                return Err(format!(
                    "element type {} is not supported on the host",
                    crate::ir::print::elem_type_name(t.data_type())
                ))
            }
        })
    }
}

#[derive(Debug, thiserror::Error)]
pub enum DataError {
    #[error("{}: cannot open: {source}", path.display())]
    Open {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("{}: not a readable .npz archive: {message}", path.display())]
    Archive { path: PathBuf, message: String },
    #[error("{}: array '{name}' has an element type we cannot read (float32, float64, int64, int32, bool are supported)", path.display())]
    ElementType { path: PathBuf, name: String },
    #[error("{}: cannot write: {message}", path.display())]
    Write { path: PathBuf, message: String },
    #[error("{}: unknown state file extension: state files are .npz or .safetensors", path.display())]
    Extension { path: PathBuf },
    #[error("{}: not a readable .safetensors file: {message}", path.display())]
    Safetensors { path: PathBuf, message: String },
    #[error("{}: tensor '{name}' is {dtype}, which we cannot read (F32, F64, I64, I32, BOOL are supported)", path.display())]
    SafetensorsDtype {
        path: PathBuf,
        name: String,
        dtype: String,
    },
}

/// Reads every array of an `.npz` file, by name.
pub fn read_npz(path: &Path) -> Result<BTreeMap<String, Tensor>, DataError> {
    Ok(read_npz_arrays(path, None)?.arrays)
}

/// What [`read_npz_only`] or [`read_state_only`] read: the arrays asked for (those present),
/// and the names of the others, which were not decoded.
#[derive(Debug, Default)]
pub struct NpzContents {
    pub arrays: BTreeMap<String, Tensor>,
    pub ignored: Vec<String>,
}

/// Reads the arrays named in `names` from an `.npz` file; the others are listed in
/// [`NpzContents::ignored`] and never decoded (whatever their shape or element type).
pub fn read_npz_only(path: &Path, names: &[String]) -> Result<NpzContents, DataError> {
    read_npz_arrays(path, Some(names))
}

/// The note for the arrays of `file` that training does not take ([`NpzContents::ignored`]),
/// naming the first few; `None` when there are none.
pub fn ignored_note(file: &Path, ignored: &[String]) -> Option<String> {
    const SHOWN: usize = 5;
    if ignored.is_empty() {
        return None;
    }
    let mut names: Vec<String> = ignored
        .iter()
        .take(SHOWN)
        .map(|n| format!("'{n}'"))
        .collect();
    if ignored.len() > SHOWN {
        names.push(format!("and {} more", ignored.len() - SHOWN));
    }
    Some(format!(
        "note: {}: ignoring {} array{} the step does not take: {}",
        file.display(),
        ignored.len(),
        if ignored.len() == 1 { "" } else { "s" },
        names.join(", ")
    ))
}

/// The most bytes deflate makes of one compressed byte (its limit is about 1032:1).
const MAX_DEFLATE_RATIO: u64 = 1032;
/// The longest `.npy` header we read (NumPy writes under 100 bytes).
const MAX_NPY_HEADER: usize = 1 << 20;

/// Reads the arrays of an `.npz` file (all, or those in `only`) into memory.
fn read_npz_arrays(path: &Path, only: Option<&[String]>) -> Result<NpzContents, DataError> {
    let file = open_input(path)?;
    Ok(read_npz_entries(&file, path, only, false)?.0)
}

/// Opens an input file for reading ([`crate::input::open_regular`]).
pub(crate) fn open_input(path: &Path) -> Result<std::fs::File, DataError> {
    crate::input::open_regular(path).map_err(|source| DataError::Open {
        path: path.to_path_buf(),
        source,
    })
}

/// An array of an `.npz` file left where it lies: NumPy stored it uncompressed (`np.savez`),
/// in C order and little-endian, so its rows can be read from the file as they are needed.
#[derive(Clone, Debug, PartialEq)]
pub struct StoredArray {
    /// The ONNX `TensorProto.DataType` of the elements (float32, float64, int64, int32).
    pub elem_type: i32,
    pub shape: Vec<usize>,
    /// Where element 0 lies in the file.
    pub offset: u64,
}

impl StoredArray {
    /// The bytes of one element.
    pub fn elem_size(&self) -> usize {
        use crate::proto::tensor_proto::DataType as D;
        if self.elem_type == D::Float as i32 || self.elem_type == D::Int32 as i32 {
            4
        } else {
            8
        }
    }

    /// The bytes of one row (index of the first axis).
    pub fn row_bytes(&self) -> usize {
        self.shape.iter().skip(1).product::<usize>() * self.elem_size()
    }
}

/// The `.npz` reader (of the open regular file `file`, named `path` in messages): nothing is
/// allocated before the archive entry's sizes and the `.npy` header agree, and the entry can
/// hold no more than deflate can make of its compressed bytes; all the arrays decoded must
/// fit in the memory available. With `leave_stored`, the arrays [`StoredArray`] describes
/// are not read but returned as where they lie (their bytes checked to be in the file).
pub(crate) fn read_npz_entries(
    file: &std::fs::File,
    path: &Path,
    only: Option<&[String]>,
    leave_stored: bool,
) -> Result<(NpzContents, BTreeMap<String, StoredArray>), DataError> {
    let archive = |e: &dyn std::fmt::Display| DataError::Archive {
        path: path.to_path_buf(),
        message: e.to_string(),
    };
    let file_len = file.metadata().map_err(|e| archive(&e))?.len();
    let mut zip = zip::ZipArchive::new(BufReader::new(file)).map_err(|e| archive(&e))?;
    let available = crate::input::memory_budget();
    let mut total: u64 = 0;
    let mut out = NpzContents::default();
    let mut stored = BTreeMap::new();
    for index in 0..zip.len() {
        let mut entry = zip.by_index(index).map_err(|e| archive(&e))?;
        let entry_name = entry.name().to_string();
        let name = entry_name
            .strip_suffix(".npy")
            .unwrap_or(&entry_name)
            .to_string();
        if only.is_some_and(|only| !only.contains(&name)) || entry.is_dir() {
            out.ignored.push(name);
            continue;
        }
        if out.arrays.contains_key(&name) || stored.contains_key(&name) {
            return Err(archive(&format!("two arrays are named '{name}'")));
        }
        let bad = |message: String| archive(&format!("array '{name}': {message}"));
        let declared = entry.size();
        let compressed = entry.compressed_size();
        let most = match entry.compression() {
            zip::CompressionMethod::Stored => compressed,
            _ => compressed
                .saturating_mul(MAX_DEFLATE_RATIO)
                .saturating_add(1024),
        };
        if declared > most {
            return Err(bad(format!(
                "the archive entry claims {declared} bytes from {compressed} compressed bytes, more than compression can make of them"
            )));
        }
        let plain_entry =
            entry.compression() == zip::CompressionMethod::Stored && !entry.encrypted();
        let data_start = entry.data_start();
        let mut reader = std::io::Read::take(&mut entry, declared);
        let (header, header_len) = read_npy_header(&mut reader, declared).map_err(bad)?;
        // The descriptor as Python writes it: '<f4' for a simple dtype, a list for a record.
        let literal = header.type_descriptor.to_string();
        let descr = literal
            .strip_prefix('\'')
            .and_then(|s| s.strip_suffix('\''))
            .unwrap_or(&literal)
            .to_string();
        let elem_size: u64 = match descr.get(1..) {
            Some("f4" | "i4") => 4,
            Some("f8" | "i8") => 8,
            Some("b1") => 1,
            _ => {
                return Err(DataError::ElementType {
                    path: path.to_path_buf(),
                    name,
                })
            }
        };
        let count = header
            .shape
            .iter()
            .try_fold(1u64, |n, d| n.checked_mul(*d as u64));
        let bytes = count.and_then(|c| c.checked_mul(elem_size));
        let holds = declared - header_len;
        let (count, bytes) = match (count, bytes) {
            (Some(c), Some(b)) if b <= holds => (c, b),
            _ => {
                return Err(bad(format!(
                    "its header claims shape {:?} of '{descr}', {} bytes, but the archive entry holds {holds} bytes of data",
                    header.shape,
                    bytes.map_or("more than 2^64".to_string(), |b| b.to_string())
                )))
            }
        };
        let stored_plainly = plain_entry
            && !header.layout.is_fortran()
            && matches!(descr.as_str(), "<f4" | "<f8" | "<i8" | "<i4");
        if leave_stored && stored_plainly {
            let offset = data_start + header_len;
            if offset.checked_add(bytes).is_none_or(|end| end > file_len) {
                return Err(bad(format!(
                    "its data ({bytes} bytes at byte {offset}) runs past the end of the file ({file_len} bytes)"
                )));
            }
            let elem_type = match &descr[1..] {
                "f4" => crate::proto::tensor_proto::DataType::Float,
                "f8" => crate::proto::tensor_proto::DataType::Double,
                "i8" => crate::proto::tensor_proto::DataType::Int64,
                _ => crate::proto::tensor_proto::DataType::Int32,
            } as i32;
            let shape = header.shape.clone();
            verify_crc(&mut entry).map_err(|e| bad(e.to_string()))?;
            stored.insert(
                name,
                StoredArray {
                    elem_type,
                    shape,
                    offset,
                },
            );
            continue;
        }
        total = total.saturating_add(bytes);
        if let Some(available) = available.filter(|a| total > *a) {
            return Err(bad(format!(
                "the arrays read so far need {total} bytes, more than the {available} bytes of memory available (ONNX_GA_MEMORY_LIMIT sets the budget)"
            )));
        }
        let count = usize::try_from(count).map_err(|_| bad("too large for this machine".into()))?;
        let shape = IxDyn(&header.shape);
        let shape = if header.layout.is_fortran() {
            ndarray::ShapeBuilder::f(shape)
        } else {
            ndarray::ShapeBuilder::into_shape_with_order(shape)
        };
        macro_rules! read {
            ($ty:ty, $variant:ident) => {{
                let values = <$ty as ndarray_npy::ReadableElement>::read_to_end_exact_vec(
                    &mut reader,
                    &header.type_descriptor,
                    count,
                )
                .map_err(|e| bad(e.to_string()))?;
                Tensor::$variant(
                    ArrayD::from_shape_vec(shape, values).map_err(|e| bad(e.to_string()))?,
                )
            }};
        }
        let tensor = match descr.get(1..) {
            Some("f4") => read!(f32, F32),
            Some("f8") => read!(f64, F64),
            Some("i8") => read!(i64, I64),
            Some("i4") => read!(i32, I32),
            _ => read!(bool, Bool),
        };
        verify_crc(&mut entry).map_err(|e| bad(e.to_string()))?;
        out.arrays.insert(name, tensor);
    }
    Ok((out, stored))
}

/// Reads what is left of an archive entry: at its end the zip reader compares the entry's
/// CRC-32 with the one the archive records, as NumPy's `np.load` does, so a damaged file
/// is an error rather than training on altered numbers. An array left in the file is read
/// through once here, in 1 MiB reads (the data file's one sequential pass at the start).
fn verify_crc(entry: &mut impl std::io::Read) -> Result<(), String> {
    // 1 MiB reads pass the archive's 8 KiB buffer by: 1.15 GB of data opens in 0.39 s, against
    // 0.42 s with io::copy's 8 KiB reads and 0.26 s unchecked.
    let mut buf = vec![0u8; 1 << 20];
    loop {
        match entry.read(&mut buf) {
            Ok(0) => return Ok(()),
            Ok(_) => {}
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) => {
                return Err(format!(
                    "its bytes do not check against the archive's CRC-32 ({e}): the file is damaged"
                ))
            }
        }
    }
}

/// The header of an `.npy` stream of `declared` bytes, and the bytes it took; its length
/// is checked before anything is allocated for it.
fn read_npy_header(
    reader: &mut impl std::io::Read,
    declared: u64,
) -> Result<(ndarray_npy::npy::header::Header, u64), String> {
    let mut prefix = vec![0u8; 8];
    reader
        .read_exact(&mut prefix)
        .map_err(|e| format!("no .npy header: {e}"))?;
    if &prefix[..6] != b"\x93NUMPY" {
        return Err("not an .npy array (no NUMPY magic string)".into());
    }
    let header_len = match prefix[6] {
        1 => {
            let mut b = [0u8; 2];
            reader.read_exact(&mut b).map_err(|e| e.to_string())?;
            prefix.extend_from_slice(&b);
            u16::from_le_bytes(b) as usize
        }
        2 | 3 => {
            let mut b = [0u8; 4];
            reader.read_exact(&mut b).map_err(|e| e.to_string())?;
            prefix.extend_from_slice(&b);
            u32::from_le_bytes(b) as usize
        }
        v => return Err(format!(".npy format version {v} is not supported")),
    };
    let total = (prefix.len() + header_len) as u64;
    if header_len > MAX_NPY_HEADER || total > declared {
        return Err(format!(
            "its .npy header claims {header_len} bytes (at most {MAX_NPY_HEADER}, within the entry's {declared})"
        ));
    }
    let mut chained =
        std::io::Read::chain(&prefix[..], std::io::Read::take(reader, header_len as u64));
    let header = ndarray_npy::npy::header::Header::from_reader(&mut chained)
        .map_err(|e| format!("bad .npy header: {e}"))?;
    Ok((header, total))
}

/// Writes arrays to an `.npz` file atomically (never a partial file at `path`).
pub fn write_npz<'a>(
    path: &Path,
    arrays: impl IntoIterator<Item = (&'a str, &'a Tensor)>,
) -> Result<(), DataError> {
    let arrays: Vec<(&str, &Tensor)> = arrays.into_iter().collect();
    let layouts: Vec<TensorLayout> = arrays.iter().map(|(n, t)| TensorLayout::of(n, t)).collect();
    let mut arrays = arrays.into_iter().map(|(_, t)| t);
    // In the order given: each fetch takes the next array.
    write_npz_lazily(path, &layouts, |_| {
        arrays
            .next()
            .map(Cow::Borrowed)
            .ok_or_else(|| "fewer arrays than names".to_string())
    })
}

/// The two kinds of state file, told apart by extension.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum StateFormat {
    Npz,
    Safetensors,
}

impl StateFormat {
    /// The format a state file's extension names (`.npz` or `.safetensors`, any case); any
    /// other extension is an error naming the file.
    pub fn of(path: &Path) -> Result<StateFormat, DataError> {
        let ext = path.extension().and_then(|e| e.to_str()).unwrap_or("");
        if ext.eq_ignore_ascii_case("npz") {
            Ok(StateFormat::Npz)
        } else if ext.eq_ignore_ascii_case("safetensors") {
            Ok(StateFormat::Safetensors)
        } else {
            Err(DataError::Extension {
                path: path.to_path_buf(),
            })
        }
    }
}

/// Reads a state file, `.npz` or `.safetensors` by extension: every tensor, by name.
pub fn read_state(path: &Path) -> Result<BTreeMap<String, Tensor>, DataError> {
    match StateFormat::of(path)? {
        StateFormat::Npz => read_npz(path),
        StateFormat::Safetensors => read_safetensors(path),
    }
}

/// Reads the tensors named in `names` from a state file (`.npz` or `.safetensors`); the
/// others are listed in [`NpzContents::ignored`] and their data is not read: `export` wants
/// a model's parameters, not the accumulators and moments beside them (three times their
/// size under AdamW).
pub fn read_state_only(path: &Path, names: &[String]) -> Result<NpzContents, DataError> {
    match StateFormat::of(path)? {
        StateFormat::Npz => read_npz_arrays(path, Some(names)),
        StateFormat::Safetensors => read_safetensors_arrays(path, Some(names)),
    }
}

/// Writes a state file, `.npz` or `.safetensors` by extension, atomically.
pub fn write_state<'a>(
    path: &Path,
    tensors: impl IntoIterator<Item = (&'a str, &'a Tensor)>,
) -> Result<(), DataError> {
    let tensors: Vec<(&str, &Tensor)> = tensors.into_iter().collect();
    let layouts: Vec<TensorLayout> = tensors
        .iter()
        .map(|(name, t)| TensorLayout::of(name, t))
        .collect();
    let by_name: BTreeMap<&str, &Tensor> = tensors.into_iter().collect();
    write_state_lazily(path, &layouts, |name| Ok(Cow::Borrowed(by_name[name])))
}

/// A tensor of a state about to be written: its name, ONNX element type and shape, known
/// before its values (a safetensors header comes before any data).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TensorLayout {
    pub name: String,
    pub elem_type: i32,
    pub shape: Vec<usize>,
}

impl TensorLayout {
    pub fn of(name: &str, t: &Tensor) -> TensorLayout {
        TensorLayout {
            name: name.to_string(),
            elem_type: t.elem_type(),
            shape: t.shape().to_vec(),
        }
    }
}

/// Writes a state file (`.npz` or `.safetensors` by extension, atomically) whose tensors
/// are fetched one at a time as the file reaches them: `fetch(name)` lends a tensor or
/// makes one for the moment (a value an engine holds, copied to the host), so writing a
/// state of any size holds at most one tensor's copy beside it, not the whole state's.
/// Each fetched tensor must have its layout's type and shape.
pub fn write_state_lazily<'a>(
    path: &Path,
    layouts: &[TensorLayout],
    fetch: impl FnMut(&str) -> Result<Cow<'a, Tensor>, String>,
) -> Result<(), DataError> {
    let mut names = BTreeSet::new();
    if let Some(twice) = layouts.iter().find(|l| !names.insert(l.name.as_str())) {
        return Err(DataError::Write {
            path: path.to_path_buf(),
            message: format!("two tensors are named '{}'", twice.name),
        });
    }
    match StateFormat::of(path)? {
        StateFormat::Npz => write_npz_lazily(path, layouts, fetch),
        StateFormat::Safetensors => write_safetensors(path, layouts, fetch),
    }
}

/// `fetch(layout.name)`, checked against the layout it was declared with.
fn fetch_checked<'a>(
    layout: &TensorLayout,
    fetch: &mut impl FnMut(&str) -> Result<Cow<'a, Tensor>, String>,
) -> std::io::Result<Cow<'a, Tensor>> {
    let t = fetch(&layout.name).map_err(std::io::Error::other)?;
    if t.elem_type() != layout.elem_type || t.shape() != layout.shape.as_slice() {
        return Err(std::io::Error::other(format!(
            "tensor '{}' is {} {:?}, not the {} {:?} the file was begun with",
            layout.name,
            crate::ir::print::elem_type_name(t.elem_type()),
            t.shape(),
            crate::ir::print::elem_type_name(layout.elem_type),
            layout.shape
        )));
    }
    Ok(t)
}

/// Writes `t`'s elements little-endian in row-major order, a block of elements at a time
/// (one `write_all` per element made saving a 2 GB state take seconds longer).
pub fn write_le(out: &mut impl std::io::Write, t: &Tensor) -> std::io::Result<()> {
    const BLOCK: usize = 1 << 14;
    let mut bytes = Vec::new();
    // Each block converted into a buffer sized up front: a loop the compiler turns into
    // plain copies on a little-endian machine.
    macro_rules! blocks {
        ($a:expr, $width:expr, $le:expr) => {{
            let mut put = |values: &[_]| {
                bytes.resize(values.len() * $width, 0u8);
                bytes
                    .chunks_exact_mut($width)
                    .zip(values)
                    .for_each(|(to, v)| to.copy_from_slice(&$le(v)));
                out.write_all(&bytes)
            };
            match $a.as_slice() {
                Some(all) => all.chunks(BLOCK).try_for_each(&mut put)?,
                None => {
                    // Not in row-major order in memory: gathered a block at a time.
                    let mut values = $a.iter().copied();
                    loop {
                        let block: Vec<_> = values.by_ref().take(BLOCK).collect();
                        if block.is_empty() {
                            break;
                        }
                        put(&block)?;
                    }
                }
            }
        }};
    }
    match t {
        Tensor::F32(a) => blocks!(a, 4, |v: &f32| v.to_le_bytes()),
        Tensor::F64(a) => blocks!(a, 8, |v: &f64| v.to_le_bytes()),
        Tensor::I64(a) => blocks!(a, 8, |v: &i64| v.to_le_bytes()),
        Tensor::I32(a) => blocks!(a, 4, |v: &i32| v.to_le_bytes()),
        Tensor::Bool(a) => blocks!(a, 1, |v: &bool| [*v as u8]),
    }
    Ok(())
}

/// The `.npz` writer of [`write_state_lazily`].
fn write_npz_lazily<'a>(
    path: &Path,
    layouts: &[TensorLayout],
    mut fetch: impl FnMut(&str) -> Result<Cow<'a, Tensor>, String>,
) -> Result<(), DataError> {
    crate::atomic::write_with(path, |file| {
        let mut npz = NpzWriter::new(file);
        for layout in layouts {
            let t = fetch_checked(layout, &mut fetch)?;
            let name = layout.name.as_str();
            match t.as_ref() {
                Tensor::F32(a) => npz.add_array(name, a),
                Tensor::F64(a) => npz.add_array(name, a),
                Tensor::I64(a) => npz.add_array(name, a),
                Tensor::I32(a) => npz.add_array(name, a),
                Tensor::Bool(a) => npz.add_array(name, a),
            }
            .map_err(std::io::Error::other)?;
        }
        npz.finish().map_err(std::io::Error::other)?;
        Ok(())
    })
    .map_err(|e| DataError::Write {
        path: path.to_path_buf(),
        message: e.to_string(),
    })
}

/// Reads every tensor of a `.safetensors` file, by name, one tensor at a time: the header
/// first (parsed and checked by the `safetensors` crate: the data offsets must tile the data
/// exactly, and each tensor's byte length must equal its shape times its element size),
/// checked against the file's length, then each tensor read from its offset. So nothing
/// is allocated beyond the file's own size whatever the header claims, and the file's bytes
/// are never held whole beside the tensors made from them (a 124M-parameter model's state
/// is 2 GB).
pub fn read_safetensors(path: &Path) -> Result<BTreeMap<String, Tensor>, DataError> {
    Ok(read_safetensors_arrays(path, None)?.arrays)
}

/// The format's bound on a safetensors header (the `safetensors` crate's, not exported).
const MAX_SAFETENSORS_HEADER: u64 = 100_000_000;

/// [`read_safetensors`] of the tensors in `only` (all when `None`).
fn read_safetensors_arrays(path: &Path, only: Option<&[String]>) -> Result<NpzContents, DataError> {
    use safetensors::tensor::{Dtype, Metadata};
    use std::io::{Read, Seek, SeekFrom};
    let bad = |message: String| DataError::Safetensors {
        path: path.to_path_buf(),
        message,
    };
    let open_err = |source| DataError::Open {
        path: path.to_path_buf(),
        source,
    };
    let mut file = crate::input::open_regular(path).map_err(open_err)?;
    let file_len = file.metadata().map_err(open_err)?.len();
    let mut len = [0u8; 8];
    file.read_exact(&mut len)
        .map_err(|_| bad("too short for a safetensors header".into()))?;
    let header_len = u64::from_le_bytes(len);
    if header_len > MAX_SAFETENSORS_HEADER || 8 + header_len > file_len {
        return Err(bad(format!(
            "its header claims {header_len} bytes (the file has {file_len})"
        )));
    }
    let mut header = vec![0u8; header_len as usize];
    file.read_exact(&mut header).map_err(open_err)?;
    let metadata: Metadata =
        serde_json::from_slice(&header).map_err(|e| bad(format!("bad header: {e}")))?;
    // Checked: a header may describe up to 2^64 bytes of data.
    let described = (metadata.data_len() as u64).checked_add(8 + header_len);
    if described != Some(file_len) {
        return Err(bad(format!(
            "the header describes {} bytes of data, but the file has {} after it",
            metadata.data_len(),
            file_len - 8 - header_len
        )));
    }
    let data_start = 8 + header_len;
    let mut out = NpzContents::default();
    let mut bytes = Vec::new();
    for name in metadata.offset_keys() {
        if only.is_some_and(|names| !names.contains(&name)) {
            out.ignored.push(name);
            continue;
        }
        let info = metadata.info(&name).expect("a name the header lists");
        let (start, end) = info.data_offsets;
        bytes.resize(end - start, 0);
        file.seek(SeekFrom::Start(data_start + start as u64))
            .and_then(|_| file.read_exact(&mut bytes))
            .map_err(open_err)?;
        let shape = IxDyn(&info.shape);
        let array_err = |e: ndarray::ShapeError| bad(format!("tensor '{name}': {e}"));
        macro_rules! le {
            ($ty:ty, $variant:ident) => {{
                let values: Vec<$ty> = bytes
                    .chunks_exact(std::mem::size_of::<$ty>())
                    .map(|c| <$ty>::from_le_bytes(c.try_into().expect("chunk size")))
                    .collect();
                Tensor::$variant(ArrayD::from_shape_vec(shape, values).map_err(array_err)?)
            }};
        }
        let tensor = match info.dtype {
            Dtype::F32 => le!(f32, F32),
            Dtype::F64 => le!(f64, F64),
            Dtype::I64 => le!(i64, I64),
            Dtype::I32 => le!(i32, I32),
            Dtype::BOOL => Tensor::Bool(
                ArrayD::from_shape_vec(shape, bytes.iter().map(|b| *b != 0).collect())
                    .map_err(array_err)?,
            ),
            other => {
                return Err(DataError::SafetensorsDtype {
                    path: path.to_path_buf(),
                    name,
                    dtype: format!("{other:?}"),
                })
            }
        };
        out.arrays.insert(name, tensor);
    }
    Ok(out)
}

/// Writes tensors to a `.safetensors` file atomically (never a partial file at `path`),
/// keyed by name, without `__metadata__`: the header from the layouts (tensors ordered by
/// element alignment, then name, as the `safetensors` crate's serializer orders them), then
/// each tensor's data as [`write_state_lazily`] fetches it.
fn write_safetensors<'a>(
    path: &Path,
    layouts: &[TensorLayout],
    mut fetch: impl FnMut(&str) -> Result<Cow<'a, Tensor>, String>,
) -> Result<(), DataError> {
    use crate::proto::tensor_proto::DataType as D;
    use safetensors::tensor::{Dtype, Metadata, TensorInfo};
    use std::io::Write;
    let err = |e: &dyn std::fmt::Display| DataError::Write {
        path: path.to_path_buf(),
        message: e.to_string(),
    };
    let dtype = |l: &TensorLayout| match D::try_from(l.elem_type) {
        Ok(D::Float) => Ok((Dtype::F32, 4)),
        Ok(D::Double) => Ok((Dtype::F64, 8)),
        Ok(D::Int64) => Ok((Dtype::I64, 8)),
        Ok(D::Int32) => Ok((Dtype::I32, 4)),
        Ok(D::Bool) => Ok((Dtype::BOOL, 1)),
        _ => Err(err(&format!(
            "tensor '{}': element type {} has no safetensors form here",
            l.name,
            crate::ir::print::elem_type_name(l.elem_type)
        ))),
    };
    let mut items: Vec<(&TensorLayout, Dtype, usize)> = Vec::with_capacity(layouts.len());
    for l in layouts {
        let (dtype, width) = dtype(l)?;
        items.push((l, dtype, width));
    }
    items.sort_by(|(a, da, _), (b, db, _)| db.cmp(da).then(a.name.cmp(&b.name)));
    let mut infos = Vec::with_capacity(items.len());
    let mut offset = 0usize;
    for (l, dtype, width) in &items {
        let len = l.shape.iter().product::<usize>() * width;
        infos.push((
            l.name.clone(),
            TensorInfo {
                dtype: *dtype,
                shape: l.shape.clone(),
                data_offsets: (offset, offset + len),
            },
        ));
        offset += len;
    }
    let metadata = Metadata::new(None, infos).map_err(|e| err(&e))?;
    let mut header = serde_json::to_vec(&metadata).map_err(|e| err(&e))?;
    // The format pads the header with spaces to a multiple of 8 bytes.
    header.resize(header.len().next_multiple_of(8), b' ');

    crate::atomic::write_with(path, |out| {
        out.write_all(&(header.len() as u64).to_le_bytes())?;
        out.write_all(&header)?;
        for (l, _, _) in &items {
            write_le(out, fetch_checked(l, &mut fetch)?.as_ref())?;
        }
        Ok(())
    })
    .map_err(|e| err(&e))
}
