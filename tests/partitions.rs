//! Partitions, not only kills: strata processes on hosts of their own (network namespaces on a
//! bridge, `tests/netns`), whose links the test cuts and heals while no process dies.
//!
//! - A node cut from its router mid-stream: the router hears nothing from it for its idle
//!   timeout and continues each of its streams on the other node, which come out byte-identical
//!   to a fault-free run (greedy and seeded sampling alike). Canary: the same cut under a router
//!   with `--failover false` breaks those streams.
//! - The raft leader cut from the majority (its link down), then, once healed, the next leader
//!   made unheard (everything it sends to the other members is dropped, what they send still
//!   arrives): each time the majority elects another leader and keeps committing, the old
//!   leader refuses a write promptly instead of taking it, and after the heal every member
//!   agrees on one leader and the voters. A writer and a reader record the group throughout:
//!   the history is linearizable and holds every acknowledged write (with the checker's canary).
//! - A joiner cut off right after its certificate is issued (a join in flight across a
//!   partition): once healed it completes, a voter with a record like the others.
//! - A follower cut off while the majority removes it (a leave in flight across a partition):
//!   the removal commits without it, and once healed the group keeps its two voters and the
//!   removed member stays out.
//! - A router cut from the topology group (nodes on hosts of their own, still reachable) serves
//!   from its last view; a node that comes while it is cut off stays unknown to it (the canary:
//!   with its known nodes killed, a request fails), and once healed it finds that node.

mod cluster;
mod history;
mod netns;

use std::path::{Path, PathBuf};
use std::process::Output;
use std::time::{Duration, Instant};

use cluster::{Process, serial, streams_across_a_fault, synth};
use history::recorder::GroupHistory;
use netns::{Host, Net};
use serde_json::Value;
use strata_topology::transport::ClusterCa;

const STRATA: &str = env!("CARGO_BIN_EXE_strata");
const TIMEOUT: Duration = Duration::from_secs(60);

/// Runs 16 streams (odd ones sampled with a seed) through a router on host 1 in front of nodes
/// on hosts 2 and 3 (round robin, so both carry streams), cuts host 2's link once every stream
/// has its first text, and returns per stream whether it ended with the fault-free text.
fn streams_across_a_node_cut(router_args: &[&str]) -> Vec<bool> {
    let tmp = tempfile::tempdir().unwrap();
    let model = tmp.path().join("m");
    synth(&model);
    let model = model.to_str().unwrap();
    let ca = ClusterCa::create(&tmp.path().join("ca")).unwrap();
    let mut net = Net::new();
    let router_host = net.host(1);
    let node_hosts = [net.host(2), net.host(3)];
    let mut nodes = Vec::new();
    let mut addrs = Vec::new();
    for (i, host) in node_hosts.iter().enumerate() {
        let identity = tmp.path().join(format!("member-{}", i + 1));
        ca.issue_member(i as u64 + 1, &identity).unwrap();
        let listen = format!("{}:7100", host.ip);
        let args = [
            "node",
            "serve",
            "--model",
            model,
            "--listen",
            &listen,
            "--identity",
            identity.to_str().unwrap(),
            "--kv-cache-mib",
            "16",
        ];
        let node = Process::start_with(host.command(STRATA), &args);
        addrs.push(node.address("on quic://").to_string());
        nodes.push(node);
    }
    let operator = tmp.path().join("router-identity");
    ca.issue_operator("router-1", &operator).unwrap();
    let (list, host_ip) = (addrs.join(","), router_host.ip.to_string());
    let mut args = vec![
        "router",
        "--model",
        model,
        "--nodes",
        &list,
        "--identity",
        operator.to_str().unwrap(),
        "--policy",
        "round-robin",
        "--host",
        &host_ip,
        "--port",
        "8080",
    ];
    args.extend_from_slice(router_args);
    let router = Process::start_with(router_host.command(STRATA), &args);
    let router_addr = router.address("on http://");
    let reference = Process::start(&["serve", "--model", model, "--port", "0"]);
    let reference_addr = reference.address("on http://");

    let cut = || net.cut(&node_hosts[0]);
    streams_across_a_fault(router_addr, reference_addr, ("partition", 16, 2000), cut)
}

