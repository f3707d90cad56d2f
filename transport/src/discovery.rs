//! Finding the head on the LAN without trusting the LAN: one UDP datagram per message,
//! MACed with a key stretched from the cluster secret and the sender's salt.
//!
//! ```text
//! head   -> LAN   Announce { port }          every few seconds, to the multicast group and
//!                                            to each interface's broadcast address
//! worker -> head  Join     { port, name }    "my ring server listens at <source ip>:<port>"
//! head   -> worker Welcome { port, name }    in answer to each join it recorded: the
//!                                            worker says it joined only once it hears it
//! worker -> head  Leave    { port, name }    sent on SIGTERM, before the worker stops
//! ```
//!
//! A datagram is `MAGIC | salt | HMAC-SHA256(key, LABEL | salt | body) | body`. The salt is
//! 16 random bytes each node draws at start, in clear; the key is Argon2id of the secret
//! with that salt ([`ClusterSecret::salted`]), so a table of stretched guesses made for one
//! sender's salt serves no other sender, let alone every cluster. A receiver stretches the
//! key of each sender's salt once and keeps the keys of salts that verified
//! ([`MAX_SALTS`]); as a stranger can send any salt, new salts are stretched at a bounded
//! rate ([`NEW_SALT_BURST`], [`NEW_SALT_EVERY`]) and the rest dropped. A datagram recorded
//! on the LAN still lets a stranger test guesses offline, at Argon2's full cost per guess
//! for that one salt: nothing one-to-many can avoid that, and a secret from `hearth
//! secret` makes it moot (docs/security.md). The body is JSON with the
//! sender's random id (per process), a unix-ms timestamp, a fresh nonce, the sender's own
//! IPv4 addresses, the id of the node it is meant for (all but announcements) and the
//! message. The receiver drops a datagram that is malformed, carries a wrong MAC, a
//! timestamp more than a minute off its clock, a nonce it has accepted before
//! ([`crate::freshness`]), is meant for another node, or came
//! from an address its sender did not sign; it also drops its own datagrams (multicast
//! loops back). Refusals are logged a few a minute ([`crate::throttle`]).
//!
//! A stranger on the LAN can capture datagrams but not make one, so what it can do is send
//! a captured copy again, from its own address or another node's:
//!
//! - from its own address: refused, the address is not among those the sender signed. So
//!   no node is ever told to connect to an address its sender did not name (the stranger
//!   cannot make a worker join it, nor a head dial it);
//! - to a node it was not meant for: refused, it names another recipient (a node remembers
//!   only the nonces it accepted, so without the recipient a copy would be fresh to every
//!   node that had not heard it);
//! - to the node it was meant for, within the minute: refused as a replay;
//! - an announcement, which is for every node, from the head's own address: that is a copy
//!   the head sends anyway (it announces to the whole LAN every few seconds), and it points
//!   at the head.
//!
//! Discovery only tells a node where to connect: the connection that follows runs the
//! link handshake ([`crate::auth`]), so even a stale address wastes a connection attempt,
//! never admits a stranger, and tells it nothing about the secret.
//!
//! Addresses are taken from the datagram's source (what the LAN routes back), checked
//! against the signed list, so a node need not know which of its interfaces the others see.

use std::collections::VecDeque;
use std::net::{IpAddr, Ipv4Addr, SocketAddr, SocketAddrV4};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use hmac::Mac;
use serde::{Deserialize, Serialize};
use tokio::net::UdpSocket;
use tracing::debug;

use crate::throttle::WarnThrottle;

use crate::auth::{random, ClusterSecret, HmacSha256, PeerId, Salt, SALT_LEN};
use crate::error::{Error, Result};
use crate::freshness::{hex, stale, unhex, unix_ms, Fresh, Replays, RequestNonce};

/// The port heads announce on and workers listen to unless told otherwise (unassigned by
/// IANA; next to nothing a home runs).
pub const DEFAULT_PORT: u16 = 7946;
/// An organization-local multicast group (RFC 2365): routers do not forward it off the
/// home network.
pub const MULTICAST_GROUP: Ipv4Addr = Ipv4Addr::new(239, 255, 77, 46);
/// Version 2: salted per sender (version 1 was MACed with the fixed-salt cluster key).
pub const MAGIC: &[u8; 8] = b"HRTHDSC2";
const LABEL: &[u8] = b"hearth discovery v2";
const TAG_LEN: usize = 32;
/// Keys of senders' salts that verified, kept at once: a home's nodes, each restart a new
/// salt, with room to spare; the one used longest ago makes room.
pub const MAX_SALTS: usize = 32;
/// Keys of salts stretched whose datagram did not verify (yet): a neighbour's cluster
/// sending the same salt again costs one stretch, not one per datagram.
const MAX_TRIED_SALTS: usize = 8;
/// New salts stretched at once before the rate applies: a head hearing a few workers
/// start together takes them all at once.
pub const NEW_SALT_BURST: u32 = 4;
/// Then one new salt this often: a stranger sending datagrams with fresh salts makes a
/// node spend at most one Argon2 stretch (64 MiB, a fraction of a second of one core) per
/// interval; a real sender repeats its datagrams every 2 s and gets through.
pub const NEW_SALT_EVERY: Duration = Duration::from_secs(2);
/// Under a typical Ethernet MTU, so a datagram is never fragmented; the messages are a few
/// hundred bytes.
pub const MAX_DATAGRAM: usize = 1200;
/// Longest device name carried; longer ones are cut (names are for logs and dashboards).
pub const MAX_NAME: usize = 64;
/// Addresses a datagram signs as its sender's: a home device has a few (Wi-Fi, Ethernet,
/// a VPN, container bridges); 16 in dotted form keep the datagram under [`MAX_DATAGRAM`].
pub const MAX_ADDRS: usize = 16;

