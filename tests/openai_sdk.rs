//! The official OpenAI Python SDK against a running `hearth serve` on the default model
//! (clients/openai_sdk.py holds the checks). Needs `python3 -m pip install openai`, which
//! scripts/setup.sh does.

mod common;

use std::path::PathBuf;
use std::process::Command;

#[test]
fn the_openai_python_sdk_works_unchanged() {
    let has_sdk = Command::new("python3").args(["-c", "import openai, pydantic"]).status().is_ok_and(|s| s.success());
    assert!(has_sdk, "the `openai` Python package is missing: run scripts/setup.sh (or python3 -m pip install openai)");
    let server = common::Served::start(&["--threads", "2", "--ctx-size", "1024", "--parallel", "2", "--api-key", "test-key"]);
    let script = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("clients/openai_sdk.py");
    let out = Command::new("python3").arg(script).arg(format!("http://{}", server.addr)).arg("test-key").output().unwrap();
    assert!(out.status.success(), "stdout:\n{}\nstderr:\n{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    assert!(String::from_utf8_lossy(&out.stdout).contains("all checks passed"));
}
