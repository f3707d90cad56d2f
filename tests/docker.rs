//! hearth in Docker, as a home user runs it: the image of this build (docker/Dockerfile.runtime
//! on the local base image of docker/base/make-base.sh, so no registry is needed), a head
//! and two workers started from the real compose files (docker/head, docker/worker) on a
//! bridge network of their own, each container with its own address and memory limit.
//! Only the head has the model: the workers fetch their layers from it. A chat completion
//! goes round the ring; a stopped worker gives 503 and `degraded` naming
//! it; serving resumes by itself when the worker starts again; the HEALTHCHECKs pass.
//!
//! Skipped, with a line on stderr, where Docker, Compose or the base image's prerequisites
//! are missing, unless HEARTH_REQUIRE_DOCKER=1 (CI), which makes that a failure.
//! HEARTH_COMPOSE picks the Compose command (default: docker-compose, else docker compose).

mod common;

use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use common::{free_port, wait_for, Response};
use serde_json::Value;

/// An unusual private subnet: Docker's own pools are 172.17-31.x and 192.168.x.
const SUBNET: &str = "10.213.47.0/24";
const NETWORK: &str = "hearth-test-net";
const HEAD_IP: &str = "10.213.47.10";
const W1_IP: &str = "10.213.47.11";
const W2_IP: &str = "10.213.47.12";
const IMAGE: &str = "hearth:test";
const BASE_IMAGE: &str = "hearth-base:bookworm";
const HEAD: &str = "hearth-test-head";
const W1: &str = "hearth-test-w1";
const W2: &str = "hearth-test-w2";
const PROJECTS: [&str; 3] = [HEAD, W1, W2];
const SECRET: &str = "hearth-test-cluster-secret";
const API_KEY: &str = "hearth-test-api-key";
const CHAT: &str =
    r#"{"model":"","messages":[{"role":"user","content":"Say hello"}],"max_tokens":16}"#;

/// Attaches a service of the real compose file to the test network at a fixed address,
/// with a memory limit like a small device's.
fn override_file(service: &str) -> String {
    format!(
        "services:\n  {service}:\n    mem_limit: 1g\n    networks:\n      test:\n        ipv4_address: ${{HEARTH_TEST_IP}}\n\
         networks:\n  test:\n    external: true\n    name: {NETWORK}\n"
    )
}

fn repo() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("..")
        .canonicalize()
        .expect("repository root")
}

/// Runs a command; its stdout, or what went wrong with its stderr.
fn output(cmd: &mut Command) -> Result<String, String> {
    let out = cmd
        .stdin(Stdio::null())
        .output()
        .map_err(|e| format!("{cmd:?}: {e}"))?;
    if out.status.success() {
        Ok(String::from_utf8_lossy(&out.stdout).trim().to_string())
    } else {
        Err(format!(
            "{cmd:?}: {}\n{}{}",
            out.status,
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        ))
    }
}

fn docker(args: &[&str]) -> Result<String, String> {
    output(Command::new("docker").args(args))
}

/// Docker is a prerequisite the machine may lack: skip, or fail where it is required.
fn unavailable(why: &str) {
    if std::env::var("HEARTH_REQUIRE_DOCKER").as_deref() == Ok("1") {
        panic!("HEARTH_REQUIRE_DOCKER=1, but {why}");
    }
    eprintln!("skipped: no docker ({why}); HEARTH_REQUIRE_DOCKER=1 makes this a failure");
}

/// The Compose command: HEARTH_COMPOSE, else docker-compose (v1 or v2), else docker compose.
fn compose_command() -> Option<Vec<String>> {
    if let Ok(c) = std::env::var("HEARTH_COMPOSE") {
        return Some(c.split_whitespace().map(str::to_string).collect());
    }
    [vec!["docker-compose"], vec!["docker", "compose"]]
        .into_iter()
        .find(|c| output(Command::new(c[0]).args(&c[1..]).arg("version")).is_ok())
        .map(|c| c.into_iter().map(str::to_string).collect())
}

