//! `fp8nsa-inspect` on hand-written programs in tests/data/inspect/: XLA HLO text (native fp8
//! dot, upcast inside a fusion, unbalanced async copies), StableHLO, and Mosaic TPU MLIR written
//! like Pallas output for the v1 / v2 / v3 kernels.

use fp8nsa_inspect::{inspect, BufferRole, Check, ProgramFormat, Report, Variant};

fn fixture(name: &str) -> String {
    let path = format!("{}/tests/data/inspect/{name}", env!("CARGO_MANIFEST_DIR"));
    std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{path}: {e}"))
}

/// 1-based number of the first line containing `needle` (after `skip` such lines).
fn line_of(text: &str, needle: &str, skip: usize) -> usize {
    text.lines()
        .enumerate()
        .filter(|(_, l)| l.contains(needle))
        .nth(skip)
        .map(|(i, _)| i + 1)
        .unwrap_or_else(|| panic!("`{needle}` not in the fixture"))
}

fn check<'a>(checks: &'a [Check], name: &str) -> &'a Check {
    checks
        .iter()
        .find(|c| c.name == name)
        .unwrap_or_else(|| panic!("no check `{name}` in {checks:#?}"))
}

fn lines(c: &Check) -> Vec<usize> {
    c.evidence.iter().map(|(l, _)| *l).collect()
}

/// The names of the expectations of `v` that fail.
fn failing(r: &Report, v: Variant) -> Vec<&'static str> {
    r.expectations(v)
        .into_iter()
        .filter(|c| !c.ok)
        .map(|c| c.name)
        .collect()
}

const ALL: [&str; 7] = [
    "hlo_native_fp8_dot.hlo",
    "hlo_upcast_fusion.hlo",
    "hlo_async_unbalanced.hlo",
    "stablehlo_fp8.mlir",
    "mosaic_v1_blockspec.mlir",
    "mosaic_v2_manual_dma.mlir",
    "mosaic_v3_smem_scales.mlir",
];

#[test]
fn hlo_native_fp8_dot() {
    let r = inspect(&fixture("hlo_native_fp8_dot.hlo"));
    assert_eq!(r.format, ProgramFormat::HloText);
    assert_eq!((r.dots, r.native_fp8_dots, r.upcast_dots), (1, 1, 0));
    assert_eq!(r.fp8_types, ["f8e4m3fn"]);

    let dot = check(&r.checks, "native fp8 dot");
    assert!(dot.ok, "{dot:?}");
    assert_eq!(lines(dot), [8]);
    assert!(dot.evidence[0]
        .1
        .starts_with("ROOT %dot.5 = f32[2,4]{1,0} dot("));

    let fp8 = check(&r.checks, "fp8 operands");
    assert!(fp8.ok);
    assert!(fp8.detail.contains("bitcast from u8"), "{}", fp8.detail);
    assert_eq!(&lines(fp8)[..2], [5, 7], "the bitcasts come first");

    // Parameters are in device memory (no S(n) in their layouts).
    let params: Vec<_> = r
        .buffers
        .iter()
        .filter(|b| b.role == BufferRole::Parameter)
        .map(|b| (b.name.as_str(), b.space.as_deref(), b.dims.clone()))
        .collect();
    assert_eq!(
        params,
        [
            ("Arg_0.1", Some("S(0)"), vec![2, 3]),
            ("Arg_1.2", Some("S(0)"), vec![3, 4])
        ]
    );

    assert!(r.satisfies(Variant::V1));
    assert!(!r.satisfies(Variant::V2) && !r.satisfies(Variant::V3));
    assert_eq!(
        failing(&r, Variant::V2),
        ["DMA started", "double-buffered VMEM buffer"]
    );
}

#[test]
fn hlo_upcast_inside_fusion_is_followed_to_the_dot() {
    let r = inspect(&fixture("hlo_upcast_fusion.hlo"));
    assert_eq!(r.format, ProgramFormat::HloText);
    assert_eq!((r.dots, r.native_fp8_dots, r.upcast_dots), (1, 0, 1));

    let dot = check(&r.checks, "native fp8 dot");
    assert!(!dot.ok);
    assert!(
        dot.detail
            .starts_with("upcast to f32 before the dot: convert at line 5 (in fused_computation)"),
        "{}",
        dot.detail
    );
    assert!(dot
        .detail
        .contains("fusion at line 14 feeds dot at line 15"));
    // The convert (inside the fused computation), the fusion, and the dot.
    assert_eq!(lines(dot), [5, 14, 15]);
    assert!(dot.evidence[0]
        .1
        .starts_with("%convert.0 = f32[3,4]{1,0} convert("));

    let fp8 = check(&r.checks, "fp8 operands");
    assert!(fp8.ok && fp8.detail.contains("bitcast from u8"));
    assert_eq!(lines(fp8), [4]);

    // fp8 weights are there (V1), even if the dot does not use them natively.
    assert!(r.satisfies(Variant::V1));
    assert!(!r.satisfies(Variant::V2));
}

