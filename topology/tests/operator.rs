//! An operator's own certificate over real QUIC on 127.0.0.1: it may read, propose, subscribe
//! and change the membership (logged with its name), its raft RPCs are refused before they
//! reach raft, and an operator certificate of another CA fails the handshake.

mod common;

use std::collections::BTreeMap;
use std::time::Duration;

use common::logs::{captured_logs, logged};
use common::{Group, TestCa, local, spec};
use openraft::{BasicNode, ServerState};
use strata_topology::state::{Change, Command};
use strata_topology::transport::wire::{FeedItem, MembershipChange, Refusal, Request, Response};
use strata_topology::transport::{Client, ClientError, OperatorIdentity, operator_endpoint, tls};

const TIMEOUT: Duration = Duration::from_secs(10);

/// Everything the members log at INFO and above, for checking who a change was logged as.
fn operator_client(identity: &OperatorIdentity) -> Client {
    Client::new(
        operator_endpoint(identity, local()).expect("operator endpoint"),
        TIMEOUT,
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_operator_certificate_makes_client_calls_but_no_raft_rpcs() {
    let logs = captured_logs(tracing::Level::INFO);
    let ca = TestCa::new();
    let group = Group::new(
        "strata-operator-test",
        100,
        (400, 800),
        Duration::from_secs(2),
    );
    let first_identity = ca.issue(1);
    let endpoint = common::bind(&first_identity, local(), TIMEOUT).await;
    let first = group
        .start(&first_identity, &ca.store(1), endpoint, None)
        .await;
    let mut nodes = BTreeMap::new();
    nodes.insert(1, BasicNode::new(&first.addr));
    first.raft.initialize(nodes).await.expect("initialize");
    first
        .raft
        .wait(Some(TIMEOUT))
        .state(ServerState::Leader, "member 1 leads")
        .await
        .expect("a one-voter group elects its member");

    let alice = ca
        .ca
        .issue_operator("alice", &ca.root().join("alice"))
        .expect("issue an operator certificate");
    let admin = operator_client(&alice);

    // Propose, read and subscribe.
    let mut feed = admin.subscribe(&first.addr).await.expect("subscribe");
    assert!(matches!(
        feed.next().await.expect("start").expect("an item"),
        FeedItem::Start { .. }
    ));
    let add = Command::new(1_000, Change::AddMember(spec(1, &first.addr)));
    let (_, outcome) = admin.propose(&first.addr, add).await.expect("propose");
    assert!(outcome.is_ok(), "{outcome:?}");
    let view = admin.read(&first.addr).await.expect("read");
    assert_eq!(view.cluster.members().len(), 1);
    assert_eq!(view.leader, Some(1));
    let applied = tokio::time::timeout(TIMEOUT, async {
        loop {
            if let FeedItem::Applied {
                command: Some(c), ..
            } = feed.next().await.expect("feed").expect("open feed")
            {
                return c;
            }
        }
    })
    .await
    .expect("the proposal arrives on the feed");
    assert!(matches!(applied.change, Change::AddMember(_)));

    // Membership changes: a learner, then a voter, each logged with the operator's name.
    let second_identity = ca.issue(2);
    let endpoint = common::bind(&second_identity, local(), TIMEOUT).await;
    let second = group
        .start(&second_identity, &ca.store(2), endpoint, None)
        .await;
    admin
        .add_learner(&first.addr, 2, &second.addr)
        .await
        .expect("add a learner");
    logged(&logs, &["adding a learner", "operator alice"], TIMEOUT).await;
    admin
        .change_membership(&first.addr, MembershipChange::AddVoters([2].into()))
        .await
        .expect("promote the learner");
    logged(
        &logs,
        &["changing the membership", "operator alice"],
        TIMEOUT,
    )
    .await;
    let view = admin.read(&first.addr).await.expect("read after promotion");
    assert_eq!(view.voters, [1, 2].into());

    // A raft RPC from the operator is refused, naming it, and never reaches raft.
    let term_before = first.raft.metrics().borrow().current_term;
    let vote = openraft::raft::VoteRequest::new(openraft::Vote::new(term_before + 5, 1), None);
    let refused = admin
        .call(&first.addr, &Request::Vote(vote))
        .await
        .expect("the member answers");
    assert!(
        matches!(&refused, Response::Refused(Refusal::OperatorRaft { operator }) if operator == "alice"),
        "{refused:?}"
    );
    logged(&logs, &["refused a request", "operator alice"], TIMEOUT).await;
    assert_eq!(first.raft.metrics().borrow().current_term, term_before);
    assert!(admin.read(&first.addr).await.is_ok(), "still serving alice");

    // An operator certificate of another CA, presented to a member it trusts, fails the
    // handshake.
    let other_ca = TestCa::new();
    let mallory = other_ca
        .ca
        .issue_operator("alice", &other_ca.root().join("alice"))
        .expect("issue a foreign operator certificate");
    let mixed = OperatorIdentity {
        name: mallory.name,
        ca: alice.ca.clone(),
        cert: mallory.cert,
        key: mallory.key,
    };
    let mut endpoint = quinn::Endpoint::client(local()).unwrap();
    endpoint.set_default_client_config(tls::operator_client_config(&mixed).unwrap());
    let forger = Client::new(endpoint, Duration::from_secs(3));
    let err = forger.read(&first.addr).await.expect_err("foreign CA");
    assert!(!matches!(err, ClientError::Refused { .. }), "{err}");

    second.kill().await;
    first.kill().await;
}
