//! Server-side optimizers that update plain `&mut [f32]` slices.
//!
//! SGD, Adam and FTRL read the stored float32 weights and state, compute in float64, and round the
//! results to float32 once; Adagrad computes in float32, as torch does (its float64 square root
//! and division were most of a push's update time). The coalesced gradient arrives in float64
//! either way. The formulas are those of `torch.optim` (SGD with dampening 0, Adagrad
//! with lr_decay 0, Adam without amsgrad) and of FTRL-Proximal (McMahan et al. 2013, per coordinate).

use crate::error::{invalid, Result};

/// Which optimizer, with its own hyper-parameters.
///
/// Its serde form is the one schema of the optimizers: the binding, the `CreateTable` request's
/// `config_json`, the replica's and snapshots' table configs all carry it, and the Python classes
/// and the docs are checked against [`schema`] by tests.
#[derive(Debug, Clone, Copy, PartialEq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case", deny_unknown_fields)]
pub enum OptimizerKind {
    /// `w -= lr * d`, with heavy-ball or Nesterov momentum when `momentum > 0`.
    Sgd {
        /// Momentum factor (0: none).
        momentum: f64,
        /// L2 penalty added to the gradient (0: none).
        weight_decay: f64,
        /// Nesterov momentum instead of heavy-ball.
        nesterov: bool,
    },
    /// `sum += g^2; w -= lr * g / (sqrt(sum) + eps)`.
    Adagrad {
        /// The starting value of the sum of squared gradients.
        initial_accumulator_value: f64,
        /// Added to the denominator, for numerical stability.
        eps: f64,
        /// L2 penalty added to the gradient (0: none).
        weight_decay: f64,
    },
    /// Adam with bias correction by a step count (per row in sparse tables).
    Adam {
        /// Decay of the first-moment estimate.
        beta1: f64,
        /// Decay of the second-moment estimate.
        beta2: f64,
        /// Added to the denominator, for numerical stability.
        eps: f64,
        /// L2 penalty added to the gradient (0: none).
        weight_decay: f64,
    },
    /// FTRL-Proximal; the learning rate is `alpha`.
    Ftrl {
        /// Added to the root of the sum of squared gradients in the per-coordinate rate.
        beta: f64,
        /// L1 regularisation strength.
        l1: f64,
        /// L2 regularisation strength.
        l2: f64,
    },
}

/// An optimizer: its kind, its (initial) learning rate and the gradient clipping applied first.
#[derive(Debug, Clone, Copy, PartialEq, serde::Serialize, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub struct OptimizerConfig {
    /// The optimizer and its hyper-parameters.
    pub kind: OptimizerKind,
    /// The learning rate at creation (`alpha` for FTRL); tables may change it at run time.
    pub lr: f64,
    /// Clamp every gradient element to `[-c, c]`.
    pub clip_value: Option<f64>,
    /// Scale a row's gradient (a dense table's whole gradient) down to this L2 norm.
    pub clip_norm: Option<f64>,
}

impl Default for OptimizerConfig {
    fn default() -> Self {
        Self {
            kind: OptimizerKind::Sgd {
                momentum: 0.0,
                weight_decay: 0.0,
                nesterov: false,
            },
            lr: 0.01,
            clip_value: None,
            clip_norm: None,
        }
    }
}

fn check(name: &str, v: f64, ok: bool, want: &str) -> Result<()> {
    if v.is_finite() && ok {
        Ok(())
    } else {
        Err(invalid(format!("optimizer {name} must be {want}, got {v}")))
    }
}

/// Checks a learning rate.
pub fn validate_lr(lr: f64) -> Result<()> {
    check("lr", lr, lr > 0.0, "finite and > 0")
}

impl OptimizerKind {
    /// One value of every kind, in the order of [`OptimizerKind::index`].
    pub const EVERY: [OptimizerKind; 4] = [
        OptimizerKind::Sgd {
            momentum: 0.0,
            weight_decay: 0.0,
            nesterov: false,
        },
        OptimizerKind::Adagrad {
            initial_accumulator_value: 0.1,
            eps: 1e-10,
            weight_decay: 0.0,
        },
        OptimizerKind::Adam {
            beta1: 0.9,
            beta2: 0.999,
            eps: 1e-8,
            weight_decay: 0.0,
        },
        OptimizerKind::Ftrl {
            beta: 1.0,
            l1: 0.0,
            l2: 0.0,
        },
    ];

