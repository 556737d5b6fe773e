//! Admitting a new member: a one-use token, a certificate request, a certificate back.
//!
//! `cluster init` writes a token holding the CA certificate's fingerprint and a random secret,
//! and commits the secret's SHA-256. The joiner dials the join endpoint of the member holding
//! the CA key, verifying that member's chain against the pinned fingerprint (it has no
//! certificate of its own yet), and sends the secret with a CSR. That member commits
//! `ConsumeJoinToken` with the id it assigns — through the leader, so the token is spent once
//! for the whole group — then signs the CSR for that id, and adds the joiner as a learner.
//!
//! The group records when each token expires (`state::join_tokens`); a spend past that is
//! rejected in the state machine, so the refusal reaches the joiner before anything is signed
//! and the token stays unspent.
//!
//! Joins are retriable. The joiner keeps its key in its TLS directory from the first attempt, and
//! the token records the key it admitted: the same key presenting the same token again (its
//! answer was lost to a timeout or a leader change) gets the same member id, a certificate for it,
//! and its learner entry re-added (with its address updated) — no second id, no orphan learner.
//! The learner is added without waiting for it to catch up (it cannot start before it holds the
//! certificate this answer carries), wherever the leader is.

use std::fs;
use std::net::SocketAddr;
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use openraft::ChangeMembers;
use openraft::error::{ClientWriteError, RaftError};
use rcgen::{CertificateParams, CertificateSigningRequestParams, KeyPair, PublicKeyData};
use ring::rand::SecureRandom;
use rustls::pki_types::pem::PemObject;

use super::ca::{
    CA_CERT_FILE, CaError, ClusterCa, MEMBER_CERT_FILE, MEMBER_KEY_FILE, MemberIdentity, Principal,
    sha256_hex,
};
use super::client::{Client, ClientError, commit_via_leader};
use super::tls::{TlsError, pinned_client_config};
use super::wire::{JoinGrant, JoinRequest, Refusal, Request, Response, node};
use crate::lease_driver::Clock;
use crate::state::{Change, Command};
use crate::store::StateReader;
use crate::{NodeId, Raft};

/// What a joiner must present: which CA to trust and the secret.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct JoinToken {
    pub ca_fingerprint: String,
    pub secret: String,
}

const TOKEN_PREFIX: &str = "strata-join-1";

impl JoinToken {
    /// A fresh token for the CA with this fingerprint.
    pub fn generate(ca_fingerprint: &str) -> Result<Self, JoinError> {
        let mut bytes = [0u8; 32];
        ring::rand::SystemRandom::new()
            .fill(&mut bytes)
            .map_err(|_| JoinError::Token("the system random source failed".into()))?;
        Ok(Self {
            ca_fingerprint: ca_fingerprint.to_string(),
            secret: bytes.iter().map(|b| format!("{b:02x}")).collect(),
        })
    }

    /// What the group stores: the secret's SHA-256.
    pub fn secret_sha256(&self) -> String {
        sha256_hex(self.secret.as_bytes())
    }

    /// `strata-join-1.<fingerprint>.<secret>`
    pub fn encode(&self) -> String {
        format!("{TOKEN_PREFIX}.{}.{}", self.ca_fingerprint, self.secret)
    }

