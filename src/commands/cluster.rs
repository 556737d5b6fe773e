//! `strata cluster`: make a topology group, join it, run a member, and look at the group.
//!
//! A member's data directory holds everything it needs to restart: `member.toml` (its
//! configuration), `tls/` (its certificate, key and the CA certificate), `topology.redb` (the
//! raft log and state) and, on the member that ran `init`, `ca/` (the CA key) and `join-token`.
//! `init` and `join` on a directory that already holds a member resume it, as `serve` does.

use std::collections::{BTreeMap, BTreeSet};
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::{Context, Result, bail};
use clap::{Args, Subcommand};
use serde_json::{Value, json};
use strata_topology::NodeId;
use strata_topology::lease_driver::{Clock, SystemClock};
use strata_topology::server::{DataLayout, Server, ServerConfig, Timing, shutdown_signal};
use strata_topology::state::{
    Capacity, Change, Command, DEFAULT_JOIN_TOKEN_TTL_MS, MemberAddresses, MemberSpec, RaftRole,
    UnixMillis,
};
use strata_topology::transport::client::commit_via_leader;
use strata_topology::transport::join::{JoinToken, request_membership};
use strata_topology::transport::wire::{ClusterView, MembershipChange};
use strata_topology::transport::{Client, ClusterCa, MemberIdentity, client_endpoint};

/// How long a join or a promotion may take.
const CALL_TIMEOUT: Duration = Duration::from_secs(10);
/// How long one operator call (status, members, token, leave) may take: short, because a
/// follower may still name a leader that just died.
const OPERATOR_TIMEOUT: Duration = Duration::from_secs(3);
/// How long a joiner waits to catch up before asking to become a voter.
const CATCH_UP_TIMEOUT: Duration = Duration::from_secs(60);

#[derive(Subcommand)]
pub enum ClusterCommand {
    /// Create a cluster: the CA, member 1's certificate, a join token, a one-voter group; then
    /// serve as member 1.
    Init(InitArgs),
    /// Join a cluster with a token (certificate issued through the member holding the CA),
    /// as a learner or, with --voter, a voter; then serve.
    Join(JoinArgs),
    /// Run the member whose data directory this is (after a restart).
    Serve(DataArgs),
    /// The group: leader, voters, learners, applied index, ring epoch, health.
    Status(ViewArgs),
    /// The members and what they declared.
    Members(ViewArgs),
    /// Model placement: groups of GPUs per model.
    Placement(ViewArgs),
    /// Remove this member from the group (then stop its process).
    Leave(DataArgs),
    /// Issue another one-use join token (each join spends one); it expires after --ttl.
    Token(TokenArgs),
}

#[derive(Args)]
pub struct InitArgs {
    #[arg(long)]
    data: PathBuf,
    /// Member endpoint (raft and clients, mutual TLS).
    #[arg(long)]
    listen: SocketAddr,
    /// Address others dial; default: --listen.
    #[arg(long)]
    advertise: Option<String>,
    /// Join endpoint (server-authenticated TLS, joins only); default: --listen's port + 1.
    #[arg(long)]
    join_listen: Option<SocketAddr>,
}

#[derive(Args)]
pub struct JoinArgs {
    #[arg(long)]
    data: PathBuf,
    #[arg(long)]
    listen: SocketAddr,
    #[arg(long)]
    advertise: Option<String>,
    /// The join endpoint of the member that ran `init`.
    #[arg(long)]
    seed: String,
    /// The join token: a file holding it, or the token itself.
    #[arg(long)]
    token: String,
    /// Become a voter once caught up (otherwise stay a learner).
    #[arg(long)]
    voter: bool,
}

#[derive(Args)]
pub struct DataArgs {
    #[arg(long)]
    data: PathBuf,
}

#[derive(Args)]
pub struct TokenArgs {
    #[arg(long)]
    data: PathBuf,
    /// Write the token to this new file (mode 0600) instead of printing it.
    #[arg(long)]
    out: Option<PathBuf>,
    /// Seconds the token admits a joiner, from when the group records it.
    #[arg(
        long,
        default_value_t = DEFAULT_JOIN_TOKEN_TTL_MS / 1_000,
        value_parser = clap::value_parser!(u64).range(1..)
    )]
    ttl: u64,
}

#[derive(Args)]
pub struct ViewArgs {
    /// The data directory of a member on this machine (its identity and address are used).
    #[arg(long)]
    data: PathBuf,
    /// Ask this member instead of the one in --data.
    #[arg(long)]
    addr: Option<String>,
    /// Print JSON instead of a table.
    #[arg(long)]
    json: bool,
}