#[test]
fn a_node_cut_from_its_router_mid_stream_fails_over_byte_identical() {
    let _serial = serial();
    let same = streams_across_a_node_cut(&[]);
    assert!(
        same.iter().all(|&s| s),
        "streams changed by the cut: {same:?}"
    );
}

#[test]
fn canary_without_failover_the_cut_breaks_streams() {
    let _serial = serial();
    let same = streams_across_a_node_cut(&["--failover", "false"]);
    assert!(
        same.iter().any(|&s| !s),
        "no stream broke: the cut reached no stream, so the test above proves nothing"
    );
}

/// `strata cluster <args> --data <data>`, run on `host` (its own namespace) or here.
fn cli(host: Option<&Host>, data: &Path, args: &[&str]) -> Output {
    let mut command = match host {
        Some(host) => host.command(STRATA),
        None => std::process::Command::new(STRATA),
    };
    command
        .arg("cluster")
        .args(args)
        .args(["--data", data.to_str().unwrap()])
        .output()
        .expect("run strata")
}

/// `cluster status --json` through the member in `data`, when it answers.
fn status(data: &Path) -> Option<Value> {
    let out = cli(None, data, &["status", "--json"]);
    out.status
        .success()
        .then(|| serde_json::from_slice(&out.stdout).ok())
        .flatten()
}

/// Polls the members in `datas` until one's status passes `check`.
fn wait_status(datas: &[&Path], what: &str, check: impl Fn(&Value) -> bool) -> Value {
    let deadline = Instant::now() + TIMEOUT;
    loop {
        for data in datas {
            if let Some(s) = status(data)
                && check(&s)
            {
                return s;
            }
        }
        assert!(Instant::now() < deadline, "never: {what}");
        std::thread::sleep(Duration::from_millis(200));
    }
}

/// Polls until every member in `datas` reports the same leader and `voters` voters.
fn wait_agreement(datas: &[&Path], voters: usize) -> u64 {
    let deadline = Instant::now() + TIMEOUT;
    loop {
        let leaders: Vec<Option<u64>> = datas
            .iter()
            .map(|d| {
                status(d).and_then(|s| {
                    let settled = s["changing"] == false
                        && s["voters"].as_array().is_some_and(|v| v.len() == voters);
                    settled.then(|| s["leader"].as_u64()).flatten()
                })
            })
            .collect();
        if let Some(Some(first)) = leaders.first()
            && leaders.iter().all(|l| *l == Some(*first))
        {
            return *first;
        }
        assert!(
            Instant::now() < deadline,
            "the members never agreed: {leaders:?}"
        );
        std::thread::sleep(Duration::from_millis(300));
    }
}

/// Three members, one per host (1..=3), `init` on host 1 and two `join --voter`; each process
/// with its data directory.
fn start_group(net: &mut Net, root: &Path) -> (Vec<Host>, Vec<PathBuf>, Vec<Process>) {
    let hosts: Vec<Host> = (1..=3).map(|n| net.host(n)).collect();
    let datas: Vec<PathBuf> = (1..=3).map(|i| root.join(format!("m{i}"))).collect();
    let join = format!("{}:7001", hosts[0].ip);
    let listen = |i: usize| format!("{}:7000", hosts[i].ip);
    let data = |i: usize| datas[i].to_str().unwrap().to_string();
    let init = [
        "cluster",
        "init",
        "--listen",
        &listen(0),
        "--join-listen",
        &join,
        "--data",
        &data(0),
    ];
    let mut members = vec![Process::start_with(hosts[0].command(STRATA), &init)];
    wait_status(&[&datas[0]], "member 1 leads", |s| s["leader"] == 1);
    for i in 1..3 {
        let token = if i == 1 {
            datas[0].join("join-token")
        } else {
            let file = root.join(format!("token-{i}"));
            let out = cli(None, &datas[0], &["token", "--out", file.to_str().unwrap()]);
            assert!(out.status.success(), "{out:?}");
            file
        };
        let args = [
            "cluster",
            "join",
            "--listen",
            &listen(i),
            "--seed",
            &join,
            "--token",
            token.to_str().unwrap(),
            "--voter",
            "--data",
            &data(i),
        ];
        members.push(Process::start_with(hosts[i].command(STRATA), &args));
        let started: Vec<&Path> = datas[..=i].iter().map(PathBuf::as_path).collect();
        wait_agreement(&started, i + 1);
    }
    (hosts, datas, members)
}

