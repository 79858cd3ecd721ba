//! Initialisers: the value a row has before its first update, a pure function of (seed, id).

use crate::error::{invalid, Result};
use crate::hash::{inverse_normal_cdf_many, SplitMix64};

/// How new rows (sparse) or a new tensor (dense) are filled.
///
/// Its serde form is the one schema of the initialisers (see [`schema`]), as for the optimizers.
#[derive(Debug, Clone, Copy, PartialEq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case", deny_unknown_fields)]
pub enum Initializer {
    /// All zeros.
    Zeros,
    /// Every element equals the value.
    Constant(f64),
    /// Uniform on [low, high).
    Uniform {
        /// The lowest value.
        low: f64,
        /// The bound above every value.
        high: f64,
    },
    /// Normal with the given mean and standard deviation.
    Normal {
        /// The mean.
        mean: f64,
        /// The standard deviation.
        std: f64,
    },
    /// Normal restricted to [mean - 2 std, mean + 2 std].
    TruncatedNormal {
        /// The mean.
        mean: f64,
        /// The standard deviation (before truncation).
        std: f64,
    },
}

impl Default for Initializer {
    fn default() -> Self {
        Initializer::Normal {
            mean: 0.0,
            std: 0.01,
        }
    }
}

/// How far from `mean`, in standard deviations, a `Normal` draw can land: the quantile of the
/// smallest open-interval draw (2^-53) is about 8.2.
const NORMAL_REACH: f64 = 9.0;

fn finite(name: &str, v: f64) -> Result<()> {
    if !v.is_finite() {
        return Err(invalid(format!(
            "initializer {name} must be finite, got {v}"
        )));
    }
    within_f32(name, v)
}

/// Rows are float32: a value past float32's range would be stored as inf.
fn within_f32(name: &str, v: f64) -> Result<()> {
    if v.abs() > f64::from(f32::MAX) {
        return Err(invalid(format!(
            "initializer {name} = {v:e} is outside float32's range (|x| <= {:e}): rows would \
             hold inf",
            f32::MAX
        )));
    }
    Ok(())
}

/// The initialisers' schema, derived from their serde form: `{kind: [field, ...]}`, fields sorted
/// by name; a kind with one unnamed value (Constant) lists `["value"]`, one with none `[]`.
pub fn schema() -> serde_json::Value {
    let mut kinds = serde_json::Map::new();
    for init in Initializer::EVERY {
        match serde_json::to_value(init).expect("an initializer serializes") {
            serde_json::Value::String(name) => {
                kinds.insert(name, serde_json::json!([]));
            }
            serde_json::Value::Object(m) => {
                if let Some((name, body)) = m.into_iter().next() {
                    let fields: Vec<String> = match body {
                        serde_json::Value::Object(f) => f.keys().cloned().collect(),
                        _ => vec!["value".into()],
                    };
                    kinds.insert(name, fields.into());
                }
            }
            other => unreachable!("an initializer serializes to a name or a map, not {other}"),
        }
    }
    kinds.into()
}

impl Initializer {
    /// One value of every kind, in the order of [`Initializer::index`].
    pub const EVERY: [Initializer; 5] = [
        Initializer::Zeros,
        Initializer::Constant(0.0),
        Initializer::Uniform {
            low: -1.0,
            high: 1.0,
        },
        Initializer::Normal {
            mean: 0.0,
            std: 1.0,
        },
        Initializer::TruncatedNormal {
            mean: 0.0,
            std: 1.0,
        },
    ];

    /// The kind's position in [`Initializer::EVERY`] (a new kind fails to compile here until it
    /// is listed there too).
    pub fn index(&self) -> usize {
        match self {
            Initializer::Zeros => 0,
            Initializer::Constant(_) => 1,
            Initializer::Uniform { .. } => 2,
            Initializer::Normal { .. } => 3,
            Initializer::TruncatedNormal { .. } => 4,
        }
    }

    /// The initialiser from its serde JSON form, validated.
    pub fn from_json(text: &str) -> Result<Self> {
        let i: Self =
            serde_json::from_str(text).map_err(|e| invalid(format!("initializer: {e}")))?;
        i.validate()?;
        Ok(i)
    }

    /// The initialiser's serde JSON form.
    pub fn to_json(&self) -> String {
        serde_json::to_string(self).expect("an initializer serializes")
    }

    /// Checks the parameters.
    pub fn validate(&self) -> Result<()> {
        match *self {
            Initializer::Zeros => Ok(()),
            Initializer::Constant(v) => finite("value", v),
            Initializer::Uniform { low, high } => {
                finite("low", low)?;
                finite("high", high)?;
                if low >= high {
                    return Err(invalid(format!(
                        "Uniform needs low < high, got low={low}, high={high}"
                    )));
                }
                Ok(())
            }
            Initializer::Normal { mean, std } | Initializer::TruncatedNormal { mean, std } => {
                finite("mean", mean)?;
                finite("std", std)?;
                if std < 0.0 {
                    return Err(invalid(format!("std must be >= 0, got {std}")));
                }
                // Every draw must be a float32 too (a truncated normal stays within 2 std).
                within_f32("mean + 9 std", mean.abs() + NORMAL_REACH * std)
            }
        }
    }

