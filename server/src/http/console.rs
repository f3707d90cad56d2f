//! The web console on `GET /`: one hand-written page (`server/console/`), compiled into the
//! binary, drawn live from `GET /console/state` — a snapshot of the head made here from
//! what the admin views and the metrics already hold, so the console shows the figures
//! Prometheus scrapes and nothing computed twice.
//!
//! The page holds keys only in its own tab (no cookie): the server's answers carry no
//! CORS grant (unless `--cors-origins` gives one), and a page on another origin can
//! neither read them nor make the browser send a key it holds. The content security policy
//! lets the page load only its own script and style and talk only to this server.
//!
//! The live stream never ends by itself: each holds a slot of `--max-console-streams`,
//! apart from the API's connections (`server::endless`), so open consoles cannot crowd out
//! API clients.

use std::collections::HashMap;
use std::convert::Infallible;
use std::sync::Arc;
use std::time::Duration;

use axum::extract::State;
use axum::http::{header, HeaderMap, HeaderValue};
use axum::response::sse::{Event, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use axum::Json;
use openapi::{ConsoleCheck, ConsoleDevice, ConsoleLoad, ConsoleLocalModel, ConsoleModel, ConsolePlan, ConsoleState, ConsoleTimes};

use super::{ApiError, AppState};
use crate::runtime::views::{streams_rate, ClusterView, PlanView};

const PAGE: &str = include_str!("../../console/index.html");
const SCRIPT: &str = include_str!("../../console/console.js");
const STYLE: &str = include_str!("../../console/console.css");
const ICON: &str = include_str!("../../console/icon.svg");

/// How often the stream looks for a changed snapshot: the console's "live" (a worker gone
/// shows within this, plus the ring's own detection).
const STREAM_EVERY: Duration = Duration::from_secs(1);

/// The page may run only its own script and style, and talk only to this server; no other
/// site may frame it (clickjacking the re-plan button).
const POLICY: &str = "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; connect-src 'self'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'";

fn asset(content_type: &'static str, body: impl IntoResponse) -> Response {
    let mut r = ([(header::CONTENT_TYPE, content_type)], body).into_response();
    let h = r.headers_mut();
    h.insert(header::CONTENT_SECURITY_POLICY, HeaderValue::from_static(POLICY));
    h.insert(header::X_CONTENT_TYPE_OPTIONS, HeaderValue::from_static("nosniff"));
    h.insert(header::REFERRER_POLICY, HeaderValue::from_static("no-referrer"));
    h.insert(header::X_FRAME_OPTIONS, HeaderValue::from_static("DENY"));
    // A new binary brings a new page: never keep an old script beside a new server.
    h.insert(header::CACHE_CONTROL, HeaderValue::from_static("no-cache"));
    r
}

/// The page, saying whether the server needs an API key (so the page asks before it
/// makes a request that would be refused).
pub async fn page(State(state): State<Arc<AppState>>) -> Response {
    let needs = if state.api_key.is_some() { "required" } else { "none" };
    asset("text/html; charset=utf-8", PAGE.replacen("HEARTH_KEY", needs, 1))
}

pub async fn script() -> Response {
    asset("text/javascript; charset=utf-8", SCRIPT)
}

pub async fn style() -> Response {
    asset("text/css; charset=utf-8", STYLE)
}

pub async fn icon() -> Response {
    asset("image/svg+xml", ICON)
}

/// `GET /console/state`: a snapshot, or with `Accept: text/event-stream` a stream of them
/// (503 when every stream slot is taken: the page retries).
pub async fn state(State(state): State<Arc<AppState>>, headers: HeaderMap) -> Response {
    let wants_stream = headers.get(header::ACCEPT).and_then(|v| v.to_str().ok()).is_some_and(|a| a.contains("text/event-stream"));
    if !wants_stream {
        return match taken(state).await {
            Some(s) => Json(s).into_response(),
            None => ApiError::Internal("the console's snapshot failed".into()).into_response(),
        };
    }
    let Some(slot) = state.endless.take() else {
        return ApiError::TooManyStreams { cap: state.endless.cap() }.into_response();
    };
    // The slot lives in the stream's state: freed when the stream ends or is dropped.
    let events = futures::stream::unfold((state, None::<String>, slot), |(state, mut last, slot)| async move {
        loop {
            if last.is_some() {
                tokio::time::sleep(STREAM_EVERY).await;
            }
            let mut s = taken(state.clone()).await?;
            // The time alone changing is no change.
            let at = std::mem::take(&mut s.at);
            let key = serde_json::to_string(&s).unwrap_or_default();
            if last.as_deref() != Some(key.as_str()) {
                s.at = at;
                let event = Event::default().event("state").json_data(&s).unwrap_or_else(|_| Event::default().comment("unserialisable"));
                return Some((Ok::<_, Infallible>(event), (state, Some(key), slot)));
            }
            last = Some(key);
        }
    });
    super::server::endless(Sse::new(events).keep_alive(KeepAlive::default()).into_response())
}

/// A snapshot taken off the async workers: it renders the metrics and reads folders.
async fn taken(state: Arc<AppState>) -> Option<ConsoleState> {
    tokio::task::spawn_blocking(move || snapshot(&state)).await.ok()
}

/// The head now.
pub fn snapshot(state: &AppState) -> ConsoleState {
    let plan = state.runtime.plan();
    let cluster = state.runtime.cluster();
    let degraded = state.runtime.degraded();
    let metrics = Samples::parse(&crate::metrics::render());
    let devices = devices(&plan, &cluster, degraded.as_deref(), &metrics);
    let f = &state.facts;
    ConsoleState {
        at: std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0.0, |d| d.as_secs_f64()),
        status: if degraded.is_some() { "degraded".into() } else { "ok".into() },
        reason: degraded,
        admin: state.admin_key.is_some(),
        model: ConsoleModel {
            id: state.model_id.clone(),
            arch: f.arch.clone(),
            quantization: f.quantization.clone(),
            parameters: f.parameters,
            weight_bytes: f.weight_bytes,
            context_length: state.runtime.n_ctx() as u64,
            parallel: state.runtime.parallel() as u64,
            embedding_model: state.embeddings.as_ref().map(|e| e.service.model.id.clone()),
        },
        devices,
        plan: plan_of(&plan),
        load: load(&metrics),
        local_models: local_models(&state.model_id),
    }
}

