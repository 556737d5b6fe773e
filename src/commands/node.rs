//! `strata node inspect`: this machine's GPUs and the links between them, and the GPU pairs a
//! TP = 2 group should take (NVLink first, then PCIe peer-to-peer). `strata node serve`: the
//! engine behind the node RPC service (QUIC, mutual TLS from the cluster CA), for routers.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context, Result};
use clap::{Args, Subcommand};
use serde_json::{Value, json};
use strata_collective::inventory::{
    Inventory, InventoryError, LinkKind, inspect, suggest_tp_pairs,
};
use strata_node::rpc::{ALPN, NodeService, PeerCheck, Peers};
use strata_quic::LiveIdentity;
use strata_quic::tls::{live_client_config, live_server_config};

use super::engine_args::EngineSettings;
use strata_node::{Device, start_engine};
use strata_topology::lease_driver::{Clock, SystemClock};
use strata_topology::server::{DataLayout, ServerConfig, shutdown_signal};
use strata_topology::state::{Change, Command, Gpu, Revoked};
use strata_topology::transport::ca::{MEMBER_CERT_FILE, SERVER_NAME};
use strata_topology::transport::renew::{IdentityKind, keep_identity};
use strata_topology::transport::{
    Client, MemberIdentity, Principal, client_endpoint, live_client_endpoint,
};

#[derive(Subcommand)]
pub enum NodeCommand {
    /// List the GPUs (memory, compute capability, PCI bus id) and the peer link between every
    /// pair. Without an NVIDIA driver it says so and lists 0 GPUs.
    Inspect {
        /// Print JSON instead of tables.
        #[arg(long)]
        json: bool,
    },
    /// Serve a model's engine to routers over QUIC (mutual TLS with the cluster CA).
    Serve(Box<NodeServeArgs>),
}

#[derive(Args)]
pub struct NodeServeArgs {
    /// Checkpoint directory (HF layout).
    #[arg(long)]
    model: PathBuf,
    /// Address of the RPC endpoint (UDP); port 0 picks a free one (the address is printed).
    #[arg(long, default_value = "127.0.0.1:7070")]
    listen: SocketAddr,
    /// The node's certificate from the cluster CA: a member's data directory (`strata cluster
    /// init|join --data`), or a directory holding `ca.pem`, `member.pem` and `member.key`.
    #[arg(long, required_unless_present = "data")]
    identity: Option<PathBuf>,
    /// The data directory of the topology member this node serves beside: its identity is
    /// the node's, and the node declares its RPC address in the member's record, so that
    /// routers following the group (`strata router --cluster`) find it.
    #[arg(long, conflicts_with = "identity")]
    data: Option<PathBuf>,
    /// The RPC address routers dial; default: --listen (with the port it got), or where it
    /// listens on every interface (0.0.0.0), that port at its member's host.
    #[arg(long)]
    advertise: Option<SocketAddr>,
    #[command(flatten)]
    engine: EngineSettings,
    /// How long importing a prompt's cached blocks from another node may take (when a
    /// router asks for it) before the request computes them instead, in milliseconds.
    #[arg(long, default_value_t = 2000)]
    kv_fetch_timeout_ms: u64,
    /// Generate requests this node holds at once, running and waiting in its engine; more are
    /// refused as busy, and routers send them to another node or retry later. Default: four
    /// times the engine's running sequences (`--max-running`).
    #[arg(long)]
    max_requests: Option<usize>,
    /// On SIGTERM or ctrl-c: how long the node lets its requests in flight finish (new ones
    /// are refused as busy, so routers place them elsewhere) before it parks its cached KV on
    /// the disk tier and exits, in seconds.
    #[arg(long, default_value_t = 30)]
    drain_timeout_s: u64,
}

