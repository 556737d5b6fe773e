//! Members' lifecycle: `init` makes a group and its CA, `join` admits a member with a token
//! (retried until answered), `serve` runs one from its data directory (refusing a store it has
//! lost, with the recovery procedure), `leave` removes and revokes one, `revoke` withdraws an
//! operator.

use super::*;

/// Serves `server` until SIGTERM or ctrl-c; exits with an error if its raft core stops first
/// (a member that cannot take part must not stay up answering as if it could).
async fn serve_until_signal(server: Server) -> Result<()> {
    let mut metrics = server.raft.metrics();
    let stopped = async move {
        loop {
            if let Err(e) = &metrics.borrow().running_state {
                return e.to_string();
            }
            if metrics.changed().await.is_err() {
                return "its metrics channel closed".to_string();
            }
        }
    };
    tokio::select! {
        _ = shutdown_signal() => {
            tracing::info!(member = server.id, "stopping on signal");
            server.shutdown().await;
            Ok(())
        }
        why = stopped => {
            let id = server.id;
            server.shutdown().await;
            bail!("member {id}: the raft core stopped ({why}); exiting")
        }
    }
}

/// How a member that lost its raft state rejoins: as a new member. Keeping its id is unsafe: a
/// member that forgot its vote could vote twice in one term.
fn recovery_procedure(id: NodeId, data: &Path) -> String {
    format!(
        "member {id} cannot rejoin as itself without its raft state (it could vote twice in one \
         term). To recover: (1) on another member, `strata cluster leave --member {id} --data \
         <its data>`; (2) move {} aside; (3) on the member holding the CA key, `strata cluster \
         token --out TOKEN`; (4) `strata cluster join --seed <its join address> --token TOKEN \
         --data <a new directory> [--voter]`: it joins with a new id and catches up from the \
         group (docs/ARCHITECTURE.md, \"Recovering a member\")",
        data.display()
    )
}

pub(super) async fn serve(data: &Path) -> Result<()> {
    let config = load_config(data)?;
    let layout = DataLayout::new(data);
    let id = MemberIdentity::load(&layout.tls_dir())
        .map(|identity| identity.id)
        .with_context(|| format!("{}: the member's identity", layout.tls_dir().display()));
    if !layout.store().exists() {
        let id = id?;
        bail!(
            "{}: this member's topology store is missing. {}",
            layout.store().display(),
            recovery_procedure(id, data)
        );
    }
    let server = match Server::start(&config).await {
        Ok(server) => server,
        Err(e @ ServerError::Store(StoreError::Corrupt { .. })) => {
            return Err(match id {
                Ok(id) => anyhow::anyhow!("{e}. {}", recovery_procedure(id, data)),
                Err(_) => e.into(),
            });
        }
        Err(e) => return Err(e.into()),
    };
    serve_until_signal(server).await
}

/// A member listening on every interface must say where the others reach it: its address is
/// recorded in the group, and 0.0.0.0 dials nowhere (or, on Linux, the dialler itself).
fn check_dialable(listen: SocketAddr, advertise: Option<&String>) -> Result<()> {
    anyhow::ensure!(
        !listen.ip().is_unspecified() || advertise.is_some(),
        "--listen {listen} listens on every interface: give --advertise HOST:PORT, the address \
         the other members dial"
    );
    Ok(())
}

