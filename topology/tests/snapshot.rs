//! A snapshot larger than a wire frame reaches a new member over real QUIC: the state grows past
//! [`MAX_FRAME`] (members declaring megabyte labels), the log is purged behind a snapshot, and
//! a learner added afterwards can only catch up by installing that snapshot, which raft sends
//! in chunks well under the frame limit. The learner ends with the leader's state, byte for
//! byte.

mod common;

use std::sync::Arc;
use std::time::Duration;

use common::{Group, TestCa};
use openraft::SnapshotPolicy;
use strata_topology::server::Timing;
use strata_topology::state::{Change, Command, Rejection};
use strata_topology::transport::wire::MAX_FRAME;

const TIMEOUT: Duration = Duration::from_secs(120);
/// Members with a label this long: 18 of them make the state larger than a frame.
const LABEL: usize = 1 << 20;
const BIG_MEMBERS: u64 = 18;

/// The server's raft settings (snapshot chunks and their timeout included), with snapshots
/// taken often and no log kept behind them, and slower elections: a debug build spends tens of
/// milliseconds encoding each megabyte frame on the runtime's two threads, which would delay
/// heartbeats past the default timeouts.
fn group() -> Group {
    let timing = Timing {
        raft_heartbeat_ms: 200,
        election_timeout_min_ms: 3_000,
        election_timeout_max_ms: 6_000,
        // Each snapshot chunk gets this too: a debug build on a loaded machine can take seconds
        // to encode and decode a megabyte chunk as JSON.
        rpc_timeout_ms: 20_000,
        ..Timing::default()
    };
    let mut config = (*timing.raft_config("strata-snapshot").expect("valid")).clone();
    config.snapshot_policy = SnapshotPolicy::LogsSinceLast(8);
    config.max_in_snapshot_log_to_keep = 0;
    config.purge_batch_size = 1;
    Group {
        raft: Arc::new(config.validate().expect("valid raft config")),
        rpc_timeout: timing.rpc_timeout(),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_snapshot_larger_than_a_frame_reaches_a_new_learner_in_chunks() {
    let ca = TestCa::new();
    let (members, addr) = common::start_group(&ca, &group(), 1..=4, 3, TIMEOUT).await;
    let client = common::operator(&ca.issue(1000), Duration::from_secs(30));

    // Member 4 belongs to no group yet, so the leader is always one of the voters.
    // Members declaring megabyte labels (distinct bytes, so nothing in the path can shrink them).
    for i in 0..BIG_MEMBERS {
        let mut spec = common::spec(100 + i, &format!("10.0.0.{i}:7000"));
        let fill = (b'a' + (i % 26) as u8) as char;
        spec.labels
            .insert("blob".into(), std::iter::repeat_n(fill, LABEL).collect());
        let command = Command::new(0, Change::AddMember(spec));
        // Megabyte entries are slow in a debug build: an election may come between them.
        let deadline = std::time::Instant::now() + TIMEOUT;
        loop {
            let leader = common::wait_for_leader(&members, TIMEOUT).await;
            match client.propose(&addr[&leader], command.clone()).await {
                Ok((_, Ok(_) | Err(Rejection::MemberExists(_)))) => break,
                Ok((_, Err(e))) => panic!("member refused: {e}"),
                Err(e) => assert!(std::time::Instant::now() < deadline, "never added: {e}"),
            }
        }
    }
    let leader = common::wait_for_leader(&members, TIMEOUT).await;
    let state = members[&leader].service.state.get().cluster;
    let bytes = serde_json::to_vec(&state).expect("serialize").len();
    assert!(bytes > MAX_FRAME, "the state is only {bytes} bytes");

    // A snapshot of everything, and no log behind it.
    let raft = &members[&leader].raft;
    raft.trigger().snapshot().await.expect("trigger a snapshot");
    let last = raft.metrics().borrow().last_applied;
    raft.wait(Some(TIMEOUT))
        .snapshot(last.expect("applied"), "snapshot of the whole log")
        .await
        .expect("snapshot built");
    raft.trigger()
        .purge_log(last.expect("applied").index)
        .await
        .expect("purge");
    raft.wait(Some(TIMEOUT))
        .purged(last, "log purged")
        .await
        .expect("log purged");

    // Member 4 joins as a learner: only the snapshot can bring it up to date.
    if let Err(e) = client.add_learner(&addr[&leader], 4, &addr[&4]).await {
        let m = members[&leader].raft.metrics().borrow().clone();
        panic!("add learner 4: {e}; leader metrics {m:?}");
    }
    let learner = &members[&4].raft;
    learner
        .wait(Some(TIMEOUT))
        .applied_index_at_least(last.map(|l| l.index), "caught up")
        .await
        .expect("the learner caught up");
    let installed = learner.metrics().borrow().snapshot;
    assert!(
        installed.is_some_and(|s| Some(s) <= last && s.index > 0),
        "the learner caught up without installing the snapshot: {installed:?}"
    );
    assert_eq!(
        members[&4].service.state.get().cluster,
        state,
        "the learner's state differs from the leader's"
    );
    eprintln!("snapshot: {bytes} bytes of state installed on a new learner");
    for member in members.into_values() {
        member.kill().await;
    }
}
