//! Which plan a running ring should run: at the head's idle moments it gathers fresh
//! profiles, and decides — keep the running plan, wait for the new plan's workers to fetch
//! their windows, or adopt the new plan. A member that left (or stayed lost past the grace
//! period) is planned without whatever the gain; a plan an operator asked for is adopted
//! whenever it differs; the head's own looks adopt a plan only on a real predicted gain.
//!
//! The cluster is reached through [`Cluster`] (profiles, and the workers' windows), and the
//! verdict is handed back rather than carried out: the head rebuilds its stage and forms the
//! ring. So the decisions are tested below with a scripted cluster.

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use scheduler::{DeviceProfile, Plan, ReplanPolicy, Schedule, Strategy, Trigger};
use transport::{ControlClient, LinkConfig};

use super::board::{self, PlanBoard};
use super::planning::{addresses, Planner};
use super::shipping::{self, FetchRequest, FetchStatus};
use super::RingSetup;
use crate::error::{Error, Result};
use crate::runtime::views::CheckView;

/// Each worker, by address, with the windows a plan gives it (`[start, end)` layers).
pub type Wanted = Vec<(String, Vec<(usize, usize)>)>;

/// What deciding needs from the cluster.
pub trait Cluster {
    /// Fresh profiles of the head and every candidate, the head first; a candidate outside
    /// `needed` that cannot be reached is left out.
    fn gather(&self, planner: &Planner, needed: &[String]) -> Result<Vec<DeviceProfile>>;
    /// Asks each worker to have what its windows need (fetching it from the head when it
    /// lacks the model). `Ok(None)`: every one is ready; otherwise their progress in words.
    fn fetch(&self, wanted: &Wanted) -> Result<Option<String>>;
}

/// What a look at the plan was asked for: the strategy (`None`: the running one) and
/// whether an operator asked (then a plan that differs is adopted whatever its gain) or
/// the head looked by itself (then it must predict a real gain).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Ask {
    pub strategy: Option<Strategy>,
    pub trigger: Trigger,
}

impl Ask {
    /// The head's own look (profiles drifted, a worker joined).
    pub const DRIFT: Ask = Ask { strategy: None, trigger: Trigger::Drift };
}

/// The outcome of a look.
#[derive(Debug)]
pub enum Verdict {
    Keep,
    /// The new plan waits for its workers to fetch their windows; it is looked at again at
    /// the next idle moment (`awaiting_fetch`).
    Fetching(String),
    /// Run this schedule (its members index `Replanning::devices`) with this strategy.
    Adopt(Schedule, Strategy),
}

/// The running ring as deciding sees it.
pub struct Running<'a> {
    pub plan: &'a Plan,
    /// The workers after the head, in ring order.
    pub workers: &'a [String],
}

/// Re-planning a running ring: the planner and what the running plan was judged on.
pub struct Replanning {
    pub planner: Planner,
    /// Re-plan by itself after the queue has been idle this long; `None`: only when asked.
    pub idle_after: Option<Duration>,
    pub policy: ReplanPolicy,
    /// The profiles the running plan was last judged on: the head, then every candidate.
    pub devices: Vec<DeviceProfile>,
    /// Indices into `devices` of the running plan's members, in ring order.
    pub members: Vec<usize>,
    /// The running plan's strategy; `None` for a plan from `--windows`.
    pub strategy: Option<Strategy>,
    pub last_check: Instant,
    /// A plan chosen while some of its workers were still fetching their windows from
    /// this head: looked at again at idle moments until they have them, as it was asked for.
    pub awaiting_fetch: Option<Ask>,
}