/// What a datagram says.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum Message {
    /// A head: send joins to `port` at this datagram's source address.
    Announce { port: u16, name: String },
    /// A worker: its ring server listens at `port` of this datagram's source address.
    Join { port: u16, name: String },
    /// A worker about to stop: plan without it.
    Leave { port: u16, name: String },
    /// A head, to a worker whose join it recorded: it is a candidate of this head, whose
    /// own discovery port is `port`.
    Welcome { port: u16, name: String },
}

#[derive(Serialize, Deserialize)]
struct Body {
    sender: String,
    unix_ms: u64,
    nonce: String,
    /// The sender's own addresses: the datagram's source must be one of them.
    addrs: Vec<Ipv4Addr>,
    /// The node the datagram is meant for; absent for announcements (meant for every node)
    /// and for a join to a `--head` address whose id the worker has not heard yet.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    to: Option<String>,
    #[serde(flatten)]
    message: Message,
}

/// Who a datagram comes from and who it is for.
#[derive(Debug, Clone, Default)]
pub struct Envelope {
    /// The sender's id.
    pub sender: PeerId,
    /// The sender's addresses (see [`own_addresses`]).
    pub addrs: Vec<Ipv4Addr>,
    /// The recipient's id, if known.
    pub to: Option<PeerId>,
}

/// A datagram that verified.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Heard {
    pub message: Message,
    /// The sender's id, random per process: a restarted worker is a new sender.
    pub sender: PeerId,
    /// Where the datagram came from.
    pub from: SocketAddr,
}

impl Heard {
    /// The address the message points at: its source IP with the port it names.
    pub fn addr(&self) -> SocketAddr {
        let port = match &self.message {
            Message::Announce { port, .. } | Message::Join { port, .. } | Message::Leave { port, .. } | Message::Welcome { port, .. } => *port,
        };
        SocketAddr::new(self.from.ip(), port)
    }
}

fn tag(key: &[u8; 32], salt: &Salt, body: &[u8]) -> HmacSha256 {
    let mut mac = HmacSha256::new_from_slice(key).expect("HMAC takes keys of any length");
    mac.update(LABEL);
    mac.update(salt);
    mac.update(body);
    mac
}

/// What a node seals its datagrams with: its salt, drawn at random, and the key stretched
/// from the secret with it.
#[derive(Clone)]
pub struct Sealer {
    salt: Salt,
    key: [u8; 32],
}

impl Sealer {
    /// A fresh salt and its key (one Argon2 stretch: blocking, a fraction of a second).
    pub fn new(secret: &ClusterSecret) -> Result<Sealer> {
        let salt = random();
        Ok(Sealer { salt, key: secret.salted(&salt)? })
    }

    pub fn salt(&self) -> Salt {
        self.salt
    }
}

impl std::fmt::Debug for Sealer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Sealer {{ salt: {}, .. }}", hex(&self.salt))
    }
}

/// The salt of a datagram, if it has one where a hearth datagram of this version does.
pub fn salt_of(datagram: &[u8]) -> Option<Salt> {
    datagram.strip_prefix(MAGIC.as_slice())?.get(..SALT_LEN)?.try_into().ok()
}

fn cut_name(message: &Message) -> Message {
    let cut = |n: &str| n.chars().take(MAX_NAME).collect::<String>();
    match message {
        Message::Announce { port, name } => Message::Announce { port: *port, name: cut(name) },
        Message::Join { port, name } => Message::Join { port: *port, name: cut(name) },
        Message::Leave { port, name } => Message::Leave { port: *port, name: cut(name) },
        Message::Welcome { port, name } => Message::Welcome { port: *port, name: cut(name) },
    }
}

/// The datagram for `message` in `envelope`, stamped `unix_ms` with a fresh nonce.
pub fn seal(sealer: &Sealer, envelope: &Envelope, unix_ms: u64, message: &Message) -> Vec<u8> {
    let nonce: RequestNonce = random();
    let body = Body {
        sender: hex(&envelope.sender),
        unix_ms,
        nonce: hex(&nonce),
        addrs: envelope.addrs.iter().copied().take(MAX_ADDRS).collect(),
        to: envelope.to.as_ref().map(|id| hex(id)),
        message: cut_name(message),
    };
    // A struct of strings and integers always serialises.
    let body = serde_json::to_vec(&body).unwrap_or_default();
    let mut out = Vec::with_capacity(MAGIC.len() + SALT_LEN + TAG_LEN + body.len());
    out.extend_from_slice(MAGIC);
    out.extend_from_slice(&sealer.salt);
    out.extend_from_slice(&tag(&sealer.key, &sealer.salt, &body).finalize().into_bytes());
    out.extend_from_slice(&body);
    out
}

