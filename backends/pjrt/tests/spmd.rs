//! XLA SPMD through our binding: one program with `mhlo.sharding` annotations, compiled for N
//! partitions and run on N host devices of the XLA CPU plugin (`cpu_device_count`), checked
//! against an f64 host product (plain matmul) and against the unsharded program on one device
//! (fp8 linear). Skipped, saying so, without the plugin; failing then under
//! `FP8NSA_REQUIRE_PJRT=1`, as in CI.

use fp8nsa_pjrt::programs::{fp8_linear, sharded_fp8_linear, sharded_matmul, MatmulSplit};
use fp8nsa_pjrt::safe::{self, Api, Buffer, Client, ClientOptions, Device, ElementType};
use fp8nsa_pjrt::Error;
use fp8nsa_test_support::{gaussian, hetero, rng};
use fp8nsa_types::{ActQuant, LinearShape};

/// The leak check counts live objects process-wide: tests of this binary take turns.
static SERIAL: std::sync::Mutex<()> = std::sync::Mutex::new(());

fn api() -> Option<&'static Api> {
    let p = fp8nsa_test_support::resource::pjrt_plugin()?;
    Some(Api::load(&p.to_string_lossy()).expect("plugin loads"))
}

fn client(api: &'static Api, devices: usize) -> Client {
    api.client_with(&ClientOptions {
        cpu_device_count: Some(devices),
    })
    .expect("client")
}

fn upload(client: &Client, v: &[f32], dims: [usize; 2], device: &Device) -> Buffer {
    let bytes: Vec<u8> = v.iter().flat_map(|x| x.to_le_bytes()).collect();
    client
        .upload(
            &bytes,
            ElementType::F32,
            &[dims[0] as i64, dims[1] as i64],
            device,
        )
        .expect("upload")
}

/// Columns `[c0, c1)` of a row-major `[rows, cols]` array.
fn columns<T: Copy>(a: &[T], rows: usize, cols: usize, c0: usize, c1: usize) -> Vec<T> {
    (0..rows)
        .flat_map(|r| a[r * cols + c0..r * cols + c1].iter().copied())
        .collect()
}

/// Runs the sharded product on `parts` devices and returns the global `y [m, n]`.
fn run(
    client: &Client,
    devices: &[Device],
    x: &[f32],
    w: &[f32],
    [m, k, n]: [usize; 3],
    split: MatmulSplit,
) -> Vec<f32> {
    let parts = devices.len();
    let exe = client
        .compile_spmd(&sharded_matmul(m, k, n, parts, split).unwrap(), devices)
        .expect("compiles for SPMD");
    let shards: Vec<[Buffer; 2]> = devices
        .iter()
        .enumerate()
        .map(|(p, d)| match split {
            MatmulSplit::Columns => {
                let nb = n / parts;
                [
                    upload(client, x, [m, k], d),
                    upload(client, &columns(w, k, n, p * nb, (p + 1) * nb), [k, nb], d),
                ]
            }
            MatmulSplit::Rows => {
                let kb = k / parts;
                [
                    upload(client, &columns(x, m, k, p * kb, (p + 1) * kb), [m, kb], d),
                    upload(client, &w[p * kb * n..(p + 1) * kb * n], [kb, n], d),
                ]
            }
        })
        .collect();
    let lists: Vec<Vec<&Buffer>> = shards.iter().map(|s| s.iter().collect()).collect();
    let lists: Vec<&[&Buffer]> = lists.iter().map(|l| l.as_slice()).collect();
    if split == MatmulSplit::Rows {
        // the partial products are summed across partitions, not by a gather to one
        let (format, bytes) = exe.optimized_program().unwrap();
        let hlo = fp8nsa_pjrt::proto::render_hlo(&bytes, &format).join("\n");
        assert!(hlo.contains("all-reduce"), "{hlo}");
    }
    let outs = exe.execute_sharded(&lists).expect("executes");
    assert_eq!(outs.len(), parts);
    let ys: Vec<Vec<f32>> = outs
        .iter()
        .map(|o| {
            assert_eq!(o.len(), 1);
            o[0].to_f32().unwrap()
        })
        .collect();
    match split {
        MatmulSplit::Columns => {
            let nb = n / parts;
            for (o, y) in outs.iter().zip(&ys) {
                assert_eq!(o[0].dims().unwrap(), [m as i64, nb as i64]);
                assert_eq!(y.len(), m * nb);
            }
            (0..m)
                .flat_map(|r| {
                    ys.iter()
                        .flat_map(move |y| y[r * nb..(r + 1) * nb].to_vec())
                })
                .collect()
        }
        MatmulSplit::Rows => {
            // every partition holds the all-reduced whole
            for (o, y) in outs.iter().zip(&ys) {
                assert_eq!(o[0].dims().unwrap(), [m as i64, n as i64]);
                assert_eq!(y, &ys[0], "partitions disagree after the all-reduce");
            }
            ys[0].clone()
        }
    }
}