impl Replanning {
    /// Gathers fresh profiles and, when they drifted (or `forced`), solves again over every
    /// candidate: adopt the new plan if it predicts a real gain — or, when an operator
    /// asked, whenever it differs from the running one — once its workers have their windows.
    pub fn check(&mut self, cluster: &dyn Cluster, board: &PlanBoard, running: Running<'_>, forced: bool, ask: Ask) -> Result<Verdict> {
        self.last_check = Instant::now();
        let mut devices = cluster.gather(&self.planner, running.workers)?;
        // The running members in the fresh list (workers outside the ring may have come or
        // gone); a member missing from it said it leaves: it is no candidate any more.
        let found: Vec<Option<usize>> = self.members.iter().map(|&m| devices.iter().position(|d| d.name == self.devices[m].name)).collect();
        let left: Vec<String> = self.members.iter().zip(&found).filter(|(_, f)| f.is_none()).map(|(&m, _)| self.devices[m].name.clone()).collect();
        if !left.is_empty() {
            return self.without(board, devices, format!("{} left", left.join(", ")), forced);
        }
        let members: Vec<usize> = found.into_iter().flatten().collect();
        // Hops as the ring's traffic measured them, where it has run under this plan, and
        // how much of a MoE model's experts it read from disk: what the next plan is judged on.
        if let Some(hop) = board.measured_hop() {
            devices = board::with_measured_hop(&devices, &members, hop);
        }
        if let (Some(ds), Some(moe)) = (board.measured_disk_share(), self.planner.model.moe.as_mut()) {
            moe.disk_share = ds;
        }
        board.gathered(devices.clone());
        let drift = scheduler::drift(&self.devices, &devices, &self.policy);
        let mut check = CheckView::new(forced, drift.clone(), String::new());
        if !forced && drift.is_empty() {
            check.reason = "no profile drifted".into();
            board.checked(check);
            return Ok(Verdict::Keep);
        }
        let strategy = ask.strategy.or(self.strategy).unwrap_or(self.planner.options.strategy);
        let candidate = self.planner.schedule(&devices, strategy)?;
        let current = scheduler::Current { members: &members, plan: running.plan };
        let decision = scheduler::decide(&devices, &self.planner.model, current, &candidate, &self.policy, self.planner.options.disk_threshold, ask.trigger);
        check.applied = decision.apply;
        check.current_tpot_ms = Some(decision.current_tpot_s * 1e3);
        check.candidate_tpot_ms = Some(decision.candidate_tpot_s * 1e3);
        check.reason = match ask.trigger {
            Trigger::Asked => format!("strategy {strategy} over {} candidate(s): {}", devices.len() - 1, decision.reason),
            Trigger::Drift => decision.reason,
        };
        tracing::info!(drift = ?drift, applied = decision.apply, "re-planning: {}", check.reason);
        // Later drift is measured from what this decision saw.
        self.devices = devices;
        self.members = members;
        board.checked(check);
        if !decision.apply {
            self.awaiting_fetch = None;
            return Ok(Verdict::Keep);
        }
        // The new plan's workers fetch what they lack while the running plan serves on.
        if let Some(progress) = cluster.fetch(&wanted(&candidate.plan, &addresses(&self.devices, &candidate.members)))? {
            self.awaiting_fetch = Some(ask);
            let mut check = CheckView::new(forced, Vec::new(), format!("the new plan waits for workers fetching their windows: {progress}"));
            check.fetching = Some(progress.clone());
            check.candidate_tpot_ms = Some(candidate.prediction.tpot_s * 1e3);
            board.checked(check);
            return Ok(Verdict::Fetching(progress));
        }
        Ok(self.adopting(candidate, strategy))
    }

    /// The ring stayed broken past `grace`: the members that cannot be reached are planned
    /// without (a discovered one must join again to be a candidate again). `Ok(None)`:
    /// every member answers, so there is nobody to plan without.
    pub fn after_loss(&mut self, cluster: &dyn Cluster, board: &PlanBoard, running: Running<'_>, grace: Duration) -> Result<Option<Verdict>> {
        let devices = cluster.gather(&self.planner, &[])?;
        let lost: Vec<String> = running.workers.iter().filter(|m| !devices.iter().any(|d| d.name == **m)).cloned().collect();
        if lost.is_empty() {
            return Ok(None);
        }
        for addr in lost.iter().filter_map(|m| m.parse::<SocketAddr>().ok()) {
            self.planner.membership.lost(addr);
        }
        self.without(board, devices, format!("{} unreachable for over {} s", lost.join(", "), grace.as_secs()), false).map(Some)
    }