#[test]
fn hlo_unbalanced_copies_fail_v2_and_only_for_that() {
    let text = fixture("hlo_async_unbalanced.hlo");
    let r = inspect(&text);
    assert_eq!(
        (r.async_starts, r.async_dones, r.async_balanced),
        (2, 1, false)
    );

    let asyncs = check(&r.checks, "async copies balanced");
    assert!(!asyncs.ok);
    assert!(
        asyncs
            .detail
            .contains("no done/wait for the start(s) at line(s) 8"),
        "{}",
        asyncs.detail
    );
    assert_eq!(lines(asyncs), [7, 8, 9]);

    // S(1) values are found, and the [2, 8, 128] one counts as a VMEM double buffer.
    let spaces = check(&r.checks, "memory spaces");
    assert!(
        spaces.detail.contains("copy-start S(1)"),
        "{}",
        spaces.detail
    );
    let double = check(&r.checks, "double-buffered VMEM");
    assert!(double.ok);
    assert_eq!(lines(double)[0], 7);

    assert!(r.satisfies(Variant::V1));
    assert_eq!(failing(&r, Variant::V2), ["DMA starts and waits balance"]);

    // Completing the second copy is all it takes.
    let fixed = text.replace(
        "  %slice.1",
        "  %copy-done.1 = f32[128,128]{1,0:S(1)} copy-done(%copy-start.1)\n  %slice.1",
    );
    let r = inspect(&fixed);
    assert!(r.async_balanced);
    assert!(r.satisfies(Variant::V2), "{}", r.render(Some(Variant::V2)));
    assert!(!r.satisfies(Variant::V3), "no SMEM in this program");
}

#[test]
fn stablehlo_native_fp8_dot_general() {
    let text = fixture("stablehlo_fp8.mlir");
    let r = inspect(&text);
    assert_eq!(r.format, ProgramFormat::StableHlo);
    assert_eq!((r.dots, r.native_fp8_dots), (1, 1));
    assert_eq!(r.fp8_types, ["f8E4M3FN"]);

    let fp8 = check(&r.checks, "fp8 operands");
    assert!(fp8.detail.contains("bitcast from ui8"), "{}", fp8.detail);
    assert!(fp8.detail.contains("quantized from bf16"), "{}", fp8.detail);
    assert_eq!(&lines(fp8)[..2], [3, 4]);
    assert_eq!(lines(check(&r.checks, "native fp8 dot")), [5]);

    // Plain tensors: no memory space is stated.
    let spaces = check(&r.checks, "memory spaces");
    assert!(!spaces.ok);
    assert_eq!(
        r.buffers
            .iter()
            .map(|b| b.name.as_str())
            .collect::<Vec<_>>(),
        ["arg0", "arg1", "arg2"]
    );

    assert!(r.satisfies(Variant::V1));
    assert!(!r.satisfies(Variant::V2));

    // The same program, upcasting the weight to f32 before the dot.
    let upcast = text
        .replace(
            "    %2 = stablehlo.dot_general %1, %0,",
            "    %w = stablehlo.convert %0 : (tensor<4x3xf8E4M3FN>) -> tensor<4x3xf32>\n    \
             %x = stablehlo.convert %arg0 : (tensor<2x3xbf16>) -> tensor<2x3xf32>\n    \
             %2 = stablehlo.dot_general %x, %w,",
        )
        .replace(
            "(tensor<2x3xf8E4M3FN>, tensor<4x3xf8E4M3FN>) -> tensor<2x4xf32>",
            "(tensor<2x3xf32>, tensor<4x3xf32>) -> tensor<2x4xf32>",
        );
    let r = inspect(&upcast);
    assert_eq!((r.native_fp8_dots, r.upcast_dots), (0, 1));
    let dot = check(&r.checks, "native fp8 dot");
    assert!(!dot.ok);
    assert!(dot
        .detail
        .starts_with("upcast to f32 before the dot: stablehlo.convert at line 5"));
    assert_eq!(lines(dot), [5, 7]);
}

