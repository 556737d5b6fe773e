//! TLS for the QUIC endpoints: TLS 1.3 only, the ring provider, the cluster CA as the only
//! root on both sides.
//!
//! The member endpoint requires a client certificate chained to the cluster CA
//! (`WebPkiClientVerifier` without `allow_unauthenticated`), so a peer with no certificate or
//! one from another CA fails the handshake. The join endpoint authenticates only the server:
//! a joiner has no certificate yet and checks the member's chain against the CA fingerprint
//! its token pins.

use std::sync::Arc;

use rustls::client::danger::{HandshakeSignatureValid, ServerCertVerified, ServerCertVerifier};
use rustls::crypto::CryptoProvider;
use rustls::pki_types::{CertificateDer, ServerName, UnixTime};
use rustls::{DigitallySignedStruct, SignatureScheme};
pub use strata_quic::tls::TlsError;
use strata_quic::tls::{self as quic, LiveIdentity, client_config_from, provider, roots};

use super::ca::{OperatorIdentity, sha256_hex};

/// The application protocol both sides must agree on.
pub const ALPN: &[u8] = b"strata-topology/1";

/// The member endpoint: mutual TLS with the cluster CA, presenting the member's current
/// certificate (renewals swap it in `identity`).
pub fn member_server_config(identity: &Arc<LiveIdentity>) -> Result<quinn::ServerConfig, TlsError> {
    quic::live_server_config(identity, ALPN)
}

/// The join endpoint: the member authenticates itself; the joiner presents no certificate.
pub fn join_server_config(identity: &Arc<LiveIdentity>) -> Result<quinn::ServerConfig, TlsError> {
    quic::server_only_config(identity, ALPN)
}

/// A member (or an operator's CLI holding a member's identity) dialing members.
pub fn member_client_config(identity: &Arc<LiveIdentity>) -> Result<quinn::ClientConfig, TlsError> {
    quic::live_client_config(identity, ALPN)
}

/// An operator's CLI dialing members with the operator's own certificate.
pub fn operator_client_config(
    identity: &OperatorIdentity,
) -> Result<quinn::ClientConfig, TlsError> {
    quic::mutual_client_config(identity.chain(), ALPN)
}

/// A client that verifies members against `ca` but has no certificate of its own.
pub fn anonymous_client_config(
    ca: &CertificateDer<'static>,
) -> Result<quinn::ClientConfig, TlsError> {
    quic::anonymous_client_config(ca, ALPN)
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
    client_config_from(tls, ALPN)
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
