//! The eval model a step records, so that `train --eval-data V.npz` needs no `--eval-model`:
//! the model `rewrite` differentiated (a forward model), or the `eval_model.onnx` of the
//! ONNX Runtime artifacts it read, by absolute path and the SHA-256 of its file.
//!
//! The digest is what makes the default safe rather than a guess: a file changed or
//! replaced since `rewrite` read it is not used (the error says to pass `--eval-model`).
//! Only the model file is hashed, not external data: the eval model's parameters are fed
//! from the trainer's state, so its graph is what identifies it.

use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

use crate::proto::{ModelProto, StringStringEntryProto};

/// The step's metadata entry: JSON `{"path": ..., "sha256": ...}`.
pub const EVAL_MODEL_KEY: &str = "onnx_ga.eval_model";

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct RecordedEvalModel {
    pub path: PathBuf,
    pub sha256: String,
}

impl RecordedEvalModel {
    /// The record of the model file at `path` (made absolute).
    pub fn of_file(path: &Path) -> std::io::Result<RecordedEvalModel> {
        let path = std::fs::canonicalize(path)?;
        let sha256 = sha256_of(&path)?;
        Ok(RecordedEvalModel { path, sha256 })
    }

    /// What `step` records (`None`: no record, as in steps written before it was kept).
    pub fn read(step: &ModelProto) -> Option<Result<RecordedEvalModel, String>> {
        let entry = step
            .metadata_props
            .iter()
            .find(|p| p.key() == EVAL_MODEL_KEY)?;
        Some(
            serde_json::from_str(entry.value())
                .map_err(|e| format!("its '{EVAL_MODEL_KEY}' entry is not readable: {e}")),
        )
    }

    /// Records `self` in `step`'s metadata (replacing an earlier record). A path JSON
    /// cannot hold (not UTF-8) is not recorded.
    pub fn write(&self, step: &mut ModelProto) {
        step.metadata_props.retain(|p| p.key() != EVAL_MODEL_KEY);
        if let Ok(value) = serde_json::to_string(self) {
            step.metadata_props.push(StringStringEntryProto {
                key: Some(EVAL_MODEL_KEY.into()),
                value: Some(value),
            });
        }
    }

    /// The file is still there with the contents `rewrite` read.
    pub fn check(&self) -> Result<(), String> {
        let now = sha256_of(&self.path).map_err(|e| {
            format!(
                "the eval model the step records, {}, cannot be read: {e}",
                self.path.display()
            )
        })?;
        if now != self.sha256 {
            return Err(format!(
                "the eval model the step records, {}, changed since `rewrite` read it (its SHA-256 differs)",
                self.path.display()
            ));
        }
        Ok(())
    }
}

/// The SHA-256 of a file's bytes, in lowercase hex.
fn sha256_of(path: &Path) -> std::io::Result<String> {
    let mut file = crate::input::open_regular(path)?;
    let mut hasher = Sha256::new();
    std::io::copy(&mut file, &mut hasher)?;
    Ok(hasher
        .finalize()
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect())
}
