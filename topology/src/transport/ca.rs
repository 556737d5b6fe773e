//! The cluster certificate authority and member identities.
//!
//! `cluster init` makes a CA (a self-signed ECDSA P-256 certificate) and every member holds a
//! certificate it issued. A member certificate names its member id twice: in the subject's
//! common name and in a DNS subject alternative name `member-<id>.strata`, the one the transport
//! reads back after a handshake to learn who the peer is. Every member certificate also carries
//! [`SERVER_NAME`], the name clients verify when they dial a member whose id they do not know.
//!
//! An operator certificate names an operator the same way, as `operator-<name>.strata`, and
//! carries neither a member name nor [`SERVER_NAME`] and only client authentication: it can
//! call members but can neither pass for one nor serve as one. [`Principal`] reads back which
//! of the two a certificate is.

use std::fs;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::time::{Duration, SystemTime};

use rcgen::{
    BasicConstraints, CertificateParams, CertificateSigningRequestParams, DnType,
    ExtendedKeyUsagePurpose, IsCa, Issuer, KeyPair, KeyUsagePurpose,
};
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};

use crate::NodeId;

/// The name every member certificate carries and every client verifies.
pub const SERVER_NAME: &str = "strata-member";

pub const CA_CERT_FILE: &str = "ca.pem";
pub const CA_KEY_FILE: &str = "ca.key";
pub const MEMBER_CERT_FILE: &str = "member.pem";
pub const MEMBER_KEY_FILE: &str = "member.key";
pub const OPERATOR_CERT_FILE: &str = "operator.pem";
pub const OPERATOR_KEY_FILE: &str = "operator.key";

/// The longest operator name: it must fit in a DNS label with its prefix.
pub const MAX_OPERATOR_NAME: usize = 32;

/// How long a member or operator certificate stays valid unless the CA holder is configured
/// otherwise: holders renew theirs when a third of it is left ([`Validity::renewal_due`]).
pub const DEFAULT_CERT_LIFETIME: Duration = Duration::from_secs(30 * 24 * 3600);
/// The shortest lifetime the CA issues (tests use seconds; holders look at their certificates
/// every 2 s).
pub const MIN_CERT_LIFETIME: Duration = Duration::from_secs(10);
/// How long the CA's own certificate stays valid. Rotating the CA itself is not automated
/// (docs/ARCHITECTURE.md).
const CA_LIFETIME: Duration = Duration::from_secs(10 * 365 * 24 * 3600);
/// How far back a leaf certificate's validity starts, for peers whose clocks run behind: a
/// minute, or a tenth of a short lifetime.
const MAX_BACKDATE: Duration = Duration::from_secs(60);

/// Why a CA or an identity could not be made or loaded.
#[derive(Debug, thiserror::Error)]
pub enum CaError {
    #[error("{}: {source}", path.display())]
    Io {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("{}: not a PEM {what}: {detail}", path.display())]
    Pem {
        path: PathBuf,
        what: &'static str,
        detail: String,
    },
    #[error("{}: already exists; refusing to overwrite a cluster CA", path.display())]
    Exists { path: PathBuf },
    #[error("{}: the key does not belong to the certificate {}", key.display(), cert.display())]
    Mismatch { cert: PathBuf, key: PathBuf },
    #[error("certificate generation: {0}")]
    Generate(#[from] rcgen::Error),
    #[error("certificate lifetime {0:?} is shorter than the shortest, {MIN_CERT_LIFETIME:?}")]
    ShortLifetime(Duration),
    #[error("the certificate's validity cannot be read: {0}")]
    Validity(String),
    #[error("the certificate names no strata member id")]
    NoMemberId,
    #[error("the certificate names no strata operator")]
    NoOperator,
    #[error(
        "bad operator name {0:?}: use 1 to {MAX_OPERATOR_NAME} lowercase letters, digits or \
         '-', starting with a letter and not ending with '-'"
    )]
    BadOperatorName(String),
}

fn io_err(path: &Path) -> impl FnOnce(std::io::Error) -> CaError + '_ {
    move |source| CaError::Io {
        path: path.to_path_buf(),
        source,
    }
}

