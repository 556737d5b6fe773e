//! Three raft nodes in one process over the in-process network, each on its own redb file:
//! election, replication, losing the leader, snapshots reaching a lagging node, and a restart
//! of the whole group from disk.

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use openraft::{BasicNode, Config, ServerState, SnapshotPolicy};
use strata_topology::lease_driver::{Clock, LeaseDriver, SystemClock};
use strata_topology::network::LocalNetwork;
use strata_topology::read::read_linearizable;
use strata_topology::state::{Capacity, ClusterState, Health, HealthPolicy};
use strata_topology::state::{Change, Command, Gpu, MemberAddresses, MemberSpec, RaftRole};
use strata_topology::store::{self, CommittedEvent, StateReader};
use strata_topology::{NodeId, Raft};

const TIMEOUT: Duration = Duration::from_secs(10);
const IDS: [NodeId; 3] = [1, 2, 3];

struct Node {
    raft: Raft,
    state: StateReader,
}

fn config() -> Arc<Config> {
    let config = Config {
        cluster_name: "strata-test".into(),
        heartbeat_interval: 50,
        election_timeout_min: 200,
        election_timeout_max: 400,
        // Small, so that the test crosses several snapshots and purges.
        snapshot_policy: SnapshotPolicy::LogsSinceLast(10),
        max_in_snapshot_log_to_keep: 2,
        purge_batch_size: 1,
        ..Config::default()
    };
    Arc::new(config.validate().expect("valid raft config"))
}