#[test]
fn mosaic_v1_blockspec_kernel() {
    let text = fixture("mosaic_v1_blockspec.mlir");
    let r = inspect(&text);
    assert_eq!(r.format, ProgramFormat::Mosaic);

    // The fp8 block is widened to bf16 in the kernel before tpu.matmul.
    let dot = check(&r.checks, "native fp8 dot");
    assert!(!dot.ok);
    assert!(dot
        .detail
        .starts_with("upcast to bf16 before the dot: arith.extf"));
    assert_eq!(
        lines(dot),
        [
            line_of(&text, "arith.extf", 0),
            line_of(&text, "tpu.matmul", 0)
        ]
    );

    // BlockSpec operands are in VMEM (the pipeline copies them), the last one is scratch.
    let spaces = check(&r.checks, "memory spaces");
    assert!(spaces.ok);
    assert!(
        spaces.detail.starts_with(
            "parameters: arg3 vmem, arg4 vmem, arg5 smem, arg6 vmem; scratch: arg7 vmem"
        ),
        "{}",
        spaces.detail
    );
    assert_eq!(lines(spaces), [2; 5]);
    assert!(spaces.evidence[1]
        .1
        .starts_with("%arg4: memref<128x128xf8E4M3FN, #tpu.memory_space<vmem>>"));

    assert!(r.satisfies(Variant::V1));
    assert_eq!(
        failing(&r, Variant::V2),
        [
            "inputs left in HBM/ANY",
            "DMA started",
            "double-buffered VMEM buffer"
        ]
    );
    assert!(!r.satisfies(Variant::V3));
    let inputs = &r.expectations(Variant::V2)[1];
    assert!(
        inputs.detail.contains("fp8 operand(s) arg4 in VMEM"),
        "{}",
        inputs.detail
    );
}

#[test]
fn mosaic_v2_manual_dma_kernel() {
    let text = fixture("mosaic_v2_manual_dma.mlir");
    let r = inspect(&text);
    assert_eq!(r.format, ProgramFormat::Mosaic);
    // Prologue + in-loop prefetch for x and w, one wait each per step: balanced by semaphore
    // and buffer, although the counts in the text differ.
    assert_eq!(
        (r.async_starts, r.async_dones, r.async_balanced),
        (4, 2, true)
    );

    assert!(r.satisfies(Variant::V1));
    assert!(r.satisfies(Variant::V2), "{}", r.render(Some(Variant::V2)));
    assert_eq!(failing(&r, Variant::V3), ["f32 scales in SMEM"]);

    // Both fp8 arguments of the one-line signature are shown, each with its own text.
    let fp8 = check(&r.checks, "fp8 operands");
    assert!(
        fp8.detail
            .contains("fp8 parameter arg3 at line 2; fp8 scratch arg7 at line 2"),
        "{}",
        fp8.detail
    );
    assert_eq!(
        fp8.evidence[..2],
        [
            (
                2,
                "%arg3: memref<256x512xf8E4M3FN, #tpu.memory_space<any>>".to_string()
            ),
            (
                2,
                "%arg7: memref<2x128x128xf8E4M3FN, #tpu.memory_space<vmem>>".to_string()
            )
        ]
    );

    let exp = r.expectations(Variant::V2);
    let inputs = check(&exp, "inputs left in HBM/ANY");
    assert_eq!(inputs.detail, "arg2, arg3 in HBM/ANY");
    assert_eq!(
        inputs.evidence[1],
        (
            2,
            "%arg3: memref<256x512xf8E4M3FN, #tpu.memory_space<any>>".to_string()
        )
    );
    let started = check(&exp, "DMA started");
    assert_eq!(
        lines(started),
        (0..4)
            .map(|k| line_of(&text, "tpu.enqueue_dma", k))
            .collect::<Vec<_>>()
    );
    let double = check(&exp, "double-buffered VMEM buffer");
    assert!(double
        .detail
        .starts_with("arg6 [2x128x128xbf16], arg7 [2x128x128xf8E4M3FN] in VMEM"));
    let asyncs = check(&r.checks, "async copies balanced");
    assert!(
        asyncs.detail.contains("2 semaphore buffer(s)"),
        "{}",
        asyncs.detail
    );
    assert_eq!(lines(asyncs)[4], line_of(&text, "tpu.wait_dma2", 0));
}

