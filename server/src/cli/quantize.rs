//! `hearth quantize`: a GGUF into another weight type, by llama.cpp's own quantizer (the
//! same code as `llama-quantize`), so a user with an F16 or Q8_0 download can make the
//! K-quant or IQ file that fits their devices without building llama.cpp; and into a split
//! set (`--split-max-size`, as `gguf-split` writes it) for disks, hosts or tools that limit
//! a file's size.

use std::path::{Path, PathBuf};

use engine::gguf::split::prefix_of;

use crate::cli::QuantizeArgs;

pub fn run(args: QuantizeArgs) -> Result<(), Box<dyn std::error::Error>> {
    let ftype = match &args.ty {
        Some(ty) => {
            let wanted = ty.to_ascii_lowercase();
            let Some(ftype) = engine::reference::file_type(&wanted) else {
                let names: Vec<&str> = engine::reference::FILE_TYPES.iter().map(|(n, _)| *n).collect();
                return Err(format!("--type {ty}: use one of {}", names.join(", ")).into());
            };
            Some(ftype)
        }
        None => None,
    };
    let split = match &args.split_max_size {
        Some(s) => Some(engine::gguf::split::parse_size(s).ok_or_else(|| format!("--split-max-size {s}: give a size such as 2G, 500M or a number of bytes"))?),
        None => None,
    };
    if !args.input.is_file() {
        return Err(format!("{} is not a file", args.input.display()).into());
    }
    let Some(max_bytes) = split else {
        let Some(ftype) = ftype else {
            return Err("say what to write: --type TYPE to requantize, --split-max-size SIZE to split, or both".into());
        };
        engine::reference::quantize(&args.input, &args.output, ftype, args.threads.max(1))?;
        let size = std::fs::metadata(&args.output)?.len();
        println!("{}: {size} bytes", args.output.display());
        return Ok(());
    };
    // Quantized into one file beside the output first, then split: llama.cpp's quantizer
    // writes one file (or keeps the input's split), not a size limit.
    let quantized = ftype.map(|ftype| -> Result<PathBuf, Box<dyn std::error::Error>> {
        let tmp = sibling(&args.output, ".quantizing.gguf");
        engine::reference::quantize(&args.input, &tmp, ftype, args.threads.max(1))?;
        Ok(tmp)
    });
    let quantized = quantized.transpose()?;
    let source = engine::gguf::GgufFile::open(quantized.as_deref().unwrap_or(&args.input));
    let written = source.and_then(|file| engine::gguf::split::write_split(&file, &prefix_of(&args.output), max_bytes));
    if let Some(tmp) = &quantized {
        let _ = std::fs::remove_file(tmp);
    }
    for part in written? {
        let size = std::fs::metadata(&part)?.len();
        println!("{}: {size} bytes", part.display());
    }
    Ok(())
}

fn sibling(output: &Path, suffix: &str) -> PathBuf {
    PathBuf::from(format!("{}{suffix}", prefix_of(output)))
}
