//! `optimizer(kind=..., lr=..., ...)`: the parameter update inside the apply region, on the
//! window's normalised gradient G. The learning rate is an initializer-backed input
//! (`ga.lr`) so a host can schedule it; bias correction counts optimizer steps t (1 at the
//! first applied window), never micro-steps.
//!
//! - `sgd`:       p <- p - lr (G + wd p)
//! - `momentum`:  b <- mu b + (G + wd p);  p <- p - lr b                   (PyTorch SGD)
//! - `nesterov`:  b <- mu b + (G + wd p);  p <- p - lr (G + wd p + mu b)
//! - `adam`:      Adam with L2 (G + wd p), bias-corrected as PyTorch Adam
//! - `adamw`:     ONNX Runtime's AdamWOptimizer exactly, with m <- b1 m + (1-b1) G,
//!   v <- b2 v + (1-b2) G^2, c1 = 1 - b1^t, c2 = 1 - b2^t (computed in double, as ORT does):
//!   - adam_mode 1 (Hugging Face): p <- p - (lr sqrt(c2)/c1) m / (sqrt(v) + eps); then
//!     p <- p - lr wd p
//!   - adam_mode 0 (PyTorch): p <- p - lr wd p; then p <- p - lr m / (c1 (sqrt(v/c2) + eps))
//!
//! The order of floating-point operations follows ORT's kernels, so results agree with the
//! training build to float rounding.

use super::apply::ApplyRegion;
use super::{Pass, PassContext, PassError, PassOptions, PassReport};
use crate::ir::builder::{attr_int, tensor_f32, Builder};
use crate::ir::{BodyId, Model, ValueId};
use crate::proto::tensor_proto::DataType;
use crate::signature::OptimizerSpec;
use crate::state::Role;

pub const PASS: &str = "optimizer";

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kind {
    Sgd,
    Momentum,
    Nesterov,
    Adam,
    AdamW,
}

impl Kind {
    fn as_str(self) -> &'static str {
        match self {
            Kind::Sgd => "sgd",
            Kind::Momentum => "momentum",
            Kind::Nesterov => "nesterov",
            Kind::Adam => "adam",
            Kind::AdamW => "adamw",
        }
    }
}

#[derive(Clone, Debug)]
pub struct Optimizer {
    pub kind: Option<Kind>,
    pub lr: Option<f32>,
    pub weight_decay: Option<f32>,
    pub beta1: Option<f32>,
    pub beta2: Option<f32>,
    pub eps: Option<f32>,
    pub momentum: Option<f32>,
    pub adam_mode: Option<i64>,
    pub correct_bias: Option<bool>,
}

/// Hyperparameters after defaults from the producer's optimizer and the command line.
#[derive(Clone, Debug, PartialEq)]
pub struct Resolved {
    pub kind: Kind,
    pub lr: f32,
    pub weight_decay: f32,
    pub beta1: f32,
    pub beta2: f32,
    pub eps: f32,
    pub momentum: f32,
    pub adam_mode: i64,
    pub correct_bias: bool,
}

fn fail(message: String) -> PassError {
    PassError::Other {
        pass: PASS.into(),
        message,
    }
}

impl Resolved {
    /// The hyperparameters that matter for this kind, for reports.
    pub fn describe(&self) -> String {
        let mut text = format!("{} lr={}", self.kind.as_str(), self.lr);
        if self.weight_decay != 0.0 {
            text.push_str(&format!(" weight_decay={}", self.weight_decay));
        }
        match self.kind {
            Kind::Sgd => {}
            Kind::Momentum | Kind::Nesterov => {
                text.push_str(&format!(" momentum={}", self.momentum))
            }
            Kind::Adam | Kind::AdamW => {
                text.push_str(&format!(
                    " beta1={} beta2={} eps={:e} correct_bias={}",
                    self.beta1, self.beta2, self.eps, self.correct_bias
                ));
                if self.kind == Kind::AdamW {
                    text.push_str(&format!(" adam_mode={}", self.adam_mode));
                }
            }
        }
        text
    }
}

