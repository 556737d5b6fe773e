//! A member's configuration and the layout of its data directory.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use serde::{Deserialize, Serialize};

/// Everything a member process needs, typically read from `<data>/member.toml`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ServerConfig {
    pub data_dir: PathBuf,
    /// Where the member endpoint (raft and client RPCs, mutual TLS) listens.
    pub listen: SocketAddr,
    /// The address other members dial; `listen` when absent.
    #[serde(default)]
    pub advertise: Option<String>,
    /// Where the join endpoint listens, on the member that holds the CA key.
    #[serde(default)]
    pub join_listen: Option<SocketAddr>,
    /// How long the certificates this member issues stay valid, in seconds, where it holds the
    /// CA key (30 days when absent; at least 10 s).
    #[serde(default)]
    pub cert_lifetime_s: Option<u64>,
    #[serde(default)]
    pub timing: Timing,
}

/// Raft, lease and request timing, in milliseconds.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct Timing {
    pub raft_heartbeat_ms: u64,
    pub election_timeout_min_ms: u64,
    pub election_timeout_max_ms: u64,
    /// How often a member renews its own health lease.
    pub lease_renew_ms: u64,
    /// How often the leader's lease driver checks for expired leases.
    pub lease_check_ms: u64,
    /// The bound on one client call (connect, send, answer).
    pub rpc_timeout_ms: u64,
    /// How long a peer may take to send a whole request once it opened a stream; a stalled
    /// stream is refused and ended after this.
    pub read_timeout_ms: u64,
    /// Ask the voters before standing for election (`crate::election`); `false` stands as soon
    /// as the timeout passes, as raft without pre-vote does (etcd's `--pre-vote=false`): a
    /// member back from a pause or a partition then forces an election.
    pub pre_vote: bool,
}

impl Default for Timing {
    /// Loopback and LAN defaults: elections resolve in about a second, and a lease (3 s to
    /// suspect by default) is renewed three times before it runs out.
    fn default() -> Self {
        Self {
            raft_heartbeat_ms: 100,
            election_timeout_min_ms: 500,
            election_timeout_max_ms: 1_000,
            lease_renew_ms: 1_000,
            lease_check_ms: 500,
            rpc_timeout_ms: 3_000,
            // Far above what the largest frame (16 MiB) takes on a LAN, far below what lets a
            // stalled peer pin a member's tasks for long.
            read_timeout_ms: 10_000,
            pre_vote: true,
        }
    }
}

/// Bytes of snapshot per `InstallSnapshot` chunk. The wire carries a chunk as a JSON array of
/// numbers, up to four bytes per byte: a 1 MiB chunk stays far under the 16 MiB frame limit,
/// where openraft's 3 MiB default comes close to it.
pub const SNAPSHOT_CHUNK_BYTES: u64 = 1 << 20;

impl Timing {
    pub fn raft_config(&self, cluster_name: &str) -> Result<Arc<openraft::Config>, String> {
        let config = openraft::Config {
            cluster_name: cluster_name.to_string(),
            heartbeat_interval: self.raft_heartbeat_ms,
            election_timeout_min: self.election_timeout_min_ms,
            election_timeout_max: self.election_timeout_max_ms,
            // A snapshot chunk gets the RPC timeout like any raft RPC; openraft's default of
            // 200 ms is less than a multi-megabyte frame may take, and a chunk that always
            // times out is retried forever: the new member never catches up.
            install_snapshot_timeout: self.rpc_timeout_ms,
            snapshot_max_chunk_size: SNAPSHOT_CHUNK_BYTES,
            // Members stand for election through `crate::election`, after a pre-vote.
            enable_elect: false,
            ..openraft::Config::default()
        };
        config.validate().map(Arc::new).map_err(|e| e.to_string())
    }

    pub fn rpc_timeout(&self) -> Duration {
        Duration::from_millis(self.rpc_timeout_ms)
    }

    pub fn read_timeout(&self) -> Duration {
        Duration::from_millis(self.read_timeout_ms)
    }
}

impl ServerConfig {
    pub fn advertised(&self) -> String {
        self.advertise
            .clone()
            .unwrap_or_else(|| self.listen.to_string())
    }

    pub fn layout(&self) -> DataLayout {
        DataLayout::new(&self.data_dir)
    }

    /// Reads a TOML configuration file.
    pub fn load(path: &Path) -> Result<Self, String> {
        let text = std::fs::read_to_string(path).map_err(|e| format!("{}: {e}", path.display()))?;
        toml::from_str(&text).map_err(|e| format!("{}: {e}", path.display()))
    }

    /// Writes this configuration as TOML.
    pub fn save(&self, path: &Path) -> Result<(), String> {
        let text = toml::to_string_pretty(self).map_err(|e| e.to_string())?;
        std::fs::write(path, text).map_err(|e| format!("{}: {e}", path.display()))
    }
}

/// Where a member keeps things under its data directory.
#[derive(Debug, Clone)]
pub struct DataLayout {
    root: PathBuf,
}

impl DataLayout {
    pub fn new(root: &Path) -> Self {
        Self {
            root: root.to_path_buf(),
        }
    }

    pub fn root(&self) -> &Path {
        &self.root
    }

    /// The member's certificate, key and the CA certificate.
    pub fn tls_dir(&self) -> PathBuf {
        self.root.join("tls")
    }

    /// The CA certificate and key, on the member that made the CA.
    pub fn ca_dir(&self) -> PathBuf {
        self.root.join("ca")
    }

    pub fn store(&self) -> PathBuf {
        self.root.join("topology.redb")
    }

    pub fn config(&self) -> PathBuf {
        self.root.join("member.toml")
    }

    /// The join token `cluster init` writes for the operator to hand to joiners.
    pub fn join_token(&self) -> PathBuf {
        self.root.join("join-token")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_config_round_trips_through_toml_and_refuses_unknown_keys() {
        let config = ServerConfig {
            data_dir: "/var/lib/strata".into(),
            listen: "127.0.0.1:7400".parse().unwrap(),
            advertise: Some("node-a:7400".into()),
            join_listen: Some("127.0.0.1:7401".parse().unwrap()),
            cert_lifetime_s: Some(86_400),
            timing: Timing::default(),
        };
        let text = toml::to_string_pretty(&config).unwrap();
        assert_eq!(toml::from_str::<ServerConfig>(&text).unwrap(), config);
        let minimal: ServerConfig =
            toml::from_str("data_dir = \"/d\"\nlisten = \"127.0.0.1:1\"\n").unwrap();
        assert_eq!(minimal.timing, Timing::default());
        assert_eq!(minimal.advertised(), "127.0.0.1:1");
        assert!(
            toml::from_str::<ServerConfig>(
                "data_dir = \"/d\"\nlisten = \"127.0.0.1:1\"\nlisen = 1\n"
            )
            .is_err()
        );
        assert!(Timing::default().raft_config("t").is_ok());
        assert_eq!(Timing::default().read_timeout(), Duration::from_secs(10));
        let stricter: ServerConfig = toml::from_str(
            "data_dir = \"/d\"\nlisten = \"127.0.0.1:1\"\n[timing]\nread_timeout_ms = 500\n",
        )
        .unwrap();
        assert_eq!(stricter.timing.read_timeout(), Duration::from_millis(500));
        assert_eq!(
            stricter.timing.rpc_timeout(),
            Timing::default().rpc_timeout()
        );
    }
}
