//! The head's plan as the admin API and the metrics see it, and the queue of re-plan
//! requests (`POST /admin/replan`). The pipeline that owns the ring writes it (after every
//! plan it adopts, every idle check and every decode token's time); HTTP handlers only
//! read it and leave requests the pipeline picks up the next time the queue is idle.

use std::collections::VecDeque;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use scheduler::{DeviceProfile, ModelProfile, Plan, Strategy};
use tokio::sync::oneshot;

use crate::error::ReplanError;
use super::planning::HEAD_NAME;
use crate::runtime::views::{CheckView, ClusterView, PlanView, WhatIf};

/// Devices a "what if" may add at once: each is a device more in every integer program.
const MAX_WHAT_IF_COPIES: usize = 8;

/// Decode steps of one token the measured TPOT averages over: enough to smooth a busy
/// moment, few enough to follow a plan change within a short answer.
const MEASURED_WINDOW: usize = 64;

/// A request to solve again now (when idle), optionally with another strategy.
pub struct ReplanRequest {
    pub strategy: Option<Strategy>,
    pub reply: oneshot::Sender<Result<PlanView, ReplanError>>,
}

/// What the cost model needs to judge the running plan at another context.
#[derive(Debug, Clone)]
pub struct Judge {
    /// The members' profiles, in ring order.
    pub members: Vec<DeviceProfile>,
    pub model: ModelProfile,
    pub plan: Plan,
    pub disk_threshold: f64,
    /// The scheduler's options with the running strategy: what a "what if" solves with.
    pub options: scheduler::Options,
}

/// One single-token decode step as the ring timed it.
#[derive(Debug, Clone)]
struct Measured {
    step: Duration,
    /// Tokens in the KV cache.
    context: usize,
    /// The mean hop of its round trips, seconds (none without workers).
    hop: Option<f64>,
    /// Bytes each member (the head first) read from disk while computing it.
    reads: Option<Vec<u64>>,
}

/// `devices` with the hop the ring measured (seconds, the mean over its members, indices
/// into `devices`) in place of their control-call estimates. The estimate is half a
/// control round trip; a frame's hop also wakes the receiving member's ring thread and
/// crosses its I/O runtime (235–440 µs against ~50 µs on loopback here), and only traffic
/// shows that. What the ring adds over the members' estimates is added to every device
/// (a candidate outside the ring would pay it too), keeping the links' differences.
pub fn with_measured_hop(devices: &[DeviceProfile], members: &[usize], hop: f64) -> Vec<DeviceProfile> {
    let mut out = devices.to_vec();
    let estimates: Vec<f64> = members.iter().filter_map(|&m| out.get(m)).map(|d| d.comm_s).collect();
    if estimates.is_empty() || !hop.is_finite() {
        return out;
    }
    let extra = hop - estimates.iter().sum::<f64>() / estimates.len() as f64;
    if extra > 0.0 {
        for d in &mut out {
            d.comm_s += extra;
        }
    }
    out
}

pub struct PlanBoard {
    view: Mutex<PlanView>,
    cluster: Mutex<ClusterView>,
    /// Recent single-token decode steps.
    measured: Mutex<VecDeque<Measured>>,
    judge: Mutex<Option<Judge>>,
    requests: Mutex<Vec<ReplanRequest>>,
    membership: Mutex<Option<Arc<super::membership::Membership>>>,
    /// Whether anything can be re-planned (a ring head with a scheduler).
    plannable: bool,
    /// Held while a "what if" solves.
    what_if_lock: Mutex<()>,
}

impl PlanBoard {
    /// A head without workers: one member running every layer.
    pub fn single(n_layer: usize) -> PlanBoard {
        let plan = Plan { n_layer, devices: vec![scheduler::DevicePlan::new(n_layer, 0)] };
        let board = PlanBoard::new(PlanView::of("single", false, &plan, &[HEAD_NAME.to_string()], None, Vec::new()), false);
        board.export();
        board
    }

    /// A ring head's board; the ring publishes its first plan when it has one.
    pub fn ring() -> PlanBoard {
        PlanBoard::new(PlanView::of("forming", false, &Plan { n_layer: 0, devices: Vec::new() }, &[], None, Vec::new()), true)
    }