/// The containers of a compose project (by the label both Compose versions set).
fn containers(project: &str) -> Vec<String> {
    docker(&[
        "ps",
        "-aq",
        "--filter",
        &format!("label=com.docker.compose.project={project}"),
    ])
    .map(|s| s.lines().map(str::to_string).collect())
    .unwrap_or_default()
}

/// Removes everything this test makes (but the cached base image): after it, and before
/// it in case an earlier run was killed before it could clean up.
fn remove_test_objects() {
    for project in PROJECTS {
        let ids = containers(project);
        if !ids.is_empty() {
            let _ = output(Command::new("docker").args(["rm", "-f", "-v"]).args(&ids));
        }
        for kind in ["volume", "network"] {
            let label = format!("label=com.docker.compose.project={project}");
            if let Ok(names) = docker(&[kind, "ls", "-q", "--filter", &label]) {
                for name in names.lines() {
                    let _ = docker(&[kind, "rm", name]);
                }
            }
        }
    }
    if docker(&["network", "inspect", NETWORK]).is_ok() {
        let _ = docker(&["network", "rm", NETWORK]);
    }
}

/// Cleans up when the test ends, passed or not; on a failure it first prints the
/// containers' logs.
struct Cleanup {
    tmp: PathBuf,
}

impl Drop for Cleanup {
    fn drop(&mut self) {
        if std::thread::panicking() {
            for id in PROJECTS.iter().flat_map(|p| containers(p)) {
                let name = docker(&["inspect", "-f", "{{.Name}}: {{.State.Status}} {{if .State.Health}}{{.State.Health.Status}}{{end}}", &id]).unwrap_or_default();
                let logs = Command::new("docker")
                    .args(["logs", "--tail", "40", &id])
                    .output();
                let logs = logs
                    .map(|o| {
                        format!(
                            "{}{}",
                            String::from_utf8_lossy(&o.stdout),
                            String::from_utf8_lossy(&o.stderr)
                        )
                    })
                    .unwrap_or_default();
                eprintln!("--- {name}\n{logs}");
            }
        }
        remove_test_objects();
        let _ = docker(&["image", "rm", IMAGE]);
        let _ = std::fs::remove_dir_all(&self.tmp);
    }
}

/// One compose project: a compose file of docker/, the test's override, and settings
/// from the environment (an empty --env-file: a user's .env next to the compose file
/// must not leak in).
struct Project {
    compose: Vec<String>,
    files: Vec<PathBuf>,
    name: &'static str,
    env: Vec<(String, String)>,
    env_file: PathBuf,
}

impl Project {
    fn command(&self, args: &[&str]) -> Command {
        let mut cmd = Command::new(&self.compose[0]);
        cmd.args(&self.compose[1..]);
        for f in &self.files {
            cmd.arg("-f").arg(f);
        }
        cmd.args(["-p", self.name])
            .arg("--env-file")
            .arg(&self.env_file)
            .args(args);
        // The test's settings only: a user's HEARTH_API_KEY or HEARTH_LOG would reach the
        // containers through the compose files' pass-through entries.
        for (k, _) in std::env::vars() {
            if ["HEARTH_", "GRAFANA_", "PROMETHEUS_", "COMPOSE_"]
                .iter()
                .any(|p| k.starts_with(p))
            {
                cmd.env_remove(k);
            }
        }
        cmd.envs(self.env.iter().map(|(k, v)| (k, v)));
        cmd
    }

    fn run(&self, args: &[&str]) -> String {
        output(&mut self.command(args))
            .unwrap_or_else(|e| panic!("compose project {}: {e}", self.name))
    }

    /// The one container of the project's service.
    fn container(&self) -> String {
        let ids = containers(self.name);
        assert_eq!(
            ids.len(),
            1,
            "project {} should have one container: {ids:?}",
            self.name
        );
        ids[0].clone()
    }
}

