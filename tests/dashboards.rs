//! The shipped Grafana dashboard and Prometheus config against the real Prometheus: a head
//! with two workers and n-gram speculation (so every panel has something to show) is
//! scraped with `dashboards/prometheus.yml`, and after some traffic EVERY PromQL expression
//! of `dashboards/hearth.json` is evaluated through Prometheus's HTTP API. An expression
//! fails the test if Prometheus refuses it, if it names a metric hearth does not export,
//! or if it selects no series at all (a misspelt label, or a metric that never appears).
//!
//! Needs the `prometheus` binary (Debian package `prometheus`). Without it the test says
//! so and passes, unless `HEARTH_REQUIRE_PROMETHEUS=1` (CI sets it).

mod common;

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use common::Served;
use serde_json::Value;

/// The scrape target `dashboards/prometheus.yml` names (the head's compose service); the
/// test points it at its own head.
const SHIPPED_TARGET: &str = "\"hearth:8080\"";
/// What Grafana puts in for its built-in variables when the test evaluates an expression.
const GRAFANA_BUILTINS: &[(&str, &str)] = &[
    ("$__rate_interval", "1m"),
    ("$__interval", "15s"),
    ("$__range", "5m"),
];
/// The dashboard's own variables, at their "All" value.
const DASHBOARD_VARIABLES: &[(&str, &str)] = &[("$device", ".*")];

fn repo() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("..")
}

fn prometheus_binary() -> Option<PathBuf> {
    let path = std::env::var_os("PATH").unwrap_or_default();
    std::env::split_paths(&path)
        .map(|d| d.join("prometheus"))
        .find(|p| p.is_file())
}

/// Prometheus on a free loopback port, killed with the test.
struct Prometheus {
    child: Child,
    addr: String,
    _dir: TempDir,
}

