//! Finding the head on the LAN without trusting the LAN: one UDP datagram per message,
//! signed with the cluster secret.
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
//! A datagram is `MAGIC | HMAC-SHA256(secret, LABEL | body) | body`, the body JSON with the
//! sender's random id (per process), a unix-ms timestamp, a fresh nonce and the message.
//! The receiver drops, and logs, a datagram that is malformed, carries a wrong MAC, a
//! timestamp more than a minute off its clock, or a nonce it has accepted before (the same
//! rules as the control calls: [`crate::freshness`]); it also drops its own datagrams
//! (multicast loops back). Discovery only tells a node where to connect: the connection
//! that follows runs the link handshake ([`crate::auth`]), so a replayed or forged address
//! can waste a connection attempt, never admit a stranger.
//!
//! Addresses are taken from the datagram's source (what the LAN routes back), so a node
//! need not know which of its interfaces the others see.

use std::net::{Ipv4Addr, SocketAddr, SocketAddrV4};
use std::sync::Mutex;

use hmac::Mac;
use serde::{Deserialize, Serialize};
use tokio::net::UdpSocket;
use tracing::{debug, warn};

use crate::auth::{random, ClusterSecret, PeerId};
use crate::error::{Error, Result};
use crate::freshness::{hex, stale, unhex, unix_ms, Fresh, Replays, RequestNonce};

/// The port heads announce on and workers listen to unless told otherwise (unassigned by
/// IANA; next to nothing a home runs).
pub const DEFAULT_PORT: u16 = 7946;
/// An organization-local multicast group (RFC 2365): routers do not forward it off the
/// home network.
pub const MULTICAST_GROUP: Ipv4Addr = Ipv4Addr::new(239, 255, 77, 46);
const MAGIC: &[u8; 8] = b"HRTHDSC1";
const LABEL: &[u8] = b"hearth discovery v1";
const TAG_LEN: usize = 32;
/// Under a typical Ethernet MTU, so a datagram is never fragmented; the messages are a few
/// hundred bytes.
pub const MAX_DATAGRAM: usize = 1200;
/// Longest device name carried; longer ones are cut (names are for logs and dashboards).
pub const MAX_NAME: usize = 64;

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
    #[serde(flatten)]
    message: Message,
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

