/// How rotary embeddings pair the dimensions of a head: GGUF files store q/k permuted for
/// interleaved pairs `(0, 1), (2, 3), ..`; Hugging Face checkpoints use halves `(i, i + D/2)`.
///
/// ```
/// use fp8nsa_types::RopeStyle;
///
/// assert_eq!(RopeStyle::default(), RopeStyle::Half);
/// ```
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum RopeStyle {
    #[default]
    Half,
    Interleaved,
}
