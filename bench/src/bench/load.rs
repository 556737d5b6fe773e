//! How a sweep point loads the server: a closed loop (N workers, each keeping one request in
//! flight and sending the next as soon as the last one finished) or an open loop (requests sent
//! at scheduled arrival times whether or not earlier ones have finished).

use std::fmt;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use bytes::Bytes;
use tokio::task::JoinSet;

use super::client::{Client, RequestOutcome};
use super::workload::{RequestRate, arrival_offsets};

/// One point of a sweep.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Load {
    Concurrency(u32),
    Rate(RequestRate),
}

impl fmt::Display for Load {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Concurrency(c) => write!(f, "concurrency {c}"),
            Self::Rate(RequestRate::Unlimited) => f.write_str("rate inf"),
            Self::Rate(r) => write!(f, "rate {r}/s"),
        }
    }
}

/// A request ready to send: its JSON body and its prompt length (for servers without usage).
#[derive(Clone)]
pub struct PlannedRequest {
    pub body: Bytes,
    pub prompt_len: u64,
}

/// Sends `requests` under `load` and returns every outcome (in completion order per worker).
/// `seed` and `point` key the arrival schedule of an open loop.
pub async fn apply(
    client: Arc<Client>,
    load: Load,
    requests: Vec<PlannedRequest>,
    seed: u64,
    point: u64,
) -> Vec<RequestOutcome> {
    match load {
        Load::Concurrency(workers) => closed_loop(client, requests, workers as usize).await,
        Load::Rate(rate) => open_loop(client, requests, rate, seed, point).await,
    }
}

/// `workers` tasks take the next unsent request until none is left.
pub async fn closed_loop(
    client: Arc<Client>,
    requests: Vec<PlannedRequest>,
    workers: usize,
) -> Vec<RequestOutcome> {
    let requests: Arc<[PlannedRequest]> = requests.into();
    let next = Arc::new(AtomicUsize::new(0));
    let mut tasks = JoinSet::new();
    for _ in 0..workers.min(requests.len()) {
        let (client, requests, next) = (client.clone(), requests.clone(), next.clone());
        tasks.spawn(async move {
            let mut outcomes = Vec::new();
            while let Some(r) = requests.get(next.fetch_add(1, Ordering::Relaxed)) {
                outcomes.push(client.complete(r.body.clone(), r.prompt_len).await);
            }
            outcomes
        });
    }
    join_all(tasks).await.into_iter().flatten().collect()
}

/// Each request is sent at its arrival time, on its own task.
async fn open_loop(
    client: Arc<Client>,
    requests: Vec<PlannedRequest>,
    rate: RequestRate,
    seed: u64,
    point: u64,
) -> Vec<RequestOutcome> {
    let offsets = arrival_offsets(rate, requests.len(), seed, point);
    let start = tokio::time::Instant::now();
    let mut tasks = JoinSet::new();
    for (request, offset) in requests.into_iter().zip(offsets) {
        tokio::time::sleep_until(start + offset).await;
        let client = client.clone();
        tasks.spawn(async move { client.complete(request.body, request.prompt_len).await });
    }
    join_all(tasks).await
}

/// Every task's result. The tasks are never aborted, so a join error is a panic: re-raise it.
async fn join_all<T: 'static>(mut tasks: JoinSet<T>) -> Vec<T> {
    let mut out = Vec::with_capacity(tasks.len());
    while let Some(joined) = tasks.join_next().await {
        match joined {
            Ok(value) => out.push(value),
            Err(e) => std::panic::resume_unwind(e.into_panic()),
        }
    }
    out
}
