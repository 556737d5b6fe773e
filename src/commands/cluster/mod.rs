//! `strata cluster`: make a topology group, join it, run a member, and look at the group.
//!
//! A member's data directory holds everything it needs to restart: `member.toml` (its
//! configuration), `tls/` (its certificate, key and the CA certificate), `topology.redb` (the
//! raft log and state) and, on the member that ran `init`, `ca/` (the CA key) and `join-token`.
//! `init` and `join` on a directory that already holds a member resume it, as `serve` does.
//!
//! The operator commands (status, members, placement, token, leave) act either as the member
//! whose data directory they are given (`--data`) or as an operator (`--identity`, a directory
//! that `cluster operator` wrote on the member holding the CA key). An operator's certificate
//! names the operator, so members log who changed their membership and refuse its raft RPCs.
//! Making, joining, running, leaving and revoking members is in `membership.rs`.

mod membership;

use std::collections::{BTreeMap, BTreeSet};
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::Duration;

use membership::{init, join, leave, revoke_operator, serve, write_secret};

use anyhow::{Context, Result, bail};
use clap::{Args, Subcommand};
use serde_json::{Value, json};
use strata_topology::NodeId;
use strata_topology::lease_driver::{Clock, SystemClock};
use strata_topology::server::{
    DataLayout, Server, ServerConfig, ServerError, Timing, shutdown_signal,
};
use strata_topology::state::{
    Applied, Capacity, Change, Command, DEFAULT_JOIN_TOKEN_TTL_MS, MemberAddresses, MemberSpec,
    PlacementRequest, RaftRole, Rejection, UnixMillis,
};
use strata_topology::store::StoreError;
use strata_topology::transport::ca::{
    CA_KEY_FILE, DEFAULT_CERT_LIFETIME, MIN_CERT_LIFETIME, check_operator_name, sha256_hex,
};
use strata_topology::transport::client::commit_via_leader;
use strata_topology::transport::join::{JoinError, JoinToken, request_membership};
use strata_topology::transport::wire::{ClusterView, MembershipChange, Refusal};
use strata_topology::transport::{
    Client, ClientError, ClusterCa, MemberIdentity, OperatorIdentity, client_endpoint,
    operator_endpoint,
};

/// How long a join or a promotion may take.
const CALL_TIMEOUT: Duration = Duration::from_secs(10);
/// How long one operator call (status, members, token, leave) may take: short, because a
/// follower may still name a leader that just died.
const OPERATOR_TIMEOUT: Duration = Duration::from_secs(3);
/// How long an operator's call waits for the group to name a leader (an election, or the
/// leader itself leaving) before reporting the refusal.
const ELECTION_WAIT: Duration = Duration::from_secs(10);
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
    /// Place a model: tensor-parallel groups of GPUs on the members (computed once by the
    /// group, then stored). Routers following the group send the model's requests only to the
    /// members hosting one of its groups.
    Place(PlaceArgs),
    /// Remove a model's placement: its requests go to every serving member again.
    Unplace(UnplaceArgs),
    /// Remove a member from the group and revoke its certificate (then stop its process): the
    /// one in --data, or --member.
    Leave(LeaveArgs),
    /// Revoke an operator's certificates by name: every member refuses them from then on.
    Revoke(RevokeArgs),
    /// Issue another one-use join token (each join spends one); it expires after --ttl.
    Token(TokenArgs),
    /// Issue an operator's certificate (run on the member holding the CA key): writes an
    /// identity directory for --identity.
    Operator(OperatorArgs),
    /// Issue a new certificate for a member whose own ended while it was down (members renew
    /// theirs while they run; run this on the member holding the CA key, then copy the
    /// written member.pem and member.key into that member's <data>/tls/ and start it).
    Reissue(ReissueArgs),
}

#[derive(Args)]
pub struct ReissueArgs {
    /// The data directory of the member holding the cluster CA key.
    #[arg(long)]
    data: PathBuf,
    /// The member whose certificate to issue again.
    #[arg(long)]
    member: NodeId,
    /// A new directory to write `member.pem`, `member.key` (mode 0600) and `ca.pem` into.
    #[arg(long)]
    out: PathBuf,
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
    /// How long member and operator certificates stay valid (`90s`, `12h`, `30d`; at least
    /// 10 s): holders renew theirs through this member when a third is left.
    #[arg(long, default_value = "30d", value_parser = parse_lifetime)]
    cert_lifetime: u64,
    #[command(flatten)]
    election: ElectionArgs,
}

/// How a member stands for election.
#[derive(Args)]
pub struct ElectionArgs {
    /// Ask the other voters before standing for election (pre-vote), so that a member back from
    /// a pause or a partition does not depose a working leader; `false` is raft without it (a
    /// test's canary, as etcd's `--pre-vote=false`). Kept in the member's config.
    #[arg(long, default_value_t = true, action = clap::ArgAction::Set)]
    pre_vote: bool,
}