/// Writes `contents` to a new file readable only by its owner.
fn write_private(path: &Path, contents: &[u8]) -> Result<(), CaError> {
    let mut options = fs::OpenOptions::new();
    options.write(true).create_new(true);
    #[cfg(unix)]
    std::os::unix::fs::OpenOptionsExt::mode(&mut options, 0o600);
    let mut file = options.open(path).map_err(|e| match e.kind() {
        std::io::ErrorKind::AlreadyExists => CaError::Exists {
            path: path.to_path_buf(),
        },
        _ => CaError::Io {
            path: path.to_path_buf(),
            source: e,
        },
    })?;
    file.write_all(contents).map_err(io_err(path))?;
    file.sync_all().map_err(io_err(path))
}

fn write_public(path: &Path, contents: &[u8]) -> Result<(), CaError> {
    fs::write(path, contents).map_err(io_err(path))
}

fn read_text(path: &Path) -> Result<String, CaError> {
    fs::read_to_string(path).map_err(io_err(path))
}

fn pem_err<'a>(path: &'a Path, what: &'static str) -> impl FnOnce(String) -> CaError + 'a {
    move |detail| CaError::Pem {
        path: path.to_path_buf(),
        what,
        detail,
    }
}

/// Sets `params` valid from a little before now for `lifetime`.
fn set_validity(params: &mut CertificateParams, lifetime: Duration) {
    let now = time::OffsetDateTime::now_utc();
    let backdate = MAX_BACKDATE.min(lifetime / 10);
    params.not_before = now - backdate;
    params.not_after = now + lifetime;
}

/// When a certificate starts and stops being valid.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Validity {
    pub not_before: SystemTime,
    pub not_after: SystemTime,
}

impl Validity {
    /// Reads the validity window of `cert`.
    pub fn of(cert: &CertificateDer<'_>) -> Result<Self, CaError> {
        let (_, parsed) = x509_parser::parse_x509_certificate(cert)
            .map_err(|e| CaError::Validity(e.to_string()))?;
        let at = |t: x509_parser::time::ASN1Time| {
            let seconds = t.timestamp();
            u64::try_from(seconds)
                .map(|s| SystemTime::UNIX_EPOCH + Duration::from_secs(s))
                .map_err(|_| CaError::Validity(format!("a time before 1970 ({seconds})")))
        };
        let validity = parsed.validity();
        Ok(Self {
            not_before: at(validity.not_before)?,
            not_after: at(validity.not_after)?,
        })
    }

    /// The whole window.
    pub fn lifetime(&self) -> Duration {
        self.not_after
            .duration_since(self.not_before)
            .unwrap_or_default()
    }

    /// Whether the certificate is past its end at `now`.
    pub fn expired(&self, now: SystemTime) -> bool {
        now > self.not_after
    }

    /// Whether its holder should ask for a new one at `now`: a third of the window or less is
    /// left.
    pub fn renewal_due(&self, now: SystemTime) -> bool {
        let left = self.not_after.duration_since(now).unwrap_or_default();
        left <= self.lifetime() / 3
    }
}

/// The DNS name that carries a member id.
pub fn member_dns_name(id: NodeId) -> String {
    format!("member-{id}.strata")
}

fn member_params(id: NodeId) -> Result<CertificateParams, CaError> {
    let mut params = CertificateParams::new(vec![member_dns_name(id), SERVER_NAME.to_string()])?;
    params
        .distinguished_name
        .push(DnType::CommonName, format!("strata member {id}"));
    params.key_usages = vec![KeyUsagePurpose::DigitalSignature];
    // One certificate serves a member both as a server (peers dial it) and as a client.
    params.extended_key_usages = vec![
        ExtendedKeyUsagePurpose::ServerAuth,
        ExtendedKeyUsagePurpose::ClientAuth,
    ];
    params.use_authority_key_identifier_extension = true;
    Ok(params)
}

/// The DNS name that carries an operator's name.
pub fn operator_dns_name(name: &str) -> String {
    format!("operator-{name}.strata")
}

/// Checks that `name` can name an operator: a DNS label, so that the certificate stays valid
/// and the name reads back unchanged.
pub fn check_operator_name(name: &str) -> Result<(), CaError> {
    let bad = || CaError::BadOperatorName(name.to_string());
    let first = name.chars().next().ok_or_else(bad)?;
    let allowed = |c: char| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '-';
    if name.len() > MAX_OPERATOR_NAME
        || !first.is_ascii_lowercase()
        || name.ends_with('-')
        || !name.chars().all(allowed)
    {
        return Err(bad());
    }
    Ok(())
}

