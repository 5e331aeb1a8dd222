//! StableHLO programs, emitted as MLIR text. fp8 travels as `ui8` and is bitcast to
//! `f8E4M3FN` inside the program. Every product term is multiplied by its own K-block's
//! activation and weight scales before anything is summed (the contract's per-K-block scaling,
//! distributed over the block sum), which lets XLA run one plain dot.

use std::fmt::Write;

pub use fp8nsa_types::{ActQuant, LinearShape};

fn ty(dims: &[usize], elem: &str) -> String {
    let mut s = String::from("tensor<");
    for d in dims {
        let _ = write!(s, "{d}x");
    }
    s + elem + ">"
}

fn f32t(dims: &[usize]) -> String {
    ty(dims, "f32")
}

/// An f32 as an MLIR literal: decimal with a point (MLIR needs one) or, for infinities and
/// NaN, the bit pattern in hex.
fn lit(v: f32) -> String {
    if v.is_finite() {
        format!("{v:.9e}")
    } else {
        format!("0x{:08X}", v.to_bits())
    }
}

fn list(v: &[usize]) -> String {
    v.iter()
        .map(|x| x.to_string())
        .collect::<Vec<_>>()
        .join(", ")
}

/// A tiny SSA builder: each op gets a fresh `%vN` name.
struct Body {
    text: String,
    next: usize,
}

impl Body {
    fn new() -> Self {
        Self {
            text: String::new(),
            next: 0,
        }
    }

    fn op(&mut self, rhs: String) -> String {
        let name = format!("%v{}", self.next);
        self.next += 1;
        let _ = writeln!(self.text, "    {name} = {rhs}");
        name
    }

    fn splat(&mut self, v: f32, dims: &[usize]) -> String {
        self.op(format!(
            "stablehlo.constant dense<{}> : {}",
            lit(v),
            f32t(dims)
        ))
    }

    fn unary(&mut self, op: &str, x: &str, dims: &[usize]) -> String {
        self.op(format!("stablehlo.{op} {x} : {}", f32t(dims)))
    }

    fn binary(&mut self, op: &str, a: &str, b: &str, dims: &[usize]) -> String {
        self.op(format!("stablehlo.{op} {a}, {b} : {}", f32t(dims)))
    }

    fn reshape(&mut self, x: &str, from: &[usize], to: &[usize]) -> String {
        self.op(format!(
            "stablehlo.reshape {x} : ({}) -> {}",
            f32t(from),
            f32t(to)
        ))
    }

    fn transpose(&mut self, x: &str, from: &[usize], perm: &[usize]) -> String {
        let to: Vec<usize> = perm.iter().map(|&p| from[p]).collect();
        self.op(format!(
            "stablehlo.transpose {x}, dims = [{}] : ({}) -> {}",
            list(perm),
            f32t(from),
            f32t(&to)
        ))
    }

    fn broadcast(&mut self, x: &str, from: &[usize], map: &[usize], to: &[usize]) -> String {
        self.op(format!(
            "stablehlo.broadcast_in_dim {x}, dims = [{}] : ({}) -> {}",
            list(map),
            f32t(from),
            f32t(to)
        ))
    }

    /// Zero padding at the high end of each dim.
    fn pad(&mut self, x: &str, from: &[usize], to: &[usize]) -> String {
        if from == to {
            return x.to_string();
        }
        let zero = self.op(format!(
            "stablehlo.constant dense<{}> : tensor<f32>",
            lit(0.0)
        ));
        let high: Vec<usize> = from.iter().zip(to).map(|(a, b)| b - a).collect();
        let zeros = vec![0; from.len()];
        self.op(format!(
            "stablehlo.pad {x}, {zero}, low = [{}], high = [{}], interior = [{}] : ({}, tensor<f32>) -> {}",
            list(&zeros),
            list(&high),
            list(&zeros),
            f32t(from),
            f32t(to)
        ))
    }

    /// The leading `to` corner of `x`.
    fn slice(&mut self, x: &str, from: &[usize], to: &[usize]) -> String {
        if from == to {
            return x.to_string();
        }
        let ones = vec![1; from.len()];
        let zeros = vec![0; from.len()];
        self.op(format!(
            "\"stablehlo.slice\"({x}) {{start_indices = array<i64: {}>, limit_indices = array<i64: {}>, strides = array<i64: {}>}} : ({}) -> {}",
            list(&zeros),
            list(to),
            list(&ones),
            f32t(from),
            f32t(to)
        ))
    }