impl ElectionArgs {
    /// The member's timing with this choice.
    pub fn timing(&self) -> Timing {
        Timing {
            pre_vote: self.pre_vote,
            ..Timing::default()
        }
    }
}

/// A certificate lifetime in seconds from `<n>` followed by `s`, `m`, `h` or `d`.
fn parse_lifetime(text: &str) -> Result<u64, String> {
    let bad = || format!("{text:?}: expected a whole number followed by s, m, h or d (e.g. 30d)");
    let (number, unit) = text.split_at(text.len().saturating_sub(1));
    let scale = match unit {
        "s" => 1,
        "m" => 60,
        "h" => 3_600,
        "d" => 86_400,
        _ => return Err(bad()),
    };
    let seconds = number
        .parse::<u64>()
        .ok()
        .and_then(|n| n.checked_mul(scale))
        .ok_or_else(bad)?;
    let least = MIN_CERT_LIFETIME.as_secs();
    if seconds < least {
        return Err(format!(
            "{text:?}: certificates must live at least {least} s"
        ));
    }
    Ok(seconds)
}

#[derive(Args)]
pub struct JoinArgs {
    #[arg(long)]
    data: PathBuf,
    /// Member endpoint (raft and clients, mutual TLS), bound before the group is asked; port 0
    /// takes one the system picks, recorded as this member's address.
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
    #[command(flatten)]
    election: ElectionArgs,
}

#[derive(Args)]
pub struct DataArgs {
    #[arg(long)]
    data: PathBuf,
}

/// Whom an operator command acts as, and which member it asks.
#[derive(Args)]
pub struct Target {
    /// The data directory of a member on this machine (its identity and address are used).
    #[arg(
        long,
        required_unless_present = "identity",
        conflicts_with = "identity"
    )]
    data: Option<PathBuf>,
    /// An operator identity directory, as `cluster operator --out` writes it; needs --addr.
    #[arg(long, requires = "addr")]
    identity: Option<PathBuf>,
    /// Ask this member instead of the one in --data.
    #[arg(long)]
    addr: Option<String>,
}

#[derive(Args)]
pub struct LeaveArgs {
    #[command(flatten)]
    target: Target,
    /// The member to remove; default: the one in --data.
    #[arg(long, required_unless_present = "data")]
    member: Option<NodeId>,
}

#[derive(Args)]
pub struct RevokeArgs {
    #[command(flatten)]
    target: Target,
    /// The operator whose certificates to revoke.
    #[arg(long)]
    operator: String,
}

#[derive(Args)]
pub struct PlaceArgs {
    #[command(flatten)]
    target: Target,
    /// The model's served name (a router serves its checkpoint directory's name).
    #[arg(long)]
    model: String,
    /// GPUs per tensor-parallel group (a group never spans members).
    #[arg(long, default_value_t = 1)]
    tp: u32,
    /// Groups to run.
    #[arg(long, default_value_t = 1)]
    replicas: u32,
    /// Memory every GPU of a group needs, in MiB.
    #[arg(long, default_value_t = 0)]
    min_gpu_memory_mib: u64,
    /// Only members with this label qualify (`key=value`; repeat for several).
    #[arg(long = "label", value_parser = parse_label)]
    labels: Vec<(String, String)>,
    /// Of a mixture of experts: its experts per sparse layer; each rank of a group is recorded
    /// holding an equal run of them (--tp must divide it).
    #[arg(long, default_value_t = 0)]
    experts: u32,
}

#[derive(Args)]
pub struct UnplaceArgs {
    #[command(flatten)]
    target: Target,
    #[arg(long)]
    model: String,
}

fn parse_label(text: &str) -> Result<(String, String), String> {
    match text.split_once('=') {
        Some((k, v)) if !k.trim().is_empty() => Ok((k.to_string(), v.to_string())),
        _ => Err(format!("`{text}` is not key=value")),
    }
}

#[derive(Args)]
pub struct OperatorArgs {
    /// The data directory of the member holding the cluster CA key (the one that ran `init`).
    #[arg(long)]
    data: PathBuf,
    /// The operator's name: lowercase letters, digits and '-', starting with a letter.
    #[arg(long)]
    name: String,
    /// Where to write `operator.pem`, `operator.key` (mode 0600) and `ca.pem`.
    #[arg(long)]
    out: PathBuf,
}

#[derive(Args)]
pub struct TokenArgs {
    #[command(flatten)]
    target: Target,
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
    #[command(flatten)]
    target: Target,
    /// Print JSON instead of a table.
    #[arg(long)]
    json: bool,
}