    fn new(view: PlanView, plannable: bool) -> PlanBoard {
        PlanBoard { view: Mutex::new(view), cluster: Mutex::default(), measured: Mutex::default(), judge: Mutex::default(), requests: Mutex::default(), membership: Mutex::default(), plannable, what_if_lock: Mutex::default() }
    }

    pub fn view(&self) -> PlanView {
        let mut v = self.view.lock().expect("plan view").clone();
        let measured = self.measured.lock().expect("measured");
        v.measured_steps = measured.len();
        if measured.is_empty() {
            return v;
        }
        let n = measured.len() as f64;
        v.measured_tpot_ms = Some(measured.iter().map(|m| m.step).sum::<Duration>().as_secs_f64() * 1e3 / n);
        let context = measured.iter().map(|m| m.context as f64).sum::<f64>() / n;
        v.measured_context = Some(context);
        let hop = mean_hop(&measured);
        v.measured_hop_ms = hop.map(|h| h * 1e3);
        if let Some(j) = self.judge.lock().expect("judge").as_ref() {
            let mut model = j.model.at_context(context.round() as usize);
            let members = match hop {
                Some(h) => with_measured_hop(&j.members, &(0..j.members.len()).collect::<Vec<_>>(), h),
                None => j.members.clone(),
            };
            v.measured_disk_share = disk_share(j, &model, &measured);
            if let (Some(ds), Some(m)) = (v.measured_disk_share, model.moe.as_mut()) {
                m.disk_share = ds;
            }
            v.predicted_tpot_ms_at_measured_context = Some(scheduler::predict_ring(&members, &model, &j.plan, j.disk_threshold).tpot_s * 1e3);
        }
        v
    }

    /// The MoE disk share the running plan's recent decode steps measured (see
    /// `PlanView::measured_disk_share`).
    pub fn measured_disk_share(&self) -> Option<f64> {
        let measured = self.measured.lock().expect("measured");
        let judge = self.judge.lock().expect("judge");
        let j = judge.as_ref()?;
        let n = measured.len().max(1) as f64;
        let context = measured.iter().map(|m| m.context as f64).sum::<f64>() / n;
        disk_share(j, &j.model.at_context(context.round() as usize), &measured)
    }

    /// The mean hop of the recent decode steps under the running plan, seconds.
    pub fn measured_hop(&self) -> Option<f64> {
        mean_hop(&self.measured.lock().expect("measured"))
    }

    pub fn cluster(&self) -> ClusterView {
        let mut view = self.cluster.lock().expect("cluster view").clone();
        if let Some(m) = self.membership.lock().expect("membership").as_ref() {
            view.candidates = m.view();
        }
        view
    }

    /// Where `/admin/cluster` reads the candidates from.
    pub fn set_membership(&self, m: Arc<super::membership::Membership>) {
        *self.membership.lock().expect("membership") = Some(m);
    }

    /// A new plan is running: its view replaces the old one and the measurements start over.
    pub fn adopted(&self, mut view: PlanView, judge: Option<Judge>, replan: bool) {
        *self.judge.lock().expect("judge") = judge;
        {
            let mut v = self.view.lock().expect("plan view");
            view.replans = v.replans + u64::from(replan);
            view.adopted_at = Some(crate::process::now_secs());
            view.last_check = v.last_check.clone();
            *v = view;
        }
        self.measured.lock().expect("measured").clear();
        if replan {
            crate::metrics::replanned();
        }
        self.export();
    }

    /// What member `i` (0: the head) placed on its accelerator when it loaded the plan:
    /// its own `--gpu-layers` / `--experts-in-ram` may override the plan's.
    pub fn placed(&self, i: usize, gpu_layers: usize, experts_in_ram: usize) {
        {
            let mut v = self.view.lock().expect("plan view");
            let Some(m) = v.members.get_mut(i) else { return };
            if (m.gpu_layers, m.experts_in_ram) == (gpu_layers, experts_in_ram) {
                return;
            }
            m.planned_gpu_layers = Some(m.planned_gpu_layers.unwrap_or(m.gpu_layers));
            m.planned_experts_in_ram = Some(m.planned_experts_in_ram.unwrap_or(m.experts_in_ram));
            (m.gpu_layers, m.experts_in_ram) = (gpu_layers, experts_in_ram);
        }
        self.export();
    }

