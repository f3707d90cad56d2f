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
    complete_chars(addr, 400)
}

/// The same of the first `chars` characters of docs/scheduler.md.
fn complete_chars(addr: &str, chars: usize) -> Completion {
    let text = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/../docs/scheduler.md")).unwrap();
    let prompt: String = text.chars().take(chars).collect();
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

/// How long a request beside others may take on lavapipe, a device that runs on this
/// machine's CPU: the long prompt beside three others took over 120 s in a CI run (the
/// batch limit keeps its chunks to about 20 tokens there).
const LAVAPIPE_REQUEST_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(600);

/// Four requests at once, as users send them: a streamed chat, a long prompt (over 1,000
/// tokens: chunked prefill on the device), a sampled completion and a 10-turn conversation.
/// Each must complete with what it asked for.
fn concurrent_mixed(addr: &str) {
    let text = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/../docs/scheduler.md")).unwrap();
    let long: String = text.chars().take(LONG_CHARS).collect();
    let mut turns = Vec::new();
    for i in 0..10 {
        turns.push(serde_json::json!({"role": "user", "content": format!("Question {i}: what does line {i} of the plan say?")}));
        turns.push(serde_json::json!({"role": "assistant", "content": format!("Line {i} says the ring has {i} members.")}));
    }
    turns.push(serde_json::json!({"role": "user", "content": "And the last line?"}));
    let requests = [
        ("/v1/chat/completions", serde_json::json!({"model": "", "messages": [{"role": "user", "content": "Name three rivers."}], "max_tokens": 24, "stream": true})),
        ("/v1/completions", serde_json::json!({"model": "", "prompt": long, "max_tokens": 8, "temperature": 0})),
        ("/v1/completions", serde_json::json!({"model": "", "prompt": "The capital of France is", "max_tokens": 12, "temperature": 0.7, "seed": 3})),
        ("/v1/chat/completions", serde_json::json!({"model": "", "messages": turns, "max_tokens": 16})),
    ];
    let handles: Vec<_> = requests
        .into_iter()
        .map(|(path, body)| {
            let addr = addr.to_string();
            std::thread::spawn(move || (path, common::http_within(&addr, "POST", path, "", &body.to_string(), LAVAPIPE_REQUEST_TIMEOUT).unwrap()))
        })
        .collect();
    for (i, h) in handles.into_iter().enumerate() {
        let (path, r) = h.join().unwrap();
        assert_eq!(r.status, 200, "{path}: {}", r.body);
        if i == 0 {
            assert!(r.body.contains("data: [DONE]") && r.body.contains("finish_reason\":\""), "{path}: {}", r.body);
        } else {
            let v: Value = serde_json::from_str(&r.body).unwrap();
            assert!(v["usage"]["completion_tokens"].as_u64().unwrap() > 0, "{path}: {v}");
            if i == 1 {
                assert!(v["usage"]["prompt_tokens"].as_u64().unwrap() > 1000, "the long prompt: {}", v["usage"]);
            }
        }
    }
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
    // Every layer and the output layer (one more than the 30 layers), and a third, on one
    // node.
    for n in ["31", "10"] {
        let node = Served::start(&["--threads", "1", "--gpu-layers", n]);
        assert_same_or_near_tie(&format!("single node, {n} layers on the accelerator"), &complete(&node.addr), &expected);
    }
    // A ring of real processes (k = 2: two windows of 5 layers each): the head puts all of
    // its windows and the output layer on its accelerator (6, more than a window's layers),
    // the first worker the first 4 layers of each window (split GPU/CPU), the second
    // worker computes on its CPU.
    let w1 = Served::worker(&["--threads", "1", "--gpu-layers", "4"]);
    let w2 = Served::worker(&["--threads", "1", "--gpu-layers", "0"]);
    let workers = format!("{},{}", w1.addr, w2.addr);
    let head = Served::start(&["--threads", "1", "--workers", &workers, "--windows", "5,5,5", "--gpu-layers", "6", "--admin-key", ADMIN]);
    assert_same_or_near_tie("ring 5,5,5 (k = 2), the head's windows and output layer and 4 layers of each first-worker window on the accelerator", &complete(&head.addr), &expected);
    // The plan says where the head's layers ran (all 10: 5 of each window); the metrics
    // carry the same.
    let plan: Value = serde_json::from_str(&admin(&head.addr, "/admin/plan")).unwrap();
    assert_eq!(plan["members"][0]["gpu_layers"], 5, "{plan}");
    let metrics = common::http(&head.addr, "GET", "/metrics", "", "").unwrap().body;
    assert!(metrics.lines().any(|l| l.starts_with("hearth_device_gpu_layers{device=\"head\"} 10")), "{}", metrics.lines().filter(|l| l.contains("gpu_layers")).collect::<Vec<_>>().join("\n"));
}

/// Characters of docs/scheduler.md in the long prompt: over 1,000 tokens (past the 512 of
/// one batch: chunked prefill). lavapipe runs a long prompt slowly (1,903 tokens with
/// every layer of the default model there: 226 s), so not much longer.
const LONG_CHARS: usize = 3200;

/// Most tokens per batch in the MoE tests. Mesa 22.3's lavapipe crashes inside the driver
/// running ggml's expert kernels (`MUL_MAT_ID`; gdb: SIGSEGV in a libvulkan_lvp thread,
/// in llama.cpp too: engine/tests/accelerator.rs), so no expert may run there: every GPU
/// layer keeps its experts in RAM, and batches stay under the 32 tokens from which ggml
/// offloads ops on CPU-resident weights to the device (long prompts go in many chunks).
const LAVAPIPE_SAFE_BATCH: &str = "24";

/// A tiny random qwen3moe of 6 layers (32 experts of 64, 2 per token: the experts are
/// most of a layer's bytes, as in real MoE models) in `dir`.
fn tiny_moe(dir: &std::path::Path) -> std::path::PathBuf {
    std::fs::create_dir_all(dir).unwrap();
    let mut m = engine::random_model::RandomModel::new("qwen3moe", 6, 64, 128, 4, 2);
    m.n_ff_exp = 64;
    m.n_expert = 32;
    m.seed = 11;
    let path = dir.join("qwen3moe.gguf");
    m.write(&common::default_model(), &path).unwrap();
    path
}

/// MoE with one GPU in whole processes: a tiny random qwen3moe with every layer's
/// attention, norms and router on the accelerator and the routed experts of some or all
/// of them in RAM, on one node and in a ring whose members override the plan with their
/// own `--gpu-layers` / `--experts-in-ram`: the CPU's greedy text up to near-ties, for a
/// short prompt and one of over 1,000 tokens (chunked prefill through the devices); and
/// `/admin/plan` and the metrics say what each member placed, and what the plan said.
/// The single node then serves the long prompt beside three other requests.
#[test]
fn experts_in_ram_on_a_single_node_and_in_a_ring_answer_as_the_cpu_does() {
    if !has_accelerator() {
        return;
    }
    let dir = std::env::temp_dir().join(format!("hearth-gpu-moe-{}", std::process::id()));
    let path = tiny_moe(&dir);
    let cpu = Served::start_model(&path, &["--threads", "1", "--gpu-layers", "0", "--ctx-size", "2048"]);
    let (expected, expected_long) = (complete(&cpu.addr), complete_chars(&cpu.addr, LONG_CHARS));
    drop(cpu);
    let node = Served::start_model(&path, &["--threads", "1", "--gpu-layers", "6", "--experts-in-ram", "6", "--ctx-size", "2048", "--max-batch", LAVAPIPE_SAFE_BATCH]);
    let what = "single node, 6 layers on the accelerator, their experts in RAM";
    assert_same_or_near_tie(what, &complete(&node.addr), &expected);
    // Before the concurrent requests: without it (to save CI a minute) the node died
    // inside lavapipe in 3 runs of 4 as the four requests arrived together.
    assert_same_or_near_tie(&format!("{what}, a prompt of over 1,000 tokens"), &complete_chars(&node.addr, LONG_CHARS), &expected_long);
    concurrent_mixed(&node.addr);
    drop(node);
    // The plan (`--windows 2,2,2`) puts nothing on the workers' GPUs; the first worker
    // overrides it with both layers of its window there and their experts in RAM.
    let w1 = Served::worker_at("127.0.0.1:0", &path, &["--threads", "1", "--gpu-layers", "2", "--experts-in-ram", "2"]).unwrap();
    let w2 = Served::worker_at("127.0.0.1:0", &path, &["--threads", "1", "--gpu-layers", "0"]).unwrap();
    let workers = format!("{},{}", w1.addr, w2.addr);
    let head = Served::start_model(&path, &["--threads", "1", "--ctx-size", "2048", "--max-batch", LAVAPIPE_SAFE_BATCH, "--workers", &workers, "--windows", "2,2,2", "--gpu-layers", "2", "--n-cpu-moe", "2", "--admin-key", ADMIN]);
    assert_same_or_near_tie("ring 2,2,2: head and first worker with 2 GPU layers each, their experts in RAM", &complete(&head.addr), &expected);
    assert_same_or_near_tie("the same ring, a prompt of over 1,000 tokens", &complete_chars(&head.addr, LONG_CHARS), &expected_long);
    let plan: Value = serde_json::from_str(&admin(&head.addr, "/admin/plan")).unwrap();
    let member = |i: usize, key: &str| plan["members"][i][key].clone();
    assert_eq!((member(0, "gpu_layers"), member(0, "experts_in_ram")), (2.into(), 2.into()), "{plan}");
    assert_eq!((member(1, "gpu_layers"), member(1, "experts_in_ram")), (2.into(), 2.into()), "{plan}");
    assert_eq!((member(1, "planned_gpu_layers"), member(1, "planned_experts_in_ram")), (0.into(), 0.into()), "{plan}");
    assert_eq!((member(2, "gpu_layers"), member(2, "planned_gpu_layers")), (0.into(), Value::Null), "{plan}");
    let metrics = common::http(&head.addr, "GET", "/metrics", "", "").unwrap().body;
    for (device, layers) in [("head", 2), (w1.addr.as_str(), 2), (w2.addr.as_str(), 0)] {
        assert_experts_in_ram_metric(&metrics, device, layers);
    }
    std::fs::remove_dir_all(&dir).ok();
}

/// `hearth_device_experts_in_ram_layers{device}` is `layers`.
fn assert_experts_in_ram_metric(metrics: &str, device: &str, layers: usize) {
    let want = format!("hearth_device_experts_in_ram_layers{{device=\"{device}\"}} {layers}");
    assert!(metrics.lines().any(|l| l == want), "{want} missing:\n{}", metrics.lines().filter(|l| l.contains("experts_in_ram")).collect::<Vec<_>>().join("\n"));
}

/// Plan to placement: Halda, given device profiles whose GPU is worth using (lavapipe's
/// own is ~100x slower than this CPU, so Halda rightly gives it nothing; the test makes
/// the cached profile's GPU a thousand times faster in rates and latencies, and its
/// memory a GPU's that holds no whole MoE layer but every layer's dense part), plans GPU
/// layers and experts in RAM for the ring's members; each places what the plan says on
/// the device, the answers are the CPU's up to near-ties, and `/admin/plan` and the
/// metrics agree.
#[test]
fn halda_plans_experts_in_ram_from_gpu_profiles_and_every_member_places_them() {
    if !has_accelerator() {
        return;
    }
    let dir = std::env::temp_dir().join(format!("hearth-gpu-halda-{}", std::process::id()));
    let path = tiny_moe(&dir);
    // A short context, so that the KV cache is small beside the experts as with real models.
    const CTX: &str = "256";
    let cache = dir.join("cache");
    let env = [("XDG_CACHE_HOME", cache.as_os_str())];
    let exe = env!("CARGO_BIN_EXE_hearth-under-test");
    // Every process here has the same cache key (threads, model, machine): one profile.
    let out = std::process::Command::new(exe).args(["profile", "--json", "--threads", "1", "--model"]).arg(&path).envs(env).output().unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let profile: Value = serde_json::from_slice(&out.stdout).unwrap();
    let devices = dir.join("devices.json");
    std::fs::write(&devices, serde_json::to_string(&[&profile]).unwrap()).unwrap();
    let out = std::process::Command::new(exe).args(["plan", "--json", "--ctx-size", CTX, "--devices"]).arg(&devices).arg("--model").arg(&path).output().unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let model = serde_json::from_slice::<Value>(&out.stdout).unwrap()["model"].clone();
    let f = |v: &Value| v.as_f64().unwrap();
    let kv = 2.0 * f(&model["n_head_k"]) * f(&model["head_dim_k"]) * 2.0 * f(&model["n_kv"]);
    let (whole, experts) = (f(&model["layer_bytes"]) + kv, f(&model["moe"]["expert_bytes"]));
    // Room for every layer's dense part and a quarter of a layer's experts: no whole layer
    // fits, so every GPU layer keeps its experts in RAM (lavapipe crashes in ggml's expert
    // kernels for small batches: engine/tests/accelerator.rs).
    let room = f(&model["compute_buffer_gpu"]) + 6.0 * (whole - experts) + 0.25 * experts;
    assert!(room < f(&model["compute_buffer_gpu"]) + 2.0 * whole, "the tiny model's experts must dominate its layers");
    let file = cache.join("hearth/device-profile.json");
    let mut entries: Value = serde_json::from_str(&std::fs::read_to_string(&file).unwrap()).unwrap();
    for e in entries.as_array_mut().unwrap() {
        let gpu = &mut e["profile"]["gpu"];
        for (_, r) in gpu["flops"].as_object_mut().unwrap().iter_mut().filter(|(k, _)| *k != "other") {
            *r = (f(r) * 1e3).into();
        }
        gpu["read_bw"] = (f(&gpu["read_bw"]) * 1e3).into();
        // And its latencies (lavapipe's KV write and device-to-host copy take ~55 µs).
        for key in ["kv_copy_s", "ram_to_vram_s", "vram_to_ram_s"] {
            gpu[key] = (f(&gpu[key]) / 1e3).into();
        }
        gpu["memory_available"] = room.into();
        // A discrete GPU (lavapipe may call itself integrated: its memory is the host's).
        gpu["uma"] = false.into();
    }
    std::fs::write(&file, entries.to_string()).unwrap();

    let cpu = Served::start_model(&path, &["--threads", "1", "--gpu-layers", "0", "--ctx-size", CTX]);
    let expected = complete(&cpu.addr);
    drop(cpu);
    let w1 = Served::worker_env(&path, &["--threads", "1"], &env);
    let w2 = Served::worker_env(&path, &["--threads", "1"], &env);
    let workers = format!("{},{}", w1.addr, w2.addr);
    let head = Served::start_model_env(&path, &["--threads", "1", "--ctx-size", CTX, "--max-batch", LAVAPIPE_SAFE_BATCH, "--workers", &workers, "--admin-key", ADMIN], &env);
    let plan: Value = serde_json::from_str(&admin(&head.addr, "/admin/plan")).unwrap();
    eprintln!("{plan}");
    assert_eq!(plan["source"], "halda", "{plan}");
    let k = plan["rounds"].as_u64().unwrap() as usize;
    let metrics = common::http(&head.addr, "GET", "/metrics", "", "").unwrap().body;
    let mut in_ram = 0;
    for m in plan["members"].as_array().unwrap() {
        let (w, n, e) = (m["window"].as_u64().unwrap() as usize, m["gpu_layers"].as_u64().unwrap() as usize, m["experts_in_ram"].as_u64().unwrap() as usize);
        // A GPU a thousand times faster takes every layer it can, each with its experts in
        // RAM; placed as planned.
        assert_eq!((n, e), (w, w), "{m}");
        assert!(m.get("planned_gpu_layers").is_none() && m.get("planned_experts_in_ram").is_none(), "{m}");
        // What it placed fits its GPU: whole layers b', those with experts in RAM b' − experts.
        let need = (k * n) as f64 * whole - (k * e) as f64 * experts;
        assert!(need <= room - f(&model["compute_buffer_gpu"]) + 1.0, "{m} needs {need} bytes of GPU memory");
        assert_experts_in_ram_metric(&metrics, m["name"].as_str().unwrap(), k * e);
        in_ram += k * e;
    }
    assert!(in_ram > 0, "the plan keeps no experts in RAM: {plan}");
    assert_same_or_near_tie(&format!("Halda's plan with {in_ram} layers' experts in RAM"), &complete(&head.addr), &expected);
    std::fs::remove_dir_all(&dir).ok();
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
