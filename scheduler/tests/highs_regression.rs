//! HiGHS 1.15.0 (bundled by the `highs` crate 2.4.0) has a presolve bug that reports
//! "Infeasible" for a feasible 30-layer partition model (docs/scheduler.md,
//! DESIGN.md "HiGHS bug"). The scheduler turns presolve off; these 30-layer instances
//! (SmolLM2-135M, the default model, on a three-node ring) must keep solving, and
//! solving optimally.

use scheduler::halda::{solve_fixed, solve_fixed_with, SolveMode};
use scheduler::{predict, schedule, DevicePlan, DeviceProfile, DeviceSet, ModelProfile, Options, Os, PerQuant, Plan, DEFAULT_DISK_THRESHOLD};

fn smollm2() -> ModelProfile {
    // 30 layers, e = 576, 9 heads, 3 KV heads of 64, FFN 1536, vocab 49152, Q4_1 (5 bits).
    let (e, ffn, kv) = (576.0, 1536.0, 192.0);
    let params = e * e * 2.0 + e * kv * 2.0 + 3.0 * e * ffn;
    ModelProfile {
        name: "SmolLM2-135M Q4_1".into(),
        n_layer: 30,
        layer_bytes: params * 5.0 / 8.0 + 2.0 * e * 4.0,
        input_bytes: 49152.0 * e * 8.5 / 8.0,
        output_bytes: 49152.0 * e * 8.5 / 8.0,
        n_vocab: 49152,
        n_embd: 576,
        n_head_k: 3,
        n_head_v: 3,
        head_dim_k: 64,
        head_dim_v: 64,
        n_kv: 512,
        n_head: 9,
        kv_element_bytes_k: 2.0,
        kv_element_bytes_v: 2.0,
        layer_flops: PerQuant { q8_0: 2.0 * params, f16: 4.0 * 9.0 * 64.0 * 512.0, ..PerQuant::default() },
        output_flops: PerQuant { q8_0: 2.0 * 49152.0 * e, ..PerQuant::default() },
        compute_buffer_cpu: 5e7,
        compute_buffer_gpu: 0.0,
        moe: None,
        state_bytes: 0.0,
    }
}

fn node(name: &str, gflops: f64, ram: f64) -> DeviceProfile {
    let r = gflops * 1e9;
    DeviceProfile {
        name: name.into(),
        os: Os::Linux,
        head: false,
        cpu_flops: PerQuant { q4_0: r, q4_1: r, q4k: r, q5k: r, q6k: r, q8_0: r, f16: r, f32: r, other: Default::default() },
        cpu_read_bw: 27e9,
        kv_copy_cpu_s: 2e-6,
        disk_seq_read: 2e9,
        disk_rand_read: 1e9,
        ram_total: 24e9,
        ram_available: ram,
        swap_available: 0.0,
        bytes_can_swap: 0.0,
        gpu: None,
        comm_s: 1e-4,
        prompt_token_share: 0.0, row_steps: Vec::new(), output_row_steps: Vec::new(), host: None,
    }
}

fn brute(devices: &[DeviceProfile], m: &ModelProfile, sets: &[DeviceSet], k: usize) -> Option<f64> {
    let big_w = m.n_layer / k;
    let mut best: Option<f64> = None;
    for a in 1..big_w {
        for b in 1..big_w - a {
            let c = big_w - a - b;
            let p = Plan { n_layer: m.n_layer, devices: [a, b, c].iter().map(|&window| DevicePlan::new(window, 0)).collect() };
            let pr = predict(devices, m, &p, DEFAULT_DISK_THRESHOLD);
            let ok = pr.devices.iter().zip(sets).all(|(d, &s)| (s == DeviceSet::M4) != d.overloaded);
            if ok && best.is_none_or(|x| pr.tpot_s < x) {
                best = Some(pr.tpot_s);
            }
        }
    }
    best
}

#[test]
fn thirty_layers_solve_with_presolve_off() {
    let m = smollm2();
    // Roomy nodes, and nodes so tight that some must overload (M3).
    for ram in [8e9, 0.09e9] {
        let devices = vec![node("head", 40.0, ram), node("w1", 30.0, ram), node("w2", 20.0, ram)];
        for sets in [[DeviceSet::M4; 3], [DeviceSet::M3, DeviceSet::M4, DeviceSet::M4], [DeviceSet::M3; 3]] {
            for k in [1, 2, 3, 5, 6, 10] {
                let ilp = solve_fixed(&devices, &m, &sets, k, &[1, 1, 1]);
                let want = brute(&devices, &m, &sets, k);
                // The integer program itself (branch and bound, presolve off) agrees.
                let mip = solve_fixed_with(&devices, &m, &sets, k, &[1, 1, 1], false, SolveMode::Integer);
                assert_eq!(ilp.is_some(), mip.is_some(), "k={k} {sets:?}");
                if let (Some(a), Some(b)) = (&ilp, &mip) {
                    assert!((a.cost - b.cost).abs() <= 1e-9 * a.cost, "k={k} {sets:?}: LP {} vs MIP {}", a.cost, b.cost);
                }
                match (&ilp, want) {
                    (Some(s), Some(b)) => assert!((s.cost - b).abs() <= 1e-9 * b, "k={k} {sets:?}: {} vs {b}", s.cost),
                    (None, None) => {}
                    _ => panic!("ram {ram} k={k} {sets:?}: ilp {ilp:?} brute {want:?}"),
                }
                if let (Some(_), None) = (&ilp, solve_fixed_with(&devices, &m, &sets, k, &[1, 1, 1], true, SolveMode::Integer)) {
                    eprintln!("HiGHS presolve still fails: ram {ram} k={k} {sets:?}");
                }
            }
        }
        let s = schedule(&devices, &m, &Options::default()).unwrap();
        assert_eq!(s.rounds * s.plan.window_sum(), 30);
    }
}
