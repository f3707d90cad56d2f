//! `hearth plan`: Halda (or a baseline) offline, on device profiles from a JSON file and a
//! model (a GGUF, or a model-profile JSON for what-if planning). Prints the plan as a table
//! with the predicted TPOT and its breakdown, and what every other strategy would predict,
//! or the whole schedule as JSON. Nothing is measured or run: "what if I add my gaming
//! PC?" is answered by adding it to the devices file.

use std::io::Read;
use std::path::Path;

use scheduler::{DeviceProfile, ModelProfile, Options, Schedule, Strategy};
use serde_json::json;

use crate::cli::PlanArgs;

const GB: f64 = 1e9;

pub fn run(args: PlanArgs) -> Result<(), Box<dyn std::error::Error>> {
    let devices: Vec<DeviceProfile> = serde_json::from_str(&std::fs::read_to_string(&args.devices).map_err(|e| format!("cannot read {}: {e}", args.devices.display()))?)
        .map_err(|e| format!("{} is not a list of device profiles: {e}", args.devices.display()))?;
    let model = load_model(&args.model.resolve()?, args.ctx_size)?;
    let strategy: Strategy = args.plan_strategy.parse()?;
    let schedule_with = |strategy| scheduler::schedule(&devices, &model, &Options { strategy, ..Options::default() });
    let chosen = schedule_with(strategy)?;
    // The other strategies under the same cost model, so the gain is visible.
    let others: Vec<(Strategy, Result<f64, String>)> = Strategy::ALL
        .into_iter()
        .filter(|s| *s != strategy)
        .map(|s| (s, schedule_with(s).map(|x| x.prediction.tpot_s).map_err(|e| e.to_string())))
        .collect();
    if args.json {
        let others: serde_json::Map<String, serde_json::Value> =
            others.iter().map(|(s, r)| (s.to_string(), r.as_ref().map_or_else(|e| json!({ "error": e }), |t| json!({ "tpot_s": t })))).collect();
        println!("{}", serde_json::to_string_pretty(&json!({ "model": model, "schedule": chosen, "other_strategies": others }))?);
    } else {
        print!("{}", table(&devices, &model, &chosen, &others));
    }
    Ok(())
}

/// A GGUF (by its magic) or a model-profile JSON.
fn load_model(path: &Path, ctx: usize) -> Result<ModelProfile, Box<dyn std::error::Error>> {
    let mut magic = [0u8; 4];
    std::fs::File::open(path).and_then(|mut f| f.read_exact(&mut magic)).map_err(|e| format!("cannot read {}: {e}", path.display()))?;
    if &magic == b"GGUF" {
        let file = engine::ModelFile::open(path)?;
        let name = path.file_stem().map_or_else(|| "model".into(), |s| s.to_string_lossy().into_owned());
        return Ok(crate::model_profile::from_gguf(&file, &name, ctx));
    }
    let text = std::fs::read_to_string(path)?;
    Ok(serde_json::from_str(&text).map_err(|e| format!("{} is neither a GGUF nor a model-profile JSON: {e}", path.display()))?)
}

fn ms(s: f64) -> String {
    format!("{:.1}", s * 1e3)
}

/// The plan as a table: per device its set, window, GPU layers, memory and time parts;
/// then the predicted TPOT, the devices left out, and `others`' predictions.
pub fn table(devices: &[DeviceProfile], model: &ModelProfile, s: &Schedule, others: &[(Strategy, Result<f64, String>)]) -> String {
    use std::fmt::Write;
    let mut out = String::new();
    let _ = writeln!(
        out,
        "model {}: {} layers, {:.2} GB; strategy {}; k = {} rounds of W = {} layers",
        model.name,
        model.n_layer,
        model.total_bytes() / GB,
        s.strategy,
        s.rounds,
        s.plan.window_sum()
    );
    let _ = writeln!(out, "\n| device | set | window | GPU layers | layers/token | RAM needed / available | VRAM needed / available | compute ms | memory ms | disk ms | network ms |");
    let _ = writeln!(out, "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|");
    for (i, (&m, cost)) in s.members.iter().zip(&s.prediction.devices).enumerate() {
        let d = &devices[m];
        let p = &s.plan.devices[i];
        // Weights and KV of its layers (the head also holds the output layer); more than
        // is available means reloading from disk every token.
        let ram = cost.cpu_layers as f64 * model.layer_bytes_with_kv() + if i == 0 { model.output_bytes } else { 0.0 };
        let vram = match &d.gpu {
            Some(g) => format!("{:.2} / {:.2} GB", cost.gpu_layers as f64 * model.layer_bytes_with_kv() / GB, g.memory_available / GB),
            None => "-".into(),
        };
        let b = &cost.breakdown;
        let _ = writeln!(
            out,
            "| {} | {:?}{} | {} | {} | {} | {:.2} / {:.2} GB | {vram} | {} | {} | {} | {} |",
            d.name,
            cost.set,
            if cost.overloaded { " (overloaded)" } else { "" },
            p.window,
            p.gpu_layers,
            cost.cpu_layers + cost.gpu_layers,
            ram / GB,
            d.ram_available / GB,
            ms(b.compute_s),
            ms(b.memory_s),
            ms(b.disk_s),
            ms(b.network_s)
        );
    }
    let _ = writeln!(out, "\npredicted TPOT: {} ms", ms(s.prediction.tpot_s));
    if !s.dropped.is_empty() {
        let names: Vec<&str> = s.dropped.iter().map(|&i| devices[i].name.as_str()).collect();
        let _ = writeln!(out, "left out (they would slow the ring down): {}", names.join(", "));
    }
    for (strategy, r) in others {
        let _ = match r {
            Ok(t) => writeln!(out, "with --plan-strategy {strategy}: {} ms", ms(*t)),
            Err(e) => writeln!(out, "with --plan-strategy {strategy}: no plan ({e})"),
        };
    }
    out
}
