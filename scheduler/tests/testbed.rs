//! The paper's testbed (ICLR Table 3; D3 first as the head) with models computed from
//! their published architectures (fixtures/gen_fixtures.py, docs/scheduler.md).

mod common;

use common::{model, show, testbed_d1_d4, testbed_d1_d6};
use scheduler::{schedule, DeviceProfile, Options, Schedule, Strategy};

fn plan(devices: &[DeviceProfile], key: &str, strategy: Strategy) -> Schedule {
    let s = schedule(devices, &model(key), &Options { strategy, ..Options::default() }).unwrap();
    println!("{key} on {} devices: {}", devices.len(), show(devices, &s));
    s
}

fn index(devices: &[DeviceProfile], prefix: &str) -> usize {
    devices.iter().position(|d| d.name.starts_with(prefix)).unwrap()
}

/// (member position, window, gpu layers) of an input device, if it is in the ring.
fn slot(s: &Schedule, device: usize) -> Option<(usize, usize, usize)> {
    let i = s.members.iter().position(|&m| m == device)?;
    Some((i, s.plan.devices[i].window, s.plan.devices[i].gpu_layers))
}

#[test]
fn llama3_8b_runs_on_d3_alone() {
    let d = testbed_d1_d4();
    let s = plan(&d, "llama3-8b", Strategy::Halda);
    let d3 = index(&d, "D3");
    assert_eq!(s.members, vec![d3]);
    assert_eq!(s.rounds * s.plan.devices[0].window, 32);
    assert_eq!(s.plan.devices[0].gpu_layers, s.plan.devices[0].window, "all on the 2080 Ti");
    assert_eq!(s.dropped.len(), 3);
    // The small Qwen goes the same way.
    let q = plan(&d, "qwen25-7b", Strategy::Halda);
    assert_eq!(q.members, vec![d3]);
}

#[test]
fn llama3_70b_uses_gpus_then_fast_disk_cpus_and_spares_the_phone() {
    let d = testbed_d1_d4();
    let m = model("llama3-70b");
    let s = plan(&d, "llama3-70b", Strategy::Halda);
    assert!(s.members.len() >= 3, "70B needs several devices");
    assert_eq!(s.rounds * s.plan.window_sum(), 80);
    let bp = m.layer_bytes_with_kv();
    // GPUs first: both CUDA GPUs are full (one more layer would not fit).
    for name in ["D3", "D2"] {
        let (_, _, n) = slot(&s, index(&d, name)).expect("GPU devices stay");
        let g = d[index(&d, name)].gpu.as_ref().unwrap();
        assert!((s.rounds * (n + 1)) as f64 * bp + m.compute_buffer_gpu > g.memory_available, "{name} GPU not full: {n}");
    }
    // Then the strong CPUs with fast disks take the rest; slow disks never overload.
    for (i, c) in s.prediction.devices.iter().enumerate() {
        let dev = &d[s.members[i]];
        if dev.disk_read() < scheduler::DEFAULT_DISK_THRESHOLD {
            assert!(!c.overloaded, "{} has a slow disk and is overloaded", dev.name);
        }
    }
    let layers = |name: &str| slot(&s, index(&d, name)).map_or(0, |(_, w, _)| w * s.rounds);
    assert!(layers("D4") <= 4, "the slow-disk phone gets little: {}", layers("D4"));
    assert!(layers("D3") > layers("D1") && layers("D2") > layers("D1"));
    assert!(layers("D3") > layers("D4") && layers("D2") > layers("D4"));
    // And Halda beats every baseline under the model (the paper: 31x over w/o Halda).
    for st in [Strategy::Memory, Strategy::Compute, Strategy::Even] {
        let b = plan(&d, "llama3-70b", st);
        assert!(s.prediction.tpot_s < b.prediction.tpot_s, "{st}");
    }
}

#[test]
fn every_fixture_model_plans_and_halda_wins() {
    for d in [testbed_d1_d4(), testbed_d1_d6()] {
        for key in ["llama3-8b", "llama3-70b", "qwen25-7b", "qwen25-14b", "qwen25-32b", "qwq-32b", "qwen25-72b"] {
            let h = plan(&d, key, Strategy::Halda);
            h.plan.check().unwrap();
            for st in [Strategy::Memory, Strategy::Compute, Strategy::Even] {
                let b = plan(&d, key, st);
                assert!(h.prediction.tpot_s <= b.prediction.tpot_s * (1.0 + 1e-9), "{key}: halda worse than {st}");
            }
        }
    }
}

