//! The server crate's rooms depend on each other one way only (docs/architecture.md, "The
//! rooms"): cli -> http -> runtime, and every room on the leaves (error, metrics, models,
//! process), which name no room. Inside the rooms: generation does not know the ring, the
//! ring knows generation only through what `generation/mod.rs` re-exports, and http knows
//! neither the ring, the batcher nor the engine's stages. `RULES` is that table; a helper
//! put in the wrong room fails here rather than in a reviewer's head.
//!
//! Every file under `src/` is parsed with `syn`, not searched line by line, so a rule holds
//! however the path is written: grouped, glob and renamed imports, `pub use`, `super::`
//! and `self::` (resolved against the file's module and the inline `mod`s around them),
//! names an earlier `use` brought in (`use crate::runtime;` then `runtime::ring::X`), and
//! paths in expressions, types, patterns and the token bodies of macros
//! (`tracing::info!("{}", super::planning::table(..))`).
//!
//! Two choices:
//! - Re-exports are not followed. A room's `pub use` is its public face: the `pub use`
//!   itself is checked in the room that writes it, and naming what it re-exports
//!   (`crate::runtime::generation::Pipeline`) is allowed though the item lives in a module
//!   the namer must not reach.
//! - Test code counts like any other (`#[cfg(test)]` modules, `batcher_tests.rs`): the docs
//!   give tests no exemption, and a test that needs another room's internals says the seam
//!   is in the wrong place.
//!
//! Violations read `file:line: <module> names <path> (<why>)`, the file relative to `src/`.

use std::collections::{HashMap, HashSet};
use std::fmt;
use std::path::Path;

use proc_macro2::{Spacing, Span, TokenStream, TokenTree};
use syn::visit::{self, Visit};

/// (room, what it must not name, why). A room is a module and every module inside it; a
/// forbidden path forbids everything under it. `m::*` forbids the modules inside `m` but
/// not the names `m` itself declares or re-exports.
const RULES: &[(&str, &[&str], &str)] = &[
    ("crate::runtime", &["crate::http", "crate::cli"], "runtime knows nothing of HTTP or the command line"),
    ("crate::runtime::generation", &["crate::runtime::ring"], "generation does not know the ring's workings"),
    ("crate::runtime::ring", &["crate::runtime::generation::*"], "the ring knows generation only through what generation re-exports"),
    ("crate::http", &["crate::cli"], "http does not know the command line"),
    ("crate::http", &["crate::runtime::ring"], "http does not know the ring"),
    ("crate::http", &["crate::runtime::generation::Batcher", "crate::runtime::generation::BatcherConfig"], "http does not know the batcher"),
    // The engine's `stage` module and what engine/src/lib.rs re-exports from it.
    (
        "crate::http",
        &["engine::stage", "engine::Stage", "engine::StageConfig", "engine::StageInput", "engine::StageOutput", "engine::BatchToken", "engine::Logits"],
        "http does not know the engine's stages",
    ),
    ("crate::error", &["crate::runtime", "crate::http", "crate::cli", "crate::metrics", "crate::process"], LEAF),
    ("crate::metrics", &["crate::runtime", "crate::http", "crate::cli", "crate::error", "crate::process"], LEAF),
    ("crate::process", &["crate::runtime", "crate::http", "crate::cli", "crate::error", "crate::metrics"], LEAF),
    ("crate::models", &["crate::runtime", "crate::http", "crate::cli", "crate::metrics", "crate::process"], LEAF),
    // Pulling from the hub writes its cache's small files through process's hardened writes.
    ("crate::hub", &["crate::runtime", "crate::http", "crate::cli", "crate::metrics"], "the hub client is a leaf beside models"),
];

const LEAF: &str = "a leaf names no room, and no leaf but error and models";

/// Segments of a path; an absolute one starts with `crate`, or with an external crate's
/// name (`engine`, `std`), or with `::` when written that way.
type Segments = Vec<String>;

fn segments(path: &str) -> Segments {
    path.split("::").map(str::to_string).collect()
}

/// What one module declares and imports. Imports are kept as written and resolved only
/// when a path goes through them, once every module of the crate is known.
#[derive(Default)]
struct Scope {
    /// Names of the items it declares (functions, types, traits, consts, macros...).
    items: HashSet<String>,
    /// Bound name -> the path it names (`use a::b as c` binds `c` to `a::b`).
    names: HashMap<String, Segments>,
    globs: Vec<Segments>,
}

