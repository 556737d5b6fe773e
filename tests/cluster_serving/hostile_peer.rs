//! The node RPC against an authenticated but hostile peer (`tests/fuzz/mod.rs`): a
//! `strata node serve` process is sent mutations of every call a router makes — generate
//! requests with their sampling, grammar, deadline, resume and embedding fields, KV export,
//! pins, loads, the event feed — each on its own stream of one mutual-TLS connection holding an
//! operator's certificate of the cluster CA. Every call must be answered, refused or closed
//! within the deadline; afterwards the process is alive, logged no panic, and a greedy request
//! streams exactly the tokens it streamed before the campaign.

use std::net::SocketAddr;
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use strata_node::rpc::{ALPN, GenerateCall, GenerateFrame, NodeRequest};
use strata_protocol::{Constraint, GenerateRequest, Pooling, Resume, SamplingParams, TokenEvent};
use strata_quic::frame::{read_frame_bytes, write_frame_bytes};
use strata_topology::transport::ca::SERVER_NAME;
use strata_topology::transport::{ClusterCa, OperatorIdentity};

use crate::cluster::Process;
use crate::fuzz::{Campaign, Report};

const CALL_DEADLINE: Duration = Duration::from_secs(30);
/// The longest wait for a call's next frame before it counts as quiet.
const QUIET: Duration = Duration::from_secs(1);
/// Frames read from one call before it is dropped (the event feed never ends by itself).
const MAX_FRAMES: usize = 64;

fn generate(prompt: Vec<u32>, sampling: SamplingParams) -> GenerateRequest {
    GenerateRequest {
        prompt,
        sampling,
        cache_salt: 0,
        deadline: None,
        constraint: None,
        resume: None,
        embed: None,
    }
}

/// The greedy request compared before and after the campaign.
fn greedy() -> GenerateRequest {
    let sampling = SamplingParams {
        temperature: 0.0,
        max_tokens: 8,
        ..SamplingParams::default()
    };
    generate(vec![1, 5, 9, 13, 17], sampling)
}

fn call(request: GenerateRequest) -> NodeRequest {
    NodeRequest::Generate(Box::new(GenerateCall {
        request,
        fetch: None,
    }))
}