#[test]
fn the_cpu_plugin_exposes_the_devices_asked_for() {
    let _turn = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let Some(api) = api() else { return };
    let default = api.client().unwrap().devices().unwrap().len();
    eprintln!("a client without options has {default} device(s)");
    assert!(default >= 1);
    for want in [1, 2, 4, 8] {
        let devices = client(api, want).devices().unwrap();
        assert_eq!(devices.len(), want);
        let ids: Vec<i32> = devices.iter().map(|d| d.id().unwrap()).collect();
        assert_eq!(ids, (0..want as i32).collect::<Vec<_>>());
    }
    // the plugin would make a client without devices
    let e = api
        .client_with(&ClientOptions {
            cpu_device_count: Some(0),
        })
        .map(|_| ())
        .unwrap_err();
    assert!(
        matches!(
            e,
            Error::Invalid {
                arg: "cpu_device_count",
                ..
            }
        ),
        "{e}"
    );
}

#[test]
fn sharded_matmul_matches_the_host_product() {
    let _turn = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let Some(api) = api() else { return };
    let mut r = rng("sharded_matmul_matches_the_host_product");
    let (m, k, n) = (5, 24, 16);
    let x = gaussian(&mut r, m * k);
    let w = gaussian(&mut r, k * n);
    let want: Vec<f64> = (0..m * n)
        .map(|i| {
            let (row, col) = (i / n, i % n);
            (0..k)
                .map(|j| f64::from(x[row * k + j]) * f64::from(w[j * n + col]))
                .sum()
        })
        .collect();
    let client = client(api, 4);
    let all = client.devices().unwrap();
    for parts in [2, 4] {
        for split in [MatmulSplit::Columns, MatmulSplit::Rows] {
            let y = run(&client, &all[..parts], &x, &w, [m, k, n], split);
            assert_eq!(y.len(), m * n);
            for (i, (&got, &want)) in y.iter().zip(&want).enumerate() {
                // f32 sums of k = 24 unit Gaussian products; the row split adds in another order
                assert!(
                    (f64::from(got) - want).abs() <= 1e-5 * (1.0 + want.abs()) * k as f64,
                    "{parts} parts, {split:?}, [{}, {}]: {got} vs {want}",
                    i / n,
                    i % n
                );
            }
        }
    }
}

fn upload_bytes(client: &Client, v: &[u8], ty: ElementType, dims: &[usize], d: &Device) -> Buffer {
    let dims: Vec<i64> = dims.iter().map(|&x| x as i64).collect();
    client.upload(v, ty, &dims, d).expect("upload")
}

fn upload_f32(client: &Client, v: &[f32], dims: &[usize], d: &Device) -> Buffer {
    let bytes: Vec<u8> = v.iter().flat_map(|x| x.to_le_bytes()).collect();
    upload_bytes(client, &bytes, ElementType::F32, dims, d)
}

/// Host data of one fp8 linear: `x [m, k]`, e4m3 codes `[n, k]`, scales `[nb, kb]`, `bias [n]`.
struct Fp8Data {
    x: Vec<f32>,
    codes: Vec<u8>,
    scales: Vec<f32>,
    bias: Option<Vec<f32>>,
}

impl Fp8Data {
    fn random(r: &mut rand::rngs::StdRng, s: LinearShape, bias: bool) -> Self {
        let (nb, kb) = (s.n_blocks(), s.k_blocks());
        // token-by-K-group magnitudes over 1e-3..1e3, so per-group activation scales differ
        let x = hetero(r, s.m(), s.k(), 1, s.bk());
        // every finite e4m3 code (the low mantissa bits of a Gaussian are close to uniform)
        let codes = gaussian(r, s.n() * s.k())
            .iter()
            .map(|g| match g.to_bits() as u8 {
                c if c & 0x7f == 0x7f => c ^ 1,
                c => c,
            })
            .collect();
        // block scales spread over 1e-3..1e3
        let scales = gaussian(r, nb * kb)
            .iter()
            .map(|g| 10f32.powf((1.5 * g).clamp(-3.0, 3.0)))
            .collect();
        let bias = bias.then(|| gaussian(r, s.n()));
        Self {
            x,
            codes,
            scales,
            bias,
        }
    }
}

