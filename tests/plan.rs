//! `hearth plan` as a user runs it: device profiles and a model (what-if JSON or the real
//! GGUF) in, the plan out, as a table or JSON.

mod common;

use std::process::Command;

use serde_json::Value;

fn plan(args: &[&str]) -> (bool, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_hearth-under-test")).arg("plan").args(args).output().unwrap();
    (out.status.success(), format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr)))
}

fn fixture(name: &str) -> String {
    format!("{}/../scheduler/tests/fixtures/{name}", env!("CARGO_MANIFEST_DIR"))
}

#[test]
fn llama3_8b_on_the_papers_testbed_runs_on_d3_alone_and_beats_the_baselines() {
    let (ok, out) = plan(&["--devices", &fixture("testbed-d1-d4.json"), "--model", &fixture("model-llama3-8b-q4k.json"), "--json"]);
    assert!(ok, "{out}");
    let v: Value = serde_json::from_str(&out).unwrap();
    let s = &v["schedule"];
    let windows: Vec<u64> = s["plan"]["devices"].as_array().unwrap().iter().map(|d| d["window"].as_u64().unwrap()).collect();
    assert_eq!(windows.iter().sum::<u64>() * s["rounds"].as_u64().unwrap(), 32);
    let names: Vec<&str> = s["prediction"]["devices"].as_array().unwrap().iter().map(|d| d["name"].as_str().unwrap()).collect();
    let d3 = names.iter().position(|n| n.starts_with("D3")).expect("D3 is in the ring");
    assert_eq!(windows[d3] * s["rounds"].as_u64().unwrap(), 32, "every layer on D3: {s}");
    let tpot = s["prediction"]["tpot_s"].as_f64().unwrap();
    // D3 alone: one member, one micro-batch at a time, the same throughput either way.
    let f = &v["forecast"];
    assert_eq!(f["micro_batches"], 1, "{f}");
    let eight = &f["streams"][2];
    assert_eq!(eight["pipelined_tokens_per_s"], eight["one_at_a_time_tokens_per_s"], "{f}");
    for (strategy, other) in v["other_strategies"].as_object().unwrap() {
        assert!(tpot <= other["tpot_s"].as_f64().unwrap_or(f64::INFINITY) + 1e-9, "{strategy} beats halda: {out}");
    }
}

#[test]
fn a_gguf_is_profiled_from_its_tensors_and_the_table_names_every_strategy() {
    let model = common::default_model();
    let (ok, out) = plan(&["--devices", &fixture("testbed-d1-d4.json"), "--model", model.to_str().unwrap(), "--json"]);
    assert!(ok, "{out}");
    let v: Value = serde_json::from_str(&out).unwrap();
    let m = &v["model"];
    assert_eq!(m["n_layer"], 30);
    assert_eq!(m["n_vocab"], 49152);
    // Layers and the embedding (read again as the tied output layer) are the file, but for
    // its header (the tokenizer: 1.7 MB) and the output norm.
    let layers = 30.0 * m["layer_bytes"].as_f64().unwrap();
    let file = std::fs::metadata(&model).unwrap().len() as f64;
    let embedding = m["input_bytes"].as_f64().unwrap();
    assert!(layers + embedding < file && layers + embedding > 0.97 * file, "{layers} + {embedding} vs a file of {file}");
    // Q4_1 weights are their own format: 2 FLOPs per weight of every layer matrix.
    let q4_1 = m["layer_flops"]["q4_1"].as_f64().unwrap();
    assert!(q4_1 > 0.0 && m["layer_flops"]["q4k"].as_f64().unwrap() == 0.0, "Q4_1 weights count as Q4_1: {m}");
    assert!((q4_1 - 2.0 * m["layer_bytes"].as_f64().unwrap() * 8.0 / 5.0).abs() < 0.05 * q4_1, "Q4_1 holds 5 bits per weight: {m}");

    let (ok, table) = plan(&["--devices", &fixture("testbed-d1-d4.json"), "--model", model.to_str().unwrap()]);
    assert!(ok, "{table}");
    assert!(table.contains("predicted TPOT"), "{table}");
    assert!(table.contains("micro-batches in flight") && table.contains("8 streams") && table.contains("2000-token prompt"), "{table}");
    for s in ["memory", "compute", "even"] {
        assert!(table.contains(&format!("--plan-strategy {s}")), "{table}");
    }
}