/// The models folder's and the hub cache's models; `served` by the file name the served
/// model's id comes from.
fn local_models(served_id: &str) -> Vec<ConsoleLocalModel> {
    let dir = crate::models::local_models(&crate::models::models_dir());
    let hub = crate::hub::local_models(&crate::hub::Hub::from_env());
    dir.into_iter()
        .chain(hub)
        .map(|(name, bytes)| {
            let file = name.rsplit(['/', ':']).next().unwrap_or(&name);
            let served = file.strip_suffix(".gguf").is_some_and(|stem| stem == served_id);
            ConsoleLocalModel { name, bytes, served }
        })
        .collect()
}

fn devices(plan: &PlanView, cluster: &ClusterView, degraded: Option<&str>, metrics: &Samples) -> Vec<ConsoleDevice> {
    let single = plan.members.len() <= 1;
    // Each hop as the profiles estimate it (half a control round trip to that device) plus
    // what the ring's traffic measured beyond their mean, as the scheduler judges plans
    // (`board::with_measured_hop`): links keep their differences.
    let estimates: Vec<f64> = plan.members.iter().filter_map(|m| cluster.devices.iter().find(|d| d.name == m.name)).map(|d| d.comm_s * 1e3).collect();
    let extra = match (plan.measured_hop_ms, estimates.is_empty()) {
        (Some(measured), false) => (measured - estimates.iter().sum::<f64>() / estimates.len() as f64).max(0.0),
        _ => 0.0,
    };
    let mut out: Vec<ConsoleDevice> = plan
        .members
        .iter()
        .enumerate()
        .map(|(i, m)| {
            let profile = cluster.devices.iter().find(|d| d.name == m.name);
            let label = cluster.candidates.iter().find(|c| c.addr == m.name).map_or_else(|| m.name.clone(), |c| c.name.clone());
            let hop_ms = profile.filter(|_| !single).map(|p| p.comm_s * 1e3 + extra).or(plan.measured_hop_ms.filter(|_| !single));
            // A single node has no ring reports: its engine steps are its compute.
            let (compute_seconds_total, compute_steps_total) = if single {
                (metrics.sum("hearth_step_duration_seconds_sum", None), metrics.sum("hearth_step_duration_seconds_count", None) as u64)
            } else {
                (metrics.sum("hearth_device_compute_seconds_sum", Some(&m.name)), metrics.sum("hearth_device_compute_seconds_count", Some(&m.name)) as u64)
            };
            ConsoleDevice {
                name: m.name.clone(),
                label,
                progress: None,
                // While the ring is broken every member waits; the one the head cannot
                // reach is named in the reason once it has tried to form the ring again.
                state: match degraded {
                    None => "ok".into(),
                    Some(why) if i > 0 && why.contains(&m.name) => "lost".into(),
                    Some(_) => "degraded".into(),
                },
                member: true,
                ring_index: Some(i as u64),
                layers: m.layers.iter().map(|[a, b]| [*a as u64, *b as u64]).collect(),
                layer_count: (m.window * plan.rounds) as u64,
                gpu_layers: (m.gpu_layers * plan.rounds) as u64,
                experts_in_ram: (m.experts_in_ram * plan.rounds) as u64,
                threads: m.threads.map(|t| t as u64),
                ram_total_bytes: profile.map(|p| p.ram_total),
                ram_available_bytes: profile.map(|p| p.ram_available),
                gpu_memory_available_bytes: profile.and_then(|p| p.gpu.as_ref()).map(|g| g.memory_available),
                hop_ms,
                predicted_ms: m.predicted.map(|b| ConsoleTimes { compute: b.compute_s * 1e3, memory: b.memory_s * 1e3, disk: b.disk_s * 1e3, network: b.network_s * 1e3 }),
                compute_seconds_total,
                compute_steps_total,
                disk_read_bytes_total: metrics.sum("hearth_device_disk_read_bytes_total", Some(&m.name)) as u64,
            }
        })
        .collect();
    for c in &cluster.candidates {
        if out.iter().any(|d| d.name == c.addr) {
            continue;
        }
        let profile = cluster.devices.iter().find(|d| d.name == c.addr);
        // The last look at the plan lists the workers still fetching, as `addr NN% of X MB`.
        let progress = plan.last_check.as_ref().and_then(|k| k.fetching.as_deref()).and_then(|f| f.split(", ").find(|p| p.strip_prefix(c.addr.as_str()).is_some_and(|rest| rest.starts_with(' '))));
        let state = if c.state == "left" {
            "left"
        } else if progress.is_some() {
            "fetching"
        } else if plan.dropped.contains(&c.addr) {
            "standby"
        } else {
            "joining"
        };
        out.push(ConsoleDevice {
            name: c.addr.clone(),
            label: c.name.clone(),
            state: state.into(),
            progress: progress.map(|p| format!("fetching its windows: {}", p[c.addr.len()..].trim())),
            member: false,
            ring_index: None,
            layers: Vec::new(),
            layer_count: 0,
            gpu_layers: 0,
            experts_in_ram: 0,
            threads: None,
            ram_total_bytes: profile.map(|p| p.ram_total),
            ram_available_bytes: profile.map(|p| p.ram_available),
            gpu_memory_available_bytes: profile.and_then(|p| p.gpu.as_ref()).map(|g| g.memory_available),
            hop_ms: profile.map(|p| p.comm_s * 1e3),
            predicted_ms: None,
            compute_seconds_total: metrics.sum("hearth_device_compute_seconds_sum", Some(&c.addr)),
            compute_steps_total: metrics.sum("hearth_device_compute_seconds_count", Some(&c.addr)) as u64,
            disk_read_bytes_total: metrics.sum("hearth_device_disk_read_bytes_total", Some(&c.addr)) as u64,
        });
    }
    out
}

