//! Property tests on random clusters: plan validity, memory limits, the ILP against
//! brute force over the same model, and Halda against the baselines.

mod common;

use proptest::prelude::*;
use scheduler::cost::{gpu_cap, ram_cap};
use scheduler::halda::{solve_fixed, solve_fixed_with, SolveMode, Solved};
use scheduler::pipelining::{auto_depth, FORECAST_CONTEXT};
use scheduler::{predict, schedule, DevicePlan, DeviceProfile, DeviceSet, GpuBackend, GpuProfile, ModelProfile, Options, Os, PerQuant, Pipelining, Plan, Strategy as PlanStrategy, DEFAULT_DISK_THRESHOLD};

const GB: f64 = 1e9;

fn rates(peak: f64) -> PerQuant {
    PerQuant { q4k: 0.35 * peak, q5k: 0.3 * peak, q6k: 0.3 * peak, q8_0: 0.45 * peak, f16: 0.25 * peak, f32: 0.5 * peak, ..PerQuant::default() }
}

prop_compose! {
    fn device()(os in 0..3u8, gpu in 0..3u8, cpu in 50.0..2000.0f64, bw in 10.0..80.0f64, disk in 0.2..4.0f64,
                ram in 0.5..16.0f64, vram in 1.0..24.0f64, gflops in 2.0..40.0f64, gbw in 60.0..900.0f64,
                swap in 0.0..2.0f64, comm in 0.0..8.0f64) -> DeviceProfile {
        let os = [Os::Macos, Os::Linux, Os::Android][os as usize];
        let gpu = match (os, gpu) {
            (Os::Macos, 1 | 2) => Some(GpuProfile { backend: GpuBackend::Metal, flops: rates(gflops * 1e11), read_bw: bw * GB, memory_available: ram * GB * 0.8, kv_copy_s: 1e-5, ram_to_vram_s: 0.0, vram_to_ram_s: 0.0, uma: true }),
            (Os::Linux, 1 | 2) | (Os::Android, 2) => Some(GpuProfile { backend: GpuBackend::Cuda, flops: rates(gflops * 1e12), read_bw: gbw * GB, memory_available: vram * GB, kv_copy_s: 1e-5, ram_to_vram_s: 2e-5, vram_to_ram_s: 2e-5, uma: false }),
            _ => None,
        };
        DeviceProfile {
            name: format!("{os:?}"), os, head: false, cpu_flops: rates(cpu * 1e9), cpu_read_bw: bw * GB, kv_copy_cpu_s: 2e-6,
            disk_seq_read: disk * GB, disk_rand_read: disk * GB * 0.8, ram_total: 16.0 * GB, ram_available: ram * GB,
            swap_available: swap * GB, bytes_can_swap: swap * GB * 0.5, gpu, comm_s: comm * 1e-3, prompt_token_share: 0.0, row_steps: Vec::new(), output_row_steps: Vec::new(), host: None,
        }
    }
}

prop_compose! {
    fn model(max_layers: usize)(n_layer in 2..=max_layers, layer_mb in 20.0..900.0f64, e in 512..8192usize, n_kv in 0..4096usize) -> ModelProfile {
        let b = layer_mb * 1e6;
        ModelProfile {
            name: "random".into(), n_layer, layer_bytes: b, input_bytes: b * 0.8, output_bytes: b * 1.2, n_vocab: 32000, n_embd: e,
            n_head_k: 8, n_head_v: 8, head_dim_k: 128, head_dim_v: 128, n_kv, n_head: 8, kv_element_bytes_k: 2.0, kv_element_bytes_v: 2.0,
            layer_flops: PerQuant { q4k: 1.6 * b, q6k: 0.5 * b, f16: 4096.0 * n_kv as f64, f32: 10.0 * e as f64, ..PerQuant::default() },
            output_flops: PerQuant { q6k: 2.0 * 32000.0 * e as f64, ..PerQuant::default() },
            compute_buffer_cpu: 2e8, compute_buffer_gpu: 2e8, moe: None, state_bytes: 0.0,
        }
    }
}

