//! `hearth profile`: measures this device and prints it as a table, or as JSON that
//! `hearth plan --devices` reads (`--fresh` measures again instead of using the cache).

use std::time::Duration;

use scheduler::DeviceProfile;

use crate::cli::ProfileArgs;
use crate::runtime::profiling::device_profile;

pub fn run(args: ProfileArgs) -> Result<(), Box<dyn std::error::Error>> {
    let threads = args.threads.unwrap_or_else(engine::stage::default_threads);
    let model = match &args.model.model {
        Some(path) => Some((path.as_path(), engine::ModelFile::open(path)?)),
        None => None,
    };
    let (mut profile, took, disk_dir) = device_profile(threads, model.as_ref().map(|(p, f)| (*p, f)), args.fresh)?;
    profile.name = args.name.clone().unwrap_or_else(|| crate::process::hostname().unwrap_or_else(|| "this device".into()));
    profile.head = args.head;
    if args.json {
        println!("{}", serde_json::to_string_pretty(&profile)?);
    } else {
        print!("{}", table(&profile, threads, &disk_dir, took));
    }
    Ok(())
}

fn table(p: &DeviceProfile, threads: usize, disk_dir: &std::path::Path, took: Option<Duration>) -> String {
    use std::fmt::Write;
    let mut out = String::new();
    let source = took.map_or("cached (--fresh measures again)".into(), |t| format!("measured in {:.1} s", t.as_secs_f64()));
    let _ = writeln!(out, "device {} ({:?}, {threads} threads): {source}\n", p.name, p.os);
    let _ = writeln!(out, "| measure | value |\n|---|---:|");
    let f = &p.cpu_flops;
    for (name, v) in [("Q4_0", f.q4_0), ("Q4_1", f.q4_1), ("Q4_K", f.q4k), ("Q5_K", f.q5k), ("Q6_K", f.q6k), ("Q8_0", f.q8_0), ("F16", f.f16), ("F32", f.f32)] {
        let _ = writeln!(out, "| CPU matrix x vector, {name} | {:.1} GFLOP/s |", v / 1e9);
    }
    // The model's other formats, each measured on its own kernels.
    for (name, v) in &f.other {
        let _ = writeln!(out, "| CPU matrix x vector, {} (the model's) | {:.1} GFLOP/s |", name.to_uppercase(), v / 1e9);
    }
    let _ = writeln!(out, "| memory read | {:.1} GB/s |", p.cpu_read_bw / 1e9);
    let _ = writeln!(out, "| KV write, one token of one layer | {:.2} µs |", p.kv_copy_cpu_s * 1e6);
    let _ = writeln!(out, "| disk sequential read ({}) | {:.0} MB/s |", disk_dir.display(), p.disk_seq_read / 1e6);
    let _ = writeln!(out, "| disk random 4 KiB read | {:.0} MB/s |", p.disk_rand_read / 1e6);
    let _ = writeln!(out, "| RAM total / available | {:.1} / {:.1} GB |", p.ram_total / 1e9, p.ram_available / 1e9);
    let _ = writeln!(out, "| swap free | {:.1} GB |", p.swap_available / 1e9);
    let accels = engine::accelerators();
    match (&p.gpu, accels.first()) {
        (Some(g), Some(a)) => {
            let kind = if a.integrated { "integrated, shares RAM" } else { "own memory" };
            let _ = writeln!(out, "\naccelerator {} ({}, {:?}, {kind}): {:.1} of {:.1} GB free\n", a.name, a.description, g.backend, a.memory_free as f64 / 1e9, a.memory_total as f64 / 1e9);
            let _ = writeln!(out, "| measure | value |\n|---|---:|");
            let f = &g.flops;
            for (name, v) in [("Q4_0", f.q4_0), ("Q4_1", f.q4_1), ("Q4_K", f.q4k), ("Q5_K", f.q5k), ("Q6_K", f.q6k), ("Q8_0", f.q8_0), ("F16", f.f16), ("F32", f.f32)].into_iter().filter(|(_, v)| *v > 0.0) {
                let _ = writeln!(out, "| GPU matrix x vector, {name} | {:.1} GFLOP/s |", v / 1e9);
            }
            for (name, v) in &f.other {
                let _ = writeln!(out, "| GPU matrix x vector, {} (the model's) | {:.1} GFLOP/s |", name.to_uppercase(), v / 1e9);
            }
            let _ = writeln!(out, "| GPU memory read | {:.1} GB/s |", g.read_bw / 1e9);
            let _ = writeln!(out, "| GPU KV write, one token of one layer | {:.2} µs |", g.kv_copy_s * 1e6);
            let _ = writeln!(out, "| hidden state host -> GPU / GPU -> host | {:.1} / {:.1} µs |", g.ram_to_vram_s * 1e6, g.vram_to_ram_s * 1e6);
        }
        _ if accels.is_empty() => {
            let _ = writeln!(out, "\nno accelerator: this build computes on the CPU only (GPU builds: --features cuda, metal or vulkan)");
        }
        _ => {
            let _ = writeln!(out, "\naccelerators seen but not profiled (a backend the scheduler has no terms for): {}", accels.iter().map(|a| a.description.as_str()).collect::<Vec<_>>().join(", "));
        }
    }
    out
}
