//! A member process's life in one test process: start from a data directory, bootstrap a
//! one-voter group, renew its own lease, admit a joiner through the join endpoint, stop, and
//! start again from disk into the same state; and a peer stalling mid-request, cut after the
//! configured read timeout while the member serves everyone else; and certificates renewed
//! before they end, an unrenewed one refused after.

mod common;

use std::path::Path;
use std::time::Duration;

use common::{framed, free_port, local, spec};
use openraft::ServerState;
use strata_topology::server::{DataLayout, Server, ServerConfig, Timing};
use strata_topology::transport::ca::{MEMBER_CERT_FILE, Validity};
use strata_topology::transport::join::{JoinToken, request_membership};
use strata_topology::transport::renew::read_certificate;
use strata_topology::transport::wire::{Refusal, Response, read_frame};
use strata_topology::transport::{Client, ClientError, ClusterCa, tls};

const TIMEOUT: Duration = Duration::from_secs(15);

fn config(dir: &Path, listen: &str, join: bool) -> ServerConfig {
    ServerConfig {
        data_dir: dir.to_path_buf(),
        listen: listen.parse().unwrap(),
        advertise: None,
        join_listen: join.then(|| "127.0.0.1:0".parse().unwrap()),
        cert_lifetime_s: None,
        timing: Timing {
            lease_renew_ms: 100,
            lease_check_ms: 100,
            ..Timing::default()
        },
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
    common::eventually(TIMEOUT, "member 1 renews its lease", || {
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

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stalled_request_is_cut_after_the_read_timeout_while_other_calls_are_served() {
    const READ_TIMEOUT: Duration = Duration::from_millis(1_000);
    // What a loaded test machine may add to the timeout before the refusal arrives.
    const SLACK: Duration = Duration::from_secs(2);
    let root = tempfile::tempdir().unwrap();
    let dir = root.path().join("m1");
    let layout = DataLayout::new(&dir);
    let ca = ClusterCa::create(&layout.ca_dir()).unwrap();
    ca.issue_member(1, &layout.tls_dir()).unwrap();
    let mut config = config(&dir, "127.0.0.1:0", true);
    config.timing.read_timeout_ms = READ_TIMEOUT.as_millis() as u64;
    let server = Server::start(&config).await.expect("start member 1");
    server
        .bootstrap(spec(1, &server.addr), None)
        .await
        .expect("bootstrap");
    let operator = ca.issue_member(100, &root.path().join("tls-100")).unwrap();
    let client = common::operator(&operator, TIMEOUT);
    let mut joiner = quinn::Endpoint::client(local()).unwrap();
    joiner
        .set_default_client_config(tls::pinned_client_config(&ca.fingerprint().unwrap()).unwrap());
    let joiner = Client::new(joiner, TIMEOUT);
    let join_addr = server.join_addr().expect("join endpoint").to_string();

    // Three streams that stall mid-frame: half a length prefix and half a body on the member
    // endpoint, half a body on the join endpoint (which anyone may reach). None is finished.
    let request = framed(br#"{"type":"Read"}"#);
    let mut stalled = Vec::new();
    // Before the first byte: no stream can be cut earlier than a timeout after this.
    let sent = tokio::time::Instant::now();
    for (name, via, addr, bytes) in [
        ("half a length", &client, &server.addr, &request[..2]),
        ("half a body", &client, &server.addr, &request[..8]),
        ("half a join", &joiner, &join_addr, &request[..8]),
    ] {
        let connection = via.connection(addr).await.expect("connect");
        let (mut send, recv) = connection.open_bi().await.expect("open a stream");
        send.write_all(bytes).await.expect("write part of a frame");
        stalled.push((name, send, recv));
    }

    // Meanwhile calls on the same connection are answered, without waiting for the stalls.
    let view = client
        .read(&server.addr)
        .await
        .expect("served while stalled");
    assert_eq!(view.cluster.members().len(), 1);
    assert!(
        sent.elapsed() < READ_TIMEOUT,
        "a call waited {:?} behind stalled streams",
        sent.elapsed()
    );

    // Each stalled stream is refused, naming the timeout, and ended: not before the timeout,
    // and not long after it.
    for (name, send, recv) in &mut stalled {
        let answer = tokio::time::timeout(READ_TIMEOUT + SLACK, read_frame::<Response>(recv))
            .await
            .unwrap_or_else(|_| panic!("{name}: still open {:?} after the stall", sent.elapsed()))
            .unwrap_or_else(|e| panic!("{name}: {e}"))
            .unwrap_or_else(|| panic!("{name}: ended without an answer"));
        assert!(
            matches!(
                answer,
                Response::Refused(Refusal::ReadTimeout { ms: 1_000 })
            ),
            "{name}: {answer:?}"
        );
        assert!(
            sent.elapsed() >= READ_TIMEOUT,
            "{name}: cut after {:?}",
            sent.elapsed()
        );
        let end = read_frame::<Response>(recv).await;
        assert!(matches!(end, Ok(None)), "{name}: {end:?}");
        // The member stopped reading: the rest of the request would go nowhere.
        let stopped = tokio::time::timeout(SLACK, send.stopped()).await;
        assert!(
            matches!(stopped, Ok(Ok(Some(_)))),
            "{name}: the member did not stop the stream: {stopped:?}"
        );
    }
    assert!(sent.elapsed() < READ_TIMEOUT + SLACK);

    // The connection that carried the stalls still serves.
    let view = client
        .read(&server.addr)
        .await
        .expect("served after the stalls");
    assert_eq!(view.cluster.members().len(), 1);
    server.shutdown().await;
}

/// The certificate in `dir`'s `member.pem`, and when it ends.
fn member_cert(dir: &Path) -> (Vec<u8>, std::time::SystemTime) {
    let path = DataLayout::new(dir).tls_dir().join(MEMBER_CERT_FILE);
    let (der, validity) = read_certificate(&path).expect("member certificate");
    (der.to_vec(), validity.not_after)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn certificates_renew_before_they_expire_and_an_outlived_one_is_refused() {
    const LIFETIME: Duration = Duration::from_secs(12);
    let root = tempfile::tempdir().unwrap();
    let dir1 = root.path().join("m1");
    let layout = DataLayout::new(&dir1);
    let ca = ClusterCa::create(&layout.ca_dir())
        .unwrap()
        .with_lifetime(LIFETIME)
        .unwrap();
    ca.issue_member(1, &layout.tls_dir()).unwrap();
    let token = JoinToken::generate(&ca.fingerprint().unwrap()).unwrap();
    let mut config1 = config(&dir1, "127.0.0.1:0", true);
    config1.cert_lifetime_s = Some(LIFETIME.as_secs());
    let first = Server::start(&config1).await.expect("start member 1");
    first
        .bootstrap(spec(1, &first.addr), Some(token.secret_sha256()))
        .await
        .expect("bootstrap");
    // Member 2 holds no CA key: it renews through member 1.
    let dir2 = root.path().join("m2");
    let listen2 = free_port();
    let join_addr = first.join_addr().expect("join endpoint").to_string();
    request_membership(
        &join_addr,
        &token,
        &listen2,
        &DataLayout::new(&dir2).tls_dir(),
        TIMEOUT,
    )
    .await
    .expect("join");
    let second = Server::start(&config(&dir2, &listen2, false))
        .await
        .expect("start member 2");
    let originals = [member_cert(&dir1), member_cert(&dir2)];
    // A client whose certificate nobody renews, with a connection opened while it is valid.
    let outsider = ca.issue_member(100, &root.path().join("tls-100")).unwrap();
    let stale = common::operator(&outsider, TIMEOUT);
    stale
        .read(&first.addr)
        .await
        .expect("a valid certificate reads");

    common::eventually(
        LIFETIME * 2,
        "both members hold renewed certificates",
        || {
            [&dir1, &dir2]
                .iter()
                .zip(&originals)
                .all(|(dir, (der, end))| {
                    let (now_der, now_end) = member_cert(dir);
                    now_der != *der && now_end > *end
                })
        },
    )
    .await;
    // The outsider's certificate was issued last; wait past its end (whole seconds in X.509).
    let last_end = Validity::of(&outsider.cert).unwrap().not_after;
    let wait = last_end
        .duration_since(std::time::SystemTime::now())
        .unwrap_or_default();
    tokio::time::sleep(wait + Duration::from_secs(2)).await;

    // Past the first certificates' end the group still replicates: member 1 reaches member 2
    // (and is reached) with renewed certificates.
    let fresh = ca.issue_member(101, &root.path().join("tls-101")).unwrap();
    let client = common::operator(&fresh, TIMEOUT);
    let token2 = JoinToken::generate(&ca.fingerprint().unwrap()).unwrap();
    let change = strata_topology::state::Command::new(
        0,
        strata_topology::state::Change::PutJoinToken {
            sha256: token2.secret_sha256(),
            ttl_ms: 60_000,
        },
    );
    let (log_id, _) = client.propose(&first.addr, change).await.expect("commit");
    second
        .raft
        .wait(Some(TIMEOUT))
        .applied_index_at_least(Some(log_id.index), "replicated after the first certs ended")
        .await
        .expect("member 2 applies what member 1 committed");
    // The certificate nobody renewed: its open connection is refused at the next call, and it
    // cannot open a new one.
    match stale.read(&first.addr).await {
        Err(ClientError::Refused {
            refusal: Refusal::Expired(who),
            ..
        }) => assert_eq!(who, "member 100"),
        other => panic!("an expired certificate's connection was served: {other:?}"),
    }
    // (The client sees its handshake done before the member checks its certificate, so the
    // refusal arrives as the connection closing, not as an answer: a resumed TLS session, which
    // skips the check, would be answered `Expired` instead.)
    let refused = stale.read(&first.addr).await;
    assert!(
        matches!(
            refused,
            Err(ClientError::Frame { .. } | ClientError::Connect { .. })
        ),
        "a new connection with an expired certificate: {refused:?}"
    );
    second.shutdown().await;
    first.shutdown().await;
}
