//! TLS for strata's QUIC endpoints: TLS 1.3 only, the ring provider, the cluster CA as the only
//! root on both sides, one ALPN per service.
//!
//! A server asking for client certificates ([`mutual_server_config`]) fails the handshake of a
//! peer with none, or with one from another CA (`WebPkiClientVerifier` without
//! `allow_unauthenticated`). [`server_only_config`] asks for none: for callers that have no
//! certificate yet (a joiner).

use std::sync::{Arc, PoisonError, RwLock};
use std::time::Duration;

use quinn::crypto::rustls::{QuicClientConfig, QuicServerConfig};
use rustls::RootCertStore;
use rustls::client::ResolvesClientCert;
use rustls::crypto::CryptoProvider;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use rustls::server::{ClientHello, ResolvesServerCert, WebPkiClientVerifier};
use rustls::sign::CertifiedKey;

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

/// A certificate issued by the cluster CA, its key, and the CA certificate.
#[derive(Clone, Copy)]
pub struct Chain<'a> {
    pub ca: &'a CertificateDer<'static>,
    pub cert: &'a CertificateDer<'static>,
    pub key: &'a PrivateKeyDer<'static>,
}

/// A certificate and key that can be replaced while endpoints use them: every configuration
/// built from one ([`live_server_config`], [`live_client_config`]) presents whichever is current
/// at each handshake, so a renewed certificate needs no new endpoint. The CA stays the same.
#[derive(Debug)]
pub struct LiveIdentity {
    ca: CertificateDer<'static>,
    current: RwLock<Arc<CertifiedKey>>,
}

impl LiveIdentity {
    pub fn new(chain: Chain<'_>) -> Result<Arc<Self>, TlsError> {
        Ok(Arc::new(Self {
            ca: chain.ca.clone(),
            current: RwLock::new(certified(chain)?),
        }))
    }

    /// Presents `chain` from the next handshake on; connections already open keep theirs.
    pub fn replace(&self, chain: Chain<'_>) -> Result<(), TlsError> {
        let next = certified(chain)?;
        *self.current.write().unwrap_or_else(PoisonError::into_inner) = next;
        Ok(())
    }

    /// The certificate presented now.
    pub fn cert(&self) -> CertificateDer<'static> {
        self.key().cert[0].clone()
    }

    fn key(&self) -> Arc<CertifiedKey> {
        self.current
            .read()
            .unwrap_or_else(PoisonError::into_inner)
            .clone()
    }
}

fn certified(chain: Chain<'_>) -> Result<Arc<CertifiedKey>, TlsError> {
    let key = provider()
        .key_provider
        .load_private_key(chain.key.clone_key())?;
    Ok(Arc::new(CertifiedKey::new(
        vec![chain.cert.clone(), chain.ca.clone()],
        key,
    )))
}

impl ResolvesServerCert for LiveIdentity {
    fn resolve(&self, _hello: ClientHello<'_>) -> Option<Arc<CertifiedKey>> {
        Some(self.key())
    }
}

impl ResolvesClientCert for LiveIdentity {
    fn resolve(
        &self,
        _root_hint_subjects: &[&[u8]],
        _sigschemes: &[rustls::SignatureScheme],
    ) -> Option<Arc<CertifiedKey>> {
        Some(self.key())
    }

    fn has_certs(&self) -> bool {
        true
    }
}

/// The crypto provider every endpoint uses.
pub fn provider() -> Arc<CryptoProvider> {
    Arc::new(rustls::crypto::ring::default_provider())
}

/// A root store holding `ca` alone.
pub fn roots(ca: &CertificateDer<'static>) -> Result<Arc<RootCertStore>, TlsError> {
    let mut roots = RootCertStore::empty();
    roots.add(ca.clone())?;
    Ok(Arc::new(roots))
}

fn transport() -> Arc<quinn::TransportConfig> {
    liveness(IDLE_TIMEOUT, KEEP_ALIVE)
}

fn liveness(idle: Duration, keep_alive: Duration) -> Arc<quinn::TransportConfig> {
    let mut transport = quinn::TransportConfig::default();
    // The conversion cannot fail for durations this small (below 2^62 µs).
    transport.max_idle_timeout(quinn::IdleTimeout::try_from(idle).ok());
    transport.keep_alive_interval(Some(keep_alive));
    Arc::new(transport)
}