/// One request to the head, with the API key.
fn http(addr: &str, method: &str, path: &str, body: &str) -> Result<Response, String> {
    common::http(addr, method, path, &format!("Authorization: Bearer {API_KEY}\r\n"), body)
}

fn health(addr: &str) -> Option<Value> {
    http(addr, "GET", "/health", "")
        .ok()
        .filter(|r| r.status == 200)
        .and_then(|r| serde_json::from_str(&r.body).ok())
}

fn chat(addr: &str) -> Result<Response, String> {
    http(addr, "POST", "/v1/chat/completions", CHAT)
}

/// A 503 with the OpenAI error envelope, `ring_unavailable`, a message naming `names`,
/// and Retry-After.
fn assert_ring_unavailable(r: &Response, names: &str) {
    assert_eq!(r.status, 503, "{}", r.body);
    assert!(
        r.headers.contains("\r\nretry-after:"),
        "a 503 should say when to retry: {}",
        r.headers
    );
    let v: Value = serde_json::from_str(&r.body).unwrap_or_else(|e| panic!("{e}: {}", r.body));
    assert_eq!(v["error"]["code"], "ring_unavailable", "{}", r.body);
    assert_eq!(v["error"]["type"], "server_error", "{}", r.body);
    let message = v["error"]["message"].as_str().unwrap_or_default();
    assert!(
        message.contains("unavailable") && message.contains(names),
        "the error should name {names}: {}",
        r.body
    );
}

fn container_state(id: &str) -> String {
    docker(&[
        "inspect",
        "-f",
        "{{.State.Status}} {{if .State.Health}}{{.State.Health.Status}}{{end}}",
        id,
    ])
    .unwrap_or_default()
}