    pub fn checked(&self, check: CheckView) {
        self.view.lock().expect("plan view").last_check = Some(check);
    }

    pub fn gathered(&self, devices: Vec<DeviceProfile>) {
        *self.cluster.lock().expect("cluster view") = ClusterView { devices, gathered_at: Some(crate::process::now_secs()), candidates: Vec::new() };
    }

    /// The time of one decode step of a single token, with `context` tokens in its cache,
    /// the mean hop of its round trips (seconds) and what each member read from disk.
    pub fn decode_step(&self, d: Duration, context: usize, hop: Option<f64>, reads: Option<&[u64]>) {
        let mean = {
            let mut m = self.measured.lock().expect("measured");
            // The oldest step's buffer holds this one's reads: no allocation per token.
            let recycled = if m.len() == MEASURED_WINDOW { m.pop_front().and_then(|old| old.reads) } else { None };
            let reads = reads.map(|r| {
                let mut v = recycled.unwrap_or_default();
                v.clear();
                v.extend_from_slice(r);
                v
            });
            m.push_back(Measured { step: d, context, hop, reads });
            m.iter().map(|m| m.step).sum::<Duration>().as_secs_f64() / m.len() as f64
        };
        crate::metrics::measured_tpot(mean);
    }

    /// What the scheduler would plan on the last gathered profiles without the devices in
    /// `without` and with a copy of each device in `copies` (another machine like it: its
    /// profile on a host of its own), with `strategy` or the running one. Nothing is
    /// adopted. One at a time: each is a full schedule (integer programs).
    pub fn what_if(&self, without: &[String], copies: &[String], strategy: Option<Strategy>) -> Result<WhatIf, ReplanError> {
        if !self.plannable {
            return Err(ReplanError::NotARing);
        }
        if copies.len() > MAX_WHAT_IF_COPIES {
            return Err(ReplanError::WhatIf { param: "copies", message: format!("at most {MAX_WHAT_IF_COPIES} copies of devices at once") });
        }
        let _one_at_a_time = self.what_if_lock.lock().expect("what-if lock");
        let (model, options) = match self.judge.lock().expect("judge").as_ref() {
            Some(j) => (j.model.clone(), j.options.clone()),
            None => return Err(ReplanError::Failed("the ring has no plan yet".into())),
        };
        let gathered = self.cluster.lock().expect("cluster view").devices.clone();
        let known = |name: &str| gathered.iter().any(|d| d.name == name);
        for name in without {
            if name == HEAD_NAME {
                return Err(ReplanError::WhatIf { param: "without", message: "the head leads every ring: it cannot be planned without".into() });
            }
            if !known(name) {
                return Err(ReplanError::WhatIf { param: "without", message: format!("no device {name:?} among the gathered profiles") });
            }
        }
        let mut devices: Vec<DeviceProfile> = gathered.iter().filter(|d| !without.contains(&d.name)).cloned().collect();
        for (i, name) in copies.iter().enumerate() {
            let Some(original) = gathered.iter().find(|d| &d.name == name) else {
                return Err(ReplanError::WhatIf { param: "copies", message: format!("no device {name:?} among the gathered profiles") });
            };
            let mut copy = original.clone();
            copy.name = format!("copy {} of {name}", i + 1);
            copy.head = false;
            copy.host = None;
            devices.push(copy);
        }
        let options = scheduler::Options { strategy: strategy.unwrap_or(options.strategy), ..options };
        let s = scheduler::schedule(&devices, &model, &options).map_err(|e| ReplanError::Failed(format!("the {} plan: {e}", options.strategy)))?;
        let forecast = super::planning::forecast(&devices, &model, &s);
        Ok(WhatIf { devices, schedule: s, forecast, current: self.view() })
    }

