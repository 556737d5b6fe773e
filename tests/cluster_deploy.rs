//! The local deployment (`deploy/local/up.sh` and `down.sh`) as real processes: a whole cluster
//! started and stopped; a member and its node joining the group under load, taking a share of
//! the ring and traffic with no request failing; a certificate the group revokes refused by
//! the nodes; and certificates of seconds renewed and taken up by the node and the router.

mod cluster;

use std::net::SocketAddr;
use std::path::Path;
use std::time::Duration;

use cluster::{
    Process, complete, completion_body, deploy_local, deploy_local_with, get, metric, post, serial,
    strata, synth, without_model_label,
};

#[test]
fn deploy_local_starts_a_whole_cluster_and_stops_it() {
    let _serial = serial();
    let tmp = tempfile::tempdir().unwrap();
    let model = tmp.path().join("m");
    synth(&model);
    let dir = tmp.path().join("cluster");
    let script = |name: &str, args: &[&str]| {
        std::process::Command::new(
            Path::new(env!("CARGO_MANIFEST_DIR")).join(format!("deploy/local/{name}")),
        )
        .args(args)
        .env("STRATA", env!("CARGO_BIN_EXE_strata"))
        .output()
        .expect("run the script")
    };
    // Ports from a free one: members, joins and nodes at base + 10i (+1, +2), routers base + 101..
    let base = cluster::free_ports(110).to_string();
    let dir_arg = dir.to_str().unwrap();
    let up = script(
        "up.sh",
        &[
            "--nodes",
            "3",
            "--routers",
            "2",
            "--model",
            model.to_str().unwrap(),
            "--dir",
            dir_arg,
            "--base-port",
            &base,
        ],
    );
    let said = String::from_utf8_lossy(&up.stdout).to_string();
    let up_err = String::from_utf8_lossy(&up.stderr);
    assert!(up.status.success(), "{said}{up_err}");
    // Waiting for the group is quiet (a poll before member 1 answers used to print a Python
    // traceback).
    assert!(!up_err.contains("Traceback"), "{up_err}");
    let pids = std::fs::read_to_string(dir.join("pids")).unwrap();
    assert_eq!(pids.lines().count(), 3 + 3 + 2, "{pids}");
    // Both routers answer through the nodes.
    let routers: Vec<SocketAddr> = said
        .lines()
        .filter_map(|l| l.split("http://").nth(1))
        .map(|a| a.trim_end_matches("/v1").parse().unwrap())
        .collect();
    assert_eq!(routers.len(), 2, "{said}");
    for router in &routers {
        assert!(!complete(*router, "hello cluster", 4).is_empty());
    }
    let down = script("down.sh", &["--dir", dir_arg]);
    assert!(
        down.status.success(),
        "{}",
        String::from_utf8_lossy(&down.stderr)
    );
    for line in pids.lines() {
        let pid = line.split_whitespace().next().unwrap();
        let alive = std::process::Command::new("kill")
            .args(["-0", pid])
            .stderr(std::process::Stdio::null())
            .status()
            .unwrap()
            .success();
        assert!(!alive, "{line} still runs after down.sh");
    }
    assert!(!dir.join("pids").exists());
}

#[test]
fn a_node_joining_the_group_under_load_changes_the_ring_and_gets_traffic() {
    let _serial = serial();
    use std::sync::Arc;
    use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
    let tmp = tempfile::tempdir().unwrap();
    let model = tmp.path().join("m");
    synth(&model);
    let dir = tmp.path().join("cluster");
    let (_down, base) = deploy_local(&dir, &model, 2);
    let router: SocketAddr = format!("127.0.0.1:{}", base + 101).parse().unwrap();
    let member = |i: u16| format!("127.0.0.1:{}", base + 10 * i);
    let node3: SocketAddr = format!("127.0.0.1:{}", base + 32).parse().unwrap();
    let read = |name: &str| metric(&get(router, "/metrics"), name);
    let node3_requests = format!("strata_router_node_requests_total{{node=\"{node3}\"}}");
    let epoch_before = read("strata_router_ring_epoch");
    assert!(epoch_before > 0.0);
    // Load from two clients; every answer must be a 200.
    let stop = Arc::new(AtomicBool::new(false));
    let failed = Arc::new(AtomicUsize::new(0));
    let clients: Vec<_> = (0..2)
        .map(|c| {
            let (stop, failed) = (stop.clone(), failed.clone());
            std::thread::spawn(move || {
                let mut i = 0;
                while !stop.load(Ordering::Relaxed) {
                    // Each prompt's first block is its own: nothing is cached for it, so its
                    // ring owner takes it, and the new node owns a share of the ring.
                    let prompt = format!("{i:05} {c} asks a question");
                    let body = completion_body(&prompt, 16, false, None);
                    let (status, body) = cluster::post(router, "/v1/completions", &body);
                    if status != 200 {
                        eprintln!("request failed: {status} {body}");
                        failed.fetch_add(1, Ordering::Relaxed);
                    }
                    i += 1;
                    std::thread::sleep(Duration::from_millis(20));
                }
            })
        })
        .collect();
    // Member 3 joins the raft group as a voter, and its node starts beside it.
    let token = dir.join("token-3");
    let out = strata(&[
        "cluster",
        "token",
        "--data",
        dir.join("member-1").to_str().unwrap(),
        "--out",
        token.to_str().unwrap(),
    ]);
    assert!(out.status.success(), "{out:?}");
    let data3 = dir.join("member-3");
    let join_seed = format!("127.0.0.1:{}", base + 11);
    let member3 = Process::start(&[
        "cluster",
        "join",
        "--data",
        data3.to_str().unwrap(),
        "--listen",
        &member(3),
        "--seed",
        &join_seed,
        "--token",
        token.to_str().unwrap(),
        "--voter",
    ]);
    let node3_process = Process::start(&[
        "node",
        "serve",
        "--model",
        model.to_str().unwrap(),
        "--data",
        data3.to_str().unwrap(),
        "--listen",
        &node3.to_string(),
    ]);
    let joined = || {
        let text = get(router, "/metrics");
        metric(&text, "strata_router_ring_epoch") > epoch_before
            && text
                .lines()
                .map(without_model_label)
                .any(|l| l.starts_with(&node3_requests))
            && metric(&text, &node3_requests) > 0.0
    };
    let deadline = std::time::Instant::now() + Duration::from_secs(120);
    while !joined() {
        if std::time::Instant::now() >= deadline {
            let logs: Vec<String> = member3
                .log
                .try_iter()
                .chain(node3_process.log.try_iter())
                .collect();
            panic!(
                "the new node never got traffic:\n{}\n{}",
                get(router, "/metrics"),
                logs.join("\n")
            );
        }
        std::thread::sleep(Duration::from_millis(200));
    }
    stop.store(true, Ordering::Relaxed);
    for client in clients {
        client.join().unwrap();
    }
    assert_eq!(
        failed.load(Ordering::Relaxed),
        0,
        "requests failed while the node joined"
    );
}

