//! The topology transport: QUIC (quinn) with mutual TLS from the cluster CA.
//!
//! - [`ca`]: the cluster CA, member and operator identities (the member id or operator name
//!   lives in the certificate).
//! - [`tls`]: rustls configurations — mutual TLS for members, server-only TLS for joiners.
//! - [`wire`]: requests, responses and their length-prefixed JSON frames.
//! - [`service`]: the member side; [`client`]: the calling side.
//! - [`raft_network`]: openraft's `RaftNetworkFactory` over the client.
//! - [`join`]: admitting a member with a one-use token.
//! - [`renew`]: certificates renewed before they expire.
//!
//! One bidirectional stream carries one call. Raft RPCs and client calls share the member
//! endpoint; joins have their own endpoint because a joiner has no certificate yet, and the
//! member endpoint refuses every peer without one at the handshake.

pub mod ca;
pub mod client;
pub mod join;
pub mod raft_guard;
pub mod raft_network;
pub mod renew;
pub mod service;
pub mod tls;
pub mod wire;

use std::net::SocketAddr;
use std::sync::Arc;

use strata_quic::LiveIdentity;

pub use ca::{CaError, ClusterCa, MemberIdentity, OperatorIdentity, Principal};
pub use client::{Client, ClientError, Subscription};
pub use raft_network::QuicNetworkFactory;
pub use service::{Service, serve};
pub use tls::TlsError;

#[derive(Debug, thiserror::Error)]
pub enum EndpointError {
    #[error(transparent)]
    Tls(#[from] TlsError),
    #[error("cannot listen on {addr}: {source}")]
    Bind {
        addr: SocketAddr,
        source: std::io::Error,
    },
}

/// The member endpoint on `listen`: accepts members (mutual TLS) and dials them as `identity`
/// (whichever certificate it holds at each handshake).
pub fn member_endpoint(
    listen: SocketAddr,
    identity: &Arc<LiveIdentity>,
) -> Result<quinn::Endpoint, EndpointError> {
    let bind = |source| EndpointError::Bind {
        addr: listen,
        source,
    };
    member_endpoint_on(std::net::UdpSocket::bind(listen).map_err(bind)?, identity)
}

/// [`member_endpoint`] on a socket bound beforehand (a joiner holds its address while it asks
/// to be admitted, so that a group never admits a member that cannot listen).
pub fn member_endpoint_on(
    socket: std::net::UdpSocket,
    identity: &Arc<LiveIdentity>,
) -> Result<quinn::Endpoint, EndpointError> {
    let addr = socket
        .local_addr()
        .unwrap_or_else(|_| SocketAddr::from(([0, 0, 0, 0], 0)));
    let bind = |source| EndpointError::Bind { addr, source };
    let runtime = quinn::default_runtime().ok_or_else(|| {
        bind(std::io::Error::other(
            "no async runtime to drive the endpoint",
        ))
    })?;
    let mut endpoint = quinn::Endpoint::new(
        quinn::EndpointConfig::default(),
        Some(tls::member_server_config(identity)?),
        socket,
        runtime,
    )
    .map_err(bind)?;
    endpoint.set_default_client_config(tls::member_client_config(identity)?);
    Ok(endpoint)
}

/// The join endpoint on `listen`: server-authenticated TLS, serving only joins.
pub fn join_endpoint(
    listen: SocketAddr,
    identity: &Arc<LiveIdentity>,
) -> Result<quinn::Endpoint, EndpointError> {
    quinn::Endpoint::server(tls::join_server_config(identity)?, listen).map_err(|source| {
        EndpointError::Bind {
            addr: listen,
            source,
        }
    })
}

/// A dial-only endpoint for tools that hold a member identity.
pub fn client_endpoint(
    identity: &MemberIdentity,
    local: SocketAddr,
) -> Result<quinn::Endpoint, EndpointError> {
    dial_only(local, tls::member_client_config(&identity.live()?)?)
}

/// A dial-only endpoint for a long-running process (a router, a node) presenting `identity`
/// as it is at each handshake, member's or operator's: renewals need no new endpoint.
pub fn live_client_endpoint(
    identity: &Arc<LiveIdentity>,
    local: SocketAddr,
) -> Result<quinn::Endpoint, EndpointError> {
    dial_only(local, tls::member_client_config(identity)?)
}

/// A dial-only endpoint for an operator's tools, holding the operator's own identity.
pub fn operator_endpoint(
    identity: &OperatorIdentity,
    local: SocketAddr,
) -> Result<quinn::Endpoint, EndpointError> {
    dial_only(local, tls::operator_client_config(identity)?)
}

fn dial_only(
    local: SocketAddr,
    config: quinn::ClientConfig,
) -> Result<quinn::Endpoint, EndpointError> {
    let mut endpoint = quinn::Endpoint::client(local).map_err(|source| EndpointError::Bind {
        addr: local,
        source,
    })?;
    endpoint.set_default_client_config(config);
    Ok(endpoint)
}

/// Turns a dial-only endpoint (a joiner's, before it had a certificate) into a member
/// endpoint on the same socket, so that the address it announced stays valid.
pub fn upgrade_to_member(
    endpoint: &mut quinn::Endpoint,
    identity: &MemberIdentity,
) -> Result<(), EndpointError> {
    let live = identity.live()?;
    endpoint.set_server_config(Some(tls::member_server_config(&live)?));
    endpoint.set_default_client_config(tls::member_client_config(&live)?);
    Ok(())
}
