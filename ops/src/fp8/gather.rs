//! An all-gather of uneven slices over a collective that only gathers equal buffers (NCCL):
//! a fixed-size header with each rank's shape first, then the slices padded to the longest and
//! cut back apart. Pure tensor steps, so they are tested here on the CPU with the collective
//! simulated; the NCCL communicator runs them around its two gathers.
#![cfg_attr(not(feature = "nccl"), allow(dead_code))]

use candle_core::Tensor;

use super::comm::check_gather;
use crate::error::{invalid, Result};

/// Dimensions an uneven all-gather over a fixed-size collective (NCCL) can describe.
pub(crate) const GATHER_MAX_RANK: usize = 8;
/// Words of the header each rank sends first: its rank count, the gather dim, then each dim as
/// two 32-bit halves (low, high), zero past its rank.
pub(crate) const GATHER_HEADER: usize = 2 + 2 * GATHER_MAX_RANK;

/// This rank's header for an uneven all-gather, as f32 words whose bits are the u32 values
/// (a collective that moves f32 copies bits; as numbers, dims past 2^24 would round). It is
/// sent before any check, so that every rank refuses a bad call after seeing the same headers.
pub(crate) fn gather_header(dims: &[usize], dim: usize) -> [f32; GATHER_HEADER] {
    let word = |v: u64| f32::from_bits(v as u32);
    let mut h = [word(0); GATHER_HEADER];
    h[0] = word(dims.len() as u64);
    h[1] = word(dim as u64);
    for (i, &d) in dims.iter().take(GATHER_MAX_RANK).enumerate() {
        h[2 + 2 * i] = word(d as u64);
        h[3 + 2 * i] = word((d as u64) >> 32);
    }
    h
}

/// Every rank's shape from the gathered headers (rank order), checked as [`check_gather`] does,
/// and the gather dim all ranks asked for.
pub(crate) fn read_gather_headers(words: &[f32]) -> Result<(Vec<Vec<usize>>, usize)> {
    let u = |w: f32| u64::from(w.to_bits());
    let mut shapes = Vec::new();
    let mut dims_asked = Vec::new();
    for (r, h) in words.chunks(GATHER_HEADER).enumerate() {
        let ndim = u(h[0]) as usize;
        if ndim > GATHER_MAX_RANK {
            return Err(invalid(
                "t",
                format!(
                    "rank {r}'s tensor has {ndim} dims; all-gather takes up to {GATHER_MAX_RANK}"
                ),
            ));
        }
        dims_asked.push(u(h[1]) as usize);
        shapes.push(
            (0..ndim)
                .map(|i| (u(h[2 + 2 * i]) | (u(h[3 + 2 * i]) << 32)) as usize)
                .collect(),
        );
    }
    let dim = dims_asked[0];
    if let Some(r) = dims_asked.iter().position(|&d| d != dim) {
        return Err(invalid(
            "dim",
            format!(
                "rank {r} gathers along dim {}, rank 0 along {dim}",
                dims_asked[r]
            ),
        ));
    }
    check_gather(&shapes, dim)?;
    Ok((shapes, dim))
}

/// What a rank sends in an uneven all-gather: `t` with `dim` moved first, zero-padded to
/// `longest` along it, flattened, so every rank sends the same number of elements.
pub(crate) fn gather_send(t: &Tensor, dim: usize, longest: usize) -> Result<Tensor> {
    let moved = t.transpose(0, dim)?.contiguous()?;
    let pad = longest - moved.dims()[0];
    Ok(moved.pad_with_zeros(0, 0, pad)?.flatten_all()?)
}

/// The ranks' tensors concatenated along `dim`, cut back out of `gathered`: the ranks'
/// [`gather_send`] buffers end to end, for the shapes [`read_gather_headers`] returned.
pub(crate) fn gather_cut(gathered: &Tensor, shapes: &[Vec<usize>], dim: usize) -> Result<Tensor> {
    let lens: Vec<usize> = shapes.iter().map(|s| s[dim]).collect();
    let longest = lens.iter().copied().max().unwrap_or(0);
    let mut moved = shapes[0].clone();
    moved.swap(0, dim);
    moved[0] = longest * shapes.len();
    let gathered = gathered.reshape(moved)?;
    let parts: Vec<Tensor> = lens
        .iter()
        .enumerate()
        .map(|(r, &len)| gathered.narrow(0, r * longest, len))
        .collect::<candle_core::Result<_>>()?;
    Ok(Tensor::cat(&parts, 0)?.transpose(0, dim)?.contiguous()?)
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Device;

    /// The uneven all-gather's steps as the NCCL communicator runs them, with the collective
    /// itself (ranks' buffers end to end) done here: the pieces come back whole and in order.
    #[test]
    fn uneven_gather_pieces_come_back_whole() {
        let dev = Device::Cpu;
        for (dim, lens) in [
            (1usize, vec![5usize, 4, 1]),
            (0, vec![3, 3]),
            (2, vec![1, 6, 2, 4]),
        ] {
            let parts: Vec<Tensor> = lens
                .iter()
                .enumerate()
                .map(|(r, &len)| {
                    let mut dims = vec![2, 3, 2];
                    dims[dim] = len;
                    let n: usize = dims.iter().product();
                    let v: Vec<f32> = (0..n).map(|i| (r * 1000 + i) as f32).collect();
                    Tensor::from_vec(v, dims, &dev).unwrap()
                })
                .collect();
            let headers: Vec<f32> = parts
                .iter()
                .flat_map(|p| gather_header(p.dims(), dim))
                .collect();
            let (shapes, d) = read_gather_headers(&headers).unwrap();
            assert_eq!(d, dim);
            let longest = shapes.iter().map(|s| s[dim]).max().unwrap();
            let sent: Vec<Tensor> = parts
                .iter()
                .map(|p| gather_send(p, dim, longest).unwrap())
                .collect();
            assert!(sent.iter().all(|s| s.elem_count() == sent[0].elem_count()));
            let got = gather_cut(&Tensor::cat(&sent, 0).unwrap(), &shapes, dim).unwrap();
            let want = Tensor::cat(&parts, dim).unwrap();
            assert_eq!(got.dims(), want.dims());
            let flat = |t: &Tensor| t.flatten_all().unwrap().to_vec1::<f32>().unwrap();
            assert_eq!(flat(&got), flat(&want), "dim {dim}, lens {lens:?}");
        }
    }

    #[test]
    fn gather_headers_are_exact_and_refused_alike() {
        let big = (1usize << 40) + 3; // not exact as an f32 number
        let words: Vec<f32> = [gather_header(&[big, 7], 1), gather_header(&[big, 9], 1)].concat();
        let (shapes, _) = read_gather_headers(&words).unwrap();
        assert_eq!(shapes, vec![vec![big, 7], vec![big, 9]]);
        // another dim on one rank, shapes that differ off the gather dim, too many dims
        let bad = [
            [gather_header(&[2, 3], 1), gather_header(&[2, 3], 0)].concat(),
            [gather_header(&[2, 3], 1), gather_header(&[4, 3], 1)].concat(),
            [gather_header(&[2, 3], 2), gather_header(&[2, 3], 2)].concat(),
            [gather_header(&[1; 9], 0), gather_header(&[1; 9], 0)].concat(),
        ];
        for words in bad {
            // every rank reads the same words, so every rank gets this same error
            assert!(read_gather_headers(&words).is_err());
        }
    }
}
