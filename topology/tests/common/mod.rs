//! What the QUIC, server and fault-battery tests share: a throwaway cluster CA issuing member
//! identities, members on real QUIC endpoints on 127.0.0.1, raw frames for poking a member's
//! wire, and waiting for a condition under a deadline.
//!
//! Deadlines are passed in: each test file keeps its own bound, sized to what it starts.

// Each test binary compiles this module and uses a different part of it.
#![allow(dead_code)]

pub mod logs;
pub mod proxy;

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use openraft::{Config, ServerState};
use strata_topology::state::{Capacity, MemberAddresses, MemberSpec, RaftRole};
use strata_topology::store;
use strata_topology::transport::join::JoinAuthority;
use strata_topology::transport::wire::{Response, read_frame};
use strata_topology::transport::{
    Client, ClusterCa, MemberIdentity, QuicNetworkFactory, Service, client_endpoint,
    member_endpoint, serve,
};
use strata_topology::{NodeId, Raft};

/// Any free port on loopback.
pub const LOCAL: &str = "127.0.0.1:0";

/// How long a test member waits for a whole request on an open stream (the production default).
pub const READ_TIMEOUT: Duration = Duration::from_secs(10);

pub fn local() -> SocketAddr {
    LOCAL.parse().expect("a literal socket address")
}

/// A cluster CA in its own temporary directory; identities and stores live beside it.
pub struct TestCa {
    pub dir: tempfile::TempDir,
    pub ca: ClusterCa,
}

impl TestCa {
    pub fn new() -> Self {
        let dir = tempfile::tempdir().expect("temporary directory");
        let ca = ClusterCa::create(&dir.path().join("ca")).expect("create the CA");
        Self { dir, ca }
    }

    pub fn root(&self) -> &Path {
        self.dir.path()
    }

    pub fn ca_dir(&self) -> PathBuf {
        self.root().join("ca")
    }

    /// A certificate naming member `id`, written under `tls-<id>`.
    pub fn issue(&self, id: NodeId) -> MemberIdentity {
        self.ca
            .issue_member(id, &self.root().join(format!("tls-{id}")))
            .expect("issue a member certificate")
    }

    /// Where member `id` keeps its raft log and state.
    pub fn store(&self, id: NodeId) -> PathBuf {
        self.root().join(format!("member-{id}.redb"))
    }
}

/// How the members of one test group run: raft timing and the bound on their calls to one
/// another.
#[derive(Clone)]
pub struct Group {
    pub raft: Arc<Config>,
    pub rpc_timeout: Duration,
}

impl Group {
    pub fn new(
        cluster_name: &str,
        heartbeat_ms: u64,
        (election_min_ms, election_max_ms): (u64, u64),
        rpc_timeout: Duration,
    ) -> Self {
        let config = Config {
            cluster_name: cluster_name.into(),
            heartbeat_interval: heartbeat_ms,
            election_timeout_min: election_min_ms,
            election_timeout_max: election_max_ms,
            // As the server sets them (`Timing::raft_config`).
            install_snapshot_timeout: rpc_timeout.as_millis() as u64,
            snapshot_max_chunk_size: strata_topology::server::SNAPSHOT_CHUNK_BYTES,
            ..Config::default()
        };
        Self {
            raft: Arc::new(config.validate().expect("valid raft config")),
            rpc_timeout,
        }
    }

    /// Opens the store at `store`, starts raft on `endpoint` and serves it there.
    pub async fn start(
        &self,
        identity: &MemberIdentity,
        store: &Path,
        endpoint: quinn::Endpoint,
        join: Option<JoinAuthority>,
    ) -> Member {
        let (log, sm) = store::open(store).expect("open store");
        let state = sm.reader();
        let addr = endpoint.local_addr().expect("bound").to_string();
        let client = Client::new(endpoint.clone(), self.rpc_timeout);
        let raft = Raft::new(
            identity.id,
            self.raft.clone(),
            QuicNetworkFactory::new(client),
            log,
            sm,
        )
        .await
        .expect("start raft");
        let service = Service {
            raft: raft.clone(),
            state,
            join: join.map(Arc::new),
            read_timeout: READ_TIMEOUT,
            contact: Arc::default(),
            lease: Duration::from_millis(self.raft.election_timeout_max),
        };
        let serving = tokio::spawn(serve(endpoint.clone(), service.clone(), true));
        Member {
            raft,
            addr,
            endpoint,
            service,
            serving,
        }
    }
}

/// A member started by [`Group::start`].
pub struct Member {
    pub raft: Raft,
    /// The address its endpoint is bound to.
    pub addr: String,
    pub endpoint: quinn::Endpoint,
    pub service: Service,
    serving: tokio::task::JoinHandle<()>,
}

