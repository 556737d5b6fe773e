//! The load balancer example (deploy/haproxy/haproxy.cfg, ports substituted) in front of two
//! routers of a real local cluster, under streaming load from client threads:
//! - a router SIGKILLed: every request started after the kill succeeds through the other router
//!   (the example's retry of a refused connection on another router carries the requests sent
//!   before the health check notices). The canary, at the same kill: a balancer whose config lacks
//!   those retry lines fails some.
//! - a router SIGTERMed: it drains (`/ready` answers 503 while it still serves), the balancer's
//!   check on `/ready` takes it out for that reason, and every request succeeds through a
//!   balancer that never retries; the router exits cleanly once its streams end. The canary: with
//!   `--drain-delay-s 0` the same balancer fails some requests, and takes the router out only
//!   once its connections are refused.
//!
//! HAProxy comes from Debian (scripts/fetch-test-data.sh installs it); this test installs nothing.

mod cluster;

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use cluster::{Process, completion_body, deploy_local, get, serial, synth};

/// Client threads per balancer, each streaming one request after another.
const CLIENTS: usize = 2;
/// Tokens per stream: a stream lasts a fraction of a second, so many start in every phase.
const TOKENS: u32 = 24;

/// The HAProxy binary: on PATH, or where Debian puts it (root's PATH has it; others' may not).
fn haproxy_binary() -> PathBuf {
    let on_path = std::env::var_os("PATH")
        .map(|p| std::env::split_paths(&p).collect::<Vec<_>>())
        .unwrap_or_default()
        .into_iter()
        .chain([PathBuf::from("/usr/sbin")])
        .map(|dir| dir.join("haproxy"))
        .find(|p| p.is_file());
    on_path.unwrap_or_else(|| {
        panic!("no haproxy: run scripts/fetch-test-data.sh as root (it installs Debian's haproxy)")
    })
}

/// `text` with its one `from` replaced by `to`; the example must hold `from` exactly once, so a
/// change to it cannot leave this test running something else.
fn replace_once(text: &str, from: &str, to: &str) -> String {
    assert_eq!(
        text.matches(from).count(),
        1,
        "deploy/haproxy/haproxy.cfg should hold {from:?} once"
    );
    text.replacen(from, to, 1)
}

/// The example config listening on `listen`, over `routers`, its admin socket at `socket`; with
/// `retry` false, without the lines that retry a refused connection on another router.
fn haproxy_config(listen: u16, routers: [u16; 2], socket: &Path, retry: bool) -> String {
    let example = std::fs::read_to_string(
        Path::new(env!("CARGO_MANIFEST_DIR")).join("deploy/haproxy/haproxy.cfg"),
    )
    .unwrap();
    let mut text = replace_once(&example, "bind :8000", &format!("bind 127.0.0.1:{listen}"));
    text = replace_once(
        &text,
        "10.0.0.11:8000",
        &format!("127.0.0.1:{}", routers[0]),
    );
    text = replace_once(
        &text,
        "10.0.0.12:8000",
        &format!("127.0.0.1:{}", routers[1]),
    );
    text = replace_once(
        &text,
        "stats socket /run/haproxy/admin.sock",
        &format!("stats socket {}", socket.display()),
    );
    if !retry {
        text = replace_once(&text, "    retries 1\n", "    retries 0\n");
        text = replace_once(&text, "    option redispatch 1\n", "");
        text = replace_once(&text, "    retry-on conn-failure empty-response\n", "");
    }
    text
}

/// A running HAProxy, killed when dropped; what it logs goes to `log`.
struct Balancer {
    child: Child,
    addr: SocketAddr,
    socket: PathBuf,
    log: PathBuf,
}