/// The arguments of the fp8 linear program, in its order, on `d`.
fn fp8_args(
    client: &Client,
    d: &Device,
    [m, n, k, nb, kb]: [usize; 5],
    v: &Fp8Data,
    act: ActQuant,
) -> Vec<Buffer> {
    let mut args = vec![
        upload_f32(client, &v.x, &[m, k], d),
        upload_bytes(client, &v.codes, ElementType::U8, &[n, k], d),
        upload_f32(client, &v.scales, &[nb, kb], d),
    ];
    if let Some(b) = &v.bias {
        args.push(upload_f32(client, b, &[n], d));
    }
    if act != ActQuant::None {
        args.push(upload_f32(client, &[448.0], &[], d));
    }
    args
}

/// The unsharded `fp8_linear` program on one device: what the sharded one must reproduce.
fn fp8_unsharded(
    client: &Client,
    d: &Device,
    s: LinearShape,
    act: ActQuant,
    v: &Fp8Data,
) -> Vec<f32> {
    let exe = client
        .compile(
            &fp8_linear(s, act, v.bias.is_some()),
            "mlir",
            &fp8nsa_pjrt::proto::compile_options(0, 1, 1),
        )
        .expect("compiles");
    let dims = [s.m(), s.n(), s.k(), s.n_blocks(), s.k_blocks()];
    let args = fp8_args(client, d, dims, v, act);
    let out = exe
        .execute(&args.iter().collect::<Vec<_>>())
        .expect("executes");
    out[0].to_f32().unwrap()
}

/// The collective operations of an optimized HLO module, in order.
fn collectives(hlo: &str) -> Vec<String> {
    const OPS: [&str; 9] = [
        "all-reduce",
        "all-reduce-start",
        "all-gather",
        "all-gather-start",
        "reduce-scatter",
        "all-to-all",
        "collective-permute",
        "collective-permute-start",
        "collective-broadcast",
    ];
    hlo.lines()
        .flat_map(|l| {
            OPS.iter()
                .filter(move |op| l.contains(&format!(" {op}(")))
                .map(|op| op.to_string())
        })
        .collect()
}

/// The sharded fp8 linear on `devices`, fed its shards; returns the global `y [m, n]` and
/// the collectives of the optimized program.
fn fp8_sharded(
    client: &Client,
    devices: &[Device],
    s: LinearShape,
    act: ActQuant,
    v: &Fp8Data,
    split: MatmulSplit,
) -> (Vec<f32>, Vec<String>) {
    let parts = devices.len();
    let (m, n, k) = (s.m(), s.n(), s.k());
    let (nb, kb) = (s.n_blocks(), s.k_blocks());
    let code = sharded_fp8_linear(s, act, v.bias.is_some(), parts, split).expect("legal split");
    let exe = client
        .compile_spmd(&code, devices)
        .expect("compiles for SPMD");
    let (format, bytes) = exe.optimized_program().unwrap();
    let hlo = fp8nsa_pjrt::proto::render_hlo(&bytes, &format).join("\n");
    let args: Vec<Vec<Buffer>> = devices
        .iter()
        .enumerate()
        .map(|(p, d)| match split {
            MatmulSplit::Columns => {
                let (np, nbp) = (n / parts, nb / parts);
                let shard = Fp8Data {
                    x: v.x.clone(),
                    codes: v.codes[p * np * k..(p + 1) * np * k].to_vec(),
                    scales: v.scales[p * nbp * kb..(p + 1) * nbp * kb].to_vec(),
                    bias: v.bias.as_ref().map(|b| b[p * np..(p + 1) * np].to_vec()),
                };
                fp8_args(client, d, [m, np, k, nbp, kb], &shard, act)
            }
            MatmulSplit::Rows => {
                let (kp, kbp) = (k / parts, kb / parts);
                let shard = Fp8Data {
                    x: columns(&v.x, m, k, p * kp, (p + 1) * kp),
                    codes: columns(&v.codes, n, k, p * kp, (p + 1) * kp),
                    scales: columns(&v.scales, nb, kb, p * kbp, (p + 1) * kbp),
                    bias: v.bias.clone(),
                };
                fp8_args(client, d, [m, n, kp, nb, kbp], &shard, act)
            }
        })
        .collect();
    let lists: Vec<Vec<&Buffer>> = args.iter().map(|a| a.iter().collect()).collect();
    let lists: Vec<&[&Buffer]> = lists.iter().map(|l| l.as_slice()).collect();
    let outs = exe.execute_sharded(&lists).expect("executes");
    let ys: Vec<Vec<f32>> = outs.iter().map(|o| o[0].to_f32().unwrap()).collect();
    let y = match split {
        MatmulSplit::Columns => {
            let np = n / parts;
            (0..m)
                .flat_map(|r| {
                    ys.iter()
                        .flat_map(move |y| y[r * np..(r + 1) * np].to_vec())
                })
                .collect()
        }
        MatmulSplit::Rows => {
            for y in &ys {
                assert_eq!(y.len(), m * n);
                assert!(
                    y.iter()
                        .zip(&ys[0])
                        .all(|(a, b)| a.to_bits() == b.to_bits()),
                    "partitions disagree after the all-reduce"
                );
            }
            ys[0].clone()
        }
    };
    (y, collectives(&hlo))
}

