//! Certificates that renew themselves before they expire.
//!
//! Member and operator certificates are valid for days (the CA holder's `cert_lifetime`, 30
//! days by default), not centuries: a key that leaks stops working on its own, and revocation
//! covers the rest. A holder asks for a new certificate once a third of its window is left
//! ([`Validity::renewal_due`]): it makes a new key, sends a certificate request over a connection
//! authenticated by its current certificate, and a member holding the CA key signs it for the
//! identity that certificate names (never one the request claims; a revoked identity is refused
//! before it is asked). The new key and certificate replace the files in the holder's TLS
//! directory, key first; a reader that catches the pair in between sees a mismatch and reads
//! again later ([`super::ca::CaError::Mismatch`]).
//!
//! Members renew their own ([`super::super::server`]); a node serving beside a member reloads
//! the member's files when they change; a router renews its operator certificate through the
//! members it follows.

use std::fs;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::time::SystemTime;

use rcgen::{CertificateParams, KeyPair};
use rustls::pki_types::CertificateDer;
use rustls::pki_types::pem::PemObject;

use super::ca::{
    ClusterCa, MEMBER_CERT_FILE, MEMBER_KEY_FILE, MemberIdentity, OPERATOR_CERT_FILE,
    OPERATOR_KEY_FILE, OperatorIdentity, Principal, Validity,
};
use super::client::Client;
use super::wire::{Request, Response};

/// Which identity a TLS directory holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum IdentityKind {
    Member,
    Operator,
}

impl IdentityKind {
    /// The certificate and key files of this kind in a TLS directory.
    pub fn files(self, dir: &Path) -> (PathBuf, PathBuf) {
        let (cert, key) = match self {
            IdentityKind::Member => (MEMBER_CERT_FILE, MEMBER_KEY_FILE),
            IdentityKind::Operator => (OPERATOR_CERT_FILE, OPERATOR_KEY_FILE),
        };
        (dir.join(cert), dir.join(key))
    }
}

#[derive(Debug, thiserror::Error)]
pub enum RenewError {
    #[error("{}: {source}", path.display())]
    Io {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("{}: {detail}", path.display())]
    Certificate { path: PathBuf, detail: String },
    #[error("certificate request: {0}")]
    Request(#[from] rcgen::Error),
    #[error("no member holding the CA key renewed it (asked {asked}): {last}")]
    NotRenewed { asked: usize, last: String },
}

fn io_err(path: &Path) -> impl FnOnce(std::io::Error) -> RenewError + '_ {
    move |source| RenewError::Io {
        path: path.to_path_buf(),
        source,
    }
}

/// The certificate in `path` and its validity.
pub fn read_certificate(path: &Path) -> Result<(CertificateDer<'static>, Validity), RenewError> {
    let bad = |detail: String| RenewError::Certificate {
        path: path.to_path_buf(),
        detail,
    };
    let pem = fs::read(path).map_err(io_err(path))?;
    let der = CertificateDer::from_pem_slice(&pem).map_err(|e| bad(e.to_string()))?;
    let validity = Validity::of(&der).map_err(|e| bad(e.to_string()))?;
    Ok((der, validity))
}

/// What [`renew_if_due`] did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Renewal {
    /// More than a third of the certificate's window is left.
    NotDue(Validity),
    /// A new certificate and key are in place, valid for this window.
    Renewed(Validity),
}

/// Renews the identity of `kind` in `dir` if it is due at `now`, asking the members at
/// `members` in turn (the first that holds the CA key signs) over `client`, which presents the
/// current certificate.
pub async fn renew_if_due(
    client: &Client,
    members: &[String],
    dir: &Path,
    kind: IdentityKind,
    now: SystemTime,
) -> Result<Renewal, RenewError> {
    let Asking {
        principal,
        key,
        csr_pem,
        ..
    } = match asking(dir, kind, now)? {
        Ok(asking) => asking,
        Err(validity) => return Ok(Renewal::NotDue(validity)),
    };
    let request = Request::Renew { csr_pem };
    let mut last = String::from("no member to ask");
    for addr in members {
        let answer = match client.call(addr, &request).await {
            Ok(Response::Renewed { cert_pem }) => cert_pem,
            Ok(other) => {
                last = format!("{addr}: {}", describe(&other));
                continue;
            }
            Err(e) => {
                last = e.to_string();
                continue;
            }
        };
        return install(&answer, &principal, &key, kind, dir, addr).map(Renewal::Renewed);
    }
    Err(RenewError::NotRenewed {
        asked: members.len(),
        last,
    })
}

