//! A registry of names written and read through the topology group by clients speaking its own
//! QUIC protocol, every operation recorded on one clock for the linearizability checker: what
//! the raft failover bench and the cluster chaos test run beside their faults. Writes are
//! `PutTenant` of distinct names; reads are linearizable reads reporting on a sample of names.
//! A write whose answer never came (a timeout across a kill) may or may not have been applied;
//! one refused as "not the leader" or never sent was not, and is left out.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use strata_topology::state::{Change, Command, Rejection};
use strata_topology::transport::wire::{ClusterView, Refusal, Request, Response};
use strata_topology::transport::{Client, ClientError};

use super::{Operation, SetInput, SetModel, SetOutput, Verdict, check};

/// A writer's pause between calls: what keeps the registry (and so each read of it) from
/// growing faster than the machine can serve.
pub const WRITE_PAUSE: Duration = Duration::from_millis(10);
const READ_PAUSE: Duration = Duration::from_millis(50);
/// Keys each mid-run read reports on: the most recently invoked writes (the interesting,
/// concurrent ones) and a few older ones.
const READ_RECENT: usize = 4;
const READ_OLDER: usize = 2;
/// Search steps per key for the checker; each key has one write, so this is never approached.
pub const CHECK_BUDGET: u64 = 1_000_000;

pub type SetOperation = Operation<SetInput, SetOutput>;

/// The operations clients recorded, on one monotonic clock.
pub struct Journal {
    start: Instant,
    ops: Mutex<Vec<SetOperation>>,
    /// Every name a writer has tried, in invocation order.
    pub invoked: Mutex<Vec<String>>,
    tally: Mutex<Tally>,
}

#[derive(Debug, Default, Clone, Copy)]
pub struct Tally {
    pub acked: u64,
    pub unknown: u64,
    /// Refused as "not the leader" or never sent: not applied.
    pub refused: u64,
    pub reads: u64,
}

impl Journal {
    pub fn new() -> Self {
        Self {
            start: Instant::now(),
            ops: Mutex::default(),
            invoked: Mutex::default(),
            tally: Mutex::default(),
        }
    }

    pub fn now(&self) -> Duration {
        self.start.elapsed()
    }

    pub fn ops(&self) -> std::sync::MutexGuard<'_, Vec<SetOperation>> {
        self.ops.lock().unwrap_or_else(PoisonError::into_inner)
    }

    pub fn tally(&self) -> Tally {
        *self.tally.lock().unwrap_or_else(PoisonError::into_inner)
    }

    pub fn count(&self, bump: impl FnOnce(&mut Tally)) {
        bump(&mut self.tally.lock().unwrap_or_else(PoisonError::into_inner));
    }

    pub fn invoke(&self, name: &str) {
        self.invoked
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .push(name.to_string());
    }

    /// Names for a read to report on: the latest invoked, and older ones spread by `salt`.
    pub fn sample(&self, salt: usize) -> Vec<String> {
        let invoked = self.invoked.lock().unwrap_or_else(PoisonError::into_inner);
        let mut names: Vec<String> = invoked.iter().rev().take(READ_RECENT).cloned().collect();
        if !invoked.is_empty() {
            for k in 0..READ_OLDER {
                let i = salt.wrapping_mul(7919).wrapping_add(k * 104_729) % invoked.len();
                names.push(invoked[i].clone());
            }
        }
        names
    }

    /// How many operations are recorded: a mark to scan from later.
    pub fn mark(&self) -> usize {
        self.ops().len()
    }

    /// The earliest answer to a write invoked at or after `since` that was acknowledged, among
    /// the operations recorded after `mark` (an operation is recorded after its answer, so
    /// none invoked after `since` sits before a mark taken at `since`).
    pub fn first_ack_since(&self, since: Duration, mark: usize) -> Option<Duration> {
        self.ops()[mark..]
            .iter()
            .filter(|op| matches!(op.input, SetInput::Add(_)) && op.invoked >= since)
            .filter_map(|op| match op.returned {
                Some((at, SetOutput::Done)) => Some(at),
                _ => None,
            })
            .min()
    }
}

pub fn unix_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
}