/// An operator's certificate revoked in the group stops working at the nodes too: a router holding
/// it (in front of the nodes directly, `--nodes`) is served before and refused after, within the
/// nodes' refresh, while the group's own router keeps answering (the canary arm).
#[test]
fn nodes_refuse_a_certificate_the_group_revoked() {
    let _serial = serial();
    let tmp = tempfile::tempdir().unwrap();
    let model = tmp.path().join("m");
    synth(&model);
    let dir = tmp.path().join("cluster");
    let (_down, base) = deploy_local(&dir, &model, 2);
    let member1 = dir.join("member-1");
    let rogue = tmp.path().join("rogue");
    let out = strata(&[
        "cluster",
        "operator",
        "--data",
        member1.to_str().unwrap(),
        "--name",
        "rogue",
        "--out",
        rogue.to_str().unwrap(),
    ]);
    assert!(out.status.success(), "{out:?}");
    let nodes = format!("127.0.0.1:{},127.0.0.1:{}", base + 12, base + 22);
    let router = Process::start(&[
        "router",
        "--model",
        model.to_str().unwrap(),
        "--nodes",
        &nodes,
        "--identity",
        rogue.to_str().unwrap(),
        "--port",
        "0",
    ]);
    let rogue_addr = router.address("on http://");
    let ask = |addr: SocketAddr| {
        let body = completion_body("a question for the nodes", 4, false, None);
        post(addr, "/v1/completions", &body).0
    };
    assert_eq!(
        ask(rogue_addr),
        200,
        "the operator's router is served before"
    );
    let out = strata(&[
        "cluster",
        "revoke",
        "--data",
        member1.to_str().unwrap(),
        "--operator",
        "rogue",
    ]);
    assert!(out.status.success(), "{out:?}");
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    while ask(rogue_addr) == 200 {
        assert!(
            std::time::Instant::now() < deadline,
            "the nodes still serve a revoked certificate"
        );
        std::thread::sleep(Duration::from_millis(250));
    }
    for _ in 0..3 {
        assert_ne!(
            ask(rogue_addr),
            200,
            "a revoked certificate was served again"
        );
    }
    let group_router: SocketAddr = format!("127.0.0.1:{}", base + 101).parse().unwrap();
    assert_eq!(ask(group_router), 200, "the group's own router was refused");
}

#[test]
fn nodes_and_routers_take_up_renewed_certificates() {
    let _serial = serial();
    let tmp = tempfile::tempdir().unwrap();
    let model = tmp.path().join("m");
    synth(&model);
    let dir = tmp.path().join("cluster");
    let (_down, base) = deploy_local_with(&dir, &model, (1, 1), "", "--cert-lifetime 12s");
    let identity = dir.join("router-identity");
    let pem = |path: &Path| std::fs::read(path).expect("certificate");
    let node_cert = dir.join("member-1").join("tls").join("member.pem");
    let first = (pem(&node_cert), pem(&identity.join("operator.pem")));
    let ask = |addr: SocketAddr| {
        let body = completion_body("a question for the node", 4, false, None);
        post(addr, "/v1/completions", &body).0
    };
    let router1 = SocketAddr::from(([127, 0, 0, 1], base + 101));
    assert_eq!(ask(router1), 200);
    // Past every first certificate's end (12 s, issued before the cluster was up).
    std::thread::sleep(Duration::from_secs(16));
    assert_ne!(
        pem(&node_cert),
        first.0,
        "the member renewed its certificate"
    );
    assert_ne!(
        pem(&identity.join("operator.pem")),
        first.1,
        "the router renewed its operator certificate"
    );
    assert_eq!(ask(router1), 200, "the running router still serves");
    // A new router dials the group and the node afresh: both handshakes need the renewed
    // certificates, the router's read from the files and the node's taken up while it ran.
    let member = format!("127.0.0.1:{}", base + 10);
    let router = Process::start(&[
        "router",
        "--model",
        model.to_str().unwrap(),
        "--cluster",
        &member,
        "--identity",
        identity.to_str().unwrap(),
        "--port",
        "0",
    ]);
    assert_eq!(ask(router.address("on http://")), 200);
}
