//! The server crate's rooms depend on each other one way only (see `src/lib.rs`):
//! cli -> http -> runtime, and every room on the leaves (error, metrics, process), which
//! depend on no room. Read from the `use` lines and paths of every source file, so a
//! helper put in the wrong room fails here rather than in a reviewer's head.

use std::path::{Path, PathBuf};

/// (room, rooms and leaves it must not name)
const FORBIDDEN: &[(&str, &[&str])] = &[
    ("runtime", &["crate::http", "crate::cli"]),
    ("http", &["crate::cli"]),
    ("error.rs", &["crate::runtime", "crate::http", "crate::cli", "crate::metrics", "crate::process"]),
    ("metrics.rs", &["crate::runtime", "crate::http", "crate::cli", "crate::error", "crate::process"]),
    ("process.rs", &["crate::runtime", "crate::http", "crate::cli", "crate::error", "crate::metrics"]),
    ("models.rs", &["crate::runtime", "crate::http", "crate::cli", "crate::metrics", "crate::process"]),
];

fn sources(dir: &Path, out: &mut Vec<PathBuf>) {
    for entry in std::fs::read_dir(dir).unwrap() {
        let path = entry.unwrap().path();
        if path.is_dir() {
            sources(&path, out);
        } else if path.extension().is_some_and(|e| e == "rs") {
            out.push(path);
        }
    }
}

#[test]
fn rooms_depend_on_each_other_one_way() {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let mut files = Vec::new();
    sources(&src, &mut files);
    assert!(files.len() > 20, "found only {} source files under {}", files.len(), src.display());
    let mut wrong = Vec::new();
    for file in &files {
        let rel = file.strip_prefix(&src).unwrap().to_string_lossy().replace('\\', "/");
        let room = rel.split('/').next().unwrap();
        let text = std::fs::read_to_string(file).unwrap();
        for (r, forbidden) in FORBIDDEN {
            if *r != room {
                continue;
            }
            for (n, line) in text.lines().enumerate() {
                let code = line.split("//").next().unwrap_or("");
                for f in *forbidden {
                    if code.contains(f) {
                        wrong.push(format!("{rel}:{}: {} names {f}", n + 1, room));
                    }
                }
            }
        }
    }
    assert!(wrong.is_empty(), "imports against the arrows:\n{}", wrong.join("\n"));
}