pub fn run(command: NodeCommand) -> Result<()> {
    match command {
        NodeCommand::Inspect { json } => inspect_node(json),
        NodeCommand::Serve(args) => {
            let NodeServeArgs {
                model,
                listen,
                identity,
                data,
                advertise,
                engine,
                kv_fetch_timeout_ms,
                max_requests,
                drain_timeout_s,
            } = *args;
            let spec = engine.spec()?;
            let max_requests = match max_requests {
                Some(0) => anyhow::bail!("--max-requests must be at least 1"),
                Some(n) => n,
                None => 4 * spec.limits.max_running,
            };
            let (device, tp) = (spec.device, spec.tp);
            let (identity, identity_dir) = match (&identity, &data) {
                (Some(dir), _) => (member_identity(dir)?, dir.as_path()),
                // A member still joining gets its certificate in a moment.
                (None, Some(dir)) => (wait_for_identity(dir)?, dir.as_path()),
                (None, None) => anyhow::bail!("give --identity or --data"),
            };
            let (engine, _) = start_engine(&model, &spec)
                .with_context(|| format!("{}: starting the engine", model.display()))?;
            // The member beside this node renews the certificate they share; the node presents
            // the renewed one once its files change.
            let live = identity.live()?;
            let tls_dir = member_tls_dir(identity_dir);
            let server = live_server_config(&live, ALPN)?;
            // Nodes dial each other with the same certificate to fetch KV blocks.
            let peer_client = live_client_config(&live, ALPN)?;
            let runtime = tokio::runtime::Builder::new_multi_thread()
                .enable_all()
                .build()
                .context("starting the async runtime")?;
            runtime.block_on(async move {
                tokio::spawn(keep_identity(
                    tls_dir,
                    IdentityKind::Member,
                    live.clone(),
                    None,
                ));
                let mut endpoint = quinn::Endpoint::server(server, listen)
                    .with_context(|| format!("cannot listen on {listen}"))?;
                endpoint.set_default_client_config(peer_client);
                let addr = endpoint.local_addr()?;
                let peers = Peers::new(
                    endpoint.clone(),
                    SERVER_NAME,
                    Duration::from_millis(kv_fetch_timeout_ms),
                );
                let mut service = NodeService::new(Arc::new(engine), tp)
                    .with_peers(peers)
                    .with_max_calls(max_requests);
                if let Some(data) = &data {
                    let revoked = Arc::new(std::sync::RwLock::new(Revoked::default()));
                    tokio::spawn(follow_revocations(
                        data.clone(),
                        live.clone(),
                        revoked.clone(),
                    ));
                    service = service.with_peer_check(revocation_check(revoked));
                }
                let service = Arc::new(service);
                tracing::info!(
                    "node serving `{}` on quic://{addr} ({} KV blocks of {} tokens, tp {tp})",
                    model.display(),
                    service.info().capacity_blocks,
                    service.info().block_size
                );
                if let Some(data) = data {
                    let rpc = declared_address(addr, advertise, &data)?;
                    let blocks = service.info().capacity_blocks as u64;
                    let gpus = engine_gpus(device, tp);
                    tokio::spawn(async move {
                        match declare(&data, &identity, rpc, blocks, gpus).await {
                            Ok(()) => tracing::info!("declared to the topology group as {rpc}"),
                            Err(e) => tracing::error!("declaring to the topology group: {e:#}"),
                        }
                    });
                }
                let serving =
                    tokio::spawn(strata_node::rpc::serve(endpoint.clone(), service.clone()));
                tokio::select! {
                    _ = serving => {}
                    () = shutdown_signal() => {
                        drain(&service, Duration::from_secs(drain_timeout_s)).await;
                        endpoint.close(0u32.into(), b"node shutting down");
                        let _ = tokio::time::timeout(Duration::from_secs(2), endpoint.wait_idle())
                            .await;
                    }
                }
                Ok(())
            })
        }
    }
}

