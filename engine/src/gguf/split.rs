//! Split GGUF models: llama.cpp's `gguf-split` layout, which the hub uses for every model
//! too large for one file (`name-00001-of-00003.gguf`). Every part is a whole GGUF file;
//! the first holds the model's metadata, each holds some of the tensors with offsets into
//! its own data section, and each says where it stands:
//!
//! - `split.no`: this part's index, from 0 (u16);
//! - `split.count`: how many parts (u16);
//! - `split.tensors.count`: the tensors of all parts together (i32).
//!
//! Parts are found by name, as llama.cpp finds them: `PREFIX-%05d-of-%05d.gguf`.

use std::path::{Path, PathBuf};

use super::{GgufFile, GgufWriter};
use crate::Result;

/// `split.no`.
pub const SPLIT_NO: &str = "split.no";
/// `split.count`.
pub const SPLIT_COUNT: &str = "split.count";
/// `split.tensors.count`.
pub const SPLIT_TENSORS_COUNT: &str = "split.tensors.count";
/// The most parts a set may have: `split.count` is a u16.
pub const MAX_PARTS: u64 = u16::MAX as u64;

/// `name-00001-of-00003.gguf` -> (`name`, 1, 3): a split part's name, its number from 1
/// and the number of parts. Works on a bare name or a path (the prefix keeps the folders).
pub fn split_part(name: &str) -> Option<(&str, u32, u32)> {
    let stem = name.strip_suffix(".gguf").or_else(|| name.strip_suffix(".GGUF"))?;
    let (rest, count) = stem.rsplit_once("-of-")?;
    let (prefix, no) = rest.rsplit_once('-')?;
    let digits = |s: &str| s.len() == 5 && s.bytes().all(|b| b.is_ascii_digit());
    if !digits(no) || !digits(count) {
        return None;
    }
    Some((prefix, no.parse().ok()?, count.parse().ok()?))
}

/// The file name of part `no` (from 1) of `count`: `PREFIX-0000no-of-0count.gguf`.
pub fn part_name(prefix: &str, no: u64, count: u64) -> String {
    format!("{prefix}-{no:05}-of-{count:05}.gguf")
}

/// The prefix a split set written to `out` is numbered after: `out.gguf` -> `out`.
pub fn prefix_of(out: &Path) -> String {
    let s = out.to_string_lossy();
    s.strip_suffix(".gguf").unwrap_or(&s).to_string()
}

/// The paths of every part of the set `path` belongs to, as part `no` (from 0) of `count`:
/// its siblings named after the same prefix. `None` when its name does not follow the
/// scheme for that place in the set (a renamed part: its siblings cannot be found).
pub fn part_paths(path: &Path, no: u64, count: u64) -> Option<Vec<PathBuf>> {
    let name = path.file_name()?.to_str()?;
    let (prefix, n, c) = split_part(name)?;
    if u64::from(n) != no + 1 || u64::from(c) != count {
        return None;
    }
    let dir = path.parent().unwrap_or(Path::new(""));
    Some((1..=count).map(|k| dir.join(part_name(prefix, k, count))).collect())
}

/// Writes `src` (one file or a split set) again as a split set of parts whose tensor data
/// is at most `max_bytes` each, tensor by tensor (never more than one in memory), with
/// its metadata and tensors unchanged. Returns the parts' paths.
pub fn write_split(src: &GgufFile, prefix: &str, max_bytes: u64) -> Result<Vec<PathBuf>> {
    let mut w = GgufWriter::from_meta(src.meta());
    for t in src.tensors() {
        w.add_tensor_later(t.name.clone(), t.ty, &t.dims)?;
    }
    w.write_split_streaming(prefix, max_bytes, |name, _, _, buf| {
        if let Some(t) = src.tensor(name) {
            buf.copy_from_slice(src.tensor_bytes(t));
        }
    })
}

/// `2G`, `500M`, `4096K` or plain bytes: gguf-split's `--split-max-size` (powers of 1000,
/// as gguf-split counts them).
pub fn parse_size(s: &str) -> Option<u64> {
    let s = s.trim();
    let (digits, unit) = match s.char_indices().find(|(_, c)| !c.is_ascii_digit()) {
        Some((i, _)) => s.split_at(i),
        None => (s, ""),
    };
    let n: u64 = digits.parse().ok()?;
    let scale = match unit.to_ascii_uppercase().as_str() {
        "" => 1,
        "K" | "KB" => 1_000,
        "M" | "MB" => 1_000_000,
        "G" | "GB" => 1_000_000_000,
        _ => return None,
    };
    n.checked_mul(scale).filter(|&b| b > 0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_of_a_split_set() {
        assert_eq!(split_part("m-Q4_K_M-00002-of-00003.gguf"), Some(("m-Q4_K_M", 2, 3)));
        assert_eq!(split_part("dir/x-00001-of-00010.GGUF"), Some(("dir/x", 1, 10)));
        assert_eq!(split_part("m-0001-of-00003.gguf"), None, "four digits");
        assert_eq!(split_part("m.gguf"), None);
        assert_eq!(part_name("a/b", 7, 12), "a/b-00007-of-00012.gguf");
        assert_eq!(prefix_of(Path::new("/m/out.gguf")), "/m/out");
        assert_eq!(prefix_of(Path::new("/m/out")), "/m/out");
        let paths = part_paths(Path::new("/m/big-00002-of-00003.gguf"), 1, 3).unwrap();
        assert_eq!(paths, [Path::new("/m/big-00001-of-00003.gguf"), Path::new("/m/big-00002-of-00003.gguf"), Path::new("/m/big-00003-of-00003.gguf")]);
        assert_eq!(part_paths(Path::new("/m/big-00002-of-00003.gguf"), 0, 3), None, "the name says another part");
        assert_eq!(part_paths(Path::new("/m/renamed.gguf"), 0, 3), None);
    }

    #[test]
    fn sizes_as_gguf_split_reads_them() {
        assert_eq!(parse_size("2G"), Some(2_000_000_000));
        assert_eq!(parse_size("500M"), Some(500_000_000));
        assert_eq!(parse_size("64k"), Some(64_000));
        assert_eq!(parse_size("4096"), Some(4096));
        assert_eq!(parse_size("0"), None);
        assert_eq!(parse_size("2T"), None);
        assert_eq!(parse_size("G"), None);
    }
}