fn plan_of(p: &PlanView) -> ConsolePlan {
    ConsolePlan {
        source: p.source.clone(),
        automatic: p.automatic,
        n_layer: p.n_layer as u64,
        rounds: p.rounds as u64,
        micro_batches: p.micro_batches as u64,
        predicted_tpot_ms: p.predicted_tpot_ms,
        measured_tpot_ms: p.measured_tpot_ms,
        measured_hop_ms: p.measured_hop_ms,
        forecast_tokens_per_s: streams_rate(p.forecast.as_ref()),
        replans: p.replans,
        adopted_at: p.adopted_at,
        dropped: p.dropped.clone(),
        last_check: p.last_check.as_ref().map(|c| ConsoleCheck { at: c.at, applied: c.applied, reason: c.reason.clone(), drift: c.drift.clone(), fetching: c.fetching.clone() }),
    }
}

fn load(m: &Samples) -> ConsoleLoad {
    let n = |name: &str| m.sum(name, None).max(0.0) as u64;
    ConsoleLoad {
        running: n("hearth_running_sequences"),
        queued: n("hearth_queue_size"),
        requests_total: n("hearth_requests_total"),
        errors_total: m.errors,
        generated_tokens_total: n("hearth_generated_tokens_total"),
        prompt_tokens_total: n("hearth_prompt_tokens_total"),
        cached_prompt_tokens_total: n("hearth_prompt_cached_tokens_total"),
        ttft_seconds_sum: m.sum("hearth_time_to_first_token_seconds_sum", None),
        ttft_count: n("hearth_time_to_first_token_seconds_count"),
        tpot_seconds_sum: m.sum("hearth_time_per_output_token_seconds_sum", None),
        tpot_count: n("hearth_time_per_output_token_seconds_count"),
        draft_tokens_total: n("hearth_spec_draft_tokens_total"),
        accepted_tokens_total: n("hearth_spec_accepted_tokens_total"),
    }
}