/// An operator identity named `name`, issued through the member in `data`, under `root`.
fn operator(root: &Path, data: &Path, name: &str) -> PathBuf {
    let dir = root.join(format!("operator-{name}"));
    let out = cli(
        None,
        data,
        &["operator", "--name", name, "--out", dir.to_str().unwrap()],
    );
    assert!(out.status.success(), "{out:?}");
    dir
}

/// Whether a write through the member in `data`, run on its own host, is refused (not taken)
/// within `within`.
fn write_refused_on(host: &Host, data: &Path, within: Duration) -> bool {
    let started = Instant::now();
    let out = cli(Some(host), data, &["token", "--out", "/dev/null"]);
    let took = started.elapsed();
    eprintln!(
        "write through the cut-off leader: {} in {took:?}: {}",
        out.status,
        String::from_utf8_lossy(&out.stderr).trim()
    );
    !out.status.success() && took < within
}

/// The majority's side: a leader other than `old` whose applied index moves past `applied`.
fn new_leader_commits(datas: &[PathBuf], old: usize, applied: u64) -> u64 {
    let survivors: Vec<&Path> = datas
        .iter()
        .enumerate()
        .filter(|(i, _)| i + 1 != old)
        .map(|(_, d)| d.as_path())
        .collect();
    let after = wait_status(&survivors, "the majority elects and commits", |s| {
        s["leader"].as_u64().is_some_and(|l| l as usize != old)
            && s["last_applied"].as_u64().is_some_and(|a| a > applied + 2)
    });
    after["leader"].as_u64().unwrap()
}

#[test]
fn a_leader_cut_off_or_unheard_is_replaced_and_the_healed_group_is_linearizable() {
    let _serial = serial();
    let root = tempfile::tempdir().unwrap();
    let mut net = Net::new();
    let (hosts, datas, _members) = start_group(&mut net, root.path());
    let paths: Vec<&Path> = datas.iter().map(PathBuf::as_path).collect();
    let operator = operator(root.path(), &datas[0], "history");
    let addrs: Vec<String> = hosts.iter().map(|h| format!("{}:7000", h.ip)).collect();
    let recorder = GroupHistory::record(&operator, addrs);

    // The leader's link goes down: both directions cut.
    let before = wait_status(&paths, "a leader", |s| s["leader"].is_u64());
    let cut = before["leader"].as_u64().unwrap() as usize;
    net.cut(&hosts[cut - 1]);
    let elected = new_leader_commits(&datas, cut, before["last_applied"].as_u64().unwrap());
    eprintln!("leader {cut} cut off; member {elected} leads the majority");
    assert!(
        write_refused_on(&hosts[cut - 1], &datas[cut - 1], Duration::from_secs(30)),
        "the cut-off leader took a write, or hung"
    );
    net.heal(&hosts[cut - 1]);
    let healed = wait_agreement(&paths, 3);
    eprintln!("healed: member {healed} leads all three");

    // The next leader unheard: what it sends to the other members is dropped.
    let unheard = healed as usize;
    let applied = status(&datas[unheard - 1]).unwrap()["last_applied"]
        .as_u64()
        .unwrap();
    let others: Vec<&Host> = (1..=3)
        .filter(|&i| i != unheard)
        .map(|i| &hosts[i - 1])
        .collect();
    for other in &others {
        net.drop_from(&hosts[unheard - 1], other.ip);
    }
    let elected = new_leader_commits(&datas, unheard, applied);
    eprintln!("leader {unheard} unheard; member {elected} leads the majority");
    assert!(
        write_refused_on(
            &hosts[unheard - 1],
            &datas[unheard - 1],
            Duration::from_secs(30)
        ),
        "the unheard leader took a write, or hung"
    );
    for other in &others {
        net.undrop_from(&hosts[unheard - 1], other.ip);
    }
    let healed = wait_agreement(&paths, 3);
    eprintln!("healed: member {healed} leads all three");
    recorder.check();
}