/// Every module of the crate (files and inline `mod`s) with what it declares and imports,
/// and each file with its module and syntax tree.
#[derive(Default)]
struct Crate {
    modules: HashMap<Segments, Scope>,
    files: Vec<(String, Segments, syn::File)>,
}

/// What a path names, and the import it went through if its first segment is one.
struct Resolved {
    path: Segments,
    via: Option<Segments>,
}

struct Violation {
    file: String,
    line: usize,
    module: String,
    path: String,
    why: &'static str,
}

impl fmt::Display for Violation {
    fn fmt(&self, f: &mut fmt::Formatter) -> fmt::Result {
        write!(f, "{}:{}: {} names {} ({})", self.file, self.line, self.module, self.path, self.why)
    }
}

/// A path that starts outside this crate; `hearth::` is this crate seen from `main.rs`.
fn external(segs: &[String]) -> Segments {
    let mut path = segs.to_vec();
    if path.first().is_some_and(|s| s == "hearth") {
        path[0] = "crate".to_string();
    }
    path
}

/// A file's module from its path under `src/`: `a/b.rs` and `a/b/mod.rs` are `crate::a::b`;
/// `lib.rs` and `main.rs` are the root (see `external` for main.rs's `hearth::`).
fn module_of(file: &str) -> Segments {
    let mut module = vec!["crate".to_string()];
    module.extend(file.trim_end_matches(".rs").split('/').map(str::to_string));
    if matches!(module.last().map(String::as_str), Some("mod" | "lib" | "main")) {
        module.pop();
    }
    module
}

/// What one leaf of a `use` tree binds.
enum Binds {
    Name(String),
    Glob,
    /// `use x as _` brings a trait's methods in but binds no name.
    Nothing,
}

/// One leaf of a `use` tree: the path it names, what it binds, where it is written.
struct Import {
    path: Segments,
    binds: Binds,
    at: Span,
}

fn imports(item: &syn::ItemUse) -> Vec<Import> {
    fn walk(tree: &syn::UseTree, prefix: &mut Segments, out: &mut Vec<Import>) {
        // `{self}` in a group names the group's prefix.
        let leaf = |prefix: &Segments, ident: &syn::Ident| {
            let mut path = prefix.clone();
            if ident != "self" {
                path.push(ident.to_string());
            }
            path
        };
        match tree {
            syn::UseTree::Path(p) => {
                prefix.push(p.ident.to_string());
                walk(&p.tree, prefix, out);
                prefix.pop();
            }
            syn::UseTree::Name(n) => {
                let path = leaf(prefix, &n.ident);
                let binds = Binds::Name(path.last().cloned().unwrap_or_default());
                out.push(Import { path, binds, at: n.ident.span() });
            }
            syn::UseTree::Rename(r) => {
                let binds = if r.rename == "_" { Binds::Nothing } else { Binds::Name(r.rename.to_string()) };
                out.push(Import { path: leaf(prefix, &r.ident), binds, at: r.ident.span() });
            }
            syn::UseTree::Glob(g) => out.push(Import { path: prefix.clone(), binds: Binds::Glob, at: g.star_token.spans[0] }),
            syn::UseTree::Group(g) => g.items.iter().for_each(|t| walk(t, prefix, out)),
        }
    }
    let mut prefix = if item.leading_colon.is_some() { vec!["::".to_string()] } else { Vec::new() };
    let mut out = Vec::new();
    walk(&item.tree, &mut prefix, &mut out);
    out
}

/// Pass one: every module's items and imports, so a path can be resolved through an
/// import written after it, or through a glob (`use super::*`).
struct Collector<'a> {
    modules: &'a mut HashMap<Segments, Scope>,
    module: Segments,
}

impl Collector<'_> {
    fn scope(&mut self) -> &mut Scope {
        self.modules.entry(self.module.clone()).or_default()
    }
}

