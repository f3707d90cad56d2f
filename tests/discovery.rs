//! Discovery on a LAN made of network namespaces (loopback carries neither multicast nor
//! broadcast as a LAN does): a worker started without a head address finds the head by its
//! announcements and joins; the head profiles it and the ring with it gives the single
//! node's answer; a worker with another secret is never a candidate; `--head` joins
//! without announcements. Needs root (namespaces); HEARTH_REQUIRE_NETNS=1 fails instead of
//! skipping where that is missing.

mod common;

use std::time::Duration;

use common::netns::{self, Lan};
use common::Served;
use serde_json::Value;

const SECRET: &str = "discovery-test-secret";
const ADMIN: &str = "admin-key";
const PROMPT: &str = "Explain in detail how a bicycle works.";

fn chat(addr: &str) -> String {
    let body = format!(r#"{{"model":"","messages":[{{"role":"user","content":"{PROMPT}"}}],"max_tokens":32,"temperature":0}}"#);
    let r = common::http(addr, "POST", "/v1/chat/completions", "", &body).unwrap();
    assert_eq!(r.status, 200, "{}", r.body);
    let v: Value = serde_json::from_str(&r.body).unwrap();
    v["choices"][0]["message"]["content"].as_str().unwrap().to_string()
}

fn admin(addr: &str, method: &str, path: &str, body: &str) -> Value {
    let r = common::http(addr, method, path, &format!("Authorization: Bearer {ADMIN}\r\n"), body).unwrap();
    assert_eq!(r.status, 200, "{} {path}: {}", method, r.body);
    serde_json::from_str(&r.body).unwrap()
}

/// The discovered candidates `/admin/cluster` lists.
fn discovered(head: &str) -> Vec<Value> {
    admin(head, "GET", "/admin/cluster", "")["candidates"].as_array().cloned().unwrap_or_default().into_iter().filter(|c| c["origin"] == "discovery").collect()
}

fn on(env: &str) -> [(&'static str, &std::ffi::OsStr); 1] {
    [("HEARTH_NO_DISCOVERY", std::ffi::OsStr::new(env))]
}

#[test]
fn a_worker_without_a_head_address_finds_the_head_and_joins_its_ring() {
    if let Err(e) = netns::available() {
        assert!(std::env::var("HEARTH_REQUIRE_NETNS").as_deref() != Ok("1"), "network namespaces are required here: {e}");
        eprintln!("skipped: no network namespaces here ({e})");
        return;
    }
    let model = common::default_model();
    let single = Served::start(&["--threads", "1"]);
    let expected = chat(&single.addr);
    drop(single);

    let lan = Lan::new("disc").unwrap();
    let discovery_on = on("false");
    let head = Served::spawn_in_netns(&lan.a, &["serve", "--port", "0"], &["--threads", "1", "--cluster-secret", SECRET, "--admin-key", ADMIN], &model, "listening on http://", &discovery_on).unwrap();
    let head_addr = head.addr.clone();
    let _worker = Served::spawn_in_netns(&lan.b, &["worker", "--listen", "0.0.0.0:9090"], &["--threads", "1", "--cluster-secret", SECRET, "--name", "desktop"], &model, "worker listening on ", &discovery_on).unwrap();
    // A stranger on the same LAN: another secret, so its joins do not verify.
    let _stranger = Served::spawn_in_netns(&lan.b, &["worker", "--listen", "0.0.0.0:9092"], &["--threads", "1", "--cluster-secret", "another-secret"], &model, "worker listening on ", &discovery_on).unwrap();

    let worker_addr = format!("{}:9090", lan.b_ip);
    let (h, w) = (head_addr.clone(), worker_addr.clone());
    let joined = netns::run_in(&lan.a, move || {
        common::wait_for("the worker to join by discovery", Duration::from_secs(30), || discovered(&h).into_iter().find(|c| c["addr"] == w.as_str()))
    });
    assert_eq!(joined["name"], "desktop", "{joined}");

    let h = head_addr.clone();
    let (plan, cluster, answer, stranger) = netns::run_in(&lan.a, move || {
        // Judged at once: the head gathered the candidate's profile for a plan check.
        let checked = common::wait_for("the head to judge a plan with the joined worker", Duration::from_secs(60), || {
            let plan = admin(&h, "GET", "/admin/plan", "");
            plan["last_check"].is_object().then_some(plan)
        });
        eprintln!("after the join: {}", checked["last_check"]);
        // Admitted: a plan with both devices forms the ring over the LAN, and it answers
        // as the single node does.
        let plan = admin(&h, "POST", "/admin/replan", r#"{"strategy":"even"}"#);
        let cluster = admin(&h, "GET", "/admin/cluster", "");
        let answer = chat(&h);
        // Several announcements later, the stranger is still no candidate.
        std::thread::sleep(Duration::from_secs(5));
        (plan, cluster, answer, discovered(&h).len())
    });
    let members: Vec<&str> = plan["members"].as_array().unwrap().iter().map(|m| m["name"].as_str().unwrap()).collect();
    assert_eq!(members, vec!["head", worker_addr.as_str()], "{plan}");
    assert!(cluster["devices"].as_array().unwrap().iter().any(|d| d["name"] == worker_addr.as_str()), "the joined worker was profiled: {cluster}");
    assert_eq!(answer, expected, "the ring over the LAN answers as the single node");
    assert_eq!(stranger, 1, "a worker with another secret must never become a candidate");
}

#[test]
fn a_worker_named_with_head_joins_without_announcements() {
    if let Err(e) = netns::available() {
        assert!(std::env::var("HEARTH_REQUIRE_NETNS").as_deref() != Ok("1"), "network namespaces are required here: {e}");
        eprintln!("skipped: no network namespaces here ({e})");
        return;
    }
    let model = common::default_model();
    let lan = Lan::new("head").unwrap();
    // The head announces on another port than the worker would listen to: only --head
    // can bring them together.
    let head = Served::spawn_in_netns(&lan.a, &["serve", "--port", "0"], &["--threads", "1", "--cluster-secret", SECRET, "--admin-key", ADMIN, "--discovery-port", "7950"], &model, "listening on http://", &on("false")).unwrap();
    let target = format!("{}:7950", lan.a_ip);
    let _worker = Served::spawn_in_netns(&lan.b, &["worker", "--listen", "0.0.0.0:9090"], &["--threads", "1", "--cluster-secret", SECRET, "--head", &target], &model, "worker listening on ", &on("false")).unwrap();
    let (h, w) = (head.addr.clone(), format!("{}:9090", lan.b_ip));
    netns::run_in(&lan.a, move || {
        common::wait_for("the worker to join the head it was named", Duration::from_secs(30), || discovered(&h).into_iter().find(|c| c["addr"] == w.as_str()));
    });
}
