//! Three members over real QUIC with mutual TLS on 127.0.0.1: election, replication through
//! any member, linearizable reads, the change feed, refusal of peers without a valid
//! certificate, refusal of malformed frames while the member keeps serving, a join by token,
//! the refusal of an expired token (which stays unspent), and the loss of the leader.

mod common;
#[path = "../../tests/fuzz/mod.rs"]
mod fuzz;

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use common::logs::{captured_logs, logged};
use common::{Group, Member, TestCa, framed, local, operator, raw_call, spec, wait_for_leader};
use openraft::{BasicNode, ServerState};
use strata_topology::NodeId;
use strata_topology::lease_driver::{Clock, SystemClock};
use strata_topology::state::{Change, Command, DEFAULT_JOIN_TOKEN_TTL_MS, UnixMillis};
use strata_topology::transport::ca::{MEMBER_CERT_FILE, MEMBER_KEY_FILE};
use strata_topology::transport::join::{JoinAuthority, JoinToken, request_membership};
use strata_topology::transport::wire::{
    FeedItem, MAX_FRAME, MembershipChange, Refusal, Request, Response, read_frame,
};
use strata_topology::transport::{
    Client, ClientError, ClusterCa, join_endpoint, serve, tls, upgrade_to_member,
};

/// Everything the members log, for tests that check a refusal was logged.
const TIMEOUT: Duration = Duration::from_secs(10);

fn group() -> Group {
    Group::new("strata-quic-test", 100, (400, 800), Duration::from_secs(2))
}

/// Commits a fresh join token, valid for `ttl_ms` from now on the wall clock (the clock the
/// join authority stamps its spends with).
async fn issue_token(ca: &TestCa, admin: &Client, addr: &str, ttl_ms: u64) -> JoinToken {
    let token = JoinToken::generate(&ca.ca.fingerprint().unwrap()).unwrap();
    let put = Change::PutJoinToken {
        sha256: token.secret_sha256(),
        ttl_ms,
    };
    let (_, outcome) = admin
        .propose(addr, Command::new(SystemClock.now_ms(), put))
        .await
        .expect("store the token");
    outcome.expect("token accepted");
    token
}

