//! Rotary-embedding frequencies, with the context-extension schemes of `config.json`'s
//! `rope_scaling`: `linear` (position interpolation), `llama3` (Llama 3.1 / 3.2) and `yarn`
//! (Qwen3, DeepSeek-V3). Each follows the published definition of its scheme; an unknown kind
//! is an error, never silently plain RoPE.

use serde_json::Value;

use crate::error::{invalid, Result};

/// A model's RoPE scaling, parsed from `rope_scaling`.
///
/// ```
/// use fp8nsa_models::RopeScaling;
///
/// let v = serde_json::json!({"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
///     "high_freq_factor": 4.0, "original_max_position_embeddings": 8192});
/// let s = RopeScaling::parse(Some(&v), 131072)?;
/// let (inv, attn) = s.frequencies(500_000.0, 128);
/// assert_eq!(inv[0], 1.0); // the fastest rotation is kept
/// assert!((inv[63] - 500_000f64.powf(-126.0 / 128.0) / 8.0).abs() < 1e-18); // the slowest is / 8
/// assert_eq!(attn, 1.0);
/// assert!(RopeScaling::parse(Some(&serde_json::json!({"rope_type": "ntk"})), 4096).is_err());
/// # Ok::<(), fp8nsa_models::Error>(())
/// ```
#[derive(Clone, Debug, PartialEq)]
pub enum RopeScaling {
    /// Plain RoPE (`rope_scaling` absent, null, or of type `default`).
    None,
    /// Positions divided by `factor`: every frequency divided by it.
    Linear { factor: f64 },
    /// Llama 3.1: wavelengths shorter than `original / high_freq_factor` kept, longer than
    /// `original / low_freq_factor` divided by `factor`, a smooth blend between.
    Llama3 {
        factor: f64,
        low_freq_factor: f64,
        high_freq_factor: f64,
        original_max_position_embeddings: f64,
    },
    /// YaRN (`factor` as written in the config; some transformers releases derived it from
    /// `max_position_embeddings / original_max_position_embeddings` instead): per-dimension blend of the original (extrapolated) and `factor`-interpolated
    /// frequencies over a linear ramp between the dimensions that rotate `beta_fast` and
    /// `beta_slow` times in the original context; cos and sin are multiplied by
    /// `attention_factor`.
    Yarn {
        factor: f64,
        original_max_position_embeddings: f64,
        beta_fast: f64,
        beta_slow: f64,
        attention_factor: f64,
        truncate: bool,
    },
}

fn num(obj: &serde_json::Map<String, Value>, key: &str) -> Result<Option<f64>> {
    match obj.get(key) {
        None | Some(Value::Null) => Ok(None),
        Some(v) => v
            .as_f64()
            .filter(|x| x.is_finite())
            .map(Some)
            .ok_or_else(|| invalid("rope_scaling", format!("`{key}` must be a number, got {v}"))),
    }
}

fn positive(obj: &serde_json::Map<String, Value>, key: &str) -> Result<Option<f64>> {
    match num(obj, key)? {
        Some(x) if x <= 0.0 => Err(invalid(
            "rope_scaling",
            format!("`{key}` must be positive, got {x}"),
        )),
        x => Ok(x),
    }
}

/// A number where 0 (or absence) means "unset", as the reference implementation reads it.
fn optional(obj: &serde_json::Map<String, Value>, key: &str) -> Result<Option<f64>> {
    match num(obj, key)? {
        Some(x) if x < 0.0 => Err(invalid(
            "rope_scaling",
            format!("`{key}` must not be negative, got {x}"),
        )),
        Some(0.0) => Ok(None),
        x => Ok(x),
    }
}

fn required(obj: &serde_json::Map<String, Value>, key: &str, kind: &str) -> Result<f64> {
    positive(obj, key)?
        .ok_or_else(|| invalid("rope_scaling", format!("`{kind}` scaling needs `{key}`")))
}

/// YaRN's attention temperature for a context `scale`, `0.1 * mscale * ln(scale) + 1`.
fn yarn_mscale(scale: f64, mscale: f64) -> f64 {
    if scale <= 1.0 {
        1.0
    } else {
        0.1 * mscale * scale.ln() + 1.0
    }
}

