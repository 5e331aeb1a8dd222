//! XLA SPMD through our binding: one program with `mhlo.sharding` annotations, compiled for N
//! partitions and run on N host devices of the XLA CPU plugin (`cpu_device_count`), checked
//! against an f64 host product. Skipped, saying so, without the plugin; failing then under
//! `FP8NSA_REQUIRE_PJRT=1`, as in CI.

use fp8nsa_pjrt::programs::{sharded_matmul, MatmulSplit};
use fp8nsa_pjrt::safe::{self, Api, Buffer, Client, ClientOptions, Device, ElementType};
use fp8nsa_pjrt::Error;
use fp8nsa_test_support::{gaussian, rng};

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
fn columns(a: &[f32], rows: usize, cols: usize, c0: usize, c1: usize) -> Vec<f32> {
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
