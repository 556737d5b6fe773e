//! Membership churn under write load over real QUIC: two clients keep adding names and reading
//! them back while the voter set goes {1,2,3} → {1,2,3,4} → {2,3,4} → {2,3,4,5} → {3,4,5}
//! (learners added, promoted, voters removed — the first leader among them). Every operation is
//! recorded with its invocation and answer times, and the history goes through the
//! linearizability checker (`tests/history`, Wing & Gong with Lowe's memoization): every
//! acknowledged add must be there at the end and every read must have a place in one sequential
//! order. The canary — a client that acknowledges an add it sent to a removed member without
//! waiting for the commit — must fail the same check.

mod common;
#[path = "../../tests/history/mod.rs"]
mod history;

use std::collections::BTreeSet;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use common::{Group, TestCa};
use history::{Operation, SetInput, SetModel, SetOutput, Verdict, check};
use strata_topology::NodeId;
use strata_topology::state::{Change, Command, Rejection};
use strata_topology::transport::wire::{ClusterView, MembershipChange, Refusal};
use strata_topology::transport::{Client, ClientError};
use tokio::sync::Mutex;

const TIMEOUT: Duration = Duration::from_secs(30);
const BUDGET: u64 = 5_000_000;

type Op = Operation<SetInput, SetOutput>;

fn group() -> Group {
    Group::new("strata-churn", 50, (300, 600), Duration::from_secs(1))
}

/// Adds `name` through any of `addrs` (redirected to the leader); the answer, or `None` when
/// the client never learned the outcome.
async fn add(client: &Client, addrs: &[String], name: &str) -> Option<SetOutput> {
    let command = Command::new(
        0,
        Change::PutTenant {
            name: name.to_string(),
        },
    );
    for addr in addrs {
        match client.propose(addr, command.clone()).await {
            Ok((_, Ok(_))) => return Some(SetOutput::Done),
            Ok((_, Err(Rejection::AlreadyExists(_)))) => return Some(SetOutput::Unchanged),
            // Refused before raft saw it (not the leader, none known): the next member.
            Err(ClientError::Refused {
                refusal: Refusal::NotLeader { .. },
                ..
            }) => continue,
            // The proposal may have reached a leader before the error: unknown, not a retry.
            Ok((_, Err(_))) | Err(_) => return None,
        }
    }
    None
}

/// A linearizable read of whether `name` is there, through the first member that answers.
async fn contains(client: &Client, addrs: &[String], name: &str) -> Option<SetOutput> {
    for addr in addrs {
        if let Ok(view) = client.read(addr).await {
            return Some(SetOutput::Present(
                view.cluster.tenants().tenants().contains_key(name),
            ));
        }
    }
    None
}

struct Recorder {
    start: Instant,
    ops: Mutex<Vec<Op>>,
}

impl Recorder {
    async fn record<F>(&self, client: usize, input: SetInput, run: F) -> Option<SetOutput>
    where
        F: std::future::Future<Output = Option<SetOutput>>,
    {
        let invoked = self.start.elapsed();
        let answer = run.await;
        let returned = answer.map(|a| (self.start.elapsed(), a));
        self.ops.lock().await.push(Operation {
            client,
            input,
            invoked,
            returned,
        });
        answer
    }
}

