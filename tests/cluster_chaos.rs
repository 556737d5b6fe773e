//! The cluster under chaos (issue 19): a whole local deployment (`deploy/local/up.sh`: three raft
//! members, a node beside each, two routers) serves long greedy streams from clients that retry
//! on the other router when theirs dies, while one thread SIGKILLs a node and a router (drawn
//! from a printed seed) and the raft leader (each started again on its own command line and
//! data), lets a fourth member and its node join and then leave, and restarts every node in turn.
//! Every stream must complete and equal the fault-free run of one `strata serve`; afterwards the
//! members agree on the voters and leader, the group still commits, both routers follow its ring,
//! and what a writer and a reader of the group saw through all of it is linearizable
//! (tests/history), no acknowledged write lost.
//!
//! The faults must have hit live work, or the test proves nothing: some stream had to be retried
//! on the other router (the router kill cut it), the routers failed streams over between nodes,
//! and the canary (the same chaos with the routers' failover off) breaks
//! streams.

mod cluster;
mod history;

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use history::recorder::GroupHistory;

use cluster::{
    Process, complete_with, completion_body, dechunk, deploy_local_with, get, metric, serial,
    strata, stream_text, synth, without_model_label,
};

/// Tokens per stream: long enough that streams are running through every fault.
const TOKENS: u32 = 600;
/// Client threads, each streaming its prompts one after another until the chaos is over.
const CLIENTS: usize = 8;
/// The whole test's bound.
const DEADLINE: Duration = Duration::from_secs(420);

/// The `pid` and command line of `name` in the deployment's pids file.
fn recorded(dir: &Path, name: &str) -> (u32, Vec<String>) {
    let pids = std::fs::read_to_string(dir.join("pids")).unwrap();
    let pid: u32 = pids
        .lines()
        .filter_map(|l| l.split_once(' '))
        .filter(|(_, n)| *n == name)
        .map(|(p, _)| p.parse().unwrap())
        .next_back()
        .unwrap_or_else(|| panic!("{name} is not in the pids file:\n{pids}"));
    let cmdline = std::fs::read(format!("/proc/{pid}/cmdline")).unwrap();
    let args = cmdline
        .split(|&b| b == 0)
        .filter(|a| !a.is_empty())
        .map(|a| String::from_utf8(a.to_vec()).unwrap())
        .collect();
    (pid, args)
}

fn alive(pid: u32) -> bool {
    Path::new(&format!("/proc/{pid}")).exists()
        && !std::fs::read_to_string(format!("/proc/{pid}/stat"))
            .is_ok_and(|s| s.split_whitespace().nth(2) == Some("Z"))
}

/// Starts `args` as `name` of the deployment: its log appended to, its pid recorded for down.sh.
fn spawn_recorded(dir: &Path, name: &str, args: &[String]) {
    let log = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(dir.join(format!("{name}.log")))
        .unwrap();
    let mut child = Command::new(&args[0])
        .args(&args[1..])
        .env("RUST_LOG", "info")
        .stdin(Stdio::null())
        .stdout(log.try_clone().unwrap())
        .stderr(log)
        .spawn()
        .unwrap();
    let mut pids = std::fs::OpenOptions::new()
        .append(true)
        .open(dir.join("pids"))
        .unwrap();
    writeln!(pids, "{} {name}", child.id()).unwrap();
    // down.sh stops it (the deployment's guard runs down.sh); reaped here as soon as it exits,
    // so that down.sh does not wait on a zombie.
    std::thread::spawn(move || child.wait());
}

/// SIGKILLs `name` and starts it again on the same command line (and so the same data).
fn kill_and_restart(dir: &Path, name: &str, down_for: Duration) {
    let (pid, args) = recorded(dir, name);
    let killed = Command::new("kill")
        .args(["-KILL", &pid.to_string()])
        .status()
        .unwrap();
    assert!(killed.success(), "kill {name} ({pid})");
    let until = Instant::now() + Duration::from_secs(10);
    while alive(pid) && Instant::now() < until {
        std::thread::sleep(Duration::from_millis(50));
    }
    std::thread::sleep(down_for);
    spawn_recorded(dir, name, &args);
}

/// How many times `name`'s log says `what`.
fn said(dir: &Path, name: &str, what: &str) -> usize {
    std::fs::read_to_string(dir.join(format!("{name}.log")))
        .map(|l| l.matches(what).count())
        .unwrap_or(0)
}