#[test]
fn mosaic_v2_variants_that_must_fail() {
    let text = fixture("mosaic_v2_manual_dma.mlir");

    // Drop the wait for the weight copies: those DMAs are never waited on.
    let no_wait: String = text
        .lines()
        .filter(|l| !(l.contains("tpu.wait_dma2") && l.contains("f8E4M3FN")))
        .map(|l| format!("{l}\n"))
        .collect();
    let r = inspect(&no_wait);
    assert!(!r.async_balanced);
    assert_eq!(failing(&r, Variant::V2), ["DMA starts and waits balance"]);
    let asyncs = check(&r.checks, "async copies balanced");
    let first_w_start = line_of(&no_wait, "tpu.enqueue_dma source(%7", 0);
    assert!(
        asyncs.detail.contains(&format!(
            "no done/wait for the start(s) at line(s) {first_w_start}"
        )),
        "{}",
        asyncs.detail
    );

    // A wait whose copy is never started.
    let no_start: String = text
        .lines()
        .filter(|l| !(l.contains("tpu.enqueue_dma") && l.contains("xbf16")))
        .map(|l| format!("{l}\n"))
        .collect();
    let r = inspect(&no_start);
    assert_eq!(failing(&r, Variant::V2), ["DMA starts and waits balance"]);
    assert!(check(&r.checks, "async copies balanced")
        .detail
        .contains("no start for the done/wait(s)"));

    // The fp8 weight handed over in VMEM: the pipeline copies it, not the kernel.
    let w_in_vmem = text.replacen(
        "%arg3: memref<256x512xf8E4M3FN, #tpu.memory_space<any>>",
        "%arg3: memref<256x512xf8E4M3FN, #tpu.memory_space<vmem>>",
        1,
    );
    let r = inspect(&w_in_vmem);
    assert_eq!(failing(&r, Variant::V2), ["inputs left in HBM/ANY"]);

    // Single-buffered scratch.
    let single = text.replace("memref<2x128x128x", "memref<1x128x128x");
    let r = inspect(&single);
    assert_eq!(failing(&r, Variant::V2), ["double-buffered VMEM buffer"]);
}

#[test]
fn mosaic_v3_smem_scales_kernel() {
    let text = fixture("mosaic_v3_smem_scales.mlir");
    let r = inspect(&text);
    assert_eq!(r.format, ProgramFormat::Mosaic);
    assert_eq!(
        (r.async_starts, r.async_dones, r.async_balanced),
        (6, 3, true)
    );
    for v in [Variant::V1, Variant::V2, Variant::V3] {
        assert!(r.satisfies(v), "{}", r.render(Some(v)));
    }
    let scales = check(&r.checks, "f32 scales in SMEM");
    assert_eq!(scales.detail, "arg8 [2x1x1xf32, double-buffered] in SMEM");
    assert_eq!(
        scales.evidence,
        [(
            2,
            "%arg8: memref<2x1x1xf32, #tpu.memory_space<smem>>".to_string()
        )]
    );
    let scratch: Vec<&str> = r
        .buffers
        .iter()
        .filter(|b| b.role == BufferRole::Scratch)
        .map(|b| b.name.as_str())
        .collect();
    assert_eq!(
        scratch,
        ["arg6", "arg7", "arg8", "arg9", "arg10", "arg11", "arg12"]
    );

    // An i32 table in SMEM (scalar prefetch, say) is not a scale.
    let r = inspect(&text.replace(
        "memref<2x1x1xf32, #tpu.memory_space<smem>>",
        "memref<2x1x1xi32, #tpu.memory_space<smem>>",
    ));
    assert_eq!(failing(&r, Variant::V3), ["f32 scales in SMEM"]);

    // Scales in VMEM instead: v2, not v3.
    let r = inspect(&text.replace(
        "%arg8: memref<2x1x1xf32, #tpu.memory_space<smem>>",
        "%arg8: memref<2x1x1xf32, #tpu.memory_space<vmem>>",
    ));
    assert!(r.satisfies(Variant::V2));
    assert_eq!(failing(&r, Variant::V3), ["f32 scales in SMEM"]);
}