/// The keys of the salts a node has heard, and its budget for stretching new ones.
struct SaltKeys {
    /// Salts whose datagrams verified, with when each was last used.
    verified: Vec<(Salt, [u8; 32], Instant)>,
    tried: VecDeque<(Salt, [u8; 32])>,
    tokens: u32,
    refilled: Instant,
}

impl SaltKeys {
    fn new(now: Instant) -> SaltKeys {
        SaltKeys { verified: Vec::new(), tried: VecDeque::new(), tokens: NEW_SALT_BURST, refilled: now }
    }

    fn known(&self, salt: &Salt) -> Option<[u8; 32]> {
        let verified = self.verified.iter().find(|(s, _, _)| s == salt).map(|(_, k, _)| *k);
        verified.or_else(|| self.tried.iter().find(|(s, _)| s == salt).map(|(_, k)| *k))
    }

    /// Takes one new-salt token if there is one.
    fn may_stretch(&mut self, now: Instant) -> bool {
        let earned = (now.duration_since(self.refilled).as_millis() / NEW_SALT_EVERY.as_millis()) as u32;
        if earned > 0 {
            self.tokens = (self.tokens + earned).min(NEW_SALT_BURST);
            self.refilled = now;
        }
        if self.tokens == 0 {
            return false;
        }
        self.tokens -= 1;
        true
    }

    fn tried(&mut self, salt: Salt, key: [u8; 32]) {
        if self.known(&salt).is_none() {
            if self.tried.len() >= MAX_TRIED_SALTS {
                self.tried.pop_front();
            }
            self.tried.push_back((salt, key));
        }
    }

    fn verified(&mut self, salt: Salt, key: [u8; 32], now: Instant) {
        self.tried.retain(|(s, _)| *s != salt);
        if let Some(entry) = self.verified.iter_mut().find(|(s, _, _)| *s == salt) {
            entry.2 = now;
            return;
        }
        if self.verified.len() >= MAX_SALTS {
            if let Some(oldest) = self.verified.iter().enumerate().min_by_key(|(_, e)| e.2).map(|(i, _)| i) {
                self.verified.swap_remove(oldest);
            }
        }
        self.verified.push((salt, key, now));
    }
}

/// Checks datagrams: MAC, freshness, and that none is accepted twice.
pub struct Opener {
    secret: ClusterSecret,
    own: PeerId,
    keys: Mutex<SaltKeys>,
    replays: Mutex<Replays>,
}

/// Why a datagram was dropped.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Dropped {
    /// This node's own datagram, looped back: not worth a log line.
    Own,
    /// Anything else: worth a warning (a stranger, a replay, a clock far off).
    Refused(String),
}

/// Why a datagram needs no key stretched, or that it does.
enum KeyFor {
    Known([u8; 32]),
    Stretch(Salt),
    Refused(&'static str),
}

impl Opener {
    /// An opener for a node whose own datagrams carry `own`.
    pub fn new(secret: &ClusterSecret, own: PeerId) -> Opener {
        Opener { secret: secret.clone(), own, keys: Mutex::new(SaltKeys::new(Instant::now())), replays: Mutex::default() }
    }

    /// Knows `sealer`'s key from the start (a node's own, or one it made for a test).
    pub fn remember(&self, sealer: &Sealer) {
        self.keys.lock().unwrap_or_else(|e| e.into_inner()).verified(sealer.salt, sealer.key, Instant::now());
    }

    /// What opening `datagram` needs: a key known, a salt to stretch, or nothing (refused
    /// before any key matters). A stretch is granted here, out of the budget.
    fn key_for(&self, datagram: &[u8], at: Instant) -> KeyFor {
        if datagram.len() > MAX_DATAGRAM {
            return KeyFor::Refused("too long");
        }
        let Some(rest) = datagram.strip_prefix(MAGIC.as_slice()) else {
            return KeyFor::Refused("not a hearth discovery datagram (or another version)");
        };
        let Some(salt) = rest.get(..SALT_LEN).and_then(|s| Salt::try_from(s).ok()).filter(|_| rest.len() >= SALT_LEN + TAG_LEN) else {
            return KeyFor::Refused("truncated");
        };
        let mut keys = self.keys.lock().unwrap_or_else(|e| e.into_inner());
        match keys.known(&salt) {
            Some(key) => KeyFor::Known(key),
            None if keys.may_stretch(at) => KeyFor::Stretch(salt),
            None => KeyFor::Refused("a new salt, and too many new salts lately (a flood?); dropped unchecked"),
        }
    }