    /// The kind's position in [`OptimizerKind::EVERY`] (a new kind fails to compile here until
    /// it is listed there too).
    pub fn index(&self) -> usize {
        match self {
            OptimizerKind::Sgd { .. } => 0,
            OptimizerKind::Adagrad { .. } => 1,
            OptimizerKind::Adam { .. } => 2,
            OptimizerKind::Ftrl { .. } => 3,
        }
    }
}

/// The optimizers' schema, derived from their serde form: `{"common": [field, ...], "kinds":
/// {kind: [field, ...]}}` (fields sorted by name).
pub fn schema() -> serde_json::Value {
    let fields = |v: serde_json::Value| -> Vec<String> {
        v.as_object()
            .map_or_else(Vec::new, |m| m.keys().cloned().collect())
    };
    let mut kinds = serde_json::Map::new();
    for kind in OptimizerKind::EVERY {
        let v = serde_json::to_value(kind).expect("an optimizer kind serializes");
        if let Some((name, body)) = v.as_object().and_then(|m| m.iter().next()) {
            kinds.insert(name.clone(), fields(body.clone()).into());
        }
    }
    let mut common = serde_json::to_value(OptimizerConfig::default()).expect("serializes");
    if let Some(m) = common.as_object_mut() {
        m.remove("kind");
    }
    serde_json::json!({"common": fields(common), "kinds": kinds})
}

impl OptimizerConfig {
    /// The config from its serde JSON form, validated.
    pub fn from_json(text: &str) -> Result<Self> {
        let c: Self = serde_json::from_str(text).map_err(|e| invalid(format!("optimizer: {e}")))?;
        c.validate()?;
        Ok(c)
    }

    /// The config's serde JSON form.
    pub fn to_json(&self) -> String {
        serde_json::to_string(self).expect("an optimizer config serializes")
    }