/// A node told to stop: refuses new requests as busy (routers place them elsewhere), lets those
/// in flight finish for up to `limit`, then parks its cached KV on the disk tier (when it has
/// one) so that it serves them again once restarted.
async fn drain(service: &Arc<NodeService>, limit: Duration) {
    service.drain();
    tracing::info!(
        in_flight = service.calls_held(),
        "stopping: new requests are refused as busy; letting those in flight finish"
    );
    let deadline = tokio::time::Instant::now() + limit;
    while service.calls_held() > 0 && tokio::time::Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    if service.calls_held() > 0 {
        tracing::warn!(
            in_flight = service.calls_held(),
            "stopping with requests in flight after {limit:?} (routers fail them over)"
        );
    }
    let engine = service.engine().clone();
    match tokio::task::spawn_blocking(move || engine.park_on_disk()).await {
        Ok(Ok(0)) => {}
        Ok(Ok(parked)) => tracing::info!(parked, "cached KV blocks parked on the disk tier"),
        Ok(Err(e)) => tracing::warn!("parking the cached KV: {e}"),
        Err(e) => tracing::warn!("parking the cached KV: {e}"),
    }
}

/// How often a node serving beside a member re-reads the group's revocations.
const REVOCATIONS_EVERY: Duration = Duration::from_secs(2);

/// Keeps `revoked` equal to the group's revocation list, read through the member in `data`
/// every [`REVOCATIONS_EVERY`] (a failed read keeps the last list).
async fn follow_revocations(
    data: PathBuf,
    identity: Arc<LiveIdentity>,
    revoked: Arc<std::sync::RwLock<Revoked>>,
) {
    let setup = || -> Result<(Client, String)> {
        let config =
            ServerConfig::load(&DataLayout::new(&data).config()).map_err(anyhow::Error::msg)?;
        let member = config
            .advertise
            .unwrap_or_else(|| config.listen.to_string());
        let local = SocketAddr::from(([0, 0, 0, 0], 0));
        let client = Client::new(
            live_client_endpoint(&identity, local)?,
            Duration::from_secs(5),
        );
        Ok((client, member))
    };
    let (client, member) = match setup() {
        Ok(found) => found,
        Err(e) => {
            tracing::error!("following the group's revocations: {e:#}");
            return;
        }
    };
    loop {
        match client.read(&member).await {
            Ok(view) => {
                let list = view.cluster.revoked().clone();
                if let Ok(mut held) = revoked.write() {
                    *held = list;
                }
            }
            Err(e) => tracing::debug!("reading the group's revocations from {member}: {e}"),
        }
        tokio::time::sleep(REVOCATIONS_EVERY).await;
    }
}

/// Refuses a caller whose certificate names a member or an operator in `revoked`.
fn revocation_check(revoked: Arc<std::sync::RwLock<Revoked>>) -> PeerCheck {
    Arc::new(move |leaf: &[u8]| {
        let principal = Principal::of(&quinn::rustls::pki_types::CertificateDer::from(
            leaf.to_vec(),
        ))?;
        let list = revoked.read().ok()?;
        let out = match &principal {
            Principal::Member(id) => list.members.contains(id),
            Principal::Operator(name) => list.operators.contains(name),
        };
        out.then(|| format!("the certificate of {principal} has been revoked"))
    })
}

/// How long a node keeps trying to declare itself to its member before giving up.
const DECLARE_TIMEOUT: Duration = Duration::from_secs(120);

/// The GPUs an engine on `device` with `tp` ranks runs on, as a member declares them: memory,
/// and a link group per NVLink island (GPUs joined by NVLink, directly or through each other,
/// share the smallest index among them). None on the CPU, or without a driver.
fn engine_gpus(device: Device, tp: usize) -> Vec<Gpu> {
    let Device::Cuda(first) = device else {
        return Vec::new();
    };
    let inventory = match inspect() {
        Ok(inventory) => inventory,
        Err(e) => {
            tracing::warn!("declaring no GPUs: {e}");
            return Vec::new();
        }
    };
    let used: Vec<usize> = (first..first + tp.max(1)).collect();
    let group = nvlink_islands(&inventory);
    inventory
        .gpus
        .iter()
        .filter(|g| used.contains(&g.index))
        .map(|g| Gpu {
            index: g.index as u32,
            memory_mib: g.memory_total >> 20,
            link_group: group[&g.index] as u32,
        })
        .collect()
}