impl ClusterCommand {
    /// Whether the command runs a member (the rest ask one and print).
    pub fn serves(&self) -> bool {
        matches!(
            self,
            ClusterCommand::Init(_) | ClusterCommand::Join(_) | ClusterCommand::Serve(_)
        )
    }
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
            ClusterCommand::Place(args) => place(args).await,
            ClusterCommand::Unplace(args) => unplace(args).await,
            ClusterCommand::Leave(args) => leave(args).await,
            ClusterCommand::Revoke(args) => revoke_operator(args).await,
            ClusterCommand::Token(args) => issue_token(args).await,
            ClusterCommand::Operator(args) => issue_operator(&args),
            ClusterCommand::Reissue(args) => reissue_member(&args),
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

/// An operator command's connection: a client holding the identity it acts as, the member
/// address to ask, and the fingerprint of the CA that identity trusts.
struct Operator {
    client: Client,
    addr: String,
    ca_fingerprint: String,
}

/// Dials as the operator identity in `--identity`, or else as the member in `--data`.
fn operator(target: &Target) -> Result<Operator> {
    let addr = match (&target.addr, &target.data) {
        (Some(addr), _) => addr.clone(),
        (None, Some(data)) => load_config(data)?.advertised(),
        (None, None) => bail!("--identity needs --addr, the member to ask"),
    };
    let local: SocketAddr = if addr.starts_with('[') {
        "[::]:0".parse()?
    } else {
        "0.0.0.0:0".parse()?
    };
    let (endpoint, ca) = match (&target.identity, &target.data) {
        (Some(dir), _) => {
            let identity = OperatorIdentity::load(dir)
                .with_context(|| format!("load the operator identity in {}", dir.display()))?;
            (operator_endpoint(&identity, local)?, identity.ca)
        }
        (None, Some(data)) => {
            let identity = MemberIdentity::load(&DataLayout::new(data).tls_dir())?;
            (client_endpoint(&identity, local)?, identity.ca)
        }
        (None, None) => bail!("give --data (a member's directory) or --identity"),
    };
    Ok(Operator {
        client: Client::new(endpoint, OPERATOR_TIMEOUT).waiting_for_elections(ELECTION_WAIT),
        addr,
        ca_fingerprint: sha256_hex(&ca),
    })
}

async fn show(args: ViewArgs, print: fn(&ClusterView, bool) -> Result<()>) -> Result<()> {
    let Operator { client, addr, .. } = operator(&args.target)?;
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
        "changing": view.changing,
        "learners": learners,
        "last_applied": view.last_applied.map(|l| l.index),
        "term": view.last_applied.map(|l| l.leader_id.term),
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
    println!(
        "voters       {}{}",
        ids(&view.voters),
        if view.changing {
            "  (membership change under way: joint configuration)"
        } else {
            ""
        }
    );
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

/// `, experts rank 0: 0..32, …` for a mixture of experts' group; empty for a dense one.
fn experts_text(group: &strata_topology::state::TpGroup) -> String {
    let runs: Vec<String> = (group.experts.iter().enumerate())
        .map(|(rank, [start, end])| format!("rank {rank}: {start}..{end}"))
        .collect();
    if runs.is_empty() {
        String::new()
    } else {
        format!(", experts {}", runs.join(", "))
    }
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
            let experts = experts_text(group);
            println!(
                "{model:<32} {i:>5}  {}:{}{experts}",
                group.node,
                gpus.join(",")
            );
        }
    }
    Ok(())
}

async fn place(args: PlaceArgs) -> Result<()> {
    let request = PlacementRequest {
        model: args.model.clone(),
        tp_size: args.tp,
        replicas: args.replicas,
        min_gpu_memory_mib: args.min_gpu_memory_mib,
        required_labels: args.labels.into_iter().collect(),
        experts: args.experts,
    };
    let applied = operator_commit(&args.target, Change::PlaceModel(request))
        .await
        .with_context(|| format!("placing `{}`", args.model))?;
    for (i, group) in applied.placed.iter().enumerate() {
        let gpus: Vec<String> = group.gpus.iter().map(ToString::to_string).collect();
        let experts = experts_text(group);
        println!(
            "{} group {i}: member {} GPUs {}{experts}",
            args.model,
            group.node,
            gpus.join(",")
        );
    }
    Ok(())
}

async fn unplace(args: UnplaceArgs) -> Result<()> {
    let change = Change::RemoveModel {
        model: args.model.clone(),
    };
    operator_commit(&args.target, change)
        .await
        .with_context(|| format!("removing `{}`'s placement", args.model))?;
    println!("{} is no longer placed", args.model);
    Ok(())
}

/// Commits `change` through the member `target` names; the group's refusal is an error.
async fn operator_commit(target: &Target, change: Change) -> Result<Applied> {
    let Operator { client, addr, .. } = operator(target)?;
    let outcome = client
        .propose(&addr, Command::new(SystemClock.now_ms(), change))
        .await?
        .1;
    client.endpoint().close(0u32.into(), b"done");
    outcome.map_err(|r| anyhow::anyhow!("the group refused: {r}"))
}