#[test]
fn a_follower_removed_while_cut_off_stays_out_after_the_heal() {
    let _serial = serial();
    let root = tempfile::tempdir().unwrap();
    let mut net = Net::new();
    let (hosts, datas, _members) = start_group(&mut net, root.path());
    let paths: Vec<&Path> = datas.iter().map(PathBuf::as_path).collect();
    let leader = wait_agreement(&paths, 3) as usize;
    let follower = (1..=3).find(|&i| i != leader && i != 1).unwrap();
    net.cut(&hosts[follower - 1]);
    let id = follower.to_string();
    let out = cli(None, &datas[leader - 1], &["leave", "--member", &id]);
    assert!(
        out.status.success(),
        "the majority could not remove a cut-off follower: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let remaining: Vec<&Path> = (1..=3)
        .filter(|&i| i != follower)
        .map(|i| datas[i - 1].as_path())
        .collect();
    wait_agreement(&remaining, 2);
    net.heal(&hosts[follower - 1]);
    // Long enough for the healed member to be heard from, were it to disturb the group.
    std::thread::sleep(Duration::from_secs(5));
    let settled = wait_agreement(&remaining, 2);
    let view = status(remaining[0]).unwrap();
    let voters: Vec<u64> = view["voters"]
        .as_array()
        .unwrap()
        .iter()
        .filter_map(Value::as_u64)
        .collect();
    assert!(
        !voters.contains(&(follower as u64)),
        "the removed member is a voter again: {view}"
    );
    assert_eq!(view["members"], 2, "{view}");
    assert_ne!(settled as usize, follower);
}

#[test]
fn a_join_cut_off_midway_completes_once_healed() {
    let _serial = serial();
    let root = tempfile::tempdir().unwrap();
    let mut net = Net::new();
    let (hosts, mut datas, _members) = start_group(&mut net, root.path());
    let joiner = net.host(4);
    let token = root.path().join("token-4");
    let out = cli(
        None,
        &datas[0],
        &["token", "--out", token.to_str().unwrap()],
    );
    assert!(out.status.success(), "{out:?}");
    datas.push(root.path().join("m4"));
    let (seed, listen) = (
        format!("{}:7001", hosts[0].ip),
        format!("{}:7000", joiner.ip),
    );
    let args = [
        "cluster",
        "join",
        "--listen",
        &listen,
        "--seed",
        &seed,
        "--token",
        token.to_str().unwrap(),
        "--voter",
        "--data",
        datas[3].to_str().unwrap(),
    ];
    let _joining = Process::start_with(joiner.command(STRATA), &args);
    // The certificate is issued: the join is admitted, its learner, record and promotion to come.
    let certificate = datas[3].join("tls").join("member.pem");
    let deadline = Instant::now() + TIMEOUT;
    while !certificate.is_file() {
        assert!(
            Instant::now() < deadline,
            "the joiner never got its certificate"
        );
        std::thread::sleep(Duration::from_millis(1));
    }
    net.cut(&joiner);
    // The join must still be in flight at the cut, or this tests only a rejoin.
    let at_cut = status(&datas[0]).unwrap();
    let voters = at_cut["voters"].as_array().map_or(0, Vec::len);
    eprintln!("at the cut: {voters} voters, {} members", at_cut["members"]);
    assert!(
        voters < 4 || at_cut["members"] != 4,
        "the join had finished before the cut: {at_cut}"
    );
    std::thread::sleep(Duration::from_secs(6));
    net.heal(&joiner);
    let paths: Vec<&Path> = datas.iter().map(PathBuf::as_path).collect();
    wait_agreement(&paths, 4);
    let view = status(&datas[0]).unwrap();
    assert_eq!(view["members"], 4, "{view}");
}

/// A node serving beside `data`'s member, on a host of its own (`host`), declared to the group.
fn node_beside(host: &Host, model: &str, data: &Path) -> Process {
    let listen = format!("{}:7100", host.ip);
    let args = [
        "node",
        "serve",
        "--model",
        model,
        "--data",
        data.to_str().unwrap(),
        "--listen",
        &listen,
        "--kv-cache-mib",
        "16",
    ];
    let node = Process::start_with(host.command(STRATA), &args);
    node.address("declared to the topology group as ");
    node
}

/// The status of a short completion through the router at `addr`.
fn ask(addr: std::net::SocketAddr) -> u16 {
    cluster::post(
        addr,
        "/v1/completions",
        &cluster::completion_body("The capital of France is", 4, false, None),
    )
    .0
}

#[test]
fn a_router_cut_from_the_group_serves_its_last_view_and_catches_up_once_healed() {
    let _serial = serial();
    let root = tempfile::tempdir().unwrap();
    let mut net = Net::new();
    let (hosts, datas, _members) = start_group(&mut net, root.path());
    // Named "m", as the requests name it.
    let model = root.path().join("m");
    synth(&model);
    let model = model.to_str().unwrap();
    let operator = operator(root.path(), &datas[0], "router");
    // Nodes on hosts of their own, so that the router can lose the group and keep the nodes.
    let router_host = net.host(4);
    let node_hosts = [net.host(5), net.host(6), net.host(7)];
    let mut first = [
        node_beside(&node_hosts[0], model, &datas[0]),
        node_beside(&node_hosts[1], model, &datas[1]),
    ];
    let group: Vec<String> = hosts.iter().map(|h| format!("{}:7000", h.ip)).collect();
    let (group, router_ip) = (group.join(","), router_host.ip.to_string());
    let args = [
        "router",
        "--model",
        model,
        "--cluster",
        &group,
        "--identity",
        operator.to_str().unwrap(),
        "--policy",
        "round-robin",
        "--host",
        &router_ip,
        "--port",
        "8080",
    ];
    let router = Process::start_with(router_host.command(STRATA), &args);
    let addr = router.address("on http://");
    assert_eq!(ask(addr), 200, "the router serves before the cut");

    // The router and the group no longer hear each other (both directions: a feed the group
    // pushes would otherwise still arrive); the nodes it knows it still reaches.
    for member in &hosts {
        net.drop_from(&router_host, member.ip);
        net.drop_from(member, router_host.ip);
    }
    std::thread::sleep(Duration::from_secs(2));
    for i in 0..4 {
        assert_eq!(
            ask(addr),
            200,
            "request {i} during the cut: the last view serves"
        );
    }
    // Meanwhile the group changes: a third node comes, the two the router knows go.
    let _third = node_beside(&node_hosts[2], model, &datas[2]);
    for node in &mut first {
        node.kill();
    }
    std::thread::sleep(Duration::from_secs(3));
    // The canary of the cut: had the router heard the group, it would send this to the third.
    assert_ne!(
        ask(addr),
        200,
        "a request found the third node while the router was cut off: the cut did not hold"
    );

    for member in &hosts {
        net.undrop_from(&router_host, member.ip);
        net.undrop_from(member, router_host.ip);
    }
    let healed = Instant::now();
    let deadline = healed + TIMEOUT;
    let mut served = 0;
    while served < 3 {
        assert!(
            Instant::now() < deadline,
            "{TIMEOUT:?} after the heal the router still had not found the third node"
        );
        served = if ask(addr) == 200 { served + 1 } else { 0 };
        std::thread::sleep(Duration::from_millis(200));
    }
    eprintln!(
        "the router served from the third node {:?} after the heal",
        healed.elapsed()
    );
}