fn operator_params(name: &str) -> Result<CertificateParams, CaError> {
    check_operator_name(name)?;
    let mut params = CertificateParams::new(vec![operator_dns_name(name)])?;
    params
        .distinguished_name
        .push(DnType::CommonName, format!("strata operator {name}"));
    params.key_usages = vec![KeyUsagePurpose::DigitalSignature];
    // Client only: a member verifying a server never accepts an operator's certificate.
    params.extended_key_usages = vec![ExtendedKeyUsagePurpose::ClientAuth];
    params.use_authority_key_identifier_extension = true;
    Ok(params)
}

/// The cluster CA: its certificate, and its key where this member holds it.
pub struct ClusterCa {
    cert_pem: String,
    issuer: Issuer<'static, KeyPair>,
    /// How long the certificates it issues stay valid.
    lifetime: Duration,
}

impl ClusterCa {
    /// Makes a new CA and writes `ca.pem` and `ca.key` (mode 0600) into `dir`, refusing to
    /// overwrite an existing CA.
    pub fn create(dir: &Path) -> Result<Self, CaError> {
        fs::create_dir_all(dir).map_err(io_err(dir))?;
        let key = KeyPair::generate()?;
        let mut params = CertificateParams::default();
        params.distinguished_name = rcgen::DistinguishedName::new();
        params
            .distinguished_name
            .push(DnType::CommonName, "strata cluster CA");
        params.is_ca = IsCa::Ca(BasicConstraints::Constrained(0));
        set_validity(&mut params, CA_LIFETIME);
        params.key_usages = vec![
            KeyUsagePurpose::KeyCertSign,
            KeyUsagePurpose::CrlSign,
            KeyUsagePurpose::DigitalSignature,
        ];
        let cert = params.self_signed(&key)?;
        write_private(&dir.join(CA_KEY_FILE), key.serialize_pem().as_bytes())?;
        write_public(&dir.join(CA_CERT_FILE), cert.pem().as_bytes())?;
        Ok(Self {
            cert_pem: cert.pem(),
            issuer: Issuer::new(params, key),
            lifetime: DEFAULT_CERT_LIFETIME,
        })
    }

    /// Loads the CA written by [`create`](Self::create) from `dir`.
    pub fn load(dir: &Path) -> Result<Self, CaError> {
        let cert_path = dir.join(CA_CERT_FILE);
        let key_path = dir.join(CA_KEY_FILE);
        let cert_pem = read_text(&cert_path)?;
        let key = KeyPair::from_pem(&read_text(&key_path)?)
            .map_err(|e| pem_err(&key_path, "private key")(e.to_string()))?;
        let cert_der = CertificateDer::from_pem_slice(cert_pem.as_bytes())
            .map_err(|e| pem_err(&cert_path, "certificate")(e.to_string()))?;
        let (_, parsed) = x509_parser::parse_x509_certificate(&cert_der)
            .map_err(|e| pem_err(&cert_path, "certificate")(e.to_string()))?;
        if parsed.public_key().subject_public_key.data.as_ref() != key.public_key_raw() {
            return Err(CaError::Mismatch {
                cert: cert_path,
                key: key_path,
            });
        }
        let issuer = Issuer::from_ca_cert_der(&cert_der, key)?;
        Ok(Self {
            cert_pem,
            issuer,
            lifetime: DEFAULT_CERT_LIFETIME,
        })
    }

    /// Issues certificates valid for `lifetime` from now on.
    pub fn with_lifetime(mut self, lifetime: Duration) -> Result<Self, CaError> {
        if lifetime < MIN_CERT_LIFETIME {
            return Err(CaError::ShortLifetime(lifetime));
        }
        self.lifetime = lifetime;
        Ok(self)
    }

    pub fn lifetime(&self) -> Duration {
        self.lifetime
    }

    pub fn cert_pem(&self) -> &str {
        &self.cert_pem
    }

