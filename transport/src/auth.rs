//! Mutual authentication of ring links with the cluster secret, without the secret, or
//! anything to test guesses of it against, ever crossing the wire.
//!
//! SPAKE2 (a password-authenticated key exchange, RustCrypto's `spake2`) with the cluster
//! key as the password, then key confirmation; four messages:
//!
//! ```text
//! client -> server  AuthHello     { client key share }
//! server -> client  AuthChallenge { server key share, server id }
//! client -> server  AuthProof     { HMAC(K, label | "client" | client share | server share | server id) }
//! server -> client  AuthWelcome   { HMAC(K, label | "server" | client share | server share | server id) }
//! ```
//!
//! Each side's key share is a fresh random curve point blinded by the password; both sides
//! derive the same key `K` only if they used the same password. What a peer without the
//! secret sees — a share, and a proof made with a `K` it cannot compute — lets it test one
//! guess per connection it makes or accepts, online, and none offline: unlike a
//! challenge-response MAC, a recorded transcript is no oracle for a wordlist. This matters
//! because either side may be talking to a stranger: a worker accepts connections from
//! anyone, and the head dials addresses that discovery or an operator named, which a
//! stranger may hold by then (a laptop left; its address was handed to another device).
//! Online guesses are what the ring server slows down, per source ([`crate::backoff`]).
//!
//! Fresh shares per connection make a recorded transcript prove nothing on a new one; the
//! role labels stop a peer from reflecting one side's proof back as the other's. The server
//! id is random per server process, and bound into the proofs.
//!
//! **Everything after the handshake is keyed by the session, never by the secret.** Both
//! sides derive a [`SessionKey`] from `K`, both shares and the server id (its own label,
//! so it is independent of the proofs), and every control and blob call on the connection,
//! both ways, is MACed with it (see `control`). `K` comes out of two ephemeral scalars that
//! never leave their processes: a recording of a connection, handshake and calls together,
//! holds no MAC that any key computed from the secret alone verifies, so it is no oracle
//! for guesses (the test `a_recorded_exchange_tests_no_guess` in `link` checks this with the
//! right secret). Before this, calls were MACed with the cluster key itself, and since that
//! key's Argon2 salt is fixed, a wordlist stretched once could test one recorded call per
//! guess in microseconds, for every cluster (issue 61).
//!
//! Discovery datagrams are one-to-many: nothing is exchanged, so they remain MACed with a
//! key derived from the secret, but salted per sender with a random salt sent in clear
//! ([`ClusterSecret::salted`]): a table stretched for one salt serves no other datagram
//! sender, let alone every cluster. A recorded datagram still lets a stranger test guesses
//! offline at Argon2's full cost each ([`KEY_MEMORY_KIB`]); `hearth secret` makes secrets no
//! wordlist holds (docs/security.md).
//!
//! This authenticates the connection; it does not encrypt it. The ring is meant for one
//! home network, and hidden states are all that cross it.

use std::collections::HashMap;
use std::fmt;
use std::sync::{Arc, Mutex, OnceLock};

use hmac::{Hmac, Mac};
use rand::RngCore;
use sha2::Sha256;
use spake2::{Ed25519Group, Identity, Password, Spake2};

use crate::error::{Error, Result};

/// A SPAKE2 message on Ed25519: a side byte and a compressed point.
pub const KEY_SHARE_LEN: usize = 33;
pub type KeyShare = [u8; KEY_SHARE_LEN];
pub type Proof = [u8; 32];
/// 128 random bits: two servers of one ring never share an id by chance.
pub const PEER_ID_LEN: usize = 16;
/// A server's identity for the lifetime of its process (see the module docs).
pub type PeerId = [u8; PEER_ID_LEN];

pub(crate) type HmacSha256 = Hmac<Sha256>;
/// A salt a discovery sender stretches the secret with (see [`ClusterSecret::salted`]).
pub const SALT_LEN: usize = 16;
pub type Salt = [u8; SALT_LEN];

/// Domain separation: a MAC made for this protocol means nothing to any other use of the
/// same secret (the control RPCs use their own labels). Also SPAKE2's shared identity.
const LINK_LABEL: &[u8] = b"hearth ring link auth v2";
/// What `--insecure` runs with: every node knows it, so the handshake still runs (and still
/// catches a node of another cluster or version) but proves nothing.
const INSECURE_SECRET: &[u8] = b"hearth insecure cluster: no secret given";
/// The session key's own label: the same `K` keys the proofs, and a session key must be
/// independent of anything the handshake shows.
const SESSION_LABEL: &[u8] = b"hearth ring session v1";
/// Prefixed to a discovery sender's random salt: keys for discovery never equal the
/// handshake's password, whatever salt a stranger sends.
const SALTED_PREFIX: &[u8] = b"hearth discovery key v2 ";

