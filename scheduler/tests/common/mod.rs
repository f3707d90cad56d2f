//! Shared by the scheduler's integration tests: the fixtures (compiled in, so the tests
//! do no file I/O either) and a printer.
#![allow(dead_code)]

use scheduler::{DeviceProfile, ModelProfile, Schedule};

pub fn testbed_d1_d4() -> Vec<DeviceProfile> {
    serde_json::from_str(include_str!("../fixtures/testbed-d1-d4.json")).unwrap()
}

pub fn testbed_d1_d6() -> Vec<DeviceProfile> {
    serde_json::from_str(include_str!("../fixtures/testbed-d1-d6.json")).unwrap()
}

pub fn model(key: &str) -> ModelProfile {
    let text = match key {
        "llama3-8b" => include_str!("../fixtures/model-llama3-8b-q4k.json"),
        "llama3-70b" => include_str!("../fixtures/model-llama3-70b-q4k.json"),
        "qwen25-7b" => include_str!("../fixtures/model-qwen25-7b-q4k.json"),
        "qwen25-14b" => include_str!("../fixtures/model-qwen25-14b-q4k.json"),
        "qwen25-32b" => include_str!("../fixtures/model-qwen25-32b-q4k.json"),
        "qwq-32b" => include_str!("../fixtures/model-qwq-32b-q4k.json"),
        "qwen25-72b" => include_str!("../fixtures/model-qwen25-72b-q4k.json"),
        other => panic!("no fixture {other}"),
    };
    serde_json::from_str(text).unwrap()
}

pub fn show(devices: &[DeviceProfile], s: &Schedule) -> String {
    let mut out = format!("{} k={} TPOT {:.1} ms, ILPs {}\n", s.strategy, s.rounds, s.prediction.tpot_s * 1e3, s.ilp_solves);
    for (i, (&m, d)) in s.members.iter().zip(&s.plan.devices).enumerate() {
        let c = &s.prediction.devices[i];
        let b = c.breakdown;
        out += &format!(
            "  {:<30} w={:>2} n={:>2} {:?}{} comp {:.1} mem {:.1} disk {:.1} net {:.1} ms\n",
            devices[m].name,
            d.window,
            d.gpu_layers,
            c.set,
            if c.overloaded { " overloaded" } else { "" },
            b.compute_s * 1e3,
            b.memory_s * 1e3,
            b.disk_s * 1e3,
            b.network_s * 1e3
        );
    }
    for &m in &s.dropped {
        out += &format!("  {:<30} dropped\n", devices[m].name);
    }
    out
}