impl<'ast> Visit<'ast> for Collector<'_> {
    fn visit_item(&mut self, item: &'ast syn::Item) {
        let ident = match item {
            syn::Item::Const(i) => Some(&i.ident),
            syn::Item::Enum(i) => Some(&i.ident),
            syn::Item::Fn(i) => Some(&i.sig.ident),
            syn::Item::Macro(i) => i.ident.as_ref(),
            syn::Item::Static(i) => Some(&i.ident),
            syn::Item::Struct(i) => Some(&i.ident),
            syn::Item::Trait(i) => Some(&i.ident),
            syn::Item::Type(i) => Some(&i.ident),
            syn::Item::Union(i) => Some(&i.ident),
            _ => None,
        };
        if let Some(ident) = ident {
            self.scope().items.insert(ident.to_string());
        }
        visit::visit_item(self, item);
    }

    fn visit_item_mod(&mut self, m: &'ast syn::ItemMod) {
        self.module.push(m.ident.to_string());
        self.scope();
        visit::visit_item_mod(self, m);
        self.module.pop();
    }

    // A `use` in a function body is scoped to its block; counting it for the whole module
    // can only make more paths resolve, never hide one.
    fn visit_item_use(&mut self, item: &'ast syn::ItemUse) {
        for import in imports(item) {
            match import.binds {
                Binds::Name(name) => {
                    self.scope().names.insert(name, import.path);
                }
                Binds::Glob => self.scope().globs.push(import.path),
                Binds::Nothing => {}
            }
        }
    }
}

impl Crate {
    /// Parses the files, given as (path under `src/`, source).
    fn parse(files: impl IntoIterator<Item = (String, String)>) -> Crate {
        let mut krate = Crate::default();
        for (file, text) in files {
            let ast = syn::parse_file(&text).unwrap_or_else(|e| panic!("{file}:{}: {e}", e.span().start().line));
            let module = module_of(&file);
            krate.modules.entry(module.clone()).or_default();
            Collector { modules: &mut krate.modules, module: module.clone() }.visit_file(&ast);
            krate.files.push((file, module, ast));
        }
        krate
    }

    fn check(&self) -> Vec<Violation> {
        let mut found = Vec::new();
        for (file, module, ast) in &self.files {
            Checker { krate: self, file, module: module.clone(), found: &mut found }.visit_file(ast);
        }
        found
    }

    /// The absolute path `segs` names when written in `module`. Import chains deeper than a
    /// few steps are cycles (`use tokio;` binds `tokio` to itself): they name an external
    /// crate.
    fn resolve(&self, module: &[String], segs: &[String], depth: usize) -> Option<Resolved> {
        if depth > 16 {
            return None;
        }
        let (first, mut rest) = segs.split_first()?;
        let mut head = match first.as_str() {
            "::" => return Some(Resolved { path: external(rest), via: None }),
            // `$crate` reaches here as `crate`: the token scan drops the `$`.
            "crate" => vec!["crate".to_string()],
            "self" => module.to_vec(),
            "super" => module[..module.len().saturating_sub(1)].to_vec(),
            name => match self.lookup(module, name, depth + 1) {
                Some(Resolved { mut path, via }) => {
                    path.extend(rest.iter().cloned());
                    return Some(Resolved { path, via });
                }
                None => return Some(Resolved { path: external(segs), via: None }),
            },
        };
        while rest.first().is_some_and(|s| s == "super") {
            head.pop();
            rest = &rest[1..];
        }
        head.extend(rest.iter().cloned());
        Some(Resolved { path: head, via: None })
    }

    /// What a bare first segment means in `module`: one of its own imports (followed), an
    /// item or module it declares, or a name a glob import brings in from another module
    /// (taken as that module's name, not followed: see "re-exports" in the header). `None`
    /// for an external crate or a prelude name.
    fn lookup(&self, module: &[String], name: &str, depth: usize) -> Option<Resolved> {
        let scope = self.modules.get(module)?;
        if let Some(target) = scope.names.get(name) {
            let r = self.resolve(module, target, depth + 1)?;
            return Some(Resolved { via: Some(r.path.clone()), path: r.path });
        }
        let within = |m: &[String]| [m, &[name.to_string()]].concat();
        if scope.items.contains(name) || self.modules.contains_key(&within(module)) {
            return Some(Resolved { path: within(module), via: None });
        }
        scope.globs.iter().find_map(|glob| {
            let from = self.resolve(module, glob, depth + 1)?.path;
            let has = self.modules.get(&from).is_some_and(|s| s.items.contains(name) || s.names.contains_key(name));
            (has || self.modules.contains_key(&within(&from))).then(|| Resolved { path: within(&from), via: None })
        })
    }

    fn forbids(&self, forbidden: &str, path: &[String]) -> bool {
        match forbidden.strip_suffix("::*") {
            Some(parent) => {
                let parent = segments(parent);
                path.len() > parent.len() && path.starts_with(&parent) && self.modules.contains_key(&path[..=parent.len()])
            }
            None => path.starts_with(&segments(forbidden)),
        }
    }