/// Argon2id's memory per derivation: RFC 9106's second recommended setting (64 MiB, three
/// passes), which a phone affords once at start and a guesser pays for every guess.
pub const KEY_MEMORY_KIB: u32 = 64 * 1024;
const KEY_PASSES: u32 = 3;
/// The handshake's password is stretched with a fixed salt: nothing is shared before it to
/// salt it with, and it needs none, as nothing it keys ever crosses the wire testably
/// (SPAKE2 transcripts are no oracle). It keeps hearth's password apart from any other use
/// of the same secret. Everything a recording could test is keyed otherwise (module docs).
const KEY_SALT: &[u8] = b"hearth cluster key v1";
/// Fewer characters than this draw a warning at start: `hearth secret` makes 32 hex
/// characters (128 bits); a person's 16-character passphrase is about the least a wordlist
/// run against a stretched key does not find in reasonable time.
pub const SHORT_SECRET_CHARS: usize = 16;

/// The cluster secret every ring member is started with: the handshake's stretched
/// password, and the secret itself for the salted discovery keys. Cheap to clone; never
/// printed.
#[derive(Clone)]
pub struct ClusterSecret(Arc<Keys>);

struct Keys {
    password: [u8; 32],
    secret: Vec<u8>,
}

impl ClusterSecret {
    /// Refuses an empty secret so a missing flag cannot silently mean "no authentication";
    /// use [`ClusterSecret::insecure`] for that, explicitly. Derives the cluster key
    /// (Argon2id, a fraction of a second; remembered for the process, so a test that makes
    /// many nodes pays once).
    pub fn new(secret: impl AsRef<[u8]>) -> Result<Self> {
        let secret = secret.as_ref();
        if secret.is_empty() {
            return Err(Error::Secret("it is empty"));
        }
        let password = derived(secret, KEY_SALT)?;
        Ok(ClusterSecret(Arc::new(Keys { password, secret: secret.to_vec() })))
    }

    pub fn insecure() -> Self {
        // The insecure secret is fixed and valid: its derivation cannot fail.
        let password = derived(INSECURE_SECRET, KEY_SALT).unwrap_or([0; 32]);
        ClusterSecret(Arc::new(Keys { password, secret: INSECURE_SECRET.to_vec() }))
    }

    /// The discovery key for `salt`: Argon2id of the secret with that salt, as costly as
    /// the password's (a fraction of a second; blocking). Each sender salts its datagrams
    /// with its own random salt, so a precomputed table serves one sender's datagrams only.
    pub fn salted(&self, salt: &Salt) -> Result<[u8; 32]> {
        let mut full = SALTED_PREFIX.to_vec();
        full.extend_from_slice(salt);
        derived(&self.0.secret, &full)
    }

    /// A new secret for a cluster: 128 random bits, as 32 hex characters.
    pub fn generate() -> String {
        crate::freshness::hex(&random::<16>())
    }

    /// Why `secret` is weak, if it is: shown at start so a person choosing one knows.
    pub fn weakness(secret: &str) -> Option<String> {
        let chars = secret.chars().count();
        (chars < SHORT_SECRET_CHARS).then(|| {
            format!(
                "the cluster secret has {chars} characters: anyone on the LAN can record a discovery datagram and try guesses against it offline; use {SHORT_SECRET_CHARS} or more (`hearth secret` makes one)"
            )
        })
    }

    fn password(&self) -> Password {
        Password::new(self.0.password.as_slice())
    }

    /// The handshake's password key: for tests that show nothing on the wire is keyed by it.
    #[cfg(test)]
    pub(crate) fn password_key(&self) -> [u8; 32] {
        self.0.password
    }
}