    /// Reduction of `dims` with `op` ("maximum" / "add") from `init`.
    fn reduce(&mut self, x: &str, from: &[usize], dims: &[usize], op: &str, init: f32) -> String {
        let to: Vec<usize> = (0..from.len())
            .filter(|i| !dims.contains(i))
            .map(|i| from[i])
            .collect();
        let init = self.op(format!(
            "stablehlo.constant dense<{}> : tensor<f32>",
            lit(init)
        ));
        self.op(format!(
            "\"stablehlo.reduce\"({x}, {init}) ({{\n    ^bb0(%a: tensor<f32>, %b: tensor<f32>):\n      %r = stablehlo.{op} %a, %b : tensor<f32>\n      stablehlo.return %r : tensor<f32>\n    }}) {{dimensions = array<i64: {}>}} : ({}, tensor<f32>) -> {}",
            list(dims),
            f32t(from),
            f32t(&to)
        ))
    }
}

/// The fp8 block linear (TPU kernel v1: plain XLA, which schedules the pipelining itself).
///
/// Arguments: `x f32[m, k]`, `wq ui8[n, k]` (e4m3fn bytes), `sw f32[ceil(n/bn), ceil(k/bk)]`,
/// `bias f32[n]` when `bias`, and `fp8_max f32[]` (= 448) when activations are quantized.
/// Result `f32[m, n]`.
pub fn fp8_linear(s: LinearShape, act: ActQuant, bias: bool) -> String {
    fp8_linear_module(s, act, bias, None)
}

/// `mhlo.sharding` of each argument of [`fp8_linear`] and of its result.
struct LinearShardings {
    parts: usize,
    x: String,
    wq: String,
    sw: String,
    bias: String,
    fp8_max: String,
    y: String,
}

