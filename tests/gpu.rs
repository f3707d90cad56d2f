//! GPU layers in whole processes (a GPU build: `--features hearth/vulkan`, `cuda` or
//! `metal`): a single node and a ring of real processes with some layers of their windows
//! on the accelerator answer as the CPU-only run does, `/admin/plan` and the metrics say
//! which layers the plan put there, and `hearth profile` reports the device. Without an
//! accelerator in this build the tests only say so, unless `HEARTH_REQUIRE_ACCELERATOR` is
//! set (CI's Vulkan run on Mesa's lavapipe sets it).

mod common;

use common::Served;
use serde_json::Value;

const TOKENS: usize = 16;
/// Where a greedy text on the accelerator parts from the CPU's, the CPU's token must be a
/// near-tie there: among the accelerator's 5 most likely, at most this many nats below
/// its choice. The accelerator's kernels round differently (other accumulation orders,
/// F16 intermediates; measured in engine/tests/accelerator.rs), which decides near-ties
/// and nothing else.
const NEAR_TIE_NATS: f64 = 1.0;
const ADMIN: &str = "gpu-test";

fn has_accelerator() -> bool {
    let some = !engine::accelerators().is_empty();
    if !some {
        assert!(std::env::var_os("HEARTH_REQUIRE_ACCELERATOR").is_none(), "HEARTH_REQUIRE_ACCELERATOR is set, but this build sees no accelerator");
        eprintln!("no accelerator in this build: nothing to test");
    }
    some
}

/// A greedy completion of real text: its tokens, their logprobs and the top 5 at each step.
struct Completion {
    tokens: Vec<String>,
    logprobs: Vec<f64>,
    top: Vec<serde_json::Map<String, Value>>,
}

fn complete(addr: &str) -> Completion {
    let text = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/../docs/scheduler.md")).unwrap();
    let prompt: String = text.chars().take(400).collect();
    let body = serde_json::json!({"model": "", "prompt": prompt, "max_tokens": TOKENS, "temperature": 0, "logprobs": 5}).to_string();
    let r = common::http(addr, "POST", "/v1/completions", "", &body).unwrap();
    assert_eq!(r.status, 200, "{}", r.body);
    let v: Value = serde_json::from_str(&r.body).unwrap();
    let lp = &v["choices"][0]["logprobs"];
    Completion {
        tokens: lp["tokens"].as_array().unwrap().iter().map(|t| t.as_str().unwrap().to_string()).collect(),
        logprobs: lp["token_logprobs"].as_array().unwrap().iter().map(|x| x.as_f64().unwrap()).collect(),
        top: lp["top_logprobs"].as_array().unwrap().iter().map(|m| m.as_object().unwrap().clone()).collect(),
    }
}

/// Asserts `got` (accelerator) equals `cpu` up to a step where the CPU's token is a
/// near-tie for the accelerator; the tokens in common.
fn assert_same_or_near_tie(what: &str, got: &Completion, cpu: &Completion) -> usize {
    let same = got.tokens.iter().zip(&cpu.tokens).take_while(|(a, b)| a == b).count();
    eprintln!("{what}: greedy tokens equal to the CPU's for {same} of {}", cpu.tokens.len());
    if same < cpu.tokens.len() {
        let theirs = &cpu.tokens[same];
        let gap = got.top[same].get(theirs).and_then(Value::as_f64).map(|lp| got.logprobs[same] - lp);
        eprintln!("  step {same}: accelerator chose {:?}, CPU {theirs:?}, {gap:?} nats apart on the accelerator", got.tokens[same]);
        assert!(gap.is_some_and(|g| g <= NEAR_TIE_NATS), "{what}: parted from the CPU at step {same} where the CPU's token was no near-tie ({gap:?} nats)");
    }
    same
}

fn admin(addr: &str, path: &str) -> String {
    let r = common::http(addr, "GET", path, &format!("Authorization: Bearer {ADMIN}\r\n"), "").unwrap();
    assert_eq!(r.status, 200, "{}", r.body);
    r.body
}

#[test]
fn gpu_layers_on_a_single_node_and_in_a_ring_answer_as_the_cpu_does() {
    if !has_accelerator() {
        return;
    }
    let cpu = Served::start(&["--threads", "1", "--gpu-layers", "0"]);
    let expected = complete(&cpu.addr);
    drop(cpu);
    // Every layer, and a third, on one node.
    for n in ["30", "10"] {
        let node = Served::start(&["--threads", "1", "--gpu-layers", n]);
        assert_same_or_near_tie(&format!("single node, {n} layers on the accelerator"), &complete(&node.addr), &expected);
    }
    // A ring of real processes: the head and the first worker put the first 4 layers of
    // each window on their accelerator (k = 2: windows of 5 split GPU/CPU), the second
    // worker computes on its CPU.
    let w1 = Served::worker(&["--threads", "1", "--gpu-layers", "4"]);
    let w2 = Served::worker(&["--threads", "1", "--gpu-layers", "0"]);
    let workers = format!("{},{}", w1.addr, w2.addr);
    let head = Served::start(&["--threads", "1", "--workers", &workers, "--windows", "5,5,5", "--gpu-layers", "4", "--admin-key", ADMIN]);
    assert_same_or_near_tie("ring 5,5,5 (k = 2), 4 layers of each head and first-worker window on the accelerator", &complete(&head.addr), &expected);
    // The plan says where the head's layers ran (8 of its 10: 4 of each window); the
    // metrics carry the same.
    let plan: Value = serde_json::from_str(&admin(&head.addr, "/admin/plan")).unwrap();
    assert_eq!(plan["members"][0]["gpu_layers"], 4, "{plan}");
    let metrics = common::http(&head.addr, "GET", "/metrics", "", "").unwrap().body;
    assert!(metrics.lines().any(|l| l.starts_with("hearth_device_gpu_layers{device=\"head\"} 8")), "{}", metrics.lines().filter(|l| l.contains("gpu_layers")).collect::<Vec<_>>().join("\n"));
}

#[test]
fn hearth_profile_reports_the_accelerator() {
    if !has_accelerator() {
        return;
    }
    let cache = std::env::temp_dir().join(format!("hearth-gpu-profile-{}", std::process::id()));
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_hearth-under-test")).args(["profile", "--json", "--threads", "1"]).env("XDG_CACHE_HOME", &cache).output().unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let p: Value = serde_json::from_slice(&out.stdout).unwrap();
    let gpu = &p["gpu"];
    eprintln!("{gpu}");
    assert!(gpu["read_bw"].as_f64().unwrap() > 0.0 && gpu["flops"]["q4_1"].as_f64().unwrap() > 0.0, "{gpu}");
    assert!(gpu["ram_to_vram_s"].as_f64().is_some() && gpu["kv_copy_s"].as_f64().unwrap() > 0.0, "{gpu}");
    let table = std::process::Command::new(env!("CARGO_BIN_EXE_hearth-under-test")).args(["profile", "--threads", "1"]).env("XDG_CACHE_HOME", &cache).output().unwrap();
    let table = String::from_utf8_lossy(&table.stdout);
    assert!(table.contains("accelerator ") && table.contains("GPU matrix x vector, Q4_1"), "{table}");
    std::fs::remove_dir_all(&cache).ok();
}