/// Every kind of call, the generate request's optional parts each present in one seed.
fn seeds() -> Vec<Vec<u8>> {
    let sampled = SamplingParams {
        temperature: 0.8,
        top_p: 0.9,
        top_k: 20,
        repetition_penalty: 1.1,
        logit_bias: [(3, 2.0)].into(),
        seed: 7,
        max_tokens: 6,
        stop_token_ids: vec![2],
        logprobs: Some(2),
        ..SamplingParams::default()
    };
    let hash = strata_node::kv::BlockHash(0x1234);
    let requests = [
        call(greedy()),
        call(generate(vec![4; 40], sampled.clone())),
        call(GenerateRequest {
            deadline: Some(Duration::from_millis(500)),
            constraint: Some(Constraint::JsonSchema(r#"{"type":"boolean"}"#.into())),
            ..generate(vec![1, 2], sampled.clone())
        }),
        call(GenerateRequest {
            resume: Some(Resume {
                output: vec![5, 6],
                rng_pos: 3,
            }),
            ..generate(vec![1, 2, 3], sampled)
        }),
        call(GenerateRequest {
            embed: Some(Pooling::Mean),
            ..generate(vec![1, 2, 3], SamplingParams::default())
        }),
        NodeRequest::Load,
        NodeRequest::Info,
        NodeRequest::KvDump,
        NodeRequest::Pins,
        NodeRequest::KvExport { hashes: vec![hash] },
        NodeRequest::Pin {
            name: "p".into(),
            hashes: vec![hash],
            ttl_ms: 1_000,
        },
        NodeRequest::Unpin { name: "p".into() },
        NodeRequest::KvEvents,
    ];
    requests
        .iter()
        .map(|r| serde_json::to_vec(r).unwrap())
        .collect()
}

/// A client connection to the node at `addr` holding the operator identity in `dir`.
async fn connect(dir: &Path, addr: SocketAddr) -> quinn::Connection {
    let identity = OperatorIdentity::load(dir).unwrap().live().unwrap();
    let config = strata_quic::tls::live_client_config(&identity, ALPN).unwrap();
    let mut endpoint = quinn::Endpoint::client(SocketAddr::from(([127, 0, 0, 1], 0))).unwrap();
    endpoint.set_default_client_config(config);
    endpoint.connect(addr, SERVER_NAME).unwrap().await.unwrap()
}

/// Sends `body` as one call and reads what comes back: its frames, or how it ended. A call
/// that goes quiet (no frame for [`QUIET`]) is dropped as "quiet": only the event feed may,
/// which sends nothing while the cache does not change.
async fn raw_call(connection: &quinn::Connection, body: &[u8]) -> (&'static str, Vec<Vec<u8>>) {
    let (mut send, mut recv) = connection.open_bi().await.expect("open a stream");
    let _ = write_frame_bytes(&mut send, body).await;
    let _ = send.finish();
    let mut frames = Vec::new();
    let started = std::time::Instant::now();
    let mut quiet = false;
    while frames.len() < MAX_FRAMES {
        assert!(
            started.elapsed() < CALL_DEADLINE,
            "no end within {CALL_DEADLINE:?}"
        );
        match tokio::time::timeout(QUIET, read_frame_bytes(&mut recv)).await {
            Ok(Ok(Some(frame))) => frames.push(frame),
            Ok(Ok(None) | Err(_)) => break,
            Err(_) => {
                quiet = true;
                break;
            }
        }
    }
    if quiet {
        let feed = matches!(serde_json::from_slice(body), Ok(NodeRequest::KvEvents));
        assert!(feed, "a call other than the event feed went quiet");
        return ("quiet", frames);
    }
    let refused = frames.first().is_some_and(|f| {
        let text = String::from_utf8_lossy(f);
        text.contains("\"Refused\"") || text.contains("malformed")
    });
    let outcome = match (frames.is_empty(), refused) {
        (true, _) => "closed",
        (false, true) => "refused",
        (false, false) => "answered",
    };
    (outcome, frames)
}

/// The token ids a generate call streamed.
async fn tokens(connection: &quinn::Connection, request: GenerateRequest) -> Vec<u32> {
    let (_, frames) = raw_call(connection, &serde_json::to_vec(&call(request)).unwrap()).await;
    let mut ids = Vec::new();
    for frame in frames {
        match serde_json::from_slice::<GenerateFrame>(&frame).unwrap() {
            GenerateFrame::Event(TokenEvent::Token { id, .. }) => ids.push(id),
            GenerateFrame::Event(TokenEvent::Finished { .. }) => return ids,
            GenerateFrame::Accepted { .. } => {}
            other => panic!("the greedy request got {other:?}"),
        }
    }
    panic!("the greedy request did not finish: {ids:?}")
}

/// A node process from a fresh CA on the tiny model, and the campaign against it.
pub fn campaign(campaign: Campaign) -> Report {
    let tmp = tempfile::tempdir().unwrap();
    let model = tmp.path().join("m");
    crate::cluster::synth(&model);
    let ca = ClusterCa::create(&tmp.path().join("ca")).unwrap();
    let member = tmp.path().join("member-1");
    ca.issue_member(1, &member).unwrap();
    let operator = tmp.path().join("operator");
    ca.issue_operator("hostile", &operator).unwrap();
    let mut node = Process::start(&[
        "node",
        "serve",
        "--model",
        model.to_str().unwrap(),
        "--listen",
        "127.0.0.1:0",
        "--identity",
        member.to_str().unwrap(),
        "--kv-cache-mib",
        "16",
    ]);
    let addr = node.address("on quic://");
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    let connection = Arc::new(runtime.block_on(connect(&operator, addr)));
    let before = runtime.block_on(tokens(&connection, greedy()));
    assert_eq!(before.len(), 8, "{before:?}");
    let report = campaign.run(&seeds(), |body| {
        runtime.block_on(raw_call(&connection, body)).0
    });
    // A fresh connection: the campaign's may have been closed by the node for a good reason.
    let fresh = runtime.block_on(connect(&operator, addr));
    assert_eq!(runtime.block_on(tokens(&fresh, greedy())), before);
    assert!(
        node.child.try_wait().unwrap().is_none(),
        "the node process ended"
    );
    let panics: Vec<String> = node
        .log
        .try_iter()
        .filter(|l| l.contains("panicked"))
        .collect();
    assert!(
        panics.is_empty(),
        "the node logged panics:\n{}",
        panics.join("\n")
    );
    node.kill();
    report
}
