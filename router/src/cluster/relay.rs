//! A request's life on the nodes: routed, relayed from its node, and moved to another node from
//! where it stood when its node fails (the module docs of `cluster`), or when a node refuses it
//! as busy (at its admission limit: the request tries the other nodes, and when all are busy
//! waits [`BUSY_BACKOFF`] and tries them again, for up to [`FAILOVER_WAIT`]).

use std::ops::ControlFlow;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use strata_engine_api::rpc::{KvFetch, NodeError, RefusalKind, RemoteStream};
use strata_protocol::{GenerateRequest, Resume, TokenEvent};
use tokio::sync::mpsc::UnboundedSender;
use tokio::sync::oneshot;

use super::{BUSY_BACKOFF, Cluster, FAILOVER_ATTEMPTS, FAILOVER_POLL, FAILOVER_WAIT, Node, Slot};

/// Where one request's attempts stand across the nodes.
#[derive(Default)]
struct Attempts {
    /// The incarnations that failed this request: each is left out of its later attempts, but
    /// the same node restarted is a new incarnation and may take it again (a rolling restart
    /// must not use up a long stream's nodes).
    failed: Vec<(Slot, u64)>,
    failures: Vec<String>,
    /// Nodes that refused it as busy (at their admission limit): healthy, so not failed; the
    /// request tries the others first and, when every node is busy, waits BUSY_BACKOFF and
    /// tries them all again, for up to FAILOVER_WAIT.
    busy: Vec<(Slot, u64)>,
    busy_since: Option<tokio::time::Instant>,
    /// The budget is per attempt and time, not per node: FAILOVER_ATTEMPTS attempts, and while
    /// no node can take it, waiting up to FAILOVER_WAIT for one to come (back).
    count: usize,
}

impl Attempts {
    /// `node`'s `incarnation` failed the request.
    fn fail(&mut self, node: &Node, incarnation: u64, why: String) {
        self.failures.push(why);
        self.failed.push((node.slot, incarnation));
    }

    /// Why no node could take the request.
    fn why(&self) -> String {
        if self.failures.is_empty() && self.busy_since.is_some() {
            "every node is at its admission limit; retry later".to_string()
        } else if self.failures.is_empty() {
            "no node is available".to_string()
        } else {
            format!(
                "no node could finish the request: {}",
                self.failures.join("; ")
            )
        }
    }
}

/// What the relay does next.
enum Next {
    Run(Arc<Node>, Option<KvFetch>),
    Again,
    Stop,
}

impl Cluster {
    /// [`Cluster::route`] leaving out the incarnations in `failed`; while none can take the
    /// request, polls for up to `wait` (a node restarting, or one reconnecting), unless the
    /// request is cancelled or its client goes away (`tx` closes) first.
    async fn route_within(
        &self,
        request: &GenerateRequest,
        failed: &[(Slot, u64)],
        wait: Duration,
        cancelled: &mut oneshot::Receiver<()>,
        tx: &UnboundedSender<TokenEvent>,
    ) -> Option<(Arc<Node>, Option<KvFetch>)> {
        let deadline = tokio::time::Instant::now() + wait;
        loop {
            let exclude: Vec<Slot> = self
                .nodes()
                .iter()
                .filter(|n| failed.contains(&(n.slot, n.incarnation())))
                .map(|n| n.slot)
                .collect();
            if let Some(found) = self.route(request, &exclude) {
                return Some(found);
            }
            // No node is connected at all: nothing will take the request before one is back,
            // and a new request is told so at once (503); this one is told the same now.
            let none_up = self.nodes().iter().all(|n| n.client().is_none());
            if none_up || tokio::time::Instant::now() >= deadline {
                return None;
            }
            tokio::select! {
                () = tokio::time::sleep(FAILOVER_POLL) => {}
                _ = &mut *cancelled => return None,
                () = tx.closed() => return None,
            }
        }
    }

    /// Runs `request` on a node, moving it to another when its node fails, until it ends, the
    /// client goes away, or it is cancelled.
    pub(super) async fn relay(
        &self,
        request: GenerateRequest,
        tx: UnboundedSender<TokenEvent>,
        mut cancelled: oneshot::Receiver<()>,
    ) {
        let prompt_tokens = request.prompt.len() as u32;
        let mut emitted: Vec<u32> = Vec::new();
        let mut rng_pos = 0;
        let mut attempts = Attempts::default();
        loop {
            let Some(attempt) = resumed(&request, &emitted, rng_pos) else {
                // The budget was spent exactly when the node failed: the stream is complete.
                let _ = tx.send(TokenEvent::Finished {
                    reason: strata_protocol::FinishReason::Length,
                    usage: strata_protocol::Usage {
                        prompt_tokens,
                        completion_tokens: emitted.len() as u32,
                        cached_tokens: 0,
                        queued_ms: 0,
                    },
                });
                return;
            };
            let (node, fetch) = match self
                .next_node(&attempt, &mut attempts, &mut cancelled, &tx)
                .await
            {
                Next::Run(node, fetch) => (node, fetch),
                Next::Again => continue,
                Next::Stop => return,
            };
            let incarnation = node.incarnation();
            if !emitted.is_empty() {
                self.stats.failovers.fetch_add(1, Ordering::Relaxed);
            }
            let Some(client) = node.client() else {
                attempts.fail(&node, incarnation, format!("node {} went away", node.addr));
                continue;
            };
            let mut stream = match client.generate_with(attempt.clone(), fetch).await {
                Ok(stream) => stream,
                Err(e) => match self.start_failed(&node, incarnation, e, &mut attempts, &tx) {
                    ControlFlow::Continue(()) => continue,
                    ControlFlow::Break(()) => return,
                },
            };
            // Accepted: busy refusals before it no longer hold the request back.
            attempts.busy.clear();
            attempts.busy_since = None;
            match self
                .forward(&mut stream, &tx, &mut cancelled, &mut emitted, &mut rng_pos)
                .await
            {
                Forwarded::Done => return,
                Forwarded::Stopped => {
                    stream.cancel();
                    return;
                }
                Forwarded::NodeFailed(e) => {
                    node_failed(&node, &e);
                    if !self.options.failover {
                        let message = format!("the node running the request failed: {e}");
                        let _ = tx.send(TokenEvent::Failed { message });
                        return;
                    }
                    attempts.fail(&node, incarnation, e.to_string());
                }
            }
        }
    }