fn tag(secret: &ClusterSecret, body: &[u8]) -> [u8; TAG_LEN] {
    let mut mac = secret.mac();
    mac.update(LABEL);
    mac.update(body);
    mac.finalize().into_bytes().into()
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

/// The datagram for `message` from `sender`, stamped `unix_ms` with a fresh nonce.
pub fn seal(secret: &ClusterSecret, sender: &PeerId, unix_ms: u64, message: &Message) -> Vec<u8> {
    let nonce: RequestNonce = random();
    let body = Body { sender: hex(sender), unix_ms, nonce: hex(&nonce), message: cut_name(message) };
    // A struct of strings and integers always serialises.
    let body = serde_json::to_vec(&body).unwrap_or_default();
    let mut out = Vec::with_capacity(MAGIC.len() + TAG_LEN + body.len());
    out.extend_from_slice(MAGIC);
    out.extend_from_slice(&tag(secret, &body));
    out.extend_from_slice(&body);
    out
}

/// Checks datagrams: MAC, freshness, and that none is accepted twice.
pub struct Opener {
    secret: ClusterSecret,
    own: PeerId,
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

impl Opener {
    /// An opener for a node whose own datagrams carry `own`.
    pub fn new(secret: &ClusterSecret, own: PeerId) -> Opener {
        Opener { secret: secret.clone(), own, replays: Mutex::default() }
    }

    /// The message in `datagram` from `from`, received at `now` (unix ms).
    pub fn open(&self, datagram: &[u8], from: SocketAddr, now: u64) -> std::result::Result<Heard, Dropped> {
        let refuse = |why: &str| Err(Dropped::Refused(format!("discovery datagram from {from}: {why}")));
        if datagram.len() > MAX_DATAGRAM {
            return refuse("too long");
        }
        let Some(rest) = datagram.strip_prefix(MAGIC.as_slice()) else {
            return refuse("not a hearth discovery datagram (or another version)");
        };
        if rest.len() < TAG_LEN {
            return refuse("truncated");
        }
        let (mac, body) = rest.split_at(TAG_LEN);
        let mut check = self.secret.mac();
        check.update(LABEL);
        check.update(body);
        if check.verify_slice(mac).is_err() {
            return refuse("wrong signature (another cluster's secret, or forged)");
        }
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
    secret: ClusterSecret,
    id: PeerId,
    opener: Opener,
    port: u16,
    direct_port: u16,
}

impl Discovery {
    /// Binds `0.0.0.0:port` (shared with other hearth processes on the machine), joins the
    /// multicast group on every interface that can, and allows broadcast. `port` 0 picks
    /// one (for a node that only sends and hears answers).
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
        Ok(Discovery { socket, direct, secret: secret.clone(), id, opener: Opener::new(secret, id), port, direct_port })
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

    /// Sends `message` to every node listening on `port` of the LAN: the multicast group
    /// and each interface's broadcast address. Fails only if no copy could be sent.
    pub async fn broadcast(&self, message: &Message, port: u16) -> Result<()> {
        let mut targets = vec![SocketAddrV4::new(MULTICAST_GROUP, port)];
        targets.extend(interfaces().into_iter().filter_map(|i| i.broadcast).map(|b| SocketAddrV4::new(b, port)));
        let mut last_error = None;
        let mut sent = 0;
        for to in targets {
            // A copy per target, each with its own nonce: a node that hears both the
            // multicast and the broadcast copy hears two messages, not a replay.
            let datagram = seal(&self.secret, &self.id, unix_ms(), message);
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

    /// Sends `message` to one node.
    pub async fn send_to(&self, message: &Message, to: SocketAddr) -> Result<()> {
        let datagram = seal(&self.secret, &self.id, unix_ms(), message);
        self.direct.send_to(&datagram, to).await.map_err(|error| Error::Io { peer: to.to_string(), what: "sending a discovery datagram", error })?;
        Ok(())
    }

    /// The next datagram that verifies; the others are dropped (logged as warnings, except
    /// this node's own).
    pub async fn recv(&self) -> Result<Heard> {
        let (mut shared, mut own) = (vec![0u8; MAX_DATAGRAM + 1], vec![0u8; MAX_DATAGRAM + 1]);
        let io = |error| Error::Io { peer: format!("discovery port {}", self.port), what: "receiving", error };
        loop {
            let (n, from, on_shared) = tokio::select! {
                r = self.socket.recv_from(&mut shared) => { let (n, from) = r.map_err(io)?; (n, from, true) }
                r = self.direct.recv_from(&mut own) => { let (n, from) = r.map_err(io)?; (n, from, false) }
            };
            let datagram = if on_shared { &shared[..n] } else { &own[..n] };
            match self.opener.open(datagram, from, unix_ms()) {
                Ok(heard) => return Ok(heard),
                Err(Dropped::Own) => {}
                Err(Dropped::Refused(why)) => warn!("{why}; ignored"),
            }
        }
    }
}

/// An IPv4 interface that is up and not loopback: where a LAN can be.
struct Interface {
    addr: Ipv4Addr,
    broadcast: Option<Ipv4Addr>,
}

/// The machine's IPv4 interfaces that are up, loopback excluded (it does not carry
/// multicast or broadcast the way a LAN does).
fn interfaces() -> Vec<Interface> {
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
            if ifa.ifa_addr.is_null() || (*ifa.ifa_addr).sa_family as i32 != libc::AF_INET || flags & libc::IFF_UP as u32 == 0 || flags & libc::IFF_LOOPBACK as u32 != 0 {
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

    #[test]
    fn a_sealed_message_opens_once_with_the_same_secret() {
        let s = secret("family");
        let m = Message::Join { port: 9000, name: "desktop".into() };
        let d = seal(&s, &[7; 16], 1_000_000, &m);
        let opener = Opener::new(&s, [1; 16]);
        let heard = opener.open(&d, FROM, 1_000_500).unwrap();
        assert_eq!(heard, Heard { message: m, sender: [7; 16], from: FROM });
        assert_eq!(heard.addr(), "10.0.0.2:9000".parse().unwrap());
        // The same datagram again is a replay.
        assert!(matches!(opener.open(&d, FROM, 1_000_600), Err(Dropped::Refused(w)) if w.contains("replayed")));
    }

    #[test]
    fn strangers_forgeries_stale_and_own_datagrams_are_dropped() {
        let s = secret("family");
        let m = Message::Announce { port: 7946, name: "laptop".into() };
        let opener = Opener::new(&s, [1; 16]);
        let refused = |r: std::result::Result<Heard, Dropped>, what: &str| matches!(r, Err(Dropped::Refused(w)) if w.contains(what));
        assert!(refused(opener.open(&seal(&secret("neighbour"), &[7; 16], 1_000_000, &m), FROM, 1_000_000), "wrong signature"));
        let mut tampered = seal(&s, &[7; 16], 1_000_000, &m);
        let last = tampered.len() - 3;
        tampered[last] ^= 1;
        assert!(refused(opener.open(&tampered, FROM, 1_000_000), "wrong signature"));
        assert!(refused(opener.open(&seal(&s, &[7; 16], 1_000_000, &m), FROM, 1_000_000 + 61_000), "off this node's clock"));
        assert!(refused(opener.open(b"HRTHDSC0 anything", FROM, 1_000_000), "not a hearth"));
        assert!(refused(opener.open(b"HRTHDSC1short", FROM, 1_000_000), "truncated"));
        assert!(refused(opener.open(&vec![0; MAX_DATAGRAM + 1], FROM, 1_000_000), "too long"));
        assert_eq!(opener.open(&seal(&s, &[1; 16], 1_000_000, &m), FROM, 1_000_000), Err(Dropped::Own));
    }

    #[test]
    fn names_are_cut_and_datagrams_stay_small() {
        let s = secret("family");
        let m = Message::Leave { port: 1, name: "é".repeat(10_000) };
        let d = seal(&s, &[7; 16], 1, &m);
        assert!(d.len() <= MAX_DATAGRAM, "{} bytes", d.len());
        let Message::Leave { name, .. } = Opener::new(&s, [1; 16]).open(&d, FROM, 1).unwrap().message else { panic!() };
        assert_eq!(name.chars().count(), MAX_NAME);
    }

    #[tokio::test]
    async fn two_sockets_on_loopback_hear_each_other_directly() {
        let s = secret("family");
        let a = Discovery::bind(0, &s).unwrap();
        let b = Discovery::bind(0, &s).unwrap();
        for port in [b.port(), b.direct_port()] {
            let to = SocketAddr::new(Ipv4Addr::LOCALHOST.into(), port);
            a.send_to(&Message::Join { port: 9100, name: "w".into() }, to).await.unwrap();
            let heard = tokio::time::timeout(std::time::Duration::from_secs(5), b.recv()).await.unwrap().unwrap();
            assert_eq!(heard.addr(), "127.0.0.1:9100".parse().unwrap());
            // It left from a's own port: an answer goes back to a alone.
            assert_eq!(heard.from.port(), a.direct_port());
        }
    }
}