    /// A member is gone (it said it leaves, or stayed lost): plans on `devices`, which lack
    /// it, with the running strategy — adopted whatever the gain, as the running plan
    /// cannot stay.
    fn without(&mut self, board: &PlanBoard, devices: Vec<DeviceProfile>, reason: String, forced: bool) -> Result<Verdict> {
        let strategy = self.strategy.unwrap_or(self.planner.options.strategy);
        let candidate = self.planner.schedule(&devices, strategy)?;
        board.gathered(devices.clone());
        let mut check = CheckView::new(forced, vec![reason.clone()], format!("{reason}: planning with the devices there are"));
        check.applied = true;
        check.candidate_tpot_ms = Some(candidate.prediction.tpot_s * 1e3);
        board.checked(check);
        tracing::warn!("{reason}: planning with the devices there are");
        self.devices = devices;
        Ok(self.adopting(candidate, strategy))
    }

    fn adopting(&mut self, candidate: Schedule, strategy: Strategy) -> Verdict {
        self.awaiting_fetch = None;
        self.strategy = Some(strategy);
        tracing::info!("{}", super::planning::table(&self.devices, &self.planner.model, &candidate, &[]));
        Verdict::Adopt(candidate, strategy)
    }
}

/// Each of `workers` with the windows `plan` gives it (the head is the plan's device 0).
pub fn wanted(plan: &Plan, workers: &[String]) -> Wanted {
    workers.iter().enumerate().map(|(i, w)| (w.clone(), plan.windows_of(i + 1).iter().map(|r| (r.start, r.end)).collect())).collect()
}

/// The real cluster: the planner's gathering over the network, and workers asked to fetch
/// their windows from this head's ring listener.
pub struct LiveCluster<'a> {
    pub rt: &'a tokio::runtime::Runtime,
    pub setup: &'a RingSetup,
    pub link_config: &'a LinkConfig,
    /// The head's ring listener, which serves the model to workers.
    pub listen: SocketAddr,
    pub fingerprint: &'a str,
}

impl LiveCluster<'_> {
    /// `fetch`, also handing back the connection to each worker, in order.
    pub fn connect_ready(&self, wanted: &Wanted) -> Result<(Vec<ControlClient>, Option<String>)> {
        let (secret, config, listen, advertise, fingerprint) = (&self.setup.secret, self.link_config, self.listen, &self.setup.advertise, self.fingerprint);
        self.rt.block_on(async {
            let mut waiting = Vec::new();
            let mut clients = Vec::with_capacity(wanted.len());
            // A relay (no windows) fetches the header only: its model's fingerprint.
            for (w, windows) in wanted {
                let client = ControlClient::connect(w, secret, config).await.map_err(|e| super::connecting(w, e))?;
                let source = match advertise {
                    Some(a) => a.clone(),
                    None => super::reachable_at(listen, w).await,
                };
                let request = FetchRequest { fingerprint: fingerprint.to_string(), source, windows: windows.clone() };
                let body = serde_json::to_value(&request).map_err(|e| Error::RingRefused(e.to_string()))?;
                let answer = client.call(shipping::FETCH, &body).await.map_err(|e| super::connecting(w, e))?;
                let status: FetchStatus = serde_json::from_value(answer).map_err(|e| Error::RingRefused(format!("worker {w} answered fetch_model with {e}")))?;
                if status.needed_bytes > 0 {
                    crate::metrics::model_fetch(w, status.needed_bytes, status.verified_bytes, status.refused_pieces);
                }
                if let Some(e) = status.error {
                    return Err(Error::RingBroken(format!("worker {w} could not fetch its windows from the head: {e}")));
                }
                if !status.ready {
                    let share = status.verified_bytes as f64 / status.needed_bytes.max(1) as f64 * 100.0;
                    waiting.push(format!("{w} {share:.0}% of {:.1} MB", status.needed_bytes as f64 / 1e6));
                }
                clients.push(client);
            }
            Ok((clients, (!waiting.is_empty()).then(|| waiting.join(", "))))
        })
    }
}

impl Cluster for LiveCluster<'_> {
    fn gather(&self, planner: &Planner, needed: &[String]) -> Result<Vec<DeviceProfile>> {
        planner.gather(self.rt, Duration::ZERO, Some(needed))
    }

    fn fetch(&self, wanted: &Wanted) -> Result<Option<String>> {
        Ok(self.connect_ready(wanted)?.1)
    }
}