    /// Fills `out` with the initial values of the stream `(seed, key)`.
    pub fn fill(&self, seed: u64, key: u64, out: &mut [f32]) {
        let mut rng = SplitMix64::for_row(seed, key);
        match *self {
            Initializer::Zeros => out.fill(0.0),
            Initializer::Constant(v) => out.fill(v as f32),
            Initializer::Uniform { low, high } => {
                let (lo32, hi32) = (low as f32, high as f32);
                for x in out {
                    // Rounding to f32 can reach `high`; keep the interval half-open.
                    let v = (low + (high - low) * rng.next_f64()) as f32;
                    *x = if v >= hi32 {
                        lo32.max(hi32.next_down())
                    } else {
                        v
                    };
                }
            }
            Initializer::Normal { mean, std } => {
                // Element i is `mean + std * inverse_normal_cdf(next_open01())` of the i-th
                // draw, computed a block at a time.
                quantiles(out, &mut rng, 0.0, 1.0, |x, z| *x = (mean + std * z) as f32);
            }
            Initializer::TruncatedNormal { mean, std } => {
                let (lo, hi) = ((mean - 2.0 * std) as f32, (mean + 2.0 * std) as f32);
                quantiles(
                    out,
                    &mut rng,
                    PHI_MINUS_2,
                    1.0 - 2.0 * PHI_MINUS_2,
                    |x, z| *x = ((mean + std * z.clamp(-2.0, 2.0)) as f32).clamp(lo, hi),
                );
            }
        }
    }
}

/// Draws a probability per element of `out` with `draw` (in order), and sets each element with
/// `set` from the draw's standard normal quantile: blocks of [`BLOCK`] draws go through
/// [`inverse_normal_cdf_many`] together.
#[inline]
fn quantiles(out: &mut [f32], rng: &mut SplitMix64, a: f64, b: f64, set: impl Fn(&mut f32, f64)) {
    let mut p = [0f64; BLOCK];
    let mut z = [0f64; BLOCK];
    for block in out.chunks_mut(BLOCK) {
        let n = block.len();
        rng.open01_many(a, b, &mut p[..n]);
        inverse_normal_cdf_many(&p[..n], &mut z[..n]);
        for (x, &z) in block.iter_mut().zip(&z[..n]) {
            set(x, z);
        }
    }
}

/// The standard normal's CDF at -2: TruncatedNormal draws the quantiles of [Phi(-2), Phi(2)], the
/// normal restricted to 2 std, exactly.
const PHI_MINUS_2: f64 = 0.022_750_131_948_179_2;

/// Draws per block of [`quantiles`]: two 512-byte buffers on the stack.
const BLOCK: usize = 64;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_kind_is_listed_once_and_round_trips_through_json() {
        for (i, init) in Initializer::EVERY.iter().enumerate() {
            assert_eq!(init.index(), i);
            assert_eq!(Initializer::from_json(&init.to_json()).unwrap(), *init);
        }
        let s = schema();
        assert_eq!(s["constant"], serde_json::json!(["value"]));
        assert_eq!(s["zeros"], serde_json::json!([]));
        assert_eq!(s["uniform"], serde_json::json!(["high", "low"]));
        let e = Initializer::from_json(r#"{"normal": {"mean": 0, "sd": 1}}"#).unwrap_err();
        assert!(e.to_string().contains("unknown field `sd`"), "{e}");
    }

    #[test]
    fn uniform_stays_in_range() {
        let init = Initializer::Uniform {
            low: -0.5,
            high: 0.25,
        };
        let mut row = vec![0.0; 10_000];
        init.fill(1, 2, &mut row);
        assert!(row.iter().all(|&v| (-0.5..0.25).contains(&v)));
    }

    #[test]
    fn truncated_normal_stays_within_two_std() {
        let init = Initializer::TruncatedNormal {
            mean: 1.0,
            std: 0.5,
        };
        let mut row = vec![0.0; 10_000];
        init.fill(9, 9, &mut row);
        assert!(row.iter().all(|&v| (0.0..=2.0).contains(&v)));
    }

    #[test]
    fn normal_fills_are_the_draws_one_at_a_time() {
        // The blocked fill gives the bits of the element-by-element formula, for lengths below,
        // at and above a block.
        for len in [1, 7, BLOCK, BLOCK + 1, 3 * BLOCK + 5] {
            let (mean, std) = (0.25, 1.5);
            let mut row = vec![0.0; len];
            Initializer::Normal { mean, std }.fill(5, 77, &mut row);
            let mut rng = SplitMix64::for_row(5, 77);
            let want: Vec<f32> = (0..len)
                .map(|_| (mean + std * rng.next_normal()) as f32)
                .collect();
            assert_eq!(row, want, "len {len}");
            Initializer::TruncatedNormal { mean, std }.fill(5, 77, &mut row);
            let mut rng = SplitMix64::for_row(5, 77);
            let (lo, hi) = ((mean - 2.0 * std) as f32, (mean + 2.0 * std) as f32);
            let want: Vec<f32> = (0..len)
                .map(|_| {
                    let p = PHI_MINUS_2 + (1.0 - 2.0 * PHI_MINUS_2) * rng.next_open01();
                    let z = crate::hash::inverse_normal_cdf(p).clamp(-2.0, 2.0);
                    ((mean + std * z) as f32).clamp(lo, hi)
                })
                .collect();
            assert_eq!(row, want, "len {len}");
        }
    }

    #[test]
    fn fill_is_pure() {
        let init = Initializer::default();
        let (mut a, mut b) = (vec![0.0; 16], vec![0.0; 16]);
        init.fill(7, 42, &mut a);
        init.fill(7, 42, &mut b);
        assert_eq!(a, b);
    }

    #[test]
    fn rejects_bad_parameters() {
        assert!(Initializer::Uniform {
            low: 1.0,
            high: 1.0
        }
        .validate()
        .is_err());
        assert!(Initializer::Normal {
            mean: 0.0,
            std: -1.0
        }
        .validate()
        .is_err());
        assert!(Initializer::Constant(f64::NAN).validate().is_err());
    }
}
