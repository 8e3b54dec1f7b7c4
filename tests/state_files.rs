//! State files (`train --save-state`, `--init-state`) in both formats: written a tensor at a
//! time and read a tensor at a time, checked against the `safetensors` crate's own reader
//! (an independent implementation of the format), round trips of every element type and of
//! arrays not in row-major order, and files that lie about their size refused by name.

use std::collections::BTreeMap;
use std::path::Path;

use ndarray::{ArrayD, IxDyn};
use onnx_ga::data::{read_state, write_state, DataError, Tensor};

fn sample_state() -> BTreeMap<String, Tensor> {
    let f32s = ArrayD::from_shape_vec(
        IxDyn(&[3, 5]),
        (0..15).map(|i| i as f32 * 0.25 - 1.0).collect(),
    )
    .unwrap();
    let mut state = BTreeMap::new();
    // A transposed view made owned keeps its column-major memory: written in row-major
    // order all the same.
    state.insert("w.t".to_string(), Tensor::F32(f32s.t().to_owned()));
    state.insert("w".to_string(), Tensor::F32(f32s));
    state.insert(
        "moment".to_string(),
        Tensor::F64(
            ArrayD::from_shape_vec(IxDyn(&[2, 2]), vec![1e-300, -0.5, 3.0, f64::MAX]).unwrap(),
        ),
    );
    state.insert(
        "step".to_string(),
        Tensor::I64(ndarray::arr0(-7i64).into_dyn()),
    );
    state.insert(
        "ids".to_string(),
        Tensor::I32(ArrayD::from_shape_vec(IxDyn(&[4]), vec![1, -2, i32::MAX, 0]).unwrap()),
    );
    state.insert(
        "mask".to_string(),
        Tensor::Bool(ArrayD::from_shape_vec(IxDyn(&[3]), vec![true, false, true]).unwrap()),
    );
    state.insert(
        "empty".to_string(),
        Tensor::F32(ArrayD::zeros(IxDyn(&[0, 4]))),
    );
    state
}

fn write(path: &Path, state: &BTreeMap<String, Tensor>) {
    write_state(path, state.iter().map(|(k, v)| (k.as_str(), v))).unwrap();
}

#[test]
fn both_formats_round_trip_every_element_type_and_layout() {
    let dir = tempfile::tempdir().unwrap();
    let state = sample_state();
    let Tensor::F32(transposed) = &state["w.t"] else {
        panic!()
    };
    assert!(
        transposed.as_slice().is_none(),
        "not column-major in memory: the case is lost"
    );
    for name in ["s.npz", "s.safetensors"] {
        let path = dir.path().join(name);
        write(&path, &state);
        let back = read_state(&path).unwrap();
        assert!(back == state, "{name}: read back differs");
        // The transposed array's values in row-major order, not its memory order.
        let Tensor::F32(t) = &back["w.t"] else {
            panic!()
        };
        assert_eq!(t[[1, 0]], 0.25 - 1.0, "{name}");
    }
    // Upper-case extensions are the same formats; only the temporary files' renames made
    // files, so nothing else is left in the folder.
    for name in ["S.NPZ", "S.SAFETENSORS"] {
        let path = dir.path().join(name);
        write(&path, &state);
        assert!(read_state(&path).unwrap() == state, "{name}");
    }
    assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 4);
}

/// What we write is what the `safetensors` crate reads: names, dtypes, shapes, bytes.
#[test]
fn safetensors_files_read_back_with_the_safetensors_crate() {
    use safetensors::tensor::Dtype;
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("s.safetensors");
    let state = sample_state();
    write(&path, &state);
    let bytes = std::fs::read(&path).unwrap();
    let file = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    assert_eq!(file.len(), state.len());
    for (name, t) in &state {
        let view = file.tensor(name).unwrap();
        assert_eq!(view.shape(), t.shape(), "{name}");
        let (dtype, le): (Dtype, Vec<u8>) = match t {
            Tensor::F32(a) => (Dtype::F32, a.iter().flat_map(|v| v.to_le_bytes()).collect()),
            Tensor::F64(a) => (Dtype::F64, a.iter().flat_map(|v| v.to_le_bytes()).collect()),
            Tensor::I64(a) => (Dtype::I64, a.iter().flat_map(|v| v.to_le_bytes()).collect()),
            Tensor::I32(a) => (Dtype::I32, a.iter().flat_map(|v| v.to_le_bytes()).collect()),
            Tensor::Bool(a) => (Dtype::BOOL, a.iter().map(|v| *v as u8).collect()),
        };
        assert_eq!(view.dtype(), dtype, "{name}");
        assert_eq!(view.data(), le.as_slice(), "{name}");
    }
}