    pub fn parse(text: &str) -> Result<Self, JoinError> {
        let bad = || JoinError::Token("expected strata-join-1.<fingerprint>.<secret>".into());
        let mut parts = text.trim().split('.');
        if parts.next() != Some(TOKEN_PREFIX) {
            return Err(bad());
        }
        let hex64 = |s: &str| s.len() == 64 && s.bytes().all(|b| b.is_ascii_hexdigit());
        match (parts.next(), parts.next(), parts.next()) {
            (Some(fp), Some(secret), None) if hex64(fp) && hex64(secret) => Ok(Self {
                ca_fingerprint: fp.to_ascii_lowercase(),
                secret: secret.to_string(),
            }),
            _ => Err(bad()),
        }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum JoinError {
    #[error("join token: {0}")]
    Token(String),
    #[error(transparent)]
    Ca(#[from] CaError),
    #[error(transparent)]
    Tls(#[from] TlsError),
    #[error(transparent)]
    Client(#[from] ClientError),
    #[error("cannot open a QUIC endpoint: {0}")]
    Endpoint(std::io::Error),
    #[error("certificate request: {0}")]
    Request(#[from] rcgen::Error),
    #[error("the seed answered with a CA other than the token's")]
    WrongCa,
    #[error("{}: {source}", path.display())]
    Write {
        path: std::path::PathBuf,
        source: std::io::Error,
    },
}

/// Held by the member with the CA key: admits joiners.
pub struct JoinAuthority {
    ca: ClusterCa,
    client: Client,
    clock: Arc<dyn Clock>,
}

impl JoinAuthority {
    pub fn new(ca: ClusterCa, client: Client, clock: Arc<dyn Clock>) -> Self {
        Self { ca, client, clock }
    }

    /// Checks and spends the token, signs the request, adds the joiner as a learner. A joiner
    /// presenting a token it already spent, with the same key, is admitted again as the same id.
    pub async fn admit(
        &self,
        raft: &Raft,
        state: &StateReader,
        join: JoinRequest,
    ) -> Result<JoinGrant, Refusal> {
        let csr = CertificateSigningRequestParams::from_pem(&join.csr_pem)
            .map_err(|e| Refusal::Malformed(format!("certificate request: {e}")))?;
        let key_sha256 = sha256_hex(csr.public_key.der_bytes());
        if join.raft_addr.parse::<SocketAddr>().is_err() {
            return Err(Refusal::Malformed(format!(
                "raft address {:?} is not host:port",
                join.raft_addr
            )));
        }
        let sha256 = sha256_hex(join.secret.as_bytes());
        let now = self.clock.now_ms();
        let id = state.with(|applied| {
            let tokens = applied.cluster.join_tokens();
            if let Some(id) = tokens.readmits(&sha256, &key_sha256, now) {
                return id;
            }
            let members = applied.cluster.members().keys().copied();
            let nodes = applied.membership.membership().nodes().map(|(id, _)| *id);
            let admitted = tokens.tokens().values().filter_map(|t| t.consumed_by);
            members.chain(nodes).chain(admitted).max().unwrap_or(0) + 1
        });
        let consume = Command::new(
            now,
            Change::ConsumeJoinToken {
                sha256,
                id,
                key_sha256: Some(key_sha256),
            },
        );
        commit_via_leader(raft, &self.client, consume)
            .await?
            .map_err(|rejection| Refusal::JoinRefused(rejection.to_string()))?;
        let cert_pem = self
            .ca
            .sign_request(&join.csr_pem, id)
            .map_err(|e| Refusal::Failed(e.to_string()))?;
        self.add_learner(raft, id, &join.raft_addr)
            .await
            .map_err(|e| Refusal::Failed(format!("member {id} admitted, not added: {e}")))?;
        tracing::info!(member = id, addr = %join.raft_addr, "admitted a joiner as a learner");
        Ok(JoinGrant {
            id,
            cert_pem,
            ca_pem: self.ca.cert_pem().to_string(),
        })
    }

    /// Signs `csr_pem` as a new certificate for `principal`, the identity the caller's current
    /// certificate names (checked not revoked before this is asked).
    pub fn renew(&self, csr_pem: &str, principal: &Principal) -> Result<String, Refusal> {
        let cert_pem = self
            .ca
            .sign_for(csr_pem, principal)
            .map_err(|e| Refusal::Malformed(format!("certificate request: {e}")))?;
        tracing::info!(%principal, lifetime = ?self.ca.lifetime(), "renewed a certificate");
        Ok(cert_pem)
    }

    /// Adds `id` at `addr` as a learner through whichever member leads, without waiting for it
    /// to catch up; a learner already there (a retried join) gets its address updated.
    async fn add_learner(&self, raft: &Raft, id: NodeId, addr: &str) -> Result<(), String> {
        let known = raft
            .metrics()
            .borrow()
            .membership_config
            .membership()
            .get_node(&id)
            .map(|n| n.addr.clone());
        if known.as_deref() == Some(addr) {
            return Ok(());
        }
        let change = if known.is_some() {
            raft.change_membership(ChangeMembers::SetNodes([(id, node(addr))].into()), true)
                .await
        } else {
            raft.add_learner(id, node(addr), false).await
        };
        match change {
            Ok(_) => Ok(()),
            Err(RaftError::APIError(ClientWriteError::ForwardToLeader(forward))) => {
                match forward.leader_node {
                    Some(leader) => self
                        .client
                        .add_learner(&leader.addr, id, addr)
                        .await
                        .map(|_| ())
                        .map_err(|e| e.to_string()),
                    None => Err("no leader".to_string()),
                }
            }
            Err(e) => Err(e.to_string()),
        }
    }
}

/// The joiner's side: asks the member at `seed` (its join endpoint) for a certificate, writes
/// the new identity into `tls_dir` and returns it. The key is made on the first attempt and kept
/// in `tls_dir`, so that a retry after a lost answer is admitted as the same member.
pub async fn request_membership(
    seed: &str,
    token: &JoinToken,
    raft_addr: &str,
    tls_dir: &Path,
    timeout: Duration,
) -> Result<MemberIdentity, JoinError> {
    let key = joiner_key(tls_dir)?;
    let csr_pem = CertificateParams::new(Vec::<String>::new())?
        .serialize_request(&key)?
        .pem()?;
    let seed_addr: SocketAddr = tokio::net::lookup_host(seed)
        .await
        .ok()
        .and_then(|mut a| a.next())
        .ok_or_else(|| ClientError::Resolve {
            addr: seed.to_string(),
            detail: "no address".into(),
        })?;
    let local: SocketAddr = if seed_addr.is_ipv4() {
        "0.0.0.0:0"
    } else {
        "[::]:0"
    }
    .parse()
    .map_err(|_| JoinError::Token("unreachable: a literal address".into()))?;
    let mut endpoint = quinn::Endpoint::client(local).map_err(JoinError::Endpoint)?;
    endpoint.set_default_client_config(pinned_client_config(&token.ca_fingerprint)?);
    let client = Client::new(endpoint.clone(), timeout);
    let request = Request::Join(JoinRequest {
        secret: token.secret.clone(),
        csr_pem,
        raft_addr: raft_addr.to_string(),
    });
    let response = client.call(seed, &request).await;
    endpoint.close(0u32.into(), b"joined");
    let grant = match response? {
        Response::Joined(grant) => grant,
        Response::Refused(refusal) => {
            return Err(ClientError::Refused {
                addr: seed.to_string(),
                refusal,
            }
            .into());
        }
        other => {
            return Err(ClientError::Unexpected {
                addr: seed.to_string(),
                what: format!("{other:?}").chars().take(200).collect(),
            }
            .into());
        }
    };
    let ca_der = rustls::pki_types::CertificateDer::from_pem_slice(grant.ca_pem.as_bytes())
        .map_err(|_| JoinError::WrongCa)?;
    if sha256_hex(&ca_der) != token.ca_fingerprint {
        return Err(JoinError::WrongCa);
    }
    write_identity(tls_dir, &grant)?;
    Ok(MemberIdentity::load(tls_dir)?)
}

fn write_err(path: &Path) -> impl FnOnce(std::io::Error) -> JoinError {
    let path = path.to_path_buf();
    move |source| JoinError::Write { path, source }
}

/// The key this joiner asks with: the one an earlier attempt left in `dir`, else a new one,
/// written there (owner-only) before it is used.
fn joiner_key(dir: &Path) -> Result<KeyPair, JoinError> {
    let key_path = dir.join(MEMBER_KEY_FILE);
    if let Ok(pem) = fs::read_to_string(&key_path) {
        return KeyPair::from_pem(&pem).map_err(JoinError::Request);
    }
    let key = KeyPair::generate()?;
    fs::create_dir_all(dir).map_err(write_err(dir))?;
    let mut options = fs::OpenOptions::new();
    options.write(true).create(true).truncate(true);
    #[cfg(unix)]
    std::os::unix::fs::OpenOptionsExt::mode(&mut options, 0o600);
    let mut file = options.open(&key_path).map_err(write_err(&key_path))?;
    std::io::Write::write_all(&mut file, key.serialize_pem().as_bytes())
        .map_err(write_err(&key_path))?;
    Ok(key)
}

fn write_identity(dir: &Path, grant: &JoinGrant) -> Result<(), JoinError> {
    for (name, contents) in [
        (MEMBER_CERT_FILE, &grant.cert_pem),
        (CA_CERT_FILE, &grant.ca_pem),
    ] {
        let path = dir.join(name);
        fs::write(&path, contents).map_err(write_err(&path))?;
    }
    Ok(())
}
