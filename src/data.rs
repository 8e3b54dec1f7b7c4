//! Host tensors and `.npz` files (NumPy archives): training data in, state and fixtures in
//! and out. Writes are atomic: a temporary file in the target folder, then a rename.

use std::collections::BTreeMap;
use std::fs::File;
use std::io::BufReader;
use std::path::{Path, PathBuf};

use ndarray::{ArrayD, IxDyn};
use ndarray_npy::{NpzReader, NpzWriter};

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
}

/// Reads every array of an `.npz` file, by name.
pub fn read_npz(path: &Path) -> Result<BTreeMap<String, Tensor>, DataError> {
    let file = File::open(path).map_err(|source| DataError::Open {
        path: path.to_path_buf(),
        source,
    })?;
    let archive = |e: &dyn std::fmt::Display| DataError::Archive {
        path: path.to_path_buf(),
        message: e.to_string(),
    };
    let mut npz = NpzReader::new(BufReader::new(file)).map_err(|e| archive(&e))?;
    let mut out = BTreeMap::new();
    for name in npz.names().map_err(|e| archive(&e))? {
        let tensor = if let Ok(a) = npz.by_name::<ndarray::OwnedRepr<f32>, IxDyn>(&name) {
            Tensor::F32(a)
        } else if let Ok(a) = npz.by_name::<ndarray::OwnedRepr<i64>, IxDyn>(&name) {
            Tensor::I64(a)
        } else if let Ok(a) = npz.by_name::<ndarray::OwnedRepr<bool>, IxDyn>(&name) {
            Tensor::Bool(a)
        } else if let Ok(a) = npz.by_name::<ndarray::OwnedRepr<f64>, IxDyn>(&name) {
            Tensor::F64(a)
        } else if let Ok(a) = npz.by_name::<ndarray::OwnedRepr<i32>, IxDyn>(&name) {
            Tensor::I32(a)
        } else {
            return Err(DataError::ElementType {
                path: path.to_path_buf(),
                name,
            });
        };
        out.insert(name, tensor);
    }
    Ok(out)
}

/// Writes arrays to an `.npz` file atomically (never a partial file at `path`).
pub fn write_npz<'a>(
    path: &Path,
    arrays: impl IntoIterator<Item = (&'a str, &'a Tensor)>,
) -> Result<(), DataError> {
    let err = |e: &dyn std::fmt::Display| DataError::Write {
        path: path.to_path_buf(),
        message: e.to_string(),
    };
    crate::atomic::write_with(path, |file| {
        let mut npz = NpzWriter::new(file);
        for (name, t) in arrays {
            match t {
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
    .map_err(|e| err(&e))
}
