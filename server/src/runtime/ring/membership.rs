//! Who may be in the ring, both sides of it. On the head: the workers named with
//! `--workers` and those that joined by discovery; the head's discovery task writes them
//! (announcing the head on the LAN and hearing joins), the planner reads the candidates at
//! every gathering, and the ring re-plans at its next idle moment when they changed.
//! Whether a candidate is used stays the plan's decision (the gain rule), as for a worker
//! named on the command line. On a worker: answering each head's announcement with a join
//! (or joining `--head` directly), saying it joined only once the head acknowledged it
//! (a `Welcome`), and saying it leaves when it stops.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use transport::discovery::{Discovery, Heard, Message};
use transport::ClusterSecret;

use super::WorkerDiscovery;
use crate::runtime::views::CandidateView;
use crate::error::{Error, Result};

/// How often the head announces itself: a worker started after the head finds it within
/// this long, and the joins it answers with keep the head's view of it fresh.
pub const ANNOUNCE_EVERY: Duration = Duration::from_secs(2);
/// How long a worker waits for the head named with `--head` to acknowledge its joins
/// before it looks into why: five joins' time, so one lost datagram or a head still
/// starting is not taken for a wrong address.
const WELCOME_WAIT: Duration = Duration::from_secs(10);
/// How long the look at a silent `--head` address may wait for a TCP connection.
const PROBE_TIMEOUT: Duration = Duration::from_secs(2);
/// A discovered worker not heard for this long is no longer a candidate (it joins again,
/// and is judged again, when it comes back). A live worker joins at every announcement, so
/// this is fifteen missed ones: a worker that is gone, not a lost datagram. Without it the
/// head would dial an address at every plan check for as long as it runs, whoever holds
/// that address by then.
pub const CANDIDATE_EXPIRY: Duration = Duration::from_secs(30);

/// A worker that joined by discovery.
#[derive(Debug, Clone)]
struct Joined {
    addr: String,
    name: String,
    since: SystemTime,
    last_heard: Instant,
}

#[derive(Default)]
struct Inner {
    configured: Vec<String>,
    joined: Vec<Joined>,
    /// Candidates that said they leave: no longer planned with until they join again.
    away: Vec<String>,
    /// A candidate came or went since the ring last looked.
    changed: bool,
}

/// The candidates, shared by the discovery task and the ring.
#[derive(Default)]
pub struct Membership {
    inner: Mutex<Inner>,
}