/// A cluster Halda can always serve without overloading a slow disk: the head has room
/// for its fixed buffers, and one device has a fast disk.
fn cluster(max: usize) -> impl Strategy<Value = Vec<DeviceProfile>> {
    proptest::collection::vec(device(), 1..=max).prop_map(|mut ds| {
        ds[0].head = true;
        ds[0].ram_available = ds[0].ram_available.max(4.0 * GB);
        if let Some(g) = ds[0].gpu.as_mut().filter(|g| g.backend == GpuBackend::Metal) {
            g.memory_available = g.memory_available.max(3.2 * GB);
        }
        let last = ds.len() - 1;
        ds[last].disk_seq_read = ds[last].disk_seq_read.max(2.0 * GB);
        ds[last].disk_rand_read = ds[last].disk_rand_read.max(2.0 * GB);
        ds
    })
}

fn check_plan(devices: &[DeviceProfile], m: &ModelProfile, s: &scheduler::Schedule) {
    let p = &s.plan;
    p.check().unwrap();
    assert_eq!(p.rounds() * p.window_sum(), m.n_layer, "k·W = L");
    let mut layers: Vec<usize> = p.route().iter().flat_map(|&(d, r)| p.windows_of(d)[r].clone()).collect();
    layers.sort();
    assert_eq!(layers, (0..m.n_layer).collect::<Vec<_>>(), "every layer exactly once");
    for (i, d) in p.devices.iter().enumerate() {
        let dev = &devices[s.members[i]];
        assert!(d.gpu_layers <= gpu_cap(dev, m, i == 0, p.rounds()), "{} exceeds its VRAM", dev.name);
        if dev.gpu.is_none() {
            assert_eq!(d.gpu_layers, 0);
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 256, ..ProptestConfig::default() })]

    #[test]
    fn plans_are_whole_fit_vram_and_spare_m4(devices in cluster(8), m in model(96)) {
        prop_assume!(devices.len() <= m.n_layer);
        for st in PlanStrategy::ALL {
            let s = schedule(&devices, &m, &Options { strategy: st, ..Options::default() }).unwrap();
            check_plan(&devices, &m, &s);
            if st == PlanStrategy::Halda {
                for c in &s.prediction.devices {
                    prop_assert!(!(c.set == DeviceSet::M4 && c.overloaded), "an M4 device is overloaded: {c:?}");
                }
            }
        }
    }

    #[test]
    fn halda_plans_for_more_devices_than_layers(devices in cluster(8), m in model(4)) {
        let s = schedule(&devices, &m, &Options::default()).unwrap();
        check_plan(&devices, &m, &s);
        prop_assert!(s.members.len() <= m.n_layer + 1);
    }

    #[test]
    fn halda_is_never_worse_than_a_baseline(devices in cluster(6), m in model(80)) {
        prop_assume!(devices.len() <= m.n_layer);
        let h = schedule(&devices, &m, &Options::default()).unwrap();
        for st in [PlanStrategy::Memory, PlanStrategy::Compute, PlanStrategy::Even] {
            let b = schedule(&devices, &m, &Options { strategy: st, ..Options::default() }).unwrap();
            // The guarantee covers baselines that meet Halda's constraints: no slow disk
            // overloaded (a slow-disk device is labelled M4).
            if b.prediction.devices.iter().any(|c| c.set == DeviceSet::M4 && c.overloaded) {
                continue;
            }
            prop_assert!(h.prediction.tpot_s <= b.prediction.tpot_s * (1.0 + 1e-7) + 1e-12,
                "halda {} > {st} {}", h.prediction.tpot_s, b.prediction.tpot_s);
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 128, ..ProptestConfig::default() })]

    /// Planning for several streams at once may keep devices one token alone would do
    /// without, but never costs that token more than a quarter, and never forecasts less
    /// for the streams together than the plan for one token's latency.
    #[test]
    fn plans_for_many_streams_give_up_at_most_a_quarter_of_one_token(devices in cluster(6), m in model(80)) {
        prop_assume!(devices.len() <= m.n_layer);
        let one = schedule(&devices, &m, &Options::default()).unwrap();
        let many = schedule(&devices, &m, &Options { streams: 8, ..Options::default() }).unwrap();
        check_plan(&devices, &m, &many);
        prop_assert!(many.prediction.tpot_s <= one.prediction.tpot_s * 1.25 * (1.0 + 1e-9) + 1e-12,
            "{} against {}", many.prediction.tpot_s, one.prediction.tpot_s);
        let rate = |s: &scheduler::Schedule| {
            let profs: Vec<DeviceProfile> = s.members.iter().map(|&i| devices[i].clone()).collect();
            let pipelining = Pipelining::of(&profs, &m, &s.plan);
            pipelining.tokens_per_s(8, auto_depth(&s.plan, &s.prediction, &pipelining), FORECAST_CONTEXT)
        };
        prop_assert!(rate(&many) >= rate(&one) * (1.0 - 1e-9), "{} against {}", rate(&many), rate(&one));
    }
}