#[test]
fn a_head_and_two_workers_in_containers_serve_lose_a_worker_and_recover() {
    let started = Instant::now();
    let phase = |what: &str| eprintln!("[{:5.1} s] {what}", started.elapsed().as_secs_f64());
    if let Err(e) = docker(&["info"]) {
        let last = e
            .lines()
            .rfind(|l| !l.trim().is_empty())
            .unwrap_or_default();
        return unavailable(&format!("`docker info` failed: {}", last.trim()));
    }
    let Some(compose) = compose_command() else {
        return unavailable("neither docker-compose nor `docker compose` runs");
    };
    let repo = repo();
    let docker_dir = repo.join("docker");

    // The base image: debootstrapped once (minutes), then cached as a tarball and image.
    let status = Command::new("bash")
        .arg(docker_dir.join("base/make-base.sh"))
        .arg(BASE_IMAGE)
        .stdout(Stdio::null())
        .status()
        .expect("run make-base.sh");
    match status.code() {
        Some(0) => {}
        Some(2) => {
            return unavailable("docker/base/make-base.sh lacks a prerequisite (its message above)")
        }
        _ => panic!("docker/base/make-base.sh failed: {status}"),
    }
    phase("base image ready");

    remove_test_objects();
    let tmp = std::env::temp_dir().join(format!("hearth-test-docker-{}", std::process::id()));
    let cleanup = Cleanup { tmp: tmp.clone() };
    output(
        Command::new("bash")
            .arg(docker_dir.join("build-runtime.sh"))
            .args([
                "--base",
                BASE_IMAGE,
                "--tag",
                IMAGE,
                env!("CARGO_BIN_EXE_hearth-under-test"),
            ]),
    )
    .unwrap_or_else(|e| panic!("building {IMAGE}: {e}"));
    let size = docker(&["image", "inspect", "-f", "{{.Size}}", IMAGE]).unwrap_or_default();
    phase(&format!(
        "{IMAGE} built ({} MB)",
        size.parse::<u64>().unwrap_or(0) / 1_000_000
    ));

    std::fs::create_dir_all(&tmp).unwrap();
    let env_file = tmp.join("empty.env");
    std::fs::write(&env_file, "").unwrap();
    let head_override = tmp.join("head.override.yaml");
    let worker_override = tmp.join("worker.override.yaml");
    std::fs::write(&head_override, override_file("hearth")).unwrap();
    std::fs::write(&worker_override, override_file("hearth-worker")).unwrap();

    let model = common::default_model();
    let models_dir = model.parent().unwrap().to_str().unwrap().to_string();
    let model_file = model.file_name().unwrap().to_str().unwrap().to_string();
    let api_port = free_port();
    let shared = |ip: &str| -> Vec<(String, String)> {
        [
            ("HEARTH_IMAGE", IMAGE),
            ("HEARTH_MODELS_DIR", &models_dir),
            ("HEARTH_MODEL_FILE", &model_file),
            ("HEARTH_CLUSTER_SECRET", SECRET),
            ("HEARTH_THREADS", "1"),
            ("HEARTH_PUBLISH_IP", "127.0.0.1"),
            ("HEARTH_TEST_IP", ip),
        ]
        .into_iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect()
    };
    let worker = |name: &'static str, ip: &str| {
        let mut env = shared(ip);
        env.push(("HEARTH_WORKER_PORT".into(), free_port().to_string()));
        Project {
            compose: compose.clone(),
            files: vec![
                docker_dir.join("worker/compose.yaml"),
                worker_override.clone(),
            ],
            name,
            env,
            env_file: env_file.clone(),
        }
    };
    let (w1, w2) = (worker(W1, W1_IP), worker(W2, W2_IP));
    let mut env = shared(HEAD_IP);
    for (k, v) in [
        ("HEARTH_WORKERS", format!("{W1_IP}:9090,{W2_IP}:9090")),
        // The workers reach the head at its address on the test network; a LAN's head
        // gives its LAN address and published port.
        ("HEARTH_RING_ADVERTISE", format!("{HEAD_IP}:9091")),
        ("HEARTH_API_PORT", api_port.to_string()),
        ("HEARTH_RING_PORT", free_port().to_string()),
        ("HEARTH_API_KEY", API_KEY.to_string()),
        // Pinned: on one machine Halda would rightly leave both workers out.
        ("HEARTH_WINDOWS", "10,10,10".to_string()),
        ("GRAFANA_ADMIN_PASSWORD", "unused".to_string()),
    ] {
        env.push((k.to_string(), v));
    }
    let head = Project {
        compose: compose.clone(),
        files: vec![docker_dir.join("head/compose.yaml"), head_override.clone()],
        name: HEAD,
        env,
        env_file: env_file.clone(),
    };

    // The compose files are valid as shipped (with their documented .env.example) and with
    // the test's override, for this Compose.
    // The LAN variants (host network, discovery) too; they cannot run here: their
    // multicast would leave what the test made.
    for (dir, lan) in [("head", false), ("worker", false), ("head", true), ("worker", true)] {
        let mut cmd = Command::new(&compose[0]);
        cmd.args(&compose[1..]).arg("-f").arg(docker_dir.join(dir).join("compose.yaml"));
        if lan {
            cmd.arg("-f").arg(docker_dir.join(dir).join("compose.lan.yaml"));
        }
        cmd.arg("--env-file")
            .arg(docker_dir.join(dir).join(".env.example"))
            .args(["config", "-q"]);
        output(&mut cmd)
            .unwrap_or_else(|e| panic!("docker/{dir}/compose.yaml with its .env.example: {e}"));
    }
    for p in [&head, &w1] {
        p.run(&["config", "-q"]);
    }

    docker(&[
        "network", "create", "--driver", "bridge", "--subnet", SUBNET, NETWORK,
    ])
    .unwrap_or_else(|e| panic!("creating the test network: {e}"));
    w1.run(&["up", "-d", "--no-build"]);
    w2.run(&["up", "-d", "--no-build"]);
    // Only the head: Prometheus and Grafana would need images from a registry.
    head.run(&["up", "-d", "--no-build", "hearth"]);
    let head_id = head.container();
    let w2_id = w2.container();
    phase("containers started");

    let api = format!("127.0.0.1:{api_port}");
    wait_for(
        "the head's /health to say ok",
        Duration::from_secs(180),
        || {
            let state = container_state(&head_id);
            assert!(
                state.starts_with("running"),
                "the head container is {state} (its log is below)"
            );
            health(&api).filter(|h| h["status"] == "ok")
        },
    );
    phase("the ring is up");

    let r = chat(&api).unwrap_or_else(|e| panic!("chat completion: {e}"));
    assert_eq!(r.status, 200, "{}", r.body);
    let v: Value = serde_json::from_str(&r.body).unwrap_or_else(|e| panic!("{e}: {}", r.body));
    let content = v["choices"][0]["message"]["content"]
        .as_str()
        .unwrap_or_default();
    assert!(!content.trim().is_empty(), "empty answer: {}", r.body);
    phase(&format!("answer through the ring: {content:?}"));

    // The worker sees its container's memory limit, not the host's memory.
    // hearth logs to stderr, which `docker logs` replays on its own stderr.
    let logs = Command::new("docker").args(["logs", &w1.container()]).output().expect("docker logs");
    let w1_log = String::from_utf8_lossy(&logs.stderr);
    assert!(w1_log.contains("memory budget 1024 MiB"), "the worker did not read its 1 GiB limit:\n{w1_log}");
    // It has no copy of the model: it fetched its layers from the head.
    assert!(w1_log.contains("fetching the model from the head: 100%"), "the worker did not fetch its layers:\n{w1_log}");

    // A worker goes away. The idle head notices without a request: /health says degraded
    // and names the worker by the address the head dials; new requests get 503 naming it.
    docker(&["stop", &w2_id]).unwrap_or_else(|e| panic!("docker stop: {e}"));
    let w2_addr = format!("{W2_IP}:9090");
    let stopped = Instant::now();
    let h = wait_for("/health to say degraded, naming the stopped worker", Duration::from_secs(10), || {
        health(&api).filter(|h| h["status"] == "degraded" && h["reason"].as_str().is_some_and(|r| r.contains(&w2_addr)))
    });
    phase(&format!("degraded {:.1} s after the stop: {}", stopped.elapsed().as_secs_f64(), h["reason"]));
    let r = chat(&api).unwrap_or_else(|e| panic!("chat completion while degraded: {e}"));
    assert_ring_unavailable(&r, &w2_addr);

    // It comes back: the head re-forms the ring by itself.
    docker(&["start", &w2_id]).unwrap_or_else(|e| panic!("docker start: {e}"));
    let resumed = Instant::now();
    wait_for(
        "serving to resume after the worker started again",
        Duration::from_secs(60),
        || chat(&api).ok().filter(|r| r.status == 200),
    );
    assert_eq!(
        health(&api).map(|h| h["status"].clone()),
        Some(Value::from("ok"))
    );
    phase(&format!(
        "serving resumed {:.1} s after the worker started",
        resumed.elapsed().as_secs_f64()
    ));

    // The images' HEALTHCHECK: GET /health on the head, a TCP connect on a worker.
    for (what, id) in [("head", head_id.clone()), ("worker 1", w1.container())] {
        wait_for(
            &format!("the {what}'s HEALTHCHECK to pass"),
            Duration::from_secs(60),
            || {
                let state = container_state(&id);
                assert!(
                    !state.ends_with("unhealthy"),
                    "the {what} is {state}: {}",
                    docker(&["inspect", "-f", "{{json .State.Health.Log}}", &id])
                        .unwrap_or_default()
                );
                state.ends_with(" healthy").then_some(())
            },
        );
    }
    phase("head and worker healthy");
    drop(cleanup);
    phase("cleaned up");
    let left: Vec<String> = PROJECTS.iter().flat_map(|p| containers(p)).collect();
    assert!(left.is_empty(), "containers left behind: {left:?}");
    assert!(
        docker(&["network", "inspect", NETWORK]).is_err(),
        "network {NETWORK} left behind"
    );
}
