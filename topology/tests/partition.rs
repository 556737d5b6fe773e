//! Partitions over real QUIC: five voters on 127.0.0.1, each behind a UDP proxy that drops what
//! the test cuts (`common::proxy`). The leader cut off with one follower cannot commit or serve
//! a linearizable read; the three-member majority elects a leader and keeps committing; once
//! healed, every member converges on one state holding every acknowledged write and none of the
//! writes the minority was asked for. A follower cut off alone costs the majority nothing.

mod common;

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::proxy::{Faults, Proxy};
use common::{Group, Member, TestCa, leader_of, local};
use openraft::BasicNode;
use strata_topology::NodeId;
use strata_topology::state::{Change, Command, Rejection};
use strata_topology::transport::wire::Refusal;
use strata_topology::transport::{Client, ClientError};

const TIMEOUT: Duration = Duration::from_secs(20);

fn group() -> Group {
    Group::new("strata-partition", 50, (300, 600), Duration::from_secs(1))
}

/// Five members, each known to the others by its proxy's address.
struct Cluster {
    _ca: TestCa,
    members: BTreeMap<NodeId, Member>,
    /// Real (bound) addresses: an operator's client reaches a member directly, never cut off.
    direct: BTreeMap<NodeId, SocketAddr>,
    faults: Arc<Faults>,
    _proxies: Vec<Proxy>,
    client: Client,
}

impl Cluster {
    async fn start(voters: u64) -> Cluster {
        let ca = TestCa::new();
        let faults = Arc::new(Faults::default());
        let (mut members, mut direct, mut proxies) = (BTreeMap::new(), BTreeMap::new(), vec![]);
        let mut nodes = BTreeMap::new();
        for id in 1..=voters {
            let identity = ca.issue(id);
            let endpoint = common::bind(&identity, local(), TIMEOUT).await;
            let bound = endpoint.local_addr().expect("bound");
            let member = group()
                .start(&identity, &ca.store(id), endpoint, None)
                .await;
            faults.member(id, bound);
            let proxy = Proxy::start(id, bound, Arc::clone(&faults)).await;
            nodes.insert(id, BasicNode::new(proxy.addr.to_string()));
            direct.insert(id, bound);
            members.insert(id, member);
            proxies.push(proxy);
        }
        members[&1]
            .raft
            .initialize(nodes)
            .await
            .expect("initialize");
        let client = common::operator(&ca.issue(1000), Duration::from_millis(500));
        Cluster {
            _ca: ca,
            members,
            direct,
            faults,
            _proxies: proxies,
            client,
        }
    }