impl Member {
    /// Stops the member the way a crash looks from outside: no more answers, connections
    /// gone. Nothing waits for peers to acknowledge the close; a crashed process would not
    /// either.
    pub async fn kill(self) {
        self.endpoint.close(0u32.into(), b"killed");
        self.serving.abort();
        let _ = self.raft.shutdown().await;
        let _ = self.serving.await;
    }
}

/// The member endpoint of `identity` on `listen`. A restarted member rebinds its old port and
/// the old socket may take a moment to go, so binding is retried until `within` has passed.
pub async fn bind(
    identity: &MemberIdentity,
    listen: SocketAddr,
    within: Duration,
) -> quinn::Endpoint {
    let deadline = tokio::time::Instant::now() + within;
    loop {
        match member_endpoint(listen, &identity.live().unwrap()) {
            Ok(endpoint) => return endpoint,
            Err(e) if tokio::time::Instant::now() < deadline => {
                tracing::debug!("rebind {listen}: {e}");
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
            Err(e) => panic!("cannot bind {listen}: {e}"),
        }
    }
}

/// A dial-only client holding `identity`, as an operator's tool has.
pub fn operator(identity: &MemberIdentity, timeout: Duration) -> Client {
    Client::new(
        client_endpoint(identity, local()).expect("client endpoint"),
        timeout,
    )
}

/// The member that leads right now, as its own raft metrics say.
pub fn leader_of(members: &BTreeMap<NodeId, Member>) -> Option<NodeId> {
    members
        .iter()
        .find(|(_, m)| m.raft.metrics().borrow().state == ServerState::Leader)
        .map(|(id, _)| *id)
}

/// Waits until one of `members` leads.
pub async fn wait_for_leader(members: &BTreeMap<NodeId, Member>, within: Duration) -> NodeId {
    let mut leader = None;
    eventually(within, "a leader", || {
        leader = leader_of(members);
        leader.is_some()
    })
    .await;
    leader.expect("checked just above")
}

/// Polls `check` until it holds; fails the test once `within` has passed.
pub async fn eventually(within: Duration, what: &str, mut check: impl FnMut() -> bool) {
    let deadline = tokio::time::Instant::now() + within;
    while !check() {
        assert!(tokio::time::Instant::now() < deadline, "never: {what}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// A voter declaring no GPUs, reachable at `addr`.
pub fn spec(id: NodeId, addr: &str) -> MemberSpec {
    MemberSpec {
        id,
        addresses: MemberAddresses {
            raft: addr.to_string(),
            rpc: addr.to_string(),
        },
        gpus: vec![],
        capacity: Capacity::default(),
        labels: BTreeMap::new(),
        role: RaftRole::Voter,
    }
}

/// A loopback address nothing listens on right now.
pub fn free_port() -> String {
    let socket = std::net::UdpSocket::bind(LOCAL).expect("bind a probe socket");
    socket.local_addr().expect("bound").to_string()
}

/// `body` behind its 4-byte big-endian length, as the wire frames it.
pub fn framed(body: &[u8]) -> Vec<u8> {
    let mut bytes = (body.len() as u32).to_be_bytes().to_vec();
    bytes.extend_from_slice(body);
    bytes
}

/// Sends raw bytes on a fresh stream of `client`'s connection to `addr`, ends the stream and
/// decodes the member's answer, which must come within `within`.
pub async fn raw_call(client: &Client, addr: &str, bytes: &[u8], within: Duration) -> Response {
    let connection = client.connection(addr).await.expect("connect");
    let (mut send, mut recv) = connection.open_bi().await.expect("open stream");
    send.write_all(bytes).await.expect("write");
    send.finish().expect("finish");
    let answer = tokio::time::timeout(within, read_frame::<Response>(&mut recv))
        .await
        .expect("answer in time")
        .expect("a frame");
    answer.expect("an answer before the end of stream")
}

/// Members `members` on loopback, each with a fresh identity from `ca` and its own store, the
/// first `voters` of them initialized as a group (the rest wait to be added); with the address
/// each is bound to.
pub async fn start_group(
    ca: &TestCa,
    group: &Group,
    members: std::ops::RangeInclusive<NodeId>,
    voters: usize,
    within: Duration,
) -> (BTreeMap<NodeId, Member>, BTreeMap<NodeId, String>) {
    let (mut started, mut addrs) = (BTreeMap::new(), BTreeMap::new());
    for id in members {
        let identity = ca.issue(id);
        let endpoint = bind(&identity, local(), within).await;
        addrs.insert(id, endpoint.local_addr().expect("bound").to_string());
        let member = group.start(&identity, &ca.store(id), endpoint, None).await;
        started.insert(id, member);
    }
    let nodes: BTreeMap<NodeId, openraft::BasicNode> = addrs
        .iter()
        .take(voters)
        .map(|(id, addr)| (*id, openraft::BasicNode::new(addr.clone())))
        .collect();
    let first = *nodes.keys().next().expect("at least one voter");
    started[&first]
        .raft
        .initialize(nodes)
        .await
        .expect("initialize");
    (started, addrs)
}