/// Applies one membership step through whichever member answers, until it succeeds.
async fn step(client: &Client, addrs: &[String], what: &str, change: impl Fn() -> Request) {
    let deadline = Instant::now() + TIMEOUT;
    loop {
        for addr in addrs {
            let done = match change() {
                Request::Learner(id, learner_addr) => {
                    client.add_learner(addr, id, &learner_addr).await.is_ok()
                }
                Request::Members(change) => client.change_membership(addr, change).await.is_ok(),
            };
            if done {
                return;
            }
        }
        assert!(
            Instant::now() < deadline,
            "membership step never applied: {what}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

enum Request {
    Learner(NodeId, String),
    Members(MembershipChange),
}

/// A linearizable read through any of `addrs`, waiting out an election.
async fn settled_view(client: &Client, addrs: &[String]) -> ClusterView {
    let deadline = Instant::now() + TIMEOUT;
    loop {
        for addr in addrs {
            if let Ok(view) = client.read(addr).await {
                return view;
            }
        }
        assert!(
            Instant::now() < deadline,
            "no member of {addrs:?} served a read"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

fn ids(v: &[NodeId]) -> BTreeSet<NodeId> {
    v.iter().copied().collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn writes_stay_linearizable_while_voters_are_added_and_removed() {
    let ca = TestCa::new();
    let (members, addr) = common::start_group(&ca, &group(), 1..=5, 3, TIMEOUT).await;
    let all: Vec<String> = addr.values().cloned().collect();
    let recorder = Arc::new(Recorder {
        start: Instant::now(),
        ops: Mutex::new(Vec::new()),
    });
    let stop = Arc::new(AtomicBool::new(false));

    // Two writers: adds of fresh names, and reads of their own, the other's, and absent names.
    let mut writers = Vec::new();
    for client_id in 0..2usize {
        let client = common::operator(&ca.issue(1000 + client_id as u64), Duration::from_secs(2));
        let (recorder, stop, addrs) = (Arc::clone(&recorder), Arc::clone(&stop), all.clone());
        writers.push(tokio::spawn(async move {
            let mut i = 0usize;
            while !stop.load(Ordering::Relaxed) {
                let name = format!("c{client_id}-{i}");
                let answer = recorder
                    .record(
                        client_id,
                        SetInput::Add(name.clone()),
                        add(&client, &addrs, &name),
                    )
                    .await;
                if answer.is_none() {
                    // Mid-election: do not spin.
                    tokio::time::sleep(Duration::from_millis(20)).await;
                }
                if i % 3 == 2 {
                    let probe = match i % 4 {
                        0 => format!("c{}-{}", 1 - client_id, i / 2),
                        1 => format!("never-{i}"),
                        _ => format!("c{client_id}-{}", i / 2),
                    };
                    recorder
                        .record(
                            client_id,
                            SetInput::Contains(probe.clone()),
                            contains(&client, &addrs, &probe),
                        )
                        .await;
                }
                i += 1;
            }
            i
        }));
    }

    // The churn, while they write.
    let admin = common::operator(&ca.issue(2000), Duration::from_secs(2));
    let voters = |v: &[NodeId]| Request::Members(MembershipChange::AddVoters(ids(v)));
    let remove = |v: &[NodeId]| Request::Members(MembershipChange::RemoveVoters(ids(v)));
    tokio::time::sleep(Duration::from_millis(300)).await;
    step(&admin, &all, "add learner 4", || {
        Request::Learner(4, addr[&4].clone())
    })
    .await;
    step(&admin, &all, "promote 4", || voters(&[4])).await;
    step(&admin, &all, "remove voter 1", || remove(&[1])).await;
    step(&admin, &all, "add learner 5", || {
        Request::Learner(5, addr[&5].clone())
    })
    .await;
    step(&admin, &all, "promote 5", || voters(&[5])).await;
    step(&admin, &all, "remove voter 2", || remove(&[2])).await;
    tokio::time::sleep(Duration::from_millis(500)).await;
    stop.store(true, Ordering::Relaxed);
    let mut written = 0;
    for w in writers {
        written += w.await.expect("writer");
    }

    // The group is {3, 4, 5}; members 1 and 2 are out of it.
    let survivors: Vec<String> = [3, 4, 5].iter().map(|id| addr[id].clone()).collect();
    let view = settled_view(&admin, &survivors).await;
    assert_eq!(view.voters, ids(&[3, 4, 5]));

    // The canary client acknowledges an add it sent to removed member 1 without waiting.
    let canary_name = "canary-acked-before-commit".to_string();
    let canary = {
        let invoked = recorder.start.elapsed();
        let _ = tokio::time::timeout(
            Duration::from_millis(300),
            add(&admin, std::slice::from_ref(&addr[&1]), &canary_name),
        )
        .await;
        Operation {
            client: 99,
            input: SetInput::Add(canary_name.clone()),
            invoked,
            returned: Some((recorder.start.elapsed(), SetOutput::Done)),
        }
    };

    // A final read of every name, through the new group.
    let names: BTreeSet<String> = recorder
        .ops
        .lock()
        .await
        .iter()
        .map(|op| match &op.input {
            SetInput::Add(n) | SetInput::Remove(n) | SetInput::Contains(n) => n.clone(),
        })
        .chain([canary_name.clone()])
        .collect();
    let final_view = settled_view(&admin, &survivors).await;
    let (read_at, read_done) = (recorder.start.elapsed(), recorder.start.elapsed());
    let mut history = recorder.ops.lock().await.clone();
    let acked: Vec<String> = history
        .iter()
        .filter(|op| matches!(op.returned, Some((_, SetOutput::Done))))
        .map(|op| match &op.input {
            SetInput::Add(n) | SetInput::Remove(n) | SetInput::Contains(n) => n.clone(),
        })
        .collect();
    for name in &names {
        history.push(Operation {
            client: 100,
            input: SetInput::Contains(name.clone()),
            invoked: read_at,
            returned: Some((
                read_done,
                SetOutput::Present(final_view.cluster.tenants().tenants().contains_key(name)),
            )),
        });
    }
    for name in &acked {
        assert!(
            final_view.cluster.tenants().tenants().contains_key(name),
            "acknowledged add {name} lost"
        );
    }
    let unknown = history.iter().filter(|op| op.returned.is_none()).count();
    eprintln!(
        "churn: {written} adds, {} acknowledged, {unknown} unknown, {} operations checked",
        acked.len(),
        history.len()
    );
    assert!(
        acked.len() > 10,
        "too few writes went through: {}",
        acked.len()
    );
    assert_eq!(check(&SetModel, &history, BUDGET), Verdict::Linearizable);

    // The canary must fail the same check.
    history.push(canary);
    assert_eq!(
        check(&SetModel, &history, BUDGET),
        Verdict::Violation { key: canary_name }
    );

    for member in members.into_values() {
        member.kill().await;
    }
}