/// The samples of the Prometheus exposition the console reads: each series' value summed
/// over its labels, and by its `device` label.
struct Samples {
    total: HashMap<String, f64>,
    by_device: HashMap<(String, String), f64>,
    /// `hearth_requests_total` with a 4xx or 5xx `status`.
    errors: u64,
}

impl Samples {
    fn parse(text: &str) -> Samples {
        let mut s = Samples { total: HashMap::new(), by_device: HashMap::new(), errors: 0 };
        for line in text.lines().filter(|l| !l.starts_with('#')) {
            let Some((series, value)) = line.rsplit_once(' ') else { continue };
            let Ok(value) = value.parse::<f64>() else { continue };
            if !value.is_finite() {
                continue;
            }
            let (name, labels) = match series.split_once('{') {
                Some((n, l)) => (n, l.trim_end_matches('}')),
                None => (series, ""),
            };
            *s.total.entry(name.to_string()).or_default() += value;
            if let Some(device) = label(labels, "device") {
                *s.by_device.entry((name.to_string(), device.to_string())).or_default() += value;
            }
            if name == "hearth_requests_total" && label(labels, "status").is_some_and(|c| c.starts_with('4') || c.starts_with('5')) {
                s.errors += value as u64;
            }
        }
        s
    }

    fn sum(&self, name: &str, device: Option<&str>) -> f64 {
        match device {
            None => self.total.get(name).copied().unwrap_or(0.0),
            Some(d) => self.by_device.get(&(name.to_string(), d.to_string())).copied().unwrap_or(0.0),
        }
    }
}

