//! `strata router`: the HTTP surfaces in front of `strata node` processes, over QUIC with mutual
//! TLS, routing each request by cached prefix and load (DESIGN.md §2, §6).

use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context, Result, bail};
use clap::{Args, ValueEnum};
use strata_node::rpc::ALPN;
use strata_node::{front_door_parts, grammar_compiler};
use strata_quic::LiveIdentity;
use strata_quic::tls::{live_client_config, set_liveness};
use strata_router::ServedModel;
use strata_router::auth::KeyStore;
use strata_router::cluster::{Cluster, ClusterOptions};
use strata_router::drain::{StopSignals, stop_after_drain};
use strata_router::routing::{KvFetchConfig, Policy, Router, RoutingSettings};
use strata_router::watcher;
use strata_topology::state::ClusterState;
use strata_topology::transport::renew::{IdentityKind, Renewer, keep_identity};
use strata_topology::transport::{Client, OperatorIdentity, live_client_endpoint};

/// How long one call to the topology group may take.
const TOPOLOGY_TIMEOUT: Duration = Duration::from_secs(5);
use strata_topology::transport::ca::SERVER_NAME;

use super::serving_args::{FrontDoor, ServingSettings};

#[derive(Args)]
pub struct RouterArgs {
    /// Checkpoint directory of the model the nodes serve (its tokenizer, chat template and
    /// config.json are read; its weights are not).
    #[arg(long)]
    model: PathBuf,
    /// The nodes' RPC addresses (`strata node serve --listen`), comma-separated.
    #[arg(long, value_delimiter = ',', required_unless_present = "cluster")]
    nodes: Vec<SocketAddr>,
    /// Instead of --nodes: members of the topology group (their raft addresses,
    /// comma-separated) to follow; the nodes are the members serving requests, kept current as
    /// they join, leave or go down.
    #[arg(long, value_delimiter = ',', conflicts_with = "nodes")]
    cluster: Vec<String>,
    /// Identity directory from the cluster CA: an operator's (`strata cluster operator`) or a
    /// member's data directory.
    #[arg(long)]
    identity: PathBuf,
    /// How requests are spread over the nodes.
    #[arg(long, value_enum, default_value_t = PolicyName::CacheAware)]
    policy: PolicyName,
    /// Continue a stream on another node when its node fails mid-stream (greedy streams come
    /// out byte-identical); `false` ends such a stream with an error.
    #[arg(long, default_value_t = true, action = clap::ArgAction::Set)]
    failover: bool,
    /// Let a node import prompt blocks another node has cached when that beats computing them
    /// (the cost model is in --routing-config's `[kv_fetch]`); `false` never fetches.
    #[arg(long, default_value_t = true, action = clap::ArgAction::Set)]
    kv_fetch: bool,
    /// Routing parameters (TOML): `[cache_aware]` (credits, load_weight,
    /// bounded_load_epsilon) and `[kv_fetch]` (enabled, link_bytes_per_s, fetch_overhead_s,
    /// prefill_tokens_per_s, min_blocks). Keys left out keep their defaults.
    #[arg(long)]
    routing_config: Option<PathBuf>,
    #[command(flatten)]
    front_door: FrontDoor,
    #[command(flatten)]
    serving: ServingSettings,
}

#[derive(Clone, Copy, ValueEnum)]
enum PolicyName {
    /// Cached prefix first, then load; the ring owner for prefixes no node holds.
    CacheAware,
    RoundRobin,
    LeastLoaded,
}

/// A node that sends nothing for this long (not even a keep-alive) is taken for dead and its
/// streams fail over: a hung node is noticed within it.
const NODE_IDLE_TIMEOUT: Duration = Duration::from_secs(5);
const NODE_KEEP_ALIVE: Duration = Duration::from_secs(1);

/// The identity a router presents, to nodes and to the topology group.
struct RouterIdentity {
    live: Arc<LiveIdentity>,
    kind: IdentityKind,
    /// Where its files are.
    dir: PathBuf,
}

/// The identity in `dir`: an operator's (`strata cluster operator`), or a member's (its data
/// directory, or the directory holding `member.pem`).
fn router_identity(dir: &Path) -> Result<RouterIdentity> {
    match OperatorIdentity::load(dir) {
        Ok(id) => Ok(RouterIdentity {
            live: id.live()?,
            kind: IdentityKind::Operator,
            dir: dir.to_path_buf(),
        }),
        Err(operator) => {
            let at = super::node::member_tls_dir(dir);
            let id = super::node::member_identity(dir).with_context(|| {
                format!(
                    "{}: not an operator identity either ({operator})",
                    dir.display()
                )
            })?;
            Ok(RouterIdentity {
                live: id.live()?,
                kind: IdentityKind::Member,
                dir: at,
            })
        }
    }
}

/// A TLS client configuration for the node ALPN presenting `identity`.
pub fn node_client_config(identity: &Arc<LiveIdentity>) -> Result<quinn::ClientConfig> {
    let mut config = live_client_config(identity, ALPN)?;
    set_liveness(&mut config, NODE_IDLE_TIMEOUT, NODE_KEEP_ALIVE);
    Ok(config)
}

/// A topology client presenting `identity`.
fn topology_client(identity: &Arc<LiveIdentity>) -> Result<Client> {
    let local = SocketAddr::new(IpAddr::V4(Ipv4Addr::UNSPECIFIED), 0);
    Ok(Client::new(
        live_client_endpoint(identity, local)?,
        TOPOLOGY_TIMEOUT,
    ))
}