impl Optimizer {
    pub fn from_options(options: &PassOptions) -> Result<Self, PassError> {
        options.only(&[
            "kind",
            "lr",
            "weight_decay",
            "beta1",
            "beta2",
            "eps",
            "momentum",
            "adam_mode",
            "correct_bias",
        ])?;
        let kind = match options.get("kind") {
            None => None,
            Some("sgd") => Some(Kind::Sgd),
            Some("momentum") => Some(Kind::Momentum),
            Some("nesterov") => Some(Kind::Nesterov),
            Some("adam") => Some(Kind::Adam),
            Some("adamw") => Some(Kind::AdamW),
            Some(other) => {
                return Err(PassError::Spec {
                    spec: PASS.into(),
                    message: format!(
                        "kind={other}: expected sgd, momentum, nesterov, adam or adamw"
                    ),
                })
            }
        };
        Ok(Optimizer {
            kind,
            lr: options.parse("lr")?,
            weight_decay: options.parse("weight_decay")?,
            beta1: options.parse("beta1")?,
            beta2: options.parse("beta2")?,
            eps: options.parse("eps")?,
            momentum: options.parse("momentum")?,
            adam_mode: options.parse("adam_mode")?,
            correct_bias: options.parse("correct_bias")?,
        })
    }

    /// Fills unset hyperparameters from the producer's optimizer (ORT's optimizer_model.onnx
    /// and checkpoint), then from the usual defaults.
    pub fn resolve(
        &self,
        producer: Option<&crate::signature::Optimizer>,
    ) -> Result<Resolved, PassError> {
        let (p_kind, p_beta1, p_beta2, p_eps, p_wd, p_bias, p_mode) =
            match producer.map(|o| &o.spec) {
                Some(OptimizerSpec::Adamw {
                    beta1,
                    beta2,
                    epsilon,
                    weight_decay,
                    correct_bias,
                    adam_mode,
                }) => (
                    Some(Kind::AdamW),
                    Some(*beta1),
                    Some(*beta2),
                    Some(*epsilon),
                    Some(*weight_decay),
                    Some(*correct_bias),
                    Some(*adam_mode),
                ),
                Some(OptimizerSpec::Sgd) => (Some(Kind::Sgd), None, None, None, None, None, None),
                None => (None, None, None, None, None, None, None),
            };
        let kind = self.kind.or(p_kind).ok_or_else(|| {
            fail("no optimizer given and the producer configured none: use --optimizer".into())
        })?;
        let lr = self
            .lr
            .or_else(|| producer.and_then(|o| o.learning_rate))
            .ok_or_else(|| {
                fail("no learning rate given and the checkpoint records none: use --lr".into())
            })?;
        let same_family = p_kind == Some(kind);
        let pick = |mine: Option<f32>, theirs: Option<f32>, default: f32| {
            mine.or(if same_family { theirs } else { None })
                .unwrap_or(default)
        };
        let resolved = Resolved {
            kind,
            lr,
            weight_decay: pick(
                self.weight_decay,
                p_wd,
                if kind == Kind::AdamW { 0.01 } else { 0.0 },
            ),
            beta1: pick(self.beta1, p_beta1, 0.9),
            beta2: pick(self.beta2, p_beta2, 0.999),
            eps: pick(
                self.eps,
                p_eps,
                if kind == Kind::AdamW { 1e-6 } else { 1e-8 },
            ),
            momentum: self.momentum.unwrap_or(0.9),
            adam_mode: self
                .adam_mode
                .or(if same_family { p_mode } else { None })
                .unwrap_or(1),
            correct_bias: self
                .correct_bias
                .or(if same_family { p_bias } else { None })
                .unwrap_or(true),
        };
        if !(0..=1).contains(&resolved.adam_mode) {
            return Err(fail(format!(
                "adam_mode={} (ORT knows 0 and 1)",
                resolved.adam_mode
            )));
        }
        Ok(resolved)
    }
}

