//! TLS for the QUIC endpoints: TLS 1.3 only, the ring provider, the cluster CA as the only
//! root on both sides.
//!
//! The member endpoint requires a client certificate chained to the cluster CA
//! (`WebPkiClientVerifier` without `allow_unauthenticated`), so a peer with no certificate or
//! one from another CA fails the handshake. The join endpoint authenticates only the server:
//! a joiner has no certificate yet and checks the member's chain against the CA fingerprint
//! its token pins.

use std::sync::Arc;
use std::time::Duration;

use quinn::crypto::rustls::{QuicClientConfig, QuicServerConfig};
use rustls::RootCertStore;
use rustls::client::danger::{HandshakeSignatureValid, ServerCertVerified, ServerCertVerifier};
use rustls::crypto::CryptoProvider;
use rustls::pki_types::{CertificateDer, ServerName, UnixTime};
use rustls::server::WebPkiClientVerifier;
use rustls::{DigitallySignedStruct, SignatureScheme};

use super::ca::{MemberIdentity, OperatorIdentity, sha256_hex};

/// The application protocol both sides must agree on.
pub const ALPN: &[u8] = b"strata-topology/1";

/// How long a connection with no traffic lives; keep-alives are sent well within it.
const IDLE_TIMEOUT: Duration = Duration::from_secs(10);
const KEEP_ALIVE: Duration = Duration::from_secs(2);

