use crate::error::{Error, Result};

/// Dynamic activation quantization (docs/numerics.md, "Activations"). The K-group width is
/// always the weight's `bk`, so activation and weight scales line up.
///
/// ```
/// use fp8nsa_types::ActQuant;
/// assert_eq!(ActQuant::default(), ActQuant::Group);
/// assert!(ActQuant::Block2d { bm: 0 }.validate().is_err());
/// ```
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum ActQuant {
    /// W8A16: activations are used as they are (computed in f32).
    None,
    /// One scale per token per K-group (DeepSeek, vLLM, cuBLASLt `VEC128`). The default.
    #[default]
    Group,
    /// One scale per `bm x bk` block of activations (the tpu-inference design).
    ///
    /// The `bm` tokens of a block share its scale: a large finite outlier in one token (1e6
    /// among values near 1) leaves the others of its block with tens of percent of relative
    /// error. NaN and ±Inf do not spread (the scale comes from finite values only; docs/
    /// numerics.md, "Non-finite values"). Prefer [`ActQuant::Group`] where one batch mixes
    /// requests from different users.
    Block2d { bm: usize },
}

impl ActQuant {
    /// `Block2d { bm: 0 }` is the one value outside the domain.
    pub fn validate(&self) -> Result<()> {
        if let ActQuant::Block2d { bm: 0 } = self {
            return Err(Error::Invalid {
                arg: "act (Block2d bm)",
                msg: "row block must be at least 1, got 0".into(),
            });
        }
        Ok(())
    }
}