impl Pass for Optimizer {
    fn name(&self) -> &'static str {
        PASS
    }

    fn spec(&self) -> String {
        let mut options = Vec::new();
        if let Some(k) = self.kind {
            options.push(format!("kind={}", k.as_str()));
        }
        let floats = [
            ("lr", self.lr),
            ("weight_decay", self.weight_decay),
            ("beta1", self.beta1),
            ("beta2", self.beta2),
            ("eps", self.eps),
            ("momentum", self.momentum),
        ];
        for (name, value) in floats {
            if let Some(v) = value {
                options.push(format!("{name}={v}"));
            }
        }
        if let Some(m) = self.adam_mode {
            options.push(format!("adam_mode={m}"));
        }
        if let Some(c) = self.correct_bias {
            options.push(format!("correct_bias={c}"));
        }
        if options.is_empty() {
            PASS.to_string()
        } else {
            format!("{PASS}({})", options.join(","))
        }
    }

    fn run(
        &mut self,
        model: &mut Model,
        cx: &mut PassContext<'_>,
    ) -> Result<PassReport, PassError> {
        let hp = self.resolve(cx.signature.optimizer.as_ref())?;
        let Some(mut region) = cx.apply.take() else {
            return Err(fail(
                "no apply region: run grad-accum before optimizer".into(),
            ));
        };
        if region.optimized {
            cx.apply = Some(region);
            return Err(fail("the apply region already has an optimizer".into()));
        }
        let nodes_before = model.all_nodes().count();
        let lr = model.add_input(
            BodyId::MAIN,
            "ga.lr",
            crate::ir::tensor_type(DataType::Float as i32, &[]),
            Some(tensor_f32(&[], &[hp.lr])),
        );
        let scalars = WindowScalars::emit(model, &region, &hp, lr);
        for i in 0..region.params.len() {
            let p = region.params[i].clone();
            let next = match hp.kind {
                Kind::Sgd => {
                    let mut b = region.builder(model, PASS);
                    let g = with_l2(&mut b, &hp, p.grad, p.value, &p.name);
                    let step = b.op("Mul", &[lr, g], vec![], &format!("{}.sgd_step", p.name));
                    b.op(
                        "Sub",
                        &[p.value, step],
                        vec![],
                        &format!("{}.updated", p.name),
                    )
                }
                Kind::Momentum | Kind::Nesterov => {
                    let buf = moment(model, &region, &p, "momentum", cx);
                    let mut b = region.builder(model, PASS);
                    let g = with_l2(&mut b, &hp, p.grad, p.value, &p.name);
                    let mu = b.scalar_f32("ga.mu", hp.momentum);
                    let decayed = b.op(
                        "Mul",
                        &[buf.0, mu],
                        vec![],
                        &format!("{}.momentum_decayed", p.name),
                    );
                    let buf_next = b.op(
                        "Add",
                        &[decayed, g],
                        vec![],
                        &format!("{}.momentum_new", p.name),
                    );
                    let direction = if hp.kind == Kind::Nesterov {
                        let look = b.op(
                            "Mul",
                            &[buf_next, mu],
                            vec![],
                            &format!("{}.nesterov_look", p.name),
                        );
                        b.op(
                            "Add",
                            &[g, look],
                            vec![],
                            &format!("{}.nesterov_direction", p.name),
                        )
                    } else {
                        buf_next
                    };
                    let step = b.op(
                        "Mul",
                        &[lr, direction],
                        vec![],
                        &format!("{}.sgd_step", p.name),
                    );
                    let next = b.op(
                        "Sub",
                        &[p.value, step],
                        vec![],
                        &format!("{}.updated", p.name),
                    );
                    region.set_next(model, &buf.1, buf_next);
                    next
                }
                Kind::Adam | Kind::AdamW => {
                    let m = moment(model, &region, &p, "m", cx);
                    let v = moment(model, &region, &p, "v", cx);
                    let mut b = region.builder(model, PASS);
                    let g = if hp.kind == Kind::Adam {
                        with_l2(&mut b, &hp, p.grad, p.value, &p.name)
                    } else {
                        p.grad
                    };
                    let (m_next, v_next) = adam_moments(&mut b, &scalars, g, m.0, v.0, &p.name);
                    let decoupled = hp.kind == Kind::AdamW && hp.weight_decay != 0.0;
                    let next = if hp.kind == Kind::AdamW && hp.adam_mode == 1 {
                        // Hugging Face: bias correction folded into the learning rate, decay after.
                        let sqrt_v = b.op("Sqrt", &[v_next], vec![], &format!("{}.sqrt_v", p.name));
                        let denom = b.op(
                            "Add",
                            &[sqrt_v, scalars.eps],
                            vec![],
                            &format!("{}.denom", p.name),
                        );
                        let scaled = b.op(
                            "Mul",
                            &[scalars.lr_corrected, m_next],
                            vec![],
                            &format!("{}.scaled_m", p.name),
                        );
                        let step = b.op(
                            "Div",
                            &[scaled, denom],
                            vec![],
                            &format!("{}.adam_step", p.name),
                        );
                        let stepped = b.op(
                            "Sub",
                            &[p.value, step],
                            vec![],
                            &format!("{}.adam_updated", p.name),
                        );
                        if decoupled {
                            let decay = b.op(
                                "Mul",
                                &[scalars.lr_wd, stepped],
                                vec![],
                                &format!("{}.decay", p.name),
                            );
                            b.op(
                                "Sub",
                                &[stepped, decay],
                                vec![],
                                &format!("{}.updated", p.name),
                            )
                        } else {
                            stepped
                        }
                    } else {
                        // PyTorch (AdamW adam_mode 0, and Adam): decay first, then the
                        // bias-corrected step.
                        let start = if decoupled {
                            let wl = b.op(
                                "Mul",
                                &[p.value, lr],
                                vec![],
                                &format!("{}.decay_lr", p.name),
                            );
                            let decay = b.op(
                                "Mul",
                                &[wl, scalars.wd],
                                vec![],
                                &format!("{}.decay", p.name),
                            );
                            b.op(
                                "Sub",
                                &[p.value, decay],
                                vec![],
                                &format!("{}.decayed", p.name),
                            )
                        } else {
                            p.value
                        };
                        let v_hat = b.op(
                            "Div",
                            &[v_next, scalars.c2],
                            vec![],
                            &format!("{}.v_hat", p.name),
                        );
                        let sqrt_v = b.op("Sqrt", &[v_hat], vec![], &format!("{}.sqrt_v", p.name));
                        let denom = b.op(
                            "Add",
                            &[sqrt_v, scalars.eps],
                            vec![],
                            &format!("{}.denom", p.name),
                        );
                        let scaled = b.op(
                            "Mul",
                            &[lr, m_next],
                            vec![],
                            &format!("{}.scaled_m", p.name),
                        );
                        let corrected = b.op(
                            "Mul",
                            &[scalars.c1, denom],
                            vec![],
                            &format!("{}.corrected_denom", p.name),
                        );
                        let step = b.op(
                            "Div",
                            &[scaled, corrected],
                            vec![],
                            &format!("{}.adam_step", p.name),
                        );
                        b.op(
                            "Sub",
                            &[start, step],
                            vec![],
                            &format!("{}.updated", p.name),
                        )
                    };
                    region.set_next(model, &m.1, m_next);
                    region.set_next(model, &v.1, v_next);
                    next
                }
            };
            region.set_next(model, &p.slot, next);
        }
        region.optimized = true;
        cx.apply = Some(region);
        Ok(PassReport {
            changed: true,
            added: model.all_nodes().count().saturating_sub(nodes_before),
            removed: 0,
            notes: vec![hp.describe()],
        })
    }
}