/// Renews the member certificate in `dir` with the CA key this process holds, if it is due at
/// `now` (expired included): what the CA holder does when it starts, since nobody could
/// renew a certificate that expired while its member was down over the network.
pub fn renew_locally(ca: &ClusterCa, dir: &Path, now: SystemTime) -> Result<Renewal, RenewError> {
    let kind = IdentityKind::Member;
    let Asking {
        principal,
        key,
        csr_pem,
        cert_path,
    } = match asking(dir, kind, now)? {
        Ok(asking) => asking,
        Err(validity) => return Ok(Renewal::NotDue(validity)),
    };
    let cert_pem = ca
        .sign_for(&csr_pem, &principal)
        .map_err(|e| RenewError::Certificate {
            path: cert_path.clone(),
            detail: e.to_string(),
        })?;
    install(
        &cert_pem,
        &principal,
        &key,
        kind,
        dir,
        "this member's CA key",
    )
    .map(Renewal::Renewed)
}

/// A renewal under way: whom the current certificate names, and a new key with its request.
struct Asking {
    principal: Principal,
    key: KeyPair,
    csr_pem: String,
    cert_path: PathBuf,
}

/// The renewal of the identity of `kind` in `dir` if it is due at `now`; the certificate's
/// validity if not.
fn asking(
    dir: &Path,
    kind: IdentityKind,
    now: SystemTime,
) -> Result<Result<Asking, Validity>, RenewError> {
    let (cert_path, _) = kind.files(dir);
    let (current, validity) = read_certificate(&cert_path)?;
    if !validity.renewal_due(now) {
        return Ok(Err(validity));
    }
    let principal = Principal::of(&current).ok_or_else(|| RenewError::Certificate {
        path: cert_path.clone(),
        detail: "names no member or operator".into(),
    })?;
    let key = KeyPair::generate()?;
    let csr_pem = CertificateParams::new(Vec::<String>::new())?
        .serialize_request(&key)?
        .pem()?;
    Ok(Ok(Asking {
        principal,
        key,
        csr_pem,
        cert_path,
    }))
}

/// Checks the renewed certificate `cert_pem` (from `signer`) and puts it and `key` in place.
fn install(
    cert_pem: &str,
    principal: &Principal,
    key: &KeyPair,
    kind: IdentityKind,
    dir: &Path,
    signer: &str,
) -> Result<Validity, RenewError> {
    let (cert_path, key_path) = kind.files(dir);
    let validity =
        check_renewed(cert_pem, principal, key).map_err(|detail| RenewError::Certificate {
            path: PathBuf::from(signer),
            detail,
        })?;
    replace(&key_path, key.serialize_pem().as_bytes(), true)?;
    replace(&cert_path, cert_pem.as_bytes(), false)?;
    tracing::info!(%principal, until = ?validity.not_after, "renewed this certificate");
    Ok(validity)
}

fn describe(response: &Response) -> String {
    match response {
        Response::Refused(refusal) => refusal.to_string(),
        other => format!("{other:?}").chars().take(120).collect(),
    }
}

/// Checks that a renewed certificate names the same identity and carries the new key.
fn check_renewed(pem: &str, principal: &Principal, key: &KeyPair) -> Result<Validity, String> {
    let der = CertificateDer::from_pem_slice(pem.as_bytes()).map_err(|e| e.to_string())?;
    if Principal::of(&der).as_ref() != Some(principal) {
        return Err(format!("the renewed certificate does not name {principal}"));
    }
    let (_, parsed) = x509_parser::parse_x509_certificate(&der).map_err(|e| e.to_string())?;
    if parsed.public_key().subject_public_key.data.as_ref() != key.public_key_raw() {
        return Err("the renewed certificate is not for the key asked with".into());
    }
    Validity::of(&der).map_err(|e| e.to_string())
}