/// The decoded value of an e4m3fn code.
fn e4m3(c: u8) -> f32 {
    fp8nsa_test_support::e4m3_value(c) as f32
}

/// `sat(rne(q))` onto the e4m3fn grid (finite `q`).
fn round_e4m3(q: f32) -> f32 {
    let r = if q.abs() < 1.0 / 64.0 {
        // subnormals: multiples of 2^-9
        (q * 512.0).round_ties_even() / 512.0
    } else {
        let b = q.to_bits();
        f32::from_bits((b + 0x7ffff + ((b >> 20) & 1)) & 0xfff0_0000)
    };
    r.clamp(-448.0, 448.0)
}

/// docs/numerics.md's result, accumulated in f64: to tell a different summation order from a
/// different quantization when two programs disagree.
fn contract(s: LinearShape, act: ActQuant, v: &Fp8Data) -> Vec<f64> {
    let (m, n, k, bn, bk) = (s.m(), s.n(), s.k(), s.bn(), s.bk());
    let kb = s.k_blocks();
    let bm = match act {
        ActQuant::None => 0,
        ActQuant::Group => 1,
        ActQuant::Block2d { bm } => bm,
    };
    let (mut xq, mut sx) = (v.x.clone(), vec![1f32; m * kb]);
    for r0 in (0..m).step_by(bm.max(1)).filter(|_| bm > 0) {
        let rows = r0..(r0 + bm).min(m);
        for b in 0..kb {
            let cols = b * bk..((b + 1) * bk).min(k);
            let amax = rows.clone().fold(0f32, |a, r| {
                v.x[r * k..][cols.clone()]
                    .iter()
                    .fold(a, |a, x| a.max(x.abs()))
            });
            let sc = amax.max(1e-12) / 448.0;
            for r in rows.clone() {
                sx[r * kb + b] = sc;
                for c in cols.clone() {
                    xq[r * k + c] = round_e4m3(v.x[r * k + c] / sc);
                }
            }
        }
    }
    let mut y = vec![0f64; m * n];
    for r in 0..m {
        for o in 0..n {
            let mut acc = v.bias.as_ref().map_or(0.0, |b| f64::from(b[o]));
            for b in 0..kb {
                let part: f64 = (b * bk..((b + 1) * bk).min(k))
                    .map(|c| f64::from(xq[r * k + c]) * f64::from(e4m3(v.codes[o * k + c])))
                    .sum();
                acc += part * f64::from(sx[r * kb + b]) * f64::from(v.scales[(o / bn) * kb + b]);
            }
            y[r * n + o] = acc;
        }
    }
    y
}