/// g + wd * p when weight decay is coupled into the gradient (SGD family, Adam).
fn with_l2(b: &mut Builder<'_>, hp: &Resolved, g: ValueId, p: ValueId, name: &str) -> ValueId {
    if hp.weight_decay == 0.0 {
        return g;
    }
    let wd = b.scalar_f32("ga.weight_decay", hp.weight_decay);
    let decay = b.op("Mul", &[p, wd], vec![], &format!("{name}.l2"));
    b.op("Add", &[g, decay], vec![], &format!("{name}.grad_l2"))
}

/// A zero-initialised optimizer moment of `p`, routed through the region.
fn moment(
    model: &mut Model,
    region: &ApplyRegion,
    p: &super::apply::ApplyParam,
    which: &str,
    cx: &mut PassContext<'_>,
) -> (ValueId, super::apply::StateSlot) {
    let zeros = tensor_f32(
        &p.dims,
        &vec![0.0; p.dims.iter().product::<i64>().max(0) as usize],
    );
    let input = ApplyRegion::state_input(model, &format!("ga.{which}.{}", p.name), zeros);
    let slot = region.route(
        model,
        input,
        input,
        Role::Moment,
        Some(&p.name),
        &mut cx.state,
    );
    (input, slot)
}

/// Per-window scalars shared by every parameter's update.
struct WindowScalars {
    b1: ValueId,
    one_minus_b1: ValueId,
    b2: ValueId,
    one_minus_b2: ValueId,
    eps: ValueId,
    wd: ValueId,
    /// lr * wd (adam_mode 1 decay).
    lr_wd: ValueId,
    /// 1 - b1^t (1 without bias correction).
    c1: ValueId,
    /// 1 - b2^t (1 without bias correction).
    c2: ValueId,
    /// lr * sqrt(c2) / c1.
    lr_corrected: ValueId,
}

