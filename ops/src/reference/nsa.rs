//! NSA: selection attention and the whole three-branch layer, by gathering key sets.

use candle_core::{DType, Device, Tensor};

use crate::error::Result;

/// NSA selection attention, naively: for each (batch, query, query head) gather the set of
/// selected keys the query may see (`0 <= j < Tk`, `j <= q_offset + t`, each key once), then an
/// f64 softmax over them. Dense BTHD shapes as [`crate::nsa::SelectionAttention::forward`];
/// `scale` defaults to `1/sqrt(D)`, `q_offset` to `Tk - Tq`. Returns `o [B, Tq, Hq, Dv]` and
/// `lse [B, Tq, Hq]`, both f32 (`o = 0`, `lse = -inf` where nothing is visible).
pub fn nsa_selection<'s>(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    selection: impl Into<crate::nsa::Selection<'s>>,
    scale: Option<f64>,
    q_offset: Option<usize>,
) -> Result<(Tensor, Tensor)> {
    use crate::nsa::Selection;
    use std::collections::BTreeSet;

    let (b, tq, hq, d) = q.dims4()?;
    let (_, tk, hkv, _) = k.dims4()?;
    let dv = v.dims4()?.3;
    let g = hq / hkv;
    let scale = scale.unwrap_or(1.0 / (d as f64).sqrt());
    let q_offset = match q_offset {
        Some(o) => o,
        None => tk.checked_sub(tq).ok_or_else(|| {
            crate::error::invalid("q_offset", "Tq > Tk needs an explicit q_offset")
        })?,
    };
    let host = |t: &Tensor| -> Result<Vec<f64>> {
        Ok(t.to_device(&Device::Cpu)?
            .to_dtype(DType::F64)?
            .flatten_all()?
            .to_vec1()?)
    };
    let (qv, kv, vv) = (host(q)?, host(k)?, host(v)?);
    let sel = selection.into();
    // keys named by row (bi, t, h), as a set
    let keys_of: Box<dyn Fn(usize, usize, usize) -> BTreeSet<i64>> = match sel {
        Selection::Blocks(s) => {
            let idx4: Vec<i64> = s
                .indices()
                .to_device(&Device::Cpu)?
                .to_dtype(DType::I64)?
                .flatten_all()?
                .to_vec1()?;
            let [_, stq, shkv, n] = s.dims();
            let bs = s.block_size() as i64;
            // only keys inside [0, Tk) can count: clamping first keeps a huge index from
            // gathering billions of keys that are dropped anyway
            let tk = tk as i64;
            Box::new(move |bi, t, h| {
                let row = &idx4[((bi * stq + t) * shkv + h) * n..][..n];
                row.iter()
                    .filter(|&&i| i >= 0)
                    .flat_map(|&i| (i * bs).min(tk)..((i + 1) * bs).min(tk))
                    .collect()
            })
        }
        Selection::Ranges(s) => {
            let r: Vec<i64> = s
                .ranges()
                .to_device(&Device::Cpu)?
                .to_dtype(DType::I64)?
                .flatten_all()?
                .to_vec1()?;
            let [_, stq, shkv, n] = s.dims();
            let tk = tk as i64;
            Box::new(move |bi, t, h| {
                let row = &r[((bi * stq + t) * shkv + h) * n * 2..][..n * 2];
                row.chunks(2)
                    .flat_map(|p| p[0].clamp(0, tk)..p[1].clamp(0, tk))
                    .collect()
            })
        }
    };
    let mut o = vec![0f32; b * tq * hq * dv];
    let mut lse = vec![f32::NEG_INFINITY; b * tq * hq];
    for bi in 0..b {
        for t in 0..tq {
            let pos = q_offset.checked_add(t).ok_or_else(|| {
                crate::error::invalid("q_offset", "q_offset + Tq overflows usize")
            })?;
            // past i64::MAX every key is visible anyway
            let pos = i64::try_from(pos).unwrap_or(i64::MAX);
            for h in 0..hkv {
                let keys: Vec<usize> = keys_of(bi, t, h)
                    .into_iter()
                    .filter(|&j| j >= 0 && j < tk as i64 && j <= pos)
                    .map(|j| j as usize)
                    .collect();
                if keys.is_empty() {
                    continue;
                }
                for qh in h * g..(h + 1) * g {
                    let qrow = &qv[((bi * tq + t) * hq + qh) * d..][..d];
                    let scores: Vec<f64> = keys
                        .iter()
                        .map(|&j| {
                            let krow = &kv[((bi * tk + j) * hkv + h) * d..][..d];
                            scale * qrow.iter().zip(krow).map(|(a, b)| a * b).sum::<f64>()
                        })
                        .collect();
                    let m = scores.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
                    let w: Vec<f64> = scores.iter().map(|s| (s - m).exp()).collect();
                    let l: f64 = w.iter().sum();
                    let out = &mut o[((bi * tq + t) * hq + qh) * dv..][..dv];
                    for c in 0..dv {
                        let acc: f64 = keys
                            .iter()
                            .zip(&w)
                            .map(|(&j, wj)| wj * vv[((bi * tk + j) * hkv + h) * dv + c])
                            .sum();
                        out[c] = (acc / l) as f32;
                    }
                    lse[(bi * tq + t) * hq + qh] = (m + l.ln()) as f32;
                }
            }
        }
    }
    Ok((
        Tensor::from_vec(o, (b, tq, hq, dv), q.device())?,
        Tensor::from_vec(lse, (b, tq, hq), q.device())?,
    ))
}