/// Replaces `path` with `contents` through a temporary file renamed over it (owner-only when
/// `private`), synced before the rename.
fn replace(path: &Path, contents: &[u8], private: bool) -> Result<(), RenewError> {
    let mut name = path.file_name().unwrap_or_default().to_os_string();
    name.push(".new");
    let temporary = path.with_file_name(name);
    let mut options = fs::OpenOptions::new();
    options.write(true).create(true).truncate(true);
    #[cfg(unix)]
    if private {
        std::os::unix::fs::OpenOptionsExt::mode(&mut options, 0o600);
    }
    #[cfg(not(unix))]
    let _ = private;
    let mut file = options.open(&temporary).map_err(io_err(&temporary))?;
    file.write_all(contents).map_err(io_err(&temporary))?;
    file.sync_all().map_err(io_err(&temporary))?;
    fs::rename(&temporary, path).map_err(io_err(path))
}

/// The addresses a renewal may ask: every member in a raft membership.
pub fn member_addresses(
    membership: &openraft::Membership<crate::NodeId, openraft::BasicNode>,
) -> Vec<String> {
    membership.nodes().map(|(_, n)| n.addr.clone()).collect()
}

/// How often a holder looks at its certificate and its files.
const LOOK_EVERY: std::time::Duration = std::time::Duration::from_secs(2);
/// The longest a holder waits between renewals that fail (the CA holder down, say): failures
/// double the wait from [`LOOK_EVERY`] up to this.
const RETRY_AT_MOST: std::time::Duration = std::time::Duration::from_secs(300);

/// Who renews an identity, and through whom.
pub struct Renewer {
    /// A client presenting the identity being renewed.
    pub client: Client,
    /// The members to ask, as they are at each renewal.
    pub members: Box<dyn Fn() -> Vec<String> + Send + Sync>,
}

/// Keeps `live` presenting the identity of `kind` in `dir` for as long as the process runs:
/// with a `renewer` it renews the certificate when due; either way it takes up new files found
/// in `dir` (a member renewing the identity a node beside it shares, `cluster reissue` copied in
/// by an operator). Connections open before finish on the certificate they were opened with.
pub async fn keep_identity(
    dir: PathBuf,
    kind: IdentityKind,
    live: std::sync::Arc<strata_quic::LiveIdentity>,
    renewer: Option<Renewer>,
) {
    let mut retry = LOOK_EVERY;
    let mut next_renewal = tokio::time::Instant::now();
    loop {
        tokio::time::sleep(LOOK_EVERY).await;
        if let Some(renewer) = renewer
            .as_ref()
            .filter(|_| tokio::time::Instant::now() >= next_renewal)
        {
            let members = (renewer.members)();
            let now = SystemTime::now();
            match renew_if_due(&renewer.client, &members, &dir, kind, now).await {
                Ok(_) => retry = LOOK_EVERY,
                Err(e) => {
                    tracing::warn!(error = %e, retry_in = ?retry, "certificate renewal failed");
                    next_renewal = tokio::time::Instant::now() + retry;
                    retry = (retry * 2).min(RETRY_AT_MOST);
                }
            }
        }
        match take_up(&dir, kind, &live) {
            Ok(false) => {}
            Ok(true) => {
                if let Some(renewer) = &renewer {
                    renewer.client.forget_all();
                }
            }
            // A pair caught between its two renames reads as a mismatch: read again later.
            Err(e) => tracing::debug!(error = %e, "identity files not taken up yet"),
        }
    }
}

/// Makes `live` present the identity in `dir` if it differs from the one presented; whether it
/// did.
fn take_up(
    dir: &Path,
    kind: IdentityKind,
    live: &strata_quic::LiveIdentity,
) -> Result<bool, Box<dyn std::error::Error>> {
    let (cert_path, _) = kind.files(dir);
    let (der, _) = read_certificate(&cert_path)?;
    if der == live.cert() {
        return Ok(false);
    }
    match kind {
        IdentityKind::Member => live.replace(MemberIdentity::load(dir)?.chain())?,
        IdentityKind::Operator => live.replace(OperatorIdentity::load(dir)?.chain())?,
    }
    tracing::info!(dir = %dir.display(), "presenting the new certificate from now on");
    Ok(true)
}