impl RopeScaling {
    /// Parses `rope_scaling` (the kind under `rope_type`, or the older `type`);
    /// `max_position_embeddings` is the fallback for YaRN's original context length.
    pub fn parse(v: Option<&Value>, max_position_embeddings: usize) -> Result<Self> {
        let obj = match v {
            None | Some(Value::Null) => return Ok(Self::None),
            Some(Value::Object(o)) => o,
            Some(other) => {
                return Err(invalid(
                    "rope_scaling",
                    format!("must be an object, got {other}"),
                ))
            }
        };
        let kind = obj
            .get("rope_type")
            .or_else(|| obj.get("type"))
            .and_then(Value::as_str)
            .ok_or_else(|| invalid("rope_scaling", "needs a `rope_type`"))?;
        let s = match kind {
            "default" => Self::None,
            "linear" => Self::Linear {
                factor: required(obj, "factor", kind)?,
            },
            "llama3" => {
                let s = Self::Llama3 {
                    factor: required(obj, "factor", kind)?,
                    low_freq_factor: required(obj, "low_freq_factor", kind)?,
                    high_freq_factor: required(obj, "high_freq_factor", kind)?,
                    original_max_position_embeddings: required(
                        obj,
                        "original_max_position_embeddings",
                        kind,
                    )?,
                };
                if let Self::Llama3 {
                    low_freq_factor: lo,
                    high_freq_factor: hi,
                    ..
                } = s
                {
                    if hi <= lo {
                        return Err(invalid(
                            "rope_scaling",
                            format!(
                                "`high_freq_factor` ({hi}) must exceed `low_freq_factor` ({lo})"
                            ),
                        ));
                    }
                }
                s
            }
            "yarn" => {
                let factor = required(obj, "factor", kind)?;
                let attention_factor = match positive(obj, "attention_factor")? {
                    Some(a) => a,
                    None => match (optional(obj, "mscale")?, optional(obj, "mscale_all_dim")?) {
                        (Some(m), Some(all)) => yarn_mscale(factor, m) / yarn_mscale(factor, all),
                        _ => yarn_mscale(factor, 1.0),
                    },
                };
                Self::Yarn {
                    factor,
                    original_max_position_embeddings: positive(
                        obj,
                        "original_max_position_embeddings",
                    )?
                    .unwrap_or(max_position_embeddings as f64),
                    beta_fast: optional(obj, "beta_fast")?.unwrap_or(32.0),
                    beta_slow: optional(obj, "beta_slow")?.unwrap_or(1.0),
                    attention_factor,
                    truncate: match obj.get("truncate") {
                        None | Some(Value::Null) => true,
                        Some(v) => v.as_bool().ok_or_else(|| {
                            invalid(
                                "rope_scaling",
                                format!("`truncate` must be a bool, got {v}"),
                            )
                        })?,
                    },
                }
            }
            other => {
                return Err(invalid(
                    "rope_scaling",
                    format!(
                        "unknown rope_type `{other}` (supported: default, linear, llama3, yarn)"
                    ),
                ))
            }
        };
        Ok(s)
    }

