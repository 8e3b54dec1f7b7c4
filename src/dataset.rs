//! Training data: the arrays of an `.npz` file that the step takes, read a micro-batch at a
//! time. An array NumPy stored plainly (`np.savez`: uncompressed, C order, little-endian)
//! stays in the file and each micro-batch's rows are read from their offset, so data larger
//! than memory trains, and `train` holds one micro-batch of it. Any other array (compressed
//! by `np.savez_compressed`, Fortran order, big-endian, bool) is decoded into memory whole,
//! within the memory budget ([`crate::input::memory_budget`]).
//!
//! The file stays open for the run: replacing it (a new file renamed over it) does not
//! change what trains, but writing into it while `train` runs does. Every array's bytes are
//! checked against the archive's CRC-32 when the file is opened (one sequential read of an
//! array left in the file), as NumPy does.

use std::collections::BTreeMap;
use std::fs::File;
use std::ops::Range;
use std::path::{Path, PathBuf};

use crate::data::{DataError, StoredArray, Tensor};
use crate::sample_order::SampleOrder;

/// The training data: arrays by name, each in memory or left in its file.
#[derive(Debug)]
pub struct Dataset {
    /// The `.npz` file, open, with its name for messages; `None` when built from arrays.
    file: Option<(PathBuf, File)>,
    arrays: BTreeMap<String, Array>,
}

#[derive(Debug)]
enum Array {
    Held(Tensor),
    InFile(StoredArray),
}

/// What [`Dataset::open`] found besides the arrays it took.
#[derive(Debug)]
pub struct Opened {
    pub dataset: Dataset,
    /// The arrays of the file the step does not take (never decoded).
    pub ignored: Vec<String>,
}

/// The most bytes of one array [`Dataset::chunks`] reads at a time.
const CHUNK_BYTES: usize = 8 << 20;

impl Dataset {
    /// The arrays named in `names` of the `.npz` file `path` (those present).
    pub fn open(path: &Path, names: &[String]) -> Result<Opened, DataError> {
        let file = crate::data::open_input(path)?;
        let (contents, stored) = crate::data::read_npz_entries(&file, path, Some(names), true)?;
        let mut arrays: BTreeMap<String, Array> = contents
            .arrays
            .into_iter()
            .map(|(name, t)| (name, Array::Held(t)))
            .collect();
        arrays.extend(stored.into_iter().map(|(n, a)| (n, Array::InFile(a))));
        Ok(Opened {
            dataset: Dataset {
                file: Some((path.to_path_buf(), file)),
                arrays,
            },
            ignored: contents.ignored,
        })
    }

    /// Data held in memory (tests, and hosts that make their own arrays).
    pub fn from_arrays(arrays: BTreeMap<String, Tensor>) -> Dataset {
        Dataset {
            file: None,
            arrays: arrays
                .into_iter()
                .map(|(n, t)| (n, Array::Held(t)))
                .collect(),
        }
    }

    /// The arrays' names, element types (ONNX `DataType`) and shapes.
    pub fn layouts(&self) -> impl Iterator<Item = (&str, i32, &[usize])> {
        self.arrays.iter().map(|(name, a)| match a {
            Array::Held(t) => (name.as_str(), t.elem_type(), t.shape()),
            Array::InFile(s) => (name.as_str(), s.elem_type, s.shape.as_slice()),
        })
    }

    /// The names of the arrays left in the file (read a micro-batch at a time).
    pub fn left_in_file(&self) -> impl Iterator<Item = &str> {
        self.arrays
            .iter()
            .filter(|(_, a)| matches!(a, Array::InFile(_)))
            .map(|(n, _)| n.as_str())
    }

    /// The arrays held in memory, with their bytes.
    pub fn held(&self) -> impl Iterator<Item = (&str, usize)> {
        self.arrays.iter().filter_map(|(n, a)| match a {
            Array::Held(t) => Some((
                n.as_str(),
                t.shape().iter().product::<usize>() * elem_bytes(t),
            )),
            Array::InFile(_) => None,
        })
    }

    /// The given rows (of the first axis, in that order) of every array: one micro-batch.
    pub fn rows(&self, rows: &[usize]) -> Result<BTreeMap<String, Tensor>, DataError> {
        self.arrays
            .iter()
            .map(|(name, a)| Ok((name.clone(), self.array_rows(name, a, rows)?)))
            .collect()
    }

    /// The rows micro-step `step` takes, `batch` of the data's `samples`, in `order`.
    pub fn micro_batch(
        &self,
        order: SampleOrder,
        samples: usize,
        batch: usize,
        step: u64,
    ) -> Result<BTreeMap<String, Tensor>, DataError> {
        self.rows(&order.rows(samples, batch, step))
    }