async fn issue_token(args: TokenArgs) -> Result<()> {
    let Operator {
        client,
        addr,
        ca_fingerprint,
    } = operator(&args.target)?;
    let token = JoinToken::generate(&ca_fingerprint)?;
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

/// The cluster CA in the member data directory `data`, issuing for the lifetime that member is
/// configured with.
fn load_ca(data: &Path) -> Result<ClusterCa> {
    let ca_dir = DataLayout::new(data).ca_dir();
    if !ca_dir.join(CA_KEY_FILE).exists() {
        bail!(
            "{} holds no cluster CA key ({} is missing): run this on the member that ran \
             `strata cluster init`",
            data.display(),
            ca_dir.join(CA_KEY_FILE).display()
        );
    }
    let lifetime = ServerConfig::load(&DataLayout::new(data).config())
        .ok()
        .and_then(|config| config.cert_lifetime_s)
        .map_or(DEFAULT_CERT_LIFETIME, std::time::Duration::from_secs);
    ClusterCa::load(&ca_dir)
        .and_then(|ca| ca.with_lifetime(lifetime))
        .context("load the cluster CA")
}

/// Writes member `--member`'s new identity into `--out`, signed by the CA key in `--data`.
fn reissue_member(args: &ReissueArgs) -> Result<()> {
    let ca = load_ca(&args.data)?;
    ca.issue_member(args.member, &args.out).with_context(|| {
        format!(
            "issue member {}'s identity into {}",
            args.member,
            args.out.display()
        )
    })?;
    println!(
        "member {} identity written to {}; copy member.pem and member.key into that member's \
         <data>/tls/, then start it",
        args.member,
        args.out.display()
    );
    Ok(())
}

/// Writes operator `--name`'s identity into `--out`, signed by the CA key in `--data`.
fn issue_operator(args: &OperatorArgs) -> Result<()> {
    check_operator_name(&args.name)?;
    let ca = load_ca(&args.data)?;
    ca.issue_operator(&args.name, &args.out).with_context(|| {
        format!(
            "issue operator {}'s identity into {}",
            args.name,
            args.out.display()
        )
    })?;
    println!(
        "operator {} identity written to {}; use it with --identity {} --addr MEMBER",
        args.name,
        args.out.display(),
        args.out.display()
    );
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
    fn a_certificate_lifetime_takes_units_and_refuses_less_than_ten_seconds() {
        assert_eq!(parse_lifetime("30d"), Ok(30 * 86_400));
        assert_eq!(parse_lifetime("12h"), Ok(12 * 3_600));
        assert_eq!(parse_lifetime("15m"), Ok(900));
        assert_eq!(parse_lifetime("10s"), Ok(10));
        for bad in [
            "9s",
            "0d",
            "30",
            "d",
            "",
            "1.5d",
            "-1d",
            "30x",
            "99999999999999999999d",
        ] {
            assert!(parse_lifetime(bad).is_err(), "{bad:?} accepted");
        }
    }

    #[test]
    fn a_token_lives_an_hour_unless_told_otherwise_and_never_zero_seconds() {
        assert_eq!(token_ttl(&[]).unwrap(), 3_600);
        assert_eq!(token_ttl(&["--ttl", "90"]).unwrap(), 90);
        assert!(token_ttl(&["--ttl", "0"]).is_err());
        assert!(token_ttl(&["--ttl", "10m"]).is_err(), "seconds only");
    }

    #[test]
    fn operator_commands_take_a_member_directory_or_an_operator_identity_with_an_address() {
        let parse = |args: &[&str]| Cli::try_parse_from(["cluster"].iter().chain(args));
        assert!(parse(&["status", "--data", "/d"]).is_ok());
        assert!(parse(&["status", "--identity", "/ops", "--addr", "127.0.0.1:1"]).is_ok());
        assert!(
            parse(&["status", "--identity", "/ops"]).is_err(),
            "no member to ask"
        );
        assert!(parse(&["status"]).is_err(), "no identity at all");
        assert!(
            parse(&[
                "members",
                "--data",
                "/d",
                "--identity",
                "/ops",
                "--addr",
                "a:1"
            ])
            .is_err(),
            "two identities"
        );
        assert!(parse(&["leave", "--data", "/d"]).is_ok());
        assert!(
            parse(&["leave", "--identity", "/ops", "--addr", "a:1"]).is_err(),
            "an operator names the member to remove"
        );
        assert!(
            parse(&[
                "leave",
                "--identity",
                "/ops",
                "--addr",
                "a:1",
                "--member",
                "3"
            ])
            .is_ok()
        );
        assert!(parse(&["token", "--identity", "/ops", "--addr", "a:1"]).is_ok());
    }
}
