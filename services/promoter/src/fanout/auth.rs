//! How one agent proves to another that it holds the agents' secret without sending it: every
//! piece request carries an HMAC-SHA256, keyed by the secret, of its method, its path, the
//! time it was made and a random nonce:
//!
//! ```text
//! Authorization: Stagehand-HMAC-SHA256 t=<unix seconds>,n=<32 hex>,s=<64 hex>
//! ```
//!
//! The server admits a request only when the signature is the one the secret gives, its time
//! is within [`SKEW`] of the server's clock and the same signature was not admitted before in
//! that window. So on plain HTTP a listener on the network learns neither the secret nor a
//! request it could use for anything but the one piece it already saw go by, and only once:
//! the replay is refused. (Mutual TLS, in the shipped Kubernetes configuration, hides even
//! that.) Node clocks must agree within [`SKEW`], as they do under NTP.

use std::collections::HashMap;
use std::fmt::Write as _;
use std::sync::{Arc, Mutex};
use std::time::{SystemTime, UNIX_EPOCH};

use hmac::{Hmac, KeyInit, Mac};
use hyper::header::HeaderValue;
use sha2::Sha256;

/// How far a request's time may be from the server's clock, either way. Also how long a
/// signature is remembered to refuse its replay.
pub const SKEW: u64 = 300;
/// The scheme named in the header.
const SCHEME: &str = "Stagehand-HMAC-SHA256";
/// What the signature covers begins with this, so a signature made for anything else with the
/// same key is never one for a piece request.
const CONTEXT: &str = "stagehand fan-out piece request v1";

/// The agents' shared secret, used only as a signing key.
#[derive(Clone)]
pub struct AgentKey {
    key: Arc<[u8]>,
}

/// Why a request was not admitted (said in the 401's body: a peer with a wrong clock or key
/// should be told which).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Refusal {
    #[error("no `{SCHEME}` authorization: the agents' signature is required")]
    Missing,
    #[error("a malformed `{SCHEME}` authorization")]
    Malformed,
    #[error(
        "the request's time is {0} s from this node's clock (at most {SKEW} s): check the nodes' clocks"
    )]
    Skewed(u64),
    #[error("the signature is not the agents' key's")]
    BadSignature,
    #[error("this signed request was already answered; a replay is refused")]
    Replayed,
}

impl AgentKey {
    pub fn new(secret: &str) -> AgentKey {
        AgentKey {
            key: secret.as_bytes().into(),
        }
    }

    /// The `Authorization` header for `method` of `path` (with its query, if any), made now.
    pub fn sign(&self, method: &str, path: &str) -> String {
        let nonce: [u8; 16] = rand::random();
        self.sign_at(method, path, now(), &hex::encode(nonce))
    }

    fn sign_at(&self, method: &str, path: &str, at: u64, nonce: &str) -> String {
        let signature = hex::encode(self.mac(method, path, at, nonce).finalize().into_bytes());
        format!("{SCHEME} t={at},n={nonce},s={signature}")
    }

    fn mac(&self, method: &str, path: &str, at: u64, nonce: &str) -> Hmac<Sha256> {
        let mut mac =
            Hmac::<Sha256>::new_from_slice(&self.key).expect("HMAC takes a key of any length");
        let mut signed = String::with_capacity(CONTEXT.len() + path.len() + 64);
        let _ = write!(signed, "{CONTEXT}\n{method}\n{path}\n{at}\n{nonce}");
        mac.update(signed.as_bytes());
        mac
    }
}

/// The server's side: the key, and the signatures admitted within the last [`SKEW`] seconds.
pub struct Gate {
    key: AgentKey,
    admitted: Mutex<Admitted>,
}

/// The signatures admitted and not yet stale.
#[derive(Default)]
struct Admitted {
    /// Signature → the time after which its request would be refused as skewed anyway.
    until: HashMap<[u8; 32], u64>,
    /// When stale signatures were last let go: at most once a minute, so that admitting stays
    /// constant time however many pieces a swarm has.
    pruned_at: u64,
}

impl Gate {
    pub fn new(key: AgentKey) -> Gate {
        Gate {
            key,
            admitted: Mutex::default(),
        }
    }

    /// Admits a request of `method` for `path` carrying `header`, at most once.
    pub fn admit(
        &self,
        method: &str,
        path: &str,
        header: Option<&HeaderValue>,
    ) -> Result<(), Refusal> {
        self.admit_at(method, path, header, now())
    }

    fn admit_at(
        &self,
        method: &str,
        path: &str,
        header: Option<&HeaderValue>,
        now: u64,
    ) -> Result<(), Refusal> {
        let header = header
            .and_then(|h| h.to_str().ok())
            .ok_or(Refusal::Missing)?;
        let fields = header
            .strip_prefix(SCHEME)
            .and_then(|f| f.strip_prefix(' '))
            .ok_or(Refusal::Missing)?;
        let (at, nonce, signature) = parse(fields).ok_or(Refusal::Malformed)?;
        let skew = at.abs_diff(now);
        if skew > SKEW {
            return Err(Refusal::Skewed(skew));
        }
        // `verify_slice` compares in constant time: how long it takes says nothing of how
        // much of a forged signature was right.
        self.key
            .mac(method, path, at, nonce)
            .verify_slice(&signature)
            .map_err(|_| Refusal::BadSignature)?;
        let mut admitted = self
            .admitted
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        if now >= admitted.pruned_at + 60 {
            admitted.until.retain(|_, until| *until >= now);
            admitted.pruned_at = now;
        }
        if admitted.until.insert(signature, at + SKEW).is_some() {
            return Err(Refusal::Replayed);
        }
        Ok(())
    }
}