/// Three devices of one speed, each hop between them costing `hop_s`, planned by
/// `hearth plan --json` with `args`.
fn equal_devices(hop_s: f64, args: &[&str]) -> Value {
    let rates = serde_json::json!({"q4_0": 4e10, "q4_1": 4e10, "q4k": 4e10, "q5k": 4e10, "q6k": 4e10, "q8_0": 4e10, "f16": 2e10, "f32": 2e10});
    let device = |name: &str, head: bool| {
        serde_json::json!({"name": name, "os": "linux", "head": head, "cpu_flops": rates, "cpu_read_bw": 1e10, "kv_copy_cpu_s": 0.0,
            "disk_seq_read": 2e9, "disk_rand_read": 1e9, "ram_total": 8e9, "ram_available": 6e9, "swap_available": 0.0, "bytes_can_swap": 0.0,
            "comm_s": hop_s, "prompt_token_share": 0.3})
    };
    let path = std::env::temp_dir().join(format!("hearth-equal-devices-{}-{hop_s}.json", std::process::id()));
    std::fs::write(&path, serde_json::json!([device("head", true), device("a", false), device("b", false)]).to_string()).unwrap();
    let model = common::default_model();
    let (ok, out) = plan(&[&["--devices", path.to_str().unwrap(), "--model", model.to_str().unwrap(), "--json"], args].concat());
    std::fs::remove_file(&path).ok();
    assert!(ok, "{out}");
    serde_json::from_str(&out).unwrap()
}

/// Three devices of one speed: a token's latency is the same however the layers are
/// split, but micro-batches in flight leave at the slowest member's pace, and the head
/// also runs the output layer (the default model's weighs about 8 of its layers): the plan
/// gives the head fewer layers than the workers and predicts no slower a token than even
/// windows. (Hops are free here; see the next test for hops that cost.)
#[test]
fn equal_devices_give_the_head_fewer_layers_for_a_steady_beat() {
    let v = equal_devices(0.0, &[]);
    let out = v.to_string();
    let w: Vec<u64> = v["schedule"]["plan"]["devices"].as_array().unwrap().iter().map(|d| d["window"].as_u64().unwrap()).collect();
    assert_eq!(w.len(), 3, "{out}");
    assert!(w[0] < w[1] && w[0] < w[2], "the head should hold fewer layers: {w:?}");
    let tpot = v["schedule"]["prediction"]["tpot_s"].as_f64().unwrap();
    let even = v["other_strategies"]["even"]["tpot_s"].as_f64().unwrap();
    assert!(tpot <= even * (1.0 + 1e-7), "balanced {tpot} against even {even}");
}

/// With a cost per hop, one token alone is fastest on two of three equal devices, and
/// Halda planning for one stream leaves the third out. Planning for 8 streams at once
/// (`--parallel 8`, micro-batches in flight) keeps it: the forecast for 8 streams rises
/// by more than one token's predicted time does, which stays within a quarter.
#[test]
fn equal_devices_with_costly_hops_stay_in_the_ring_for_many_streams() {
    let members = |v: &Value| v["schedule"]["plan"]["devices"].as_array().unwrap().len();
    let tpot = |v: &Value| v["schedule"]["prediction"]["tpot_s"].as_f64().unwrap();
    let eight = |v: &Value| v["forecast"]["streams"].as_array().unwrap().iter().find(|s| s["streams"] == 8).unwrap()["pipelined_tokens_per_s"].as_f64().unwrap();
    let one = equal_devices(0.002, &["--parallel", "1"]);
    let many = equal_devices(0.002, &["--parallel", "8"]);
    assert_eq!(members(&one), 2, "one stream: two members ({one})");
    assert_eq!(members(&many), 3, "8 streams: all three ({many})");
    assert!(tpot(&many) <= tpot(&one) * 1.25, "one token {} against {}", tpot(&many), tpot(&one));
    assert!(eight(&many) / eight(&one) > tpot(&many) / tpot(&one), "8 streams {} against {}", eight(&many), eight(&one));
}