/// The program of [`fp8_linear`], and of [`sharded_fp8_linear`] with `sharding`: the body is
/// the same text either way, since the SPMD partitioner works on the global shapes.
fn fp8_linear_module(
    s: LinearShape,
    act: ActQuant,
    bias: bool,
    sharding: Option<&LinearShardings>,
) -> String {
    let (m, n, k, bn, bk) = (s.m(), s.n(), s.k(), s.bn(), s.bk());
    let (kb, nb) = (k.div_ceil(bk), n.div_ceil(bn));
    let kp = kb * bk;
    let rows = match act {
        ActQuant::Block2d { bm } => m.div_ceil(bm) * bm,
        _ => m,
    };
    let mut b = Body::new();
    // activations: pad to whole blocks (zeros change neither amax nor sums), quantize
    let xp = b.pad("%x", &[m, k], &[rows, kp]);
    let (xq, sx_rows) = match act {
        ActQuant::None => (b.reshape(&xp, &[rows, kp], &[rows, kb, bk]), None),
        ActQuant::Group => {
            let xr = b.reshape(&xp, &[rows, kp], &[rows, kb, bk]);
            let (q, sc) = quantize(&mut b, &xr, &[rows, kb, bk], &[2], &[0, 1], &[rows, kb]);
            (q, Some(sc))
        }
        ActQuant::Block2d { bm } => {
            let mb = rows / bm;
            let full = [mb, bm, kb, bk];
            let xr = b.reshape(&xp, &[rows, kp], &full);
            let (q, sc) = quantize(&mut b, &xr, &full, &[1, 3], &[0, 2], &[mb, kb]);
            let q = b.reshape(&q, &full, &[rows, kb, bk]);
            let sb = b.broadcast(&sc, &[mb, kb], &[0, 2], &[mb, bm, kb]);
            (q, Some(b.reshape(&sb, &[mb, bm, kb], &[rows, kb])))
        }
    };
    // weights: bytes -> e4m3fn -> f32, padded to whole K-blocks, times their block scale
    let w8 = b.op(format!(
        "stablehlo.bitcast_convert %wq : ({}) -> {}",
        ty(&[n, k], "ui8"),
        ty(&[n, k], "f8E4M3FN")
    ));
    let wf = b.op(format!(
        "stablehlo.convert {w8} : ({}) -> {}",
        ty(&[n, k], "f8E4M3FN"),
        f32t(&[n, k])
    ));
    let wp = b.pad(&wf, &[n, k], &[n, kp]);
    let wr = b.reshape(&wp, &[n, kp], &[n, kb, bk]);
    let swb = b.broadcast("%sw", &[nb, kb], &[0, 2], &[nb, bn, kb]);
    let swr = b.reshape(&swb, &[nb, bn, kb], &[nb * bn, kb]);
    let swn = b.slice(&swr, &[nb * bn, kb], &[n, kb]);
    let sw3 = b.broadcast(&swn, &[n, kb], &[0, 1], &[n, kb, bk]);
    let wd = b.binary("multiply", &wr, &sw3, &[n, kb, bk]);
    let wd = b.reshape(&wd, &[n, kb, bk], &[n, kp]);
    // activations times their scales likewise: every product term carries its K-block's
    // sx · sw before anything is summed, so one plain dot gives the contract's result
    let xd = match sx_rows {
        Some(sx) => {
            let sx3 = b.broadcast(&sx, &[rows, kb], &[0, 1], &[rows, kb, bk]);
            b.binary("multiply", &xq, &sx3, &[rows, kb, bk])
        }
        None => xq,
    };
    let xd = b.reshape(&xd, &[rows, kb, bk], &[rows, kp]);
    // every dot here says HIGHEST: at DEFAULT the XLA CUDA plugin multiplies f32 in TF32
    // (relative errors of 3e-4 on the first H100 run, 2026-11-26) and TPUs in one bf16 pass,
    // where the contract is f32 products and sums
    let y = b.op(format!(
        "stablehlo.dot_general {xd}, {wd}, contracting_dims = [1] x [1], precision = [HIGHEST, HIGHEST] : ({}, {}) -> {}",
        f32t(&[rows, kp]),
        f32t(&[n, kp]),
        f32t(&[rows, n])
    ));
    let mut y = b.slice(&y, &[rows, n], &[m, n]);
    if bias {
        let bb = b.broadcast("%bias", &[n], &[1], &[m, n]);
        y = b.binary("add", &y, &bb, &[m, n]);
    }
    let ann = |pick: fn(&LinearShardings) -> &String| {
        sharding.map_or(String::new(), |sh| {
            format!(" {{mhlo.sharding = \"{}\"}}", pick(sh))
        })
    };
    let mut extra = String::new();
    if bias {
        let _ = write!(extra, ", %bias: {}{}", f32t(&[n]), ann(|s| &s.bias));
    }
    if act != ActQuant::None {
        let _ = write!(extra, ", %fp8_max: tensor<f32>{}", ann(|s| &s.fp8_max));
    }
    let (name, attrs) = match sharding {
        None => ("fp8_linear", String::new()),
        Some(sh) => (
            "sharded_fp8_linear",
            format!(
                " attributes {{mhlo.num_partitions = {} : i32, mhlo.num_replicas = 1 : i32}}",
                sh.parts
            ),
        ),
    };
    // a result with an attribute needs the parenthesized form
    let result = match sharding {
        None => f32t(&[m, n]),
        Some(_) => format!("({}{})", f32t(&[m, n]), ann(|s| &s.y)),
    };
    format!(
        "module @{name}{attrs} {{\n  func.func public @main(%x: {}{}, %wq: {}{}, %sw: {}{}{extra}) -> {result} {{\n{}    return {y} : {}\n  }}\n}}\n",
        f32t(&[m, k]),
        ann(|s| &s.x),
        ty(&[n, k], "ui8"),
        ann(|s| &s.wq),
        f32t(&[nb, kb]),
        ann(|s| &s.sw),
        b.text,
        f32t(&[m, n]),
    )
}

