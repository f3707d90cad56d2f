//! `hearth profile` as a user runs it: it measures this device into a device profile that
//! `hearth plan` reads, caches it, and measures again with --fresh.

mod common;

use std::process::Command;
use std::time::Instant;

use scheduler::DeviceProfile;

fn hearth(cache: &std::path::Path, args: &[&str]) -> String {
    let out = Command::new(env!("CARGO_BIN_EXE_hearth-under-test")).args(args).env("XDG_CACHE_HOME", cache).output().unwrap();
    assert!(out.status.success(), "hearth {args:?}: {}", String::from_utf8_lossy(&out.stderr));
    String::from_utf8(out.stdout).unwrap()
}

#[test]
fn a_measured_profile_is_cached_and_plans_a_ring() {
    let dir = std::env::temp_dir().join(format!("hearth-profile-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let model = common::default_model();
    let model = model.to_str().unwrap();
    let start = Instant::now();
    let json = hearth(&dir, &["profile", "--model", model, "--threads", "1", "--name", "ci", "--head", "--fresh", "--json"]);
    eprintln!("hearth profile took {:?}", start.elapsed());
    let p: DeviceProfile = serde_json::from_str(&json).unwrap();
    assert_eq!(p.name, "ci");
    assert!(p.head);
    let f = &p.cpu_flops;
    for (name, v) in [("q4_0", f.q4_0), ("q4_1", f.q4_1), ("q4k", f.q4k), ("q5k", f.q5k), ("q6k", f.q6k), ("q8_0", f.q8_0), ("f16", f.f16), ("f32", f.f32)] {
        assert!(v > 1e7, "{name}: {v} FLOP/s");
    }
    assert!(p.cpu_read_bw > 1e8 && p.disk_seq_read > 1e6 && p.disk_rand_read > 1e4, "{p:?}");
    assert!(p.ram_available > 0.0 && p.ram_available <= p.ram_total);
    // Calibrated on the model: a prompt token's share, and decode batches of 1 to 8 rows
    // through the layers and (the model is timed whole) through the output layer alone,
    // as multiples of one row. More rows never take less than fewer (the profiler keeps
    // noise from saying so), nor more than as many rows apart. Through the output
    // layer one row takes ggml's vec_dot and two or more take tinyBLAS's tiles, a jump
    // (2.8x at -O2, 4.7-5.8x since llama.cpp is built at -O3): there "as many rows apart"
    // counts from the two-row step, which itself stays under 8x one row.
    assert!(p.prompt_token_share > 0.0 && p.prompt_token_share <= 1.0, "{}", p.prompt_token_share);
    for steps in [&p.row_steps, &p.output_row_steps] {
        assert_eq!(steps.len(), 8, "{steps:?}");
        assert_eq!(steps[0], 1.0);
        assert!(steps.windows(2).all(|w| w[0] <= w[1]), "{steps:?}");
    }
    assert!(p.row_steps.iter().enumerate().all(|(i, &t)| t < 2.0 * (i + 1) as f64), "{:?}", p.row_steps);
    let two = p.output_row_steps[1];
    assert!(two < 8.0, "{:?}", p.output_row_steps);
    assert!(p.output_row_steps.iter().enumerate().skip(1).all(|(i, &t)| t < two * (i + 1) as f64), "{:?}", p.output_row_steps);
    // The second run reuses the cache: the same figures, and the table says so.
    let again: DeviceProfile = serde_json::from_str(&hearth(&dir, &["profile", "--model", model, "--threads", "1", "--name", "ci", "--head", "--json"])).unwrap();
    assert_eq!(again, p);
    let table = hearth(&dir, &["profile", "--model", model, "--threads", "1"]);
    assert!(table.contains("cached") && table.contains("GFLOP/s"), "{table}");
    // The profile is what `hearth plan --devices` reads.
    let devices = dir.join("devices.json");
    std::fs::write(&devices, format!("[{json}]")).unwrap();
    let plan = hearth(&dir, &["plan", "--devices", devices.to_str().unwrap(), "--model", model]);
    assert!(plan.contains("predicted TPOT"), "{plan}");
    std::fs::remove_dir_all(&dir).unwrap();
}