    /// The node the request's next attempt runs on. `Again` after a pause while every node
    /// that could take it is busy; `Stop` when none can (the client is told why) or the request
    /// was cancelled or its client went away.
    async fn next_node(
        &self,
        attempt: &GenerateRequest,
        a: &mut Attempts,
        cancelled: &mut oneshot::Receiver<()>,
        tx: &UnboundedSender<TokenEvent>,
    ) -> Next {
        a.count += 1;
        let routed = if a.count > FAILOVER_ATTEMPTS {
            None
        } else if let Some(since) = a.busy_since {
            let exclude: Vec<(Slot, u64)> = a.failed.iter().chain(&a.busy).copied().collect();
            let found = self
                .route_within(attempt, &exclude, Duration::ZERO, cancelled, tx)
                .await;
            if found.is_none() && since.elapsed() < FAILOVER_WAIT {
                // Every node that could take it is busy: a pause, then all of them again.
                a.busy.clear();
                a.count -= 1;
                tokio::select! {
                    () = tokio::time::sleep(BUSY_BACKOFF) => {}
                    _ = &mut *cancelled => return Next::Stop,
                    () = tx.closed() => return Next::Stop,
                }
                return Next::Again;
            }
            found
        } else {
            self.route_within(attempt, &a.failed, FAILOVER_WAIT, cancelled, tx)
                .await
        };
        match routed {
            Some((node, fetch)) => Next::Run(node, fetch),
            // Its attempts spent: the request failed.
            None if a.count > FAILOVER_ATTEMPTS => {
                let _ = tx.send(TokenEvent::Failed { message: a.why() });
                Next::Stop
            }
            // No node can take it now: the client may retry, as a new request is told.
            None => {
                let _ = tx.send(TokenEvent::Unavailable { message: a.why() });
                Next::Stop
            }
        }
    }

    /// A node would not start the request: try another (`Continue`), or end the request with
    /// the node's refusal (`Break`).
    fn start_failed(
        &self,
        node: &Node,
        incarnation: u64,
        e: NodeError,
        a: &mut Attempts,
        tx: &UnboundedSender<TokenEvent>,
    ) -> ControlFlow<()> {
        match e {
            // A node at its admission limit: another may take the request, or this one a
            // little later (not a failure: the node stays healthy).
            NodeError::Refused(refusal) if refusal.kind == RefusalKind::Busy => {
                self.stats.busy_refusals.fetch_add(1, Ordering::Relaxed);
                a.busy.push((node.slot, incarnation));
                a.busy_since.get_or_insert_with(tokio::time::Instant::now);
                a.count -= 1;
            }
            // A node shutting down refuses as unavailable: another may take the request.
            NodeError::Refused(refusal) if refusal.kind == RefusalKind::Unavailable => {
                a.fail(
                    node,
                    incarnation,
                    format!("node {}: {}", node.addr, refusal.message),
                );
            }
            NodeError::Refused(refusal) => {
                let _ = tx.send(TokenEvent::Failed {
                    message: refusal.message,
                });
                return ControlFlow::Break(());
            }
            e => {
                node_failed(node, &e);
                a.fail(node, incarnation, e.to_string());
            }
        }
        ControlFlow::Continue(())
    }

    /// Relays one node's events until the request ends or the node fails, keeping the tokens
    /// emitted and the sampler's position for a continuation.
    async fn forward(
        &self,
        stream: &mut RemoteStream,
        tx: &UnboundedSender<TokenEvent>,
        cancelled: &mut oneshot::Receiver<()>,
        emitted: &mut Vec<u32>,
        rng_pos: &mut u64,
    ) -> Forwarded {
        loop {
            let event = tokio::select! {
                event = stream.next() => event,
                _ = &mut *cancelled => return Forwarded::Stopped,
                () = tx.closed() => return Forwarded::Stopped,
            };
            let event = match event {
                Ok(Some(event)) => event,
                Ok(None) => return Forwarded::Done,
                Err(e) => return Forwarded::NodeFailed(e),
            };
            if let TokenEvent::Token {
                id, rng_pos: pos, ..
            } = &event
            {
                emitted.push(*id);
                *rng_pos = *pos;
            }
            let last = event.ends_stream();
            if tx.send(event).is_err() {
                return Forwarded::Stopped;
            }
            if last {
                return Forwarded::Done;
            }
        }
    }
}

enum Forwarded {
    Done,
    Stopped,
    NodeFailed(NodeError),
}

/// `request` continued after `emitted` tokens, the last drawn with the RNG ending at `rng_pos`;
/// `None` when nothing is left to generate.
fn resumed(request: &GenerateRequest, emitted: &[u32], rng_pos: u64) -> Option<GenerateRequest> {
    let mut next = request.clone();
    if emitted.is_empty() {
        return Some(next);
    }
    if emitted.len() >= next.sampling.max_tokens as usize {
        return None;
    }
    next.resume = Some(Resume {
        output: emitted.to_vec(),
        rng_pos,
    });
    Some(next)
}

fn node_failed(node: &Node, e: &NodeError) {
    tracing::warn!("node {} failed a request: {e}", node.addr);
}
