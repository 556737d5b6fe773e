//! A member process: its raft node, the QUIC endpoints, the lease driver and the renewal of
//! its own lease, started together and stopped together.
//!
//! [`run`] is the whole life of a member: start, serve until SIGTERM or ctrl-c, stop. The
//! pieces are public so that `cluster init` can bootstrap a new group between start and serve.

pub mod config;

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use openraft::{BasicNode, ServerState};
use tokio::task::JoinHandle;

pub use config::{DataLayout, SNAPSHOT_CHUNK_BYTES, ServerConfig, Timing};

use crate::election::{self, LeaderContact};
use crate::lease_driver::{Clock, LeaseDriver, SystemClock};
use crate::state::{Change, Command, DEFAULT_JOIN_TOKEN_TTL_MS, MemberSpec};
use crate::store::{self, StateReader, StoreError};
use crate::transport::ca::{CA_KEY_FILE, DEFAULT_CERT_LIFETIME};
use crate::transport::client::commit_via_leader;
use crate::transport::join::JoinAuthority;
use crate::transport::renew::{
    IdentityKind, RenewError, Renewer, keep_identity, member_addresses, renew_locally,
};
use crate::transport::{
    CaError, Client, ClusterCa, EndpointError, MemberIdentity, QuicNetworkFactory, Service,
    join_endpoint, member_endpoint, member_endpoint_on, serve,
};
use crate::{NodeId, Raft};

/// The raft cluster name every member uses.
pub const CLUSTER_NAME: &str = "strata";

/// How long a bootstrap waits for the new group's first leader.
const BOOTSTRAP_TIMEOUT: Duration = Duration::from_secs(30);
/// How long shutdown waits for peers to acknowledge the endpoint's close.
const CLOSE_GRACE: Duration = Duration::from_secs(2);

