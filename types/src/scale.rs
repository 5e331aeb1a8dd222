/// The dtype a checkpoint stores its weight scales (`weight_scale_inv`) in. DeepSeek-V3 writes
/// f32; Qwen3-FP8 writes bf16. Kernels always read f32: a bf16 scale is widened exactly.
///
/// ```
/// use fp8nsa_types::ScaleDType;
///
/// let s = 1.0f32 + 1.0 / 1024.0; // not a bf16 value
/// let r = ScaleDType::Bf16.round_up(s);
/// assert!(r > s && r == 1.0 + 1.0 / 128.0); // the next bf16 value up
/// assert_eq!(ScaleDType::Bf16.round_up(0.375), 0.375); // exact already
/// assert_eq!(ScaleDType::F32.round_up(s), s);
/// assert_eq!("bf16".parse::<ScaleDType>().unwrap(), ScaleDType::Bf16);
/// ```
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum ScaleDType {
    #[default]
    F32,
    Bf16,
}

impl ScaleDType {
    /// The smallest value of this dtype at or above the positive scale `s` (f32 bits). Rounding
    /// a block's scale *up* before its codes are computed keeps the block's largest element
    /// within ±448 instead of saturating it. Zero, NaN and infinities are returned as they are.
    pub fn round_up(self, s: f32) -> f32 {
        match self {
            ScaleDType::F32 => s,
            ScaleDType::Bf16 => {
                if !s.is_finite() || s <= 0.0 {
                    return s;
                }
                let bits = s.to_bits();
                let low = bits & 0xffff;
                if low == 0 {
                    s
                } else {
                    // a carry into the exponent is the next binade's first value, also bf16;
                    // past bf16's largest finite value it becomes +inf, which the caller's
                    // finiteness checks then refuse
                    f32::from_bits((bits - low) + 0x1_0000)
                }
            }
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            ScaleDType::F32 => "f32",
            ScaleDType::Bf16 => "bf16",
        }
    }
}

impl std::str::FromStr for ScaleDType {
    type Err = String;

    fn from_str(s: &str) -> std::result::Result<Self, String> {
        match s.to_ascii_lowercase().as_str() {
            "f32" | "float32" => Ok(ScaleDType::F32),
            "bf16" | "bfloat16" => Ok(ScaleDType::Bf16),
            _ => Err(format!("scale dtype must be f32 or bf16, got {s:?}")),
        }
    }
}