/// Waits until `name`'s log says `what` more than `before` times.
fn wait_said(dir: &Path, name: &str, what: &str, before: usize) {
    let until = Instant::now() + Duration::from_secs(90);
    while said(dir, name, what) <= before {
        assert!(
            Instant::now() < until,
            "{name} never said {what:?} again:\n{}",
            std::fs::read_to_string(dir.join(format!("{name}.log"))).unwrap_or_default()
        );
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// The group as member `data` sees it (`cluster status --json`), once it answers.
fn status(data: &Path) -> serde_json::Value {
    let until = Instant::now() + Duration::from_secs(60);
    loop {
        let out = strata(&[
            "cluster",
            "status",
            "--data",
            data.to_str().unwrap(),
            "--json",
        ]);
        if out.status.success()
            && let Ok(v) = serde_json::from_slice::<serde_json::Value>(&out.stdout)
            && !v["leader"].is_null()
        {
            return v;
        }
        assert!(Instant::now() < until, "no status from {data:?}: {out:?}");
        std::thread::sleep(Duration::from_millis(300));
    }
}

/// One streamed completion through `addr`: its text when the stream ended with `[DONE]`, `None`
/// when the router was unreachable or the stream was cut (the client then retries elsewhere).
fn stream_once(addr: SocketAddr, body: &str) -> Option<String> {
    let mut conn = TcpStream::connect(addr).ok()?;
    conn.set_read_timeout(Some(Duration::from_secs(120))).ok()?;
    let request = format!(
        "POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\
         Content-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    );
    conn.write_all(request.as_bytes()).ok()?;
    let mut raw = Vec::new();
    let _ = conn.read_to_end(&mut raw);
    let raw = String::from_utf8(raw).ok()?;
    let (head, body) = raw.split_once("\r\n\r\n")?;
    if !head.starts_with("HTTP/1.1 200") || !body.contains("data: [DONE]") {
        return None;
    }
    // A stream that ended with an error event is an answer, a wrong one (never retried).
    let events = dechunk(body);
    if let Some(error) = events.lines().find(|l| l.starts_with("data: {\"error\"")) {
        return Some(format!("<{error}>"));
    }
    Some(stream_text(body))
}

/// What one chaos run saw.
struct Outcome {
    /// `(prompt index, equal to the fault-free run)` per finished stream.
    results: Vec<(usize, bool)>,
    /// Streams re-sent to the other router (cut or refused by theirs).
    retried: usize,
    /// `strata_router_failovers_total` of both routers, the killed one's before its kill added
    /// to its count since the restart.
    failovers: f64,
}

#[test]
fn streams_survive_node_router_and_leader_kills_joins_leaves_and_a_rolling_restart() {
    let _serial = serial();
    let Outcome {
        results,
        retried,
        failovers,
    } = chaos("");
    let broken: Vec<usize> = results.iter().filter(|r| !r.1).map(|r| r.0).collect();
    assert!(
        broken.is_empty(),
        "streams that did not complete equal to the fault-free run (prompt index): {broken:?} \
         of {}",
        results.len()
    );
    assert!(results.len() >= CLIENTS, "too few streams ran: {results:?}");
    // The faults hit live streams: a stream cut by the router kill was retried, and the routers
    // moved streams between nodes.
    assert!(retried > 0, "no stream was cut by the router kill");
    assert!(failovers >= 1.0, "no stream failed over between nodes");
}

/// The canary: the same chaos with the routers' failover off must break streams (a node killed
/// under them ends them with an error), or the faults never reached a stream.
#[test]
fn canary_the_same_chaos_without_failover_breaks_streams() {
    let _serial = serial();
    let outcome = chaos("--failover false");
    assert!(
        outcome.results.iter().any(|r| !r.1),
        "every stream survived the chaos with failover off: {:?}",
        outcome.results
    );
}

/// One chaos run against a local deployment whose routers take `router_args`; the group's own
/// consistency is asserted here, the streams' outcome returned.
fn chaos(router_args: &str) -> Outcome {
    let started = Instant::now();
    let tmp = tempfile::tempdir().unwrap();
    let model = tmp.path().join("m");
    synth(&model);
    let model_arg = model.to_str().unwrap().to_string();

    // The fault-free run: one process.
    let reference = Process::start(&["serve", "--model", &model_arg, "--port", "0"]);
    let reference_addr = reference.address("on http://");
    let prompts: Vec<String> = (0..24).map(|i| format!("chaos {i}: the story")).collect();
    let want: Vec<String> = prompts
        .iter()
        .map(|p| complete_with(reference_addr, p, TOKENS, None))
        .collect();
    drop(reference);
    eprintln!("fault-free run: {:?}", started.elapsed());

    let dir: PathBuf = tmp.path().join("cluster");
    let (_down, base) = deploy_local_with(&dir, &model, (3, 2), router_args, "");
    let routers: [SocketAddr; 2] =
        [101, 102].map(|p| format!("127.0.0.1:{}", base + p).parse().unwrap());
    let member = |i: u16| dir.join(format!("member-{i}"));
    eprintln!("deployed: {:?}", started.elapsed());
    let group_history = GroupHistory::record(
        &dir.join("router-identity"),
        (1..=3)
            .map(|i| format!("127.0.0.1:{}", base + 10 * i))
            .collect(),
    );

    // Clients: each streams its prompts in turn, starting on router `c % 2`, and retries a
    // stream on the other router when it is cut or refused.
    let chaos_over = Arc::new(AtomicBool::new(false));
    let retried = Arc::new(AtomicUsize::new(0));
    let results = Arc::new(Mutex::new(Vec::<(usize, bool)>::new()));
    let clients: Vec<_> = (0..CLIENTS)
        .map(|c| {
            let (prompts, want) = (prompts.clone(), want.clone());
            let (over, retried, results) = (chaos_over.clone(), retried.clone(), results.clone());
            std::thread::spawn(move || {
                let mut round = 0;
                loop {
                    let i = (c + round * CLIENTS) % prompts.len();
                    let body = completion_body(&prompts[i], TOKENS, true, None);
                    let mut side = c % 2;
                    let text = loop {
                        if let Some(text) = stream_once(routers[side], &body) {
                            break Some(text);
                        }
                        if started.elapsed() > DEADLINE {
                            break None;
                        }
                        retried.fetch_add(1, Ordering::Relaxed);
                        side = 1 - side;
                        std::thread::sleep(Duration::from_millis(200));
                    };
                    let same = text.as_deref() == Some(want[i].as_str());
                    results.lock().unwrap().push((i, same));
                    round += 1;
                    if over.load(Ordering::Relaxed) || !same {
                        return;
                    }
                }
            })
        })
        .collect();
    // Let every client get going before the first fault.
    std::thread::sleep(Duration::from_secs(2));

    // 1. A node SIGKILLed and back on its address.
    let declared = "declared to the topology group";
    // Which node and which router die is drawn from a seed, printed (STRATA_CHAOS_SEED replays
    // a run).
    let seed: u64 = std::env::var("STRATA_CHAOS_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| {
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(1, |d| d.as_nanos() as u64)
        });
    let (seeded_node, victim_router) = (1 + seed % 3, 1 + (seed / 3) % 2);
    // The node that dies runs streams when it does: cache-aware routing may keep every stream on
    // one node while it keeps up, and killing another would hit none. The busiest node by the
    // routers' view of the loads, the seed's when none is busier.
    let running = |i: u64| -> f64 {
        let label = format!(
            "strata_engine_requests_running{{node=\"127.0.0.1:{}\"}}",
            u64::from(base) + 10 * i + 2
        );
        routers
            .iter()
            .map(|r| {
                get(*r, "/metrics")
                    .lines()
                    .map(without_model_label)
                    .find(|l| l.starts_with(&label))
                    .and_then(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
                    .unwrap_or(0.0)
            })
            .sum()
    };
    let loads: Vec<f64> = (1..=3).map(running).collect();
    let victim_node = (1..=3u64)
        .filter(|&i| loads[i as usize - 1] > loads[seeded_node as usize - 1])
        .max_by(|a, b| loads[*a as usize - 1].total_cmp(&loads[*b as usize - 1]))
        .unwrap_or(seeded_node);
    eprintln!(
        "chaos seed {seed}: node-{victim_node} (running {loads:?}) and router-{victim_router} die"
    );
    let node = format!("node-{victim_node}");
    let before = said(&dir, &node, declared);
    kill_and_restart(&dir, &node, Duration::from_millis(500));
    wait_said(&dir, &node, declared, before);

    // 2. A router SIGKILLed (its clients retry on the other) and back.
    let router = format!("router-{victim_router}");
    let before = said(&dir, &router, "on http://");
    // Its failover count dies with it: kept to add to the end's.
    let failovers_before_kill = metric(
        &get(routers[victim_router as usize - 1], "/metrics"),
        "strata_router_failovers_total",
    );
    kill_and_restart(&dir, &router, Duration::from_millis(500));
    wait_said(&dir, &router, "on http://", before);

    // 3. The raft leader SIGKILLed and back; the group elects and goes on.
    let leader = status(&member(1))["leader"].as_u64().unwrap();
    let name = format!("member-{leader}");
    kill_and_restart(&dir, &name, Duration::from_secs(1));
    let survivor = if leader == 1 { member(2) } else { member(1) };
    status(&survivor);

    // 4. A fourth member joins with its node beside it, under the same load.
    let token = dir.join("token-4");
    let out = strata(&[
        "cluster",
        "token",
        "--data",
        member(1).to_str().unwrap(),
        "--out",
        token.to_str().unwrap(),
    ]);
    assert!(out.status.success(), "token: {out:?}");
    let member4 = member(4);
    let join: Vec<String> = [
        env!("CARGO_BIN_EXE_strata"),
        "cluster",
        "join",
        "--data",
        member4.to_str().unwrap(),
        "--listen",
        &format!("127.0.0.1:{}", base + 40),
        "--seed",
        &format!("127.0.0.1:{}", base + 11),
        "--token",
        token.to_str().unwrap(),
        "--voter",
    ]
    .map(String::from)
    .to_vec();
    spawn_recorded(&dir, "member-4", &join);
    let node4: Vec<String> = [
        env!("CARGO_BIN_EXE_strata"),
        "node",
        "serve",
        "--model",
        &model_arg,
        "--data",
        member4.to_str().unwrap(),
        "--listen",
        &format!("127.0.0.1:{}", base + 42),
    ]
    .map(String::from)
    .to_vec();
    spawn_recorded(&dir, "node-4", &node4);
    wait_said(&dir, "node-4", declared, 0);

    // 5. A rolling restart of every node, one after another, each declared again before the next.
    for i in 1..=4 {
        let name = format!("node-{i}");
        let before = said(&dir, &name, declared);
        kill_and_restart(&dir, &name, Duration::from_millis(300));
        wait_said(&dir, &name, declared, before);
    }

    // 6. Member 4 leaves (and its certificate is revoked) while streams run on its node.
    let out = strata(&[
        "cluster",
        "leave",
        "--data",
        member(1).to_str().unwrap(),
        "--member",
        "4",
    ]);
    assert!(out.status.success(), "leave: {out:?}");
    let (node4_pid, _) = recorded(&dir, "node-4");
    let _ = Command::new("kill")
        .args(["-KILL", &node4_pid.to_string()])
        .status();

    chaos_over.store(true, Ordering::Relaxed);
    eprintln!("chaos over: {:?}", started.elapsed());
    for client in clients {
        client.join().expect("a client thread panicked");
    }
    let results = results.lock().unwrap().clone();
    let failovers: f64 = failovers_before_kill
        + routers
            .iter()
            .map(|r| metric(&get(*r, "/metrics"), "strata_router_failovers_total"))
            .sum::<f64>();

    // The group agrees with itself: every member names the same leader and voters (member 4
    // gone), commits a write, and both routers follow the same ring epoch.
    let views: Vec<serde_json::Value> = (1..=3).map(|i| status(&member(i))).collect();
    for v in &views[1..] {
        assert_eq!(v["leader"], views[0]["leader"], "{views:?}");
        assert_eq!(v["voters"], views[0]["voters"], "{views:?}");
    }
    let voters = views[0]["voters"].as_array().unwrap().clone();
    assert_eq!(voters.len(), 3, "voters after member 4 left: {voters:?}");
    assert!(!voters.contains(&serde_json::json!(4)), "{voters:?}");
    let out = strata(&[
        "cluster",
        "token",
        "--data",
        member(1).to_str().unwrap(),
        "--out",
        dir.join("token-after").to_str().unwrap(),
    ]);
    assert!(out.status.success(), "the group no longer commits: {out:?}");
    let epoch = views[0]["ring_epoch"].as_f64().unwrap();
    let until = Instant::now() + Duration::from_secs(30);
    for router in routers {
        while metric(&get(router, "/metrics"), "strata_router_ring_epoch") != epoch {
            assert!(
                Instant::now() < until,
                "router {router} does not follow ring epoch {epoch}"
            );
            std::thread::sleep(Duration::from_millis(200));
        }
    }
    group_history.check();
    let retried = retried.load(Ordering::Relaxed);
    eprintln!(
        "{} streams, {retried} retries on the other router, {failovers} node failovers, {:?}",
        results.len(),
        started.elapsed()
    );
    Outcome {
        results,
        retried,
        failovers,
    }
}