/// Member 1 of a new one-voter group, holding the CA key and serving joins; returns it with the
/// address of its join endpoint and an operator client holding member 1's identity.
async fn start_join_authority(ca: &TestCa, group: &Group) -> (Member, String, Client) {
    let identity = ca.issue(1);
    let admin = operator(&identity, TIMEOUT);
    let authority = JoinAuthority::new(
        ClusterCa::load(&ca.ca_dir()).unwrap(),
        admin.clone(),
        Arc::new(SystemClock),
    );
    let endpoint = common::bind(&identity, local(), TIMEOUT).await;
    let first = group
        .start(&identity, &ca.store(1), endpoint, Some(authority))
        .await;
    let join_ep = join_endpoint(local(), &identity.live().unwrap()).unwrap();
    let join_addr = join_ep.local_addr().unwrap().to_string();
    tokio::spawn(serve(join_ep, first.service.clone(), false));
    let mut nodes = BTreeMap::new();
    nodes.insert(1, BasicNode::new(&first.addr));
    first.raft.initialize(nodes).await.expect("initialize");
    first
        .raft
        .wait(Some(TIMEOUT))
        .state(ServerState::Leader, "member 1 leads")
        .await
        .expect("a one-voter group elects its member");
    (first, join_addr, admin)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn three_members_over_mutual_tls_elect_replicate_read_and_refuse_strangers() {
    let logs = captured_logs(tracing::Level::WARN);
    let ca = TestCa::new();
    let group = group();
    let identities: BTreeMap<NodeId, _> =
        [1, 2, 3].into_iter().map(|id| (id, ca.issue(id))).collect();
    let mut members = BTreeMap::new();
    for (id, identity) in &identities {
        let endpoint = common::bind(identity, local(), TIMEOUT).await;
        let member = group.start(identity, &ca.store(*id), endpoint, None).await;
        members.insert(*id, member);
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
    let first = wait_for_leader(&members, TIMEOUT).await;
    let follower = *members.keys().find(|&&id| id != first).unwrap();

    // An operator holding a certificate of the same CA writes through a follower: the
    // follower names the leader and the client retries there.
    let admin = operator(&ca.issue(100), TIMEOUT);
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
    let mut anonymous = quinn::Endpoint::client(local()).unwrap();
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
        TIMEOUT,
    )
    .await;
    let other_ca = TestCa::new();
    let forged = other_ca.issue(2);
    let mut forged_endpoint = quinn::Endpoint::client(local()).unwrap();
    let forged_addr = forged_endpoint.local_addr().unwrap().to_string();
    // It trusts our CA (so it would accept the member) but presents the other CA's certificate.
    let mut mixed = forged.clone();
    mixed.ca = identities[&1].ca.clone();
    forged_endpoint
        .set_default_client_config(tls::member_client_config(&mixed.live().unwrap()).unwrap());
    let forger = Client::new(forged_endpoint, Duration::from_secs(3));
    let err = forger.read(&leader_addr).await.expect_err("foreign CA");
    assert!(!matches!(err, ClientError::Refused { .. }), "{err}");
    logged(
        &logs,
        &["refused a connection at the handshake", &forged_addr],
        TIMEOUT,
    )
    .await;

    // Malformed frames are refused and the member keeps serving, on the same connection.
    let garbage = raw_call(&admin, &leader_addr, &framed(b"{not json"), TIMEOUT).await;
    assert!(
        matches!(garbage, Response::Refused(Refusal::Malformed(_))),
        "{garbage:?}"
    );
    logged(
        &logs,
        &["refused a request", "malformed", "127.0.0.1:"],
        TIMEOUT,
    )
    .await;
    let unknown = raw_call(
        &admin,
        &leader_addr,
        &framed(br#"{"type":"Reboot"}"#),
        TIMEOUT,
    )
    .await;
    assert!(
        matches!(unknown, Response::Refused(Refusal::Malformed(_))),
        "{unknown:?}"
    );
    let oversize = raw_call(
        &admin,
        &leader_addr,
        &(MAX_FRAME as u32 + 1).to_be_bytes(),
        TIMEOUT,
    )
    .await;
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
    members.remove(&first).unwrap().kill().await;
    let second = wait_for_leader(&members, TIMEOUT).await;
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
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_joiner_with_a_token_becomes_a_learner_then_a_voter_and_the_token_is_spent() {
    let ca = TestCa::new();
    let group = group();
    let (first, join_addr, admin) = start_join_authority(&ca, &group).await;

    let token = issue_token(&ca, &admin, &first.addr, DEFAULT_JOIN_TOKEN_TTL_MS).await;

    // A wrong secret is refused and spends nothing.
    let mut joiner_ep = quinn::Endpoint::client(local()).unwrap();
    let joiner_addr = joiner_ep.local_addr().unwrap().to_string();
    let wrong = JoinToken {
        secret: "00".repeat(32),
        ..token.clone()
    };
    let tls_dir = ca.root().join("tls-joiner");
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
    let second = group.start(&joined, &ca.store(2), joiner_ep, None).await;
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
        &ca.root().join("tls-x"),
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

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_expired_join_token_is_refused_naming_its_expiry_and_stays_unspent() {
    let ca = TestCa::new();
    let group = group();
    let (first, join_addr, admin) = start_join_authority(&ca, &group).await;
    let expired = issue_token(&ca, &admin, &first.addr, 1).await;
    let live = issue_token(&ca, &admin, &first.addr, DEFAULT_JOIN_TOKEN_TTL_MS).await;
    let record = |token: &JoinToken| {
        first.service.state.get().cluster.join_tokens().tokens()[&token.secret_sha256()].clone()
    };
    let expires_ms = record(&expired).expires_ms;
    assert_eq!(expires_ms, record(&expired).issued_ms + 1);
    // The spend must be stamped past the expiry; the wall clock moves on while we wait.
    while SystemClock.now_ms() <= expires_ms {
        tokio::time::sleep(Duration::from_millis(2)).await;
    }

    let joiner_ep = quinn::Endpoint::client(local()).unwrap();
    let joiner_addr = joiner_ep.local_addr().unwrap().to_string();
    let tls_dir = ca.root().join("tls-joiner");
    for attempt in ["first", "second"] {
        let err = request_membership(&join_addr, &expired, &joiner_addr, &tls_dir, TIMEOUT)
            .await
            .expect_err("an expired token");
        let message = err.to_string();
        assert!(
            message.contains(&format!("expired at {}", UnixMillis(expires_ms))),
            "{attempt} attempt: {message}"
        );
        // Refused as expired every time: the refusal spent nothing.
        let stored = record(&expired);
        assert_eq!(
            stored.consumed_by, None,
            "{attempt} attempt spent the token"
        );
        assert!(stored.expired(first.service.state.get().cluster.clock_ms()));
    }
    // The joiner's key is kept for its retries; no certificate is written for a refused join.
    assert!(tls_dir.join(MEMBER_KEY_FILE).exists());
    assert!(
        !tls_dir.join(MEMBER_CERT_FILE).exists(),
        "no certificate is written for a refused join"
    );
    let view = admin.read(&first.addr).await.expect("read");
    assert_eq!(
        view.nodes.len(),
        1,
        "an expired token adds no learner: {view:?}"
    );

    // A token within its TTL is accepted, and takes the id the refusals left free.
    let joined = request_membership(&join_addr, &live, &joiner_addr, &tls_dir, TIMEOUT)
        .await
        .expect("join with a live token");
    assert_eq!(joined.id, 2);
    assert_eq!(record(&live).consumed_by, Some(2));
    assert_eq!(record(&expired).consumed_by, None);
}

/// Seed calls for the hostile-peer campaign: every kind of request, raft RPCs claiming to come
/// from the caller (member 100, in no group) included.
fn hostile_seeds(members: &BTreeMap<NodeId, Member>) -> Vec<Vec<u8>> {
    use openraft::raft::{AppendEntriesRequest, VoteRequest};
    let vote = openraft::Vote::new(7, 100);
    let requests = [
        Request::Read,
        Request::Propose(Command::new(1_000, Change::PutTenant { name: "t".into() })),
        Request::Propose(Command::new(
            1_000,
            Change::AddMember(spec(9, "127.0.0.1:9")),
        )),
        Request::Propose(Command::new(1_000, Change::EvaluateLeases)),
        Request::AddLearner {
            id: 9,
            addr: members[&1].addr.clone(),
        },
        Request::ChangeMembership(MembershipChange::RemoveLearners([9].into())),
        Request::PreVote {
            term: 7,
            last_applied: None,
        },
        Request::Vote(VoteRequest::new(vote, None)),
        Request::AppendEntries(AppendEntriesRequest {
            vote,
            prev_log_id: None,
            entries: Vec::new(),
            leader_commit: None,
        }),
        Request::Renew {
            csr_pem:
                "-----BEGIN CERTIFICATE REQUEST-----\nMIIB\n-----END CERTIFICATE REQUEST-----\n"
                    .into(),
        },
    ];
    requests
        .iter()
        .map(|r| serde_json::to_vec(r).unwrap())
        .collect()
}

/// One call of raw bytes: the member's answer, or how the stream ended without one.
async fn hostile_call(admin: &Client, addr: &str, body: &[u8]) -> &'static str {
    let connection = admin.connection(addr).await.expect("connect");
    let (mut send, mut recv) = connection.open_bi().await.expect("open stream");
    let _ = send.write_all(&framed(body)).await;
    let _ = send.finish();
    match tokio::time::timeout(TIMEOUT, read_frame::<Response>(&mut recv)).await {
        Err(_) => panic!("no answer within {TIMEOUT:?}"),
        Ok(Ok(Some(Response::Refused(_)))) => "refused",
        Ok(Ok(Some(_))) => "answered",
        Ok(Ok(None) | Err(_)) => "closed",
    }
}

/// A campaign of mutated calls from an authenticated but hostile peer against a three-member
/// group; afterwards the group still elects, commits and reads, and nothing panicked anywhere
/// in the process (spawned tasks included).
fn hostile_peer(campaign: fuzz::Campaign) -> fuzz::Report {
    let panics = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let previous = std::panic::take_hook();
    let counted = Arc::clone(&panics);
    std::panic::set_hook(Box::new(move |info| {
        counted.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        previous(info);
    }));
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    let ca = TestCa::new();
    let (members, addrs) = runtime.block_on(common::start_group(&ca, &group(), 1..=3, 3, TIMEOUT));
    runtime.block_on(wait_for_leader(&members, TIMEOUT));
    let identity = ca.issue(100);
    let admin = runtime.block_on(async { operator(&identity, TIMEOUT) });
    let report = campaign.run(&hostile_seeds(&members), |body| {
        let addr = &addrs[&(1 + body.len() as u64 % 3)];
        runtime.block_on(hostile_call(&admin, addr, body))
    });
    runtime.block_on(async {
        wait_for_leader(&members, TIMEOUT).await;
        let leader = &addrs[&wait_for_leader(&members, TIMEOUT).await];
        let command = Command::new(
            2_000,
            Change::PutTenant {
                name: "after".into(),
            },
        );
        let (_, outcome) = admin.propose(leader, command).await.expect("propose");
        assert!(outcome.is_ok(), "{outcome:?}");
        let view = admin.read(leader).await.expect("read");
        assert!(view.cluster.tenants().tenants().contains_key("after"));
    });
    assert_eq!(
        panics.load(std::sync::atomic::Ordering::SeqCst),
        0,
        "a hostile call panicked a task"
    );
    report
}

#[test]
fn mutated_calls_from_an_authenticated_peer_are_refused_and_the_group_keeps_serving() {
    let report = hostile_peer(fuzz::Campaign::new(
        "topology calls",
        0x70b_0001,
        2_000,
        Duration::from_secs(15),
    ));
    assert!(
        report.count("refused") > 0 && report.count("answered") > 0,
        "{report:?}"
    );
}

#[test]
#[ignore = "a recorded ten-minute run: scripts/fuzz-long.sh"]
fn topology_calls_for_ten_minutes() {
    hostile_peer(fuzz::Campaign::new("topology calls", 0x70b_1001, 0, Duration::ZERO).long());
}