    /// The rule `path`, written in `module`, breaks. A path through an import the rule
    /// forbids is not reported again: the `use` already was.
    fn broken_rule(&self, module: &[String], r: &Resolved) -> Option<&'static str> {
        RULES.iter().filter(|(room, _, _)| module.starts_with(&segments(room))).find_map(|&(_, forbidden, why)| {
            let breaks = |p: &[String]| forbidden.iter().any(|f| self.forbids(f, p));
            (breaks(&r.path) && !r.via.as_deref().is_some_and(breaks)).then_some(why)
        })
    }
}

/// Pass two: resolves every path of one file and records the ones against the rules.
struct Checker<'a> {
    krate: &'a Crate,
    file: &'a str,
    module: Segments,
    found: &'a mut Vec<Violation>,
}

impl Checker<'_> {
    fn check(&mut self, segs: &[String], at: Span) {
        let Some(r) = self.krate.resolve(&self.module, segs, 0) else { return };
        if let Some(why) = self.krate.broken_rule(&self.module, &r) {
            self.found.push(Violation { file: self.file.to_string(), line: at.start().line, module: self.module.join("::"), path: r.path.join("::"), why });
        }
    }

    /// Paths in a macro's tokens: `a::b` runs, with or without a leading `::`. A lone
    /// identifier is skipped: in tokens it cannot be told from a local variable.
    fn scan(&mut self, tokens: TokenStream) {
        let mut run: Segments = Vec::new();
        let mut at = Span::call_site();
        let mut open = false; // the run ends in `::` and wants an identifier
        let mut tokens = tokens.into_iter().peekable();
        while let Some(token) = tokens.next() {
            match &token {
                TokenTree::Ident(ident) if open || run.is_empty() => {
                    if run.is_empty() {
                        at = ident.span();
                    }
                    run.push(ident.to_string());
                    open = false;
                    continue;
                }
                TokenTree::Punct(p) if p.as_char() == ':' && p.spacing() == Spacing::Joint && !open => {
                    if matches!(tokens.peek(), Some(TokenTree::Punct(q)) if q.as_char() == ':') {
                        tokens.next();
                        if run.is_empty() {
                            at = p.span();
                            run.push("::".to_string());
                        }
                        open = true;
                        continue;
                    }
                }
                _ => {}
            }
            // Anything else ends the run; an identifier starts the next one.
            self.flush(&mut run, at);
            open = false;
            match token {
                TokenTree::Group(g) => self.scan(g.stream()),
                TokenTree::Ident(ident) => {
                    at = ident.span();
                    run.push(ident.to_string());
                }
                _ => {}
            }
        }
        self.flush(&mut run, at);
    }

    fn flush(&mut self, run: &mut Segments, at: Span) {
        if run.len() > 1 {
            self.check(run, at);
        }
        run.clear();
    }
}

impl<'ast> Visit<'ast> for Checker<'_> {
    fn visit_item_mod(&mut self, m: &'ast syn::ItemMod) {
        self.module.push(m.ident.to_string());
        visit::visit_item_mod(self, m);
        self.module.pop();
    }

    fn visit_item_use(&mut self, item: &'ast syn::ItemUse) {
        for import in imports(item) {
            self.check(&import.path, import.at);
        }
    }

    fn visit_path(&mut self, path: &'ast syn::Path) {
        let mut segs: Segments = path.leading_colon.as_ref().map(|_| "::".to_string()).into_iter().collect();
        segs.extend(path.segments.iter().map(|s| s.ident.to_string()));
        let at = path.segments.first().map_or_else(Span::call_site, |s| s.ident.span());
        self.check(&segs, at);
        visit::visit_path(self, path);
    }

    fn visit_macro(&mut self, mac: &'ast syn::Macro) {
        self.visit_path(&mac.path);
        self.scan(mac.tokens.clone());
    }
}

fn sources(dir: &Path, src: &Path, out: &mut Vec<(String, String)>) {
    for entry in std::fs::read_dir(dir).unwrap() {
        let path = entry.unwrap().path();
        if path.is_dir() {
            sources(&path, src, out);
        } else if path.extension().is_some_and(|e| e == "rs") {
            let rel = path.strip_prefix(src).unwrap().to_string_lossy().replace('\\', "/");
            out.push((rel, std::fs::read_to_string(&path).unwrap()));
        }
    }
}

#[test]
fn rooms_depend_on_each_other_one_way() {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let mut files = Vec::new();
    sources(&src, &src, &mut files);
    assert!(files.len() > 20, "found only {} source files under {}", files.len(), src.display());
    let found = Crate::parse(files).check();
    let wrong: Vec<String> = found.iter().map(Violation::to_string).collect();
    assert!(wrong.is_empty(), "paths against the arrows (under server/src):\n{}", wrong.join("\n"));
}