    /// Whether opening `datagram` would stretch a key first (blocking for a while).
    fn stretches(&self, datagram: &[u8]) -> bool {
        let Some(salt) = salt_of(datagram) else { return false };
        self.keys.lock().unwrap_or_else(|e| e.into_inner()).known(&salt).is_none()
    }

    /// The message in `datagram` from `from`, received at `now` (unix ms). Stretches the
    /// key of a salt not heard before (blocking; see the module docs).
    pub fn open(&self, datagram: &[u8], from: SocketAddr, now: u64) -> std::result::Result<Heard, Dropped> {
        self.open_at(datagram, from, now, Instant::now())
    }

    /// `open` with the new-salt budget judged at `at` (tests need a clock that stands still
    /// while a loaded machine takes seconds per stretch).
    fn open_at(&self, datagram: &[u8], from: SocketAddr, now: u64, at: Instant) -> std::result::Result<Heard, Dropped> {
        let refuse = |why: &str| Err(Dropped::Refused(format!("discovery datagram from {from}: {why}")));
        let key = match self.key_for(datagram, at) {
            KeyFor::Known(key) => key,
            KeyFor::Stretch(salt) => match self.secret.salted(&salt) {
                Ok(key) => {
                    self.keys.lock().unwrap_or_else(|e| e.into_inner()).tried(salt, key);
                    key
                }
                Err(e) => return refuse(&e.to_string()),
            },
            KeyFor::Refused(why) => return refuse(why),
        };
        // key_for checked the lengths.
        let rest = &datagram[MAGIC.len()..];
        let (salt, rest) = rest.split_at(SALT_LEN);
        let (mac, body) = rest.split_at(TAG_LEN);
        let salt: Salt = salt.try_into().unwrap_or([0; SALT_LEN]);
        if tag(&key, &salt, body).verify_slice(mac).is_err() {
            return refuse("wrong MAC (another cluster's secret, or forged)");
        }
        self.keys.lock().unwrap_or_else(|e| e.into_inner()).verified(salt, key, Instant::now());
        let Ok(parsed) = serde_json::from_slice::<Body>(body) else {
            return refuse("signed but unreadable (a newer hearth?)");
        };
        let sender: Option<PeerId> = unhex(&parsed.sender).and_then(|v| v.try_into().ok());
        let nonce: Option<RequestNonce> = unhex(&parsed.nonce).and_then(|v| v.try_into().ok());
        let (Some(sender), Some(nonce)) = (sender, nonce) else {
            return refuse("malformed sender or nonce");
        };
        if sender == self.own {
            return Err(Dropped::Own);
        }
        if let Some(why) = stale(parsed.unix_ms, now) {
            return refuse(&why);
        }
        match (&parsed.to, &parsed.message) {
            (Some(_), Message::Announce { .. }) => return refuse("an announcement addressed to one node"),
            (None, Message::Welcome { .. }) => return refuse("a welcome addressed to no node"),
            (Some(to), _) if unhex(to).as_deref() != Some(self.own.as_slice()) => {
                return refuse("meant for another node (a copy sent on by someone else)")
            }
            _ => {}
        }
        if !signed_source(from.ip(), &parsed.addrs) {
            return refuse("sent from an address its sender did not sign (a copy sent on by someone else)");
        }
        match self.replays.lock().unwrap_or_else(|e| e.into_inner()).check_and_remember(nonce, parsed.unix_ms, now) {
            Fresh::Yes => Ok(Heard { message: parsed.message, sender, from }),
            Fresh::Replayed => refuse("replayed (its nonce was accepted already)"),
            Fresh::Full => refuse("too many datagrams in the last minutes"),
        }
    }
}

/// A node's discovery sockets: sends its own signed messages, hears the others'.
///
/// Two sockets: the shared port (every hearth process on the machine binds it, so each
/// hears the LAN's announcements), and a port of this process alone that its messages leave
/// from and answers come back to. The kernel spreads unicast datagrams to a shared port
/// over every socket bound to it, so a join sent there could reach a worker's socket on the
/// head's machine instead of the head's: a head announces its own port for joins.
pub struct Discovery {
    socket: UdpSocket,
    direct: UdpSocket,
    sealer: Sealer,
    id: PeerId,
    opener: Arc<Opener>,
    port: u16,
    direct_port: u16,
    refused: WarnThrottle,
}

impl Discovery {
    /// Binds `0.0.0.0:port` (shared with other hearth processes on the machine), joins the
    /// multicast group on every interface that can, and allows broadcast. `port` 0 picks
    /// one (for a node that only sends and hears answers). Draws this node's salt and
    /// stretches its key (blocking, a fraction of a second).
    pub fn bind(port: u16, secret: &ClusterSecret) -> Result<Discovery> {
        let io = |what: &'static str| move |error| Error::Io { peer: format!("discovery port {port}"), what, error };
        let socket = socket2::Socket::new(socket2::Domain::IPV4, socket2::Type::DGRAM, Some(socket2::Protocol::UDP)).map_err(io("socket"))?;
        socket.set_reuse_address(true).map_err(io("SO_REUSEADDR"))?;
        #[cfg(unix)]
        socket.set_reuse_port(true).map_err(io("SO_REUSEPORT"))?;
        socket.set_broadcast(true).map_err(io("SO_BROADCAST"))?;
        socket.set_nonblocking(true).map_err(io("non-blocking"))?;
        socket.bind(&SocketAddrV4::new(Ipv4Addr::UNSPECIFIED, port).into()).map_err(io("bind"))?;
        let mut joined = 0;
        for iface in interfaces() {
            match socket.join_multicast_v4(&MULTICAST_GROUP, &iface.addr) {
                Ok(()) => joined += 1,
                Err(e) => debug!(interface = %iface.addr, error = %e, "not joining the discovery multicast group here"),
            }
        }
        if joined == 0 {
            debug!("no interface joined the discovery multicast group: broadcast only");
        }
        let socket = UdpSocket::from_std(socket.into()).map_err(io("registering with tokio"))?;
        let port = socket.local_addr().map_err(io("local address"))?.port();
        let direct = std::net::UdpSocket::bind(SocketAddrV4::new(Ipv4Addr::UNSPECIFIED, 0)).map_err(io("binding this node's own port"))?;
        direct.set_broadcast(true).map_err(io("SO_BROADCAST"))?;
        direct.set_nonblocking(true).map_err(io("non-blocking"))?;
        let direct = UdpSocket::from_std(direct).map_err(io("registering with tokio"))?;
        let direct_port = direct.local_addr().map_err(io("local address"))?.port();
        let id = random();
        let sealer = Sealer::new(secret)?;
        let opener = Arc::new(Opener::new(secret, id));
        opener.remember(&sealer);
        Ok(Discovery { socket, direct, sealer, id, opener, port, direct_port, refused: WarnThrottle::default() })
    }

