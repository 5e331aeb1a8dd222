//! Kernel-argument shorthands and the elementwise launch shape, shared by the plan builder and
//! the weight layout's padding plan.

use crate::context::grid_for;
use crate::step::{Buf, KArg, Kernel, Val};

pub(super) fn val(b: Buf) -> KArg {
    KArg::Val(Val::Ptr(b, 0))
}

pub(super) fn i32v(v: usize) -> KArg {
    KArg::Val(Val::I32(v as i32))
}

pub(super) fn i64v(v: usize) -> KArg {
    KArg::Val(Val::I64(v as i64))
}

/// A grid-stride elementwise launch over `n` items.
pub(super) fn elementwise(module: &'static str, name: String, n: usize, args: Vec<KArg>) -> Kernel {
    Kernel {
        module,
        name,
        grid: (grid_for(n, 256), 1, 1),
        block: 256,
        smem: 0,
        args,
    }
}
