//! Rotary position embeddings of a decoder's queries and keys, on the token-major rows a
//! projection gives, each token at its own position. The decision is made here, once per call.

use candle_core::{CpuStorage, CustomOp3, DType, Layout, Shape, Tensor};
use fp8nsa_types::RopeStyle;

use crate::error::{invalid, shape_err, Result};
use crate::storage::{contiguous, f32s, ParkedError};

/// `x [.., H, D]` (token-major, as a projection gives it: `[B, T, H, D]` or `[T, H, D]`) with
/// token `i` of its flattened leading dims rotated by the angles of position `positions[i]`,
/// read from `cos` / `sin [P, D/2]` tables (row `p`: position `p`), pairs as `style` says.
/// f32 on the CPU runs `fp8nsa_cpu::rope::rope`: one pass, no transposed copies, any position
/// per token (a ragged batch's sequences in one call); elsewhere Candle's `rope` / `rope_i`
/// over the transposed heads, the tables' rows gathered (and moved to `x`'s device). The same
/// bits either way. A position past the tables is [`Error::Invalid`].
///
/// ```
/// use candle_core::{Device, Tensor};
/// use fp8nsa_ops::rope;
/// use fp8nsa_types::RopeStyle;
///
/// let dev = Device::Cpu;
/// let ang = Tensor::arange(0f32, 64.0, &dev)?.reshape((16, 4))?.affine(0.1, 0.0)?;
/// let (cos, sin) = (ang.cos()?, ang.sin()?); // 16 positions, head size 8
/// let x = Tensor::randn(0f32, 1.0, (1, 3, 2, 8), &dev)?; // 3 tokens, 2 heads
/// let y = rope(&x, &cos, &sin, &[7, 8, 9], RopeStyle::Half)?;
/// // Candle's rope of the same rows, heads first
/// let xh = x.transpose(1, 2)?.contiguous()?;
/// let want = candle_nn::rotary_emb::rope(&xh, &cos.narrow(0, 7, 3)?, &sin.narrow(0, 7, 3)?)?;
/// let want = want.transpose(1, 2)?.contiguous()?;
/// assert_eq!(y.flatten_all()?.to_vec1::<f32>()?, want.flatten_all()?.to_vec1::<f32>()?);
/// assert!(rope(&x, &cos, &sin, &[7, 8, 16], RopeStyle::Half).is_err()); // past the tables
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
pub fn rope(
    x: &Tensor,
    cos: &Tensor,
    sin: &Tensor,
    positions: &[usize],
    style: RopeStyle,
) -> Result<Tensor> {
    let dims = x.dims();
    let [.., h, d] = *dims else {
        return Err(shape_err("x", "[.., H, D]", dims));
    };
    let tokens: usize = dims[..dims.len() - 2].iter().product();
    if tokens != positions.len() {
        return Err(invalid(
            "positions",
            format!("{} positions for {tokens} tokens", positions.len()),
        ));
    }
    if !d.is_multiple_of(2) || h == 0 {
        return Err(shape_err("x", "[.., H, D] with H > 0 and D even", dims));
    }
    for (arg, t) in [("cos", cos), ("sin", sin)] {
        if t.dims().len() != 2 || t.dims()[1] != d / 2 || t.dims() != cos.dims() {
            return Err(shape_err(arg, format!("[P, {}], as cos", d / 2), t.dims()));
        }
    }
    let rows = cos.dims()[0];
    if let Some(&p) = positions.iter().find(|&&p| p >= rows) {
        return Err(invalid(
            "positions",
            format!("position {p} is past the tables' {rows} positions"),
        ));
    }
    let cpu = [x, cos, sin]
        .iter()
        .all(|t| t.device().is_cpu() && t.dtype() == DType::F32);
    if cpu {
        let op = RopeOp {
            h,
            d,
            positions,
            style,
            err: ParkedError::new(),
        };
        return x
            .contiguous()?
            .apply_op3_no_bwd(&cos.contiguous()?, &sin.contiguous()?, &op)
            .map_err(|e| op.err.or(e));
    }
    let ids: Vec<u32> = positions.iter().map(|&p| p as u32).collect();
    let ids = Tensor::from_vec(ids, tokens, cos.device())?;
    let gather = |t: &Tensor| -> Result<Tensor> {
        Ok(t.index_select(&ids, 0)?
            .to_device(x.device())?
            .to_dtype(x.dtype())?)
    };
    let (c, s) = (gather(cos)?, gather(sin)?);
    let xh = x
        .reshape((1, tokens, h, d))?
        .transpose(1, 2)?
        .contiguous()?;
    let y = match style {
        RopeStyle::Half => candle_nn::rotary_emb::rope(&xh, &c, &s)?,
        RopeStyle::Interleaved => candle_nn::rotary_emb::rope_i(&xh, &c, &s)?,
    };
    Ok(y.transpose(1, 2)?.contiguous()?.reshape(dims)?)
}