/// Argon2id of `secret` with `salt`, derived once per process for each pair.
fn derived(secret: &[u8], salt: &[u8]) -> Result<[u8; 32]> {
    /// Distinct (secret, salt) pairs remembered: the password and a few discovery salts in
    /// production, a few secrets in tests. Discovery bounds its own salts (`discovery`).
    const REMEMBERED: usize = 64;
    static KEYS: OnceLock<Mutex<HashMap<[u8; 32], [u8; 32]>>> = OnceLock::new();
    let mut hasher = <Sha256 as sha2::Digest>::new();
    for part in [secret, salt] {
        sha2::Digest::update(&mut hasher, (part.len() as u64).to_le_bytes());
        sha2::Digest::update(&mut hasher, part);
    }
    let id: [u8; 32] = sha2::Digest::finalize(hasher).into();
    let keys = KEYS.get_or_init(Mutex::default);
    if let Some(key) = keys.lock().unwrap_or_else(|e| e.into_inner()).get(&id) {
        return Ok(*key);
    }
    let params = argon2::Params::new(KEY_MEMORY_KIB, KEY_PASSES, 1, Some(32)).map_err(|_| Error::Secret("the key derivation's settings are invalid"))?;
    let argon = argon2::Argon2::new(argon2::Algorithm::Argon2id, argon2::Version::V0x13, params);
    let mut key = [0u8; 32];
    argon.hash_password_into(secret, salt, &mut key).map_err(|_| Error::Secret("it cannot be stretched into a key (too long?)"))?;
    let mut keys = keys.lock().unwrap_or_else(|e| e.into_inner());
    if keys.len() >= REMEMBERED {
        keys.clear();
    }
    keys.insert(id, key);
    Ok(key)
}

impl fmt::Debug for ClusterSecret {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("ClusterSecret(..)")
    }
}

/// The key of one authenticated connection (module docs): every control call on it, both
/// ways, is MACed with this. Known only to the two ends; never printed.
#[derive(Clone)]
pub struct SessionKey([u8; 32]);

impl SessionKey {
    pub(crate) fn mac(&self) -> HmacSha256 {
        HmacSha256::new_from_slice(&self.0).expect("HMAC takes keys of any length")
    }

    #[cfg(test)]
    pub(crate) fn bytes(&self) -> [u8; 32] {
        self.0
    }
}

impl fmt::Debug for SessionKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("SessionKey(..)")
    }
}