/// [`fp8_linear`] with `mhlo.sharding` on its arguments and result, for XLA's SPMD
/// partitioner over `parts` partitions (compile with [`crate::proto::spmd_compile_options`],
/// e.g. through [`crate::safe::Client::compile_spmd`]). Shapes are global; partition `p` is
/// fed, and returns, its shard:
///
/// - [`MatmulSplit::Columns`] (split over N): `x` and `fp8_max` whole, rows
///   `[p·n/parts, (p+1)·n/parts)` of `wq` and of `bias`, the matching block rows of `sw`;
///   the result is columns `[p·n/parts, (p+1)·n/parts)` of `y`. No communication.
/// - [`MatmulSplit::Rows`] (split over K): columns `[p·k/parts, (p+1)·k/parts)` of `x` and
///   `wq`, the matching block columns of `sw`, `bias` and `fp8_max` whole; every partition
///   returns all of `y`, its partial products summed by the all-reduce the partitioner
///   inserts.
///
/// Tiled shardings are even and a scale block must not straddle two partitions, so the split
/// side must be a whole number of blocks per part (`n` a multiple of `parts · bn`, or `k` of
/// `parts · bk`); otherwise [`crate::Error::Invalid`] lists the part counts that work. The
/// activation groups (`Group`, `Block2d`) are `bk` wide, so they too stay within a partition.
///
/// Each partition quantizes the activations it holds (all of `x` under `Columns`, so that
/// work is repeated), and the sums differ from [`fp8_linear`]'s only in order: on the XLA CPU
/// plugin, `Columns` was bit-identical for dots of fewer than 8 rows and within 1e-6 of the
/// row's largest output otherwise, `Rows` within 1e-6 (tests/spmd.rs).
pub fn sharded_fp8_linear(
    s: LinearShape,
    act: ActQuant,
    bias: bool,
    parts: usize,
    split: MatmulSplit,
) -> crate::Result<String> {
    act.validate()?;
    let (side, len, block) = match split {
        MatmulSplit::Columns => ("n", s.n(), s.bn()),
        MatmulSplit::Rows => ("k", s.k(), s.bk()),
    };
    if parts == 0 || !len.is_multiple_of(block) || !(len / block).is_multiple_of(parts) {
        let works = whole_block_parts(len, block);
        return Err(crate::error::invalid(
            "parts",
            format!(
                "{split:?} split of {side} = {len} (blocks of {block}) into {parts} parts: each part must hold the same whole number of blocks; part counts that work: {works:?}"
            ),
        ));
    }
    let replicated = "{replicated}".to_string();
    let sh = match split {
        MatmulSplit::Columns => LinearShardings {
            parts,
            x: replicated.clone(),
            wq: tiled(&[parts, 1]),
            sw: tiled(&[parts, 1]),
            bias: tiled(&[parts]),
            fp8_max: replicated,
            y: tiled(&[1, parts]),
        },
        MatmulSplit::Rows => LinearShardings {
            parts,
            x: tiled(&[1, parts]),
            wq: tiled(&[1, parts]),
            sw: tiled(&[1, parts]),
            bias: replicated.clone(),
            fp8_max: replicated.clone(),
            y: replicated,
        },
    };
    Ok(fp8_linear_module(s, act, bias, Some(&sh)))
}

/// The part counts that split `len` into equal whole blocks of `block`: the divisors of the
/// block count, or only 1 where the last block is partial.
fn whole_block_parts(len: usize, block: usize) -> Vec<usize> {
    if block == 0 || !len.is_multiple_of(block) {
        return vec![1];
    }
    let blocks = len / block;
    (1..=blocks).filter(|&p| blocks.is_multiple_of(p)).collect()
}

/// `{devices=[t0,t1,...]0,1,...}`: dim `i` cut into `tiles[i]` pieces over partitions
/// `0..prod(tiles)` in row-major order of the pieces.
fn tiled(tiles: &[usize]) -> String {
    let total: usize = tiles.iter().product();
    let ids = (0..total)
        .map(|i| i.to_string())
        .collect::<Vec<_>>()
        .join(",");
    let tiles = tiles
        .iter()
        .map(|t| t.to_string())
        .collect::<Vec<_>>()
        .join(",");
    format!("{{devices=[{tiles}]{ids}}}")
}

