//! Mutual authentication of ring links with the cluster secret, without the secret ever
//! crossing the wire.
//!
//! HMAC-SHA256 challenge-response, four messages:
//!
//! ```text
//! client -> server  AuthHello     { client nonce }
//! server -> client  AuthChallenge { server nonce, server id }
//! client -> server  AuthProof     { HMAC(secret, label | "client" | client nonce | server nonce | server id) }
//! server -> client  AuthWelcome   { HMAC(secret, label | "server" | client nonce | server nonce | server id) }
//! ```
//!
//! It runs on the raw TCP connection before HTTP/2 starts (see `link`), so nothing of a
//! peer that has not proved the secret reaches the HTTP/2 server. Both nonces are fresh per
//! connection, so a recorded transcript proves nothing on a new one; the role labels stop a
//! peer from reflecting one side's proof back as the other's. The server id is random per
//! server process: the client learns it here, with the server's proof over it, and signs
//! every control call for it (see `control`), so a call made for one member is refused by
//! any other, and by the same member once it restarts.
//! The client proves first because workers listen on the network: a stranger who connects
//! to one learns nothing it could use to guess the secret offline. (The head dials only
//! addresses it was given, so it is the side that can afford to reveal first.) Proofs are
//! compared in constant time.
//!
//! This authenticates the connection; it does not encrypt it. The ring is meant for one
//! home network, and hidden states are all that cross it.

use std::fmt;
use std::sync::Arc;

use hmac::{Hmac, Mac};
use rand::RngCore;
use sha2::Sha256;

use crate::error::{Error, Result};

pub const NONCE_LEN: usize = 32;
pub type Nonce = [u8; NONCE_LEN];
pub type Proof = [u8; 32];
/// 128 random bits: two servers of one ring never share an id by chance.
pub const PEER_ID_LEN: usize = 16;
/// A server's identity for the lifetime of its process (see the module docs).
pub type PeerId = [u8; PEER_ID_LEN];

pub(crate) type HmacSha256 = Hmac<Sha256>;

/// Domain separation: a MAC made for this protocol means nothing to any other use of the
/// same secret (the control RPCs use their own labels).
const LINK_LABEL: &[u8] = b"hearth ring link auth v1";
/// What `--insecure` runs with: every node knows it, so the handshake still runs (and still
/// catches a node of another cluster or version) but proves nothing.
const INSECURE_SECRET: &[u8] = b"hearth insecure cluster: no secret given";

/// The cluster secret every ring member is started with. Cheap to clone; never printed.
#[derive(Clone)]
pub struct ClusterSecret(Arc<[u8]>);

impl ClusterSecret {
    /// Refuses an empty secret so a missing flag cannot silently mean "no authentication";
    /// use [`ClusterSecret::insecure`] for that, explicitly.
    pub fn new(secret: impl AsRef<[u8]>) -> Result<Self> {
        let secret = secret.as_ref();
        if secret.is_empty() {
            return Err(Error::Secret("it is empty"));
        }
        Ok(ClusterSecret(secret.into()))
    }

    pub fn insecure() -> Self {
        ClusterSecret(INSECURE_SECRET.into())
    }

    pub(crate) fn mac(&self) -> HmacSha256 {
        HmacSha256::new_from_slice(&self.0).expect("HMAC takes keys of any length")
    }
}

impl fmt::Debug for ClusterSecret {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("ClusterSecret(..)")
    }
}

#[derive(Clone, Copy)]
enum Role {
    Client,
    Server,
}

/// Random bytes from the OS-seeded CSPRNG: nonces, server ids.
pub(crate) fn random<const N: usize>() -> [u8; N] {
    let mut bytes = [0u8; N];
    rand::thread_rng().fill_bytes(&mut bytes);
    bytes
}

fn fresh_nonce() -> Nonce {
    random()
}

/// A new server id, one per listening server.
pub fn fresh_peer_id() -> PeerId {
    random()
}

fn keyed(secret: &ClusterSecret, role: Role, client: &Nonce, server: &Nonce, id: &PeerId) -> HmacSha256 {
    let mut mac = secret.mac();
    mac.update(LINK_LABEL);
    mac.update(match role {
        Role::Client => b"client",
        Role::Server => b"server",
    });
    mac.update(client);
    mac.update(server);
    mac.update(id);
    mac
}

fn prove(secret: &ClusterSecret, role: Role, client: &Nonce, server: &Nonce, id: &PeerId) -> Proof {
    keyed(secret, role, client, server, id).finalize().into_bytes().into()
}

fn check(secret: &ClusterSecret, role: Role, client: &Nonce, server: &Nonce, id: &PeerId, proof: &Proof) -> bool {
    keyed(secret, role, client, server, id).verify_slice(proof).is_ok()
}

/// The dialling side of a handshake.
pub struct ClientHandshake {
    secret: ClusterSecret,
    client_nonce: Nonce,
    server: Option<(Nonce, PeerId)>,
}

impl ClientHandshake {
    pub fn new(secret: &ClusterSecret) -> Self {
        ClientHandshake { secret: secret.clone(), client_nonce: fresh_nonce(), server: None }
    }

    /// The nonce to send in `AuthHello`.
    pub fn hello(&self) -> Nonce {
        self.client_nonce
    }