/// Makes connections dialed with `config` end after `idle` without a packet from the peer
/// (keep-alives every `keep_alive` on both sides keep a live one open): how soon a hung peer is
/// noticed. QUIC takes the smaller of the two sides' idle timeouts.
pub fn set_liveness(config: &mut quinn::ClientConfig, idle: Duration, keep_alive: Duration) {
    config.transport_config(liveness(idle, keep_alive));
}

fn server(
    identity: &Arc<LiveIdentity>,
    verifier: Arc<dyn rustls::server::danger::ClientCertVerifier>,
    alpn: &[u8],
) -> Result<quinn::ServerConfig, TlsError> {
    let mut tls = rustls::ServerConfig::builder_with_provider(provider())
        .with_protocol_versions(&[&rustls::version::TLS13])?
        .with_client_cert_verifier(verifier)
        .with_cert_resolver(identity.clone());
    // No session resumption: a resumed session skips verifying the client's certificate, which
    // would let one that has since expired open new connections. Connections are long-lived and
    // pooled, so a full handshake each time costs little.
    tls.session_storage = Arc::new(rustls::server::NoServerSessionStorage {});
    tls.send_tls13_tickets = 0;
    tls.alpn_protocols = vec![alpn.to_vec()];
    let crypto = QuicServerConfig::try_from(tls).map_err(|e| TlsError::Quic(e.to_string()))?;
    let mut config = quinn::ServerConfig::with_crypto(Arc::new(crypto));
    config.transport_config(transport());
    Ok(config)
}

/// A server presenting `chain` and requiring a client certificate chained to its CA.
pub fn mutual_server_config(
    chain: Chain<'_>,
    alpn: &[u8],
) -> Result<quinn::ServerConfig, TlsError> {
    live_server_config(&LiveIdentity::new(chain)?, alpn)
}

/// A server presenting `identity`'s current certificate and requiring a client certificate
/// chained to its CA.
pub fn live_server_config(
    identity: &Arc<LiveIdentity>,
    alpn: &[u8],
) -> Result<quinn::ServerConfig, TlsError> {
    let verifier =
        WebPkiClientVerifier::builder_with_provider(roots(&identity.ca)?, provider()).build()?;
    server(identity, verifier, alpn)
}

/// A server presenting `identity`'s current certificate that asks its clients for none.
pub fn server_only_config(
    identity: &Arc<LiveIdentity>,
    alpn: &[u8],
) -> Result<quinn::ServerConfig, TlsError> {
    server(identity, WebPkiClientVerifier::no_client_auth(), alpn)
}

/// A QUIC client configuration from a finished rustls one: `alpn` and the shared transport
/// settings added.
pub fn client_config_from(
    tls: rustls::ClientConfig,
    alpn: &[u8],
) -> Result<quinn::ClientConfig, TlsError> {
    let mut tls = tls;
    tls.alpn_protocols = vec![alpn.to_vec()];
    let crypto = QuicClientConfig::try_from(tls).map_err(|e| TlsError::Quic(e.to_string()))?;
    let mut config = quinn::ClientConfig::new(Arc::new(crypto));
    config.transport_config(transport());
    Ok(config)
}

/// A client verifying servers against `ca`, presenting `chain` when the server asks.
pub fn mutual_client_config(
    chain: Chain<'_>,
    alpn: &[u8],
) -> Result<quinn::ClientConfig, TlsError> {
    live_client_config(&LiveIdentity::new(chain)?, alpn)
}

/// A client verifying servers against `identity`'s CA, presenting its current certificate when
/// the server asks.
pub fn live_client_config(
    identity: &Arc<LiveIdentity>,
    alpn: &[u8],
) -> Result<quinn::ClientConfig, TlsError> {
    let tls = rustls::ClientConfig::builder_with_provider(provider())
        .with_protocol_versions(&[&rustls::version::TLS13])?
        .with_root_certificates(roots(&identity.ca)?)
        .with_client_cert_resolver(identity.clone());
    client_config_from(tls, alpn)
}

/// A client verifying servers against `ca` with no certificate of its own.
pub fn anonymous_client_config(
    ca: &CertificateDer<'static>,
    alpn: &[u8],
) -> Result<quinn::ClientConfig, TlsError> {
    let tls = rustls::ClientConfig::builder_with_provider(provider())
        .with_protocol_versions(&[&rustls::version::TLS13])?
        .with_root_certificates(roots(ca)?)
        .with_no_client_auth();
    client_config_from(tls, alpn)
}
