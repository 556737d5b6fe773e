//! `strata router`: the HTTP surfaces in front of `strata node` processes, over QUIC with mutual
//! TLS, routing each request by cached prefix and load (DESIGN.md §2, §6).

use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::path::{Path, PathBuf};

use anyhow::{Context, Result, bail};
use clap::{Args, ValueEnum};
use strata_node::rpc::ALPN;
use strata_quic::tls::mutual_client_config;
use strata_router::admission::AdmissionLimits;
use strata_router::auth::KeyStore;
use strata_router::cluster::Cluster;
use strata_router::routing::{Policy, Router, RoutingConfig};
use strata_router::{Access, ServedModel, ServingParts, grammar_compiler};
use strata_topology::transport::OperatorIdentity;
use strata_topology::transport::ca::SERVER_NAME;

#[derive(Args)]
pub struct RouterArgs {
    /// Checkpoint directory of the model the nodes serve (its tokenizer, chat template and
    /// config.json are read; its weights are not).
    #[arg(long)]
    model: PathBuf,
    /// The nodes' RPC addresses (`strata node serve --listen`), comma-separated.
    #[arg(long, value_delimiter = ',', required = true)]
    nodes: Vec<SocketAddr>,
    /// Identity directory from the cluster CA: an operator's (`strata cluster operator`) or a
    /// member's data directory.
    #[arg(long)]
    identity: PathBuf,
    /// How requests are spread over the nodes.
    #[arg(long, value_enum, default_value_t = PolicyName::CacheAware)]
    policy: PolicyName,
    /// Listening address.
    #[arg(long, default_value_t = IpAddr::V4(Ipv4Addr::LOCALHOST))]
    host: IpAddr,
    /// Listening port; 0 picks a free one (the address is printed).
    #[arg(long, default_value_t = 8080)]
    port: u16,
    /// Continue a stream on another node when its node fails mid-stream (greedy streams come
    /// out byte-identical); `false` ends such a stream with an error.
    #[arg(long, default_value_t = true, action = clap::ArgAction::Set)]
    failover: bool,
    /// API keys (`strata keys add`); without the flag the router is open.
    #[arg(long)]
    keys_file: Option<PathBuf>,
}

#[derive(Clone, Copy, ValueEnum)]
enum PolicyName {
    /// Cached prefix first, then load; the ring owner for prefixes no node holds.
    CacheAware,
    RoundRobin,
    LeastLoaded,
}

/// A TLS client configuration for the node ALPN from the identity in `dir`.
pub fn node_client_config(dir: &Path) -> Result<quinn::ClientConfig> {
    let config = match OperatorIdentity::load(dir) {
        Ok(id) => mutual_client_config(id.chain(), ALPN)?,
        Err(operator) => {
            let id = super::node::member_identity(dir).with_context(|| {
                format!(
                    "{}: not an operator identity either ({operator})",
                    dir.display()
                )
            })?;
            mutual_client_config(id.chain(), ALPN)?
        }
    };
    Ok(config)
}

pub fn run(args: RouterArgs) -> Result<()> {
    let policy = match args.policy {
        PolicyName::CacheAware => Policy::CacheAware(RoutingConfig::default()),
        PolicyName::RoundRobin => Policy::RoundRobin,
        PolicyName::LeastLoaded => Policy::LeastLoaded,
    };
    if args.nodes.is_empty() {
        bail!("--nodes names no node");
    }
    let (config, parts, eos) = ServingParts::from_dir(&args.model)
        .with_context(|| format!("{}: reading the model", args.model.display()))?;
    let grammar = grammar_compiler(&parts.tokenizer, config.vocab_size, &eos);
    let client = node_client_config(&args.identity)?;
    let name = args
        .model
        .canonicalize()
        .unwrap_or_else(|_| args.model.clone())
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .with_context(|| format!("{}: cannot name the model", args.model.display()))?;
    let keys = match &args.keys_file {
        Some(path) => KeyStore::load(path)?,
        None => KeyStore::default(),
    };
    let access = Access {
        keys,
        limits: AdmissionLimits::default(),
    };
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .context("starting the async runtime")?;
    runtime.block_on(async move {
        let shutdown = strata_router::shutdown_signal()?;
        let mut endpoint =
            quinn::Endpoint::client(SocketAddr::new(IpAddr::V4(Ipv4Addr::UNSPECIFIED), 0))
                .context("opening the QUIC endpoint")?;
        endpoint.set_default_client_config(client);
        let cluster = Cluster::connect(
            &endpoint,
            &args.nodes,
            SERVER_NAME,
            config,
            grammar,
            Router::new(policy),
            args.failover,
        )
        .await?;
        tracing::info!("routing over {} node(s)", args.nodes.len());
        let state = std::sync::Arc::new(ServedModel::new(name, "strata".into(), cluster, parts));
        let addr = SocketAddr::new(args.host, args.port);
        strata_router::serve_state(state, addr, access, args.keys_file, shutdown).await?;
        Ok(())
    })
}