struct RopeOp<'a> {
    h: usize,
    d: usize,
    positions: &'a [usize],
    style: RopeStyle,
    err: ParkedError,
}

impl CustomOp3 for RopeOp<'_> {
    fn name(&self) -> &'static str {
        "fp8nsa-rope"
    }

    fn cpu_fwd(
        &self,
        xs: &CpuStorage,
        xl: &Layout,
        cs: &CpuStorage,
        cl: &Layout,
        ss: &CpuStorage,
        sl: &Layout,
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        self.err.park((|| {
            let x = contiguous("x", f32s("x", xs)?, xl)?;
            let cos = contiguous("cos", f32s("cos", cs)?, cl)?;
            let sin = contiguous("sin", f32s("sin", ss)?, sl)?;
            let mut out = vec![0f32; x.len()];
            fp8nsa_cpu::rope::rope(
                x,
                self.h,
                self.d,
                self.positions,
                cos,
                sin,
                self.style,
                &mut out,
            )?;
            Ok((CpuStorage::F32(out), xl.shape().clone()))
        })())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::error::Error;
    use candle_core::Device;

    /// Both pairings against Candle's `rope` / `rope_i` over the transposed heads, bit for bit,
    /// at a ragged batch's positions (`[T, H, D]` and `[B, T, H, D]` inputs); bad arguments are
    /// typed errors naming the argument.
    #[test]
    fn rope_equals_candle_at_ragged_positions() {
        let dev = Device::Cpu;
        let (h, d, p) = (3usize, 16usize, 50usize);
        let ang = Tensor::rand(0f32, 6.0, (p, d / 2), &dev).unwrap();
        let (cos, sin) = (ang.cos().unwrap(), ang.sin().unwrap());
        // two sequences: 3 tokens at 10.., one at 47
        let positions = [10usize, 11, 12, 47];
        let x = Tensor::randn(0f32, 1.0, (4, h, d), &dev).unwrap();
        let ids = Tensor::new(&[10u32, 11, 12, 47], &dev).unwrap();
        let (c, s) = (
            cos.index_select(&ids, 0).unwrap(),
            sin.index_select(&ids, 0).unwrap(),
        );
        let xh = x
            .unsqueeze(0)
            .unwrap()
            .transpose(1, 2)
            .unwrap()
            .contiguous()
            .unwrap();
        for style in [RopeStyle::Half, RopeStyle::Interleaved] {
            let want = match style {
                RopeStyle::Half => candle_nn::rotary_emb::rope(&xh, &c, &s).unwrap(),
                RopeStyle::Interleaved => candle_nn::rotary_emb::rope_i(&xh, &c, &s).unwrap(),
            };
            let want: Vec<f32> = want
                .transpose(1, 2)
                .unwrap()
                .flatten_all()
                .unwrap()
                .to_vec1()
                .unwrap();
            let got = rope(&x, &cos, &sin, &positions, style).unwrap();
            assert_eq!(got.dims(), x.dims());
            assert_eq!(
                got.flatten_all().unwrap().to_vec1::<f32>().unwrap(),
                want,
                "{style:?}"
            );
            let x4 = x.reshape((2, 2, h, d)).unwrap();
            let got4 = rope(&x4, &cos, &sin, &positions, style).unwrap();
            assert_eq!(
                got4.flatten_all().unwrap().to_vec1::<f32>().unwrap(),
                want,
                "{style:?}"
            );
        }
        let odd = Tensor::zeros((1, h, 5), DType::F32, &dev).unwrap();
        let half = RopeStyle::Half;
        for (r, arg) in [
            (rope(&x, &cos, &sin, &positions[..3], half), "positions"),
            (rope(&x, &cos, &sin, &[10, 11, 12, p], half), "positions"),
            (rope(&odd, &cos, &sin, &[0], half), "x"),
            (
                rope(&x, &cos.narrow(1, 0, 4).unwrap(), &sin, &positions, half),
                "cos",
            ),
            (
                rope(&x, &cos, &sin.narrow(0, 0, 20).unwrap(), &positions, half),
                "sin",
            ),
        ] {
            let e = r.unwrap_err();
            assert!(
                matches!(&e, Error::Invalid { arg: a, .. } | Error::Shape { arg: a, .. } if *a == arg),
                "{arg}: {e:?}"
            );
        }
    }
}