/// `sat(rne(x / s))` over `x` with one scale per `keep` dims (reducing `red`), returned as
/// f32 values, plus the scales `[scale_dims]`.
fn quantize(
    b: &mut Body,
    x: &str,
    dims: &[usize],
    red: &[usize],
    keep: &[usize],
    scale_dims: &[usize],
) -> (String, String) {
    // docs/numerics.md, non-finite activations: the amax is taken over finite elements (a bad
    // token must not move a shared Block2d scale), and a non-finite element quantizes to NaN
    let (ft, bool_t) = (f32t(dims), ty(dims, "i1"));
    let fin = b.op(format!("stablehlo.is_finite {x} : ({ft}) -> {bool_t}"));
    let ax = b.unary("abs", x, dims);
    let zero = b.splat(0.0, dims);
    let ax = b.op(format!(
        "stablehlo.select {fin}, {ax}, {zero} : ({bool_t}, {ft}, {ft}) -> {ft}"
    ));
    let amax = b.reduce(&ax, dims, red, "maximum", 0.0);
    let floor = b.splat(1e-12, scale_dims);
    let am = b.binary("maximum", &amax, &floor, scale_dims);
    // 448 comes in as an argument: XLA rewrites a division by a constant into a multiplication
    // by its reciprocal, and 1/448 is inexact, which would move scales by an ulp
    let c448 = b.broadcast("%fp8_max", &[], &[], scale_dims);
    let sc = b.binary("divide", &am, &c448, scale_dims);
    let sb = b.broadcast(&sc, scale_dims, keep, dims);
    let q = b.binary("divide", x, &sb, dims);
    let r = round_to_e4m3(b, &q, dims);
    let nan = b.splat(f32::NAN, dims);
    let r = b.op(format!(
        "stablehlo.select {fin}, {r}, {nan} : ({bool_t}, {ft}, {ft}) -> {ft}"
    ));
    (r, sc)
}

/// `decode(encode_e4m3(q))` in f32 arithmetic and integer bit operations: round to 3 mantissa
/// bits (ties to even) for normals, to multiples of 2^-9 below 2^-6, saturate to ±448, keep NaN.
/// Not `convert` to `f8E4M3FN` and back: with that pair, XLA's CPU plugin gave 3e-4..5e-3
/// relative error against the reference at M = 1 (N = 2048, K = 512; M >= 2 was exact), where it
/// fuses the activation quantization into the dot. Plain arithmetic leaves a compiler nothing to
/// round differently.
fn round_to_e4m3(b: &mut Body, q: &str, dims: &[usize]) -> String {
    let u32t = ty(dims, "ui32");
    let ft = f32t(dims);
    let bool_t = ty(dims, "i1");
    let uconst = |b: &mut Body, v: u32| b.op(format!("stablehlo.constant dense<{v}> : {u32t}"));
    // normal: bits + 0x7ffff + lsb, then clear the 20 low mantissa bits
    let bits = b.op(format!("stablehlo.bitcast_convert {q} : ({ft}) -> {u32t}"));
    let c20 = uconst(b, 20);
    let one = uconst(b, 1);
    let half = uconst(b, 0x7ffff);
    let keep = uconst(b, 0xfff0_0000);
    let sh = b.op(format!(
        "stablehlo.shift_right_logical {bits}, {c20} : {u32t}"
    ));
    let lsb = b.op(format!("stablehlo.and {sh}, {one} : {u32t}"));
    let inc = b.op(format!("stablehlo.add {half}, {lsb} : {u32t}"));
    let up = b.op(format!("stablehlo.add {bits}, {inc} : {u32t}"));
    let kept = b.op(format!("stablehlo.and {up}, {keep} : {u32t}"));
    let normal = b.op(format!(
        "stablehlo.bitcast_convert {kept} : ({u32t}) -> {ft}"
    ));
    // subnormal: the nearest multiple of 2^-9 (both factors are powers of two: exact)
    let c512 = b.splat(512.0, dims);
    let inv512 = b.splat(1.0 / 512.0, dims);
    let q512 = b.binary("multiply", q, &c512, dims);
    let rq = b.unary("round_nearest_even", &q512, dims);
    let sub = b.binary("multiply", &rq, &inv512, dims);
    let aq = b.unary("abs", q, dims);
    let min_normal = b.splat(1.0 / 64.0, dims);
    let small = b.op(format!(
        "stablehlo.compare LT, {aq}, {min_normal} : ({ft}, {ft}) -> {bool_t}"
    ));
    let r = b.op(format!(
        "stablehlo.select {small}, {sub}, {normal} : ({bool_t}, {ft}, {ft}) -> {ft}"
    ));
    let lo = b.op(format!(
        "stablehlo.constant dense<{}> : tensor<f32>",
        lit(-448.0)
    ));
    let hi = b.op(format!(
        "stablehlo.constant dense<{}> : tensor<f32>",
        lit(448.0)
    ));
    let rc = b.op(format!(
        "stablehlo.clamp {lo}, {r}, {hi} : (tensor<f32>, {ft}, tensor<f32>) -> {ft}"
    ));
    // NaN stays NaN (the rounding above can turn a NaN's bits into an infinity)
    let nan = b.op(format!(
        "stablehlo.compare NE, {q}, {q} : ({ft}, {ft}) -> {bool_t}"
    ));
    b.op(format!(
        "stablehlo.select {nan}, {q}, {rc} : ({bool_t}, {ft}, {ft}) -> {ft}"
    ))
}