fn session(key: &[u8], client: &KeyShare, server: &KeyShare, id: &PeerId) -> SessionKey {
    let mut mac = HmacSha256::new_from_slice(key).expect("HMAC takes keys of any length");
    mac.update(SESSION_LABEL);
    mac.update(client);
    mac.update(server);
    mac.update(id);
    SessionKey(mac.finalize().into_bytes().into())
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

/// A new server id, one per listening server.
pub fn fresh_peer_id() -> PeerId {
    random()
}

/// Starts one side of the exchange: its state and the share to send.
fn start(secret: &ClusterSecret) -> (Spake2<Ed25519Group>, KeyShare) {
    let (state, share) = Spake2::<Ed25519Group>::start_symmetric(&secret.password(), &Identity::new(LINK_LABEL));
    // The Ed25519 group's messages are always a side byte and a 32-byte point.
    let share: KeyShare = share.try_into().unwrap_or([0; KEY_SHARE_LEN]);
    (state, share)
}

/// The session key from our state and the peer's share; `None` for a share that is not a
/// point (a stranger's bytes) or is our own sent back.
fn finish(state: Spake2<Ed25519Group>, ours: &KeyShare, theirs: &KeyShare) -> Option<Vec<u8>> {
    if ours == theirs {
        return None;
    }
    state.finish(theirs).ok()
}

fn keyed(key: &[u8], role: Role, client: &KeyShare, server: &KeyShare, id: &PeerId) -> HmacSha256 {
    let mut mac = HmacSha256::new_from_slice(key).expect("HMAC takes keys of any length");
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

fn prove(key: &[u8], role: Role, client: &KeyShare, server: &KeyShare, id: &PeerId) -> Proof {
    keyed(key, role, client, server, id).finalize().into_bytes().into()
}

fn check(key: &[u8], role: Role, client: &KeyShare, server: &KeyShare, id: &PeerId, proof: &Proof) -> bool {
    keyed(key, role, client, server, id).verify_slice(proof).is_ok()
}

/// The dialling side of a handshake.
pub struct ClientHandshake {
    state: Option<Spake2<Ed25519Group>>,
    share: KeyShare,
    /// The session key, the server's share and id once the challenge came.
    server: Option<(Vec<u8>, KeyShare, PeerId)>,
}

impl ClientHandshake {
    pub fn new(secret: &ClusterSecret) -> Self {
        let (state, share) = start(secret);
        ClientHandshake { state: Some(state), share, server: None }
    }

    /// The key share to send in `AuthHello`.
    pub fn hello(&self) -> KeyShare {
        self.share
    }

    /// The proof to send in `AuthProof`, answering the server's challenge; `None` when the
    /// challenge is no key share (not a hearth server, or a broken one).
    pub fn on_challenge(&mut self, server_share: KeyShare, server_id: PeerId) -> Option<Proof> {
        let key = finish(self.state.take()?, &self.share, &server_share)?;
        let proof = prove(&key, Role::Client, &self.share, &server_share, &server_id);
        self.server = Some((key, server_share, server_id));
        Some(proof)
    }

    /// The server's id and the session's key if its `AuthWelcome` shows that it derived
    /// the same key: it knows the secret too.
    pub fn on_welcome(&self, server_proof: &Proof) -> Option<(PeerId, SessionKey)> {
        let (key, share, id) = self.server.as_ref()?;
        check(key, Role::Server, &self.share, share, id, server_proof).then(|| (*id, session(key, &self.share, share, id)))
    }
}

/// The listening side of a handshake.
pub struct ServerHandshake {
    client_share: KeyShare,
    share: KeyShare,
    /// `None` when the client's share was no key share: every proof then fails.
    key: Option<Vec<u8>>,
    id: PeerId,
}

impl ServerHandshake {
    pub fn new(secret: &ClusterSecret, id: PeerId, client_share: KeyShare) -> Self {
        let (state, share) = start(secret);
        let key = finish(state, &share, &client_share);
        ServerHandshake { client_share, share, key, id }
    }

    /// The share and id to send in `AuthChallenge`.
    pub fn challenge(&self) -> (KeyShare, PeerId) {
        (self.share, self.id)
    }

    /// The proof for `AuthWelcome` and the session's key if the client derived the same
    /// key; `None` means close.
    pub fn on_proof(&self, client_proof: &Proof) -> Option<(Proof, SessionKey)> {
        let key = self.key.as_ref()?;
        check(key, Role::Client, &self.client_share, &self.share, &self.id, client_proof).then(|| {
            let proof = prove(key, Role::Server, &self.client_share, &self.share, &self.id);
            (proof, session(key, &self.client_share, &self.share, &self.id))
        })
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
        let (share, id) = server.challenge();
        let proof = client.on_challenge(share, id).unwrap();
        match server.on_proof(&proof) {
            Some((welcome, server_key)) => {
                let accepted = client.on_welcome(&welcome);
                // Both ends hold the same session key.
                let same = accepted.as_ref().is_some_and(|(id, key)| *id == ID && key.bytes() == server_key.bytes());
                (true, same)
            }
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
        // A server that skips the check and answers with a welcome of its own key still
        // fails at the client.
        let mut client = ClientHandshake::new(&secret("right"));
        let imposter = ServerHandshake::new(&secret("wrong"), ID, client.hello());
        let (share, id) = imposter.challenge();
        client.on_challenge(share, id).unwrap();
        let forged = prove(imposter.key.as_ref().unwrap(), Role::Server, &client.hello(), &share, &id);
        assert!(client.on_welcome(&forged).is_none());
    }

    /// A stranger posing as a server tests exactly one guess per connection: the client's
    /// proof checks against the key of the guess the stranger blinded its share with, and
    /// no other (which is what makes the guessing online).
    #[test]
    fn a_stranger_tests_one_guess_per_connection() {
        let right = "correct horse";
        for guess in ["wrong guess", right] {
            let mut client = ClientHandshake::new(&secret(right));
            let stranger = ServerHandshake::new(&secret(guess), ID, client.hello());
            let (share, id) = stranger.challenge();
            let proof = client.on_challenge(share, id).unwrap();
            assert_eq!(stranger.on_proof(&proof).is_some(), guess == right);
        }
        // Two runs with the same secret share nothing: no proof repeats to look up.
        let s = secret(right);
        let proofs: Vec<Proof> = (0..2)
            .map(|_| {
                let mut c = ClientHandshake::new(&s);
                let srv = ServerHandshake::new(&s, ID, c.hello());
                let (share, id) = srv.challenge();
                c.on_challenge(share, id).unwrap()
            })
            .collect();
        assert_ne!(proofs[0], proofs[1]);
    }

    #[test]
    fn replayed_transcript_fails() {
        let s = secret("hunter2");
        let mut client = ClientHandshake::new(&s);
        let first = ServerHandshake::new(&s, ID, client.hello());
        let (share, id) = first.challenge();
        let proof = client.on_challenge(share, id).unwrap();
        let (welcome, _) = first.on_proof(&proof).unwrap();

        // An eavesdropper replays the client's hello and proof: the new challenge differs.
        let second = ServerHandshake::new(&s, ID, client.hello());
        assert_ne!(first.challenge(), second.challenge());
        assert!(second.on_proof(&proof).is_none());

        // Or replays the server's welcome to a new client.
        let mut victim = ClientHandshake::new(&s);
        victim.on_challenge(share, id).unwrap();
        assert!(victim.on_welcome(&welcome).is_none());
    }

    #[test]
    fn reflected_shares_and_proofs_fail() {
        let s = secret("hunter2");
        let mut client = ClientHandshake::new(&s);
        let server = ServerHandshake::new(&s, ID, client.hello());
        let (share, id) = server.challenge();
        let proof = client.on_challenge(share, id).unwrap();
        // The client's own proof is not a valid server proof.
        assert!(client.on_welcome(&proof).is_none());
        // A "server" that sends the client's own share back gets no proof.
        let mut mirrored = ClientHandshake::new(&s);
        let own = mirrored.hello();
        assert!(mirrored.on_challenge(own, id).is_none());
        // Bytes that are no key share give no key on either side.
        assert!(ClientHandshake::new(&s).on_challenge([0xff; KEY_SHARE_LEN], id).is_none());
        assert!(ServerHandshake::new(&s, ID, [0xff; KEY_SHARE_LEN]).on_proof(&[0; 32]).is_none());
    }

    #[test]
    fn a_proof_is_bound_to_the_server_id() {
        // A relay that hands one server's challenge to the client under another id.
        let s = secret("hunter2");
        let mut client = ClientHandshake::new(&s);
        let server = ServerHandshake::new(&s, ID, client.hello());
        let (share, _) = server.challenge();
        let proof = client.on_challenge(share, [8; PEER_ID_LEN]).unwrap();
        assert!(server.on_proof(&proof).is_none());
    }

    #[test]
    fn the_key_is_stretched_and_secrets_are_judged() {
        let start = std::time::Instant::now();
        let key = derived(b"a secret only used here", KEY_SALT).unwrap();
        eprintln!("one Argon2id derivation: {:?}", start.elapsed());
        assert_ne!(key.as_slice(), b"a secret only used here".as_slice());
        assert_eq!(derived(b"a secret only used here", KEY_SALT).unwrap(), key, "the same key each time");
        assert_ne!(derived(b"a secret only used herf", KEY_SALT).unwrap(), key);
        // Salted discovery keys differ per salt and from the password.
        let s = secret("a secret only used here");
        let (a, b) = (s.salted(&[1; SALT_LEN]).unwrap(), s.salted(&[2; SALT_LEN]).unwrap());
        assert!(a != b && a != key && b != key);
        assert_eq!(s.salted(&[1; SALT_LEN]).unwrap(), a);
        let generated = ClusterSecret::generate();
        assert_eq!(generated.len(), 32);
        assert!(generated.chars().all(|c| c.is_ascii_hexdigit()));
        assert_ne!(generated, ClusterSecret::generate());
        assert!(ClusterSecret::weakness(&generated).is_none());
        assert!(ClusterSecret::weakness("hunter2").unwrap().contains("hearth secret"));
    }

    /// Two runs with the same secret get unrelated session keys, neither of which is the
    /// password key or the `K` the proofs are made with.
    #[test]
    fn session_keys_are_fresh_and_not_the_password() {
        let s = secret("hunter2");
        let keys: Vec<[u8; 32]> = (0..2)
            .map(|_| {
                let mut c = ClientHandshake::new(&s);
                let srv = ServerHandshake::new(&s, ID, c.hello());
                let (share, id) = srv.challenge();
                let proof = c.on_challenge(share, id).unwrap();
                let (welcome, key) = srv.on_proof(&proof).unwrap();
                assert_eq!(c.on_welcome(&welcome).unwrap().1.bytes(), key.bytes());
                assert_ne!(Some(key.bytes().to_vec()), srv.key.clone(), "not the proofs' key");
                key.bytes()
            })
            .collect();
        assert_ne!(keys[0], keys[1]);
        assert!(keys.iter().all(|k| *k != s.password_key()));
        assert_eq!(format!("{:?}", SessionKey([0; 32])), "SessionKey(..)");
    }

    #[test]
    fn no_welcome_before_challenge_and_no_empty_secret() {
        let client = ClientHandshake::new(&secret("x"));
        assert!(client.on_welcome(&[0; 32]).is_none());
        assert!(ClusterSecret::new("").is_err());
        assert_eq!(format!("{:?}", secret("x")), "ClusterSecret(..)");
    }
}