impl Membership {
    pub fn new(configured: Vec<String>) -> Arc<Membership> {
        Arc::new(Membership { inner: Mutex::new(Inner { configured, ..Inner::default() }) })
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Every candidate, in ring order: the configured workers, then the joined ones in
    /// the order they came.
    pub fn candidates(&self) -> Vec<String> {
        let inner = self.lock();
        inner.configured.iter().cloned().chain(inner.joined.iter().map(|j| j.addr.clone())).filter(|a| !inner.away.contains(a)).collect()
    }

    /// A worker said it serves the ring at `addr`. True when it is new, or back after
    /// leaving.
    pub fn joined(&self, addr: SocketAddr, name: &str) -> bool {
        let addr = addr.to_string();
        let mut inner = self.lock();
        if let Some(i) = inner.away.iter().position(|a| *a == addr) {
            inner.away.remove(i);
            Membership::changed(&mut inner, "joined");
            if let Some(j) = inner.joined.iter_mut().find(|j| j.addr == addr) {
                j.last_heard = Instant::now();
            }
            return true;
        }
        if inner.configured.contains(&addr) {
            return false;
        }
        if let Some(j) = inner.joined.iter_mut().find(|j| j.addr == addr) {
            j.last_heard = Instant::now();
            j.name = name.to_string();
            return false;
        }
        inner.joined.push(Joined { addr, name: name.to_string(), since: SystemTime::now(), last_heard: Instant::now() });
        Membership::changed(&mut inner, "joined");
        true
    }

    /// A worker said it leaves: planned without from the next plan check on. True when
    /// it was a candidate.
    pub fn left(&self, addr: SocketAddr) -> bool {
        let addr = addr.to_string();
        let mut inner = self.lock();
        let known = inner.configured.contains(&addr) || inner.joined.iter().any(|j| j.addr == addr);
        if !known || inner.away.contains(&addr) {
            return false;
        }
        inner.away.push(addr);
        Membership::changed(&mut inner, "left");
        true
    }

    /// The ring planned without `addr` after losing it: a discovered worker must join
    /// again (it does within an announcement of coming back) to be judged again. A worker
    /// from `--workers` stays a candidate (nothing else would bring it back).
    pub fn lost(&self, addr: SocketAddr) {
        let addr = addr.to_string();
        let mut inner = self.lock();
        if inner.joined.iter().any(|j| j.addr == addr) && !inner.away.contains(&addr) {
            inner.away.push(addr);
        }
        crate::metrics::cluster_membership("lost", &Membership::counts(&inner));
    }

    /// Forgets the discovered workers not heard for `expiry` (see [`CANDIDATE_EXPIRY`]);
    /// returns their addresses and names.
    pub fn expire(&self, expiry: Duration) -> Vec<(String, String)> {
        let mut inner = self.lock();
        let (gone, kept): (Vec<Joined>, Vec<Joined>) = std::mem::take(&mut inner.joined).into_iter().partition(|j| j.last_heard.elapsed() >= expiry);
        inner.joined = kept;
        if gone.is_empty() {
            return Vec::new();
        }
        let was_candidate = gone.iter().any(|j| !inner.away.contains(&j.addr));
        inner.away.retain(|a| !gone.iter().any(|j| j.addr == *a));
        if was_candidate {
            Membership::changed(&mut inner, "expired");
        } else {
            crate::metrics::cluster_membership("expired", &Membership::counts(&inner));
        }
        gone.into_iter().map(|j| (j.addr, j.name)).collect()
    }

    /// Whether candidates came or went since the last call.
    pub fn take_changed(&self) -> bool {
        std::mem::take(&mut self.lock().changed)
    }

    /// Candidates by origin and state, every combination (zeros too), for the metrics.
    fn counts(inner: &Inner) -> Vec<(&'static str, &'static str, usize)> {
        let away = |a: &String| inner.away.contains(a);
        let (c_away, j_away) = (inner.configured.iter().filter(|a| away(a)).count(), inner.joined.iter().filter(|j| away(&j.addr)).count());
        vec![
            ("workers", "candidate", inner.configured.len() - c_away),
            ("workers", "left", c_away),
            ("discovery", "candidate", inner.joined.len() - j_away),
            ("discovery", "left", j_away),
        ]
    }

    fn changed(inner: &mut Inner, event: &'static str) {
        inner.changed = true;
        crate::metrics::cluster_membership(event, &Membership::counts(inner));
    }

    pub fn view(&self) -> Vec<CandidateView> {
        let inner = self.lock();
        let state = |a: &String| if inner.away.contains(a) { "left" } else { "candidate" };
        let configured = inner.configured.iter().map(|a| CandidateView { addr: a.clone(), name: a.clone(), origin: "workers", state: state(a), joined_at: None, last_heard_s: None });
        let joined = inner.joined.iter().map(|j| CandidateView {
            addr: j.addr.clone(),
            name: j.name.clone(),
            origin: "discovery",
            state: state(&j.addr),
            joined_at: j.since.duration_since(UNIX_EPOCH).ok().map(|d| d.as_secs()),
            last_heard_s: Some(j.last_heard.elapsed().as_secs_f64()),
        });
        configured.chain(joined).collect()
    }
}

/// The head's side of discovery: announces itself every [`ANNOUNCE_EVERY`] and records the
/// workers that join. Runs until the runtime stops.
pub async fn serve_head(discovery: Discovery, membership: Arc<Membership>, name: String) {
    let port = discovery.port();
    // Joins to this head's own port: a worker on this machine shares the announced port.
    let announce = Message::Announce { port: discovery.direct_port(), name };
    let mut tick = tokio::time::interval(ANNOUNCE_EVERY);
    let mut warned = false;
    let welcome = Message::Welcome { port: discovery.direct_port(), name: match &announce { Message::Announce { name, .. } => name.clone(), _ => String::new() } };
    loop {
        tokio::select! {
            _ = tick.tick() => {
                for (worker, name) in membership.expire(CANDIDATE_EXPIRY) {
                    tracing::info!(%worker, %name, "a discovered worker has not been heard for {} s: no longer a candidate until it joins again", CANDIDATE_EXPIRY.as_secs());
                }
                match discovery.broadcast(&announce, port).await {
                    Ok(()) => warned = false,
                    Err(e) if !warned => {
                        tracing::warn!("announcing this head on the LAN failed (workers can still join with --head): {e}");
                        warned = true;
                    }
                    Err(_) => {}
                }
            }
            heard = discovery.recv() => match heard {
                Ok(h) => {
                    // Answered from this head's own port, to where the join came from, for
                    // that worker alone.
                    let (from, worker) = (h.from, h.sender);
                    if on_heard(&membership, h) {
                        if let Err(e) = discovery.send_to(&welcome, from, Some(worker)).await {
                            tracing::debug!(worker = %from, "could not acknowledge a join: {e}");
                        }
                    }
                }
                Err(e) => {
                    tracing::warn!("discovery socket failed: {e}");
                    tokio::time::sleep(ANNOUNCE_EVERY).await;
                }
            },
        }
    }
}

/// Records what a worker said; `true` when it was a join to acknowledge (every join,
/// keep-alives too: a worker that missed the first welcome hears the next).
fn on_heard(membership: &Membership, heard: Heard) -> bool {
    let addr = heard.addr();
    match heard.message {
        Message::Join { name, .. } => {
            if membership.joined(addr, &name) {
                tracing::info!(worker = %addr, %name, "a worker joined by discovery: it is a candidate at the next plan");
            }
            true
        }
        Message::Leave { name, .. } => {
            if membership.left(addr) {
                tracing::info!(worker = %addr, %name, "a worker is leaving: the next plan goes without it");
            }
            false
        }
        // Another head on the same LAN and secret: two heads would fight over workers.
        Message::Announce { name, .. } => {
            tracing::warn!(head = %addr, %name, "another head announces itself with this cluster secret");
            false
        }
        Message::Welcome { .. } => false,
    }
}

/// A worker's joining, running in the background: what it needs to say it leaves.
pub struct Joining {
    discovery: Arc<Discovery>,
    heads: Arc<Mutex<Vec<Head>>>,
    leave: Message,
    /// Set once leaving: no more joins (they would undo the leave).
    leaving: Arc<AtomicBool>,
    /// Why the head named with `--head` can never acknowledge a join (a wrong port): the
    /// worker stops with it.
    refused: Option<tokio::sync::oneshot::Receiver<String>>,
}

impl Joining {
    /// Resolves when the `--head` address turned out to be no head's discovery port, with
    /// the error to stop on; never otherwise.
    pub async fn refused(&mut self) -> String {
        match self.refused.as_mut() {
            Some(rx) => match rx.await {
                Ok(why) => why,
                Err(_) => std::future::pending().await,
            },
            None => std::future::pending().await,
        }
    }