/// What [`nsa_layer`] computed.
#[derive(Clone, Debug)]
pub struct NsaLayerReference {
    /// `[B, Tq, Hq, Dv]` f32.
    pub o: Tensor,
    /// Selected blocks `[B, Tq, Hkv, num_selected]`, ascending, `-1` padded (row-major).
    pub selection: Vec<i32>,
    /// Selection-block importance `[B, Tq, Hkv, ceil(Tk / select_block)]` (row-major).
    pub importance: Vec<f64>,
}

/// `Σ_j w_j v_j / Σ_j w_j` with `w_j = exp(scale · q·k_j − max)` over the listed keys, in f64.
fn softmax_attend(q: &[f64], keys: &[&[f64]], vals: &[&[f64]], scale: f64, dv: usize) -> Vec<f64> {
    if keys.is_empty() {
        return vec![0.0; dv];
    }
    let s: Vec<f64> = keys
        .iter()
        .map(|k| scale * q.iter().zip(*k).map(|(a, b)| a * b).sum::<f64>())
        .collect();
    let m = s.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
    let w: Vec<f64> = s.iter().map(|x| (x - m).exp()).collect();
    let l: f64 = w.iter().sum();
    (0..dv)
        .map(|c| w.iter().zip(vals).map(|(wj, v)| wj * v[c]).sum::<f64>() / l)
        .collect()
}

