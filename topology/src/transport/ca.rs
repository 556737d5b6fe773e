//! The cluster certificate authority and member identities.
//!
//! `cluster init` makes a CA (a self-signed ECDSA P-256 certificate) and every member holds a
//! certificate it issued. A member certificate names its member id twice: in the subject's
//! common name and in a DNS subject alternative name `member-<id>.strata`, the one the transport
//! reads back after a handshake to learn who the peer is. Every member certificate also carries
//! [`SERVER_NAME`], the name clients verify when they dial a member whose id they do not know.

use std::fs;
use std::io::Write;
use std::path::{Path, PathBuf};

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
    #[error("the certificate names no strata member id")]
    NoMemberId,
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

/// The cluster CA: its certificate, and its key where this member holds it.
pub struct ClusterCa {
    cert_pem: String,
    issuer: Issuer<'static, KeyPair>,
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
        Ok(Self { cert_pem, issuer })
    }

    pub fn cert_pem(&self) -> &str {
        &self.cert_pem
    }

    /// Issues a certificate and key for member `id` and writes them into `dir` as
    /// `member.pem` and `member.key` (0600), with a copy of the CA certificate.
    pub fn issue_member(&self, id: NodeId, dir: &Path) -> Result<MemberIdentity, CaError> {
        fs::create_dir_all(dir).map_err(io_err(dir))?;
        let key = KeyPair::generate()?;
        let cert = member_params(id)?.signed_by(&key, &self.issuer)?;
        write_private(&dir.join(MEMBER_KEY_FILE), key.serialize_pem().as_bytes())?;
        write_public(&dir.join(MEMBER_CERT_FILE), cert.pem().as_bytes())?;
        let ca_path = dir.join(CA_CERT_FILE);
        if !ca_path.exists() {
            write_public(&ca_path, self.cert_pem.as_bytes())?;
        }
        MemberIdentity::load(dir)
    }

    /// Signs a certificate signing request as member `id`'s certificate. The id and names come
    /// from the CA, never from the request: only its public key is used.
    pub fn sign_request(&self, csr_pem: &str, id: NodeId) -> Result<String, CaError> {
        let mut request = CertificateSigningRequestParams::from_pem(csr_pem)?;
        request.params = member_params(id)?;
        Ok(request.signed_by(&self.issuer)?.pem())
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
    /// Loads `ca.pem`, `member.pem` and `member.key` from `dir`, checking that the key
    /// belongs to the certificate and that the certificate names a member id.
    pub fn load(dir: &Path) -> Result<Self, CaError> {
        let ca_path = dir.join(CA_CERT_FILE);
        let cert_path = dir.join(MEMBER_CERT_FILE);
        let key_path = dir.join(MEMBER_KEY_FILE);
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
        let id = member_id(&cert)?;
        Ok(Self { id, ca, cert, key })
    }
}

/// The member id a certificate names in its `member-<id>.strata` DNS name.
pub fn member_id(cert: &CertificateDer<'_>) -> Result<NodeId, CaError> {
    let (_, parsed) = x509_parser::parse_x509_certificate(cert).map_err(|_| CaError::NoMemberId)?;
    let san = parsed
        .subject_alternative_name()
        .map_err(|_| CaError::NoMemberId)?
        .ok_or(CaError::NoMemberId)?;
    san.value
        .general_names
        .iter()
        .find_map(|name| match name {
            x509_parser::extensions::GeneralName::DNSName(dns) => dns
                .strip_prefix("member-")
                .and_then(|rest| rest.strip_suffix(".strata"))
                .and_then(|id| id.parse().ok()),
            _ => None,
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
}