    /// Issues a certificate and key for member `id` and writes them into `dir` as
    /// `member.pem` and `member.key` (0600), with a copy of the CA certificate.
    pub fn issue_member(&self, id: NodeId, dir: &Path) -> Result<MemberIdentity, CaError> {
        fs::create_dir_all(dir).map_err(io_err(dir))?;
        let key = KeyPair::generate()?;
        let cert = self
            .params(member_params(id)?)
            .signed_by(&key, &self.issuer)?;
        write_private(&dir.join(MEMBER_KEY_FILE), key.serialize_pem().as_bytes())?;
        write_public(&dir.join(MEMBER_CERT_FILE), cert.pem().as_bytes())?;
        let ca_path = dir.join(CA_CERT_FILE);
        if !ca_path.exists() {
            write_public(&ca_path, self.cert_pem.as_bytes())?;
        }
        MemberIdentity::load(dir)
    }

    /// Issues a certificate and key for operator `name` and writes them into `dir` as
    /// `operator.pem` and `operator.key` (0600), with a copy of the CA certificate. Refuses a
    /// bad name before writing anything, and refuses to overwrite an existing key.
    pub fn issue_operator(&self, name: &str, dir: &Path) -> Result<OperatorIdentity, CaError> {
        let params = self.params(operator_params(name)?);
        fs::create_dir_all(dir).map_err(io_err(dir))?;
        let key = KeyPair::generate()?;
        let cert = params.signed_by(&key, &self.issuer)?;
        write_private(&dir.join(OPERATOR_KEY_FILE), key.serialize_pem().as_bytes())?;
        write_public(&dir.join(OPERATOR_CERT_FILE), cert.pem().as_bytes())?;
        write_public(&dir.join(CA_CERT_FILE), self.cert_pem.as_bytes())?;
        OperatorIdentity::load(dir)
    }

    /// Signs a certificate signing request as member `id`'s certificate. The id and names come
    /// from the CA, never from the request: only its public key is used.
    pub fn sign_request(&self, csr_pem: &str, id: NodeId) -> Result<String, CaError> {
        self.sign_for(csr_pem, &Principal::Member(id))
    }

    /// Signs a certificate signing request as `principal`'s certificate (a renewal: the caller
    /// proved it is `principal` with its current certificate). As with joins, only the
    /// request's public key is used.
    pub fn sign_for(&self, csr_pem: &str, principal: &Principal) -> Result<String, CaError> {
        let mut request = CertificateSigningRequestParams::from_pem(csr_pem)?;
        request.params = self.params(match principal {
            Principal::Member(id) => member_params(*id)?,
            Principal::Operator(name) => operator_params(name)?,
        });
        Ok(request.signed_by(&self.issuer)?.pem())
    }

    /// `params` valid for this CA's lifetime from now on.
    fn params(&self, mut params: CertificateParams) -> CertificateParams {
        set_validity(&mut params, self.lifetime);
        params
    }

    /// SHA-256 of the CA certificate's DER, hex: what a join token pins.
    pub fn fingerprint(&self) -> Result<String, CaError> {
        let der =
            CertificateDer::from_pem_slice(self.cert_pem.as_bytes()).map_err(|e| CaError::Pem {
                path: PathBuf::from(CA_CERT_FILE),
                what: "certificate",
                detail: e.to_string(),
            })?;
        Ok(sha256_hex(&der))
    }
}

/// SHA-256 of `bytes` as lowercase hex.
pub fn sha256_hex(bytes: &[u8]) -> String {
    ring::digest::digest(&ring::digest::SHA256, bytes)
        .as_ref()
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}

/// A member's TLS identity: its certificate chain, its key and the CA it trusts.
pub struct MemberIdentity {
    pub id: NodeId,
    pub ca: CertificateDer<'static>,
    pub cert: CertificateDer<'static>,
    pub key: PrivateKeyDer<'static>,
}

impl std::fmt::Debug for MemberIdentity {
    /// Never prints the key.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MemberIdentity")
            .field("id", &self.id)
            .finish_non_exhaustive()
    }
}

impl Clone for MemberIdentity {
    fn clone(&self) -> Self {
        Self {
            id: self.id,
            ca: self.ca.clone(),
            cert: self.cert.clone(),
            key: self.key.clone_key(),
        }
    }
}