/// Opens a node's store. openraft builds snapshots in a task of their own that `shutdown` does
/// not wait for, and that task holds the store until it finishes, so a node restarted in the
/// same process waits for redb to let the file go. (Another process is refused at once, as it
/// should be: that is a second member on one store.)
async fn open_store(path: &Path) -> (store::LogStore, store::StateMachineStore) {
    let deadline = tokio::time::Instant::now() + TIMEOUT;
    loop {
        match store::open(path) {
            Err(store::StoreError::Database {
                source: redb::Error::DatabaseAlreadyOpen,
                ..
            }) if tokio::time::Instant::now() < deadline => {
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
            opened => return opened.expect("open store"),
        }
    }
}

async fn start(id: NodeId, dir: &Path, network: &LocalNetwork) -> Node {
    let (log, sm) = open_store(&dir.join(format!("node-{id}.redb"))).await;
    let state = sm.reader();
    let raft = Raft::new(id, config(), network.factory(id), log, sm)
        .await
        .expect("start raft");
    network.attach(id, raft.clone());
    Node { raft, state }
}

async fn start_all(dir: &Path, network: &LocalNetwork) -> BTreeMap<NodeId, Node> {
    let mut nodes = BTreeMap::new();
    for id in IDS {
        nodes.insert(id, start(id, dir, network).await);
    }
    nodes
}

/// Waits until some node of `among` is leader and every one of them agrees on it.
async fn leader(nodes: &BTreeMap<NodeId, Node>, among: &[NodeId]) -> NodeId {
    let deadline = tokio::time::Instant::now() + TIMEOUT;
    loop {
        let seen: BTreeSet<Option<NodeId>> = among
            .iter()
            .map(|id| nodes[id].raft.metrics().borrow().current_leader)
            .collect();
        // Followers restarted from disk report the leader of their stored vote before that
        // node leads again, so the leader's own view must confirm it.
        if let [Some(leader)] = seen.iter().copied().collect::<Vec<_>>()[..]
            && among.contains(&leader)
            && nodes[&leader].raft.metrics().borrow().state == ServerState::Leader
        {
            return leader;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "no agreed leader: {seen:?}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Waits until each of `among` has applied at least `index`.
async fn applied(nodes: &BTreeMap<NodeId, Node>, among: &[NodeId], index: u64) {
    for id in among {
        nodes[id]
            .raft
            .wait(Some(TIMEOUT))
            .applied_index_at_least(Some(index), "caught up")
            .await
            .unwrap_or_else(|e| panic!("node {id} did not apply {index}: {e}"));
    }
}

fn spec(id: NodeId) -> MemberSpec {
    MemberSpec {
        id,
        addresses: MemberAddresses {
            raft: format!("127.0.0.1:{}", 7000 + id),
            rpc: format!("127.0.0.1:{}", 8000 + id),
        },
        gpus: vec![
            Gpu {
                index: 0,
                memory_mib: 81_920,
                link_group: 0,
            },
            Gpu {
                index: 1,
                memory_mib: 81_920,
                link_group: 0,
            },
        ],
        capacity: Capacity {
            kv_blocks: 1_000,
            max_sequences: 32,
        },
        labels: BTreeMap::new(),
        role: RaftRole::Voter,
    }
}

/// Proposes through `leader`; returns the entry's log index.
async fn write(nodes: &BTreeMap<NodeId, Node>, leader: NodeId, at_ms: u64, change: Change) -> u64 {
    let response = nodes[&leader]
        .raft
        .client_write(Command::new(at_ms, change))
        .await
        .expect("write through the leader");
    assert!(response.data.is_ok(), "rejected: {:?}", response.data);
    response.log_id.index
}

/// Waits until `among` have applied the same log index, then asserts they hold equal states
/// (the drivers may still be committing, so equal states are only expected at equal indices).
async fn assert_converged(nodes: &BTreeMap<NodeId, Node>, among: &[NodeId]) {
    let deadline = tokio::time::Instant::now() + TIMEOUT;
    loop {
        let states: Vec<_> = among.iter().map(|id| nodes[id].state.get()).collect();
        if states
            .iter()
            .all(|s| s.last_applied == states[0].last_applied)
        {
            for (id, state) in among.iter().zip(&states) {
                assert_eq!(state.cluster, states[0].cluster, "node {id} diverged");
            }
            return;
        }
        assert!(tokio::time::Instant::now() < deadline, "never converged");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

fn cluster(nodes: &BTreeMap<NodeId, Node>, id: NodeId) -> ClusterState {
    nodes[&id].state.get().cluster
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn elects_replicates_survives_leader_loss_and_restarts_from_disk() {
    let dir = tempfile::tempdir().unwrap();
    let network = LocalNetwork::new();
    let nodes = start_all(dir.path(), &network).await;
    let members: BTreeMap<NodeId, BasicNode> = IDS
        .iter()
        .map(|&id| (id, BasicNode::new(format!("local:{id}"))))
        .collect();
    nodes[&1]
        .raft
        .initialize(members)
        .await
        .expect("initialize");

    // Election and replication.
    let first = leader(&nodes, &IDS).await;
    let mut last = 0;
    for id in IDS {
        last = write(&nodes, first, 1_000, Change::AddMember(spec(id))).await;
    }
    for i in 0..25 {
        let name = format!("tenant-{i}");
        last = write(&nodes, first, 1_100 + i, Change::PutTenant { name }).await;
    }
    applied(&nodes, &IDS, last).await;
    let reference = cluster(&nodes, first);
    assert_eq!(reference.members().len(), 3);
    assert_eq!(reference.tenants().tenants().len(), 25);
    assert_eq!(reference.ring().epoch(), 3);
    for id in IDS {
        assert_eq!(cluster(&nodes, id), reference, "node {id} diverged");
    }
    // Snapshots were taken and the log purged behind them.
    let snap = nodes[&first].raft.metrics().borrow().snapshot;
    assert!(snap.is_some_and(|s| s.index >= 10), "no snapshot: {snap:?}");
    let purged = nodes[&first].raft.metrics().borrow().purged;
    assert!(purged.is_some(), "log never purged");

    // The leader vanishes: the other two elect a new one and keep committing.
    network.cut(first);
    let rest: Vec<NodeId> = IDS.iter().copied().filter(|&id| id != first).collect();
    let second = leader(&nodes, &rest).await;
    assert_ne!(second, first);
    // A follower of the feed, replaying every committed command on the state it subscribed
    // at, must arrive at the node's own state with the same outcomes.
    let watcher = rest
        .iter()
        .copied()
        .find(|&id| id != second)
        .expect("a follower");
    let (subscribed, mut feed) = nodes[&watcher].state.subscribe();
    for i in 0..15 {
        let name = format!("after-{i}");
        last = write(&nodes, second, 5_000 + i, Change::PutTenant { name }).await;
    }
    applied(&nodes, &rest, last).await;
    assert_eq!(cluster(&nodes, rest[0]), cluster(&nodes, rest[1]));
    let mut replayed = subscribed.cluster;
    let mut events = 0;
    while let Some(event) = feed.try_recv() {
        match event.expect("no lag") {
            CommittedEvent::Applied {
                command: Some(command),
                outcome,
                ..
            } => assert_eq!(replayed.apply(&command), outcome),
            CommittedEvent::Applied { command: None, .. } => {}
            CommittedEvent::Replaced { .. } => {
                panic!("a follower in the majority needs no snapshot")
            }
        }
        events += 1;
    }
    assert!(events >= 15, "{events} events");
    assert_eq!(replayed, cluster(&nodes, watcher));
    assert_eq!(cluster(&nodes, second).tenants().tenants().len(), 40);

    // The old leader comes back and catches up.
    network.heal(first);
    applied(&nodes, &[first], last).await;

    // A new, empty member joins as a learner. The log it would need starts after the purged
    // prefix, so only a snapshot sent over the network can bring it up to date.
    let mut nodes = nodes;
    let learner: NodeId = 4;
    nodes.insert(learner, start(learner, dir.path(), &network).await);
    let (_, mut learner_feed) = nodes[&learner].state.subscribe();
    let purged = nodes[&second].raft.metrics().borrow().purged;
    assert!(purged.is_some_and(|p| p.index > 0), "leader never purged");
    nodes[&second]
        .raft
        .add_learner(learner, BasicNode::new("local:4"), true)
        .await
        .expect("add learner");
    applied(&nodes, &[learner], last).await;
    let installed = nodes[&learner].raft.metrics().borrow().snapshot;
    assert!(
        installed.is_some(),
        "the learner caught up without a snapshot"
    );
    // Its feed says so first, then continues with the entries after the snapshot.
    let Some(Ok(CommittedEvent::Replaced {
        last_applied: Some(base),
    })) = learner_feed.try_recv()
    else {
        panic!("the learner's feed did not start with the installed snapshot");
    };
    assert!(base.index >= purged.map_or(0, |p| p.index));
    let mut next = base.index + 1;
    while let Some(event) = learner_feed.try_recv() {
        let Ok(CommittedEvent::Applied { log_id, .. }) = event else {
            panic!("unexpected event after the snapshot: {event:?}");
        };
        assert_eq!(log_id.index, next);
        next += 1;
    }
    let before_restart = cluster(&nodes, second);
    assert_eq!(cluster(&nodes, first), before_restart);
    assert_eq!(cluster(&nodes, learner), before_restart);

    // Stop everything, reopen every file, and come back to the same state.
    for node in nodes.values() {
        node.raft.shutdown().await.expect("shutdown");
    }
    for &id in nodes.keys() {
        network.detach(id);
    }
    drop(nodes);
    let nodes = start_all(dir.path(), &network).await;
    let third = leader(&nodes, &IDS).await;
    // Each node re-applies its committed log on top of its snapshot: every node must hold
    // exactly the state from before the stop, before anything new is written.
    applied(&nodes, &IDS, last).await;
    for id in IDS {
        assert_eq!(
            cluster(&nodes, id),
            before_restart,
            "node {id} after restart"
        );
    }
    let next = write(
        &nodes,
        third,
        9_000,
        Change::PutTenant {
            name: "restarted".into(),
        },
    )
    .await;
    applied(&nodes, &IDS, next).await;
    for id in IDS {
        assert_eq!(
            cluster(&nodes, id).tenants().tenants().len(),
            41,
            "node {id}"
        );
    }
    for node in nodes.values() {
        node.raft.shutdown().await.expect("shutdown");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cut_off_leader_cannot_commit_and_its_write_is_discarded_on_healing() {
    let dir = tempfile::tempdir().unwrap();
    let network = LocalNetwork::new();
    let nodes = start_all(dir.path(), &network).await;
    let members: BTreeMap<NodeId, BasicNode> = IDS
        .iter()
        .map(|&id| (id, BasicNode::new(format!("local:{id}"))))
        .collect();
    nodes[&1]
        .raft
        .initialize(members)
        .await
        .expect("initialize");
    let old = leader(&nodes, &IDS).await;
    let mut last = write(
        &nodes,
        old,
        1_000,
        Change::PutTenant {
            name: "before".into(),
        },
    )
    .await;
    applied(&nodes, &IDS, last).await;

    // The leader is alone on its side of the partition: its write is appended to its own log
    // only, and never acknowledged.
    network.cut(old);
    let minority = nodes[&old].raft.clone();
    let pending = tokio::spawn(async move {
        let lost = Change::PutTenant {
            name: "minority".into(),
        };
        minority.client_write(Command::new(2_000, lost)).await
    });
    tokio::time::sleep(Duration::from_millis(800)).await;
    assert!(!pending.is_finished(), "a minority acknowledged a write");
    let appended = nodes[&old].raft.metrics().borrow().last_log_index;
    assert_eq!(
        appended,
        Some(last + 1),
        "the minority entry is in the old leader's log"
    );

    // The majority elects a leader and keeps committing.
    let rest: Vec<NodeId> = IDS.iter().copied().filter(|&id| id != old).collect();
    let new = leader(&nodes, &rest).await;
    for i in 0..5 {
        let name = format!("majority-{i}");
        last = write(&nodes, new, 3_000 + i, Change::PutTenant { name }).await;
    }

    // Healing: the old leader learns of the newer term, its uncommitted entry is overwritten,
    // and its write fails instead of committing.
    network.heal(old);
    let outcome = tokio::time::timeout(TIMEOUT, pending)
        .await
        .expect("the minority write resolves after healing")
        .expect("task");
    assert!(outcome.is_err(), "minority write committed: {outcome:?}");
    applied(&nodes, &IDS, last).await;
    let reference = cluster(&nodes, new);
    assert!(!reference.tenants().tenants().contains_key("minority"));
    assert_eq!(reference.tenants().tenants().len(), 6);
    for id in IDS {
        assert_eq!(cluster(&nodes, id), reference, "node {id} diverged");
    }
    for node in nodes.values() {
        node.raft.shutdown().await.expect("shutdown");
    }
}

/// Proposes heartbeats for `ids` through the current leader, stamped with `clock`.
async fn heartbeat(nodes: &BTreeMap<NodeId, Node>, ids: &[NodeId], clock: &SystemClock) {
    let lead = leader(nodes, &IDS).await;
    for &id in ids {
        write(nodes, lead, clock.now_ms(), Change::Heartbeat { id }).await;
    }
}

fn health_of(nodes: &BTreeMap<NodeId, Node>, observer: NodeId, id: NodeId) -> Health {
    cluster(nodes, observer).members()[&id].lease.health
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_leader_commits_suspect_then_down_for_a_silent_member() {
    let dir = tempfile::tempdir().unwrap();
    let network = LocalNetwork::new();
    let nodes = start_all(dir.path(), &network).await;
    let members: BTreeMap<NodeId, BasicNode> = IDS
        .iter()
        .map(|&id| (id, BasicNode::new(format!("local:{id}"))))
        .collect();
    nodes[&1]
        .raft
        .initialize(members)
        .await
        .expect("initialize");
    let lead = leader(&nodes, &IDS).await;
    let clock = SystemClock;
    let policy = HealthPolicy {
        suspect_after_ms: 1_000,
        down_after_ms: 2_000,
    };
    write(
        &nodes,
        lead,
        clock.now_ms(),
        Change::SetHealthPolicy(policy),
    )
    .await;
    for id in IDS {
        write(&nodes, lead, clock.now_ms(), Change::AddMember(spec(id))).await;
    }
    let drivers: Vec<_> = nodes
        .values()
        .map(|node| {
            let driver = LeaseDriver::new(
                node.raft.clone(),
                node.state.clone(),
                Arc::new(SystemClock),
                Duration::from_millis(50),
            );
            tokio::spawn(driver.run())
        })
        .collect();

    // Everyone heartbeats past the new leader's grace period, then member 3 falls silent.
    let started = tokio::time::Instant::now();
    while started.elapsed() < Duration::from_millis(2_500) {
        heartbeat(&nodes, &IDS, &clock).await;
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let mut seen = Vec::new();
    let deadline = tokio::time::Instant::now() + TIMEOUT;
    while seen.last() != Some(&Health::Down) {
        assert!(
            tokio::time::Instant::now() < deadline,
            "member 3 never went down: {seen:?}"
        );
        heartbeat(&nodes, &[1, 2], &clock).await;
        let health = health_of(&nodes, lead, 3);
        if seen.last() != Some(&health) {
            seen.push(health);
        }
        for id in [1, 2] {
            assert_eq!(health_of(&nodes, lead, id), Health::Alive, "member {id}");
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_eq!(seen, vec![Health::Alive, Health::Suspect, Health::Down]);
    let state = cluster(&nodes, lead);
    assert!(!state.ring().members().contains_key(&3));
    assert_eq!(state.ring().members().len(), 2);

    // It heartbeats again and is back in the ring.
    heartbeat(&nodes, &[3], &clock).await;
    assert_eq!(health_of(&nodes, lead, 3), Health::Alive);
    assert!(cluster(&nodes, lead).ring().members().contains_key(&3));

    // Every replica committed the same verdicts.
    assert_converged(&nodes, &IDS).await;

    for node in nodes.values() {
        node.raft.shutdown().await.expect("shutdown");
    }
    for driver in drivers {
        tokio::time::timeout(TIMEOUT, driver)
            .await
            .expect("the driver stops with its raft node")
            .expect("driver task");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn linearizable_reads_come_only_from_a_confirmed_leader() {
    let dir = tempfile::tempdir().unwrap();
    let network = LocalNetwork::new();
    let nodes = start_all(dir.path(), &network).await;
    let members: BTreeMap<NodeId, BasicNode> = IDS
        .iter()
        .map(|&id| (id, BasicNode::new(format!("local:{id}"))))
        .collect();
    nodes[&1]
        .raft
        .initialize(members)
        .await
        .expect("initialize");
    let old = leader(&nodes, &IDS).await;
    write(&nodes, old, 1, Change::PutTenant { name: "a".into() }).await;
    let has = |name: &'static str| move |s: &ClusterState| s.tenants().tenants().contains_key(name);

    let node = &nodes[&old];
    assert!(
        read_linearizable(&node.raft, &node.state, has("a"))
            .await
            .expect("the leader answers")
    );
    let follower = IDS.iter().copied().find(|&id| id != old).unwrap();
    let node = &nodes[&follower];
    let refused = read_linearizable(&node.raft, &node.state, has("a")).await;
    assert!(
        matches!(&refused, Err(e) if e.forward_to_leader().is_some()),
        "a follower answered: {refused:?}"
    );

    // A leader cut off from its quorum must not answer from its (soon stale) state.
    network.cut(old);
    let rest: Vec<NodeId> = IDS.iter().copied().filter(|&id| id != old).collect();
    let new = leader(&nodes, &rest).await;
    write(&nodes, new, 2, Change::PutTenant { name: "b".into() }).await;
    let node = &nodes[&old];
    let stale = tokio::time::timeout(
        Duration::from_secs(2),
        read_linearizable(&node.raft, &node.state, has("b")),
    )
    .await;
    assert!(
        !matches!(stale, Ok(Ok(_))),
        "a cut-off leader answered: {stale:?}"
    );
    let node = &nodes[&new];
    assert!(
        read_linearizable(&node.raft, &node.state, has("b"))
            .await
            .expect("the leader answers")
    );

    network.heal(old);
    for node in nodes.values() {
        node.raft.shutdown().await.expect("shutdown");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn voters_change_online_and_the_new_membership_survives_restart() {
    let dir = tempfile::tempdir().unwrap();
    let network = LocalNetwork::new();
    let mut nodes = start_all(dir.path(), &network).await;
    let members: BTreeMap<NodeId, BasicNode> = IDS
        .iter()
        .map(|&id| (id, BasicNode::new(format!("local:{id}"))))
        .collect();
    nodes[&1]
        .raft
        .initialize(members)
        .await
        .expect("initialize");
    let lead = leader(&nodes, &IDS).await;
    for i in 0..12 {
        let name = format!("t{i}");
        write(&nodes, lead, i, Change::PutTenant { name }).await;
    }

    // Node 4 joins as a learner, is promoted, and node 1 leaves: {1,2,3} -> {2,3,4}.
    nodes.insert(4, start(4, dir.path(), &network).await);
    nodes[&lead]
        .raft
        .add_learner(4, BasicNode::new("local:4"), true)
        .await
        .expect("add learner");
    nodes[&lead]
        .raft
        .change_membership([1, 2, 3, 4], false)
        .await
        .expect("promote 4");
    let lead = leader(&nodes, &[1, 2, 3, 4]).await;
    nodes[&lead]
        .raft
        .change_membership([2, 3, 4], false)
        .await
        .expect("remove 1");
    let voters = [2, 3, 4];
    let lead = leader(&nodes, &voters).await;
    let last = write(
        &nodes,
        lead,
        100,
        Change::PutTenant {
            name: "after".into(),
        },
    )
    .await;
    applied(&nodes, &voters, last).await;
    assert_converged(&nodes, &voters).await;
    for id in voters {
        let membership = nodes[&id].state.get().membership;
        let got: Vec<NodeId> = membership.membership().voter_ids().collect();
        assert_eq!(got, voters, "node {id}");
    }
    let before = cluster(&nodes, lead);
    assert_eq!(before.tenants().tenants().len(), 13);

    // Restart the new voters from disk: they elect among themselves, with the same state.
    for node in nodes.values() {
        node.raft.shutdown().await.expect("shutdown");
    }
    for &id in nodes.keys() {
        network.detach(id);
    }
    drop(nodes);
    let mut nodes = BTreeMap::new();
    for id in voters {
        nodes.insert(id, start(id, dir.path(), &network).await);
    }
    leader(&nodes, &voters).await;
    applied(&nodes, &voters, last).await;
    for id in voters {
        assert_eq!(cluster(&nodes, id), before, "node {id}");
    }
    for node in nodes.values() {
        node.raft.shutdown().await.expect("shutdown");
    }
}