    /// A short name: "sgd", "adagrad", "adam" or "ftrl".
    pub fn name(&self) -> &'static str {
        match self.kind {
            OptimizerKind::Sgd { .. } => "sgd",
            OptimizerKind::Adagrad { .. } => "adagrad",
            OptimizerKind::Adam { .. } => "adam",
            OptimizerKind::Ftrl { .. } => "ftrl",
        }
    }

    /// Checks every hyper-parameter.
    pub fn validate(&self) -> Result<()> {
        validate_lr(self.lr)?;
        if let Some(c) = self.clip_value {
            check("clip_value", c, c > 0.0, "finite and > 0")?;
        }
        if let Some(c) = self.clip_norm {
            check("clip_norm", c, c > 0.0, "finite and > 0")?;
        }
        match self.kind {
            OptimizerKind::Sgd {
                momentum,
                weight_decay,
                nesterov,
            } => {
                check("momentum", momentum, momentum >= 0.0, "finite and >= 0")?;
                check("weight_decay", weight_decay, weight_decay >= 0.0, ">= 0")?;
                if nesterov && momentum <= 0.0 {
                    return Err(invalid("optimizer nesterov needs momentum > 0"));
                }
            }
            OptimizerKind::Adagrad {
                initial_accumulator_value: a,
                eps,
                weight_decay,
            } => {
                // Adagrad computes in float32: its values must be float32 numbers.
                let f32_range = |v: f64| (0.0..=f32::MAX as f64).contains(&v);
                let range = ">= 0 and at most float32's largest value";
                check("initial_accumulator_value", a, f32_range(a), range)?;
                check("eps", eps, f32_range(eps), range)?;
                check("weight_decay", weight_decay, f32_range(weight_decay), range)?;
                if a as f32 == 0.0 && eps as f32 == 0.0 {
                    return Err(invalid(
                        "optimizer Adagrad needs initial_accumulator_value > 0 or eps > 0 \
                         (in float32: a value below about 7e-46 rounds to 0)",
                    ));
                }
            }
            OptimizerKind::Adam {
                beta1,
                beta2,
                eps,
                weight_decay,
            } => {
                check("beta1", beta1, (0.0..1.0).contains(&beta1), "in [0, 1)")?;
                check("beta2", beta2, (0.0..1.0).contains(&beta2), "in [0, 1)")?;
                check("eps", eps, eps > 0.0, "> 0")?;
                check("weight_decay", weight_decay, weight_decay >= 0.0, ">= 0")?;
            }
            OptimizerKind::Ftrl { beta, l1, l2 } => {
                check("beta", beta, beta >= 0.0, ">= 0")?;
                check("l1", l1, l1 >= 0.0, ">= 0")?;
                check("l2", l2, l2 >= 0.0, ">= 0")?;
            }
        }
        Ok(())
    }

    /// How many f32 of optimizer state sit next to a row of `dim` weights.
    pub fn state_len(&self, dim: usize) -> usize {
        match self.kind {
            OptimizerKind::Sgd { momentum, .. } if momentum > 0.0 => dim,
            OptimizerKind::Sgd { .. } => 0,
            OptimizerKind::Adagrad { .. } => dim,
            OptimizerKind::Adam { .. } | OptimizerKind::Ftrl { .. } => 2 * dim,
        }
    }

    /// Writes the state of a fresh row.
    pub fn init_state(&self, state: &mut [f32]) {
        match self.kind {
            OptimizerKind::Adagrad {
                initial_accumulator_value,
                ..
            } => state.fill(initial_accumulator_value as f32),
            _ => state.fill(0.0),
        }
    }

    /// Clips `g` in place: by value first, then by L2 norm.
    #[inline(always)]
    fn clip(&self, g: &mut [f64]) {
        if let Some(c) = self.clip_value {
            for x in g.iter_mut() {
                *x = x.clamp(-c, c);
            }
        }
        if let Some(c) = self.clip_norm {
            let norm = g.iter().map(|x| x * x).sum::<f64>().sqrt();
            if norm > c {
                let s = c / norm;
                for x in g.iter_mut() {
                    *x *= s;
                }
            }
        }
    }

    /// Applies one update to the weights `w` and their state; returns whether every weight it
    /// wrote (all of `w`) is finite.
    ///
    /// `g` is the (coalesced) gradient of `w`, clipped here in place. `lr` is the learning rate now
    /// in force and `step` the step count of this update, starting at 1 (only Adam uses it).
    ///
    /// The finiteness of the weights is gathered in the update's own loop, as each weight is
    /// written (the exponent bits of the written values OR-ed together, no branch), so no second
    /// pass reads the row back.
    ///
    /// On x86-64 CPUs with AVX the same code runs compiled for AVX (chosen at run time): four
    /// float64 lanes instead of two, which nearly halves the cost of the square roots and divisions.
    /// No fused multiply-add is enabled, so both builds give bit-identical results.
    #[inline]
    #[must_use = "the update may have left a weight non-finite"]
    pub fn apply(
        &self,
        lr: f64,
        step: u32,
        w: &mut [f32],
        state: &mut [f32],
        g: &mut [f64],
    ) -> bool {
        #[cfg(target_arch = "x86_64")]
        if std::arch::is_x86_feature_detected!("avx") {
            // SAFETY: the CPU supports AVX, checked just above.
            return unsafe { self.apply_avx(lr, step, w, state, g) };
        }
        self.apply_portable(lr, step, w, state, g)
    }

    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx")]
    fn apply_avx(
        &self,
        lr: f64,
        step: u32,
        w: &mut [f32],
        state: &mut [f32],
        g: &mut [f64],
    ) -> bool {
        self.apply_portable(lr, step, w, state, g)
    }

    #[inline(always)]
    fn apply_portable(
        &self,
        lr: f64,
        step: u32,
        w: &mut [f32],
        state: &mut [f32],
        g: &mut [f64],
    ) -> bool {
        debug_assert_eq!(w.len(), g.len());
        debug_assert_eq!(state.len(), self.state_len(w.len()));
        self.clip(g);
        // One flag per weight written (set for NaN or an infinity), OR-ed as the loop goes: an
        // integer OR is associative, so the compiler keeps it in the loop's vector lanes.
        let mut bad = 0u32;
        match self.kind {
            OptimizerKind::Sgd {
                momentum,
                weight_decay: wd,
                nesterov,
            } => {
                if momentum > 0.0 {
                    for ((w, b), &g) in w.iter_mut().zip(state.iter_mut()).zip(g.iter()) {
                        let wf = *w as f64;
                        let g = g + wd * wf;
                        let buf = momentum * *b as f64 + g;
                        let d = if nesterov { g + momentum * buf } else { buf };
                        *b = buf as f32;
                        *w = (wf - lr * d) as f32;
                        bad |= nonfinite(*w);
                    }
                } else {
                    for (w, &g) in w.iter_mut().zip(g.iter()) {
                        let wf = *w as f64;
                        *w = (wf - lr * (g + wd * wf)) as f32;
                        bad |= nonfinite(*w);
                    }
                }
            }
            OptimizerKind::Adagrad {
                eps,
                weight_decay: wd,
                ..
            } => {
                // In float32, as torch computes it: the float64 square root and division were
                // most of an update's time (docs/decisions/0019-adagrad-in-float32.md).
                // Validation keeps the hyper-parameters inside float32's range; the clamps keep a
                // coalesced gradient beyond it finite (its square then saturates the sum to
                // infinity and the row stops moving, as in torch), never NaN.
                // The gradient is narrowed a block at a time first, so that the update's loop
                // reads float32 only and runs eight lanes wide under AVX, not four.
                let (lr, wd, eps) = ((lr as f32).min(f32::MAX), wd as f32, eps as f32);
                const BLOCK: usize = 64;
                let mut g32 = [0f32; BLOCK];
                for ((w, s), g) in w
                    .chunks_mut(BLOCK)
                    .zip(state.chunks_mut(BLOCK))
                    .zip(g.chunks(BLOCK))
                {
                    let g32 = &mut g32[..g.len()];
                    for (n, &g) in g32.iter_mut().zip(g) {
                        *n = (g as f32).clamp(-f32::MAX, f32::MAX);
                    }
                    for ((w, s), &g) in w.iter_mut().zip(s.iter_mut()).zip(g32.iter()) {
                        let g = (g + wd * *w).clamp(-f32::MAX, f32::MAX);
                        let sum = *s + g * g;
                        *s = sum;
                        *w -= lr * (g / (sum.sqrt() + eps));
                        bad |= nonfinite(*w);
                    }
                }
            }
            OptimizerKind::Adam {
                beta1,
                beta2,
                eps,
                weight_decay: wd,
            } => {
                let t = step.max(1) as i32;
                let step_size = lr / (1.0 - beta1.powi(t));
                let bc2_sqrt = (1.0 - beta2.powi(t)).sqrt();
                let (m, v) = state.split_at_mut(w.len());
                for (((w, m), v), &g) in w.iter_mut().zip(m).zip(v).zip(g.iter()) {
                    let wf = *w as f64;
                    let g = g + wd * wf;
                    let mf = beta1 * *m as f64 + (1.0 - beta1) * g;
                    let vf = beta2 * *v as f64 + (1.0 - beta2) * g * g;
                    *m = mf as f32;
                    *v = vf as f32;
                    *w = (wf - step_size * mf / (vf.sqrt() / bc2_sqrt + eps)) as f32;
                    bad |= nonfinite(*w);
                }
            }
            OptimizerKind::Ftrl { beta, l1, l2 } => {
                let alpha = lr;
                let (z, n) = state.split_at_mut(w.len());
                for (((w, z), n), &g) in w.iter_mut().zip(z).zip(n).zip(g.iter()) {
                    let (wf, nf) = (*w as f64, *n as f64);
                    let n_new = nf + g * g;
                    let sigma = (n_new.sqrt() - nf.sqrt()) / alpha;
                    let zf = *z as f64 + g - sigma * wf;
                    *z = zf as f32;
                    *n = n_new as f32;
                    *w = if zf.abs() <= l1 {
                        0.0
                    } else {
                        (-(zf - zf.signum() * l1) / ((beta + n_new.sqrt()) / alpha + l2)) as f32
                    };
                    bad |= nonfinite(*w);
                }
            }
        }
        bad == 0
    }
}

