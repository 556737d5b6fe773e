//! `strata cluster` as real processes on 127.0.0.1: `init` and two `join --voter`, the
//! leader SIGKILLed and a new leader committing writes, then every member SIGKILLed and
//! restarted from disk with the same `cluster members --json`; a join through the CA holder
//! while another member leads and that leader is stopped mid-join; and an operator identity
//! issued by `cluster operator` reading and writing the group without a member's directory;
//! certificates of a few seconds renewed while members run, and members back after theirs
//! ended (the CA holder on its own, another through `cluster reissue`); and a follower paused
//! past its election timeout that does not depose the leader (pre-vote; the canary: members
//! started with `--pre-vote false` hold an election).

mod cluster;

use std::fs::File;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

use serde_json::Value;

const TIMEOUT: Duration = Duration::from_secs(60);

/// A running member, SIGKILLed when dropped; its log goes to `<data>.log`.
struct Member {
    child: Child,
    data: PathBuf,
}

impl Member {
    fn spawn(data: &Path, args: &[&str]) -> Self {
        let log = File::create(data.with_extension("log")).expect("log file");
        let child = Command::new(env!("CARGO_BIN_EXE_strata"))
            .arg("cluster")
            .args(args)
            .args(["--data", data.to_str().unwrap()])
            .env("RUST_LOG", "info")
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .expect("spawn strata");
        Self {
            child,
            data: data.to_path_buf(),
        }
    }

    fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }

    /// SIGSTOP (`true`) or SIGCONT (`false`): a member that hangs without dying.
    fn pause(&self, stop: bool) {
        let signal = if stop { libc::SIGSTOP } else { libc::SIGCONT };
        // SAFETY: signalling our own child, which has not been waited for.
        assert_eq!(
            unsafe { libc::kill(self.child.id() as libc::pid_t, signal) },
            0
        );
    }

    fn log(&self) -> String {
        std::fs::read_to_string(self.data.with_extension("log")).unwrap_or_default()
    }
}

impl Drop for Member {
    fn drop(&mut self) {
        self.kill();
    }
}

/// `strata cluster <args>`, with no `--data` added.
fn cli_bare(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_strata"))
        .arg("cluster")
        .args(args)
        .output()
        .expect("run strata")
}

fn cli(data: &Path, args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_strata"))
        .arg("cluster")
        .args(args)
        .args(["--data", data.to_str().unwrap()])
        .output()
        .expect("run strata")
}

/// `cluster <what> --json` through the member in `data`, once it answers.
fn view(data: &Path, what: &str) -> Option<Value> {
    let out = cli(data, &[what, "--json"]);
    if !out.status.success() {
        return None;
    }
    serde_json::from_slice(&out.stdout).ok()
}

/// Polls until `check` accepts the status read through one of `datas`; on timeout the
/// panic shows the members' logs.
fn wait_status(datas: &[&Path], what: &str, check: impl Fn(&Value) -> bool) -> Value {
    let deadline = Instant::now() + TIMEOUT;
    loop {
        for data in datas {
            if let Some(status) = view(data, "status")
                && check(&status)
            {
                return status;
            }
        }
        if Instant::now() >= deadline {
            let logs: Vec<String> = datas
                .iter()
                .map(|d| {
                    let log = std::fs::read_to_string(d.with_extension("log")).unwrap_or_default();
                    let tail: Vec<&str> = log.lines().rev().take(15).collect();
                    format!(
                        "== {}\n{}",
                        d.display(),
                        tail.into_iter().rev().collect::<Vec<_>>().join("\n")
                    )
                })
                .collect();
            panic!("never: {what}\n{}", logs.join("\n"));
        }
        std::thread::sleep(Duration::from_millis(200));
    }
}

/// The voters of a settled membership: none while a change runs on a joint configuration, whose
/// union of old and new voters would overstate who can elect a leader (with the old set {1, 2}
/// still in force, member 1 dying stops the group).
fn voters(status: &Value) -> Vec<u64> {
    if status["changing"] != false {
        return Vec::new();
    }
    status["voters"]
        .as_array()
        .map(|a| a.iter().filter_map(Value::as_u64).collect())
        .unwrap_or_default()
}

