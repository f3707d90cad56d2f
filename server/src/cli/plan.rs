//! `hearth plan`: Halda (or a baseline) offline, on device profiles from a JSON file and a
//! model (a GGUF, or a model-profile JSON for what-if planning). Prints the plan as a table
//! with the predicted TPOT and its breakdown, and what every other strategy would predict,
//! or the whole schedule as JSON. Nothing is measured or run: "what if I add my gaming
//! PC?" is answered by adding it to the devices file.

use std::io::Read;
use std::path::Path;

use scheduler::{DeviceProfile, ModelProfile, Options, Strategy};

use serde_json::json;

use crate::cli::PlanArgs;
use crate::runtime::ring::planning::{forecast, table};

pub fn run(args: PlanArgs) -> Result<(), Box<dyn std::error::Error>> {
    let mut devices: Vec<DeviceProfile> = serde_json::from_str(&std::fs::read_to_string(&args.devices).map_err(|e| format!("cannot read {}: {e}", args.devices.display()))?)
        .map_err(|e| format!("{} is not a list of device profiles: {e}", args.devices.display()))?;
    // Profiles as `hearth profile` writes them: members on one machine each report its RAM.
    scheduler::share_host_memory(&mut devices);
    let model = load_model(&args.model.resolve()?, args.ctx_size, args.kv.types())?;
    let strategy: Strategy = args.plan_strategy.parse()?;
    let schedule_with = |strategy| scheduler::schedule(&devices, &model, &Options { strategy, streams: args.parallel.max(1), ..Options::default() });
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
        let forecast = forecast(&devices, &model, &chosen);
        println!("{}", serde_json::to_string_pretty(&json!({ "model": model, "schedule": chosen, "forecast": forecast, "other_strategies": others }))?);
    } else {
        print!("{}", table(&devices, &model, &chosen, &others));
    }
    Ok(())
}

/// A GGUF (by its magic) or a model-profile JSON.
fn load_model(path: &Path, ctx: usize, kv: engine::CacheTypes) -> Result<ModelProfile, Box<dyn std::error::Error>> {
    let mut magic = [0u8; 4];
    std::fs::File::open(path).and_then(|mut f| f.read_exact(&mut magic)).map_err(|e| format!("cannot read {}: {e}", path.display()))?;
    if &magic == b"GGUF" {
        let file = engine::ModelFile::open(path)?;
        let name = path.file_stem().map_or_else(|| "model".into(), |s| s.to_string_lossy().into_owned());
        return Ok(crate::runtime::profiling::model::from_gguf(&file, &name, ctx, kv));
    }
    let text = std::fs::read_to_string(path)?;
    Ok(serde_json::from_str(&text).map_err(|e| format!("{} is neither a GGUF nor a model-profile JSON: {e}", path.display()))?)
}
