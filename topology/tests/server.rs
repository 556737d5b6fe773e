//! A member process's life in one test process: start from a data directory, bootstrap a
//! one-voter group, renew its own lease, admit a joiner through the join endpoint, stop, and
//! start again from disk into the same state.

use std::collections::BTreeMap;
use std::path::Path;
use std::time::Duration;

use openraft::ServerState;
use strata_topology::server::{DataLayout, Server, ServerConfig, Timing};
use strata_topology::state::{Capacity, MemberAddresses, MemberSpec, RaftRole};
use strata_topology::transport::ClusterCa;
use strata_topology::transport::join::{JoinToken, request_membership};

const TIMEOUT: Duration = Duration::from_secs(15);

fn config(dir: &Path, listen: &str, join: bool) -> ServerConfig {
    ServerConfig {
        data_dir: dir.to_path_buf(),
        listen: listen.parse().unwrap(),
        advertise: None,
        join_listen: join.then(|| "127.0.0.1:0".parse().unwrap()),
        timing: Timing {
            lease_renew_ms: 100,
            lease_check_ms: 100,
            ..Timing::default()
        },
    }
}

fn spec(id: u64, addr: &str) -> MemberSpec {
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

/// A loopback port nothing listens on right now.
fn free_port() -> String {
    let socket = std::net::UdpSocket::bind("127.0.0.1:0").unwrap();
    socket.local_addr().unwrap().to_string()
}

async fn eventually(what: &str, mut check: impl FnMut() -> bool) {
    let deadline = tokio::time::Instant::now() + TIMEOUT;
    while !check() {
        assert!(tokio::time::Instant::now() < deadline, "never: {what}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_member_bootstraps_renews_admits_a_joiner_and_restarts_from_disk() {
    let root = tempfile::tempdir().unwrap();
    let dir1 = root.path().join("m1");
    let layout = DataLayout::new(&dir1);
    let ca = ClusterCa::create(&layout.ca_dir()).unwrap();
    ca.issue_member(1, &layout.tls_dir()).unwrap();
    let token = JoinToken::generate(&ca.fingerprint().unwrap()).unwrap();

    let config1 = config(&dir1, "127.0.0.1:0", true);
    let first = Server::start(&config1).await.expect("start member 1");
    first
        .bootstrap(spec(1, &first.addr), Some(token.secret_sha256()))
        .await
        .expect("bootstrap");
    let renewed = |server: &Server| {
        server
            .state
            .with(|s| s.cluster.members().get(&1).map(|m| m.lease.renewed_ms))
    };
    let at_bootstrap = renewed(&first).expect("member 1 recorded");
    eventually("member 1 renews its lease", || {
        renewed(&first).is_some_and(|r| r > at_bootstrap)
    })
    .await;

    // A joiner gets a certificate through the join endpoint and starts as a learner.
    let join_addr = first.join_addr().expect("join endpoint").to_string();
    let dir2 = root.path().join("m2");
    let listen2 = free_port();
    let identity = request_membership(
        &join_addr,
        &token,
        &listen2,
        &DataLayout::new(&dir2).tls_dir(),
        TIMEOUT,
    )
    .await
    .expect("join");
    assert_eq!(identity.id, 2);
    let second = Server::start(&config(&dir2, &listen2, false))
        .await
        .expect("start member 2");
    let target = first.raft.metrics().borrow().last_applied.unwrap().index;
    second
        .raft
        .wait(Some(TIMEOUT))
        .applied_index_at_least(Some(target), "learner caught up")
        .await
        .expect("member 2 catches up");
    assert!(
        second.join_addr().is_none(),
        "only the CA holder serves joins"
    );

    // Stop both; member 1 comes back from disk with the same state and leads again.
    let stopped = first.state.clone();
    second.shutdown().await;
    first.shutdown().await;
    let before = stopped.get();
    let again = Server::start(&config1).await.expect("restart member 1");
    again
        .raft
        .wait(Some(TIMEOUT))
        .state(ServerState::Leader, "leads again")
        .await
        .expect("member 1 leads after the restart");
    again
        .raft
        .wait(Some(TIMEOUT))
        .applied_index_at_least(before.last_applied.map(|l| l.index), "replayed")
        .await
        .expect("member 1 replays its log");
    let after = again.state.get();
    let specs = |s: &strata_topology::store::AppliedState| {
        s.cluster
            .members()
            .values()
            .map(|m| m.spec.clone())
            .collect::<Vec<_>>()
    };
    assert_eq!(specs(&after), specs(&before));
    assert_eq!(after.cluster.join_tokens(), before.cluster.join_tokens());
    assert_eq!(after.membership, before.membership);
    again.shutdown().await;
}
