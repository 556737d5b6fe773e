//! Three members over real QUIC with mutual TLS on 127.0.0.1: election, replication through
//! any member, linearizable reads, the change feed, refusal of peers without a valid
//! certificate, refusal of malformed frames while the member keeps serving, a join by token,
//! and the loss of the leader.

use std::collections::BTreeMap;
use std::path::Path;
use std::sync::{Arc, Mutex, OnceLock, PoisonError};
use std::time::Duration;

use openraft::{BasicNode, Config, ServerState};
use strata_topology::lease_driver::SystemClock;
use strata_topology::state::{Capacity, Change, Command, MemberAddresses, MemberSpec, RaftRole};
use strata_topology::store;
use strata_topology::transport::join::{JoinAuthority, JoinToken, request_membership};
use strata_topology::transport::wire::{
    FeedItem, MAX_FRAME, MembershipChange, Refusal, Request, Response,
};
use strata_topology::transport::{
    Client, ClientError, ClusterCa, MemberIdentity, Service, client_endpoint, join_endpoint,
    member_endpoint, serve, tls, upgrade_to_member,
};
use strata_topology::{NodeId, Raft};

/// Everything the members log, for tests that check a refusal was logged.
fn captured_logs() -> Arc<Mutex<Vec<u8>>> {
    static LOGS: OnceLock<Arc<Mutex<Vec<u8>>>> = OnceLock::new();
    LOGS.get_or_init(|| {
        let logs = Arc::new(Mutex::new(Vec::new()));
        let sink = logs.clone();
        let subscriber = tracing_subscriber::fmt()
            .with_max_level(tracing::Level::WARN)
            .with_ansi(false)
            .with_writer(move || LogSink(sink.clone()))
            .finish();
        tracing::subscriber::set_global_default(subscriber).expect("one subscriber");
        logs
    })
    .clone()
}

struct LogSink(Arc<Mutex<Vec<u8>>>);