/// Three 0.66-core emulated devices on one machine (`scripts/cpu-device.sh`), profiled
/// at once on the CI machine kind (`scheduler/tests/fixtures/emulated-0.66-core-x3.json`):
/// their speeds differ by the noise of measuring under a quota, so one token alone is
/// about as fast on any split and Halda's plan for it relays through the head. Planned for
/// 8 streams the three each get a share (the head, which also holds the output layer, the
/// smallest): measured before, the plan left one device a single layer (10, 1, 19) and
/// forecast 90 tokens/s for 8 streams where a balanced split forecasts 132.
#[test]
fn three_emulated_devices_each_get_a_share_when_many_streams_are_planned() {
    let model = common::default_model();
    let run = |parallel: &str| {
        let (ok, out) = plan(&["--devices", &fixture("emulated-0.66-core-x3.json"), "--model", model.to_str().unwrap(), "--ctx-size", "4768", "--parallel", parallel, "--json"]);
        assert!(ok, "{out}");
        serde_json::from_str::<Value>(&out).unwrap()
    };
    let windows = |v: &Value| v["schedule"]["plan"]["devices"].as_array().unwrap().iter().map(|d| d["window"].as_u64().unwrap()).collect::<Vec<_>>();
    let eight = |v: &Value| v["forecast"]["streams"].as_array().unwrap().iter().find(|s| s["streams"] == 8).unwrap()["pipelined_tokens_per_s"].as_f64().unwrap();
    let tpot = |v: &Value| v["schedule"]["prediction"]["tpot_s"].as_f64().unwrap();
    let (one, many) = (run("1"), run("8"));
    let w = windows(&many);
    assert_eq!(w.len(), 3, "{many}");
    assert!(w.iter().all(|&n| n >= 3) && w[0] < w[1] && w[0] < w[2], "every device a share, the head the least: {w:?}");
    assert!(eight(&many) > 1.3 * eight(&one), "8 streams {} against {} (windows {:?})", eight(&many), eight(&one), windows(&one));
    assert!(tpot(&many) <= tpot(&one) * 1.25, "one token {} against {}", tpot(&many), tpot(&one));
    // One micro-batch per member: a fourth forecasts only a few percent more here, and
    // measured on such devices it decoded slower in six pairs of runs of seven
    // (`scheduler::pipelining::EXTRA_DEPTH_GAIN`).
    assert_eq!(many["forecast"]["micro_batches"], 3, "{many}");
}

#[test]
fn bad_input_is_a_clear_error() {
    let (ok, out) = plan(&["--devices", &fixture("model-llama3-8b-q4k.json"), "--model", &fixture("model-llama3-8b-q4k.json")]);
    assert!(!ok);
    assert!(out.contains("is not a list of device profiles"), "{out}");
    let (ok, out) = plan(&["--devices", &fixture("testbed-d1-d4.json"), "--model", &fixture("testbed-d1-d4.json")]);
    assert!(!ok);
    assert!(out.contains("neither a GGUF nor a model-profile JSON"), "{out}");
    let (ok, out) = plan(&["--devices", &fixture("testbed-d1-d4.json"), "--model", &fixture("model-llama3-8b-q4k.json"), "--plan-strategy", "fastest"]);
    assert!(!ok);
    assert!(out.contains("unknown plan strategy"), "{out}");
}