pub fn run(command: ClusterCommand) -> Result<()> {
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .context("start the async runtime")?;
    runtime.block_on(async move {
        match command {
            ClusterCommand::Init(args) => init(args).await,
            ClusterCommand::Join(args) => join(args).await,
            ClusterCommand::Serve(args) => serve(&args.data).await,
            ClusterCommand::Status(args) => show(args, print_status).await,
            ClusterCommand::Members(args) => show(args, print_members).await,
            ClusterCommand::Placement(args) => show(args, print_placement).await,
            ClusterCommand::Leave(args) => leave(&args.data).await,
            ClusterCommand::Token(args) => issue_token(args).await,
        }
    })
}

fn load_config(data: &Path) -> Result<ServerConfig> {
    ServerConfig::load(&DataLayout::new(data).config()).map_err(anyhow::Error::msg)
}

fn member_spec(id: NodeId, addr: &str) -> MemberSpec {
    MemberSpec {
        id,
        addresses: MemberAddresses {
            raft: addr.to_string(),
            rpc: addr.to_string(),
        },
        gpus: Vec::new(),
        capacity: Capacity::default(),
        labels: BTreeMap::new(),
        role: RaftRole::Learner,
    }
}

/// Serves `server` until SIGTERM or ctrl-c.
async fn serve_until_signal(server: Server) -> Result<()> {
    shutdown_signal().await;
    tracing::info!(member = server.id, "stopping on signal");
    server.shutdown().await;
    Ok(())
}

async fn serve(data: &Path) -> Result<()> {
    let config = load_config(data)?;
    let server = Server::start(&config).await?;
    serve_until_signal(server).await
}