/// Shape of one sequence of NSA selection attention (masked form).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct AttnShape {
    pub tq: usize,
    pub tk: usize,
    pub hq: usize,
    pub hkv: usize,
    pub d: usize,
    pub dv: usize,
}

/// Selection attention in masked form: `q f32[tq, hq, d]`, `k f32[tk, hkv, d]`,
/// `v f32[tk, hkv, dv]`, `mask f32[hkv, tq, tk]` (0 where the query sees a selected key,
/// -inf elsewhere) -> `o f32[tq, hq, dv]`, `lse f32[tq, hq]` (`o = 0`, `lse = -inf` for a
/// query that sees nothing).
pub fn nsa_selection(s: AttnShape, scale: f32) -> String {
    let AttnShape {
        tq,
        tk,
        hq,
        hkv,
        d,
        dv,
    } = s;
    let g = hq / hkv;
    let mut b = Body::new();
    let qt = b.transpose("%q", &[tq, hq, d], &[1, 0, 2]);
    let qr = b.reshape(&qt, &[hq, tq, d], &[hkv, g * tq, d]);
    let kt = b.transpose("%k", &[tk, hkv, d], &[1, 0, 2]);
    let vt = b.transpose("%v", &[tk, hkv, dv], &[1, 0, 2]);
    let sc = b.op(format!(
        "stablehlo.dot_general {qr}, {kt}, batching_dims = [0] x [0], contracting_dims = [2] x [2], precision = [HIGHEST, HIGHEST] : ({}, {}) -> {}",
        f32t(&[hkv, g * tq, d]),
        f32t(&[hkv, tk, d]),
        f32t(&[hkv, g * tq, tk])
    ));
    let full = [hkv, g, tq, tk];
    let s4 = b.reshape(&sc, &[hkv, g * tq, tk], &full);
    let c = b.splat(scale, &full);
    let s4 = b.binary("multiply", &s4, &c, &full);
    let mb = b.broadcast("%mask", &[hkv, tq, tk], &[0, 2, 3], &full);
    let sm = b.binary("add", &s4, &mb, &full);
    let red = [hkv, g, tq];
    let m = b.reduce(&sm, &full, &[3], "maximum", f32::NEG_INFINITY);
    // a query that sees nothing has max -inf; clamping keeps exp(-inf - m) = 0, not NaN
    let lowest = b.splat(f32::MIN, &red);
    let m = b.binary("maximum", &m, &lowest, &red);
    let m4 = b.broadcast(&m, &red, &[0, 1, 2], &full);
    let e = b.binary("subtract", &sm, &m4, &full);
    let e = b.unary("exponential", &e, &full);
    let l = b.reduce(&e, &full, &[3], "add", 0.0);
    let tiny = b.splat(f32::MIN_POSITIVE, &red);
    let ls = b.binary("maximum", &l, &tiny, &red);
    let l4 = b.broadcast(&ls, &red, &[0, 1, 2], &full);
    let p = b.binary("divide", &e, &l4, &full);
    let pr = b.reshape(&p, &full, &[hkv, g * tq, tk]);
    let o = b.op(format!(
        "stablehlo.dot_general {pr}, {vt}, batching_dims = [0] x [0], contracting_dims = [2] x [1], precision = [HIGHEST, HIGHEST] : ({}, {}) -> {}",
        f32t(&[hkv, g * tq, tk]),
        f32t(&[hkv, tk, dv]),
        f32t(&[hkv, g * tq, dv])
    ));
    let o4 = b.reshape(&o, &[hkv, g * tq, dv], &[hkv, g, tq, dv]);
    let ot = b.transpose(&o4, &[hkv, g, tq, dv], &[2, 0, 1, 3]);
    let o = b.reshape(&ot, &[tq, hkv, g, dv], &[tq, hq, dv]);
    let logl = b.unary("log", &l, &red);
    let lse = b.binary("add", &m, &logl, &red);
    let lt = b.transpose(&lse, &red, &[2, 0, 1]);
    let lse = b.reshape(&lt, &[tq, hkv, g], &[tq, hq]);
    format!(
        "module @nsa_selection {{\n  func.func public @main(%q: {}, %k: {}, %v: {}, %mask: {}) -> ({}, {}) {{\n{}    return {o}, {lse} : {}, {}\n  }}\n}}\n",
        f32t(&[tq, hq, d]),
        f32t(&[tk, hkv, d]),
        f32t(&[tk, hkv, dv]),
        f32t(&[hkv, tq, tk]),
        f32t(&[tq, hq, dv]),
        f32t(&[tq, hq]),
        b.text,
        f32t(&[tq, hq, dv]),
        f32t(&[tq, hq]),
    )
}