#[test]
fn mosaic_native_fp8_matmul() {
    let text = "module {
  func.func @k(%arg0: memref<128x128xf8E4M3FN, #tpu.memory_space<vmem>>, %arg1: memref<128x128xf8E4M3FN, #tpu.memory_space<vmem>>, %arg2: memref<128x128xf32, #tpu.memory_space<vmem>>) attributes {dimension_semantics = [], scalar_prefetch = 0 : i64, scratch_operands = 0 : i64} {
    %c0 = arith.constant 0 : index
    %0 = vector.load %arg0[%c0, %c0] : memref<128x128xf8E4M3FN, #tpu.memory_space<vmem>>, vector<128x128xf8E4M3FN>
    %1 = vector.load %arg1[%c0, %c0] : memref<128x128xf8E4M3FN, #tpu.memory_space<vmem>>, vector<128x128xf8E4M3FN>
    %cst = arith.constant dense<0.000000e+00> : vector<128x128xf32>
    %2 = tpu.matmul %0, %1, %cst {dimension_numbers = #tpu.dot_dimension_numbers<[1], [0], [0], [1], [0, 0, 1, 1], [], []>} : vector<128x128xf8E4M3FN>, vector<128x128xf8E4M3FN>, vector<128x128xf32> -> vector<128x128xf32>
    tpu.vector_store %arg2[%c0, %c0], %2 {strides = array<i32>} : memref<128x128xf32, #tpu.memory_space<vmem>>, vector<128x128xf32>,
    return
  }
}";
    let r = inspect(text);
    assert_eq!(r.format, ProgramFormat::Mosaic);
    assert_eq!((r.native_fp8_dots, r.upcast_dots), (1, 0));
    assert_eq!(lines(check(&r.checks, "native fp8 dot")), [7]);
}

#[test]
fn mosaic_signature_over_many_lines_with_comments() {
    // One argument per line, with comments, as people write kernels by hand.
    let text = fixture("mosaic_v2_manual_dma.mlir");
    let mut lines: Vec<String> = text.lines().map(str::to_string).collect();
    let sig = lines[1]
        .replace("(%arg", "(\n      %arg")
        .replace(", %arg", ", // operand\n      %arg")
        .replace(") attributes", "\n    ) attributes");
    lines[1] = sig;
    let text = lines.join("\n");
    let r = inspect(&text);
    assert!(r.satisfies(Variant::V2), "{}", r.render(Some(Variant::V2)));
    let arg7 = r.buffers.iter().find(|b| b.name == "arg7").unwrap();
    assert_eq!(arg7.role, BufferRole::Scratch);
    assert_eq!(
        arg7.evidence,
        (
            10,
            "%arg7: memref<2x128x128xf8E4M3FN, #tpu.memory_space<vmem>>".to_string()
        )
    );
    assert_eq!(line_of(&text, "%arg7: memref", 0), 10);
}

#[test]
fn pallas_call_inside_stablehlo_points_to_the_mosaic_dump() {
    let text = r#"module @jit_f {
  func.func public @main(%arg0: tensor<8x128xbf16>, %arg1: tensor<128x128xui8>) -> tensor<8x128xbf16> {
    %0 = stablehlo.custom_call @tpu_custom_call(%arg0, %arg1) {backend_config = "{\22custom_call_config\22: {\22body\22: \22TUxJUgA=\22}}", kernel_name = "fp8_linear_v2_kernel"} : (tensor<8x128xbf16>, tensor<128x128xui8>) -> tensor<8x128xbf16>
    return %0 : tensor<8x128xbf16>
  }
}"#;
    let r = inspect(text);
    assert_eq!(r.format, ProgramFormat::StableHlo);
    assert_eq!(r.dots, 0);
    let dot = check(&r.checks, "native fp8 dot");
    assert!(
        dot.detail
            .contains("1 tpu_custom_call(s) (first at line 3)"),
        "{}",
        dot.detail
    );
    assert_eq!(lines(dot), [3]);
    assert!(!r.satisfies(Variant::V1), "no fp8 type in this text");
}

