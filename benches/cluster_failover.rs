//! Raft failover with real `strata cluster` processes: 3 and then 5 voters on 127.0.0.1, the
//! leader SIGKILLed again and again, the time from each kill to the first write a new leader
//! commits, and a linearizability check of everything the clients saw.
//!
//! Clients, in this process, speak the cluster's own QUIC protocol with an operator certificate
//! from the cluster CA: one writer per member, pinned to it and never following redirects, so that the
//! first write after a kill is the new leader's first commit and not a client's leader-discovery
//! backoff; and one reader doing linearizable reads through whichever member answers. Every
//! operation is recorded and the history checked against a set model (tests/history): an
//! acknowledged write missing from a later read, or a read that goes back in time, fails the
//! bench. A write whose answer never came (a timeout across a kill) may or may not have been
//! applied; one refused as "not the leader" or never sent was not.
//!
//! `cargo bench --bench cluster_failover` prints one JSON object on stdout (progress on stderr);
//! `STRATA_FAILOVER_KILLS` sets the kills per group size (default 50).

#[path = "../tests/history/mod.rs"]
mod history;

use std::fs::File;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Child, Command as Process, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, PoisonError};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail, ensure};
use history::registry::{
    CHECK_BUDGET, Journal, WRITE_PAUSE, canary_caught, lost_writes, read_loop, record_reads,
    unix_ms, write_loop,
};
use history::{SetModel, Verdict, check};
use serde_json::{Value, json};
use strata_topology::server::{DataLayout, ServerConfig, Timing};
use strata_topology::state::{
    Capacity, Change, Command, MemberAddresses, MemberSpec, RaftRole, Rejection,
};
use strata_topology::transport::wire::{ClusterView, FeedItem, MembershipChange};
use strata_topology::transport::{Client, ClusterCa, MemberIdentity, operator_endpoint};

/// How long a setup step (a join, a catch-up, a settled leader) may take.
const SETUP_TIMEOUT: Duration = Duration::from_secs(60);
/// How long the group may go without committing after a kill before the bench gives up.
const FAILOVER_TIMEOUT: Duration = Duration::from_secs(30);
/// The bound on one client call; a call to a dead member ends here, its outcome unknown.
const CALL_TIMEOUT: Duration = Duration::from_secs(1);
/// The name on the clients' operator certificate.
const OPERATOR: &str = "failover-bench";

/// A running `strata cluster` process, SIGKILLed when dropped; its log goes to `<data>.log`.
struct MemberProcess {
    child: Child,
    data: PathBuf,
}

impl MemberProcess {
    fn spawn(data: &Path, args: &[&str]) -> Result<Self> {
        let log = File::options()
            .create(true)
            .append(true)
            .open(data.with_extension("log"))
            .context("member log")?;
        let child = Process::new(env!("CARGO_BIN_EXE_strata"))
            .arg("cluster")
            .args(args)
            .arg("--data")
            .arg(data)
            .env("RUST_LOG", "info")
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .context("spawn strata")?;
        Ok(Self {
            child,
            data: data.to_path_buf(),
        })
    }

    /// Restarts the member from its data directory.
    fn restart(&mut self) -> Result<()> {
        *self = Self::spawn(&self.data, &["serve"])?;
        Ok(())
    }