    /// The `head_dim / 2` inverse frequencies for base `theta`, and the factor cos and sin are
    /// multiplied by (1 except for YaRN).
    pub fn frequencies(&self, theta: f64, head_dim: usize) -> (Vec<f64>, f64) {
        let half = head_dim / 2;
        let base: Vec<f64> = (0..half)
            .map(|i| theta.powf(-(2.0 * i as f64) / head_dim as f64))
            .collect();
        match *self {
            Self::None => (base, 1.0),
            Self::Linear { factor } => (base.iter().map(|f| f / factor).collect(), 1.0),
            Self::Llama3 {
                factor,
                low_freq_factor,
                high_freq_factor,
                original_max_position_embeddings: orig,
            } => {
                let (low_wavelen, high_wavelen) = (orig / low_freq_factor, orig / high_freq_factor);
                let inv = base
                    .iter()
                    .map(|&f| {
                        let wavelen = 2.0 * std::f64::consts::PI / f;
                        if wavelen < high_wavelen {
                            f
                        } else if wavelen > low_wavelen {
                            f / factor
                        } else {
                            let smooth = (orig / wavelen - low_freq_factor)
                                / (high_freq_factor - low_freq_factor);
                            (1.0 - smooth) * f / factor + smooth * f
                        }
                    })
                    .collect();
                (inv, 1.0)
            }
            Self::Yarn {
                factor,
                original_max_position_embeddings: orig,
                beta_fast,
                beta_slow,
                attention_factor,
                truncate,
            } => {
                let d = head_dim as f64;
                // the dimension that completes `rotations` turns over the original context
                let dim_for = |rotations: f64| {
                    d * (orig / (rotations * 2.0 * std::f64::consts::PI)).ln() / (2.0 * theta.ln())
                };
                let (mut lo, mut hi) = (dim_for(beta_fast), dim_for(beta_slow));
                if truncate {
                    (lo, hi) = (lo.floor(), hi.ceil());
                }
                let (lo, mut hi) = (lo.max(0.0), hi.min(d - 1.0));
                if lo == hi {
                    hi += 0.001;
                }
                let inv = base
                    .iter()
                    .enumerate()
                    .map(|(i, &f)| {
                        // 0 keeps the original frequency, 1 takes the interpolated one
                        let ramp = ((i as f64 - lo) / (hi - lo)).clamp(0.0, 1.0);
                        f / factor * ramp + f * (1.0 - ramp)
                    })
                    .collect();
                (inv, attention_factor)
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;
    use std::f64::consts::PI;

    fn parse(v: Value) -> Result<RopeScaling> {
        RopeScaling::parse(Some(&v), 4096)
    }

    #[test]
    fn none_and_default_are_plain_rope() {
        let plain = RopeScaling::None.frequencies(10_000.0, 8).0;
        assert_eq!(plain, vec![1.0, 0.1, 0.01, 0.001]);
        assert_eq!(RopeScaling::parse(None, 1).unwrap(), RopeScaling::None);
        assert_eq!(
            parse(json!({"type": "default"})).unwrap(),
            RopeScaling::None
        );
    }

    #[test]
    fn linear_divides_every_frequency() {
        let s = parse(json!({"type": "linear", "factor": 4.0})).unwrap();
        let (inv, a) = s.frequencies(10_000.0, 8);
        assert_eq!(inv, vec![0.25, 0.025, 0.0025, 0.00025]);
        assert_eq!(a, 1.0);
    }

    /// Llama 3.1's published parameters: wavelengths under 8192 / 4 = 2048 positions are
    /// kept, over 8192 divided by 8, and those between blend linearly in `8192 / wavelength`.
    #[test]
    fn llama3_matches_the_published_rule() {
        let s = parse(
            json!({"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}),
        )
        .unwrap();
        let (theta, d) = (500_000.0f64, 128);
        let (inv, attn) = s.frequencies(theta, d);
        assert_eq!(attn, 1.0);
        let (mut kept, mut divided, mut blended) = (0, 0, 0);
        for (i, &got) in inv.iter().enumerate() {
            let f = theta.powf(-2.0 * i as f64 / d as f64);
            let wavelen = 2.0 * PI / f;
            let want = if wavelen < 2048.0 {
                kept += 1;
                f
            } else if wavelen > 8192.0 {
                divided += 1;
                f / 8.0
            } else {
                blended += 1;
                // smooth = (8192 / wavelen - 1) / 3, linear in it from f / 8 to f
                let smooth = (8192.0 / wavelen - 1.0) / 3.0;
                f / 8.0 + smooth * (f - f / 8.0)
            };
            assert!((got - want).abs() <= 1e-15 * want, "{i}: {got} vs {want}");
        }
        // all three regimes occur at these parameters
        assert!(
            kept > 0 && divided > 0 && blended > 0,
            "{kept} {divided} {blended}"
        );
    }

    /// Qwen3's long-context setting (factor 4 over 32768): YaRN keeps the dimensions that turn
    /// more than 32 times over the original context, interpolates those under one turn, ramps
    /// linearly between, and scales attention by 0.1 ln 4 + 1.
    #[test]
    fn yarn_matches_the_published_rule() {
        let s = parse(json!({"rope_type": "yarn", "factor": 4.0,
            "original_max_position_embeddings": 32768}))
        .unwrap();
        let (theta, d) = (1_000_000.0f64, 128usize);
        let (inv, attn) = s.frequencies(theta, d);
        assert!((attn - (0.1 * 4f64.ln() + 1.0)).abs() < 1e-15);
        let turns = |i: usize| 32768.0 * theta.powf(-2.0 * i as f64 / d as f64) / (2.0 * PI);
        let mut ramped = 0;
        for (i, &got) in inv.iter().enumerate() {
            let f = theta.powf(-2.0 * i as f64 / d as f64);
            if turns(i + 1) > 32.0 {
                assert_eq!(got, f, "{i}: fast dimension kept");
            } else if turns(i.saturating_sub(1)) < 1.0 {
                assert!(
                    (got - f / 4.0).abs() <= 1e-15 * f,
                    "{i}: slow dimension / 4"
                );
            } else {
                // in between: between the two, moving monotonically toward f / 4
                assert!(got <= f && got >= f / 4.0, "{i}");
                ramped += 1;
            }
        }
        assert!(ramped > 0);
        // the ramp's ends: floor / ceil of the dimension turning 32 and 1 times
        let dim_for = |r: f64| d as f64 * (32768.0 / (r * 2.0 * PI)).ln() / (2.0 * theta.ln());
        let (lo, hi) = (dim_for(32.0).floor(), dim_for(1.0).ceil());
        let i = ((lo + hi) / 2.0).floor() as usize;
        let ramp = (i as f64 - lo) / (hi - lo);
        let f = theta.powf(-2.0 * i as f64 / d as f64);
        let want = f * (1.0 - ramp) + f / 4.0 * ramp;
        assert!((inv[i] - want).abs() <= 1e-15 * f);
    }

    #[test]
    fn yarn_attention_factor_sources() {
        // DeepSeek-V3 writes mscale = mscale_all_dim, which cancels to 1
        let s = parse(json!({"type": "yarn", "factor": 40.0, "mscale": 1.0,
            "mscale_all_dim": 1.0, "original_max_position_embeddings": 4096}))
        .unwrap();
        assert_eq!(s.frequencies(10_000.0, 64).1, 1.0);
        let s = parse(json!({"type": "yarn", "factor": 2.0, "attention_factor": 0.5})).unwrap();
        assert_eq!(s.frequencies(10_000.0, 64).1, 0.5);
        // 0 means unset, as in the reference implementation: the default attention factor
        let z = parse(
            json!({"type": "yarn", "factor": 4.0, "mscale": 0, "mscale_all_dim": 0,
            "beta_fast": 0}),
        )
        .unwrap();
        assert!((z.frequencies(10_000.0, 64).1 - (0.1 * 4f64.ln() + 1.0)).abs() < 1e-15);
        assert!(matches!(z, RopeScaling::Yarn { beta_fast, .. } if beta_fast == 32.0));
        // no original context given: max_position_embeddings
        assert!(matches!(
            s,
            RopeScaling::Yarn { original_max_position_embeddings: o, .. } if o == 4096.0
        ));
    }

    #[test]
    fn bad_configs_are_errors() {
        for v in [
            json!({"rope_type": "dynamic", "factor": 2.0}),
            json!({"rope_type": "linear"}),
            json!({"rope_type": "linear", "factor": -1.0}),
            json!({"rope_type": "linear", "factor": "2"}),
            json!({"factor": 2.0}),
            json!({"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 4.0,
                "high_freq_factor": 1.0, "original_max_position_embeddings": 8192}),
            json!({"rope_type": "llama3", "factor": 8.0}),
            json!({"rope_type": "yarn", "factor": 2.0, "truncate": "yes"}),
            json!({"rope_type": "yarn", "factor": 2.0, "beta_fast": -1.0}),
            json!("llama3"),
        ] {
            let e = parse(v.clone()).unwrap_err();
            assert!(
                matches!(
                    e,
                    crate::Error::Invalid {
                        arg: "rope_scaling",
                        ..
                    }
                ),
                "{v}: {e}"
            );
        }
    }
}