/// A file cut short, one with bytes after its data, one whose header claims more than the
/// file holds: each an error naming the file, before anything is allocated for the claim.
#[test]
fn safetensors_files_that_lie_about_their_size_are_refused() {
    let dir = tempfile::tempdir().unwrap();
    let good = dir.path().join("good.safetensors");
    write(&good, &sample_state());
    let bytes = std::fs::read(&good).unwrap();
    let header_len = u64::from_le_bytes(bytes[..8].try_into().unwrap());
    let mut huge_header = bytes.clone();
    huge_header[..8].copy_from_slice(&(1u64 << 40).to_le_bytes());
    let cases: [(&str, Vec<u8>); 5] = [
        ("short", bytes[..bytes.len() - 4].to_vec()),
        ("long", [bytes.as_slice(), &[0u8; 4]].concat()),
        ("header", huge_header),
        ("tiny", bytes[..5].to_vec()),
        (
            "json",
            [
                &bytes[..8],
                &vec![b'{'; header_len as usize][..],
                &bytes[8 + header_len as usize..],
            ]
            .concat(),
        ),
    ];
    for (name, contents) in cases {
        let path = dir.path().join(format!("{name}.safetensors"));
        std::fs::write(&path, contents).unwrap();
        let err = read_state(&path).unwrap_err();
        assert!(
            matches!(err, DataError::Safetensors { .. }),
            "{name}: {err:?}"
        );
        let text = err.to_string();
        assert!(
            text.contains(&format!("{name}.safetensors")),
            "{name}: {text}"
        );
    }
}

#[test]
fn safetensors_headers_are_not_trusted() {
    let dir = tempfile::tempdir().unwrap();
    let write = |name: &str, header: &str, data: &[u8]| {
        let path = dir.path().join(name);
        let mut bytes = (header.len() as u64).to_le_bytes().to_vec();
        bytes.extend(header.as_bytes());
        bytes.extend(data);
        std::fs::write(&path, bytes).unwrap();
        path
    };
    let huge = format!("{}", 1u64 << 40);
    let cases = [
        // A tensor claiming 4 TiB of data in a file of a few bytes.
        write(
            "huge.safetensors",
            &format!(
                r#"{{"w":{{"dtype":"F32","shape":[{huge}],"data_offsets":[0,{}]}}}}"#,
                4u64 << 40
            ),
            &[0; 8],
        ),
        // A shape whose element count overflows.
        write(
            "overflow.safetensors",
            &format!(
                r#"{{"w":{{"dtype":"F32","shape":[{huge},{huge},{huge}],"data_offsets":[0,8]}}}}"#
            ),
            &[0; 8],
        ),
        // Data of nearly 2^64 bytes: the file's length plus the header's must not
        // overflow on the way to the comparison.
        write(
            "wrap.safetensors",
            &format!(
                r#"{{"w":{{"dtype":"U8","shape":[{n}],"data_offsets":[0,{n}]}}}}"#,
                n = u64::MAX - 16
            ),
            &[0; 8],
        ),
        // Offsets past the end of the file.
        write(
            "short.safetensors",
            r#"{"w":{"dtype":"F32","shape":[4],"data_offsets":[0,16]}}"#,
            &[0; 8],
        ),
        // An element type the host cannot hold.
        write(
            "half.safetensors",
            r#"{"w":{"dtype":"F16","shape":[4],"data_offsets":[0,8]}}"#,
            &[0; 8],
        ),
    ];
    for path in &cases {
        let e = onnx_ga::data::read_state(path).unwrap_err().to_string();
        assert!(e.contains(&path.display().to_string()), "{e}");
    }
    // The header length itself claiming more than the file.
    let path = dir.path().join("length.safetensors");
    let mut bytes = (u64::MAX / 2).to_le_bytes().to_vec();
    bytes.extend(b"{}");
    std::fs::write(&path, bytes).unwrap();
    let e = onnx_ga::data::read_state(&path).unwrap_err().to_string();
    assert!(e.contains("not a readable .safetensors file"), "{e}");
    let half = cases
        .iter()
        .find(|p| p.ends_with("half.safetensors"))
        .unwrap();
    let e = onnx_ga::data::read_state(half).unwrap_err().to_string();
    assert!(e.contains("F16"), "{e}");
}