/// A fresh token file issued through the member in `data`.
fn issue_token(data: &Path, file: &Path) -> PathBuf {
    let out = cli(data, &["token", "--out", file.to_str().unwrap()]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    file.to_path_buf()
}

/// `cluster join` of a new member in `data` on `listen`, through the join endpoint `seed` with
/// the token in the file `token`; `--voter` when `voter`.
fn spawn_join(data: &Path, listen: &str, seed: &str, token: &Path, voter: bool) -> Member {
    let token = token.to_str().unwrap();
    let mut args = vec!["join", "--listen", listen, "--seed", seed, "--token", token];
    if voter {
        args.push("--voter");
    }
    Member::spawn(data, &args)
}

/// `n` members' data directories under `root`, their member addresses and a join address.
fn places(root: &Path, n: usize) -> (Vec<PathBuf>, Vec<String>, String) {
    let datas = (1..=n).map(|i| root.join(format!("m{i}"))).collect();
    let listens = (0..n)
        .map(|_| format!("127.0.0.1:{}", cluster::free_ports(1)))
        .collect();
    (
        datas,
        listens,
        format!("127.0.0.1:{}", cluster::free_ports(1)),
    )
}

/// `init` in `datas[0]` (the CA holder, join endpoint `join`), then `join --voter` of the rest
/// through it, each waited for.
fn start_group(root: &Path, datas: &[PathBuf], listens: &[String], join: &str) -> Vec<Member> {
    start_group_with(root, datas, listens, join, &[])
}

/// [`start_group`] with more arguments for `init`.
fn start_group_with(
    root: &Path,
    datas: &[PathBuf],
    listens: &[String],
    join: &str,
    init: &[&str],
) -> Vec<Member> {
    start_group_all(root, (datas, listens, join), init, &[])
}

/// [`start_group`] with more arguments for `init` and for every `join`.
fn start_group_all(
    root: &Path,
    (datas, listens, join): (&[PathBuf], &[String], &str),
    init: &[&str],
    joins: &[&str],
) -> Vec<Member> {
    let mut args = vec!["init", "--listen", &listens[0], "--join-listen", join];
    args.extend_from_slice(init);
    let mut members = vec![Member::spawn(&datas[0], &args)];
    wait_status(&[&datas[0]], "member 1 leads", |s| s["leader"] == 1);
    for i in 1..datas.len() {
        // Each join spends a token: `init` wrote the first, `cluster token` issues the next.
        let token = if i == 1 {
            datas[0].join("join-token")
        } else {
            issue_token(&datas[0], &root.join(format!("token-{i}")))
        };
        let token = token.to_str().unwrap();
        let mut args = vec![
            "join",
            "--listen",
            &listens[i],
            "--seed",
            join,
            "--token",
            token,
        ];
        args.push("--voter");
        args.extend_from_slice(joins);
        members.push(Member::spawn(&datas[i], &args));
        let want = i + 1;
        // Read through every member started so far, so that a timeout shows the joiner's log too.
        let started: Vec<&Path> = datas[..=i].iter().map(PathBuf::as_path).collect();
        wait_status(&started, "the joiner becomes a voter", |s| {
            voters(s).len() == want && s["members"] == want
        });
    }
    members
}

#[test]
fn three_processes_survive_a_leader_kill_and_a_full_restart() {
    let root = tempfile::tempdir().unwrap();
    let (datas, listens, join) = places(root.path(), 3);
    let mut members = start_group(root.path(), &datas, &listens, &join);
    let paths: Vec<&Path> = datas.iter().map(PathBuf::as_path).collect();
    let before = view(&datas[0], "members").expect("members");
    assert_eq!(before["members"].as_array().unwrap().len(), 3);
    // Each joiner's recorded role follows raft's: voter, recorded after the promotion (the
    // joiner commits it once `AddVoters` has returned, so it may trail the status by a moment).
    let deadline = Instant::now() + TIMEOUT;
    let recorded_voters = |v: &Value| {
        v["members"]
            .as_array()
            .unwrap()
            .iter()
            .all(|m| m["recorded_role"] == "voter" && m["raft"] == "voter")
    };
    let before = loop {
        let members = view(&datas[0], "members").expect("members");
        if recorded_voters(&members) {
            break members;
        }
        assert!(Instant::now() < deadline, "roles never recorded: {members}");
        std::thread::sleep(Duration::from_millis(200));
    };

    // SIGKILL the leader: the other two elect a new leader that commits (lease renewals are
    // writes through the leader).
    let status = wait_status(&paths, "a leader", |s| s["leader"].is_u64());
    let old = status["leader"].as_u64().unwrap() as usize;
    let applied = status["last_applied"].as_u64().unwrap();
    let killed_at = Instant::now();
    members[old - 1].kill();
    let survivors: Vec<&Path> = paths
        .iter()
        .enumerate()
        .filter(|(i, _)| *i != old - 1)
        .map(|(_, p)| *p)
        .collect();
    let after = wait_status(&survivors, "a new leader commits", |s| {
        s["leader"].as_u64().is_some_and(|l| l as usize != old)
            && s["last_applied"].as_u64().is_some_and(|a| a > applied + 2)
    });
    eprintln!(
        "new leader {} committing {:?} after the kill",
        after["leader"],
        killed_at.elapsed()
    );

    // Kill everyone, restart every member from its data directory: the same members.
    for member in &mut members {
        member.kill();
    }
    let restarted: Vec<Member> = datas.iter().map(|d| Member::spawn(d, &["serve"])).collect();
    wait_status(&paths, "a leader after the restart", |s| {
        s["leader"].is_u64() && voters(s).len() == 3
    });
    let again = view(&datas[0], "members").expect("members after the restart");
    assert_eq!(
        again,
        before,
        "members changed across the restart; logs:\n{}",
        restarted
            .iter()
            .map(Member::log)
            .collect::<Vec<_>>()
            .join("\n")
    );
}

/// The CA holder (member 1) is a follower: the leader died and came back as member 1 restarted.
/// A new member joins through member 1 while the leader is SIGSTOPped, so the first answer is
/// lost to the election; the joiner asks again with the same token and key and is admitted as
/// the one id the token spent, with no orphan learner left beside it.
#[test]
fn a_join_through_a_follower_ca_holder_survives_a_stalled_leader() {
    let root = tempfile::tempdir().unwrap();
    let (datas, listens, join) = places(root.path(), 4);
    let mut members = start_group(root.path(), &datas[..3], &listens[..3], &join);
    let paths: Vec<&Path> = datas[..3].iter().map(PathBuf::as_path).collect();

    // Member 1 (CA, leader) dies; another leads; member 1 comes back as a follower.
    members[0].kill();
    wait_status(&paths[1..], "a new leader", |s| {
        s["leader"].as_u64().is_some_and(|l| l != 1)
    });
    members[0] = Member::spawn(&datas[0], &["serve"]);
    let status = wait_status(&paths[..1], "member 1 follows", |s| {
        s["leader"].as_u64().is_some_and(|l| l != 1) && voters(s).len() == 3
    });
    let leader = status["leader"].as_u64().unwrap() as usize;
    let token = issue_token(&datas[0], &root.path().join("token-4"));

    // The leader hangs while the join is under way, then resumes.
    members[leader - 1].pause(true);
    let started = Instant::now();
    members.push(spawn_join(&datas[3], &listens[3], &join, &token, false));
    std::thread::sleep(Duration::from_secs(4));
    members[leader - 1].pause(false);
    let joined = wait_status(&paths, "the joiner is a recorded learner", |s| {
        s["members"] == 4 && s["learners"].as_array().is_some_and(|l| l.len() == 1)
    });
    eprintln!("joined after {:?}: {joined}", started.elapsed());
    assert_eq!(voters(&joined).len(), 3, "{joined}");
    let learner = &joined["learners"][0];
    assert_eq!(learner, 4, "the one id the token spent: {joined}");
    assert!(
        members[3].child.try_wait().unwrap().is_none(),
        "the joiner exited:\n{}",
        members[3].log()
    );
    // The token is spent for this joiner's key only: another directory presenting it is refused
    // at once, and nothing is added.
    let other = root.path().join("m5");
    let refused = Command::new(env!("CARGO_BIN_EXE_strata"))
        .args([
            "cluster",
            "join",
            "--listen",
            &format!("127.0.0.1:{}", cluster::free_ports(1)),
        ])
        .args(["--seed", &join, "--token", token.to_str().unwrap()])
        .args(["--data", other.to_str().unwrap()])
        .output()
        .expect("run strata");
    assert!(!refused.status.success());
    let stderr = String::from_utf8_lossy(&refused.stderr);
    assert!(stderr.contains("join refused"), "{stderr}");
    let after = view(&datas[0], "status").expect("status");
    assert_eq!(after["learners"], joined["learners"], "{after}");
}

/// A member whose store is corrupt, then missing (moved aside), exits non-zero each time with a
/// recovery procedure, rather than staying up without raft; the procedure it prints (leave, a
/// new token, join with a new directory) brings the group back to three voters that commit.
#[test]
fn a_member_that_lost_its_store_exits_and_the_printed_procedure_recovers_the_group() {
    let root = tempfile::tempdir().unwrap();
    let (datas, listens, join) = places(root.path(), 3);
    let mut members = start_group(root.path(), &datas, &listens, &join);
    members[2].kill();
    let store = datas[2].join("topology.redb");
    let mut bytes = std::fs::read(&store).unwrap();
    let middle = bytes.len() / 2;
    for b in &mut bytes[middle..] {
        *b ^= 0x5a;
    }
    std::fs::write(&store, bytes).unwrap();

    // Restarted on the damaged store, then with it moved aside: it exits (within 20 s, not
    // staying up without raft), naming the procedure.
    let restart = |what: &str| {
        let mut member = Member::spawn(&datas[2], &["serve"]);
        let deadline = Instant::now() + Duration::from_secs(20);
        let status = loop {
            if let Some(status) = member.child.try_wait().unwrap() {
                break Some(status);
            }
            if Instant::now() >= deadline {
                break None;
            }
            std::thread::sleep(Duration::from_millis(100));
        };
        let stderr = member.log();
        assert!(
            status.is_some_and(|s| !s.success()),
            "{what}: it kept running or succeeded\n{stderr}"
        );
        assert!(
            stderr.contains("cluster leave --member 3") && stderr.contains("cluster join"),
            "{what}: {stderr}"
        );
        stderr
    };
    let corrupt = restart("corrupt store");
    assert!(corrupt.contains("corrupt"), "{corrupt}");
    std::fs::rename(&store, datas[2].join("topology.redb.damaged")).unwrap();
    let missing = restart("store moved aside");
    assert!(missing.contains("missing"), "{missing}");
    assert!(
        !store.exists(),
        "a refused start must not create an empty store"
    );

    // The procedure: remove member 3 through another member, a new token, a join as new.
    let leave = cli(&datas[0], &["leave", "--member", "3"]);
    assert!(
        leave.status.success(),
        "{}",
        String::from_utf8_lossy(&leave.stderr)
    );
    // Member 3's certificate is revoked with its leave: it can no longer read the group.
    let stale = cli(&datas[2], &["status", "--addr", &listens[0]]);
    assert!(!stale.status.success());
    let stale = String::from_utf8_lossy(&stale.stderr);
    assert!(stale.contains("member 3 has been revoked"), "{stale}");
    let token = issue_token(&datas[0], &root.path().join("token-new"));
    let fresh = root.path().join("m3-new");
    // A joiner that cannot listen (its address taken) fails before asking: nothing is added
    // and its token is not spent.
    let taken = std::net::UdpSocket::bind("127.0.0.1:0").unwrap();
    let taken_addr = taken.local_addr().unwrap().to_string();
    let blocked = cli_bare(&[
        "join",
        "--listen",
        &taken_addr,
        "--seed",
        &join,
        "--token",
        token.to_str().unwrap(),
        "--data",
        root.path().join("m-blocked").to_str().unwrap(),
    ]);
    assert!(!blocked.status.success());
    let stderr = String::from_utf8_lossy(&blocked.stderr);
    assert!(stderr.contains("cannot listen"), "{stderr}");
    drop(taken);
    // Port 0: the joiner takes a port the system picks and is recorded at it.
    members.push(spawn_join(&fresh, "127.0.0.1:0", &join, &token, true));
    let paths = [datas[0].as_path(), datas[1].as_path(), fresh.as_path()];
    let before = wait_status(&paths[..1], "three voters again, member 3 gone", |s| {
        let v = voters(s);
        v.len() == 3 && !v.contains(&3) && s["members"] == 3
    });
    let recorded = view(&datas[0], "members").expect("members");
    let new_id = voters(&before).into_iter().max().unwrap();
    let addr = recorded["members"]
        .as_array()
        .unwrap()
        .iter()
        .find(|m| m["id"] == new_id)
        .and_then(|m| m["raft_addr"].as_str())
        .unwrap_or_else(|| panic!("member {new_id} recorded: {recorded}"));
    let port = addr.rsplit_once(':').unwrap().1.parse::<u16>().unwrap();
    assert_ne!(port, 0, "{recorded}");
    let applied = before["last_applied"].as_u64().unwrap();
    wait_status(&paths, "the recovered group commits", |s| {
        s["last_applied"].as_u64().is_some_and(|a| a > applied + 2)
    });
}

/// A member listening on every interface without --advertise is refused before anything is
/// created: the group would record an address nobody can dial.
#[test]
fn a_member_on_every_interface_must_advertise() {
    let root = tempfile::tempdir().unwrap();
    for verb in [
        &["init"][..],
        &["join", "--seed", "127.0.0.1:1", "--token", "t"][..],
    ] {
        let data = root.path().join(verb[0]);
        let out = cli(&data, &[verb, &["--listen", "0.0.0.0:0"]].concat());
        assert!(!out.status.success(), "{verb:?}");
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(stderr.contains("--advertise"), "{verb:?}: {stderr}");
        assert!(
            !data.join("member.toml").exists(),
            "{verb:?} wrote a member"
        );
    }
}

#[test]
fn an_operator_identity_reads_and_writes_without_a_member_directory() {
    let root = tempfile::tempdir().unwrap();
    let data = root.path().join("m1");
    let listen = format!("127.0.0.1:{}", cluster::free_ports(1));
    let join = format!("127.0.0.1:{}", cluster::free_ports(1));
    let _member = Member::spawn(
        &data,
        &["init", "--listen", &listen, "--join-listen", &join],
    );
    wait_status(&[&data], "member 1 leads", |s| s["leader"] == 1);

    let ops = root.path().join("alice");
    let ops = ops.to_str().unwrap();
    let issued = cli(&data, &["operator", "--name", "alice", "--out", ops]);
    let stderr = |out: &Output| String::from_utf8_lossy(&out.stderr).into_owned();
    assert!(issued.status.success(), "{}", stderr(&issued));
    assert!(Path::new(ops).join("operator.pem").exists());
    assert!(!Path::new(ops).join("member.pem").exists());

    // A bad name, and a directory without the CA key, are refused and write nothing.
    let bad_out = root.path().join("bad");
    let bad = cli(
        &data,
        &[
            "operator",
            "--name",
            "Alice!",
            "--out",
            bad_out.to_str().unwrap(),
        ],
    );
    assert!(!bad.status.success());
    assert!(
        stderr(&bad).contains("bad operator name"),
        "{}",
        stderr(&bad)
    );
    let no_ca = cli(
        &root.path().join("nowhere"),
        &[
            "operator",
            "--name",
            "bob",
            "--out",
            bad_out.to_str().unwrap(),
        ],
    );
    assert!(!no_ca.status.success());
    assert!(
        stderr(&no_ca).contains("holds no cluster CA key"),
        "{}",
        stderr(&no_ca)
    );
    assert!(!bad_out.exists());

    // The operator reads the group and issues a join token as itself.
    let status = cli_bare(&["status", "--identity", ops, "--addr", &listen, "--json"]);
    assert!(status.status.success(), "{}", stderr(&status));
    let status: Value = serde_json::from_slice(&status.stdout).expect("status JSON");
    assert_eq!(status["leader"], 1);
    let token = cli_bare(&["token", "--identity", ops, "--addr", &listen]);
    assert!(token.status.success(), "{}", stderr(&token));
    // --identity without --addr has no member to ask.
    let no_addr = cli_bare(&["status", "--identity", ops]);
    assert!(!no_addr.status.success());

    // `cluster status | head`: a reader that went away ends the command quietly (SIGPIPE, as
    // Unix tools end), never a panic. The pipe's read end is closed before the first line.
    let mut piped = Command::new(env!("CARGO_BIN_EXE_strata"))
        .args(["cluster", "status", "--identity", ops, "--addr", &listen])
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("run strata");
    drop(piped.stdout.take());
    let closed = piped.wait_with_output().expect("wait for strata");
    assert!(!stderr(&closed).contains("panicked"), "{}", stderr(&closed));
    {
        use std::os::unix::process::ExitStatusExt;
        assert!(
            closed.status.success() || closed.status.signal() == Some(libc::SIGPIPE),
            "{:?}: {}",
            closed.status,
            stderr(&closed)
        );
    }

    // Leaving a member the group does not have changes nothing and says so (it used to print
    // success).
    let unknown = cli_bare(&[
        "leave",
        "--identity",
        ops,
        "--addr",
        &listen,
        "--member",
        "99",
    ]);
    assert!(!unknown.status.success());
    assert!(
        stderr(&unknown).contains("member 99 is not in the group"),
        "{}",
        stderr(&unknown)
    );

    // Placement through the operator: a member without GPUs hosts no group, and the group
    // says why; removing a placement that does not exist is refused by name.
    let place = cli_bare(&[
        "place",
        "--identity",
        ops,
        "--addr",
        &listen,
        "--model",
        "m",
        "--tp",
        "1",
    ]);
    assert!(!place.status.success());
    assert!(
        stderr(&place).contains("the group refused"),
        "{}",
        stderr(&place)
    );
    let unplace = cli_bare(&[
        "unplace",
        "--identity",
        ops,
        "--addr",
        &listen,
        "--model",
        "m",
    ]);
    assert!(!unplace.status.success());
    assert!(stderr(&unplace).contains("`m`"), "{}", stderr(&unplace));
    let placement = cli_bare(&["placement", "--identity", ops, "--addr", &listen, "--json"]);
    assert_eq!(String::from_utf8_lossy(&placement.stdout).trim(), "{}");

    // Revoked by name through the member: alice's certificate no longer reads or writes, while
    // the member's own identity still does (the canary arm).
    let revoke = cli(&data, &["revoke", "--operator", "alice"]);
    assert!(revoke.status.success(), "{}", stderr(&revoke));
    let refused = cli_bare(&["status", "--identity", ops, "--addr", &listen]);
    assert!(!refused.status.success());
    assert!(
        stderr(&refused).contains("operator alice has been revoked"),
        "{}",
        stderr(&refused)
    );
    let token = root.path().join("token-after-revoke");
    let mint = cli_bare(&[
        "token",
        "--identity",
        ops,
        "--addr",
        &listen,
        "--out",
        token.to_str().unwrap(),
    ]);
    assert!(!mint.status.success(), "a revoked operator minted a token");
    assert!(
        view(&data, "status").is_some(),
        "the member's identity was refused"
    );
}

/// The member certificate in `data` as it is now.
fn member_pem(data: &Path) -> Vec<u8> {
    std::fs::read(data.join("tls").join("member.pem")).expect("member.pem")
}

/// Polls `check` for up to `within`; panics naming `what`.
fn wait_until(within: Duration, what: &str, check: impl Fn() -> bool) {
    let deadline = Instant::now() + within;
    while !check() {
        assert!(Instant::now() < deadline, "never: {what}");
        std::thread::sleep(Duration::from_millis(200));
    }
}

fn health_of(status: &Value, id: u64) -> Option<&str> {
    status["health"][id.to_string()].as_str()
}

#[test]
fn certificates_renew_while_members_run_and_after_they_were_down() {
    // Certificates of 12 s: renewed at about 8 s, ended 12 s after issue.
    const LIFETIME: Duration = Duration::from_secs(12);
    let root = tempfile::tempdir().unwrap();
    let (datas, listens, join) = places(root.path(), 3);
    let mut members = start_group_with(
        root.path(),
        &datas,
        &listens,
        &join,
        &["--cert-lifetime", "12s"],
    );
    let paths: Vec<&Path> = datas.iter().map(PathBuf::as_path).collect();
    let first: Vec<Vec<u8>> = datas.iter().map(|d| member_pem(d)).collect();
    let started = Instant::now();

    // Member 3 stops, and its certificate ends while it is down; 1 and 2 renew theirs.
    members[2].kill();
    let stopped = Instant::now();
    wait_until(
        LIFETIME * 2,
        "members 1 and 2 renew their certificates",
        || member_pem(&datas[0]) != first[0] && member_pem(&datas[1]) != first[1],
    );
    std::thread::sleep((LIFETIME + Duration::from_secs(2)).saturating_sub(stopped.elapsed()));
    // Past the first certificates' end the group commits (a token is a write).
    issue_token(&datas[0], &root.path().join("token-after"));
    wait_status(&paths[..2], "member 3 is seen down", |s| {
        health_of(s, 3).is_some_and(|h| h != "alive")
    });

    // Member 3 comes back with a certificate issued again on the CA holder.
    reissue(&datas[0], 3, &datas[2]);
    members[2] = Member::spawn(&datas[2], &["serve"]);
    wait_status(&paths[..2], "member 3 heartbeats again", |s| {
        health_of(s, 3) == Some("alive")
    });
    eprintln!("member 3 back after a reissue: {:?}", started.elapsed());

    // The CA holder stops for longer than the certificates live: the others' end too, since
    // nobody could renew them. Started again, it renews its own; the others, still running,
    // take up certificates issued again and copied into their directories.
    members[0].kill();
    let held = member_pem(&datas[0]);
    std::thread::sleep(LIFETIME + Duration::from_secs(2));
    members[0] = Member::spawn(&datas[0], &["serve"]);
    wait_until(
        TIMEOUT,
        "member 1 renews its own certificate at start",
        || member_pem(&datas[0]) != held,
    );
    eprintln!("member 1 renewed its own at start: {:?}", started.elapsed());
    for id in [2, 3] {
        reissue(&datas[0], id, &datas[id as usize - 1]);
    }
    wait_status(&paths, "the three members heartbeat again", |s| {
        [1, 2, 3]
            .iter()
            .all(|&id| health_of(s, id) == Some("alive"))
            && voters(s).len() == 3
    });
    eprintln!("the group is whole again: {:?}", started.elapsed());
    issue_token(&datas[0], &root.path().join("token-last"));
    assert!(
        members
            .iter_mut()
            .all(|m| m.child.try_wait().unwrap().is_none()),
        "a member exited"
    );
}

/// `cluster reissue` of member `id` on the CA holder in `ca_data`, copied into `data`'s TLS
/// directory.
fn reissue(ca_data: &Path, id: u64, data: &Path) {
    let out_dir = ca_data.with_file_name(format!("reissued-{id}-{}", cluster::free_ports(1)));
    let out = cli(
        ca_data,
        &[
            "reissue",
            "--member",
            &id.to_string(),
            "--out",
            out_dir.to_str().unwrap(),
        ],
    );
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    // The key first: a member reading in between sees a mismatch and reads again.
    for file in ["member.key", "member.pem"] {
        let staged = data.join("tls").join(format!("{file}.new"));
        std::fs::copy(out_dir.join(file), &staged).unwrap();
        std::fs::rename(&staged, data.join("tls").join(file)).unwrap();
    }
}

/// A follower of a three-member group (started with `flags` on every member) stopped for four
/// seconds — far past its election timeout — then resumed: the group's leader and term before
/// and after.
fn pause_a_follower(flags: &[&str]) -> (Value, Value) {
    let root = tempfile::tempdir().unwrap();
    let (datas, listens, join) = places(root.path(), 3);
    let members = start_group_all(root.path(), (&datas, &listens, &join), flags, flags);
    let paths: Vec<&Path> = datas.iter().map(PathBuf::as_path).collect();
    let before = wait_status(&paths, "a leader with three voters", |s| {
        s["leader"].as_u64().is_some() && voters(s).len() == 3 && s["term"].as_u64().is_some()
    });
    let leader = before["leader"].as_u64().unwrap();
    let follower = (1..=3).find(|&id| id != leader).unwrap();
    members[follower as usize - 1].pause(true);
    std::thread::sleep(Duration::from_secs(4));
    members[follower as usize - 1].pause(false);
    std::thread::sleep(Duration::from_secs(4));
    let after = wait_status(&paths, "the group answers again", |s| {
        s["leader"].as_u64().is_some()
    });
    // The group still commits.
    let leader_now = after["leader"].as_u64().unwrap();
    issue_token(
        &datas[leader_now as usize - 1],
        &root.path().join("token-after"),
    );
    (before, after)
}

#[test]
fn a_paused_follower_does_not_depose_the_leader() {
    let (before, after) = pause_a_follower(&[]);
    assert_eq!(
        (after["leader"].as_u64(), after["term"].as_u64()),
        (before["leader"].as_u64(), before["term"].as_u64()),
        "the paused follower forced an election: before {before}, after {after}"
    );
}

/// The canary of the test above: members without pre-vote (`--pre-vote false`) let the resumed
/// follower stand at once, and the group's term rises.
#[test]
fn canary_without_pre_vote_a_paused_follower_forces_an_election() {
    let (before, after) = pause_a_follower(&["--pre-vote", "false"]);
    assert!(
        after["term"].as_u64() > before["term"].as_u64(),
        "no election without pre-vote: before {before}, after {after}"
    );
}

/// `cluster leave` of the current leader finishes the job: the leader leaves raft's voters, the
/// command follows the group to its new leader (it waits out the election rather than failing
/// with "the leader is None"), removes the record and revokes the certificate, and exits 0;
/// leaving again finds nothing to do.
#[test]
fn leaving_the_leader_follows_the_new_leader_and_finishes() {
    let root = tempfile::tempdir().unwrap();
    let (datas, listens, join) = places(root.path(), 3);
    let _members = start_group(root.path(), &datas, &listens, &join);
    let status = wait_status(&[&datas[1]], "a leader", |s| s["leader"].is_u64());
    let leader = status["leader"].as_u64().unwrap();
    let asker = &datas[(leader as usize) % 3]; // another member's data
    let id = leader.to_string();
    let leave = cli(asker, &["leave", "--member", &id]);
    assert!(
        leave.status.success(),
        "{}",
        String::from_utf8_lossy(&leave.stderr)
    );
    wait_status(
        &[asker],
        "two voters, a new leader, one record fewer",
        |s| {
            let v = voters(s);
            v.len() == 2
                && !v.contains(&leader)
                && s["leader"].as_u64().is_some_and(|l| l != leader)
                && s["members"] == 2
        },
    );
    let again = cli(asker, &["leave", "--member", &id]);
    assert!(again.status.success());
    let said = String::from_utf8_lossy(&again.stdout);
    assert!(said.contains("already left"), "{said}");
}