pub(super) async fn init(args: InitArgs) -> Result<()> {
    let layout = DataLayout::new(&args.data);
    if layout.config().exists() {
        tracing::info!(data = %args.data.display(), "a member lives here already; resuming it");
        return serve(&args.data).await;
    }
    check_dialable(args.listen, args.advertise.as_ref())?;
    let join_listen = args.join_listen.unwrap_or_else(|| {
        let mut addr = args.listen;
        if addr.port() != 0 {
            addr.set_port(addr.port().wrapping_add(1));
        }
        addr
    });
    let lifetime = std::time::Duration::from_secs(args.cert_lifetime);
    let ca = ClusterCa::create(&layout.ca_dir())
        .and_then(|ca| ca.with_lifetime(lifetime))
        .context("create the cluster CA")?;
    ca.issue_member(1, &layout.tls_dir())
        .context("issue member 1's certificate")?;
    let token = JoinToken::generate(&ca.fingerprint()?)?;
    write_secret(&layout.join_token(), &token.encode())?;
    let config = ServerConfig {
        data_dir: args.data.clone(),
        listen: args.listen,
        advertise: args.advertise,
        join_listen: Some(join_listen),
        cert_lifetime_s: Some(args.cert_lifetime),
        timing: args.election.timing(),
    };
    config.save(&layout.config()).map_err(anyhow::Error::msg)?;
    let server = Server::start(&config).await?;
    let mut spec = member_spec(1, &server.addr);
    spec.role = RaftRole::Voter;
    server.bootstrap(spec, Some(token.secret_sha256())).await?;
    tracing::info!(
        member = 1,
        addr = %server.addr,
        join = ?server.join_addr(),
        token = %layout.join_token().display(),
        "cluster initialized"
    );
    serve_until_signal(server).await
}

/// Writes a file only its owner can read.
pub(super) fn write_secret(path: &Path, contents: &str) -> Result<()> {
    use std::io::Write;
    let mut options = std::fs::OpenOptions::new();
    options.write(true).create_new(true);
    #[cfg(unix)]
    std::os::unix::fs::OpenOptionsExt::mode(&mut options, 0o600);
    let mut file = options
        .open(path)
        .with_context(|| format!("create {}", path.display()))?;
    writeln!(file, "{contents}").with_context(|| format!("write {}", path.display()))
}

fn read_token(token: &str) -> Result<JoinToken> {
    let path = Path::new(token);
    let text = if path.exists() {
        std::fs::read_to_string(path).with_context(|| format!("read {}", path.display()))?
    } else {
        token.to_string()
    };
    Ok(JoinToken::parse(&text)?)
}

pub(super) async fn join(args: JoinArgs) -> Result<()> {
    let layout = DataLayout::new(&args.data);
    if layout.config().exists() {
        tracing::info!(data = %args.data.display(), "a member lives here already; resuming it");
        return serve(&args.data).await;
    }
    check_dialable(args.listen, args.advertise.as_ref())?;
    let token = read_token(&args.token)?;
    // The member address is held from before the group is asked: a joiner that cannot listen
    // fails here, before it is admitted as a member the others can never reach. Port 0 takes
    // one the system picks, recorded as the member's address.
    let socket = std::net::UdpSocket::bind(args.listen)
        .with_context(|| format!("cannot listen on {}", args.listen))?;
    let listen = socket.local_addr().context("the bound member address")?;
    let config = ServerConfig {
        data_dir: args.data.clone(),
        listen,
        advertise: args.advertise,
        join_listen: None,
        cert_lifetime_s: None,
        timing: args.election.timing(),
    };
    std::fs::create_dir_all(&args.data)
        .with_context(|| format!("create {}", args.data.display()))?;
    let identity = join_with_retries(&args.seed, &token, &config.advertised(), &layout).await?;
    config.save(&layout.config()).map_err(anyhow::Error::msg)?;
    let server = Server::start_on(&config, Some(socket)).await?;
    // Recorded as what it is now, a learner; the voter role only once raft has promoted it.
    let spec = member_spec(identity.id, &server.addr);
    server
        .raft
        .wait(Some(CATCH_UP_TIMEOUT))
        .metrics(
            |m| m.current_leader.is_some(),
            "the leader reaches this learner",
        )
        .await
        .context("hear from the leader")?;
    commit_joining(&server, Change::AddMember(spec)).await?;
    if args.voter {
        promote(&server).await?;
        let role = Change::SetRole {
            id: identity.id,
            role: RaftRole::Voter,
        };
        commit_joining(&server, role).await?;
    }
    tracing::info!(member = identity.id, addr = %server.addr, voter = args.voter, "joined");
    serve_until_signal(server).await
}