impl std::io::Write for LogSink {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .extend_from_slice(buf);
        Ok(buf.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

/// Waits until a logged line contains every one of `parts`.
async fn logged(logs: &Mutex<Vec<u8>>, parts: &[&str]) {
    let deadline = tokio::time::Instant::now() + TIMEOUT;
    loop {
        let text = String::from_utf8_lossy(&logs.lock().unwrap_or_else(PoisonError::into_inner))
            .into_owned();
        if text
            .lines()
            .any(|line| parts.iter().all(|p| line.contains(p)))
        {
            return;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "no log line with {parts:?} in:\n{text}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

const TIMEOUT: Duration = Duration::from_secs(10);
const LOCAL: &str = "127.0.0.1:0";

fn config() -> Arc<Config> {
    let config = Config {
        cluster_name: "strata-quic-test".into(),
        heartbeat_interval: 100,
        election_timeout_min: 400,
        election_timeout_max: 800,
        ..Config::default()
    };
    Arc::new(config.validate().expect("valid raft config"))
}

struct Member {
    raft: Raft,
    addr: String,
    endpoint: quinn::Endpoint,
    service: Service,
}

async fn start(
    identity: &MemberIdentity,
    dir: &Path,
    join: Option<JoinAuthority>,
    endpoint: Option<quinn::Endpoint>,
) -> Member {
    let id = identity.id;
    let (log, sm) = store::open(&dir.join(format!("member-{id}.redb"))).expect("open store");
    let state = sm.reader();
    let endpoint = endpoint
        .unwrap_or_else(|| member_endpoint(LOCAL.parse().unwrap(), identity).expect("endpoint"));
    let addr = endpoint.local_addr().unwrap().to_string();
    let client = Client::new(endpoint.clone(), Duration::from_secs(2));
    let network = strata_topology::transport::QuicNetworkFactory::new(client);
    let raft = Raft::new(id, config(), network, log, sm)
        .await
        .expect("start raft");
    let service = Service {
        raft: raft.clone(),
        state,
        join: join.map(Arc::new),
    };
    tokio::spawn(serve(endpoint.clone(), service.clone(), true));
    Member {
        raft,
        addr,
        endpoint,
        service,
    }
}

fn operator(identity: &MemberIdentity) -> Client {
    Client::new(
        client_endpoint(identity, LOCAL.parse().unwrap()).expect("client endpoint"),
        TIMEOUT,
    )
}

async fn leader(members: &BTreeMap<NodeId, Member>) -> NodeId {
    let deadline = tokio::time::Instant::now() + TIMEOUT;
    loop {
        for (id, m) in members {
            if m.raft.metrics().borrow().state == ServerState::Leader {
                return *id;
            }
        }
        assert!(tokio::time::Instant::now() < deadline, "no leader");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

fn spec(id: NodeId, addr: &str) -> MemberSpec {
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

/// Sends raw bytes on a fresh stream and decodes the member's answer.
async fn raw_call(client: &Client, addr: &str, bytes: &[u8]) -> Response {
    let connection = client.connection(addr).await.expect("connect");
    let (mut send, mut recv) = connection.open_bi().await.expect("open stream");
    send.write_all(bytes).await.expect("write");
    send.finish().expect("finish");
    let answer = tokio::time::timeout(
        TIMEOUT,
        strata_topology::transport::wire::read_frame::<Response>(&mut recv),
    )
    .await
    .expect("answer in time")
    .expect("a frame");
    answer.expect("an answer before the end of stream")
}

fn framed(body: &[u8]) -> Vec<u8> {
    let mut bytes = (body.len() as u32).to_be_bytes().to_vec();
    bytes.extend_from_slice(body);
    bytes
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn three_members_over_mutual_tls_elect_replicate_read_and_refuse_strangers() {
    let logs = captured_logs();
    let dir = tempfile::tempdir().unwrap();
    let ca = ClusterCa::create(&dir.path().join("ca")).unwrap();
    let identities: BTreeMap<NodeId, MemberIdentity> = [1, 2, 3]
        .into_iter()
        .map(|id| {
            let identity = ca.issue_member(id, &dir.path().join(format!("tls-{id}")));
            (id, identity.unwrap())
        })
        .collect();
    let mut members = BTreeMap::new();
    for (id, identity) in &identities {
        members.insert(*id, start(identity, dir.path(), None, None).await);
    }
    let nodes: BTreeMap<NodeId, BasicNode> = members
        .iter()
        .map(|(id, m)| (*id, BasicNode::new(&m.addr)))
        .collect();
    members[&1]
        .raft
        .initialize(nodes)
        .await
        .expect("initialize");
    let first = leader(&members).await;
    let follower = *members.keys().find(|&&id| id != first).unwrap();

    // An operator holding a certificate of the same CA writes through a follower: the
    // follower names the leader and the client retries there.
    let admin = operator(&ca.issue_member(100, &dir.path().join("tls-100")).unwrap());
    let follower_addr = members[&follower].addr.clone();
    for id in [1, 2, 3] {
        let command = Command::new(1_000, Change::AddMember(spec(id, &members[&id].addr)));
        let (_, outcome) = admin
            .propose(&follower_addr, command)
            .await
            .expect("propose");
        assert!(outcome.is_ok(), "{outcome:?}");
    }
    let refused = admin
        .call(
            &follower_addr,
            &Request::Propose(Command::new(1, Change::EvaluateLeases)),
        )
        .await
        .expect("a follower answers");
    assert!(
        matches!(refused, Response::Refused(Refusal::NotLeader { leader: Some(l), addr: Some(_) }) if l == first),
        "{refused:?}"
    );

    // A linearizable read asked of a follower reflects every acknowledged write.
    let view = admin.read(&follower_addr).await.expect("read");
    assert_eq!(view.cluster.members().len(), 3);
    assert_eq!(view.leader, Some(first));
    assert_eq!(view.voters.len(), 3);

    // The change feed of a follower streams what commits after the subscription.
    let mut feed = admin.subscribe(&follower_addr).await.expect("subscribe");
    let start_item = feed.next().await.expect("start").expect("an item");
    assert!(
        matches!(start_item, FeedItem::Start { ref cluster, .. } if cluster.members().len() == 3)
    );
    let tenant = Change::PutTenant {
        name: "acme".into(),
    };
    let (_, outcome) = admin
        .propose(&follower_addr, Command::new(2_000, tenant.clone()))
        .await
        .expect("propose tenant");
    assert!(outcome.is_ok(), "{outcome:?}");
    let applied = tokio::time::timeout(TIMEOUT, async {
        loop {
            match feed.next().await.expect("feed").expect("open feed") {
                FeedItem::Applied {
                    command: Some(c), ..
                } => return c,
                FeedItem::Applied { command: None, .. } => continue,
                other => panic!("unexpected feed item {other:?}"),
            }
        }
    })
    .await
    .expect("the tenant arrives on the feed");
    assert_eq!(applied.change, tenant);

    // A client with no certificate, and one with a certificate of another CA, are refused.
    let leader_addr = members[&first].addr.clone();
    let mut anonymous = quinn::Endpoint::client(LOCAL.parse().unwrap()).unwrap();
    let anonymous_addr = anonymous.local_addr().unwrap().to_string();
    anonymous.set_default_client_config(tls::anonymous_client_config(&identities[&1].ca).unwrap());
    let stranger = Client::new(anonymous, Duration::from_secs(3));
    let err = stranger
        .read(&leader_addr)
        .await
        .expect_err("no certificate");
    assert!(!matches!(err, ClientError::Refused { .. }), "{err}");
    logged(
        &logs,
        &["refused a connection at the handshake", &anonymous_addr],
    )
    .await;
    let other_ca = ClusterCa::create(&dir.path().join("other-ca")).unwrap();
    let forged = other_ca
        .issue_member(2, &dir.path().join("tls-forged"))
        .unwrap();
    let mut forged_endpoint = quinn::Endpoint::client(LOCAL.parse().unwrap()).unwrap();
    let forged_addr = forged_endpoint.local_addr().unwrap().to_string();
    // It trusts our CA (so it would accept the member) but presents the other CA's certificate.
    let mut mixed = forged.clone();
    mixed.ca = identities[&1].ca.clone();
    forged_endpoint.set_default_client_config(tls::member_client_config(&mixed).unwrap());
    let forger = Client::new(forged_endpoint, Duration::from_secs(3));
    let err = forger.read(&leader_addr).await.expect_err("foreign CA");
    assert!(!matches!(err, ClientError::Refused { .. }), "{err}");
    logged(
        &logs,
        &["refused a connection at the handshake", &forged_addr],
    )
    .await;

    // Malformed frames are refused and the member keeps serving, on the same connection.
    let garbage = raw_call(&admin, &leader_addr, &framed(b"{not json")).await;
    assert!(
        matches!(garbage, Response::Refused(Refusal::Malformed(_))),
        "{garbage:?}"
    );
    logged(&logs, &["refused a request", "malformed", "127.0.0.1:"]).await;
    let unknown = raw_call(&admin, &leader_addr, &framed(br#"{"type":"Reboot"}"#)).await;
    assert!(
        matches!(unknown, Response::Refused(Refusal::Malformed(_))),
        "{unknown:?}"
    );
    let oversize = raw_call(&admin, &leader_addr, &(MAX_FRAME as u32 + 1).to_be_bytes()).await;
    assert!(
        matches!(oversize, Response::Refused(Refusal::Oversize(_))),
        "{oversize:?}"
    );
    // A raft RPC from member 100 claiming to come from another member is refused.
    let vote = openraft::raft::VoteRequest::new(openraft::Vote::new(99, first), None);
    let spoofed = admin
        .call(&leader_addr, &Request::Vote(vote))
        .await
        .unwrap();
    assert!(
        matches!(spoofed, Response::Refused(Refusal::WrongSender { claimed, peer: 100 }) if claimed == first),
        "{spoofed:?}"
    );
    assert_eq!(
        members[&first].raft.metrics().borrow().state,
        ServerState::Leader,
        "the spoofed vote reached raft"
    );
    let view = admin.read(&leader_addr).await.expect("still serving");
    assert_eq!(view.cluster.tenants().tenants().len(), 1);

    // The leader goes away; the other two elect a new one that commits a write.
    members[&first].raft.shutdown().await.expect("shutdown");
    members[&first].endpoint.close(0u32.into(), b"bye");
    let gone = members.remove(&first).unwrap();
    let second = leader(&members).await;
    assert_ne!(second, first);
    let (_, outcome) = admin
        .propose(
            &members[&second].addr,
            Command::new(
                3_000,
                Change::PutTenant {
                    name: "beta".into(),
                },
            ),
        )
        .await
        .expect("a write after the leader's loss");
    assert!(outcome.is_ok());
    drop(gone);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_joiner_with_a_token_becomes_a_learner_then_a_voter_and_the_token_is_spent() {
    let dir = tempfile::tempdir().unwrap();
    let ca_dir = dir.path().join("ca");
    let ca = ClusterCa::create(&ca_dir).unwrap();
    let identity = ca.issue_member(1, &dir.path().join("tls-1")).unwrap();
    let admin = operator(&identity);
    let authority = JoinAuthority::new(
        ClusterCa::load(&ca_dir).unwrap(),
        admin.clone(),
        Arc::new(SystemClock),
    );
    let first = start(&identity, dir.path(), Some(authority), None).await;
    let join_ep = join_endpoint(LOCAL.parse().unwrap(), &identity).unwrap();
    let join_addr = join_ep.local_addr().unwrap().to_string();
    tokio::spawn(serve(join_ep, first.service.clone(), false));
    let mut nodes = BTreeMap::new();
    nodes.insert(1, BasicNode::new(&first.addr));
    first.raft.initialize(nodes).await.expect("initialize");
    let mut single = BTreeMap::new();
    single.insert(1, first);
    leader(&single).await;
    let first = &single[&1];

    let token = JoinToken::generate(&ca.fingerprint().unwrap()).unwrap();
    let put = Change::PutJoinToken {
        sha256: token.secret_sha256(),
    };
    let (_, outcome) = admin
        .propose(&first.addr, Command::new(1, put))
        .await
        .expect("store the token");
    outcome.expect("token accepted");

    // A wrong secret is refused and spends nothing.
    let mut joiner_ep = quinn::Endpoint::client(LOCAL.parse().unwrap()).unwrap();
    let joiner_addr = joiner_ep.local_addr().unwrap().to_string();
    let wrong = JoinToken {
        secret: "00".repeat(32),
        ..token.clone()
    };
    let tls_dir = dir.path().join("tls-joiner");
    let err = request_membership(&join_addr, &wrong, &joiner_addr, &tls_dir, TIMEOUT)
        .await
        .expect_err("wrong secret");
    assert!(err.to_string().contains("join token"), "{err}");

    // The right token yields a certificate for member 2; the joiner turns its endpoint into a
    // member endpoint and the leader, which added it as a learner, catches it up.
    let joined = request_membership(&join_addr, &token, &joiner_addr, &tls_dir, TIMEOUT)
        .await
        .expect("join");
    assert_eq!(joined.id, 2);
    upgrade_to_member(&mut joiner_ep, &joined).expect("member endpoint");
    let second = start(&joined, dir.path(), None, Some(joiner_ep)).await;
    let (_, outcome) = admin
        .propose(
            &first.addr,
            Command::new(2, Change::AddMember(spec(2, &second.addr))),
        )
        .await
        .expect("add member 2");
    outcome.expect("member 2 recorded");
    let index = first.raft.metrics().borrow().last_applied.unwrap().index;
    second
        .raft
        .wait(Some(TIMEOUT))
        .applied_index_at_least(Some(index), "learner caught up")
        .await
        .expect("the learner catches up over QUIC");
    let tokens = second.service.state.get().cluster.join_tokens().clone();
    assert_eq!(
        tokens.tokens().values().next().unwrap().consumed_by,
        Some(2)
    );

    // The token is spent: a second use is refused.
    let again = request_membership(
        &join_addr,
        &token,
        &joiner_addr,
        &dir.path().join("tls-x"),
        TIMEOUT,
    )
    .await
    .expect_err("a spent token");
    assert!(again.to_string().contains("join"), "{again}");

    // Promoted to voter.
    admin
        .change_membership(&first.addr, MembershipChange::AddVoters([2].into()))
        .await
        .expect("promote");
    let view = admin.read(&first.addr).await.expect("read");
    assert_eq!(view.voters, [1, 2].into());
    assert_eq!(view.nodes.len(), 2);
}
