//! The library steps of a plan (cuBLAS, cuBLASLt), called by the executor. They sit below
//! `launch` and above `step` / `context`, so no module calls back up into a builder.

pub(crate) mod cublas;
pub(crate) mod cublaslt;
