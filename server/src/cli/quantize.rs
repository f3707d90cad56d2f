//! `hearth quantize`: a GGUF into another weight type, by llama.cpp's own quantizer (the
//! same code as `llama-quantize`), so a user with an F16 or Q8_0 download can make the
//! K-quant or IQ file that fits their devices without building llama.cpp.

use crate::cli::QuantizeArgs;

pub fn run(args: QuantizeArgs) -> Result<(), Box<dyn std::error::Error>> {
    let wanted = args.ty.to_ascii_lowercase();
    let Some(ftype) = engine::reference::file_type(&wanted) else {
        let names: Vec<&str> = engine::reference::FILE_TYPES.iter().map(|(n, _)| *n).collect();
        return Err(format!("--type {}: use one of {}", args.ty, names.join(", ")).into());
    };
    if !args.input.is_file() {
        return Err(format!("{} is not a file", args.input.display()).into());
    }
    engine::reference::quantize(&args.input, &args.output, ftype, args.threads.max(1))?;
    let size = std::fs::metadata(&args.output)?.len();
    println!("{} ({wanted}): {size} bytes", args.output.display());
    Ok(())
}