    /// Tells every head this worker joined that it is leaving (best effort: one datagram
    /// each; a head that misses it sees the links close), and stops joining.
    pub async fn leave(&self) {
        self.leaving.store(true, Ordering::Release);
        let heads = self.heads.lock().unwrap_or_else(|e| e.into_inner()).clone();
        for Head { addr: head, id } in heads {
            if let Err(e) = self.discovery.send_to(&self.leave, head, id).await {
                tracing::warn!(%head, "could not tell the head this worker leaves: {e}");
            }
        }
    }
}

/// Starts a worker's joining: with `--head`, a join to it every [`ANNOUNCE_EVERY`];
/// otherwise (and as well) a join in answer to every head's announcement heard on the
/// LAN. `ring_port` is where this worker's ring server listens.
pub async fn serve_worker(d: WorkerDiscovery, ring_port: u16, secret: ClusterSecret) -> Result<Joining> {
    let direct = match &d.head {
        Some(h) => {
            let with_port = if h.rsplit_once(':').is_some_and(|(_, p)| p.parse::<u16>().is_ok()) { h.clone() } else { format!("{h}:{}", d.port) };
            let addr = tokio::net::lookup_host(&with_port).await.ok().and_then(|mut a| a.next()).ok_or_else(|| Error::Config(format!("--head {h}: not an address this machine can resolve")))?;
            Some(addr)
        }
        None => None,
    };
    // With a head named, this worker need not hear the LAN's announcements on the shared port.
    let discovery = Arc::new(Discovery::bind(if direct.is_some() { 0 } else { d.port }, &secret)?);
    let join = Message::Join { port: ring_port, name: d.name.clone() };
    let heads: Arc<Mutex<Vec<Head>>> = Arc::default();
    let leaving = Arc::new(AtomicBool::new(false));
    let (task_discovery, task_heads, task_leaving) = (discovery.clone(), heads.clone(), leaving.clone());
    match direct {
        Some(head) => tracing::info!(%head, "joining the head named with --head"),
        None => tracing::info!(port = d.port, "looking for a head on the LAN"),
    }
    let (refuse, refused) = tokio::sync::oneshot::channel();
    let named = d.head.clone().unwrap_or_default();
    tokio::spawn(async move {
        let mut tick = tokio::time::interval(ANNOUNCE_EVERY);
        // Heads that acknowledged a join, by the address their welcome came from.
        let mut welcomed: Vec<SocketAddr> = Vec::new();
        let started = Instant::now();
        let mut refuse = Some(refuse);
        loop {
            // The head named with --head stayed silent: find out why, once.
            if let (Some(head), true) = (direct, started.elapsed() >= WELCOME_WAIT) {
                if !welcomed.iter().any(|w| w.ip() == head.ip()) {
                    if let Some(tx) = refuse.take() {
                        match silent_head(&named, head).await {
                            Some(why) => {
                                let _ = tx.send(why);
                                return;
                            }
                            None => tracing::warn!(%head, "no head has acknowledged this worker's joins yet: is one running there with the same --cluster-secret, and is {} its discovery port (UDP, {} unless the head sets --discovery-port)? Still trying", head.port(), transport::discovery::DEFAULT_PORT),
                        }
                    }
                }
            }
            let head = tokio::select! {
                _ = tick.tick(), if direct.is_some() => direct.map(|addr| Head { addr, id: None }),
                heard = task_discovery.recv() => match heard {
                    Ok(h @ Heard { message: Message::Announce { .. }, .. }) => Some(Head { addr: h.addr(), id: Some(h.sender) }),
                    Ok(Heard { message: Message::Welcome { name, .. }, from, sender }) => {
                        let asked = {
                            let mut known = task_heads.lock().unwrap_or_else(|e| e.into_inner());
                            // The leave is meant for this head alone. Joins to a head named
                            // with --head name none: a restarted head has a new id.
                            known.iter_mut().filter(|h| h.addr.ip() == from.ip()).map(|h| h.id = Some(sender)).count() > 0
                        };
                        if asked && !welcomed.contains(&from) {
                            welcomed.push(from);
                            tracing::info!(head = %from, %name, "joined the head at {from}: it acknowledged this worker");
                        }
                        None
                    }
                    Ok(_) => None,
                    Err(e) => {
                        tracing::warn!("discovery socket failed: {e}");
                        tokio::time::sleep(ANNOUNCE_EVERY).await;
                        None
                    }
                },
            };
            let Some(head) = head.filter(|_| !task_leaving.load(Ordering::Acquire)) else { continue };
            let new = {
                let mut known = task_heads.lock().unwrap_or_else(|e| e.into_inner());
                match known.iter_mut().find(|h| h.addr == head.addr) {
                    Some(k) => {
                        if head.id.is_some() {
                            k.id = head.id;
                        }
                        false
                    }
                    None => {
                        known.push(head);
                        true
                    }
                }
            };
            // An announced head's join is meant for the head whose announcement it
            // answers; a --head join for whichever head listens there.
            let (head, id) = (head.addr, head.id);
            match task_discovery.send_to(&join, head, id).await {
                // Joined only once it answers (see the welcome above).
                Ok(()) if new => tracing::info!(%head, "found a head: asked to join it"),
                Ok(()) => {}
                Err(e) => tracing::warn!(%head, "could not send a join: {e}"),
            }
        }
    });
    Ok(Joining { discovery, heads, leave: Message::Leave { port: ring_port, name: d.name }, leaving, refused: Some(refused) })
}

/// A head this worker sends joins to: where, and its id once heard (from its announcement,
/// or its welcome for a head named with `--head`).
#[derive(Debug, Clone, Copy)]
struct Head {
    addr: SocketAddr,
    id: Option<transport::PeerId>,
}

/// Why the head named with `--head NAMED` (resolved to `head`) answered no join, when that
/// is certain: something there accepts TCP connections, which a discovery port (UDP) does
/// not — most likely the head's ring (`--ring-listen`) or API port. `None`: nothing to
/// tell yet (a head still starting, another secret, a firewall).
async fn silent_head(named: &str, head: SocketAddr) -> Option<String> {
    let tcp = tokio::time::timeout(PROBE_TIMEOUT, tokio::net::TcpStream::connect(head)).await;
    matches!(tcp, Ok(Ok(_))).then(|| {
        format!(
            "--head {named}: {head} answers TCP connections but no join: that is not a head's discovery port (perhaps its ring or API port). Name the head's discovery port (UDP, {port} unless the head sets --discovery-port), e.g. --head {ip}:{port}, or just --head {ip}",
            port = transport::discovery::DEFAULT_PORT,
            ip = head.ip()
        )
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn joins_add_candidates_once_after_the_configured_workers() {
        let m = Membership::new(vec!["10.0.0.5:9000".into()]);
        assert!(!m.take_changed());
        assert!(m.joined("10.0.0.7:9001".parse().unwrap(), "desktop"));
        assert!(!m.joined("10.0.0.7:9001".parse().unwrap(), "desktop"), "a repeated join is a keep-alive");
        assert!(!m.joined("10.0.0.5:9000".parse().unwrap(), "laptop"), "already configured");
        assert_eq!(m.candidates(), vec!["10.0.0.5:9000".to_string(), "10.0.0.7:9001".to_string()]);
        assert!(m.take_changed());
        assert!(!m.take_changed());
        let v = m.view();
        assert_eq!((v[0].origin, v[1].origin, v[1].name.as_str()), ("workers", "discovery", "desktop"));
    }

    #[test]
    fn a_worker_that_leaves_is_no_candidate_until_it_joins_again() {
        let m = Membership::new(vec!["10.0.0.5:9000".into()]);
        let (configured, joined) = ("10.0.0.5:9000".parse().unwrap(), "10.0.0.7:9001".parse().unwrap());
        m.joined(joined, "desktop");
        m.take_changed();
        assert!(m.left(configured) && m.left(joined));
        assert!(!m.left(joined), "said twice");
        assert!(!m.left("10.0.0.9:1".parse().unwrap()), "never a candidate");
        assert!(m.candidates().is_empty());
        assert!(m.take_changed());
        assert_eq!(m.view().iter().map(|c| c.state).collect::<Vec<_>>(), vec!["left", "left"]);
        assert!(m.joined(configured, "laptop"), "back");
        assert_eq!(m.candidates(), vec!["10.0.0.5:9000".to_string()]);
        assert!(m.take_changed());
    }

    #[test]
    fn a_discovered_worker_not_heard_expires_and_a_configured_one_never_does() {
        let m = Membership::new(vec!["10.0.0.5:9000".into()]);
        let (joined, gone) = ("10.0.0.7:9001".parse().unwrap(), "10.0.0.8:9002".parse().unwrap());
        m.joined(joined, "desktop");
        m.joined(gone, "phone");
        assert!(m.left(gone));
        m.take_changed();
        assert!(m.expire(CANDIDATE_EXPIRY).is_empty(), "heard just now");
        assert!(!m.take_changed());
        let mut expired = m.expire(Duration::ZERO);
        expired.sort();
        assert_eq!(expired, vec![("10.0.0.7:9001".into(), "desktop".into()), ("10.0.0.8:9002".into(), "phone".into())]);
        assert_eq!(m.candidates(), vec!["10.0.0.5:9000".to_string()]);
        assert!(m.take_changed(), "a candidate went");
        assert_eq!(m.view().len(), 1, "nothing of the expired ones is kept");
        assert!(m.joined(joined, "desktop"), "it joins again as new");
    }
}
