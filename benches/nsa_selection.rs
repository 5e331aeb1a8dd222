//! CPU NSA selection kernel vs the dense masked-SDPA fallback, same inputs, same run.
//! Hq = 16, Hkv = 1, D = 128, 16 selected blocks of 64 per query (1/32 of a 32k context):
//! 256 queries at the end of a 32k context (chunked prefill), and decode at Tk = 65536. Then
//! token-level selection (DeepSeek-V3.2 DSA: K = 2048 single keys of a 64k context, decode): the
//! `TokenSelection` against dense masked SDPA and against the same keys as 2048 one-token ranges.
//! Last, a continuous-batching decode step over a paged KV cache (16 sequences of 1k..32k keys
//! in pages of 16, 16 blocks of 64 each): one `forward_paged` call against 16 single calls on
//! contiguous keys, and against gathering the pages into a packed copy first.
//!
//! `cargo bench --bench nsa_selection`

mod util;

use candle_core::{Device, Tensor};
use criterion::BenchmarkId;
use fp8nsa::nsa::{BlockSelection, PagedKv, SelectionAttention, SelectionRanges, TokenSelection};
use rand::seq::SliceRandom;
use rand::{Rng, SeedableRng};

const HQ: usize = 16;
const HKV: usize = 1;
const D: usize = 128;
const BLOCK: usize = 64;
const SELECTED: usize = 16;
const BASELINE: &str = "dense_masked_sdpa";
const OURS: &str = "selection_kernel";

/// 16 random visible blocks per query; the query's own (local) block always among them.
fn selection(tq: usize, tk: usize, rng: &mut rand::rngs::StdRng) -> BlockSelection {
    let mut v = Vec::with_capacity(tq * HKV * SELECTED);
    for t in 0..tq {
        let last = (tk - tq + t) / BLOCK;
        let mut ids: Vec<i32> = (0..last as i32).collect();
        ids.shuffle(rng);
        ids.truncate(SELECTED - 1);
        ids.push(last as i32);
        v.extend(ids);
    }
    let t = Tensor::from_vec(v, (1, tq, HKV, SELECTED), &Device::Cpu).unwrap();
    BlockSelection::new(t, BLOCK).unwrap()
}

fn main() {
    let mut c = util::criterion(10, 8);
    let group = "nsa_selection_cpu_hq16_hkv1_d128_16x64";
    let dev = Device::Cpu;
    let mut rng = rand::rngs::StdRng::seed_from_u64(0);
    let cases = [("prefill256_32k", 256, 32768), ("decode_64k", 1, 65536)];
    for (name, tq, tk) in cases {
        let q = Tensor::randn(0f32, 1.0, (1, tq, HQ, D), &dev).unwrap();
        let k = Tensor::randn(0f32, 1.0, (1, tk, HKV, D), &dev).unwrap();
        let v = Tensor::randn(0f32, 1.0, (1, tk, HKV, D), &dev).unwrap();
        let sel = selection(tq, tk, &mut rng);
        let kernel = SelectionAttention::new().min_len(0);
        let dense = SelectionAttention::new().min_len(usize::MAX);
        let mut g = c.benchmark_group(group);
        g.bench_function(BenchmarkId::new(BASELINE, name), |b| {
            b.iter(|| dense.forward(&q, &k, &v, &sel).unwrap())
        });
        g.bench_function(BenchmarkId::new(OURS, name), |b| {
            b.iter(|| kernel.forward(&q, &k, &v, &sel).unwrap())
        });
        g.finish();
    }
    // DSA decode: 2048 random distinct keys of 65536, the query's own key among them
    let (tk, k_sel) = (65536usize, 2048usize);
    let q = Tensor::randn(0f32, 1.0, (1, 1, HQ, D), &dev).unwrap();
    let k = Tensor::randn(0f32, 1.0, (1, tk, HKV, D), &dev).unwrap();
    let v = Tensor::randn(0f32, 1.0, (1, tk, HKV, D), &dev).unwrap();
    let mut ids: Vec<i32> = (0..tk as i32 - 1).collect();
    ids.shuffle(&mut rng);
    ids.truncate(k_sel - 1);
    ids.push(tk as i32 - 1);
    let ranges: Vec<i32> = ids.iter().flat_map(|&i| [i, i + 1]).collect();
    let tokens =
        TokenSelection::new(Tensor::from_vec(ids, (1, 1, HKV, k_sel), &dev).unwrap()).unwrap();
    let ranges =
        SelectionRanges::new(Tensor::from_vec(ranges, (1, 1, HKV, k_sel, 2), &dev).unwrap())
            .unwrap();
    let kernel = SelectionAttention::new().min_len(0);
    let dense = SelectionAttention::new().min_len(usize::MAX);
    let mut g = c.benchmark_group("nsa_tokens_cpu_hq16_hkv1_d128_2048of64k");
    g.bench_function(BenchmarkId::new(BASELINE, "decode_64k"), |b| {
        b.iter(|| dense.forward(&q, &k, &v, &tokens).unwrap())
    });
    g.bench_function(BenchmarkId::new("one_token_ranges", "decode_64k"), |b| {
        b.iter(|| kernel.forward(&q, &k, &v, &ranges).unwrap())
    });
    g.bench_function(BenchmarkId::new("token_selection", "decode_64k"), |b| {
        b.iter(|| kernel.forward(&q, &k, &v, &tokens).unwrap())
    });
    g.finish();
    paged_decode(&mut c, &mut rng);
    c.final_summary();
    let params: Vec<String> = cases.iter().map(|c| c.0.to_string()).collect();
    util::print_ratios(group, BASELINE, &[OURS], &params);
    util::print_ratios(
        PAGED_GROUP,
        "single_calls_contiguous",
        &["paged_batched", "gather_then_varlen"],
        &["decode_16seq".to_string()],
    );
}