/// Asks the seed for membership until it answers, for up to [`CATCH_UP_TIMEOUT`]: a timeout, a
/// lost answer or a leader change is asked again (the key kept from the first attempt makes the
/// retry the same joiner, admitted as the same id); a refusal of the token itself is final.
async fn join_with_retries(
    seed: &str,
    token: &JoinToken,
    advertised: &str,
    layout: &DataLayout,
) -> Result<MemberIdentity> {
    let deadline = std::time::Instant::now() + CATCH_UP_TIMEOUT;
    let mut pause = std::time::Duration::from_millis(200);
    loop {
        match request_membership(seed, token, advertised, &layout.tls_dir(), CALL_TIMEOUT).await {
            Ok(identity) => return Ok(identity),
            Err(e) if join_retriable(&e) && std::time::Instant::now() < deadline => {
                tracing::warn!(error = %e, retry_in = ?pause, "join not answered; asking again");
                tokio::time::sleep(pause).await;
                pause = (pause * 2).min(std::time::Duration::from_secs(5));
            }
            Err(e) => return Err(anyhow::Error::new(e).context("join through the seed")),
        }
    }
}

/// Whether a failed join may succeed when asked again.
fn join_retriable(e: &JoinError) -> bool {
    match e {
        JoinError::Client(ClientError::Refused { refusal, .. }) => matches!(
            refusal,
            Refusal::NotLeader { .. } | Refusal::Failed(_) | Refusal::ReadTimeout { .. }
        ),
        JoinError::Client(ClientError::WrongMember { .. }) => false,
        JoinError::Client(_) | JoinError::Endpoint(_) => true,
        _ => false,
    }
}

/// Commits `change` through the leader this new member knows of. Right after admission a
/// learner may not yet know where the leader is, and the leader may die or lose its term
/// mid-call (the answer lost): any refusal that is not the state machine's is retried until
/// [`CATCH_UP_TIMEOUT`]. A retried `AddMember` that finds itself already recorded committed the
/// first time.
async fn commit_joining(server: &Server, change: Change) -> Result<()> {
    let deadline = std::time::Instant::now() + CATCH_UP_TIMEOUT;
    loop {
        let record = Command::new(SystemClock.now_ms(), change.clone());
        match commit_via_leader(&server.raft, &server.client, record).await {
            Ok(Err(Rejection::MemberExists(id))) if matches!(&change, Change::AddMember(spec) if spec.id == id) =>
            {
                return Ok(());
            }
            Ok(outcome) => return outcome.map(drop).map_err(anyhow::Error::msg),
            Err(refused) if std::time::Instant::now() < deadline => {
                tracing::warn!(error = %refused, "not committed yet; asking the leader again");
                tokio::time::sleep(std::time::Duration::from_millis(200)).await;
            }
            Err(refused) => return Err(anyhow::Error::msg(refused)),
        }
    }
}

/// Waits until this learner has caught up with the leader, then asks to become a voter; a
/// leader that dies or changes on the way is asked again (adding a voter twice changes
/// nothing) until [`CATCH_UP_TIMEOUT`].
async fn promote(server: &Server) -> Result<()> {
    let deadline = std::time::Instant::now() + CATCH_UP_TIMEOUT;
    loop {
        match try_promote(server).await {
            Ok(()) => return Ok(()),
            Err(e) if std::time::Instant::now() < deadline => {
                tracing::warn!(error = %format!("{e:#}"), "not promoted yet; asking again");
                tokio::time::sleep(std::time::Duration::from_millis(200)).await;
            }
            Err(e) => return Err(e),
        }
    }
}

async fn try_promote(server: &Server) -> Result<()> {
    let leader_addr = leader_address(server)?;
    let view = server.client.read(&leader_addr).await?;
    let target = view.last_applied.map(|l| l.index);
    server
        .raft
        .wait(Some(CATCH_UP_TIMEOUT))
        .applied_index_at_least(target, "caught up before promotion")
        .await
        .context("catch up with the leader")?;
    server
        .client
        .change_membership(
            &leader_addr,
            MembershipChange::AddVoters([server.id].into()),
        )
        .await
        .context("become a voter")?;
    Ok(())
}