impl MemberIdentity {
    /// The certificate chain and key, as the QUIC configurations take them.
    pub fn chain(&self) -> strata_quic::Chain<'_> {
        strata_quic::Chain {
            ca: &self.ca,
            cert: &self.cert,
            key: &self.key,
        }
    }

    /// This identity as one whose certificate a renewal can replace under running endpoints.
    pub fn live(&self) -> Result<std::sync::Arc<strata_quic::LiveIdentity>, strata_quic::TlsError> {
        strata_quic::LiveIdentity::new(self.chain())
    }

    /// Loads `ca.pem`, `member.pem` and `member.key` from `dir`, checking that the key
    /// belongs to the certificate and that the certificate names a member id.
    pub fn load(dir: &Path) -> Result<Self, CaError> {
        let (ca, cert, key) = load_chain(dir, MEMBER_CERT_FILE, MEMBER_KEY_FILE)?;
        let id = member_id(&cert)?;
        Ok(Self { id, ca, cert, key })
    }
}

/// An operator's TLS identity: what `cluster operator` writes and the operator commands load.
pub struct OperatorIdentity {
    pub name: String,
    pub ca: CertificateDer<'static>,
    pub cert: CertificateDer<'static>,
    pub key: PrivateKeyDer<'static>,
}

impl std::fmt::Debug for OperatorIdentity {
    /// Never prints the key.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("OperatorIdentity")
            .field("name", &self.name)
            .finish_non_exhaustive()
    }
}

impl OperatorIdentity {
    /// The certificate chain and key, as the QUIC configurations take them.
    pub fn chain(&self) -> strata_quic::Chain<'_> {
        strata_quic::Chain {
            ca: &self.ca,
            cert: &self.cert,
            key: &self.key,
        }
    }

    /// This identity as one whose certificate a renewal can replace under running endpoints.
    pub fn live(&self) -> Result<std::sync::Arc<strata_quic::LiveIdentity>, strata_quic::TlsError> {
        strata_quic::LiveIdentity::new(self.chain())
    }

    /// Loads `ca.pem`, `operator.pem` and `operator.key` from `dir`, checking that the key
    /// belongs to the certificate and that the certificate names an operator.
    pub fn load(dir: &Path) -> Result<Self, CaError> {
        let (ca, cert, key) = load_chain(dir, OPERATOR_CERT_FILE, OPERATOR_KEY_FILE)?;
        let name = operator_name(&cert)?;
        Ok(Self {
            name,
            ca,
            cert,
            key,
        })
    }
}

type Chain = (
    CertificateDer<'static>,
    CertificateDer<'static>,
    PrivateKeyDer<'static>,
);

/// Loads the CA certificate, a certificate and its key from `dir`, checking that the key
/// belongs to the certificate.
fn load_chain(dir: &Path, cert_file: &str, key_file: &str) -> Result<Chain, CaError> {
    let ca_path = dir.join(CA_CERT_FILE);
    let cert_path = dir.join(cert_file);
    let key_path = dir.join(key_file);
    let ca = CertificateDer::from_pem_slice(read_text(&ca_path)?.as_bytes())
        .map_err(|e| pem_err(&ca_path, "certificate")(e.to_string()))?;
    let cert = CertificateDer::from_pem_slice(read_text(&cert_path)?.as_bytes())
        .map_err(|e| pem_err(&cert_path, "certificate")(e.to_string()))?;
    let key_pem = read_text(&key_path)?;
    let key = PrivateKeyDer::from_pem_slice(key_pem.as_bytes())
        .map_err(|e| pem_err(&key_path, "private key")(e.to_string()))?;
    let pair = KeyPair::from_pem(&key_pem)
        .map_err(|e| pem_err(&key_path, "private key")(e.to_string()))?;
    let (_, parsed) = x509_parser::parse_x509_certificate(&cert)
        .map_err(|e| pem_err(&cert_path, "certificate")(e.to_string()))?;
    if parsed.public_key().subject_public_key.data.as_ref() != pair.public_key_raw() {
        return Err(CaError::Mismatch {
            cert: cert_path,
            key: key_path,
        });
    }
    Ok((ca, cert, key))
}

/// Who a certificate of the cluster CA speaks for.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Principal {
    Member(NodeId),
    Operator(String),
}

impl Principal {
    /// What `cert` names; `None` for a certificate naming neither or, since the CA never
    /// issues one, both.
    pub fn of(cert: &CertificateDer<'_>) -> Option<Self> {
        match (member_id(cert), operator_name(cert)) {
            (Ok(id), Err(_)) => Some(Principal::Member(id)),
            (Err(_), Ok(name)) => Some(Principal::Operator(name)),
            _ => None,
        }
    }
}