const PAGED_GROUP: &str = "nsa_paged_cpu_hq16_hkv1_d128_16x64_page16";

/// One decode step of 16 sequences of mixed lengths over a paged cache.
fn paged_decode(c: &mut criterion::Criterion, rng: &mut rand::rngs::StdRng) {
    const PAGE: usize = 16;
    let dev = Device::Cpu;
    let lens: Vec<usize> = (0..16).map(|_| rng.random_range(1024..32768)).collect();
    let pages: usize = lens.iter().map(|l| l.div_ceil(PAGE)).sum();
    let mut ids: Vec<i32> = (0..pages as i32).collect();
    ids.shuffle(rng);
    let max_pages = lens.iter().map(|l| l.div_ceil(PAGE)).max().unwrap();
    let mut table = vec![-1i32; 16 * max_pages];
    let mut next = 0;
    for (i, l) in lens.iter().enumerate() {
        let n = l.div_ceil(PAGE);
        table[i * max_pages..i * max_pages + n].copy_from_slice(&ids[next..next + n]);
        next += n;
    }
    let k_pages = Tensor::randn(0f32, 1.0, (pages, PAGE, HKV, D), &dev).unwrap();
    let v_pages = Tensor::randn(0f32, 1.0, (pages, PAGE, HKV, D), &dev).unwrap();
    let block_table = Tensor::from_vec(table.clone(), (16, max_pages), &dev).unwrap();
    // each sequence's keys as its own contiguous tensor (what single calls need)
    let gather = |i: usize, l: usize| {
        let rows: Vec<u32> = (0..l)
            .map(|j| (table[i * max_pages + j / PAGE] as usize * PAGE + j % PAGE) as u32)
            .collect();
        let rows = Tensor::from_vec(rows, l, &dev).unwrap();
        let pool = |t: &Tensor| t.reshape((pages * PAGE, HKV, D)).unwrap();
        (
            pool(&k_pages).index_select(&rows, 0).unwrap(),
            pool(&v_pages).index_select(&rows, 0).unwrap(),
        )
    };
    let contiguous: Vec<(Tensor, Tensor)> = lens
        .iter()
        .enumerate()
        .map(|(i, &l)| gather(i, l))
        .collect();
    let q = Tensor::randn(0f32, 1.0, (16, 1, HQ, D), &dev).unwrap();
    let sels: Vec<BlockSelection> = lens.iter().map(|&l| selection(1, l, rng)).collect();
    let idx: Vec<Tensor> = sels.iter().map(|s| s.indices().clone()).collect();
    let batched = BlockSelection::new(Tensor::cat(&idx, 0).unwrap(), BLOCK).unwrap();
    let kernel = SelectionAttention::new().min_len(0);
    let kv = PagedKv {
        k_pages: &k_pages,
        v_pages: &v_pages,
        block_table: &block_table,
        seq_lens: &lens,
    };
    let mut g = c.benchmark_group(PAGED_GROUP);
    g.bench_function(
        BenchmarkId::new("single_calls_contiguous", "decode_16seq"),
        |b| {
            b.iter(|| {
                for (i, (k, v)) in contiguous.iter().enumerate() {
                    let (k, v) = (k.unsqueeze(0).unwrap(), v.unsqueeze(0).unwrap());
                    kernel
                        .forward(&q.narrow(0, i, 1).unwrap(), &k, &v, &sels[i])
                        .unwrap();
                }
            })
        },
    );
    g.bench_function(BenchmarkId::new("paged_batched", "decode_16seq"), |b| {
        b.iter(|| kernel.forward_paged(&q, &kv, &batched).unwrap())
    });
    let cu: Vec<u32> = std::iter::once(0)
        .chain(lens.iter().scan(0u32, |a, &l| {
            *a += l as u32;
            Some(*a)
        }))
        .collect();
    let cu_q = Tensor::from_vec((0..=16u32).collect::<Vec<_>>(), 17, &dev).unwrap();
    let cu_k = Tensor::from_vec(cu, 17, &dev).unwrap();
    let packed_sel = BlockSelection::new(Tensor::cat(&idx, 1).unwrap(), BLOCK).unwrap();
    g.bench_function(
        BenchmarkId::new("gather_then_varlen", "decode_16seq"),
        |b| {
            b.iter(|| {
                let parts: Vec<(Tensor, Tensor)> = lens
                    .iter()
                    .enumerate()
                    .map(|(i, &l)| gather(i, l))
                    .collect();
                let k =
                    Tensor::cat(&parts.iter().map(|p| p.0.clone()).collect::<Vec<_>>(), 0).unwrap();
                let v =
                    Tensor::cat(&parts.iter().map(|p| p.1.clone()).collect::<Vec<_>>(), 0).unwrap();
                let q = q.reshape((16, HQ, D)).unwrap();
                kernel
                    .forward_varlen(&q, &k, &v, &cu_q, &cu_k, &packed_sel)
                    .unwrap()
            })
        },
    );
    g.finish();
}