#[cfg(test)]
mod tests {
    use std::path::PathBuf;
    use std::sync::{Arc, Mutex};

    use engine::ModelFile;
    use transport::ClusterSecret;

    use super::*;
    use crate::runtime::ring::membership::Membership;
    use crate::runtime::ring::planning::HEAD_NAME;

    const WORKERS: [&str; 3] = ["10.0.0.1:9090", "10.0.0.2:9090", "10.0.0.3:9090"];

    /// The prima.cpp paper's testbed (D3 leads), its workers named by address.
    fn testbed() -> Vec<DeviceProfile> {
        let mut d: Vec<DeviceProfile> = serde_json::from_str(include_str!("../../../../scheduler/tests/fixtures/testbed-d1-d4.json")).unwrap();
        d[0].name = HEAD_NAME.into();
        for (dev, w) in d[1..].iter_mut().zip(WORKERS) {
            dev.name = w.into();
        }
        d
    }

    /// A cluster that answers `devices` (a worker left out: gone or unreachable), and
    /// "still fetching" to the next `fetching` asks.
    #[derive(Default)]
    struct Scripted {
        devices: Mutex<Vec<DeviceProfile>>,
        fetching: Mutex<usize>,
        asked: Mutex<Vec<Wanted>>,
    }

    impl Scripted {
        fn new(devices: Vec<DeviceProfile>, fetching: usize) -> Scripted {
            Scripted { devices: Mutex::new(devices), fetching: Mutex::new(fetching), asked: Mutex::default() }
        }
    }

    impl Cluster for Scripted {
        fn gather(&self, _: &Planner, _: &[String]) -> Result<Vec<DeviceProfile>> {
            Ok(self.devices.lock().unwrap().clone())
        }

        fn fetch(&self, wanted: &Wanted) -> Result<Option<String>> {
            self.asked.lock().unwrap().push(wanted.clone());
            let mut left = self.fetching.lock().unwrap();
            if *left == 0 {
                return Ok(None);
            }
            *left -= 1;
            Ok(Some(format!("{} 40% of 35.0 MB", wanted.last().map_or("?", |w| w.0.as_str()))))
        }
    }

    struct Rig {
        replan: Replanning,
        plan: Plan,
        workers: Vec<String>,
        board: PlanBoard,
        model: PathBuf,
    }

    impl Drop for Rig {
        fn drop(&mut self) {
            let _ = std::fs::remove_file(&self.model);
        }
    }

    impl Rig {
        /// An 8-layer model running `even` over the head and the first `running` workers
        /// of the testbed (the others are candidates).
        fn new(tag: &str, running: usize) -> Rig {
            let model = std::env::temp_dir().join(format!("hearth-adoption-{tag}-{}.gguf", std::process::id()));
            engine::random_model::RandomModel::new("llama", 8, 64, 128, 4, 2).write(&crate::models::vocabulary_fixture(), &model).unwrap();
            let file = Arc::new(ModelFile::open(&model).unwrap());
            let membership = Membership::new(WORKERS.map(String::from).to_vec());
            let planner = Planner::new(file, model.clone(), membership, ClusterSecret::new("a test secret").unwrap(), 1, 4096, engine::CacheTypes::default(), Strategy::Even, 1);
            let devices = testbed()[..=running].to_vec();
            let s = planner.schedule(&devices, Strategy::Even).unwrap();
            assert_eq!(s.members.len(), running + 1, "{s:?}");
            let workers = addresses(&devices, &s.members);
            let replan = Replanning { planner, idle_after: None, policy: ReplanPolicy::default(), devices, members: s.members, strategy: Some(Strategy::Even), last_check: Instant::now(), awaiting_fetch: None };
            Rig { replan, plan: s.plan, workers, board: PlanBoard::ring(), model }
        }

        fn check(&mut self, cluster: &Scripted, forced: bool, ask: Ask) -> Verdict {
            self.replan.check(cluster, &self.board, Running { plan: &self.plan, workers: &self.workers }, forced, ask).unwrap()
        }