    /// The shared port (where announcements and `--head` joins arrive).
    pub fn port(&self) -> u16 {
        self.port
    }

    /// This process's own port: its messages leave from it, and answers sent to it reach
    /// this process and no other.
    pub fn direct_port(&self) -> u16 {
        self.direct_port
    }

    /// This node's id in its datagrams (random per process).
    pub fn id(&self) -> PeerId {
        self.id
    }

    /// The salt of this node's datagrams (random per process).
    pub fn salt(&self) -> Salt {
        self.sealer.salt
    }

    /// What this node's datagrams carry as their sender: for a datagram meant for `to`.
    fn envelope(&self, to: Option<PeerId>) -> Envelope {
        Envelope { sender: self.id, addrs: own_addresses(), to }
    }

    /// Sends `message` to every node listening on `port` of the LAN: the multicast group
    /// and each interface's broadcast address. Fails only if no copy could be sent.
    pub async fn broadcast(&self, message: &Message, port: u16) -> Result<()> {
        let mut targets = vec![SocketAddrV4::new(MULTICAST_GROUP, port)];
        targets.extend(interfaces().into_iter().filter_map(|i| i.broadcast).map(|b| SocketAddrV4::new(b, port)));
        let mut last_error = None;
        let mut sent = 0;
        let envelope = self.envelope(None);
        for to in targets {
            // A copy per target, each with its own nonce: a node that hears both the
            // multicast and the broadcast copy hears two messages, not a replay.
            let datagram = seal(&self.sealer, &envelope, unix_ms(), message);
            match self.direct.send_to(&datagram, to).await {
                Ok(_) => sent += 1,
                Err(e) => last_error = Some(e),
            }
        }
        match (sent, last_error) {
            (0, Some(error)) => Err(Error::Io { peer: format!("discovery port {port}"), what: "announcing", error }),
            _ => Ok(()),
        }
    }

    /// Sends `message` to one node: the one at `to`, whose id is `id` where known (a copy
    /// sent on to any other node is refused there).
    pub async fn send_to(&self, message: &Message, to: SocketAddr, id: Option<PeerId>) -> Result<()> {
        let datagram = seal(&self.sealer, &self.envelope(id), unix_ms(), message);
        self.direct.send_to(&datagram, to).await.map_err(|error| Error::Io { peer: to.to_string(), what: "sending a discovery datagram", error })?;
        Ok(())
    }