/// Each GPU's NVLink island, named by its smallest index: each GPU's group is lowered to its
/// NVLink neighbours' until nothing changes.
fn nvlink_islands(inventory: &Inventory) -> std::collections::BTreeMap<usize, usize> {
    let mut group: std::collections::BTreeMap<usize, usize> =
        inventory.gpus.iter().map(|g| (g.index, g.index)).collect();
    loop {
        let mut changed = false;
        for link in inventory
            .links
            .iter()
            .filter(|l| l.kind == LinkKind::NvLink)
        {
            let (Some(&a), Some(&b)) = (group.get(&link.from), group.get(&link.to)) else {
                continue;
            };
            let low = a.min(b);
            for at in [link.from, link.to] {
                if group[&at] != low {
                    group.insert(at, low);
                    changed = true;
                }
            }
        }
        if !changed {
            return group;
        }
    }
}

/// Records `rpc`, the KV capacity and the engine's GPUs in the member's record through the
/// member in `data`, retrying while the member starts or the group elects a leader.
/// The RPC address this node declares in its member's record: `--advertise`, else the bound
/// address, else — bound to every interface (0.0.0.0 or ::) — the bound port at the host its
/// member is reached at (the member's advertised address resolved); an address no router could
/// dial is refused at start, naming `--advertise`.
fn declared_address(
    bound: SocketAddr,
    advertise: Option<SocketAddr>,
    data: &Path,
) -> Result<SocketAddr> {
    if let Some(advertise) = advertise {
        return Ok(advertise);
    }
    if !bound.ip().is_unspecified() {
        return Ok(bound);
    }
    let config = ServerConfig::load(&DataLayout::new(data).config()).map_err(anyhow::Error::msg)?;
    let member = config.advertised();
    let host = std::net::ToSocketAddrs::to_socket_addrs(member.as_str())
        .ok()
        .and_then(|mut found| found.find(|a| !a.ip().is_unspecified()));
    match host {
        Some(host) => Ok(SocketAddr::new(host.ip(), bound.port())),
        None => anyhow::bail!(
            "this node listens on every interface ({bound}) and its member's address {member} \
             names no host routers can dial: give --advertise IP:PORT"
        ),
    }
}