/// 1 if `x` is NaN or infinite (all its exponent bits set), else 0; no branch.
#[inline(always)]
fn nonfinite(x: f32) -> u32 {
    const EXP: u32 = 0x7f80_0000;
    u32::from(x.to_bits() & EXP == EXP)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_kind_is_listed_once_and_round_trips_through_json() {
        for (i, kind) in OptimizerKind::EVERY.into_iter().enumerate() {
            assert_eq!(kind.index(), i);
            let c = OptimizerConfig {
                kind,
                lr: 0.5,
                clip_value: Some(2.0),
                clip_norm: None,
            };
            assert_eq!(OptimizerConfig::from_json(&c.to_json()).unwrap(), c);
            let name = c.name();
            assert!(
                schema()["kinds"].get(name).is_some(),
                "{name} in the schema"
            );
        }
        assert_eq!(
            schema()["common"],
            serde_json::json!(["clip_norm", "clip_value", "lr"])
        );
        assert_eq!(
            schema()["kinds"]["adam"],
            serde_json::json!(["beta1", "beta2", "eps", "weight_decay"])
        );
        let bad = r#"{"kind": {"sgd": {"momentum": 0, "weight_decay": 0, "nestrov": true}},
                      "lr": 1, "clip_value": null, "clip_norm": null}"#;
        let e = OptimizerConfig::from_json(bad).unwrap_err();
        assert!(e.to_string().contains("unknown field `nestrov`"), "{e}");
        let e = OptimizerConfig::from_json(&bad.replace("nestrov", "nesterov").replace("1,", "0,"));
        assert!(e.unwrap_err().to_string().contains("lr"));
    }

    fn run(cfg: OptimizerConfig, w0: &[f32], grads: &[&[f64]]) -> (Vec<f32>, Vec<f32>) {
        let mut w = w0.to_vec();
        let mut s = vec![0.0; cfg.state_len(w.len())];
        cfg.init_state(&mut s);
        for (i, g) in grads.iter().enumerate() {
            let mut g = g.to_vec();
            let finite = cfg.apply(cfg.lr, i as u32 + 1, &mut w, &mut s, &mut g);
            assert_eq!(finite, w.iter().all(|x| x.is_finite()), "{w:?}");
        }
        (w, s)
    }

    #[test]
    fn sgd_plain() {
        let cfg = OptimizerConfig {
            lr: 0.5,
            ..Default::default()
        };
        let (w, s) = run(cfg, &[1.0, 2.0], &[&[1.0, -2.0]]);
        assert_eq!(w, vec![0.5, 3.0]);
        assert!(s.is_empty());
    }

    #[test]
    fn sgd_momentum_accumulates() {
        let cfg = OptimizerConfig {
            lr: 1.0,
            kind: OptimizerKind::Sgd {
                momentum: 0.5,
                weight_decay: 0.0,
                nesterov: false,
            },
            ..Default::default()
        };
        let (w, s) = run(cfg, &[0.0], &[&[1.0], &[1.0]]);
        // buf: 1, then 1.5; w: -1, then -2.5
        assert_eq!(w, vec![-2.5]);
        assert_eq!(s, vec![1.5]);
    }

    #[test]
    fn adagrad_first_step() {
        let cfg = OptimizerConfig {
            lr: 0.1,
            kind: OptimizerKind::Adagrad {
                initial_accumulator_value: 0.0,
                eps: 0.0,
                weight_decay: 0.0,
            },
            ..Default::default()
        };
        let (w, s) = run(cfg, &[1.0], &[&[2.0]]);
        assert!((w[0] - 0.9).abs() < 1e-7);
        assert_eq!(s, vec![4.0]);
    }

    #[test]
    fn adagrad_computes_in_float32_and_never_makes_nan() {
        let cfg = OptimizerConfig {
            lr: 0.1,
            kind: OptimizerKind::Adagrad {
                initial_accumulator_value: 0.1,
                eps: 1e-10,
                weight_decay: 0.0,
            },
            ..Default::default()
        };
        // The float32 formula, operation by operation.
        let (w, s) = run(cfg, &[0.3], &[&[0.7]]);
        let sum = 0.1f32 + 0.7f32 * 0.7f32;
        assert_eq!(s[0].to_bits(), sum.to_bits());
        let want = 0.3f32 - 0.1f32 * (0.7f32 / (sum.sqrt() + 1e-10f32));
        assert_eq!(w[0].to_bits(), want.to_bits());
        // Coalesced gradients beyond float32's range: the sum saturates, nothing becomes NaN.
        let (w, s) = run(cfg, &[0.3, 0.3], &[&[1e39, -1e40], &[1.0, 1.0]]);
        assert!(w.iter().all(|v| v.is_finite()), "{w:?}");
        assert!(s.iter().all(|v| *v == f32::INFINITY), "{s:?}");
    }

    #[test]
    fn adam_first_step_moves_by_lr() {
        let cfg = OptimizerConfig {
            lr: 0.01,
            kind: OptimizerKind::Adam {
                beta1: 0.9,
                beta2: 0.999,
                eps: 1e-8,
                weight_decay: 0.0,
            },
            ..Default::default()
        };
        let (w, _) = run(cfg, &[0.0, 0.0], &[&[3.0, -0.2]]);
        assert!(
            (w[0] + 0.01).abs() < 1e-7 && (w[1] - 0.01).abs() < 1e-7,
            "{w:?}"
        );
    }

    #[test]
    fn ftrl_l1_gives_exact_zeros() {
        let cfg = OptimizerConfig {
            lr: 0.1,
            kind: OptimizerKind::Ftrl {
                beta: 1.0,
                l1: 10.0,
                l2: 0.0,
            },
            ..Default::default()
        };
        let (w, _) = run(cfg, &[0.0, 0.0], &[&[0.5, 20.0]]);
        assert_eq!(w[0], 0.0);
        assert!(w[1] < 0.0);
    }

    #[test]
    fn clipping_by_value_then_norm() {
        let cfg = OptimizerConfig {
            lr: 1.0,
            clip_value: Some(3.0),
            clip_norm: Some(2.5),
            ..Default::default()
        };
        let (w, _) = run(cfg, &[0.0, 0.0], &[&[4.0, 10.0]]);
        // value clip -> (3, 3), norm 4.243 -> scaled to 2.5
        let n = ((w[0] as f64).powi(2) + (w[1] as f64).powi(2)).sqrt();
        assert!((n - 2.5).abs() < 1e-6 && (w[0] - w[1]).abs() < 1e-7);
    }

    #[test]
    fn dispatched_and_portable_updates_are_bit_identical() {
        let kinds = [
            OptimizerKind::Sgd {
                momentum: 0.9,
                weight_decay: 0.01,
                nesterov: true,
            },
            OptimizerKind::Adagrad {
                initial_accumulator_value: 0.1,
                eps: 1e-10,
                weight_decay: 0.01,
            },
            OptimizerKind::Adam {
                beta1: 0.9,
                beta2: 0.999,
                eps: 1e-8,
                weight_decay: 0.01,
            },
            OptimizerKind::Ftrl {
                beta: 1.0,
                l1: 0.01,
                l2: 0.1,
            },
        ];
        for kind in kinds {
            let cfg = OptimizerConfig {
                lr: 0.05,
                kind,
                clip_value: Some(0.8),
                clip_norm: Some(3.0),
            };
            let n = 67;
            let (mut w1, mut s1) = (vec![0.3f32; n], vec![0.0f32; cfg.state_len(n)]);
            cfg.init_state(&mut s1);
            let (mut w2, mut s2) = (w1.clone(), s1.clone());
            for step in 1..20u32 {
                let g: Vec<f64> = (0..n)
                    .map(|i| ((i as u32 * 7919 + step * 104_729) % 2001) as f64 / 1000.0 - 1.0)
                    .collect();
                let f1 = cfg.apply(cfg.lr, step, &mut w1, &mut s1, &mut g.clone());
                let f2 = cfg.apply_portable(cfg.lr, step, &mut w2, &mut s2, &mut g.clone());
                assert!(f1 && f2, "{kind:?}");
            }
            assert!(
                w1.iter().zip(&w2).all(|(a, b)| a.to_bits() == b.to_bits()),
                "{kind:?}"
            );
            assert!(
                s1.iter().zip(&s2).all(|(a, b)| a.to_bits() == b.to_bits()),
                "{kind:?}"
            );
        }
    }

    /// A few pseudo-random values from `seed`: mostly ordinary, some huge (beyond float32), some
    /// tiny, so that updates overflow to infinities (and Adam, SGD and FTRL to NaN) now and then.
    fn values(seed: u64, n: usize) -> Vec<f64> {
        (0..n as u64)
            .map(|i| {
                let r = crate::hash::mix64(seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) ^ i);
                let unit = (r >> 11) as f64 / (1u64 << 53) as f64 * 2.0 - 1.0;
                match r % 16 {
                    0 => unit * 1e39,
                    1 => unit * 3e38,
                    2 => unit * 1e-40,
                    _ => unit,
                }
            })
            .collect()
    }

    /// Property: the flag `apply` returns (gathered in the update's loop) says exactly whether
    /// every weight the update left is finite, for every kind, hyper-parameters, learning rates
    /// up to 1e38, clipping or none, and rows of 1 to 130 weights (lengths that end inside and
    /// past the vector lanes and Adagrad's blocks), in the dispatched and the portable build
    /// alike; weights that became non-finite are found wherever they sit in the row.
    #[test]
    fn apply_reports_exactly_whether_the_weights_it_wrote_are_finite() {
        let (mut finite, mut not) = (0, 0);
        for case in 0..4000u64 {
            let v = values(case, 8);
            let pos = |x: f64| x.abs().min(f32::MAX as f64 / 2.0);
            let kind = match case % 4 {
                0 => OptimizerKind::Sgd {
                    momentum: if case % 8 == 0 {
                        0.0
                    } else {
                        pos(v[0]).min(0.99)
                    },
                    weight_decay: pos(v[1]).min(1.0),
                    nesterov: case % 8 == 4,
                },
                1 => OptimizerKind::Adagrad {
                    initial_accumulator_value: pos(v[0]).max(1e-3),
                    eps: 1e-10,
                    weight_decay: pos(v[1]).min(1.0),
                },
                2 => OptimizerKind::Adam {
                    beta1: pos(v[0]).min(0.99),
                    beta2: pos(v[1]).min(0.999),
                    eps: 1e-8,
                    weight_decay: pos(v[2]).min(1.0),
                },
                _ => OptimizerKind::Ftrl {
                    beta: pos(v[0]),
                    l1: pos(v[1]).min(1.0),
                    l2: pos(v[2]).min(1.0),
                },
            };
            let lr = [0.1, 1.0, 1e10, 1e38][(case / 4 % 4) as usize];
            let cfg = OptimizerConfig {
                kind,
                lr,
                clip_value: (case % 5 == 0).then_some(10.0),
                clip_norm: (case % 7 == 0).then_some(100.0),
            };
            cfg.validate().unwrap();
            let n = 1 + (crate::hash::mix64(case) % 130) as usize;
            let mut w: Vec<f32> = values(case ^ 0x5555, n).iter().map(|&x| x as f32).collect();
            let mut s = vec![0f32; cfg.state_len(n)];
            cfg.init_state(&mut s);
            let (mut w2, mut s2) = (w.clone(), s.clone());
            for step in 1..4u32 {
                let g = values(case * 7 + u64::from(step), n);
                let got = cfg.apply(lr, step, &mut w, &mut s, &mut g.clone());
                let want = w.iter().all(|x| x.is_finite());
                assert_eq!(got, want, "{cfg:?} step {step}: {w:?}");
                let got2 = cfg.apply_portable(lr, step, &mut w2, &mut s2, &mut g.clone());
                assert_eq!(
                    got2,
                    w2.iter().all(|x| x.is_finite()),
                    "{cfg:?} step {step}"
                );
                if want {
                    finite += 1;
                } else {
                    not += 1;
                }
            }
        }
        // Both answers were exercised many times.
        assert!(finite > 1000 && not > 1000, "{finite} finite, {not} not");
    }

    #[test]
    fn validation() {
        let mut cfg = OptimizerConfig {
            lr: 0.0,
            ..Default::default()
        };
        assert!(cfg.validate().is_err());
        cfg.lr = f64::NAN;
        assert!(cfg.validate().is_err());
        cfg.lr = 0.1;
        // Adagrad's values must survive the narrowing to float32.
        let adagrad = |a: f64, eps: f64, weight_decay: f64| OptimizerKind::Adagrad {
            initial_accumulator_value: a,
            eps,
            weight_decay,
        };
        for bad in [adagrad(0.0, 1e-50, 0.0), adagrad(1e-46, 0.0, 0.0)] {
            cfg.kind = bad;
            assert!(cfg.validate().unwrap_err().to_string().contains("float32"));
        }
        for bad in [
            adagrad(1e39, 0.0, 0.0),
            adagrad(0.1, 1e39, 0.0),
            adagrad(0.1, 0.0, 1e39),
        ] {
            cfg.kind = bad;
            assert!(cfg.validate().is_err(), "{bad:?}");
        }
        cfg.kind = adagrad(0.0, 1e-10, 0.0);
        assert!(cfg.validate().is_ok());
        cfg.kind = OptimizerKind::Adam {
            beta1: 1.0,
            beta2: 0.9,
            eps: 1e-8,
            weight_decay: 0.0,
        };
        assert!(cfg.validate().is_err());
    }
}