    /// The next datagram that verifies; the others are dropped (logged as warnings, a few
    /// a minute, except this node's own).
    pub async fn recv(&self) -> Result<Heard> {
        let (mut shared, mut own) = (vec![0u8; MAX_DATAGRAM + 1], vec![0u8; MAX_DATAGRAM + 1]);
        let io = |error| Error::Io { peer: format!("discovery port {}", self.port), what: "receiving", error };
        loop {
            let (n, from, on_shared) = tokio::select! {
                r = self.socket.recv_from(&mut shared) => { let (n, from) = r.map_err(io)?; (n, from, true) }
                r = self.direct.recv_from(&mut own) => { let (n, from) = r.map_err(io)?; (n, from, false) }
            };
            let datagram = if on_shared { &shared[..n] } else { &own[..n] };
            let opened = if self.opener.stretches(datagram) {
                // A new sender's salt: the stretch must not hold up the runtime's thread.
                let (opener, datagram) = (self.opener.clone(), datagram.to_vec());
                tokio::task::spawn_blocking(move || opener.open(&datagram, from, unix_ms()))
                    .await
                    .unwrap_or_else(|_| Err(Dropped::Refused("stretching a key failed".into())))
            } else {
                self.opener.open(datagram, from, unix_ms())
            };
            match opened {
                Ok(heard) => return Ok(heard),
                Err(Dropped::Own) => {}
                Err(Dropped::Refused(why)) => self.refused.warn(|| format!("{why}; ignored")),
            }
        }
    }
}

/// Whether a datagram from `source` may be from a sender that signed `addrs`. A loopback
/// source is a process on this machine (no LAN interface accepts a packet claiming one).
fn signed_source(source: IpAddr, addrs: &[Ipv4Addr]) -> bool {
    match source {
        IpAddr::V4(v4) => v4.is_loopback() || addrs.contains(&v4),
        IpAddr::V6(v6) => v6.is_loopback() || v6.to_ipv4_mapped().is_some_and(|v4| v4.is_loopback() || addrs.contains(&v4)),
    }
}

/// This machine's IPv4 addresses that are up, the ones a datagram of it can leave from
/// (loopback included: a node's datagram to another on the same machine leaves from it).
pub fn own_addresses() -> Vec<Ipv4Addr> {
    let mut addrs: Vec<Ipv4Addr> = interfaces_with(true).into_iter().map(|i| i.addr).collect();
    addrs.sort();
    addrs.dedup();
    // Non-loopback first: if a machine has more than MAX_ADDRS, the LAN ones are kept.
    addrs.sort_by_key(|a| a.is_loopback());
    addrs.truncate(MAX_ADDRS);
    addrs
}

/// An IPv4 interface that is up.
struct Interface {
    addr: Ipv4Addr,
    broadcast: Option<Ipv4Addr>,
}

/// The machine's IPv4 interfaces that are up, loopback excluded (it does not carry
/// multicast or broadcast the way a LAN does).
fn interfaces() -> Vec<Interface> {
    interfaces_with(false)
}

fn interfaces_with(loopback: bool) -> Vec<Interface> {
    let mut out = Vec::new();
    #[cfg(unix)]
    // SAFETY: getifaddrs hands back a list we only read and free once.
    unsafe {
        let mut head: *mut libc::ifaddrs = std::ptr::null_mut();
        if libc::getifaddrs(&mut head) != 0 {
            return out;
        }
        let mut cur = head;
        while !cur.is_null() {
            let ifa = &*cur;
            cur = ifa.ifa_next;
            let flags = ifa.ifa_flags;
            if ifa.ifa_addr.is_null() || (*ifa.ifa_addr).sa_family as i32 != libc::AF_INET || flags & libc::IFF_UP as u32 == 0 || (!loopback && flags & libc::IFF_LOOPBACK as u32 != 0) {
                continue;
            }
            let v4 = |sa: *const libc::sockaddr| Ipv4Addr::from(u32::from_be((*(sa as *const libc::sockaddr_in)).sin_addr.s_addr));
            let addr = v4(ifa.ifa_addr);
            #[cfg(target_os = "linux")]
            let brd = ifa.ifa_ifu;
            #[cfg(not(target_os = "linux"))]
            let brd = ifa.ifa_dstaddr;
            let broadcast = (flags & libc::IFF_BROADCAST as u32 != 0 && !brd.is_null()).then(|| v4(brd));
            out.push(Interface { addr, broadcast });
        }
        libc::freeifaddrs(head);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn secret(s: &str) -> ClusterSecret {
        ClusterSecret::new(s).unwrap()
    }

    const FROM: SocketAddr = SocketAddr::V4(SocketAddrV4::new(Ipv4Addr::new(10, 0, 0, 2), 40000));
    /// Where a stranger on the LAN sends copies from.
    const STRANGER: SocketAddr = SocketAddr::V4(SocketAddrV4::new(Ipv4Addr::new(10, 0, 0, 66), 40000));
    const ME: PeerId = [1; 16];

    fn from_worker(to: Option<PeerId>) -> Envelope {
        Envelope { sender: [7; 16], addrs: vec![Ipv4Addr::new(10, 0, 0, 2)], to }
    }

    fn refused(r: std::result::Result<Heard, Dropped>, what: &str) -> bool {
        matches!(r, Err(Dropped::Refused(w)) if w.contains(what))
    }

    #[test]
    fn a_sealed_message_opens_once_with_the_same_secret() {
        let s = secret("family");
        let k = Sealer::new(&s).unwrap();
        let m = Message::Join { port: 9000, name: "desktop".into() };
        let d = seal(&k, &from_worker(Some(ME)), 1_000_000, &m);
        let opener = Opener::new(&s, ME);
        let heard = opener.open(&d, FROM, 1_000_500).unwrap();
        assert_eq!(heard, Heard { message: m, sender: [7; 16], from: FROM });
        assert_eq!(heard.addr(), "10.0.0.2:9000".parse().unwrap());
        // The same datagram again is a replay.
        assert!(refused(opener.open(&d, FROM, 1_000_600), "replayed"));
    }

    #[test]
    fn strangers_forgeries_stale_and_own_datagrams_are_dropped() {
        let s = secret("family");
        let k = Sealer::new(&s).unwrap();
        let m = Message::Announce { port: 7946, name: "laptop".into() };
        let opener = Opener::new(&s, ME);
        let env = from_worker(None);
        assert!(refused(opener.open(&seal(&Sealer::new(&secret("neighbour")).unwrap(), &env, 1_000_000, &m), FROM, 1_000_000), "wrong MAC"));
        let mut tampered = seal(&k, &env, 1_000_000, &m);
        let last = tampered.len() - 3;
        tampered[last] ^= 1;
        assert!(refused(opener.open(&tampered, FROM, 1_000_000), "wrong MAC"));
        assert!(refused(opener.open(&seal(&k, &env, 1_000_000, &m), FROM, 1_000_000 + 61_000), "off this node's clock"));
        assert!(refused(opener.open(b"HRTHDSC1 an old version", FROM, 1_000_000), "not a hearth"));
        assert!(refused(opener.open(b"HRTHDSC2short", FROM, 1_000_000), "truncated"));
        assert!(refused(opener.open(&vec![0; MAX_DATAGRAM + 1], FROM, 1_000_000), "too long"));
        let own = Envelope { sender: ME, ..env };
        assert_eq!(opener.open(&seal(&k, &own, 1_000_000, &m), FROM, 1_000_000), Err(Dropped::Own));
    }

    #[test]
    fn a_copy_sent_on_by_a_stranger_is_refused_by_every_node() {
        let s = secret("family");
        let k = Sealer::new(&s).unwrap();
        let join = Message::Join { port: 9000, name: "desktop".into() };
        let announce = Message::Announce { port: 7946, name: "head".into() };
        let (head, other_head) = (Opener::new(&s, ME), Opener::new(&s, [2; 16]));
        let now = 1_000_000;

        // A join meant for the head, relayed from the stranger's own address: the head
        // would otherwise dial the stranger. Refused before its nonce is remembered, so
        // the real copy still counts.
        let d = seal(&k, &from_worker(Some(ME)), now, &join);
        assert!(refused(head.open(&d, STRANGER, now), "did not sign"));
        // Sent on to a node it was not meant for, even from the worker's own address.
        assert!(refused(other_head.open(&d, FROM, now), "meant for another node"));
        assert!(head.open(&d, FROM, now).is_ok());

        // An announcement captured and sent again to a worker from the stranger's address:
        // the worker would join the stranger.
        let head_env = Envelope { sender: [9; 16], addrs: vec![Ipv4Addr::new(10, 0, 0, 2)], to: None };
        let a = seal(&k, &head_env, now, &announce);
        assert!(refused(Opener::new(&s, [3; 16]).open(&a, STRANGER, now), "did not sign"));
        // From the head's own address it is a copy the head sends anyway, pointing at it.
        let worker = Opener::new(&s, [3; 16]);
        assert_eq!(worker.open(&a, FROM, now).unwrap().addr(), "10.0.0.2:7946".parse().unwrap());

        // A welcome must name its worker, and an announcement none.
        let welcome = Message::Welcome { port: 7946, name: "head".into() };
        assert!(refused(worker.open(&seal(&k, &head_env, now, &welcome), FROM, now), "addressed to no node"));
        let aimed = Envelope { to: Some([3; 16]), ..head_env.clone() };
        assert!(refused(worker.open(&seal(&k, &aimed, now, &announce), FROM, now), "addressed to one node"));
        assert!(worker.open(&seal(&k, &aimed, now, &welcome), FROM, now).is_ok());

        // On one machine datagrams come from loopback, which no LAN packet can claim.
        let local: SocketAddr = "127.0.0.1:5000".parse().unwrap();
        assert!(head.open(&seal(&k, &from_worker(Some(ME)), now, &join), local, now).is_ok());
    }

    #[test]
    fn names_are_cut_and_datagrams_stay_small() {
        let s = secret("family");
        let k = Sealer::new(&s).unwrap();
        let m = Message::Leave { port: 1, name: "é".repeat(10_000) };
        let addrs: Vec<Ipv4Addr> = (0..MAX_ADDRS as u8 + 10).map(|i| Ipv4Addr::new(255, 255, 255, i)).collect();
        let env = Envelope { sender: [7; 16], addrs: addrs.clone(), to: Some(ME) };
        let d = seal(&k, &env, 1, &m);
        assert!(d.len() <= MAX_DATAGRAM, "{} bytes", d.len());
        let from = SocketAddr::new(addrs[0].into(), 1);
        let Message::Leave { name, .. } = Opener::new(&s, ME).open(&d, from, 1).unwrap().message else { panic!() };
        assert_eq!(name.chars().count(), MAX_NAME);
    }

    /// Two clusters with the same secret (or two nodes of one) salt their datagrams
    /// differently, so a table stretched for one salt serves no other; the salt is in
    /// clear, and the key of one salt does not verify another's datagram.
    #[tokio::test]
    async fn each_sender_has_its_own_salt() {
        let s = secret("family");
        let (a, b) = (Discovery::bind(0, &s).unwrap(), Discovery::bind(0, &s).unwrap());
        assert_ne!(a.salt(), b.salt());
        let m = Message::Announce { port: 7946, name: "head".into() };
        let d = seal(&a.sealer, &from_worker(None), 1_000_000, &m);
        assert_eq!(salt_of(&d), Some(a.salt()));
        let key_b = s.salted(&b.salt()).unwrap();
        let (salt, rest) = d[MAGIC.len()..].split_at(SALT_LEN);
        let (mac, body) = rest.split_at(TAG_LEN);
        assert!(tag(&key_b, &b.salt(), body).verify_slice(mac).is_err(), "b's key does not check a's datagram");
        assert!(tag(&key_b, &a.salt(), body).verify_slice(mac).is_err());
        let key_a = s.salted(&a.salt()).unwrap();
        assert!(tag(&key_a, &salt.try_into().unwrap(), body).verify_slice(mac).is_ok());
        // Nor does the handshake's password key, the one key with a fixed salt.
        assert!(tag(&s.password_key(), &a.salt(), body).verify_slice(mac).is_err());
        assert!(Opener::new(&s, ME).open(&d, FROM, 1_000_000).is_ok(), "opened by any node of the cluster");
    }

    /// A stranger sending datagrams with ever new salts makes a node stretch a few keys,
    /// then drops them unchecked; a salt that verified once is opened at once from then on.
    #[test]
    fn new_salts_are_stretched_at_a_bounded_rate() {
        let s = secret("family");
        let opener = Opener::new(&s, ME);
        let known = Sealer::new(&s).unwrap();
        let m = Message::Join { port: 9000, name: "desktop".into() };
        let (now, at) = (1_000_000, Instant::now());
        assert!(opener.open_at(&seal(&known, &from_worker(Some(ME)), now, &m), FROM, now, at).is_ok());
        let flood = (0..NEW_SALT_BURST + 10).map(|_| {
            let mut d = seal(&known, &from_worker(Some(ME)), now, &m);
            d[MAGIC.len()..MAGIC.len() + SALT_LEN].copy_from_slice(&random::<SALT_LEN>());
            opener.open_at(&d, STRANGER, now, at)
        });
        let verdicts: Vec<_> = flood.collect();
        // The burst (less the token the known salt's first datagram took) is stretched and
        // found wrong; the rest are dropped unchecked.
        let stretched = verdicts.iter().filter(|v| refused((*v).clone(), "wrong MAC")).count();
        let dropped = verdicts.iter().filter(|v| refused((*v).clone(), "too many new salts")).count();
        assert_eq!((stretched, dropped), (NEW_SALT_BURST as usize - 1, 11), "{verdicts:?}");
        // Tokens come back one per interval, up to the burst.
        let start = Instant::now();
        let mut keys = SaltKeys::new(start);
        assert!((0..NEW_SALT_BURST).all(|_| keys.may_stretch(start)) && !keys.may_stretch(start));
        assert!(keys.may_stretch(start + NEW_SALT_EVERY) && !keys.may_stretch(start + NEW_SALT_EVERY));
        let later = start + NEW_SALT_EVERY * 100;
        assert_eq!((0..10).filter(|_| keys.may_stretch(later)).count(), NEW_SALT_BURST as usize);
        // The known salt still opens, with no token.
        assert!(opener.open_at(&seal(&known, &from_worker(Some(ME)), now, &m), FROM, now, at).is_ok());
    }

    #[test]
    fn this_machine_signs_its_loopback_and_lan_addresses() {
        let addrs = own_addresses();
        assert!(addrs.iter().any(|a| a.is_loopback()), "{addrs:?}");
        assert!(addrs.len() <= MAX_ADDRS);
    }

    #[tokio::test]
    async fn two_sockets_on_loopback_hear_each_other_directly() {
        let s = secret("family");
        let a = Discovery::bind(0, &s).unwrap();
        let b = Discovery::bind(0, &s).unwrap();
        for port in [b.port(), b.direct_port()] {
            let to = SocketAddr::new(Ipv4Addr::LOCALHOST.into(), port);
            a.send_to(&Message::Join { port: 9100, name: "w".into() }, to, Some(b.id())).await.unwrap();
            let heard = tokio::time::timeout(std::time::Duration::from_secs(5), b.recv()).await.unwrap().unwrap();
            assert_eq!(heard.addr(), "127.0.0.1:9100".parse().unwrap());
            assert_eq!(heard.sender, a.id());
            // It left from a's own port: an answer goes back to a alone.
            assert_eq!(heard.from.port(), a.direct_port());
        }
    }
}