async fn declare(
    data: &Path,
    identity: &MemberIdentity,
    rpc: SocketAddr,
    kv_blocks: u64,
    gpus: Vec<Gpu>,
) -> Result<()> {
    let config = ServerConfig::load(&DataLayout::new(data).config()).map_err(anyhow::Error::msg)?;
    let member = config
        .advertise
        .unwrap_or_else(|| config.listen.to_string());
    let local = SocketAddr::from(([0, 0, 0, 0], 0));
    let client = Client::new(client_endpoint(identity, local)?, Duration::from_secs(5));
    let deadline = tokio::time::Instant::now() + DECLARE_TIMEOUT;
    loop {
        let attempt = async {
            let view = client.read(&member).await?;
            let mut spec = view
                .cluster
                .members()
                .get(&identity.id)
                .map(|m| m.spec.clone())
                .with_context(|| format!("member {} is not in the group", identity.id))?;
            spec.addresses.rpc = rpc.to_string();
            spec.capacity.kv_blocks = kv_blocks;
            spec.gpus = gpus.clone();
            let change = Change::UpdateMember(spec);
            let (_, outcome) = client
                .propose(&member, Command::new(SystemClock.now_ms(), change))
                .await?;
            outcome.map_err(|r| anyhow::anyhow!("the group refused the record: {r:?}"))?;
            anyhow::Ok(())
        };
        match attempt.await {
            Ok(()) => return Ok(()),
            Err(e) if tokio::time::Instant::now() >= deadline => return Err(e),
            Err(e) => tracing::debug!("declaring to member {member}: {e:#}"),
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
}

/// The identity of the member in the data directory `data`, waiting (up to
/// [`DECLARE_TIMEOUT`]) while the member is still joining and has no certificate yet.
fn wait_for_identity(data: &Path) -> Result<MemberIdentity> {
    let deadline = std::time::Instant::now() + DECLARE_TIMEOUT;
    let mut told = false;
    loop {
        match member_identity(data) {
            Ok(identity) => return Ok(identity),
            Err(e) if std::time::Instant::now() >= deadline => return Err(e),
            Err(_) => {
                if !told {
                    tracing::info!("waiting for the member in {} to join", data.display());
                    told = true;
                }
                std::thread::sleep(Duration::from_millis(200));
            }
        }
    }
}

/// Where the member identity named by `dir` lives: a member's data directory's `tls/`, or `dir`
/// itself holding `member.pem`.
pub fn member_tls_dir(dir: &Path) -> PathBuf {
    let tls = DataLayout::new(dir).tls_dir();
    if tls.join(MEMBER_CERT_FILE).exists() {
        tls
    } else {
        dir.to_path_buf()
    }
}

/// The member identity in `dir` ([`member_tls_dir`]).
pub fn member_identity(dir: &Path) -> Result<MemberIdentity> {
    MemberIdentity::load(&member_tls_dir(dir))
        .with_context(|| format!("{}: a member identity", dir.display()))
}

fn inspect_node(as_json: bool) -> Result<()> {
    let inventory = match inspect() {
        Ok(inventory) => inventory,
        // No driver is an answer, not a failure: this machine has no usable GPU.
        Err(e @ InventoryError::NoDriver { .. }) => {
            if as_json {
                let value = json!({"driver": Value::Null, "message": e.to_string(),
                                   "gpus": [], "links": [], "tp_pairs": []});
                println!("{}", serde_json::to_string_pretty(&value)?);
            } else {
                println!("{e}");
            }
            return Ok(());
        }
        Err(e) => return Err(e.into()),
    };
    if as_json {
        println!("{}", serde_json::to_string_pretty(&to_json(&inventory))?);
    } else {
        print_tables(&inventory);
    }
    Ok(())
}

fn gib(bytes: u64) -> f64 {
    bytes as f64 / (1u64 << 30) as f64
}

fn print_tables(inv: &Inventory) {
    println!(
        "CUDA driver {}.{}: {} GPU(s)",
        inv.driver_version / 1000,
        inv.driver_version % 1000 / 10,
        inv.gpus.len()
    );
    if inv.gpus.is_empty() {
        return;
    }
    println!(
        "{:>3}  {:<28} {:>10} {:>10} {:>4}  pci_bus_id",
        "gpu", "name", "total_GiB", "free_GiB", "cc"
    );
    for g in &inv.gpus {
        let free = g
            .memory_free
            .map_or_else(|| "?".to_string(), |f| format!("{:.1}", gib(f)));
        println!(
            "{:>3}  {:<28} {:>10.1} {:>10} {:>4}  {}",
            g.index,
            g.name,
            gib(g.memory_total),
            free,
            format!("{}.{}", g.compute_capability.0, g.compute_capability.1),
            g.pci_bus_id
        );
    }
    if inv.gpus.len() > 1 {
        println!(
            "\npeer links (row → column; * = P2P access supported; link inferred from P2P attributes):"
        );
        print!("{:>6}", "");
        for g in &inv.gpus {
            print!(" {:>8}", format!("gpu{}", g.index));
        }
        println!();
        for a in &inv.gpus {
            print!("{:>6}", format!("gpu{}", a.index));
            for b in &inv.gpus {
                let cell = match inv.link(a.index, b.index) {
                    None => "-".to_string(),
                    Some(l) => format!("{}{}", l.kind, if l.p2p_access { "*" } else { "" }),
                };
                print!(" {cell:>8}");
            }
            println!();
        }
    }
    let pairs = suggest_tp_pairs(inv);
    if pairs.is_empty() {
        println!("\nsuggested TP=2 pairs: none (no two GPUs with peer access)");
    } else {
        let listed: Vec<String> = pairs
            .iter()
            .map(|p| format!("{}+{} ({})", p.a, p.b, p.link))
            .collect();
        println!("\nsuggested TP=2 pairs: {}", listed.join(", "));
    }
}

fn to_json(inv: &Inventory) -> Value {
    let gpus: Vec<Value> = inv
        .gpus
        .iter()
        .map(|g| {
            json!({"index": g.index, "name": g.name, "memory_total_bytes": g.memory_total,
                   "memory_free_bytes": g.memory_free,
                   "compute_capability": format!("{}.{}", g.compute_capability.0,
                                                 g.compute_capability.1),
                   "pci_bus_id": g.pci_bus_id})
        })
        .collect();
    let links: Vec<Value> = inv
        .links
        .iter()
        .map(|l| {
            json!({"from": l.from, "to": l.to, "link": l.kind.as_str(),
                   "p2p_access": l.p2p_access, "native_atomics": l.native_atomics,
                   "performance_rank": l.performance_rank})
        })
        .collect();
    let pairs: Vec<Value> = suggest_tp_pairs(inv)
        .iter()
        .map(|p| json!({"gpus": [p.a, p.b], "link": p.link.as_str()}))
        .collect();
    json!({"driver": inv.driver_version, "gpus": gpus, "links": links, "tp_pairs": pairs,
           "link_source": "CUDA driver P2P attributes: access + native atomics = nvlink, \
                           access alone = pcie"})
}

#[cfg(test)]
mod tests {
    use strata_collective::inventory::{GpuInfo, PeerLink};

    use super::*;

    /// A node bound to every interface declares its port at its member's host; an explicit
    /// --advertise or a specific bound address is kept; a member that names no dialable host
    /// makes the node refuse, naming --advertise.
    #[test]
    fn a_node_on_every_interface_declares_its_members_host() {
        let tmp = tempfile::tempdir().unwrap();
        let member = |listen: &str, advertise: Option<&str>| {
            let config = ServerConfig {
                data_dir: tmp.path().to_path_buf(),
                listen: listen.parse().unwrap(),
                advertise: advertise.map(str::to_string),
                join_listen: None,
                cert_lifetime_s: None,
                timing: Default::default(),
            };
            config.save(&DataLayout::new(tmp.path()).config()).unwrap();
        };
        let any: SocketAddr = "0.0.0.0:7000".parse().unwrap();
        member("127.0.0.1:7400", None);
        assert_eq!(
            declared_address(any, None, tmp.path()).unwrap(),
            "127.0.0.1:7000".parse::<SocketAddr>().unwrap()
        );
        let given: SocketAddr = "10.1.2.3:9000".parse().unwrap();
        assert_eq!(
            declared_address(any, Some(given), tmp.path()).unwrap(),
            given
        );
        let bound: SocketAddr = "10.0.0.5:7000".parse().unwrap();
        assert_eq!(declared_address(bound, None, tmp.path()).unwrap(), bound);
        member("0.0.0.0:7400", Some("localhost:7400"));
        let got = declared_address(any, None, tmp.path()).unwrap();
        assert!(got.ip().is_loopback() && got.port() == 7000, "{got}");
        member("0.0.0.0:7400", None);
        let err = declared_address(any, None, tmp.path()).unwrap_err();
        assert!(err.to_string().contains("--advertise"), "{err}");
    }

    #[test]
    fn nvlink_islands_are_connected_components() {
        let gpu = |index| GpuInfo {
            index,
            name: "H200".into(),
            memory_total: 141 << 30,
            memory_free: None,
            compute_capability: (9, 0),
            pci_bus_id: String::new(),
        };
        let link = |from, to, kind| PeerLink {
            from,
            to,
            p2p_access: true,
            native_atomics: kind == LinkKind::NvLink,
            performance_rank: 0,
            kind,
        };
        // 3-1 and 1-0 over NVLink (a chain), 2 alone on PCIe, 4-5 a pair.
        let inventory = Inventory {
            driver_version: 13000,
            gpus: (0..6).map(gpu).collect(),
            links: vec![
                link(3, 1, LinkKind::NvLink),
                link(1, 0, LinkKind::NvLink),
                link(2, 0, LinkKind::Pcie),
                link(5, 4, LinkKind::NvLink),
            ],
        };
        let islands: Vec<usize> = nvlink_islands(&inventory).into_values().collect();
        assert_eq!(islands, vec![0, 0, 2, 0, 4, 4]);
    }
}