/// The value of label `key` in `a="x",b="y"` (hearth's label values hold no quotes or commas).
fn label<'a>(labels: &'a str, key: &str) -> Option<&'a str> {
    labels.split(',').find_map(|kv| kv.split_once('=').filter(|(k, _)| k.trim() == key).map(|(_, v)| v.trim_matches('"')))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::runtime::views::{CandidateView, CheckView};

    fn candidate(addr: &str, state: &'static str) -> CandidateView {
        CandidateView { addr: addr.into(), name: format!("box-{addr}"), origin: "discovery", state, joined_at: Some(1), last_heard_s: Some(0.5) }
    }

    /// A ring of the head and one worker, a worker the plan left out, one that joined
    /// since, one fetching its windows for a chosen plan and one that left.
    #[test]
    fn every_device_is_shown_in_its_state() {
        let plan = scheduler::Plan { n_layer: 30, devices: vec![scheduler::DevicePlan::new(10, 0), scheduler::DevicePlan::new(20, 0)] };
        let mut view = PlanView::of("halda", true, &plan, &["head".to_string(), "w1:1".to_string()], None, vec!["w2:1".to_string(), "w5:1".to_string()]);
        let mut check = CheckView::new(false, Vec::new(), "waiting".into());
        check.fetching = Some("w4:1 40% of 35.0 MB, w44:1 10% of 1.0 MB".into());
        view.last_check = Some(check);
        let cluster = ClusterView { devices: Vec::new(), gathered_at: None, candidates: ["w1:1", "w2:1", "w3:1", "w4:1"].iter().map(|a| candidate(a, "candidate")).chain([candidate("w5:1", "left")]).collect() };
        let samples = Samples::parse("hearth_device_compute_seconds_sum{device=\"w1:1\"} 2\nhearth_device_compute_seconds_count{device=\"w1:1\"} 4\n");
        let got = devices(&view, &cluster, None, &samples);
        let states: Vec<(&str, &str)> = got.iter().map(|d| (d.name.as_str(), d.state.as_str())).collect();
        assert_eq!(states, [("head", "ok"), ("w1:1", "ok"), ("w2:1", "standby"), ("w3:1", "joining"), ("w4:1", "fetching"), ("w5:1", "left")]);
        assert_eq!(got[4].progress.as_deref(), Some("fetching its windows: 40% of 35.0 MB"));
        assert_eq!((got[1].label.as_str(), got[1].layer_count, got[1].compute_steps_total, got[1].compute_seconds_total), ("box-w1:1", 20, 4, 2.0));
        assert_eq!(got[1].layers, vec![[10, 30]]);
        // While the ring is broken the worker it names is lost, the others wait.
        let got = devices(&view, &cluster, Some("worker w1:1 is unreachable"), &samples);
        assert_eq!((got[0].state.as_str(), got[1].state.as_str()), ("degraded", "lost"));
    }

    #[test]
    fn the_exposition_is_summed_by_series_and_device() {
        let text = "# HELP x\nhearth_requests_total{endpoint=\"chat\",status=\"200\"} 5\nhearth_requests_total{endpoint=\"chat\",status=\"503\"} 2\nhearth_requests_total{endpoint=\"models\",status=\"404\"} 1\n\
                    hearth_device_compute_seconds_sum{device=\"head\"} 1.5\nhearth_device_compute_seconds_sum{device=\"10.0.0.2:9000\"} 2.5\nhearth_queue_size 3\nhearth_plan_predicted_tpot_seconds NaN\n";
        let s = Samples::parse(text);
        assert_eq!(s.sum("hearth_requests_total", None), 8.0);
        assert_eq!(s.errors, 3);
        assert_eq!(s.sum("hearth_device_compute_seconds_sum", Some("10.0.0.2:9000")), 2.5);
        assert_eq!(s.sum("hearth_device_compute_seconds_sum", None), 4.0);
        assert_eq!(s.sum("hearth_queue_size", None), 3.0);
        assert_eq!(s.sum("hearth_plan_predicted_tpot_seconds", None), 0.0);
        assert_eq!(s.sum("absent", Some("head")), 0.0);
    }
}