#[derive(Debug, thiserror::Error)]
pub enum ServerError {
    #[error("member identity: {0}")]
    Identity(#[from] CaError),
    #[error("renewing this member's certificate: {0}")]
    Renew(#[from] RenewError),
    #[error(transparent)]
    Store(#[from] StoreError),
    #[error(transparent)]
    Endpoint(#[from] EndpointError),
    #[error("raft: {0}")]
    Raft(String),
    #[error("bootstrap: {0}")]
    Bootstrap(String),
}

/// A running member.
pub struct Server {
    pub id: NodeId,
    pub raft: Raft,
    pub state: StateReader,
    pub client: Client,
    /// The address other members dial.
    pub addr: String,
    endpoint: quinn::Endpoint,
    join_endpoint: Option<quinn::Endpoint>,
    tasks: Vec<JoinHandle<()>>,
}

impl Server {
    /// Opens the store, binds the endpoints and starts raft and the background tasks. The
    /// member must already hold its identity in `<data>/tls`.
    pub async fn start(config: &ServerConfig) -> Result<Self, ServerError> {
        Self::start_on(config, None).await
    }

    /// [`Server::start`] with the member endpoint on `socket` where given (bound to the
    /// configuration's `listen` beforehand), else bound here.
    pub async fn start_on(
        config: &ServerConfig,
        socket: Option<std::net::UdpSocket>,
    ) -> Result<Self, ServerError> {
        let layout = config.layout();
        let ca = if layout.ca_dir().join(CA_KEY_FILE).exists() {
            let lifetime = config
                .cert_lifetime_s
                .map_or(DEFAULT_CERT_LIFETIME, Duration::from_secs);
            let ca = ClusterCa::load(&layout.ca_dir())?.with_lifetime(lifetime)?;
            // Nobody can renew over the network a certificate that ended while this member was
            // down; the CA holder renews its own here.
            renew_locally(&ca, &layout.tls_dir(), std::time::SystemTime::now())?;
            Some(ca)
        } else {
            None
        };
        let identity = MemberIdentity::load(&layout.tls_dir())?;
        let live = identity.live().map_err(EndpointError::from)?;
        let (log, state_machine) = store::open(&layout.store())?;
        let state = state_machine.reader();
        let endpoint = match socket {
            Some(socket) => member_endpoint_on(socket, &live)?,
            None => member_endpoint(config.listen, &live)?,
        };
        let bound = endpoint
            .local_addr()
            .map_err(|source| EndpointError::Bind {
                addr: config.listen,
                source,
            })?;
        let addr = config
            .advertise
            .clone()
            .unwrap_or_else(|| bound.to_string());
        let timing = config.timing;
        let client = Client::new(endpoint.clone(), timing.rpc_timeout());
        let raft_config = timing
            .raft_config(CLUSTER_NAME)
            .map_err(ServerError::Raft)?;
        let network = QuicNetworkFactory::new(client.clone());
        let raft = Raft::new(identity.id, raft_config, network, log, state_machine)
            .await
            .map_err(|e| ServerError::Raft(e.to_string()))?;
        let clock: Arc<dyn Clock> = Arc::new(SystemClock);
        let contact = Arc::new(LeaderContact::default());
        let join = ca.map(|ca| Arc::new(JoinAuthority::new(ca, client.clone(), clock.clone())));
        let service = Service {
            raft: raft.clone(),
            state: state.clone(),
            join,
            read_timeout: timing.read_timeout(),
            contact: contact.clone(),
            lease: Duration::from_millis(timing.election_timeout_max_ms),
        };
        let mut tasks = vec![tokio::spawn(serve(endpoint.clone(), service.clone(), true))];
        let join_endpoint = match config.join_listen {
            Some(listen) if service.join.is_some() => {
                let join_endpoint = join_endpoint(listen, &live)?;
                tasks.push(tokio::spawn(serve(join_endpoint.clone(), service, false)));
                Some(join_endpoint)
            }
            Some(listen) => {
                tracing::warn!(%listen, "no CA key in this data directory; not serving joins");
                None
            }
            None => None,
        };
        // Raft's own elections are off (`Timing::raft_config`): this member stands only after a
        // pre-vote.
        tasks.push(tokio::spawn(election::drive(
            raft.clone(),
            client.clone(),
            contact,
            timing,
        )));
        let driver = LeaseDriver::new(
            raft.clone(),
            state.clone(),
            clock.clone(),
            Duration::from_millis(timing.lease_check_ms),
        );
        tasks.push(tokio::spawn(driver.run()));
        tasks.push(tokio::spawn(renew_lease(
            identity.id,
            raft.clone(),
            state.clone(),
            client.clone(),
            clock,
            Duration::from_millis(timing.lease_renew_ms),
        )));
        // The member renews its certificate through a member holding the CA key (itself, where
        // it holds it) and presents the new one at every handshake, its endpoints' and its dials'.
        let members = {
            let raft = raft.clone();
            Box::new(move || {
                member_addresses(raft.metrics().borrow().membership_config.membership())
            })
        };
        tasks.push(tokio::spawn(keep_identity(
            layout.tls_dir(),
            IdentityKind::Member,
            live,
            Some(Renewer {
                client: client.clone(),
                members,
            }),
        )));
        tracing::info!(member = identity.id, %addr, "member started");
        Ok(Self {
            id: identity.id,
            raft,
            state,
            client,
            addr,
            endpoint,
            join_endpoint,
            tasks,
        })
    }

    /// The address the join endpoint is bound to, if this member serves joins.
    pub fn join_addr(&self) -> Option<SocketAddr> {
        self.join_endpoint.as_ref()?.local_addr().ok()
    }

    /// Makes a new one-voter group of this member (unless the store already holds a group),
    /// then records the member and, if given, a join token's hash (valid for the default TTL).
    pub async fn bootstrap(
        &self,
        spec: MemberSpec,
        join_token_sha256: Option<String>,
    ) -> Result<(), ServerError> {
        let bootstrap = |e: String| ServerError::Bootstrap(e);
        let initialized = self
            .raft
            .is_initialized()
            .await
            .map_err(|e| bootstrap(e.to_string()))?;
        if !initialized {
            let mut voters = BTreeMap::new();
            voters.insert(self.id, BasicNode::new(&self.addr));
            self.raft
                .initialize(voters)
                .await
                .map_err(|e| bootstrap(e.to_string()))?;
        }
        self.raft
            .wait(Some(BOOTSTRAP_TIMEOUT))
            .state(ServerState::Leader, "the new group elects its member")
            .await
            .map_err(|e| bootstrap(e.to_string()))?;
        let now = SystemClock.now_ms();
        let known = self
            .state
            .with(|s| s.cluster.members().contains_key(&spec.id));
        let mut changes = Vec::new();
        if !known {
            changes.push(Change::AddMember(spec));
        }
        if let Some(sha256) = join_token_sha256 {
            changes.push(Change::PutJoinToken {
                sha256,
                ttl_ms: DEFAULT_JOIN_TOKEN_TTL_MS,
            });
        }
        for change in changes {
            commit_via_leader(&self.raft, &self.client, Command::new(now, change))
                .await
                .map_err(|e| bootstrap(e.to_string()))?
                .map_err(|e| bootstrap(e.to_string()))?;
        }
        Ok(())
    }

    /// Stops the background tasks and raft, and closes the endpoints.
    pub async fn shutdown(self) {
        for task in &self.tasks {
            task.abort();
        }
        if let Err(e) = self.raft.shutdown().await {
            tracing::warn!(error = %e, "raft did not stop cleanly");
        }
        for endpoint in std::iter::once(&self.endpoint).chain(self.join_endpoint.as_ref()) {
            endpoint.close(0u32.into(), b"member shutting down");
            let _ = tokio::time::timeout(CLOSE_GRACE, endpoint.wait_idle()).await;
        }
        tracing::info!(member = self.id, "member stopped");
    }
}

/// Renews this member's own health lease while the group knows it.
async fn renew_lease(
    id: NodeId,
    raft: Raft,
    state: StateReader,
    client: Client,
    clock: Arc<dyn Clock>,
    every: Duration,
) {
    let mut ticks = tokio::time::interval(every);
    ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        ticks.tick().await;
        if raft.metrics().borrow().running_state.is_err() {
            return;
        }
        if !state.with(|s| s.cluster.members().contains_key(&id)) {
            continue;
        }
        let command = Command::new(clock.now_ms(), Change::Heartbeat { id });
        if let Err(e) = commit_via_leader(&raft, &client, command).await {
            tracing::debug!(error = %e, "lease renewal not committed");
        }
    }
}

/// Resolves on SIGTERM or ctrl-c.
pub async fn shutdown_signal() {
    #[cfg(unix)]
    let terminate = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut signal) => {
                signal.recv().await;
            }
            Err(e) => {
                tracing::warn!(error = %e, "cannot watch SIGTERM; only ctrl-c stops the member");
                std::future::pending::<()>().await;
            }
        }
    };
    #[cfg(not(unix))]
    let terminate = std::future::pending::<()>();
    tokio::select! {
        _ = tokio::signal::ctrl_c() => {}
        () = terminate => {}
    }
}

/// Runs a member until SIGTERM or ctrl-c, then stops it.
pub async fn run(config: ServerConfig) -> Result<(), ServerError> {
    let server = Server::start(&config).await?;
    shutdown_signal().await;
    tracing::info!(member = server.id, "stopping on signal");
    server.shutdown().await;
    Ok(())
}