/// How [`sharded_matmul`] splits `y [m, n] = x [m, k] · w [k, n]` over its partitions, and
/// [`sharded_fp8_linear`] its `y [m, n] = x [m, k] · wqᵀ` (there `w` is `[n, k]`: "columns"
/// are the output columns N, "rows" the contraction K, whatever the weight's layout).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum MatmulSplit {
    /// Column parallel: `w` split over `n`, `x` on every partition, each partition holds its
    /// `[m, n / parts]` slice of `y`. No communication.
    Columns,
    /// Row parallel: `x` split over `k` (columns) and `w` over `k` (rows); each partition's
    /// partial product is summed by the all-reduce the SPMD partitioner inserts, and every
    /// partition holds all of `y`.
    Rows,
}

/// `x f32[m, k] · w f32[k, n] -> y f32[m, n]` with `mhlo.sharding` on arguments and result,
/// for XLA's SPMD partitioner over `parts` partitions (compile with
/// [`crate::proto::spmd_compile_options`]). The shapes here are global; each partition is fed,
/// and returns, its shard (see [`MatmulSplit`]).
pub fn sharded_matmul(
    m: usize,
    k: usize,
    n: usize,
    parts: usize,
    split: MatmulSplit,
) -> crate::Result<String> {
    let split_dim = match split {
        MatmulSplit::Columns => n,
        MatmulSplit::Rows => k,
    };
    if m == 0 || k == 0 || n == 0 || parts == 0 || split_dim % parts != 0 {
        return Err(crate::error::invalid(
            "sharded_matmul",
            format!("needs m, k, n >= 1 and the split side divisible by parts; got m = {m}, k = {k}, n = {n}, parts = {parts}, {split:?}"),
        ));
    }
    let replicated = "{replicated}".to_string();
    let (xs, ws, ys) = match split {
        MatmulSplit::Columns => (replicated, tiled(&[1, parts]), tiled(&[1, parts])),
        MatmulSplit::Rows => (tiled(&[1, parts]), tiled(&[parts, 1]), replicated),
    };
    Ok(format!(
        "module @sharded_matmul attributes {{mhlo.num_partitions = {parts} : i32, mhlo.num_replicas = 1 : i32}} {{\n  func.func public @main(%x: {xt} {{mhlo.sharding = \"{xs}\"}}, %w: {wt} {{mhlo.sharding = \"{ws}\"}}) -> ({yt} {{mhlo.sharding = \"{ys}\"}}) {{\n    %y = stablehlo.dot_general %x, %w, contracting_dims = [1] x [0], precision = [HIGHEST, HIGHEST] : ({xt}, {wt}) -> {yt}\n    return %y : {yt}\n  }}\n}}\n",
        xt = f32t(&[m, k]),
        wt = f32t(&[k, n]),
        yt = f32t(&[m, n]),
    ))
}