    /// Queues a re-plan for the next idle moment. Fails when there is nothing to plan.
    pub fn request(&self, r: ReplanRequest) -> Result<(), ReplanError> {
        if !self.plannable {
            return Err(ReplanError::NotARing);
        }
        self.requests.lock().expect("replan requests").push(r);
        Ok(())
    }

    pub fn take_requests(&self) -> Vec<ReplanRequest> {
        std::mem::take(&mut *self.requests.lock().expect("replan requests"))
    }

    fn export(&self) {
        let v = self.view.lock().expect("plan view");
        crate::metrics::plan(v.predicted_tpot_ms.map(|t| t / 1e3), v.rounds, v.members.iter().map(|m| (m.name.as_str(), v.rounds * m.window, v.rounds * m.gpu_layers, v.rounds * m.experts_in_ram)), v.dropped.iter().map(String::as_str));
    }
}

/// The disk share under which `model` reads what the steps measured per member.
fn disk_share(j: &Judge, model: &ModelProfile, measured: &VecDeque<Measured>) -> Option<f64> {
    let n = j.members.len();
    let steps: Vec<&Vec<u64>> = measured.iter().filter_map(|m| m.reads.as_ref()).filter(|r| r.len() == n).collect();
    if steps.is_empty() {
        return None;
    }
    let mean: Vec<f64> = (0..n).map(|i| steps.iter().map(|r| r[i] as f64).sum::<f64>() / steps.len() as f64).collect();
    scheduler::measured_disk_share(&j.members, model, &j.plan, &mean)
}

fn mean_hop(measured: &VecDeque<Measured>) -> Option<f64> {
    let hops: Vec<f64> = measured.iter().filter_map(|m| m.hop).collect();
    (!hops.is_empty()).then(|| hops.iter().sum::<f64>() / hops.len() as f64)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn device(comm_s: f64) -> DeviceProfile {
        DeviceProfile {
            name: "d".into(),
            os: scheduler::Os::Linux,
            head: false,
            cpu_flops: Default::default(),
            cpu_read_bw: 1e10,
            kv_copy_cpu_s: 0.0,
            disk_seq_read: 1e9,
            disk_rand_read: 1e9,
            ram_total: 8e9,
            ram_available: 8e9,
            swap_available: 0.0,
            bytes_can_swap: 0.0,
            gpu: None,
            comm_s,
            prompt_token_share: 0.0, row_steps: Vec::new(), output_row_steps: Vec::new(), host: None,
        }
    }

    #[test]
    fn the_measured_hop_replaces_the_members_estimates_and_keeps_the_links_differences() {
        // Two members estimated at 50 and 150 µs, a candidate outside the ring at 1 ms;
        // the ring measured 400 µs per hop: 300 µs more than the members' estimates.
        let devices = [device(50e-6), device(150e-6), device(1e-3)];
        let out = with_measured_hop(&devices, &[0, 1], 400e-6);
        let got: Vec<f64> = out.iter().map(|d| (d.comm_s * 1e6).round()).collect();
        assert_eq!(got, [350.0, 450.0, 1300.0]);
        // A ring faster than the estimates leaves them alone (never cheaper than a call).
        let out = with_measured_hop(&devices, &[0, 1], 20e-6);
        assert_eq!(out, devices.to_vec());
        // Nothing to compare against: unchanged.
        assert_eq!(with_measured_hop(&devices, &[], 400e-6), devices.to_vec());
        assert_eq!(with_measured_hop(&devices, &[0], f64::NAN), devices.to_vec());
    }

    #[test]
    fn the_view_reports_the_mean_hop_of_decode_steps_and_predicts_with_it() {
        let board = PlanBoard::ring();
        assert_eq!(board.measured_hop(), None);
        board.decode_step(Duration::from_millis(10), 100, Some(300e-6), None);
        board.decode_step(Duration::from_millis(12), 102, None, None);
        board.decode_step(Duration::from_millis(14), 104, Some(500e-6), None);
        let v = board.view();
        assert!((v.measured_hop_ms.unwrap() - 0.4).abs() < 1e-9);
        assert!((v.measured_tpot_ms.unwrap() - 12.0).abs() < 1e-9);
        assert!((v.measured_context.unwrap() - 102.0).abs() < 1e-9);
    }
}