/// The paper's device-set study (Fig. 8, Llama 3 70B): adding the weak D5 to D2 + D3
/// "halved" latency, because D3's overload reloads cost more than D5's slow compute.
/// (The paper also measured D2 + D3 + D5 faster than all six devices; under the model,
/// which charges reloads with no prefetch overlap, the six-device plan is faster — see
/// docs/scheduler.md.)
#[test]
fn device_set_study() {
    let all = testbed_d1_d6();
    let m = model("llama3-70b");
    let pick = |names: &[&str]| -> Vec<DeviceProfile> { names.iter().map(|n| all[index(&all, n)].clone()).collect() };
    let tpot = |names: &[&str]| {
        let d = pick(names);
        let s = schedule(&d, &m, &Options::default()).unwrap();
        println!("{names:?}: {}", show(&d, &s));
        s.prediction.tpot_s
    };
    let two = tpot(&["D3", "D2"]);
    let three = tpot(&["D3", "D2", "D5"]);
    let six = tpot(&["D3", "D1", "D2", "D4", "D5", "D6"]);
    println!("D2+D3 {:.0} ms, D2+D3+D5 {:.0} ms, all six {:.0} ms", two * 1e3, three * 1e3, six * 1e3);
    assert!(three < 0.75 * two, "adding D5 should cut TPOT substantially");
}

/// `hearth plan` prints schedules as JSON and reads profiles from it.
#[test]
fn schedules_and_profiles_round_trip_through_json() {
    let d = testbed_d1_d4();
    let s = plan(&d, "llama3-70b", Strategy::Halda);
    let text = serde_json::to_string(&s).unwrap();
    let back: Schedule = serde_json::from_str(&text).unwrap();
    // serde_json parses floats to within an ulp (no `float_roundtrip`): compare the plan
    // exactly and the numbers closely.
    assert_eq!((&back.plan, &back.members, &back.dropped, back.rounds), (&s.plan, &s.members, &s.dropped, s.rounds));
    assert!((back.prediction.tpot_s - s.prediction.tpot_s).abs() < 1e-12 * s.prediction.tpot_s);
    let dj = serde_json::to_string(&d).unwrap();
    let dback: Vec<DeviceProfile> = serde_json::from_str(&dj).unwrap();
    assert_eq!(dback.iter().map(|x| (&x.name, x.os, x.gpu.is_some())).collect::<Vec<_>>(), d.iter().map(|x| (&x.name, x.os, x.gpu.is_some())).collect::<Vec<_>>());
}

/// A quantized KV cache (`--cache-type-k/-v q4_0`) shrinks what each layer needs at a long
/// context, and the planner counts it: at 32k tokens the GPUs hold more of Llama 3 70B's
/// layers than with an F16 cache, and the predicted TPOT is no worse.
#[test]
fn a_quantized_kv_cache_lets_the_gpus_hold_more_layers_at_a_long_context() {
    let d = testbed_d1_d4();
    let f16 = scheduler::ModelProfile { n_kv: 32768, ..model("llama3-70b") };
    let q4_0 = 18.0 / 32.0;
    let q4 = scheduler::ModelProfile { kv_element_bytes_k: q4_0, kv_element_bytes_v: q4_0, ..f16.clone() };
    assert!(q4.kv_bytes_per_layer() < 0.3 * f16.kv_bytes_per_layer());
    let on_gpus = |m: &scheduler::ModelProfile| {
        let s = schedule(&d, m, &Options::default()).unwrap();
        println!("{}", show(&d, &s));
        (s.plan.devices.iter().map(|x| x.gpu_layers).sum::<usize>() * s.rounds, s.prediction.tpot_s)
    };
    let ((f16_layers, f16_tpot), (q4_layers, q4_tpot)) = (on_gpus(&f16), on_gpus(&q4));
    assert!(q4_layers > f16_layers, "GPU layers: {q4_layers} with a q4_0 cache, {f16_layers} with F16");
    assert!(q4_tpot <= f16_tpot * (1.0 + 1e-9), "TPOT {q4_tpot} with q4_0, {f16_tpot} with F16");
}