/// `t=<seconds>,n=<32 hex>,s=<64 hex>`, in that order.
fn parse(fields: &str) -> Option<(u64, &str, [u8; 32])> {
    let mut parts = fields.split(',');
    let at = parts.next()?.strip_prefix("t=")?.parse().ok()?;
    let nonce = parts.next()?.strip_prefix("n=")?;
    let signature = parts.next()?.strip_prefix("s=")?;
    if parts.next().is_some() || nonce.len() != 32 || !nonce.bytes().all(|b| b.is_ascii_hexdigit())
    {
        return None;
    }
    let mut bytes = [0u8; 32];
    hex::decode_to_slice(signature, &mut bytes).ok()?;
    Some((at, nonce, bytes))
}

fn now() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0)
}

#[cfg(test)]
mod tests {
    use super::*;

    const PATH: &str = "/v1/swarms/ab12/pieces/3";
    const NONCE: &str = "00112233445566778899aabbccddeeff";
    const AT: u64 = 1_800_000_000;

    fn h(s: &str) -> HeaderValue {
        HeaderValue::from_str(s).unwrap()
    }

    fn gate() -> Gate {
        Gate::new(AgentKey::new("a-long-shared-secret"))
    }

    #[test]
    fn a_signed_request_is_admitted_once() {
        let key = AgentKey::new("a-long-shared-secret");
        let gate = gate();
        let signed = h(&key.sign_at("GET", PATH, AT, NONCE));
        assert_eq!(gate.admit_at("GET", PATH, Some(&signed), AT + 2), Ok(()));
        assert_eq!(
            gate.admit_at("GET", PATH, Some(&signed), AT + 3),
            Err(Refusal::Replayed)
        );
        // A fresh nonce is a fresh request.
        let again = h(&key.sign_at("GET", PATH, AT, "ffeeddccbbaa99887766554433221100"));
        assert_eq!(gate.admit_at("GET", PATH, Some(&again), AT + 3), Ok(()));
    }

    #[test]
    fn the_header_never_holds_the_secret() {
        let signed = AgentKey::new("a-long-shared-secret").sign("GET", PATH);
        assert!(!signed.contains("a-long-shared-secret"), "{signed}");
        assert!(signed.starts_with("Stagehand-HMAC-SHA256 t="), "{signed}");
    }

    #[test]
    fn a_signature_covers_the_path_the_method_and_the_time() {
        let key = AgentKey::new("a-long-shared-secret");
        let signed = h(&key.sign_at("GET", PATH, AT, NONCE));
        let gate = gate();
        let other_piece = "/v1/swarms/ab12/pieces/4";
        assert_eq!(
            gate.admit_at("GET", other_piece, Some(&signed), AT),
            Err(Refusal::BadSignature)
        );
        assert_eq!(
            gate.admit_at("POST", PATH, Some(&signed), AT),
            Err(Refusal::BadSignature)
        );
        let later = key
            .sign_at("GET", PATH, AT, NONCE)
            .replace(&format!("t={AT}"), &format!("t={}", AT + 1));
        assert_eq!(
            gate.admit_at("GET", PATH, Some(&h(&later)), AT),
            Err(Refusal::BadSignature)
        );
    }

    #[test]
    fn another_key_a_stale_time_or_the_bare_secret_are_refused() {
        let gate = gate();
        let wrong = AgentKey::new("another-long-shared-secret").sign_at("GET", PATH, AT, NONCE);
        assert_eq!(
            gate.admit_at("GET", PATH, Some(&h(&wrong)), AT),
            Err(Refusal::BadSignature)
        );
        let right = AgentKey::new("a-long-shared-secret").sign_at("GET", PATH, AT, NONCE);
        assert_eq!(
            gate.admit_at("GET", PATH, Some(&h(&right)), AT + SKEW + 1),
            Err(Refusal::Skewed(SKEW + 1))
        );
        assert_eq!(
            gate.admit_at("GET", PATH, Some(&h(&right)), AT - SKEW - 5),
            Err(Refusal::Skewed(SKEW + 5))
        );
        assert_eq!(
            gate.admit_at("GET", PATH, Some(&h("Bearer a-long-shared-secret")), AT),
            Err(Refusal::Missing)
        );
        assert_eq!(gate.admit_at("GET", PATH, None, AT), Err(Refusal::Missing));
        for malformed in [
            "Stagehand-HMAC-SHA256 t=1,n=00,s=00",
            "Stagehand-HMAC-SHA256 n=00112233445566778899aabbccddeeff,t=1,s=00",
            "Stagehand-HMAC-SHA256 t=x,n=00112233445566778899aabbccddeeff,s=00",
        ] {
            assert_eq!(
                gate.admit_at("GET", PATH, Some(&h(malformed)), AT),
                Err(Refusal::Malformed),
                "{malformed}"
            );
        }
    }

    #[test]
    fn admitted_signatures_are_forgotten_once_they_would_be_stale() {
        let key = AgentKey::new("a-long-shared-secret");
        let gate = gate();
        let signed = h(&key.sign_at("GET", PATH, AT, NONCE));
        gate.admit_at("GET", PATH, Some(&signed), AT).unwrap();
        let later = h(&key.sign_at("GET", PATH, AT + SKEW + 1, NONCE));
        gate.admit_at("GET", PATH, Some(&later), AT + SKEW + 1)
            .unwrap();
        let remembered = gate.admitted.lock().unwrap().until.len();
        assert_eq!(remembered, 1, "the stale signature is forgotten");
    }
}