    /// The proof to send in `AuthProof`, answering the server's challenge.
    pub fn on_challenge(&mut self, server_nonce: Nonce, server_id: PeerId) -> Proof {
        self.server = Some((server_nonce, server_id));
        prove(&self.secret, Role::Client, &self.client_nonce, &server_nonce, &server_id)
    }

    /// The server's id if its `AuthWelcome` shows that it knows the secret too.
    pub fn on_welcome(&self, server_proof: &Proof) -> Option<PeerId> {
        let (nonce, id) = self.server?;
        check(&self.secret, Role::Server, &self.client_nonce, &nonce, &id, server_proof).then_some(id)
    }
}

/// The listening side of a handshake.
pub struct ServerHandshake {
    secret: ClusterSecret,
    client_nonce: Nonce,
    server_nonce: Nonce,
    id: PeerId,
}

impl ServerHandshake {
    pub fn new(secret: &ClusterSecret, id: PeerId, client_nonce: Nonce) -> Self {
        ServerHandshake { secret: secret.clone(), client_nonce, server_nonce: fresh_nonce(), id }
    }

    /// The nonce and id to send in `AuthChallenge`.
    pub fn challenge(&self) -> (Nonce, PeerId) {
        (self.server_nonce, self.id)
    }

    /// The proof for `AuthWelcome` if the client knows the secret; `None` means close.
    pub fn on_proof(&self, client_proof: &Proof) -> Option<Proof> {
        check(&self.secret, Role::Client, &self.client_nonce, &self.server_nonce, &self.id, client_proof)
            .then(|| prove(&self.secret, Role::Server, &self.client_nonce, &self.server_nonce, &self.id))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const ID: PeerId = [7; PEER_ID_LEN];

    fn secret(s: &str) -> ClusterSecret {
        ClusterSecret::new(s).unwrap()
    }

    /// Runs the four messages; returns (server accepted the client, client accepted the server).
    fn run(client_secret: &ClusterSecret, server_secret: &ClusterSecret) -> (bool, bool) {
        let mut client = ClientHandshake::new(client_secret);
        let server = ServerHandshake::new(server_secret, ID, client.hello());
        let (nonce, id) = server.challenge();
        let proof = client.on_challenge(nonce, id);
        match server.on_proof(&proof) {
            Some(welcome) => (true, client.on_welcome(&welcome) == Some(ID)),
            None => (false, false),
        }
    }

    #[test]
    fn right_secret_succeeds_both_ways() {
        assert_eq!(run(&secret("hunter2"), &secret("hunter2")), (true, true));
    }

    #[test]
    fn wrong_secret_fails_on_both_sides() {
        assert_eq!(run(&secret("hunter2"), &secret("hunter3")), (false, false));
        // A server that skips the check and forges a welcome still fails at the client.
        let mut client = ClientHandshake::new(&secret("right"));
        let imposter = ServerHandshake::new(&secret("wrong"), ID, client.hello());
        let (nonce, id) = imposter.challenge();
        client.on_challenge(nonce, id);
        let forged = prove(&secret("wrong"), Role::Server, &client.hello(), &nonce, &id);
        assert!(client.on_welcome(&forged).is_none());
    }

    #[test]
    fn replayed_transcript_fails() {
        let s = secret("hunter2");
        let mut client = ClientHandshake::new(&s);
        let first = ServerHandshake::new(&s, ID, client.hello());
        let (nonce, id) = first.challenge();
        let proof = client.on_challenge(nonce, id);
        let welcome = first.on_proof(&proof).unwrap();

        // An eavesdropper replays the client's hello and proof: the new challenge differs.
        let second = ServerHandshake::new(&s, ID, client.hello());
        assert_ne!(first.challenge(), second.challenge());
        assert!(second.on_proof(&proof).is_none());

        // Or replays the server's welcome to a new client.
        let mut victim = ClientHandshake::new(&s);
        victim.on_challenge(nonce, id);
        assert!(victim.on_welcome(&welcome).is_none());
    }

    #[test]
    fn reflected_proof_fails() {
        let s = secret("hunter2");
        let mut client = ClientHandshake::new(&s);
        let server = ServerHandshake::new(&s, ID, client.hello());
        let (nonce, id) = server.challenge();
        let proof = client.on_challenge(nonce, id);
        // The client's own proof is not a valid server proof.
        assert!(client.on_welcome(&proof).is_none());
    }

    #[test]
    fn a_proof_is_bound_to_the_server_id() {
        // A relay that hands one server's challenge to the client under another id.
        let s = secret("hunter2");
        let mut client = ClientHandshake::new(&s);
        let server = ServerHandshake::new(&s, ID, client.hello());
        let (nonce, _) = server.challenge();
        let proof = client.on_challenge(nonce, [8; PEER_ID_LEN]);
        assert!(server.on_proof(&proof).is_none());
    }

    #[test]
    fn no_welcome_before_challenge_and_no_empty_secret() {
        let client = ClientHandshake::new(&secret("x"));
        assert!(client.on_welcome(&[0; 32]).is_none());
        assert!(ClusterSecret::new("").is_err());
        assert_eq!(format!("{:?}", secret("x")), "ClusterSecret(..)");
    }
}