/// All (w, n) with Σw = W, w ≥ 1, n ≤ min(w, VRAM cap).
fn all_plans(devices: &[DeviceProfile], m: &ModelProfile, k: usize, f: &mut dyn FnMut(&Plan)) {
    fn rec(devices: &[DeviceProfile], m: &ModelProfile, k: usize, left: usize, acc: &mut Vec<DevicePlan>, f: &mut dyn FnMut(&Plan)) {
        let i = acc.len();
        if i == devices.len() {
            if left == 0 {
                f(&Plan { n_layer: m.n_layer, devices: acc.clone() });
            }
            return;
        }
        for w in 1..=left {
            for n in 0..=w.min(gpu_cap(&devices[i], m, i == 0, k)) {
                acc.push(DevicePlan::new(w, n));
                rec(devices, m, k, left - w, acc, f);
                acc.pop();
            }
        }
    }
    rec(devices, m, k, m.n_layer / k, &mut Vec::new(), f);
}

fn divisors(l: usize) -> Vec<usize> {
    (1..=l).filter(|k| l.is_multiple_of(*k)).collect()
}

fn fast(d: &DeviceProfile) -> bool {
    d.disk_read() >= DEFAULT_DISK_THRESHOLD
}

/// Brute force of one fixed-set program: the best plan whose loads put every device in
/// the given set.
fn brute_fixed(devices: &[DeviceProfile], m: &ModelProfile, sets: &[DeviceSet], k: usize) -> Option<f64> {
    let mut best: Option<f64> = None;
    all_plans(devices, m, k, &mut |p| {
        let pr = predict(devices, m, p, DEFAULT_DISK_THRESHOLD);
        let consistent = pr.devices.iter().zip(sets).all(|(c, &s)| if s == DeviceSet::M4 { !c.overloaded } else { c.overloaded && c.set == s });
        if consistent && best.is_none_or(|b| pr.tpot_s < b) {
            best = Some(pr.tpot_s);
        }
    });
    best
}