    fn kill(&mut self) {
        // SIGKILL on Unix: no shutdown path runs, as in a crash.
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Drop for MemberProcess {
    fn drop(&mut self) {
        self.kill();
    }
}

/// A loopback UDP port nothing is bound to right now.
fn free_port() -> Result<u16> {
    let socket = std::net::UdpSocket::bind("127.0.0.1:0")?;
    Ok(socket.local_addr()?.port())
}

/// The last lines of each member's log, for an error.
fn log_tails(datas: &[PathBuf]) -> String {
    let mut tails = String::new();
    for data in datas {
        let log = std::fs::read_to_string(data.with_extension("log")).unwrap_or_default();
        let lines: Vec<&str> = log.lines().collect();
        let tail = lines[lines.len().saturating_sub(8)..].join("\n");
        tails.push_str(&format!("== {}\n{tail}\n", data.display()));
    }
    tails
}

/// Polls linearizable reads through `addrs` until `accept` takes one.
async fn wait_view(
    client: &Client,
    addrs: &[String],
    what: &str,
    accept: impl Fn(&ClusterView) -> bool,
) -> Result<ClusterView> {
    let deadline = Instant::now() + SETUP_TIMEOUT;
    loop {
        for addr in addrs {
            if let Ok(view) = client.read(addr).await
                && accept(&view)
            {
                return Ok(view);
            }
        }
        if Instant::now() >= deadline {
            bail!("never: {what}");
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// Waits until the member at `addr` has applied `index`, through its change feed.
async fn wait_applied(client: &Client, addr: &str, index: u64) -> Result<()> {
    let deadline = tokio::time::Instant::now() + SETUP_TIMEOUT;
    let follow = async {
        loop {
            let Ok(mut feed) = client.subscribe(addr).await else {
                tokio::time::sleep(Duration::from_millis(50)).await;
                continue;
            };
            while let Ok(Some(item)) = feed.next().await {
                let applied = match item {
                    FeedItem::Start { last_applied, .. } => last_applied.map(|l| l.index),
                    FeedItem::Applied { log_id, .. } => Some(log_id.index),
                    FeedItem::Restart => break,
                };
                if applied.is_some_and(|a| a >= index) {
                    return;
                }
            }
        }
    };
    tokio::time::timeout_at(deadline, follow)
        .await
        .with_context(|| format!("{addr} never applied index {index}"))
}

/// What `cluster join --voter` does once the seed has admitted the learner: record the member,
/// promote it once caught up, record the promotion.
async fn finish_join(client: &Client, seed: &str, data: &Path, addr: &str) -> Result<()> {
    let id = MemberIdentity::load(&DataLayout::new(data).tls_dir())?.id;
    let view = wait_view(
        client,
        &[seed.to_string()],
        "the learner is admitted",
        |v| v.nodes.contains_key(&id),
    )
    .await?;
    let spec = MemberSpec {
        id,
        addresses: MemberAddresses {
            raft: addr.to_string(),
            rpc: addr.to_string(),
        },
        gpus: Vec::new(),
        capacity: Capacity::default(),
        labels: Default::default(),
        role: RaftRole::Learner,
    };
    if !view.cluster.members().contains_key(&id) {
        let record = Command::new(unix_ms(), Change::AddMember(spec));
        match client.propose(seed, record).await?.1 {
            Ok(_) | Err(Rejection::MemberExists(_)) => {}
            Err(e) => bail!("record member {id}: {e}"),
        }
    }
    let applied = wait_view(client, &[seed.to_string()], "a read", |_| true)
        .await?
        .last_applied
        .map_or(0, |l| l.index);
    wait_applied(client, addr, applied).await?;
    client
        .change_membership(seed, MembershipChange::AddVoters([id].into()))
        .await?;
    let role = Change::SetRole {
        id,
        role: RaftRole::Voter,
    };
    client
        .propose(seed, Command::new(unix_ms(), role))
        .await?
        .1?;
    Ok(())
}

/// The group: its members' processes, addresses and the client that talks to them.
struct Group {
    _root: tempfile::TempDir,
    members: Vec<MemberProcess>,
    addrs: Vec<String>,
    client: Client,
    timing: Timing,
}

impl Group {
    /// `init`, then `join --voter` until there are `voters` voters.
    async fn start(voters: usize) -> Result<Self> {
        let root = tempfile::tempdir()?;
        let datas: Vec<PathBuf> = (1..=voters)
            .map(|i| root.path().join(format!("m{i}")))
            .collect();
        let mut addrs = Vec::with_capacity(voters);
        for _ in 0..voters {
            addrs.push(format!("127.0.0.1:{}", free_port()?));
        }
        let join = format!("127.0.0.1:{}", free_port()?);
        let mut members = vec![MemberProcess::spawn(
            &datas[0],
            &["init", "--listen", &addrs[0], "--join-listen", &join],
        )?];
        let deadline = Instant::now() + SETUP_TIMEOUT;
        while !DataLayout::new(&datas[0]).join_token().exists() {
            ensure!(Instant::now() < deadline, "init wrote no join token");
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        let config =
            ServerConfig::load(&DataLayout::new(&datas[0]).config()).map_err(anyhow::Error::msg)?;
        let identity = ClusterCa::load(&DataLayout::new(&datas[0]).ca_dir())?
            .issue_operator(OPERATOR, &root.path().join("operator"))?;
        let local: SocketAddr = "127.0.0.1:0".parse()?;
        let client = Client::new(operator_endpoint(&identity, local)?, CALL_TIMEOUT);
        wait_view(&client, &addrs[..1], "member 1 leads", |v| {
            v.leader == Some(1)
        })
        .await?;
        for i in 1..voters {
            // Each join spends a token: `init` wrote the first, `cluster token` issues the next.
            let token = if i == 1 {
                DataLayout::new(&datas[0]).join_token()
            } else {
                let file = root.path().join(format!("token-{i}"));
                let out = Process::new(env!("CARGO_BIN_EXE_strata"))
                    .args(["cluster", "token", "--data"])
                    .arg(&datas[0])
                    .arg("--out")
                    .arg(&file)
                    .output()?;
                ensure!(
                    out.status.success(),
                    "cluster token: {}",
                    String::from_utf8_lossy(&out.stderr)
                );
                file
            };
            members.push(MemberProcess::spawn(
                &datas[i],
                &[
                    "join",
                    "--listen",
                    &addrs[i],
                    "--seed",
                    &join,
                    "--token",
                    &token.to_string_lossy(),
                    "--voter",
                ],
            )?);
            let want = i + 1;
            // A `join` that gave up after the learner was admitted is finished from here.
            tokio::time::sleep(Duration::from_secs(2)).await;
            if let Ok(Some(status)) = members[i].child.try_wait()
                && !status.success()
            {
                eprintln!("member {want}: `cluster join` exited ({status}); finishing its join");
                members[i].restart()?;
                finish_join(&client, &addrs[0], &datas[i], &addrs[i])
                    .await
                    .with_context(|| log_tails(&datas[..want]))?;
            }
            wait_view(&client, &addrs[..1], "the joiner becomes a voter", |v| {
                v.voters.len() == want && v.cluster.members().len() == want
            })
            .await
            .with_context(|| log_tails(&datas[..want]))?;
        }
        Ok(Self {
            _root: root,
            members,
            addrs,
            client,
            timing: config.timing,
        })
    }

    /// The leader's index in `members`, from a read it answered, and its applied index.
    async fn leader(&self) -> Result<(usize, u64)> {
        let view = wait_view(&self.client, &self.addrs, "a leader", |v| {
            v.leader.is_some()
        })
        .await?;
        let leader = view.leader.context("a leader")? as usize;
        ensure!(
            (1..=self.members.len()).contains(&leader),
            "unknown leader {leader}"
        );
        Ok((leader - 1, view.last_applied.map_or(0, |l| l.index)))
    }
}

/// Starts a group, starting over (fresh directories, fresh ports) when a join fails: the
/// joiner's own steps can race its first election, and that is not what is measured here.
async fn start_group(voters: usize) -> Result<Group> {
    const ATTEMPTS: usize = 3;
    let mut attempt = 1;
    loop {
        eprintln!("{voters} voters: starting the group (attempt {attempt})");
        match Group::start(voters).await {
            Ok(group) => return Ok(group),
            Err(e) if attempt < ATTEMPTS => eprintln!("{voters} voters: {e:#}"),
            Err(e) => return Err(e),
        }
        attempt += 1;
    }
}

/// One group size's figures.
struct Outcome {
    report: Value,
    sound: bool,
}

async fn run_group(voters: usize, kills: usize) -> Result<Outcome> {
    let mut group = start_group(voters).await?;
    let journal = Arc::new(Journal::new());
    let stop = Arc::new(AtomicBool::new(false));
    let mut tasks = Vec::new();
    for (i, addr) in group.addrs.iter().enumerate() {
        tasks.push(tokio::spawn(write_loop(
            group.client.clone(),
            vec![addr.clone()],
            format!("v{voters}-w{}", i + 1),
            journal.clone(),
            stop.clone(),
        )));
    }
    tasks.push(tokio::spawn(read_loop(
        group.client.clone(),
        group.addrs.clone(),
        journal.clone(),
        stop.clone(),
    )));

    let mut times = Vec::with_capacity(kills);
    for round in 0..kills {
        times.push(kill_round(&mut group, &journal, (voters, round, kills)).await?);
    }

    stop.store(true, Ordering::Relaxed);
    for task in tasks {
        task.await?;
    }
    // The final read: every name any writer tried, present or not.
    let invoked = journal.now();
    let view = wait_view(&group.client, &group.addrs, "a final read", |_| true).await?;
    let names = journal
        .invoked
        .lock()
        .unwrap_or_else(PoisonError::into_inner)
        .clone();
    record_reads(&journal, &view, names, invoked, journal.now());
    let tally = journal.tally();
    let history = journal.ops().clone();
    let timing = group.timing;
    drop(group);

    let lost = lost_writes(&history, &view);
    let verdict = check(&SetModel, &history, CHECK_BUDGET);
    let canary = canary_caught(&history);
    let linearizable = verdict == Verdict::Linearizable;
    if !lost.is_empty() {
        eprintln!(
            "{voters} voters: {} acknowledged writes lost, e.g. {:?}",
            lost.len(),
            &lost[..lost.len().min(5)]
        );
    }
    if !linearizable {
        eprintln!("{voters} voters: the history is not linearizable: {verdict:?}");
    }
    eprintln!(
        "{voters} voters: {} kills, {} acked, {} unknown, {} refused, {} reads, {} ops checked: \
         {verdict:?}; canary caught: {canary}",
        times.len(),
        tally.acked,
        tally.unknown,
        tally.refused,
        tally.reads,
        history.len()
    );
    times.sort();
    let ms = |d: Duration| (d.as_secs_f64() * 1e4).round() / 10.0;
    let report = json!({
        "voters": voters,
        "kills": times.len(),
        "time_to_first_write_ms": {
            "p50": ms(percentile(&times, 0.50)),
            "p99": ms(percentile(&times, 0.99)),
            "max": ms(times[times.len() - 1]),
            "min": ms(times[0]),
        },
        "writes_acked": tally.acked,
        "writes_unknown": tally.unknown,
        "writes_refused": tally.refused,
        "reads": tally.reads,
        "history_ops": history.len(),
        "acked_writes_lost": lost.len(),
        "linearizable": linearizable,
        "canary_caught": canary,
        "timing": timing_json(&timing),
    });
    Ok(Outcome {
        report,
        sound: linearizable && lost.is_empty() && canary,
    })
}

/// One round: a committing leader is SIGKILLed; returns the time from the kill to the first
/// write a new leader committed, once the killed member has restarted from disk and caught up.
async fn kill_round(
    group: &mut Group,
    journal: &Journal,
    (voters, round, kills): (usize, usize, usize),
) -> Result<Duration> {
    // A leader that commits: some write acknowledged after it was named.
    group.leader().await?;
    let (named, mark) = (journal.now(), journal.mark());
    let deadline = Instant::now() + SETUP_TIMEOUT;
    while journal.first_ack_since(named, mark).is_none() {
        ensure!(Instant::now() < deadline, "round {round}: no write commits");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let (leader, _) = group.leader().await?;

    let killed = journal.now();
    group.members[leader].kill();
    // Writes invoked once the process is gone can only be committed by a new leader.
    let (gone, mark) = (journal.now(), journal.mark());
    let deadline = Instant::now() + FAILOVER_TIMEOUT;
    let first = loop {
        if let Some(at) = journal.first_ack_since(gone, mark) {
            break at;
        }
        ensure!(
            Instant::now() < deadline,
            "round {round}: nothing committed within {FAILOVER_TIMEOUT:?} of the kill"
        );
        tokio::time::sleep(Duration::from_millis(2)).await;
    };
    let took = first - killed;

    // Back to full size: the killed member restarts from disk and catches up.
    group.members[leader].restart()?;
    let (_, applied) = group.leader().await?;
    wait_applied(&group.client, &group.addrs[leader], applied).await?;
    eprintln!(
        "{voters} voters, kill {}/{kills}: member {} killed, first commit after {:.1} ms",
        round + 1,
        leader + 1,
        took.as_secs_f64() * 1e3
    );
    Ok(took)
}

/// Nearest-rank percentile of sorted figures.
fn percentile(sorted: &[Duration], p: f64) -> Duration {
    let rank = ((sorted.len() as f64 - 1.0) * p).round() as usize;
    sorted[rank.min(sorted.len() - 1)]
}

fn timing_json(timing: &Timing) -> Value {
    json!({
        "raft_heartbeat_ms": timing.raft_heartbeat_ms,
        "election_timeout_min_ms": timing.election_timeout_min_ms,
        "election_timeout_max_ms": timing.election_timeout_max_ms,
        "client_call_timeout_ms": CALL_TIMEOUT.as_millis() as u64,
        "writer_pause_ms": WRITE_PAUSE.as_millis() as u64,
    })
}

fn kills_per_group() -> Result<usize> {
    match std::env::var("STRATA_FAILOVER_KILLS") {
        Ok(text) => {
            let kills: usize = text
                .parse()
                .with_context(|| format!("STRATA_FAILOVER_KILLS={text}: not a count"))?;
            ensure!(kills > 0, "STRATA_FAILOVER_KILLS must be at least 1");
            Ok(kills)
        }
        Err(_) => Ok(50),
    }
}

fn main() -> Result<()> {
    // `cargo bench` passes `--bench`; this bench takes no arguments of its own.
    let kills = kills_per_group()?;
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    let (groups, sound) = runtime.block_on(async {
        let mut groups = Vec::new();
        let mut sound = true;
        for voters in [3, 5] {
            let outcome = run_group(voters, kills).await?;
            sound &= outcome.sound;
            groups.push(outcome.report);
        }
        anyhow::Ok((groups, sound))
    })?;
    let timing = groups
        .first()
        .map(|g| g["timing"].clone())
        .unwrap_or_default();
    let report = json!({
        "kills_per_group": kills,
        "timing": timing,
        "measure": "time from SIGKILL of the leader process to the answer of the first write \
                    invoked after the process was reaped and acknowledged (committed) by a new \
                    leader; one writer per member, pinned to it, pausing 10 ms between calls",
        "groups": groups,
    });
    println!("{}", serde_json::to_string_pretty(&report)?);
    if !sound {
        bail!(
            "an acknowledged write was lost, the history is not linearizable, or the canary \
               was not caught: see stderr"
        );
    }
    Ok(())
}