    /// Calls `visit` with consecutive runs of rows of array `name` (its first row and the
    /// rows), a few MiB at a time, until it returns `Some`; that value is returned. Whole
    /// arrays can be checked this way without holding them.
    pub fn chunks<T>(
        &self,
        name: &str,
        mut visit: impl FnMut(usize, &Tensor) -> Option<T>,
    ) -> Result<Option<T>, DataError> {
        let Some(array) = self.arrays.get(name) else {
            return Ok(None);
        };
        let stored = match array {
            Array::Held(t) => return Ok(visit(0, t)),
            Array::InFile(s) => s,
        };
        let rows = stored.shape.first().copied().unwrap_or(0);
        let step = (CHUNK_BYTES / stored.row_bytes().max(1)).max(1);
        let mut start = 0;
        while start < rows {
            let range: Range<usize> = start..(start + step).min(rows);
            let chunk = self.array_rows(name, array, &range.clone().collect::<Vec<_>>())?;
            if let Some(found) = visit(start, &chunk) {
                return Ok(Some(found));
            }
            start = range.end;
        }
        Ok(None)
    }

    fn array_rows(&self, name: &str, array: &Array, rows: &[usize]) -> Result<Tensor, DataError> {
        let stored = match array {
            Array::Held(t) => return Ok(t.rows(rows)),
            Array::InFile(s) => s,
        };
        let Some((path, file)) = &self.file else {
            unreachable!("arrays left in a file come from Dataset::open, which keeps the file")
        };
        let samples = stored.shape.first().copied().unwrap_or(0);
        if let Some(row) = rows.iter().find(|r| **r >= samples) {
            return Err(DataError::Archive {
                path: path.clone(),
                message: format!("array '{name}' has {samples} rows; row {row} was asked for"),
            });
        }
        let row_bytes = stored.row_bytes();
        let mut bytes = vec![0u8; rows.len() * row_bytes];
        // Consecutive rows are one read: a micro-batch is one run, or two where it wraps.
        let mut done = 0;
        while done < rows.len() {
            let first = rows[done];
            let run = rows[done..]
                .iter()
                .enumerate()
                .take_while(|(i, r)| **r == first + i)
                .count();
            let at = stored.offset + (first * row_bytes) as u64;
            let into = &mut bytes[done * row_bytes..(done + run) * row_bytes];
            read_exact_at(file, into, at).map_err(|e| DataError::Archive {
                path: path.clone(),
                message: format!(
                    "array '{name}': cannot read rows {first}..{} (changed since it was opened?): {e}",
                    first + run
                ),
            })?;
            done += run;
        }
        let mut shape = stored.shape.clone();
        shape[0] = rows.len();
        Ok(decode_le(stored.elem_type, &shape, &bytes))
    }
}

/// The bytes of one element of `t`.
fn elem_bytes(t: &Tensor) -> usize {
    match t {
        Tensor::F32(_) | Tensor::I32(_) => 4,
        Tensor::F64(_) | Tensor::I64(_) => 8,
        Tensor::Bool(_) => 1,
    }
}

#[cfg(unix)]
fn read_exact_at(file: &File, buf: &mut [u8], offset: u64) -> std::io::Result<()> {
    std::os::unix::fs::FileExt::read_exact_at(file, buf, offset)
}

#[cfg(not(unix))]
fn read_exact_at(file: &File, buf: &mut [u8], offset: u64) -> std::io::Result<()> {
    use std::io::{Read, Seek};
    let mut file = file;
    file.seek(std::io::SeekFrom::Start(offset))?;
    file.read_exact(buf)
}

/// A tensor of `shape` from little-endian bytes of `elem_type` (one [`StoredArray`] kind).
fn decode_le(elem_type: i32, shape: &[usize], bytes: &[u8]) -> Tensor {
    use crate::proto::tensor_proto::DataType as D;
    macro_rules! decode {
        ($ty:ty, $variant:ident) => {{
            let values: Vec<$ty> = bytes
                .chunks_exact(std::mem::size_of::<$ty>())
                .map(|c| <$ty>::from_le_bytes(c.try_into().expect("chunk of the element's size")))
                .collect();
            Tensor::$variant(
                ndarray::ArrayD::from_shape_vec(ndarray::IxDyn(shape), values)
                    .expect("the bytes of whole rows of this shape"),
            )
        }};
    }
    match D::try_from(elem_type) {
        Ok(D::Float) => decode!(f32, F32),
        Ok(D::Double) => decode!(f64, F64),
        Ok(D::Int64) => decode!(i64, I64),
        _ => decode!(i32, I32),
    }
}

/// Element types and shapes by name: what [`crate::train::Trainer::check_data`] checks, of
/// a [`Dataset`] or of arrays in memory.
pub trait DataLayouts {
    fn layout(&self, name: &str) -> Option<(i32, &[usize])>;
}

impl DataLayouts for Dataset {
    fn layout(&self, name: &str) -> Option<(i32, &[usize])> {
        self.arrays.get(name).map(|a| match a {
            Array::Held(t) => (t.elem_type(), t.shape()),
            Array::InFile(s) => (s.elem_type, s.shape.as_slice()),
        })
    }
}

impl DataLayouts for BTreeMap<String, Tensor> {
    fn layout(&self, name: &str) -> Option<(i32, &[usize])> {
        self.get(name).map(|t| (t.elem_type(), t.shape()))
    }
}