impl WindowScalars {
    fn emit(model: &mut Model, region: &ApplyRegion, hp: &Resolved, lr: ValueId) -> WindowScalars {
        let mut b = region.builder(model, PASS);
        let b1 = b.scalar_f32("ga.beta1", hp.beta1);
        // 1 - beta in float32, as ORT's kernel computes it (1 - 0.999f is not 0.001f).
        let one_minus_b1 = b.scalar_f32("ga.one_minus_beta1", 1.0f32 - hp.beta1);
        let b2 = b.scalar_f32("ga.beta2", hp.beta2);
        let one_minus_b2 = b.scalar_f32("ga.one_minus_beta2", 1.0f32 - hp.beta2);
        let eps = b.scalar_f32("ga.eps", hp.eps);
        let wd = b.scalar_f32("ga.wd", hp.weight_decay);
        let lr_wd = b.op("Mul", &[lr, wd], vec![], "ga.lr_wd");
        let (c1, c2) = if hp.correct_bias && matches!(hp.kind, Kind::Adam | Kind::AdamW) {
            // c = 1 - beta^t with the power in double, then float (std::pow(float, int64)).
            let t = b.op(
                "Cast",
                &[region.step],
                vec![attr_int("to", DataType::Double as i64)],
                "ga.t_f64",
            );
            let one = b.scalar_f32("ga.one_f32", 1.0);
            let mut correction = |beta: f32, hint: &str| {
                let beta64 = b.model.add_initializer(
                    b.body,
                    &format!("{hint}_base"),
                    crate::ir::builder::tensor_f64(&[], &[beta as f64]),
                );
                let power = b.op("Pow", &[beta64, t], vec![], &format!("{hint}_pow"));
                let power32 = b.op(
                    "Cast",
                    &[power],
                    vec![attr_int("to", DataType::Float as i64)],
                    &format!("{hint}_pow_f32"),
                );
                b.op("Sub", &[one, power32], vec![], hint)
            };
            (correction(hp.beta1, "ga.c1"), correction(hp.beta2, "ga.c2"))
        } else {
            let one = b.scalar_f32("ga.no_correction", 1.0);
            (one, one)
        };
        let sqrt_c2 = b.op("Sqrt", &[c2], vec![], "ga.sqrt_c2");
        let lr_sqrt_c2 = b.op("Mul", &[lr, sqrt_c2], vec![], "ga.lr_sqrt_c2");
        let lr_corrected = b.op("Div", &[lr_sqrt_c2, c1], vec![], "ga.lr_corrected");
        WindowScalars {
            b1,
            one_minus_b1,
            b2,
            one_minus_b2,
            eps,
            wd,
            lr_wd,
            c1,
            c2,
            lr_corrected,
        }
    }
}

/// m' = b1 m + (1-b1) g;  v' = b2 v + ((1-b2) g) g   (ORT's evaluation order)
fn adam_moments(
    b: &mut Builder<'_>,
    s: &WindowScalars,
    g: ValueId,
    m: ValueId,
    v: ValueId,
    name: &str,
) -> (ValueId, ValueId) {
    let m_decayed = b.op("Mul", &[s.b1, m], vec![], &format!("{name}.m_decayed"));
    let m_in = b.op("Mul", &[s.one_minus_b1, g], vec![], &format!("{name}.m_in"));
    let m_next = b.op("Add", &[m_decayed, m_in], vec![], &format!("{name}.m_new"));
    let v_decayed = b.op("Mul", &[s.b2, v], vec![], &format!("{name}.v_decayed"));
    let g_scaled = b.op(
        "Mul",
        &[s.one_minus_b2, g],
        vec![],
        &format!("{name}.v_in_half"),
    );
    let v_in = b.op("Mul", &[g_scaled, g], vec![], &format!("{name}.v_in"));
    let v_next = b.op("Add", &[v_decayed, v_in], vec![], &format!("{name}.v_new"));
    (m_next, v_next)
}