#[test]
fn fp8_in_names_is_not_an_fp8_type() {
    let text = "module {
  func.func @kernel_f8e4m3fn(%w_f8e4m3fn: tensor<2xf32>) -> tensor<2xf32> {
    %f8e4m3fn_x = stablehlo.add %w_f8e4m3fn, %w_f8e4m3fn : tensor<2xf32>
    %x2f8e4m3fn = stablehlo.add %f8e4m3fn_x, %f8e4m3fn_x : tensor<2xf32>
    return %x2f8e4m3fn : tensor<2xf32>
  }
}";
    let r = inspect(text);
    assert_eq!(r.format, ProgramFormat::StableHlo);
    assert!(r.fp8_types.is_empty(), "{:?}", r.fp8_types);
    assert!(!check(&r.checks, "fp8 operands").ok);
    assert!(!r.satisfies(Variant::V1));
    // while a real type right after a shape is one
    let r = inspect(&text.replace("tensor<2xf32>", "tensor<2xf8E5M2>"));
    assert_eq!(r.fp8_types, ["f8E5M2"]);
}

#[test]
fn evidence_is_short_and_points_into_the_program() {
    for name in ALL {
        let text = fixture(name);
        let n = text.lines().count();
        let r = inspect(&text);
        assert_ne!(r.format, ProgramFormat::Unknown, "{name}");
        assert_eq!(r.lines, n);
        let all = [Variant::V1, Variant::V2, Variant::V3]
            .iter()
            .flat_map(|&v| r.expectations(v))
            .chain(r.checks.iter().cloned());
        for c in all {
            for (line, ev) in &c.evidence {
                assert!((1..=n).contains(line), "{name}: {c:?}");
                assert!(ev.chars().count() <= 160, "{name}: {ev}");
                // The text is (a piece of) that line, whitespace collapsed.
                let src: String = text
                    .lines()
                    .nth(line - 1)
                    .unwrap()
                    .split_whitespace()
                    .collect::<Vec<_>>()
                    .join(" ");
                let ev = ev.trim_end_matches('…');
                assert!(src.contains(ev), "{name}:{line}: `{ev}` not in `{src}`");
            }
        }
    }
}

#[test]
fn render_marks_each_line_and_gives_a_verdict() {
    let r = inspect(&fixture("mosaic_v2_manual_dma.mlir"));
    let text = r.render(Some(Variant::V3));
    assert!(text.starts_with("Mosaic TPU MLIR (89 lines)\n"), "{text}");
    assert!(text.contains("\n[ok]   fp8 operands: f8E4M3FN on "));
    assert!(text.contains("\n[FAIL] f32 scales in SMEM: no f32 buffer in SMEM\n"));
    assert!(text.contains("\nexpectations for v3:\n"));
    assert!(text.contains("\n[ok]   DMA started: 4 async copy/DMA start(s)\n"));
    assert!(
        text.contains("\n         L2: %arg6: memref<2x128x128xbf16, #tpu.memory_space<vmem>>\n")
    );
    assert!(text.ends_with("=> does NOT satisfy v3: 1 of 6 expectations fail\n"));
    assert!(r.render(Some(Variant::V2)).ends_with("=> satisfies v2\n"));
    let facts = r.render(None);
    assert!(!facts.contains("expectations") && !facts.contains("=>"));
    assert_eq!(
        facts.lines().filter(|l| l.starts_with('[')).count(),
        r.checks.len()
    );
}

#[test]
fn variant_parses_case_insensitively_with_a_clear_error() {
    assert_eq!("v1".parse(), Ok(Variant::V1));
    assert_eq!("V2".parse(), Ok(Variant::V2));
    assert_eq!(" v3 ".parse(), Ok(Variant::V3));
    let err = "v4".parse::<Variant>().unwrap_err().to_string();
    assert_eq!(
        err,
        "unknown TPU fp8 kernel variant `v4`: expected v1, v2 or v3"
    );
    assert!("".parse::<Variant>().is_err());
    assert_eq!(Variant::V2.to_string(), "v2");
}

fn assert_nothing_satisfied(r: &Report, what: &str) {
    for v in [Variant::V1, Variant::V2, Variant::V3] {
        assert!(!r.satisfies(v), "{what}: {}", r.render(Some(v)));
    }
}