#[derive(Debug, thiserror::Error)]
pub enum TlsError {
    #[error("TLS configuration: {0}")]
    Rustls(#[from] rustls::Error),
    #[error("client certificate verifier: {0}")]
    Verifier(#[from] rustls::server::VerifierBuilderError),
    #[error("QUIC crypto configuration: {0}")]
    Quic(String),
}

fn provider() -> Arc<CryptoProvider> {
    Arc::new(rustls::crypto::ring::default_provider())
}

fn roots(ca: &CertificateDer<'static>) -> Result<Arc<RootCertStore>, TlsError> {
    let mut roots = RootCertStore::empty();
    roots.add(ca.clone())?;
    Ok(Arc::new(roots))
}

fn transport() -> Arc<quinn::TransportConfig> {
    let mut transport = quinn::TransportConfig::default();
    // The conversion cannot fail for a duration this small (it is below 2^62 µs).
    transport.max_idle_timeout(quinn::IdleTimeout::try_from(IDLE_TIMEOUT).ok());
    transport.keep_alive_interval(Some(KEEP_ALIVE));
    Arc::new(transport)
}

fn server(
    identity: &MemberIdentity,
    verifier: Arc<dyn rustls::server::danger::ClientCertVerifier>,
) -> Result<quinn::ServerConfig, TlsError> {
    let mut tls = rustls::ServerConfig::builder_with_provider(provider())
        .with_protocol_versions(&[&rustls::version::TLS13])?
        .with_client_cert_verifier(verifier)
        .with_single_cert(
            vec![identity.cert.clone(), identity.ca.clone()],
            identity.key.clone_key(),
        )?;
    tls.alpn_protocols = vec![ALPN.to_vec()];
    let crypto = QuicServerConfig::try_from(tls).map_err(|e| TlsError::Quic(e.to_string()))?;
    let mut config = quinn::ServerConfig::with_crypto(Arc::new(crypto));
    config.transport_config(transport());
    Ok(config)
}

/// The member endpoint: mutual TLS with the cluster CA.
pub fn member_server_config(identity: &MemberIdentity) -> Result<quinn::ServerConfig, TlsError> {
    let verifier =
        WebPkiClientVerifier::builder_with_provider(roots(&identity.ca)?, provider()).build()?;
    server(identity, verifier)
}

/// The join endpoint: the member authenticates itself; the joiner presents no certificate.
pub fn join_server_config(identity: &MemberIdentity) -> Result<quinn::ServerConfig, TlsError> {
    server(identity, WebPkiClientVerifier::no_client_auth())
}

fn client(tls: rustls::ClientConfig) -> Result<quinn::ClientConfig, TlsError> {
    let mut tls = tls;
    tls.alpn_protocols = vec![ALPN.to_vec()];
    let crypto = QuicClientConfig::try_from(tls).map_err(|e| TlsError::Quic(e.to_string()))?;
    let mut config = quinn::ClientConfig::new(Arc::new(crypto));
    config.transport_config(transport());
    Ok(config)
}

/// A member (or an operator's CLI holding a member's identity) dialing members.
pub fn member_client_config(identity: &MemberIdentity) -> Result<quinn::ClientConfig, TlsError> {
    authenticated_client(&identity.ca, &identity.cert, &identity.key)
}

/// An operator's CLI dialing members with the operator's own certificate.
pub fn operator_client_config(
    identity: &OperatorIdentity,
) -> Result<quinn::ClientConfig, TlsError> {
    authenticated_client(&identity.ca, &identity.cert, &identity.key)
}

fn authenticated_client(
    ca: &CertificateDer<'static>,
    cert: &CertificateDer<'static>,
    key: &rustls::pki_types::PrivateKeyDer<'static>,
) -> Result<quinn::ClientConfig, TlsError> {
    let tls = rustls::ClientConfig::builder_with_provider(provider())
        .with_protocol_versions(&[&rustls::version::TLS13])?
        .with_root_certificates(roots(ca)?)
        .with_client_auth_cert(vec![cert.clone(), ca.clone()], key.clone_key())?;
    client(tls)
}

/// A client that verifies members against `ca` but has no certificate of its own.
pub fn anonymous_client_config(
    ca: &CertificateDer<'static>,
) -> Result<quinn::ClientConfig, TlsError> {
    let tls = rustls::ClientConfig::builder_with_provider(provider())
        .with_protocol_versions(&[&rustls::version::TLS13])?
        .with_root_certificates(roots(ca)?)
        .with_no_client_auth();
    client(tls)
}

/// A joiner: trusts a member whose chain includes the CA certificate with this SHA-256.
pub fn pinned_client_config(ca_fingerprint: &str) -> Result<quinn::ClientConfig, TlsError> {
    let verifier = PinnedCaVerifier {
        fingerprint: ca_fingerprint.to_ascii_lowercase(),
        provider: provider(),
    };
    let tls = rustls::ClientConfig::builder_with_provider(provider())
        .with_protocol_versions(&[&rustls::version::TLS13])?
        .dangerous()
        .with_custom_certificate_verifier(Arc::new(verifier))
        .with_no_client_auth();
    client(tls)
}

/// Verifies a server chain against the CA it carries, once that CA's fingerprint matches the
/// pinned one: the usual WebPKI checks with the pinned CA as the only root.
#[derive(Debug)]
struct PinnedCaVerifier {
    fingerprint: String,
    provider: Arc<CryptoProvider>,
}

impl ServerCertVerifier for PinnedCaVerifier {
    fn verify_server_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        intermediates: &[CertificateDer<'_>],
        server_name: &ServerName<'_>,
        ocsp_response: &[u8],
        now: UnixTime,
    ) -> Result<ServerCertVerified, rustls::Error> {
        let ca = intermediates
            .iter()
            .find(|c| sha256_hex(c) == self.fingerprint)
            .ok_or_else(|| {
                rustls::Error::General("the member's chain lacks the pinned cluster CA".into())
            })?;
        let roots =
            roots(&ca.clone().into_owned()).map_err(|e| rustls::Error::General(e.to_string()))?;
        let inner = rustls::client::WebPkiServerVerifier::builder_with_provider(
            roots,
            self.provider.clone(),
        )
        .build()
        .map_err(|e| rustls::Error::General(e.to_string()))?;
        inner.verify_server_cert(end_entity, intermediates, server_name, ocsp_response, now)
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls12_signature(
            message,
            cert,
            dss,
            &self.provider.signature_verification_algorithms,
        )
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls13_signature(
            message,
            cert,
            dss,
            &self.provider.signature_verification_algorithms,
        )
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.provider
            .signature_verification_algorithms
            .supported_schemes()
    }
}