impl Drop for Prometheus {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

struct TempDir(PathBuf);

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

fn start_prometheus(binary: &Path, head: &str) -> Prometheus {
    let shipped = std::fs::read_to_string(repo().join("dashboards/prometheus.yml")).unwrap();
    assert!(
        shipped.contains(SHIPPED_TARGET),
        "dashboards/prometheus.yml no longer scrapes {SHIPPED_TARGET}"
    );
    let dir =
        TempDir(std::env::temp_dir().join(format!("hearth-prometheus-{}", std::process::id())));
    std::fs::create_dir_all(&dir.0).unwrap();
    let config = dir.0.join("prometheus.yml");
    std::fs::write(
        &config,
        shipped.replace(SHIPPED_TARGET, &format!("\"{head}\"")),
    )
    .unwrap();
    let addr = format!("127.0.0.1:{}", common::free_port());
    let child = Command::new(binary)
        .arg(format!("--config.file={}", config.display()))
        .arg(format!(
            "--storage.tsdb.path={}",
            dir.0.join("data").display()
        ))
        .arg(format!("--web.listen-address={addr}"))
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .expect("start prometheus");
    Prometheus {
        child,
        addr,
        _dir: dir,
    }
}

fn url_encode(s: &str) -> String {
    s.bytes()
        .map(|b| match b {
            b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'-' | b'_' | b'.' | b'~' => {
                (b as char).to_string()
            }
            _ => format!("%{b:02X}"),
        })
        .collect()
}

/// The `data` of a Prometheus HTTP API answer, or the error it gave.
fn prometheus_api(prom: &str, path: &str) -> Result<Value, String> {
    let r = common::http(prom, "GET", path, "", "")?;
    let v: Value = serde_json::from_str(&r.body).map_err(|e| format!("HTTP {}, not JSON ({e}): {}", r.status, r.body))?;
    if v["status"] != "success" {
        return Err(format!("{}: {}", v["errorType"], v["error"]));
    }
    Ok(v["data"].clone())
}

/// Prometheus's answer to an instant query: `Ok(series)` or `Err(its error)`.
fn query(prom: &str, expr: &str) -> Result<Vec<Value>, String> {
    let data = prometheus_api(prom, &format!("/api/v1/query?query={}", url_encode(expr)))?;
    Ok(data["result"].as_array().cloned().unwrap_or_default())
}

/// A variable's `label_values(METRIC, LABEL)` is Grafana's, not PromQL: it asks
/// Prometheus for LABEL's values on METRIC's series, as Grafana does.
fn label_values(prom: &str, metric: &str, label: &str) -> Result<Vec<Value>, String> {
    let data = prometheus_api(prom, &format!("/api/v1/label/{label}/values?match[]={}", url_encode(metric)))?;
    Ok(data.as_array().cloned().unwrap_or_default())
}

/// Evaluates a panel's expression, or a variable's `label_values(...)` query.
fn evaluate(prom: &str, expr: &str) -> Result<Vec<Value>, String> {
    match expr
        .strip_prefix("label_values(")
        .and_then(|r| r.strip_suffix(')'))
    {
        Some(args) => {
            let (metric, label) = args
                .split_once(',')
                .ok_or_else(|| format!("label_values needs a metric and a label: {expr}"))?;
            label_values(prom, metric.trim(), label.trim())
        }
        None => query(prom, expr),
    }
}

/// Every `expr` in the dashboard, with the panel it belongs to.
fn expressions(dashboard: &Value) -> Vec<(String, String)> {
    let mut out = Vec::new();
    let mut panels: Vec<&Value> = dashboard["panels"].as_array().unwrap().iter().collect();
    while let Some(p) = panels.pop() {
        panels.extend(p["panels"].as_array().into_iter().flatten());
        for t in p["targets"].as_array().into_iter().flatten() {
            out.push((
                p["title"].as_str().unwrap_or("?").to_string(),
                t["expr"]
                    .as_str()
                    .expect("a target without expr")
                    .to_string(),
            ));
        }
    }
    for v in dashboard["templating"]["list"]
        .as_array()
        .into_iter()
        .flatten()
    {
        if let Some(q) = v["query"]["query"]
            .as_str()
            .or(v["query"].as_str())
            .filter(|_| v["type"] == "query")
        {
            out.push((format!("variable {}", v["name"]), q.to_string()));
        }
    }
    out
}

fn substitute(expr: &str) -> String {
    let mut e = expr.to_string();
    for (var, value) in GRAFANA_BUILTINS.iter().chain(DASHBOARD_VARIABLES) {
        e = e.replace(var, value);
    }
    e
}

/// `hearth_*` names in an expression, histogram series suffixes taken off.
fn metric_names(expr: &str) -> BTreeSet<String> {
    let mut names = BTreeSet::new();
    let mut rest = expr;
    while let Some(i) = rest.find("hearth_") {
        let tail = &rest[i..];
        let end = tail
            .find(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
            .unwrap_or(tail.len());
        let name = &tail[..end];
        let base = ["_bucket", "_sum", "_count"]
            .iter()
            .find_map(|s| name.strip_suffix(s))
            .unwrap_or(name);
        names.insert(base.to_string());
        rest = &tail[end..];
    }
    names
}

/// Metric families the head exports (`# TYPE` lines of /metrics).
fn exported(head: &str) -> BTreeSet<String> {
    let r = common::http(head, "GET", "/metrics", "", "").unwrap();
    assert_eq!(r.status, 200);
    r.body.lines()
        .filter_map(|l| l.strip_prefix("# TYPE "))
        .filter_map(|l| l.split_whitespace().next())
        .map(str::to_string)
        .collect()
}

fn chat(head: &str, content: &str, max_tokens: usize) {
    let body = serde_json::json!({"model": "", "messages": [{"role": "user", "content": content}], "max_tokens": max_tokens, "temperature": 0});
    let r = common::http(head, "POST", "/v1/chat/completions", "", &body.to_string()).unwrap();
    assert_eq!(r.status, 200, "{}", r.body);
}

#[test]
fn every_dashboard_expression_evaluates_on_a_live_head() {
    let Some(binary) = prometheus_binary() else {
        let msg = "no `prometheus` binary on PATH (Debian package `prometheus`)";
        assert!(
            std::env::var("HEARTH_REQUIRE_PROMETHEUS").as_deref() != Ok("1"),
            "{msg}, and HEARTH_REQUIRE_PROMETHEUS=1"
        );
        eprintln!("skipped: {msg}");
        return;
    };
    let dashboard: Value = serde_json::from_str(
        &std::fs::read_to_string(repo().join("dashboards/hearth.json")).unwrap(),
    )
    .unwrap();
    let exprs = expressions(&dashboard);
    assert!(exprs.len() >= 20, "only {} expressions found", exprs.len());

    // The setup where every panel has data: a ring whose workers hold layers, speculation,
    // and devices that release their windows after use and read them again (as devices
    // short of memory do), so the disk panels show bytes.
    // Each worker has its own copy of the model, as a device has its own disk: pages of
    // one file mapped by several processes stay in the page cache while any of them maps
    // them, so a worker's release freed nothing (and it read nothing back) when the head
    // had touched its layers too (seen on a fast 2-core machine).
    let dir = std::env::temp_dir().join(format!("hearth-dashboards-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let copy = |name: &str| {
        let p = dir.join(name);
        std::fs::copy(common::default_model(), &p).unwrap();
        p
    };
    let (m1, m2) = (copy("w1.gguf"), copy("w2.gguf"));
    let w1 = Served::worker_at("127.0.0.1:0", &m1, &["--threads", "1"]).unwrap();
    let w2 = Served::worker_at("127.0.0.1:0", &m2, &["--threads", "1"]).unwrap();
    let workers = format!("{},{}", w1.addr, w2.addr);
    let head = Served::start(&["--threads", "1", "--parallel", "2", "--workers", &workers, "--windows", "10,10,10", "--spec-mode", "ngram", "--release-windows"]);
    let prom = start_prometheus(&binary, &head.addr);

    common::wait_for("Prometheus to scrape the head", Duration::from_secs(60), || {
        query(&prom.addr, "up{job=\"hearth\"}").ok().filter(|r| r.first().is_some_and(|s| s["value"][1] == "1"))
    });

    // Traffic over several scrapes, so rates have two samples: answers that repeat (drafts
    // get accepted), a cached prompt, and a client error.
    let r = common::http(&head.addr, "POST", "/v1/chat/completions", "", "{not json").unwrap();
    assert_eq!(r.status, 400);
    let traffic_until = Instant::now() + Duration::from_secs(16);
    while Instant::now() < traffic_until {
        chat(
            &head.addr,
            "Repeat exactly, ten times: the cat sat on the mat.",
            48,
        );
        chat(&head.addr, "Explain in detail how a bicycle works.", 24);
    }
    // Two more scrapes after the last request (rates need two samples of the final
    // counts): Prometheus holds the head's final token count, then a newer sample of it.
    let text = common::http(&head.addr, "GET", "/metrics", "", "").unwrap().body;
    let tokens: f64 = text.lines().find_map(|l| l.strip_prefix("hearth_generated_tokens_total ")?.trim().parse().ok()).expect("a token count");
    let sample = |prom: &str| -> Option<(f64, f64)> {
        let s = query(prom, "hearth_generated_tokens_total").ok()?.into_iter().next()?;
        let at = query(prom, "timestamp(hearth_generated_tokens_total)").ok()?.into_iter().next()?;
        Some((s["value"][1].as_str()?.parse().ok()?, at["value"][1].as_str()?.parse().ok()?))
    };
    let first = common::wait_for("Prometheus to scrape the final counts", Duration::from_secs(60), || sample(&prom.addr).filter(|s| s.0 == tokens).map(|s| s.1));
    common::wait_for("one more scrape", Duration::from_secs(60), || sample(&prom.addr).filter(|s| s.1 > first));

    let names = exported(&head.addr);
    let mut failures = Vec::new();
    for (panel, expr) in &exprs {
        let e = substitute(expr);
        if let Some(i) = e.find('$') {
            failures.push(format!(
                "{panel}: unknown variable at {:?} in {expr}",
                &e[i..]
            ));
            continue;
        }
        let unknown: Vec<String> = metric_names(&e)
            .into_iter()
            .filter(|n| !names.contains(n))
            .collect();
        if !unknown.is_empty() {
            failures.push(format!(
                "{panel}: hearth does not export {unknown:?} ({expr})"
            ));
            continue;
        }
        match evaluate(&prom.addr, &e) {
            Err(err) => failures.push(format!("{panel}: Prometheus refused {e}: {err}")),
            Ok(series) if series.is_empty() => failures.push(format!("{panel}: no series for {e}")),
            Ok(series) => eprintln!(
                "ok {panel}: {} series, e.g. {}",
                series.len(),
                series[0].get("value").unwrap_or(&series[0])
            ),
        }
    }
    assert!(
        failures.is_empty(),
        "{} of {} expressions failed:\n{}",
        failures.len(),
        exprs.len(),
        failures.join("\n")
    );

    // The figures the ring panels show are real: the workers reported their compute, and
    // speculation accepted drafts on the repetitive prompt.
    let compute = query(&prom.addr, "hearth_device_compute_seconds_count").unwrap();
    let devices: BTreeSet<&str> = compute
        .iter()
        .filter_map(|s| s["metric"]["device"].as_str())
        .collect();
    for d in ["head", w1.addr.as_str(), w2.addr.as_str()] {
        assert!(
            devices.contains(d),
            "no compute reported for {d}: {devices:?}"
        );
    }
    let read = query(&prom.addr, "sum by (device) (hearth_device_disk_read_bytes_total)").unwrap();
    for s in query(&prom.addr, "hearth_device_disk_read_bytes_total").unwrap() {
        eprintln!("disk read: {} {} {}", s["metric"]["device"], s["metric"]["phase"], s["value"][1]);
    }
    for d in [w1.addr.as_str(), w2.addr.as_str()] {
        let bytes: f64 = read.iter().find(|s| s["metric"]["device"] == d).and_then(|s| s["value"][1].as_str()).and_then(|v| v.parse().ok()).unwrap_or(0.0);
        assert!(bytes > 0.0, "{d} read nothing from disk while releasing its window: {read:?}");
    }
    let accepted = query(&prom.addr, "hearth_spec_accepted_tokens_total").unwrap();
    let accepted: f64 = accepted[0]["value"][1].as_str().unwrap().parse().unwrap();
    assert!(accepted > 0.0, "no draft was accepted");
    drop((w1, w2));
    std::fs::remove_dir_all(&dir).ok();
}

/// What Grafana itself would trip over, checked without Grafana (no Debian package):
/// unique panel ids, panels inside the 24-column grid and not overlapping, every query on
/// the dashboard's data-source variable, and that variable filled in on import.
#[test]
fn the_dashboard_is_well_formed_for_grafana() {
    let dashboard: Value = serde_json::from_str(&std::fs::read_to_string(repo().join("dashboards/hearth.json")).unwrap()).unwrap();
    assert_eq!(dashboard["uid"], "hearth");
    let input = dashboard["__inputs"].as_array().and_then(|i| i.iter().find(|i| i["type"] == "datasource")).expect("a data-source input for import");
    let input_ref = format!("${{{}}}", input["name"].as_str().unwrap());
    let variables = dashboard["templating"]["list"].as_array().unwrap();
    let ds = variables.iter().find(|v| v["type"] == "datasource").expect("a data-source variable");
    assert_eq!(ds["query"], "prometheus");
    assert_eq!(ds["current"]["value"].as_str(), Some(input_ref.as_str()), "the import input must set the data-source variable");
    let ds_ref = format!("${{{}}}", ds["name"].as_str().unwrap());

    let panels = dashboard["panels"].as_array().unwrap();
    let mut ids = BTreeSet::new();
    let mut boxes: Vec<(u64, u64, u64, u64, &str)> = Vec::new();
    for p in panels {
        let title = p["title"].as_str().unwrap_or("?");
        assert!(ids.insert(p["id"].as_u64().expect("panel id")), "duplicate panel id in {title}");
        let g = &p["gridPos"];
        let (x, y, w, h) = (g["x"].as_u64().unwrap(), g["y"].as_u64().unwrap(), g["w"].as_u64().unwrap(), g["h"].as_u64().unwrap());
        assert!(w > 0 && h > 0 && x + w <= 24, "{title} leaves the grid: {g}");
        for &(bx, by, bw, bh, other) in &boxes {
            let overlap = x < bx + bw && bx < x + w && y < by + bh && by < y + h;
            assert!(!overlap, "{title} overlaps {other}");
        }
        boxes.push((x, y, w, h, title));
        if p["type"] == "row" {
            continue;
        }
        assert!(p["description"].as_str().is_some_and(|d| !d.is_empty()), "{title} has no description");
        assert_eq!(p["datasource"]["uid"].as_str(), Some(ds_ref.as_str()), "{title}");
        let targets = p["targets"].as_array().filter(|t| !t.is_empty()).unwrap_or_else(|| panic!("{title} has no query"));
        for t in targets {
            assert_eq!(t["datasource"]["uid"].as_str(), Some(ds_ref.as_str()), "{title}");
        }
    }
}