impl Balancer {
    fn start(dir: &Path, name: &str, routers: [u16; 2], retry: bool) -> Self {
        let port = cluster::free_ports(1);
        let socket = dir.join(format!("{name}.sock"));
        let config = dir.join(format!("{name}.cfg"));
        std::fs::write(&config, haproxy_config(port, routers, &socket, retry)).unwrap();
        let log = dir.join(format!("{name}.log"));
        let check = Command::new(haproxy_binary())
            .args(["-c", "-f"])
            .arg(&config)
            .output()
            .unwrap();
        assert!(check.status.success(), "haproxy -c: {check:?}");
        let child = Command::new(haproxy_binary())
            .args(["-db", "-f"])
            .arg(&config)
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(&log).unwrap())
            .spawn()
            .unwrap();
        let balancer = Self {
            child,
            addr: SocketAddr::from(([127, 0, 0, 1], port)),
            socket,
            log,
        };
        balancer.wait_for("router-1", "UP");
        balancer.wait_for("router-2", "UP");
        balancer
    }

    /// The check status of `server` ("UP", "DOWN", "UP 1/2" while going down, ...), from the admin
    /// socket's `show stat`.
    fn status(&self, server: &str) -> Option<String> {
        let mut conn = UnixStream::connect(&self.socket).ok()?;
        conn.write_all(b"show stat\n").ok()?;
        let mut csv = String::new();
        conn.read_to_string(&mut csv).ok()?;
        let mut lines = csv.lines();
        let header: Vec<&str> = lines.next()?.trim_start_matches("# ").split(',').collect();
        let column = |name: &str| header.iter().position(|h| *h == name);
        let (proxy, name, status) = (column("pxname")?, column("svname")?, column("status")?);
        lines
            .map(|l| l.split(',').collect::<Vec<_>>())
            .find(|f| f.get(proxy) == Some(&"routers") && f.get(name) == Some(&server))
            .and_then(|f| f.get(status).map(|s| s.to_string()))
    }

    fn wait_for(&self, server: &str, status: &str) {
        let deadline = Instant::now() + Duration::from_secs(20);
        loop {
            let now = self.status(server);
            if now.as_deref() == Some(status) {
                return;
            }
            assert!(
                Instant::now() < deadline,
                "{server} is {now:?}, not {status}, after 20 s:\n{}",
                self.logged()
            );
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    fn logged(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// The line in which the balancer took `server` out.
    fn down_line(&self, server: &str) -> String {
        let needle = format!("Server routers/{server} is DOWN");
        self.logged()
            .lines()
            .rev()
            .find(|l| l.contains(&needle))
            .map(str::to_string)
            .unwrap_or_else(|| panic!("no {needle:?} in:\n{}", self.logged()))
    }
}

impl Drop for Balancer {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// One request as a client saw it.
struct Outcome {
    started: Instant,
    /// `Err` says what went wrong: a status other than 200, a stream cut short, an error event.
    result: Result<(), String>,
}

/// A streamed completion through `addr`, read to its end.
fn stream_once(addr: SocketAddr, body: &str) -> Result<(), String> {
    let mut conn = TcpStream::connect(addr).map_err(|e| format!("connect: {e}"))?;
    conn.set_read_timeout(Some(Duration::from_secs(30)))
        .unwrap();
    let request = format!(
        "POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\
         Content-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    );
    conn.write_all(request.as_bytes())
        .map_err(|e| format!("send: {e}"))?;
    let mut raw = Vec::new();
    let read = conn.read_to_end(&mut raw);
    let raw = String::from_utf8_lossy(&raw);
    let status = raw.split(' ').nth(1).unwrap_or("none");
    if status != "200" {
        return Err(format!(
            "status {status}: {}",
            raw.lines().next().unwrap_or("")
        ));
    }
    if let Err(e) = read {
        return Err(format!("read: {e}"));
    }
    if raw.contains("\"error\"") || !raw.contains("data: [DONE]") {
        return Err(format!("stream cut or failed: {raw}"));
    }
    Ok(())
}

/// Client threads streaming through `addr` until stopped.
struct Load {
    stop: Arc<AtomicBool>,
    outcomes: Arc<Mutex<Vec<Outcome>>>,
    threads: Vec<JoinHandle<()>>,
}

impl Load {
    fn start(addr: SocketAddr, tag: &str) -> Self {
        let stop = Arc::new(AtomicBool::new(false));
        let outcomes = Arc::new(Mutex::new(Vec::new()));
        let threads = (0..CLIENTS)
            .map(|c| {
                let (stop, outcomes) = (stop.clone(), outcomes.clone());
                let tag = format!("{tag} client {c}");
                std::thread::spawn(move || {
                    let mut i = 0;
                    while !stop.load(Ordering::Relaxed) {
                        let prompt = format!("{tag} asks question {i}");
                        let body = completion_body(&prompt, TOKENS, true, None);
                        let started = Instant::now();
                        let result = stream_once(addr, &body);
                        // A refusal comes back at once: pause rather than spin on it.
                        if result.is_err() {
                            std::thread::sleep(Duration::from_millis(20));
                        }
                        outcomes.lock().unwrap().push(Outcome { started, result });
                        i += 1;
                    }
                })
            })
            .collect();
        Self {
            stop,
            outcomes,
            threads,
        }
    }

    /// Stops the clients; every request made.
    fn finish(self) -> Vec<Outcome> {
        self.stop.store(true, Ordering::Relaxed);
        for t in self.threads {
            t.join().unwrap();
        }
        std::mem::take(&mut *self.outcomes.lock().unwrap())
    }
}

/// The failures among the requests started at or after `from`, and how many started then.
fn failures_since(outcomes: &[Outcome], from: Instant) -> (Vec<String>, usize) {
    let since: Vec<&Outcome> = outcomes.iter().filter(|o| o.started >= from).collect();
    let failed = since
        .iter()
        .filter_map(|o| o.result.as_ref().err().cloned())
        .collect();
    (failed, since.len())
}

/// A `strata router` of the cluster on `port`, with `extra` flags.
fn router(cluster_dir: &Path, model: &Path, member: &str, port: u16, extra: &[&str]) -> Process {
    let port = port.to_string();
    let identity = cluster_dir.join("router-identity");
    let mut args = vec![
        "router",
        "--model",
        model.to_str().unwrap(),
        "--cluster",
        member,
        "--identity",
        identity.to_str().unwrap(),
        "--port",
        &port,
    ];
    args.extend_from_slice(extra);
    let process = Process::start(&args);
    process.address("on http://");
    process
}

fn sigterm(process: &Process) {
    // SAFETY: kill(2) on the pid of a child this test started and has not reaped.
    let sent = unsafe { libc::kill(process.child.id() as libc::pid_t, libc::SIGTERM) };
    assert_eq!(sent, 0, "SIGTERM");
}

/// The exit status of `process` once it has exited, within `limit`.
fn wait_exit(process: &mut Process, limit: Duration) -> std::process::ExitStatus {
    let deadline = Instant::now() + limit;
    loop {
        if let Some(status) = process.child.try_wait().unwrap() {
            return status;
        }
        assert!(Instant::now() < deadline, "still running after {limit:?}");
        std::thread::sleep(Duration::from_millis(50));
    }
}

#[test]
fn the_balancer_survives_a_router_kill_and_takes_a_draining_router_out() {
    let _serial = serial();
    let began = Instant::now();
    let tmp = tempfile::tempdir().unwrap();
    let model = tmp.path().join("m");
    synth(&model);
    let dir = tmp.path().join("cluster");
    let (_down, base) = deploy_local(&dir, &model, 1);
    let member = format!("127.0.0.1:{}", base + 10);
    let ports = [cluster::free_ports(1), cluster::free_ports(1)];
    let start_router = |port: u16, extra: &[&str]| router(&dir, &model, &member, port, extra);
    let mut router_1 = start_router(ports[0], &[]);
    let _router_2 = start_router(ports[1], &[]);
    let retrying = Balancer::start(tmp.path(), "retrying", ports, true);
    let plain = Balancer::start(tmp.path(), "plain", ports, false);

    // A SIGKILL, under load through both balancers.
    let load = Load::start(retrying.addr, "retrying");
    let canary_load = Load::start(plain.addr, "plain");
    std::thread::sleep(Duration::from_secs(1));
    router_1.kill();
    let killed = Instant::now();
    retrying.wait_for("router-1", "DOWN");
    plain.wait_for("router-1", "DOWN");
    std::thread::sleep(Duration::from_millis(500));
    let outcomes = load.finish();
    let canary = canary_load.finish();
    let (failed, started) = failures_since(&outcomes, killed);
    assert!(started > 0, "no request started after the kill");
    assert!(failed.is_empty(), "{failed:?} of {started} failed");
    // Some of them met the dead router and were sent on: their log lines count a retry on
    // another server (`+1` in the retries field).
    let redispatched = retrying
        .logged()
        .lines()
        .filter(|l| l.split_whitespace().any(|w| w.ends_with("/+1")))
        .count();
    assert!(
        redispatched > 0,
        "no request was retried:\n{}",
        retrying.logged()
    );
    let (canary_failed, canary_started) = failures_since(&canary, killed);
    assert!(
        !canary_failed.is_empty(),
        "the canary passed: without the retry lines, all {canary_started} requests sent after \
         the kill succeeded"
    );
    eprintln!(
        "kill: {started} requests after it through the example config, none failed \
         ({redispatched} sent on to the other router); {} of {canary_started} failed without \
         its retry lines",
        canary_failed.len()
    );

    // A SIGTERM with the default drain delay, under load through the balancer that never retries.
    let mut router_1 = start_router(ports[0], &[]);
    plain.wait_for("router-1", "UP");
    let load = Load::start(plain.addr, "drain");
    std::thread::sleep(Duration::from_secs(1));
    let terminated = Instant::now();
    sigterm(&router_1);
    let router_addr = SocketAddr::from(([127, 0, 0, 1], ports[0]));
    let deadline = Instant::now() + Duration::from_secs(3);
    let ready = loop {
        let ready = get(router_addr, "/ready");
        if ready.contains(" 503 ") || Instant::now() > deadline {
            break ready;
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    assert!(
        ready.contains(" 503 ") && ready.contains("draining"),
        "{ready}"
    );
    // Still serving while it drains: a request straight to it succeeds.
    let body = completion_body("straight to the draining router", TOKENS, true, None);
    stream_once(router_addr, &body).expect("the draining router serves");
    plain.wait_for("router-1", "DOWN");
    let taken_out = terminated.elapsed();
    let status = wait_exit(&mut router_1, Duration::from_secs(30));
    let stopped = terminated.elapsed();
    std::thread::sleep(Duration::from_millis(500));
    let outcomes = load.finish();
    assert!(status.success(), "the drained router exited with {status}");
    let reason = plain.down_line("router-1");
    assert!(
        reason.contains("code: 503"),
        "taken out for another reason: {reason}"
    );
    let (failed, started) = failures_since(&outcomes, terminated);
    assert!(failed.is_empty(), "{failed:?} of {started} failed");
    let delay = Duration::from_secs(strata_router::drain::DEFAULT_DRAIN_DELAY_S);
    assert!(
        taken_out < delay && delay <= stopped,
        "taken out after {taken_out:?}, stopped after {stopped:?}: not within the {delay:?} drain"
    );
    eprintln!(
        "drain: taken out after {taken_out:?}, stopped after {stopped:?}; {started} requests, \
         none failed"
    );

    // The canary: no drain delay, the same balancer.
    let router_1 = start_router(ports[0], &["--drain-delay-s", "0"]);
    plain.wait_for("router-1", "UP");
    let load = Load::start(plain.addr, "no drain");
    std::thread::sleep(Duration::from_secs(1));
    let terminated = Instant::now();
    sigterm(&router_1);
    plain.wait_for("router-1", "DOWN");
    std::thread::sleep(Duration::from_millis(500));
    let outcomes = load.finish();
    let (failed, started) = failures_since(&outcomes, terminated);
    assert!(
        !failed.is_empty(),
        "the canary passed: with no drain delay, all {started} requests succeeded"
    );
    let reason = plain.down_line("router-1");
    assert!(!reason.contains("code: 503"), "{reason}");
    eprintln!(
        "no drain: {} of {started} failed; taken out by: {reason}",
        failed.len()
    );
    assert!(
        began.elapsed() < Duration::from_secs(90),
        "took {:?}",
        began.elapsed()
    );
}