/// Where the leader this member knows of listens.
fn leader_address(server: &Server) -> Result<String> {
    let metrics = server.raft.metrics().borrow().clone();
    let leader = metrics.current_leader.context("no leader known yet")?;
    metrics
        .membership_config
        .membership()
        .get_node(&leader)
        .map(|n| n.addr.clone())
        .context("the leader has no address in the membership")
}

pub(super) async fn leave(args: LeaveArgs) -> Result<()> {
    let id = match (args.member, &args.target.data) {
        (Some(id), _) => id,
        (None, Some(data)) => MemberIdentity::load(&DataLayout::new(data).tls_dir())?.id,
        (None, None) => bail!("--identity needs --member, the member to remove"),
    };
    let Operator { client, addr, .. } = operator(&args.target)?;
    let view = client.read(&addr).await?;
    let in_raft = view.nodes.contains_key(&id);
    let in_state = view.cluster.members().contains_key(&id);
    let revoked = view.cluster.revoked().members.contains(&id);
    // Member 1 is `init`'s; every other id was admitted by a join token.
    let ever_member = id == 1 || view.cluster.join_tokens().admitted(id);
    if !in_raft && !in_state && (revoked || !ever_member) {
        client.endpoint().close(0u32.into(), b"done");
        if revoked {
            println!("member {id} has already left and its certificate is revoked: nothing to do");
            return Ok(());
        }
        bail!(
            "member {id} is not in the group (its members: {}): nothing was changed",
            view.nodes
                .keys()
                .map(ToString::to_string)
                .collect::<Vec<_>>()
                .join(", ")
        );
    }
    if view.voters.contains(&id) && view.voters.len() == 1 {
        bail!("member {id} is the only voter; a group cannot lose its last voter");
    }
    // Ask another member: this one may be the leader and step down mid-call.
    let other = view
        .nodes
        .iter()
        .find(|(other, _)| **other != id)
        .map(|(_, a)| a.clone())
        .unwrap_or(addr);
    if in_raft {
        let change = if view.voters.contains(&id) {
            MembershipChange::RemoveVoters([id].into())
        } else {
            MembershipChange::RemoveLearners([id].into())
        };
        if let Err(e) = client.change_membership(&other, change).await {
            // The change may have committed while its answer was lost (the leader changed
            // mid-call): what the group holds now decides, so a retried leave finishes the job.
            let now = client.read(&other).await.map_err(|_| e)?;
            if now.nodes.contains_key(&id) {
                bail!("member {id} is still in the group's membership after a failed change");
            }
            tracing::warn!("the membership change's answer was lost; the group no longer has {id}");
        }
    }
    if in_state {
        let remove = Command::new(SystemClock.now_ms(), Change::RemoveMember { id });
        client
            .propose(&other, remove)
            .await?
            .1
            .map_err(anyhow::Error::msg)?;
    }
    // Last, since a member leaving by its own identity can make no call after this one.
    let revoke = Command::new(SystemClock.now_ms(), Change::RevokeMember { id });
    client
        .propose(&other, revoke)
        .await?
        .1
        .map_err(anyhow::Error::msg)?;
    client.endpoint().close(0u32.into(), b"done");
    let what = match (in_raft, in_state) {
        (true, true) => "left the group's membership, its record was removed",
        (true, false) => "left the group's membership (it had no member record)",
        (false, true) => "had already left the membership; its leftover record was removed",
        (false, false) => "had already left the membership and has no record",
    };
    println!("member {id} {what} and its certificate is revoked; stop its process");
    Ok(())
}

/// `cluster revoke --operator NAME`: every member refuses that operator's certificates.
pub(super) async fn revoke_operator(args: RevokeArgs) -> Result<()> {
    check_operator_name(&args.operator)?;
    let Operator { client, addr, .. } = operator(&args.target)?;
    let name = args.operator.clone();
    let revoke = Command::new(SystemClock.now_ms(), Change::RevokeOperator { name });
    let outcome = client.propose(&addr, revoke).await;
    client.endpoint().close(0u32.into(), b"done");
    outcome?.1.map_err(anyhow::Error::msg)?;
    println!(
        "operator {} is revoked: every member refuses its certificates",
        args.operator
    );
    Ok(())
}