/// The whole three-branch NSA layer with the mean-pool compressor and fixed `gates`
/// `[compressed, selected, window]`, in f64, for queries at the last `Tq` of `Tk` positions.
/// Block importance is written as overlap counting (each compressed block weighted by the keys
/// it shares with the selection block, over the stride), an independent form of paper eq. 9.
/// Ties in the top-n go to the lower block index.
pub fn nsa_layer(
    cfg: &crate::nsa::NsaConfig,
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    gates: [f64; 3],
) -> Result<NsaLayerReference> {
    cfg.validate()?;
    let (b, tq, hq, d) = q.dims4()?;
    let (_, tk, hkv, _) = k.dims4()?;
    let dv = v.dims4()?.3;
    let g = hq / hkv;
    let scale = 1.0 / (d as f64).sqrt();
    let q_offset = tk - tq;
    let host = |t: &Tensor| -> Result<Vec<f64>> {
        Ok(t.to_device(&Device::Cpu)?
            .to_dtype(DType::F64)?
            .flatten_all()?
            .to_vec1()?)
    };
    let (qv, kv, vv) = (host(q)?, host(k)?, host(v)?);
    let (l, s, sb) = (cfg.compress_block, cfg.compress_stride, cfg.select_block);
    let n_c = cfg.compressed_len(tk);
    let nb = tk.div_ceil(sb);
    let key = |bi: usize, j: usize, h: usize| &kv[((bi * tk + j) * hkv + h) * d..][..d];
    let val = |bi: usize, j: usize, h: usize| &vv[((bi * tk + j) * hkv + h) * dv..][..dv];
    let mean =
        |bi: usize, i: usize, h: usize, dim: usize, x: &dyn Fn(usize, usize, usize) -> Vec<f64>| {
            let mut m = vec![0.0; dim];
            for r in 0..l {
                for (a, b) in m.iter_mut().zip(x(bi, i * s + r, h)) {
                    *a += b / l as f64;
                }
            }
            m
        };
    let kvec = |bi: usize, j: usize, h: usize| key(bi, j, h).to_vec();
    let vvec = |bi: usize, j: usize, h: usize| val(bi, j, h).to_vec();

    let mut o = vec![0f32; b * tq * hq * dv];
    let mut selection = Vec::with_capacity(b * tq * hkv * cfg.num_selected);
    let mut importance = vec![0f64; b * tq * hkv * nb];
    for bi in 0..b {
        let ck: Vec<Vec<Vec<f64>>> = (0..n_c)
            .map(|i| (0..hkv).map(|h| mean(bi, i, h, d, &kvec)).collect())
            .collect();
        let cv: Vec<Vec<Vec<f64>>> = (0..n_c)
            .map(|i| (0..hkv).map(|h| mean(bi, i, h, dv, &vvec)).collect())
            .collect();
        for t in 0..tq {
            let p = q_offset + t;
            // compressed block i is visible once its last key i*s + l - 1 is at or before p
            let vis: Vec<usize> = (0..n_c).filter(|&i| i * s + l <= p + 1).collect();
            for h in 0..hkv {
                let mut group_probs = vec![0f64; n_c];
                let mut o_cmp = Vec::with_capacity(g);
                for qh in h * g..(h + 1) * g {
                    let qrow = &qv[((bi * tq + t) * hq + qh) * d..][..d];
                    let ks: Vec<&[f64]> = vis.iter().map(|&i| &ck[i][h][..]).collect();
                    let vs: Vec<&[f64]> = vis.iter().map(|&i| &cv[i][h][..]).collect();
                    o_cmp.push(softmax_attend(qrow, &ks, &vs, scale, dv));
                    // the probabilities themselves, for the importance
                    let sc: Vec<f64> = ks
                        .iter()
                        .map(|k| scale * qrow.iter().zip(*k).map(|(a, b)| a * b).sum::<f64>())
                        .collect();
                    let m = sc.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
                    let z: f64 = sc.iter().map(|x| (x - m).exp()).sum();
                    for (&i, x) in vis.iter().zip(&sc) {
                        group_probs[i] += (x - m).exp() / z;
                    }
                }
                let imp = &mut importance[((bi * tq + t) * hkv + h) * nb..][..nb];
                for (j, w) in imp.iter_mut().enumerate() {
                    for (i, pi) in group_probs.iter().enumerate() {
                        let (a, e) = ((i * s).max(j * sb), (i * s + l).min((j + 1) * sb));
                        if e > a {
                            *w += pi * (e - a) as f64 / s as f64;
                        }
                    }
                }
                // top-n with forced initial and local blocks, among blocks at or before p
                let cur = p / sb;
                let forced = |j: usize| j < cfg.num_initial || j + cfg.num_local > cur;
                let mut row: Vec<usize> = (0..=cur).filter(|&j| forced(j)).collect();
                let mut rest: Vec<usize> = (0..=cur).filter(|&j| !forced(j)).collect();
                rest.sort_by(|&a, &c| imp[c].total_cmp(&imp[a]).then(a.cmp(&c)));
                let budget = cfg.num_selected.saturating_sub(row.len());
                row.extend(rest.into_iter().take(budget));
                row.sort_unstable();
                let sel_keys: Vec<usize> = row
                    .iter()
                    .flat_map(|&j| j * sb..((j + 1) * sb).min(p + 1).min(tk))
                    .collect();
                let win_keys: Vec<usize> = ((p + 1).saturating_sub(cfg.window)..=p).collect();
                for (gi, qh) in (h * g..(h + 1) * g).enumerate() {
                    let qrow = &qv[((bi * tq + t) * hq + qh) * d..][..d];
                    let branch = |keys: &[usize]| {
                        let ks: Vec<&[f64]> = keys.iter().map(|&j| key(bi, j, h)).collect();
                        let vs: Vec<&[f64]> = keys.iter().map(|&j| val(bi, j, h)).collect();
                        softmax_attend(qrow, &ks, &vs, scale, dv)
                    };
                    let (o_slc, o_win) = (branch(&sel_keys), branch(&win_keys));
                    let out = &mut o[((bi * tq + t) * hq + qh) * dv..][..dv];
                    for c in 0..dv {
                        out[c] = (gates[0] * o_cmp[gi][c]
                            + gates[1] * o_slc[c]
                            + gates[2] * o_win[c]) as f32;
                    }
                }
                let mut padded: Vec<i32> = row.iter().map(|&j| j as i32).collect();
                padded.resize(cfg.num_selected, -1);
                selection.extend(padded);
            }
        }
    }
    Ok(NsaLayerReference {
        o: Tensor::from_vec(o, (b, tq, hq, dv), q.device())?,
        selection,
        importance,
    })
}