/// Equal within HiGHS's optimality tolerances (costs are seconds; 1e-7 relative).
fn close(a: f64, b: f64) -> bool {
    (a - b).abs() <= 1e-7 * a.abs().max(b.abs()) + 1e-12
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 128, ..ProptestConfig::default() })]

    #[test]
    fn ilp_equals_brute_force(devices in cluster(3), m in model(8), pick in proptest::collection::vec(any::<bool>(), 3)) {
        prop_assume!(devices.len() <= m.n_layer);
        let sets: Vec<DeviceSet> = devices.iter().enumerate().map(|(i, d)| {
            if !(fast(d) && pick[i]) { DeviceSet::M4 } else {
                match (d.os, d.gpu.as_ref().map(|g| g.backend)) {
                    (Os::Macos, Some(GpuBackend::Metal)) => DeviceSet::M2,
                    (Os::Macos, _) => DeviceSet::M1,
                    _ => DeviceSet::M3,
                }
            }
        }).collect();
        let lower = vec![1; devices.len()];
        let mut global_ilp: Option<f64> = None;
        for k in divisors(m.n_layer) {
            if m.n_layer / k < devices.len() { continue; }
            let ilp = solve_fixed(&devices, &m, &sets, k, &lower);
            let brute = brute_fixed(&devices, &m, &sets, k);
            let mip = solve_fixed_with(&devices, &m, &sets, k, &lower, false, SolveMode::Integer);
            prop_assert_eq!(mip.is_some(), brute.is_some());
            if let (Some(x), Some(b)) = (&mip, brute) {
                prop_assert!(close(x.cost, b), "k={k} integer program {} brute {b}", x.cost);
            }
            match (&ilp, brute) {
                (None, None) => {}
                (Some(Solved { cost, w, n, .. }), Some(b)) => {
                    prop_assert!(close(*cost, b), "k={k} ilp {cost} brute {b} (w {w:?} n {n:?})");
                    let p = Plan { n_layer: m.n_layer, devices: w.iter().zip(n).map(|(&window, &gpu_layers)| DevicePlan::new(window, gpu_layers)).collect() };
                    let pr = predict(&devices, &m, &p, DEFAULT_DISK_THRESHOLD);
                    prop_assert!(close(pr.tpot_s, *cost), "objective {cost} != model {}", pr.tpot_s);
                    global_ilp = Some(global_ilp.map_or(*cost, |g: f64| g.min(*cost)));
                }
                (a, b) => prop_assert!(false, "k={k}: ilp {a:?} brute {b:?} sets {sets:?}"),
            }
        }
        let _ = global_ilp;
    }

    #[test]
    fn all_set_programs_together_equal_global_brute_force(devices in cluster(3), m in model(8)) {
        prop_assume!(devices.len() <= m.n_layer);
        let lower = vec![1; devices.len()];
        let ks: Vec<usize> = divisors(m.n_layer).into_iter().filter(|k| m.n_layer / k >= devices.len()).collect();
        // Every plan that keeps slow disks from overloading, brute force.
        let mut brute: Option<f64> = None;
        for &k in &ks {
            all_plans(&devices, &m, k, &mut |p| {
                let pr = predict(&devices, &m, p, DEFAULT_DISK_THRESHOLD);
                if pr.devices.iter().zip(&devices).all(|(c, d)| fast(d) || !c.overloaded) && brute.is_none_or(|b| pr.tpot_s < b) {
                    brute = Some(pr.tpot_s);
                }
            });
        }
        // The union of the fixed-set programs over every set assignment.
        let mut ilp: Option<f64> = None;
        let n = devices.len();
        for mask in 0..(1u32 << n) {
            let sets: Vec<DeviceSet> = (0..n).map(|i| {
                let d = &devices[i];
                if mask & (1 << i) == 0 || !fast(d) { DeviceSet::M4 } else {
                    match (d.os, d.gpu.as_ref().map(|g| g.backend)) {
                        (Os::Macos, Some(GpuBackend::Metal)) => DeviceSet::M2,
                        (Os::Macos, _) => DeviceSet::M1,
                        _ => DeviceSet::M3,
                    }
                }
            }).collect();
            for &k in &ks {
                if let Some(s) = solve_fixed(&devices, &m, &sets, k, &lower) {
                    ilp = Some(ilp.map_or(s.cost, |g: f64| g.min(s.cost)));
                }
            }
        }
        match (ilp, brute) {
            (Some(a), Some(b)) => prop_assert!(close(a, b), "ilp {a} brute {b}"),
            (a, b) => prop_assert_eq!(a.is_some(), b.is_some()),
        }
        // Halda's set iteration is a heuristic: never below the optimum, and always a plan.
        let h = schedule(&devices, &m, &Options { drop_at_most_layers: None, ..Options::default() }).unwrap();
        if let Some(b) = brute {
            prop_assert!(h.prediction.tpot_s >= b * (1.0 - 1e-9));
        }
        let _ = ram_cap;
    }
}