/// Largest `|y - want|` over the largest `|want|` of its row, and the same per element: an
/// output near 0 by cancellation keeps no relative precision under another summation order.
fn errors(y: &[f32], want: &[f64], n: usize) -> (f64, f64) {
    let (mut of_row, mut per_element) = (0f64, 0f64);
    for (yr, wr) in y.chunks(n).zip(want.chunks(n)) {
        let scale = wr.iter().fold(0f64, |a, b| a.max(b.abs()));
        for (&a, &b) in yr.iter().zip(wr) {
            let d = (f64::from(a) - b).abs();
            of_row = of_row.max(d / scale);
            per_element = per_element.max(d / b.abs().max(f64::MIN_POSITIVE));
        }
    }
    (of_row, per_element)
}

#[test]
fn sharded_fp8_linear_matches_the_unsharded_program() {
    let _turn = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let Some(api) = api() else { return };
    let mut r = rng("sharded_fp8_linear_matches_the_unsharded_program");
    let client = client(api, 4);
    let all = client.devices().unwrap();
    let acts = [ActQuant::None, ActQuant::Group, ActQuant::Block2d { bm: 4 }];
    // the split side in whole 128-blocks for 2 and 4 parts; the other side need not be:
    // K = 3884 (30.3 blocks) under the column split, N = 576 (4.5 blocks) under the row split
    for (split, n, k) in [
        (MatmulSplit::Columns, 512, 3884),
        (MatmulSplit::Rows, 576, 1024),
    ] {
        // M = 7 and 9 with bm = 4 leave a partial row block
        for m in [1, 7, 9] {
            let s = LinearShape::new(m, n, k, 128, 128).unwrap();
            let v = Fp8Data::random(&mut r, s, m != 1);
            for act in acts {
                let exact = contract(s, act, &v);
                let want = fp8_unsharded(&client, &all[0], s, act, &v);
                // f32 sums of products spanning six decades (seen: up to 4e-6 for W8A16)
                let (err, _) = errors(&want, &exact, n);
                assert!(err < 1e-4, "unsharded, M = {m}, {act:?}: {err:e}");
                let want64: Vec<f64> = want.iter().map(|&y| f64::from(y)).collect();
                for parts in [2, 4] {
                    let (y, coll) = fp8_sharded(&client, &all[..parts], s, act, &v, split);
                    let what = format!("{split:?}, {parts} parts, M = {m}, {act:?}");
                    assert_eq!(y.len(), want.len(), "{what}");
                    let differ = y
                        .iter()
                        .zip(&want)
                        .filter(|(a, b)| a.to_bits() != b.to_bits())
                        .count();
                    let (of_row, per_element) = errors(&y, &want64, n);
                    let (vs_contract, _) = errors(&y, &exact, n);
                    eprintln!(
                        "{what}: collectives {coll:?}; {differ} of {} differ from the unsharded program, by {of_row:.1e} of the row's largest ({per_element:.1e} per element); {vs_contract:.1e} from the f64 contract",
                        y.len()
                    );
                    // the same quantization: only the order of the f32 sums may differ (seen:
                    // up to 9e-7 of the row's largest; a changed activation code would be
                    // ~1e-3 of its term)
                    assert!(vs_contract < 1e-4, "{what}: {vs_contract:e}");
                    assert!(of_row < 1e-5, "{what}: {of_row:e}");
                    match split {
                        MatmulSplit::Columns => {
                            assert!(coll.is_empty(), "{what}: {coll:?}");
                            // one dot product per output (XLA's CPU dot sums a row of 8 or
                            // more in an order that depends on the N it is given)
                            if m == 1 {
                                assert_eq!(differ, 0, "{what}");
                            }
                        }
                        MatmulSplit::Rows => assert_eq!(coll, ["all-reduce"], "{what}"),
                    }
                }
            }
        }
    }
}