/// The group's state once at least one member serves `model`.
async fn serving_state_now(client: &Client, seeds: &[String], model: &str) -> Result<ClusterState> {
    let mut told = false;
    loop {
        match watcher::read_state(client, seeds).await {
            Ok(state) => {
                if !watcher::serving_nodes(&state, model).is_empty() {
                    return Ok(state);
                }
                if !told {
                    tracing::info!(
                        "waiting for a member of the group to serve (strata node serve --data)"
                    );
                    told = true;
                }
            }
            Err(e) => tracing::warn!("reading the topology group: {e}"),
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
}

/// The placement policy `args` ask for and the cross-node fetch settings (the routing config
/// file's, off unless allowed).
fn routing(args: &RouterArgs) -> Result<(Policy, KvFetchConfig)> {
    let mut settings = match &args.routing_config {
        None => RoutingSettings::default(),
        Some(path) => {
            let text = std::fs::read_to_string(path)
                .with_context(|| format!("{}: reading the routing config", path.display()))?;
            RoutingSettings::from_toml(&text)
                .map_err(anyhow::Error::msg)
                .with_context(|| format!("{}: not a routing config", path.display()))?
        }
    };
    settings.kv_fetch.enabled &= args.kv_fetch;
    let policy = match args.policy {
        PolicyName::CacheAware => Policy::CacheAware(settings.cache_aware),
        PolicyName::RoundRobin => Policy::RoundRobin,
        PolicyName::LeastLoaded => Policy::LeastLoaded,
    };
    Ok((policy, settings.kv_fetch))
}

pub fn run(args: RouterArgs) -> Result<()> {
    let (policy, kv_fetch) = routing(&args)?;
    if args.nodes.is_empty() && args.cluster.is_empty() {
        bail!("give the nodes (--nodes) or the topology group to find them in (--cluster)");
    }
    let (config, mut parts, eos) = front_door_parts(&args.model)
        .with_context(|| format!("{}: reading the model", args.model.display()))?;
    let grammar = grammar_compiler(&parts.tokenizer, config.vocab_size, &eos);
    // The checkpoint's name finds the nodes serving it in the group; clients may know the
    // model by others (--served-model-name).
    let name = args
        .model
        .canonicalize()
        .unwrap_or_else(|_| args.model.clone())
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .with_context(|| format!("{}: cannot name the model", args.model.display()))?;
    let (served_name, options) = args.serving.presentation(name.clone())?;
    options.context_window(config.max_position_embeddings)?;
    if let Some(template) = options.chat_template(&args.model)? {
        parts.template = Some(template);
    }
    let identity = router_identity(&args.identity)?;
    let client = node_client_config(&identity.live)?;
    let keys = match &args.front_door.keys_file {
        Some(path) => KeyStore::load(path)?,
        None => KeyStore::default(),
    };
    let limits = args.front_door.limits()?;
    let access = args.serving.access(keys, limits)?;
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .context("starting the async runtime")?;
    runtime.block_on(async move {
        let signals = StopSignals::install()?;
        let mut endpoint =
            quinn::Endpoint::client(SocketAddr::new(IpAddr::V4(Ipv4Addr::UNSPECIFIED), 0))
                .context("opening the QUIC endpoint")?;
        endpoint.set_default_client_config(client);
        let topology = if args.cluster.is_empty() {
            None
        } else {
            Some(topology_client(&identity.live)?)
        };
        // An operator certificate is renewed through the group it follows; a member's by its
        // member (taken up here once its files change).
        let renewer = match (&topology, identity.kind) {
            (Some(topology), IdentityKind::Operator) => {
                let members = args.cluster.clone();
                Some(Renewer {
                    client: topology.clone(),
                    members: Box::new(move || members.clone()),
                })
            }
            _ => None,
        };
        tokio::spawn(keep_identity(
            identity.dir.clone(),
            identity.kind,
            identity.live.clone(),
            renewer,
        ));
        let state = match &topology {
            None => None,
            Some(topology) => Some(serving_state_now(topology, &args.cluster, &name).await?),
        };
        let nodes = match &state {
            None => args.nodes.clone(),
            Some(state) => watcher::serving_nodes(state, &name)
                .iter()
                .map(|n| n.addr)
                .collect(),
        };
        let cluster = Cluster::connect(
            &endpoint,
            &nodes,
            SERVER_NAME,
            config,
            grammar,
            Router::new(policy),
            ClusterOptions {
                failover: args.failover,
                kv_fetch,
            },
        )
        .await?;
        if let (Some(topology), Some(state)) = (topology, state) {
            // The nodes take their places on the group's ring before the first request.
            watcher::sync(&cluster, &state, &name);
            tokio::spawn(watcher::follow(
                cluster.clone(),
                topology,
                args.cluster.clone(),
                name.clone(),
            ));
        }
        tracing::info!("routing over {} node(s)", nodes.len());
        let served = ServedModel::new(served_name, "strata".into(), cluster, parts);
        let state = std::sync::Arc::new(served.serving(&options)?);
        let drain_delay = args.front_door.drain_delay();
        let shutdown = stop_after_drain(signals, state.draining.clone(), drain_delay);
        let addr = args.front_door.addr();
        strata_router::serve_state(state, addr, access, args.front_door.keys_file, shutdown)
            .await?;
        Ok(())
    })
}