/// The (file, line, path named) of every violation in a crate made of `files`.
fn violations(files: &[(&str, &str)]) -> Vec<(String, usize, String)> {
    let krate = Crate::parse(files.iter().map(|&(f, s)| (f.to_string(), s.to_string())));
    krate.check().into_iter().map(|v| (v.file, v.line, v.path)).collect()
}

fn at(file: &str, line: usize, path: &str) -> (String, usize, String) {
    (file.to_string(), line, path.to_string())
}

#[test]
fn the_checker_sees_paths_however_they_are_written() {
    let mut found = violations(&[
        ("lib.rs", "pub mod cli;\npub mod http;\npub mod runtime;"),
        ("cli/mod.rs", "pub fn foo() {}"),
        ("runtime/mod.rs", "pub mod generation;\npub mod head;\npub mod ring;"),
        ("runtime/generation/mod.rs", "mod batcher;\npub use batcher::Batcher;"),
        // `self::` and `super::` from a test module inline in a file.
        ("runtime/generation/batcher.rs", "pub struct Batcher;\nmod tests {\n    use self::super::super::super::ring::Plan;\n}"),
        // Generation's re-export is its public face; the module behind it is not.
        ("runtime/ring/mod.rs", "pub mod board;\nuse crate::runtime::generation::Batcher;\nfn f() { crate::runtime::generation::batcher::Batcher; }"),
        ("runtime/ring/board.rs", "pub struct Z;"),
        // A grouped import, `super::super::`, a fully qualified path in a body and one in a
        // macro's tokens (through main.rs's name for the library).
        (
            "runtime/head.rs",
            "use crate::{http::X};\nuse super::super::http::Y;\nfn f() {\n    crate::cli::foo();\n    tracing::info!(\"{}\", ::hearth::cli::foo());\n}",
        ),
        ("http/mod.rs", "pub mod admin;"),
        // A re-export, a stage type, a path through an earlier import, a name from a glob.
        ("http/admin.rs", "pub use crate::runtime::ring::board::Z;\nuse crate::runtime;\nuse crate::runtime::generation::*;\nfn f(s: engine::Stage) { runtime::ring::board::Z; Batcher::new(); }"),
    ]);
    let mut want = vec![
        at("runtime/generation/batcher.rs", 3, "crate::runtime::ring::Plan"),
        at("runtime/ring/mod.rs", 3, "crate::runtime::generation::batcher::Batcher"),
        at("runtime/head.rs", 1, "crate::http::X"),
        at("runtime/head.rs", 2, "crate::http::Y"),
        at("runtime/head.rs", 4, "crate::cli::foo"),
        at("runtime/head.rs", 5, "crate::cli::foo"),
        at("http/admin.rs", 1, "crate::runtime::ring::board::Z"),
        at("http/admin.rs", 4, "engine::Stage"),
        at("http/admin.rs", 4, "crate::runtime::ring::board::Z"),
        at("http/admin.rs", 4, "crate::runtime::generation::Batcher::new"),
    ];
    found.sort();
    want.sort();
    assert_eq!(found, want);
}

#[test]
fn a_clean_crate_passes() {
    let found = violations(&[
        ("lib.rs", "pub mod error;\npub mod http;\npub mod runtime;\npub use error::Error;"),
        ("error.rs", "pub enum Error {}\nuse crate::models;"),
        ("runtime/mod.rs", "pub mod generation;\npub mod ring;\nuse ring::board::PlanView;\npub trait Runtime { fn plan(&self) -> PlanView; }"),
        ("runtime/generation/mod.rs", "mod pipeline;\npub use pipeline::Pipeline;"),
        ("runtime/generation/pipeline.rs", "pub trait Pipeline {}\n#[cfg(test)]\nmod tests { use super::*; }"),
        ("runtime/ring/mod.rs", "pub mod board;\nimpl crate::runtime::generation::Pipeline for Ring {}\nfn f() { tracing::info!(\"{}\", super::super::Error); }"),
        ("runtime/ring/board.rs", "pub struct PlanView;"),
        ("http/mod.rs", "use crate::runtime::{Runtime, generation::{self, Pipeline}};\nuse engine::{sampler::Sampler, Error as EngineError};\nfn f(r: &dyn Runtime) { generation::Pipeline; crate::Error; }"),
    ]);
    assert_eq!(found, Vec::new());
}
