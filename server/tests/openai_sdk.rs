//! The official OpenAI Python SDK against a running `hearth serve` on the default model
//! (clients/openai_sdk.py holds the checks). Needs `python3 -m pip install openai`, which
//! scripts/setup.sh does.

use std::io::{BufRead, BufReader};
use std::path::PathBuf;
use std::process::{Command, Stdio};

#[test]
fn the_openai_python_sdk_works_unchanged() {
    let has_sdk = Command::new("python3").args(["-c", "import openai, pydantic"]).status().is_ok_and(|s| s.success());
    assert!(has_sdk, "the `openai` Python package is missing: run scripts/setup.sh (or python3 -m pip install openai)");
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../models");
    let model = engine::default_model::ensure_default_model(&dir).unwrap();
    let mut server = Command::new(env!("CARGO_BIN_EXE_hearth"))
        .args(["serve", "--port", "0", "--threads", "2", "--ctx-size", "1024", "--parallel", "2", "--api-key", "test-key"])
        .arg("--model")
        .arg(&model)
        .env("HEARTH_LOG", "info")
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut lines = BufReader::new(server.stderr.take().unwrap()).lines();
    let addr = loop {
        let line = lines.next().expect("server exited early").unwrap();
        if let Some(rest) = line.split("listening on ").nth(1) {
            break rest.trim().to_string();
        }
    };
    // Keep draining the log so the server never blocks on a full pipe.
    std::thread::spawn(move || for _ in lines {});
    let script = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/clients/openai_sdk.py");
    let out = Command::new("python3").arg(script).arg(&addr).arg("test-key").output().unwrap();
    let _ = server.kill();
    let _ = server.wait();
    assert!(out.status.success(), "stdout:\n{}\nstderr:\n{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    assert!(String::from_utf8_lossy(&out.stdout).contains("all checks passed"));
}