#[test]
fn a_split_that_cuts_a_scale_block_is_an_error() {
    let s = LinearShape::new(3, 384, 3884, 128, 128).unwrap();
    let err = |s: LinearShape, act, parts, split| {
        sharded_fp8_linear(s, act, true, parts, split)
            .map(|_| ())
            .unwrap_err()
    };
    let cases = [
        // K = 3884 ends in a partial block: no row split but the trivial one
        (s, 2, MatmulSplit::Rows, "[1]"),
        // N = 384 is 3 blocks: 2 parts would cut one
        (s, 2, MatmulSplit::Columns, "[1, 3]"),
        (
            LinearShape::new(s.m(), s.n(), 1024, s.bn(), s.bk()).unwrap(),
            3,
            MatmulSplit::Rows,
            "[1, 2, 4, 8]",
        ),
        (
            LinearShape::new(s.m(), 576, s.k(), s.bn(), s.bk()).unwrap(),
            2,
            MatmulSplit::Columns,
            "[1]",
        ),
        (s, 0, MatmulSplit::Columns, "[1, 3]"),
    ];
    for (s, parts, split, works) in cases {
        let e = err(s, ActQuant::Group, parts, split);
        eprintln!("{e}");
        match &e {
            Error::Invalid { arg: "parts", msg } => assert!(msg.ends_with(works), "{e}"),
            _ => panic!("{e}"),
        }
    }
    // legal ones are accepted; bad shapes and activation schemes are refused before the split
    assert!(sharded_fp8_linear(s, ActQuant::None, false, 3, MatmulSplit::Columns).is_ok());
    let e = err(s, ActQuant::Block2d { bm: 0 }, 3, MatmulSplit::Columns);
    assert!(matches!(e, Error::Invalid { .. }), "{e}");
    // a shape with an empty block cannot be made, so it never reaches the split
    let e = LinearShape::new(3, 384, 3884, 128, 0).unwrap_err();
    assert!(
        matches!(e, fp8nsa_types::Error::Invalid { arg: "bk", .. }),
        "{e}"
    );
}

#[test]
fn misuse_is_an_error_and_nothing_leaks() {
    let _turn = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let Some(api) = api() else { return };
    let before = safe::live_objects();
    {
        let client = client(api, 2);
        let devices = client.devices().unwrap();
        let e = sharded_matmul(2, 3, 4, 2, MatmulSplit::Rows).unwrap_err();
        assert!(matches!(e, Error::Invalid { .. }), "{e}");
        let exe = client
            .compile_spmd(
                &sharded_matmul(2, 4, 4, 2, MatmulSplit::Columns).unwrap(),
                &devices,
            )
            .unwrap();
        let [x0, x1] = [0, 1].map(|d| upload(&client, &[1.0; 8], [2, 4], &devices[d]));
        let [w0, w1] = [0, 1].map(|d| upload(&client, &[1.0; 8], [4, 2], &devices[d]));
        // one argument list for a two-partition program
        let e = exe.execute_sharded(&[&[&x0, &w0]]).map(|_| ()).unwrap_err();
        assert!(matches!(e, Error::Plugin { .. }), "{e}");
        eprintln!("one list for two partitions: {e}");
        // lists of different lengths never reach the plugin
        let e = exe
            .execute_sharded(&[&[&x0, &w0], &[&x1]])
            .map(|_| ())
            .unwrap_err();
        assert!(matches!(e, Error::Invalid { arg: "args", .. }), "{e}");
        // a device, or a buffer, of another client
        let other_client = api.client().unwrap();
        let other = other_client.device().unwrap();
        let e = client
            .upload(&[0; 4], ElementType::F32, &[1], &other)
            .map(|_| ())
            .unwrap_err();
        assert!(matches!(e, Error::Invalid { arg: "device", .. }), "{e}");
        // an SPMD program over another client's device, or over one device twice
        let code = sharded_matmul(2, 4, 4, 2, MatmulSplit::Columns).unwrap();
        let others = other_client.devices().unwrap();
        for (twice, list) in [
            (false, [&devices[0], &others[0]]),
            (true, [&devices[1], &devices[1]]),
        ] {
            let list: Vec<Device> = list.into_iter().cloned().collect();
            let e = client.compile_spmd(&code, &list).map(|_| ()).unwrap_err();
            assert!(matches!(e, Error::Invalid { arg: "devices", .. }), "{e}");
            assert_eq!(e.to_string().contains("twice"), twice, "{e}");
        }
        let foreign = upload(&other_client, &[1.0; 8], [4, 2], &other);
        let e = exe
            .execute_sharded(&[&[&x0, &w0], &[&x1, &foreign]])
            .map(|_| ())
            .unwrap_err();
        assert!(matches!(e, Error::Invalid { arg: "args", .. }), "{e}");
        // repeated runs free their outputs
        let lists: [&[&Buffer]; 2] = [&[&x0, &w0], &[&x1, &w1]];
        for _ in 0..20 {
            let y = exe.execute_sharded(&lists).unwrap();
            assert_eq!(y[1][0].to_f32().unwrap(), [4.0; 4]);
        }
    }
    assert_eq!(
        safe::live_objects(),
        before,
        "[clients, executables, buffers, events]"
    );
}