        /// The workers a verdict adopts, in ring order.
        fn adopted(&self, v: &Verdict) -> Vec<String> {
            match v {
                Verdict::Adopt(s, _) => addresses(&self.replan.devices, &s.members),
                other => panic!("expected a plan to adopt, got {other:?}"),
            }
        }

        fn last_check(&self) -> CheckView {
            self.board.view().last_check.expect("a check was recorded")
        }
    }

    const ASKED_EVEN: Ask = Ask { strategy: Some(Strategy::Even), trigger: Trigger::Asked };

    #[test]
    fn an_asked_plan_waits_for_its_workers_to_fetch_and_is_adopted_once_they_have_their_windows() {
        let mut rig = Rig::new("fetch", 1);
        let cluster = Scripted::new(testbed(), 2);
        let v = rig.check(&cluster, true, ASKED_EVEN);
        assert!(matches!(&v, Verdict::Fetching(p) if p.contains("40%")), "{v:?}");
        assert_eq!(rig.replan.awaiting_fetch, Some(ASKED_EVEN), "looked at again as it was asked for");
        assert!(rig.last_check().fetching.is_some_and(|p| p.contains("10.0.0.3:9090")));
        // The next idle look: still fetching; then every worker has its windows.
        assert!(matches!(rig.check(&cluster, true, ASKED_EVEN), Verdict::Fetching(_)));
        let v = rig.check(&cluster, true, ASKED_EVEN);
        assert_eq!(rig.adopted(&v), WORKERS.to_vec());
        assert_eq!(rig.replan.awaiting_fetch, None);
        // Every look asked each worker of the new plan for its own windows: 2 layers each.
        let asked = cluster.asked.lock().unwrap();
        assert_eq!(asked.len(), 3);
        assert!(asked.iter().all(|w| w.len() == 3 && w.iter().all(|(_, windows)| windows.iter().map(|(a, b)| b - a).sum::<usize>() == 2)), "{asked:?}");
    }

    #[test]
    fn the_running_plan_is_kept_when_nothing_drifted_and_asking_for_it_again_says_so() {
        let mut rig = Rig::new("keep", 3);
        let cluster = Scripted::new(testbed(), 0);
        assert!(matches!(rig.check(&cluster, false, Ask::DRIFT), Verdict::Keep));
        assert_eq!(rig.last_check().reason, "no profile drifted");
        assert!(matches!(rig.check(&cluster, true, ASKED_EVEN), Verdict::Keep));
        let check = rig.last_check();
        assert!(!check.applied && check.reason.contains("running plan again"), "{check:?}");
        assert!(cluster.asked.lock().unwrap().is_empty(), "nothing to fetch for a plan kept");
    }

    #[test]
    fn a_member_that_left_is_planned_without_whatever_the_gain() {
        let mut rig = Rig::new("left", 3);
        let mut devices = testbed();
        devices.remove(2);
        let cluster = Scripted::new(devices, 0);
        let v = rig.check(&cluster, false, Ask::DRIFT);
        assert_eq!(rig.adopted(&v), vec![WORKERS[0], WORKERS[2]]);
        let check = rig.last_check();
        assert!(check.applied && check.reason.contains("10.0.0.2:9090 left"), "{check:?}");
    }

    #[test]
    fn a_member_lost_past_the_grace_period_is_planned_without() {
        let mut rig = Rig::new("lost", 3);
        let everyone = Scripted::new(testbed(), 0);
        let running = Running { plan: &rig.plan, workers: &rig.workers };
        assert!(rig.replan.after_loss(&everyone, &rig.board, running, Duration::from_secs(30)).unwrap().is_none(), "every member answers");
        let mut devices = testbed();
        devices.pop();
        let cluster = Scripted::new(devices, 0);
        let running = Running { plan: &rig.plan, workers: &rig.workers };
        let v = rig.replan.after_loss(&cluster, &rig.board, running, Duration::from_secs(30)).unwrap().expect("a plan without the lost member");
        assert_eq!(rig.adopted(&v), vec![WORKERS[0], WORKERS[1]]);
        assert!(rig.last_check().reason.contains("10.0.0.3:9090 unreachable for over 30 s"));
    }
}
