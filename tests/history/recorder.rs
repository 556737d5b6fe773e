//! A writer and a reader of the topology group recording what they see, for tests that put the
//! group through faults (process kills, partitions) and then check the history: linearizable,
//! no acknowledged write lost, and the checker's canary caught.

use std::net::SocketAddr;
use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use strata_topology::transport::wire::ClusterView;
use strata_topology::transport::{Client, OperatorIdentity, operator_endpoint};

use super::registry::{
    CHECK_BUDGET, Journal, SetOperation, canary_caught, lost_writes, read_loop, record_reads,
    write_loop,
};
use super::{SetModel, Verdict, check};

/// A writer and a reader of the topology group on a runtime of their own, recording what they
/// see until `stop`; the thread answers with the history and a final read.
pub struct GroupHistory {
    stop: Arc<AtomicBool>,
    thread: std::thread::JoinHandle<(Vec<SetOperation>, ClusterView)>,
}

impl GroupHistory {
    pub fn record(identity: &Path, members: Vec<String>) -> Self {
        let identity = OperatorIdentity::load(identity).expect("the routers' operator identity");
        let stop = Arc::new(AtomicBool::new(false));
        let stopped = stop.clone();
        let thread = std::thread::spawn(move || {
            let runtime = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .unwrap();
            runtime.block_on(async move {
                let local = SocketAddr::from(([0, 0, 0, 0], 0));
                let endpoint = operator_endpoint(&identity, local).unwrap();
                let client = Client::new(endpoint, Duration::from_secs(1));
                let journal = Arc::new(Journal::new());
                let tasks = [
                    tokio::spawn(write_loop(
                        client.clone(),
                        members.clone(),
                        "chaos".into(),
                        journal.clone(),
                        stopped.clone(),
                    )),
                    tokio::spawn(read_loop(
                        client.clone(),
                        members.clone(),
                        journal.clone(),
                        stopped,
                    )),
                ];
                for task in tasks {
                    task.await.unwrap();
                }
                // The final read reports on every name the writer tried.
                let invoked = journal.now();
                let deadline = Instant::now() + Duration::from_secs(30);
                let view = 'read: loop {
                    for member in &members {
                        if let Ok(view) = client.read(member).await {
                            break 'read view;
                        }
                    }
                    assert!(Instant::now() < deadline, "no member answers a read");
                    tokio::time::sleep(Duration::from_millis(200)).await;
                };
                let names = journal.invoked.lock().unwrap().clone();
                record_reads(&journal, &view, names, invoked, journal.now());
                let history = journal.ops().clone();
                (history, view)
            })
        });
        Self { stop, thread }
    }

    /// Stops recording and checks the history: linearizable, no acknowledged write lost, and
    /// the checker's canary (one acknowledged write hidden from the last read) caught.
    pub fn check(self) {
        self.stop.store(true, Ordering::Relaxed);
        let (history, view) = self.thread.join().expect("the group's clients panicked");
        let writes = history
            .iter()
            .filter(|op| matches!(op.input, super::SetInput::Add(_)))
            .count();
        assert!(writes > 10, "too few writes reached the group: {writes}");
        let lost = lost_writes(&history, &view);
        assert!(lost.is_empty(), "acknowledged writes lost: {lost:?}");
        let verdict = check(&SetModel, &history, CHECK_BUDGET);
        if let Verdict::Violation { key } = &verdict {
            // What a failure needs to be understood: every operation on the key, on the
            // journal's clock (it starts when the recording does).
            let ops: Vec<String> = history
                .iter()
                .filter(|op| match &op.input {
                    super::SetInput::Add(k)
                    | super::SetInput::Remove(k)
                    | super::SetInput::Contains(k) => k == key,
                })
                .map(|op| format!("{op:?}"))
                .collect();
            let written = history
                .iter()
                .any(|op| matches!(&op.input, super::SetInput::Add(k) if k == key));
            panic!(
                "the group's history is not linearizable on {key}{}:\n{}",
                if written {
                    ""
                } else {
                    " (its write was refused as not the leader's, or never sent, so left out)"
                },
                ops.join("\n")
            );
        }
        assert_eq!(verdict, Verdict::Linearizable);
        assert!(
            canary_caught(&history),
            "the checker's canary was not caught"
        );
        eprintln!(
            "group history: {} operations, {writes} writes, linearizable",
            history.len()
        );
    }
}
