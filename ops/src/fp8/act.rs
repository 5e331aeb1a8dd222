use fp8nsa_cpu::quant::ActMode;

/// Dynamic activation quantization, per the numerics contract. The K-group width is always the
/// weight's `bk`, so activation and weight scales line up.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum ActQuant {
    /// W8A16: activations are used as they are (computed in f32).
    None,
    /// One scale per token per K-group (DeepSeek, vLLM, cuBLASLt `VEC128`). The default.
    #[default]
    Group,
    /// One scale per `bm x bk` block of activations (the tpu-inference design).
    Block2d { bm: usize },
}

impl ActQuant {
    pub(crate) fn validate(&self) -> crate::Result<()> {
        if let ActQuant::Block2d { bm: 0 } = self {
            return Err(crate::error::invalid(
                "act (Block2d bm)",
                "row block must be at least 1, got 0",
            ));
        }
        Ok(())
    }
}

impl From<ActQuant> for ActMode {
    fn from(a: ActQuant) -> Self {
        match a {
            ActQuant::None => ActMode::None,
            ActQuant::Group => ActMode::Group,
            ActQuant::Block2d { bm } => ActMode::Block2d { bm },
        }
    }
}