    /// Waits until one of `among` leads and has committed `name` through it.
    async fn write_through_leader(&self, among: &[NodeId], name: &str) -> NodeId {
        let subset: BTreeMap<NodeId, &Member> = self
            .members
            .iter()
            .filter(|(id, _)| among.contains(id))
            .map(|(id, m)| (*id, m))
            .collect();
        let deadline = Instant::now() + TIMEOUT;
        loop {
            let leader = subset
                .iter()
                .find(|(_, m)| m.raft.metrics().borrow().state == openraft::ServerState::Leader)
                .map(|(id, _)| *id);
            if let Some(leader) = leader
                && self.commit(leader, name).await
            {
                return leader;
            }
            assert!(
                Instant::now() < deadline,
                "no leader of {among:?} committed {name}"
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    /// Proposes tenant `name` to member `id` directly; true once it is known to be committed.
    async fn commit(&self, id: NodeId, name: &str) -> bool {
        let command = Command::new(
            0,
            Change::PutTenant {
                name: name.to_string(),
            },
        );
        matches!(
            self.client
                .propose(&self.direct[&id].to_string(), command)
                .await,
            Ok((_, Ok(_) | Err(Rejection::AlreadyExists(_))))
        )
    }

    /// Waits until every member has applied the same last entry and holds the same state.
    async fn converged(&self) {
        let deadline = Instant::now() + TIMEOUT;
        loop {
            let states: Vec<_> = self
                .members
                .values()
                .map(|m| {
                    (
                        m.raft.metrics().borrow().last_applied,
                        m.service.state.get().cluster,
                    )
                })
                .collect();
            if states.windows(2).all(|w| w[0] == w[1]) {
                return;
            }
            assert!(Instant::now() < deadline, "members never converged");
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    fn has(&self, id: NodeId, name: &str) -> bool {
        self.members[&id]
            .service
            .state
            .get()
            .cluster
            .tenants()
            .tenants()
            .contains_key(name)
    }

    async fn stop(self) {
        for member in self.members.into_values() {
            member.kill().await;
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cut_off_leader_cannot_commit_the_majority_continues_and_healing_converges() {
    let cluster = Cluster::start(5).await;
    let all: Vec<NodeId> = cluster.members.keys().copied().collect();
    let old = cluster.write_through_leader(&all, "before").await;

    // The leader and one follower on one side, three members on the other.
    let follower = *all.iter().find(|&&id| id != old).expect("five members");
    let minority = [old, follower];
    let majority: Vec<NodeId> = all
        .iter()
        .copied()
        .filter(|id| !minority.contains(id))
        .collect();
    cluster.faults.partition(&minority, &majority);
    let cut = Instant::now();

    // The majority elects one of its own and commits.
    let new = cluster.write_through_leader(&majority, "majority-1").await;
    let first_write = cut.elapsed();
    assert!(majority.contains(&new));
    assert!(cluster.write_through_leader(&majority, "majority-2").await == new);

    // Check-quorum: the old leader, unheard by a majority for longer than its lease, steps down
    // for its callers: a write or a read sent to it is refused at once as not the leader's,
    // naming no leader, instead of waiting out a timeout.
    for read in [false, true] {
        let asked = Instant::now();
        let addr = cluster.direct[&old].to_string();
        let refused = if read {
            cluster.client.read(&addr).await.map(|_| ())
        } else {
            let command = Command::new(
                0,
                Change::PutTenant {
                    name: "quorum".into(),
                },
            );
            cluster.client.propose(&addr, command).await.map(|_| ())
        };
        assert!(
            matches!(
                refused,
                Err(ClientError::Refused {
                    refusal: Refusal::NotLeader { leader: None, .. },
                    ..
                })
            ),
            "read {read}: {refused:?}"
        );
        assert!(
            asked.elapsed() < Duration::from_secs(1),
            "read {read}: {:?}",
            asked.elapsed()
        );
    }

    // The old leader, asked directly, commits nothing and serves no linearizable read.
    let applied_at_cut = cluster.members[&old].raft.metrics().borrow().last_applied;
    for attempt in 0..3 {
        let name = format!("minority-{attempt}");
        assert!(
            !cluster.commit(old, &name).await,
            "the cut-off leader acknowledged {name}"
        );
    }
    assert!(
        cluster
            .client
            .read(&cluster.direct[&old].to_string())
            .await
            .is_err(),
        "the cut-off leader served a linearizable read"
    );
    assert_eq!(
        cluster.members[&old].raft.metrics().borrow().last_applied,
        applied_at_cut,
        "the minority applied an entry while cut off"
    );

    // Healed: one state everywhere, with every acknowledged write and no minority write.
    cluster.faults.heal();
    cluster.write_through_leader(&all, "after").await;
    cluster.converged().await;
    for id in &all {
        for name in ["before", "majority-1", "majority-2", "after"] {
            assert!(cluster.has(*id, name), "member {id} lost {name}");
        }
        for attempt in 0..3 {
            let name = format!("minority-{attempt}");
            assert!(!cluster.has(*id, &name), "member {id} holds {name}");
        }
    }
    eprintln!("partition: the majority committed {first_write:?} after the cut");
    cluster.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_follower_cut_off_alone_costs_the_leader_nothing_and_catches_up() {
    let cluster = Cluster::start(5).await;
    let all: Vec<NodeId> = cluster.members.keys().copied().collect();
    let leader = cluster.write_through_leader(&all, "before").await;
    let alone = *all.iter().find(|&&id| id != leader).expect("five members");
    let rest: Vec<NodeId> = all.iter().copied().filter(|&id| id != alone).collect();
    cluster.faults.partition(&[alone], &rest);
    for i in 0..5 {
        let name = format!("while-cut-{i}");
        assert_eq!(
            cluster.write_through_leader(&rest, &name).await,
            leader,
            "the leader changed while only a follower was cut off"
        );
        assert!(!cluster.has(alone, &name));
    }
    assert_eq!(leader_of(&cluster.members), Some(leader));
    cluster.faults.heal();
    cluster.converged().await;
    for i in 0..5 {
        assert!(cluster.has(alone, &format!("while-cut-{i}")));
    }
    cluster.stop().await;
}