impl std::fmt::Display for Principal {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Principal::Member(id) => write!(f, "member {id}"),
            Principal::Operator(name) => write!(f, "operator {name}"),
        }
    }
}

/// The DNS names in a certificate's subject alternative names.
fn dns_names(cert: &CertificateDer<'_>) -> Vec<String> {
    let Ok((_, parsed)) = x509_parser::parse_x509_certificate(cert) else {
        return Vec::new();
    };
    let Ok(Some(san)) = parsed.subject_alternative_name() else {
        return Vec::new();
    };
    san.value
        .general_names
        .iter()
        .filter_map(|name| match name {
            x509_parser::extensions::GeneralName::DNSName(dns) => Some(dns.to_string()),
            _ => None,
        })
        .collect()
}

/// The operator a certificate names in its `operator-<name>.strata` DNS name.
pub fn operator_name(cert: &CertificateDer<'_>) -> Result<String, CaError> {
    dns_names(cert)
        .iter()
        .find_map(|dns| {
            let name = dns.strip_prefix("operator-")?.strip_suffix(".strata")?;
            check_operator_name(name).ok().map(|()| name.to_string())
        })
        .ok_or(CaError::NoOperator)
}

/// The member id a certificate names in its `member-<id>.strata` DNS name.
pub fn member_id(cert: &CertificateDer<'_>) -> Result<NodeId, CaError> {
    dns_names(cert)
        .iter()
        .find_map(|dns| {
            dns.strip_prefix("member-")?
                .strip_suffix(".strata")?
                .parse()
                .ok()
        })
        .ok_or(CaError::NoMemberId)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_member_certificate_names_its_id_and_loads_back() {
        let dir = tempfile::tempdir().unwrap();
        let ca = ClusterCa::create(&dir.path().join("ca")).unwrap();
        let identity = ca.issue_member(7, &dir.path().join("m7")).unwrap();
        assert_eq!(identity.id, 7);
        assert_eq!(member_id(&identity.cert).unwrap(), 7);
        let again = ClusterCa::load(&dir.path().join("ca")).unwrap();
        assert_eq!(again.fingerprint().unwrap(), ca.fingerprint().unwrap());
        #[cfg(unix)]
        {
            use std::os::unix::fs::PermissionsExt;
            let mode = fs::metadata(dir.path().join("ca").join(CA_KEY_FILE))
                .unwrap()
                .permissions()
                .mode();
            assert_eq!(mode & 0o777, 0o600);
        }
    }

    #[test]
    fn loading_reports_missing_and_mismatched_files() {
        let dir = tempfile::tempdir().unwrap();
        assert!(matches!(
            ClusterCa::load(dir.path()),
            Err(CaError::Io { .. })
        ));
        ClusterCa::create(&dir.path().join("a")).unwrap();
        ClusterCa::create(&dir.path().join("b")).unwrap();
        assert!(matches!(
            ClusterCa::create(&dir.path().join("a")),
            Err(CaError::Exists { .. })
        ));
        fs::copy(
            dir.path().join("b").join(CA_KEY_FILE),
            dir.path().join("a").join("other.key"),
        )
        .unwrap();
        fs::rename(
            dir.path().join("a").join("other.key"),
            dir.path().join("a").join(CA_KEY_FILE),
        )
        .unwrap();
        let err = ClusterCa::load(&dir.path().join("a")).err().unwrap();
        assert!(matches!(err, CaError::Mismatch { .. }), "{err}");
        fs::write(dir.path().join("b").join(CA_CERT_FILE), "garbage").unwrap();
        assert!(matches!(
            ClusterCa::load(&dir.path().join("b")),
            Err(CaError::Pem { .. })
        ));
    }

    #[test]
    fn a_signed_request_gets_the_id_the_ca_chose() {
        let dir = tempfile::tempdir().unwrap();
        let ca = ClusterCa::create(dir.path()).unwrap();
        let key = KeyPair::generate().unwrap();
        // The request claims member 99; the CA decides.
        let csr = CertificateParams::new(vec![member_dns_name(99)])
            .unwrap()
            .serialize_request(&key)
            .unwrap()
            .pem()
            .unwrap();
        let pem = ca.sign_request(&csr, 4).unwrap();
        let der = CertificateDer::from_pem_slice(pem.as_bytes()).unwrap();
        assert_eq!(member_id(&der).unwrap(), 4);
    }

    #[test]
    fn an_operator_certificate_names_its_operator_and_no_member() {
        let dir = tempfile::tempdir().unwrap();
        let ca = ClusterCa::create(&dir.path().join("ca")).unwrap();
        let operator = ca
            .issue_operator("alice", &dir.path().join("alice"))
            .unwrap();
        assert_eq!(operator.name, "alice");
        assert!(matches!(
            member_id(&operator.cert),
            Err(CaError::NoMemberId)
        ));
        assert_eq!(
            Principal::of(&operator.cert),
            Some(Principal::Operator("alice".into()))
        );
        let member = ca.issue_member(3, &dir.path().join("m3")).unwrap();
        assert_eq!(Principal::of(&member.cert), Some(Principal::Member(3)));
        assert!(matches!(
            operator_name(&member.cert),
            Err(CaError::NoOperator)
        ));
        // An operator directory is not a member's, nor the other way round.
        assert!(MemberIdentity::load(&dir.path().join("alice")).is_err());
        assert!(OperatorIdentity::load(&dir.path().join("m3")).is_err());
        // Issuing again into the same directory refuses to overwrite the key.
        assert!(matches!(
            ca.issue_operator("alice", &dir.path().join("alice")),
            Err(CaError::Exists { .. })
        ));
    }

    #[test]
    fn certificates_live_as_configured_and_come_due_with_a_third_left() {
        let dir = tempfile::tempdir().unwrap();
        let lifetime = Duration::from_secs(3_000);
        let ca = ClusterCa::create(&dir.path().join("ca"))
            .unwrap()
            .with_lifetime(lifetime)
            .unwrap();
        let member = ca.issue_member(2, &dir.path().join("m2")).unwrap();
        let validity = Validity::of(&member.cert).unwrap();
        let now = SystemTime::now();
        let end = validity.not_after.duration_since(now).unwrap();
        assert!(
            end <= lifetime && end > lifetime - Duration::from_secs(5),
            "{end:?}"
        );
        // Backdated a tenth of a short lifetime, a minute at most.
        assert_eq!(
            validity.lifetime(),
            lifetime + MAX_BACKDATE.min(lifetime / 10)
        );
        assert!(!validity.renewal_due(now));
        assert!(!validity.renewal_due(now + Duration::from_secs(1_700)));
        assert!(validity.renewal_due(now + Duration::from_secs(2_100)));
        assert!(!validity.expired(now + Duration::from_secs(2_990)));
        assert!(validity.expired(now + Duration::from_secs(3_001)));
        // An operator's renewal keeps its name; the default lifetime is 30 days.
        let default = ClusterCa::load(&dir.path().join("ca")).unwrap();
        assert_eq!(default.lifetime(), DEFAULT_CERT_LIFETIME);
        let key = KeyPair::generate().unwrap();
        let csr = CertificateParams::new(Vec::<String>::new())
            .unwrap()
            .serialize_request(&key)
            .unwrap()
            .pem()
            .unwrap();
        let alice = Principal::Operator("alice".into());
        let pem = default.sign_for(&csr, &alice).unwrap();
        let der = CertificateDer::from_pem_slice(pem.as_bytes()).unwrap();
        assert_eq!(Principal::of(&der), Some(alice));
        let days = Validity::of(&der).unwrap().lifetime().as_secs() / 86_400;
        assert_eq!(days, 30);
        assert!(matches!(
            default.with_lifetime(Duration::from_secs(9)),
            Err(CaError::ShortLifetime(_))
        ));
    }

    #[test]
    fn a_bad_operator_name_is_refused_before_anything_is_written() {
        let dir = tempfile::tempdir().unwrap();
        let ca = ClusterCa::create(&dir.path().join("ca")).unwrap();
        let long = "a".repeat(MAX_OPERATOR_NAME + 1);
        for bad in [
            "", "Alice", "al ice", "-alice", "alice-", "7alice", "a.b", &long,
        ] {
            let out = dir.path().join("out");
            let err = ca.issue_operator(bad, &out).err().unwrap();
            assert!(matches!(err, CaError::BadOperatorName(_)), "{bad:?}: {err}");
            assert!(!out.exists(), "{bad:?} wrote {}", out.display());
        }
        for good in ["alice", "ops-2", "b"] {
            check_operator_name(good).unwrap();
        }
    }
}