async fn init(args: InitArgs) -> Result<()> {
    let layout = DataLayout::new(&args.data);
    if layout.config().exists() {
        tracing::info!(data = %args.data.display(), "a member lives here already; resuming it");
        return serve(&args.data).await;
    }
    let join_listen = args.join_listen.unwrap_or_else(|| {
        let mut addr = args.listen;
        if addr.port() != 0 {
            addr.set_port(addr.port().wrapping_add(1));
        }
        addr
    });
    let ca = ClusterCa::create(&layout.ca_dir()).context("create the cluster CA")?;
    ca.issue_member(1, &layout.tls_dir())
        .context("issue member 1's certificate")?;
    let token = JoinToken::generate(&ca.fingerprint()?)?;
    write_secret(&layout.join_token(), &token.encode())?;
    let config = ServerConfig {
        data_dir: args.data.clone(),
        listen: args.listen,
        advertise: args.advertise,
        join_listen: Some(join_listen),
        timing: Timing::default(),
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
fn write_secret(path: &Path, contents: &str) -> Result<()> {
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

async fn join(args: JoinArgs) -> Result<()> {
    let layout = DataLayout::new(&args.data);
    if layout.config().exists() {
        tracing::info!(data = %args.data.display(), "a member lives here already; resuming it");
        return serve(&args.data).await;
    }
    let token = read_token(&args.token)?;
    let config = ServerConfig {
        data_dir: args.data.clone(),
        listen: args.listen,
        advertise: args.advertise,
        join_listen: None,
        timing: Timing::default(),
    };
    std::fs::create_dir_all(&args.data)
        .with_context(|| format!("create {}", args.data.display()))?;
    let identity = request_membership(
        &args.seed,
        &token,
        &config.advertised(),
        &layout.tls_dir(),
        CALL_TIMEOUT,
    )
    .await
    .context("join through the seed")?;
    config.save(&layout.config()).map_err(anyhow::Error::msg)?;
    let server = Server::start(&config).await?;
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
    let record = Command::new(SystemClock.now_ms(), Change::AddMember(spec));
    commit_via_leader(&server.raft, &server.client, record)
        .await
        .map_err(anyhow::Error::msg)?
        .map_err(anyhow::Error::msg)?;
    if args.voter {
        promote(&server).await?;
        let record = Command::new(
            SystemClock.now_ms(),
            Change::SetRole {
                id: identity.id,
                role: RaftRole::Voter,
            },
        );
        commit_via_leader(&server.raft, &server.client, record)
            .await
            .map_err(anyhow::Error::msg)?
            .map_err(anyhow::Error::msg)?;
    }
    tracing::info!(member = identity.id, addr = %server.addr, voter = args.voter, "joined");
    serve_until_signal(server).await
}

/// Waits until this learner has caught up with the leader, then asks to become a voter.
async fn promote(server: &Server) -> Result<()> {
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

/// A client holding this machine's member identity, and the member address to ask.
fn operator(data: &Path, addr: Option<String>) -> Result<(Client, String)> {
    let layout = DataLayout::new(data);
    let identity = MemberIdentity::load(&layout.tls_dir())?;
    let addr = match addr {
        Some(addr) => addr,
        None => load_config(data)?.advertised(),
    };
    let local: SocketAddr = if addr.starts_with('[') {
        "[::]:0".parse()?
    } else {
        "0.0.0.0:0".parse()?
    };
    let endpoint = client_endpoint(&identity, local)?;
    Ok((Client::new(endpoint, OPERATOR_TIMEOUT), addr))
}

async fn show(args: ViewArgs, print: fn(&ClusterView, bool) -> Result<()>) -> Result<()> {
    let (client, addr) = operator(&args.data, args.addr)?;
    let view = client
        .read(&addr)
        .await
        .with_context(|| format!("read the group through {addr}"))?;
    client.endpoint().close(0u32.into(), b"done");
    print(&view, args.json)
}

fn raft_role(view: &ClusterView, id: NodeId) -> &'static str {
    if view.voters.contains(&id) {
        "voter"
    } else if view.nodes.contains_key(&id) {
        "learner"
    } else {
        "none"
    }
}

fn print_status(view: &ClusterView, as_json: bool) -> Result<()> {
    let learners: BTreeSet<NodeId> = view
        .nodes
        .keys()
        .filter(|id| !view.voters.contains(id))
        .copied()
        .collect();
    let health: BTreeMap<String, String> = view
        .cluster
        .members()
        .iter()
        .map(|(id, m)| {
            (
                id.to_string(),
                format!("{:?}", m.lease.health).to_lowercase(),
            )
        })
        .collect();
    let value = json!({
        "leader": view.leader,
        "voters": view.voters,
        "learners": learners,
        "last_applied": view.last_applied.map(|l| l.index),
        "ring_epoch": view.cluster.ring().epoch(),
        "members": view.cluster.members().len(),
        "models": view.cluster.placements().len(),
        "health": health,
    });
    if as_json {
        println!("{}", serde_json::to_string_pretty(&value)?);
        return Ok(());
    }
    let ids = |set: &BTreeSet<NodeId>| {
        set.iter()
            .map(ToString::to_string)
            .collect::<Vec<_>>()
            .join(",")
    };
    println!(
        "leader       {}",
        view.leader.map_or("none".into(), |l| l.to_string())
    );
    println!("voters       {}", ids(&view.voters));
    println!("learners     {}", ids(&learners));
    println!(
        "applied      {}",
        view.last_applied
            .map_or("none".into(), |l| l.index.to_string())
    );
    println!("ring epoch   {}", view.cluster.ring().epoch());
    println!("models       {}", view.cluster.placements().len());
    println!("{:>4}  {:<8} health", "id", "raft");
    for (id, member) in view.cluster.members() {
        println!(
            "{id:>4}  {:<8} {:?}",
            raft_role(view, *id),
            member.lease.health
        );
    }
    Ok(())
}

/// Members as declared, with their raft role: nothing that changes while the group is idle,
/// so that two reads of an unchanged group print the same bytes.
fn members_json(view: &ClusterView) -> Value {
    let members: Vec<Value> = view
        .cluster
        .members()
        .iter()
        .map(|(id, m)| {
            json!({
                "id": id,
                "raft": raft_role(view, *id),
                // The role recorded in the state: a joiner is recorded a voter only once raft
                // has promoted it.
                "recorded_role": match m.spec.role {
                    RaftRole::Voter => "voter",
                    RaftRole::Learner => "learner",
                },
                "raft_addr": m.spec.addresses.raft,
                "rpc_addr": m.spec.addresses.rpc,
                "gpus": m.spec.gpus.len(),
                "kv_blocks": m.spec.capacity.kv_blocks,
                "max_sequences": m.spec.capacity.max_sequences,
                "labels": m.spec.labels,
            })
        })
        .collect();
    json!({ "voters": view.voters, "nodes": view.nodes, "members": members })
}

fn print_members(view: &ClusterView, as_json: bool) -> Result<()> {
    if as_json {
        println!("{}", serde_json::to_string_pretty(&members_json(view))?);
        return Ok(());
    }
    println!(
        "{:>4}  {:<8} {:<8} {:<24} {:>4}  labels",
        "id", "raft", "health", "raft_addr", "gpus"
    );
    for (id, m) in view.cluster.members() {
        let labels: Vec<String> = m
            .spec
            .labels
            .iter()
            .map(|(k, v)| format!("{k}={v}"))
            .collect();
        println!(
            "{id:>4}  {:<8} {:<8} {:<24} {:>4}  {}",
            raft_role(view, *id),
            format!("{:?}", m.lease.health).to_lowercase(),
            m.spec.addresses.raft,
            m.spec.gpus.len(),
            labels.join(",")
        );
    }
    Ok(())
}

fn print_placement(view: &ClusterView, as_json: bool) -> Result<()> {
    let placements = view.cluster.placements();
    if as_json {
        println!("{}", serde_json::to_string_pretty(placements)?);
        return Ok(());
    }
    if placements.is_empty() {
        println!("no models placed");
        return Ok(());
    }
    println!("{:<32} {:>5}  node:gpus", "model", "group");
    for (model, placement) in placements {
        for (i, group) in placement.groups.iter().enumerate() {
            let gpus: Vec<String> = group.gpus.iter().map(ToString::to_string).collect();
            println!("{model:<32} {i:>5}  {}:{}", group.node, gpus.join(","));
        }
    }
    Ok(())
}

async fn issue_token(args: TokenArgs) -> Result<()> {
    let identity = MemberIdentity::load(&DataLayout::new(&args.data).tls_dir())?;
    let token = JoinToken::generate(&strata_topology::transport::ca::sha256_hex(&identity.ca))?;
    let (client, addr) = operator(&args.data, None)?;
    let put = Change::PutJoinToken {
        sha256: token.secret_sha256(),
        ttl_ms: args.ttl.saturating_mul(1_000),
    };
    let now = SystemClock.now_ms();
    client
        .propose(&addr, Command::new(now, put))
        .await?
        .1
        .map_err(anyhow::Error::msg)?;
    client.endpoint().close(0u32.into(), b"done");
    // The group dates the token at its own time, which runs ahead of this clock only if
    // another member's clock is ahead: the expiry shown is the earliest it can be.
    tracing::info!(
        expires = %UnixMillis(now.saturating_add(args.ttl.saturating_mul(1_000))),
        "join token issued"
    );
    match args.out {
        Some(path) => write_secret(&path, &token.encode())?,
        None => println!("{}", token.encode()),
    }
    Ok(())
}

async fn leave(data: &Path) -> Result<()> {
    let layout = DataLayout::new(data);
    let identity = MemberIdentity::load(&layout.tls_dir())?;
    let id = identity.id;
    let (client, addr) = operator(data, None)?;
    let view = client.read(&addr).await?;
    if view.voters.contains(&id) && view.voters.len() == 1 {
        bail!("member {id} is the only voter; a group cannot lose its last voter");
    }
    let change = if view.voters.contains(&id) {
        MembershipChange::RemoveVoters([id].into())
    } else {
        MembershipChange::RemoveLearners([id].into())
    };
    // Ask another member: this one may be the leader and step down mid-call.
    let other = view
        .nodes
        .iter()
        .find(|(other, _)| **other != id)
        .map(|(_, a)| a.clone())
        .unwrap_or(addr);
    client.change_membership(&other, change).await?;
    if view.cluster.members().contains_key(&id) {
        let remove = Command::new(SystemClock.now_ms(), Change::RemoveMember { id });
        client
            .propose(&other, remove)
            .await?
            .1
            .map_err(anyhow::Error::msg)?;
    }
    client.endpoint().close(0u32.into(), b"done");
    println!("member {id} left the group; stop its process");
    Ok(())
}

#[cfg(test)]
mod tests {
    use clap::Parser;

    use super::*;

    #[derive(Parser)]
    struct Cli {
        #[command(subcommand)]
        command: ClusterCommand,
    }

    fn token_ttl(args: &[&str]) -> Result<u64, clap::Error> {
        let cli = Cli::try_parse_from(["cluster", "token", "--data", "/d"].iter().chain(args))?;
        match cli.command {
            ClusterCommand::Token(token) => Ok(token.ttl),
            _ => unreachable!("parsed the token subcommand"),
        }
    }

    #[test]
    fn a_token_lives_an_hour_unless_told_otherwise_and_never_zero_seconds() {
        assert_eq!(token_ttl(&[]).unwrap(), 3_600);
        assert_eq!(token_ttl(&["--ttl", "90"]).unwrap(), 90);
        assert!(token_ttl(&["--ttl", "0"]).is_err());
        assert!(token_ttl(&["--ttl", "10m"]).is_err(), "seconds only");
    }
}