#[test]
fn empty_and_garbage_input() {
    let r = inspect("");
    assert_eq!(r.format, ProgramFormat::Unknown);
    assert_eq!(r.checks.len(), 1);
    assert_eq!(r.checks[0].detail, "empty input");
    assert_nothing_satisfied(&r, "empty");

    let garbage = [
        "   \n\t\n",
        "hello world",
        "a = b c(d)",
        "\u{0}\u{1}\u{7f}\u{fffd}ÿ日本語 %x = ((( f8e4m3fn",
        "}}}}>>>)))]]]",
        "<<<<((((",
        "\"unterminated string f8E4M3FN",
        "/* never closed",
    ];
    for g in garbage {
        let r = inspect(g);
        assert_eq!(r.format, ProgramFormat::Unknown, "{g:?}");
        assert_nothing_satisfied(&r, g);
        assert!(r.render(Some(Variant::V1)).contains("[FAIL] program: "));
    }

    // Recognized, but broken: still no panic and nothing proven.
    let broken = [
        "HloModule x\n%a = f32[2 dot(((",
        "HloModule x\nENTRY %m {\n ROOT %d = f32[2]{0} dot(%d, %d)\n}",
        "HloModule x\n%c = (f32[2]{0:S(1)}, u32[]) copy-start(%c)\n%d = f32[2] copy-done(%d)",
        "module {\n func.func @k(%arg0: memref<2x",
        "module {\n func.func @k(%arg0 memref<>, %: , %arg1: memref<2x?x>) {\n %0 = tpu.matmul %0, %0 : -> \n}",
        "func.func @f(\n",
        "%0 = stablehlo.dot_general %a, %b : (tensor<2x",
        "tpu.enqueue_dma target_semaphore( target( \"tpu.wait_dma\"()",
    ];
    for b in broken {
        let r = inspect(b);
        assert_nothing_satisfied(&r, b);
        let _ = r.render(Some(Variant::V3));
    }
}

#[test]
fn truncated_and_mangled_fixtures_never_panic() {
    for name in ALL {
        let text = fixture(name);
        let cuts = (0..text.len())
            .step_by(17)
            .filter(|&i| text.is_char_boundary(i));
        for cut in cuts {
            let r = inspect(&text[..cut]);
            let _ = r.render(Some(Variant::V3));
        }
        // Remove one kind of bracket or quote at a time.
        for c in ['(', ')', '<', '>', '{', '}', '[', ']', '"', '%', ':', ','] {
            let mangled: String = text.chars().filter(|&x| x != c).collect();
            let r = inspect(&mangled);
            let _ = r.render(Some(Variant::V3));
        }
    }
    assert_eq!(inspect(&"x".repeat(1 << 20)).format, ProgramFormat::Unknown);
    let nested = format!(
        "HloModule d\n%a = {}f32[1]{{0}}{} tuple(%b)",
        "(".repeat(100_000),
        ")".repeat(100_000)
    );
    let _ = inspect(&nested).render(None);
    let long_sig = format!("func.func @f(\n{}", "%a: memref<2xf32>,\n".repeat(100_000));
    let _ = inspect(&long_sig).render(None);
    let deep = format!(
        "HloModule d\n%a = f32[1]{{0}} add({}%b{})",
        "(".repeat(5000),
        ")".repeat(5000)
    );
    let _ = inspect(&deep).render(None);
}

/// Random soup of the tokens the parsers react to, seeded so a failure replays.
#[test]
fn random_token_soup_never_panics() {
    const TOKENS: [&str; 48] = [
        "(",
        ")",
        "<",
        ">",
        "{",
        "}",
        "[",
        "]",
        "\"",
        "%",
        "@",
        ":",
        ",",
        " = ",
        "x",
        "2x",
        "?x",
        "f8E4M3FN",
        "f8e4m3fn",
        "€",
        "é",
        "\n",
        "tpu.enqueue_dma ",
        "tpu.wait_dma2 ",
        "copy-start",
        "copy-done",
        "ROOT ",
        "HloModule ",
        "func.func ",
        "memref<",
        "#tpu.memory_space<smem>",
        "S(1)",
        "->",
        " to ",
        "/*",
        "//",
        "target(",
        "semaphore(",
        "calls=",
        "parameter(0)",
        "dot(",
        "tpu.matmul ",
        "arith.extf ",
        "convert(",
        "ENTRY ",
        "scratch_operands = 1",
        "u8[2,3]{1,0:S(1)}",
        "%arg0: ",
    ];
    let mut state: u64 = 0x9e37_79b9_7f4a_7c15;
    let mut next = |n: usize| {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        (state % n as u64) as usize
    };
    for case in 0..3000 {
        let len = next(120);
        let text: String = (0..len).map(|_| TOKENS[next(TOKENS.len())]).collect();
        let r = std::panic::catch_unwind(|| inspect(&text).render(Some(Variant::V3)));
        assert!(r.is_ok(), "case {case} panicked on {text:?}");
    }
}
