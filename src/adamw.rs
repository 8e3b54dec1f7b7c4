//! AdamW's hyperparameters as ONNX Runtime's `AdamWOptimizer` defines them, the one
//! declaration the others derive from: ORT's attribute names and op-schema defaults
//! ([`AdamW::from_ort_attributes`]) and what the lowering implements
//! ([`AdamW::unsupported`]). The artifacts' optimizer (`signature::OptimizerSpec::Adamw`,
//! from optimizer_model.onnx) and the legalize-ort lowering of an `AdamWOptimizer` node
//! both read the attributes through it; the optimizer pass resolves its hyperparameters
//! (`passes::optimizer::Resolved`, which the recipe shows) and derives from them the
//! `AdamW` it lowers (`Resolved::adamw`). A leaf: it depends on nothing of the crate.

/// AdamW as ONNX Runtime's `AdamWOptimizer` computes it (its attribute defaults).
#[derive(Clone, Debug, PartialEq)]
pub struct AdamW {
    /// `alpha`
    pub beta1: f32,
    /// `beta`
    pub beta2: f32,
    pub epsilon: f32,
    pub weight_decay: f32,
    pub correct_bias: bool,
    /// 0: PyTorch AdamW, 1: Hugging Face AdamW.
    pub adam_mode: i64,
    /// 1 - β1 and 1 - β2 from the decimal β the user wrote, as Keras 2.15 Adam computes
    /// them (in Python's double, then rounded to float), instead of in float from the
    /// rounded β as ONNX Runtime's kernel does: 1 - f32(0.999) is 1.3e-5 off 1 - 0.999.
    /// (torch's AdamW is measured closer to its float32 run without it.)
    pub decimal_complements: bool,
}

impl Default for AdamW {
    fn default() -> Self {
        AdamW {
            beta1: 0.9,
            beta2: 0.999,
            epsilon: 1e-8,
            weight_decay: 0.0,
            correct_bias: true,
            adam_mode: 0,
            decimal_complements: false,
        }
    }
}

impl AdamW {
    /// The AdamW of an `AdamWOptimizer` node, from its attributes as `float` and `int` read
    /// them (`None`: absent, the op schema's default), in ORT's names (`alpha` is β1,
    /// `beta` β2) and in this order: alpha, beta, epsilon, weight_decay, correct_bias,
    /// adam_mode. `correct_bias` turns the attribute's integer into the flag (readers
    /// differ on values other than 0 and 1).
    pub fn from_ort_attributes<E>(
        mut float: impl FnMut(&str) -> Result<Option<f32>, E>,
        mut int: impl FnMut(&str) -> Result<Option<i64>, E>,
        correct_bias: impl FnOnce(i64) -> Result<bool, E>,
    ) -> Result<AdamW, E> {
        let d = AdamW::default();
        Ok(AdamW {
            beta1: float("alpha")?.unwrap_or(d.beta1),
            beta2: float("beta")?.unwrap_or(d.beta2),
            epsilon: float("epsilon")?.unwrap_or(d.epsilon),
            weight_decay: float("weight_decay")?.unwrap_or(d.weight_decay),
            correct_bias: correct_bias(int("correct_bias")?.unwrap_or(d.correct_bias as i64))?,
            adam_mode: int("adam_mode")?.unwrap_or(d.adam_mode),
            decimal_complements: false,
        })
    }

    /// An attribute value the lowering does not implement: `(attribute, detail)`.
    pub fn unsupported(&self) -> Option<(&'static str, String)> {
        match (self.adam_mode, self.correct_bias) {
            (0 | 1, true) | (1, false) => None,
            (0, false) => Some((
                "correct_bias",
                "0 with adam_mode 0 (ONNX Runtime rejects it too)".into(),
            )),
            (mode, _) => Some(("adam_mode", format!("{mode}"))),
        }
    }
}
