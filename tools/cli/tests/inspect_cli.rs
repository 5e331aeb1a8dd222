//! The `fp8nsa inspect` command on the inspector's own test programs.

/// `fp8nsa inspect`: the checklist on stdout, the exit status from `--expect`.
#[test]
fn cli_exit_status_follows_the_expectations() {
    let run = |args: &[&str]| {
        let out = std::process::Command::new(env!("CARGO_BIN_EXE_fp8nsa"))
            .arg("inspect")
            .args(args)
            .output()
            .unwrap();
        (
            out.status.code(),
            String::from_utf8_lossy(&out.stdout).into_owned(),
        )
    };
    let dir = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../inspect/tests/data/inspect/"
    );
    let v2 = format!("{dir}mosaic_v2_manual_dma.mlir");
    let (code, out) = run(&[&v2, "--expect", "v2"]);
    assert_eq!(code, Some(0), "{out}");
    assert!(out.contains("satisfies v2"), "{out}");
    assert_eq!(run(&[&v2, "--expect", "v3"]).0, Some(1));
    assert_eq!(run(&[&v2]).0, Some(0));
    assert_eq!(run(&[&v2, "--expect", "v9"]).0, Some(2));
    assert_eq!(run(&["/nonexistent/program.mlir"]).0, Some(2));
}