/// Writes distinct tenant names through the members at `homes` until `stop`, recording each;
/// a writer moves to the next home when its own refuses or cannot be reached (a bench pins one
/// writer to each member by giving it one home).
pub async fn write_loop(
    client: Client,
    homes: Vec<String>,
    tag: String,
    journal: Arc<Journal>,
    stop: Arc<AtomicBool>,
) {
    let mut seq = 0u64;
    let mut turn = 0usize;
    while !stop.load(Ordering::Relaxed) {
        let name = format!("{tag}-{seq}");
        seq += 1;
        journal.invoke(&name);
        let invoked = journal.now();
        let change = Change::PutTenant { name: name.clone() };
        let request = Request::Propose(Command::new(unix_ms(), change));
        let answer = client.call(&homes[turn % homes.len()], &request).await;
        let at = journal.now();
        let returned = match answer {
            Ok(Response::Proposed { outcome, .. }) => {
                journal.count(|t| t.acked += 1);
                // A name is written once: anything but success is the model's to judge.
                match outcome {
                    Ok(_) => Some((at, SetOutput::Done)),
                    Err(Rejection::AlreadyExists(_)) => Some((at, SetOutput::Unchanged)),
                    Err(other) => {
                        eprintln!("write {name} rejected: {other}");
                        Some((at, SetOutput::Unchanged))
                    }
                }
            }
            // Refused before raft took it, or taken and then truncated by a new leader
            // (openraft answers a truncated entry with ForwardToLeader): not applied.
            Ok(Response::Refused(Refusal::NotLeader { .. }))
            | Err(ClientError::Connect { .. } | ClientError::Resolve { .. }) => {
                journal.count(|t| t.refused += 1);
                turn += 1;
                tokio::time::sleep(WRITE_PAUSE).await;
                continue;
            }
            _ => {
                journal.count(|t| t.unknown += 1);
                None
            }
        };
        journal.ops().push(Operation {
            client: 0,
            input: SetInput::Add(name),
            invoked,
            returned,
        });
        tokio::time::sleep(WRITE_PAUSE).await;
    }
}

/// Linearizable reads through the members in turn until `stop`, each recorded as membership
/// answers for a sample of names.
pub async fn read_loop(
    client: Client,
    addrs: Vec<String>,
    journal: Arc<Journal>,
    stop: Arc<AtomicBool>,
) {
    let mut turn = 0usize;
    while !stop.load(Ordering::Relaxed) {
        turn += 1;
        let names = journal.sample(turn);
        let invoked = journal.now();
        // A read that fails has no effect: it is left out of the history.
        if let Ok(view) = client.read(&addrs[turn % addrs.len()]).await {
            let at = journal.now();
            record_reads(&journal, &view, names, invoked, at);
        }
        tokio::time::sleep(READ_PAUSE).await;
    }
}

pub fn record_reads(
    journal: &Journal,
    view: &ClusterView,
    names: Vec<String>,
    invoked: Duration,
    at: Duration,
) {
    let tenants = view.cluster.tenants().tenants();
    let mut ops = journal.ops();
    for name in names {
        let present = tenants.contains_key(&name);
        ops.push(Operation {
            client: 1,
            input: SetInput::Contains(name),
            invoked,
            returned: Some((at, SetOutput::Present(present))),
        });
    }
    drop(ops);
    journal.count(|t| t.reads += 1);
}

/// Acknowledged writes the final read does not show.
pub fn lost_writes(history: &[SetOperation], last: &ClusterView) -> Vec<String> {
    let tenants = last.cluster.tenants().tenants();
    history
        .iter()
        .filter_map(|op| match (&op.input, &op.returned) {
            (SetInput::Add(name), Some((_, SetOutput::Done))) if !tenants.contains_key(name) => {
                Some(name.clone())
            }
            _ => None,
        })
        .collect()
}

/// The gate's canary: the same history with one acknowledged write missing from the final read
/// must be rejected by the checker.
pub fn canary_caught(history: &[SetOperation]) -> bool {
    let Some(name) = history
        .iter()
        .find_map(|op| match (&op.input, &op.returned) {
            (SetInput::Add(name), Some((_, SetOutput::Done))) => Some(name.clone()),
            _ => None,
        })
    else {
        return false;
    };
    let key = SetInput::Contains(name.clone());
    let mut ops: Vec<SetOperation> = history
        .iter()
        .filter(|op| matches!(&op.input, SetInput::Add(n) | SetInput::Contains(n) if *n == name))
        .cloned()
        .collect();
    let Some(last_read) = ops.iter().rposition(|op| op.input == key) else {
        return false;
    };
    ops[last_read].returned = ops[last_read]
        .returned
        .map(|(at, _)| (at, SetOutput::Present(false)));
    matches!(
        check(&SetModel, &ops, CHECK_BUDGET),
        Verdict::Violation { .. }
    )
}
