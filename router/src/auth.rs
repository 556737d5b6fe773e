//! API keys: a JSON file holding only each key's SHA-256, its tenant and a short id; and the
//! middleware that turns `Authorization: Bearer <key>` (or Anthropic's `x-api-key`) into the
//! request's [`Tenant`]. The tenant's cache salt keeps its prefix cache apart from other tenants'.
//!
//! With no keys the server is open: every request runs as the anonymous tenant (salt 0). A key
//! given to the server itself ([`ApiKey`], vLLM's `--api-key`) closes it too; requests with that
//! key run as the anonymous tenant.
//!
//! A running server follows its keys file: [`KeysFileWatch`] polls it and swaps the
//! [`LiveKeys`] ring whole, so a revoked key stops working within the poll interval.

use std::fs;
use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::sync::{Arc, RwLock};
use std::time::{Duration, SystemTime};

use axum::extract::{Request, State};
use axum::http::{HeaderMap, StatusCode, header};
use axum::middleware::Next;
use axum::response::Response;
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

use crate::admission::refusal;

/// What every generated key starts with, so a leaked key is recognisable.
pub const KEY_PREFIX: &str = "sk-strata-";

#[derive(Debug, thiserror::Error)]
pub enum KeysError {
    #[error("{}: {source}", path.display())]
    Io {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("{}: not a strata keys file: {source}", path.display())]
    Parse {
        path: PathBuf,
        source: serde_json::Error,
    },
    #[error("the tenant name must be non-empty printable text without spaces; got {0:?}")]
    TenantName(String),
    #[error("no key with id `{0}`")]
    UnknownId(String),
    #[error("cannot read random bytes from /dev/urandom: {0}")]
    Random(std::io::Error),
    #[error("the API key must be non-empty printable text without spaces")]
    ApiKey,
}

/// A key given to the server itself (`--api-key`) rather than through the keys file: accepted
/// beside the file's keys for as long as the server runs, whatever the file says. Requests
/// presenting it run as the anonymous tenant (the one cache an open server shares), since the
/// key names no tenant. Only its hash is held.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ApiKey {
    sha256: [u8; 32],
}

impl ApiKey {
    /// The key as a client sends it. Surrounding or inner whitespace is refused: a presented key
    /// is trimmed, so such a key could never match.
    pub fn new(key: &str) -> Result<Self, KeysError> {
        if key.is_empty() || key.chars().any(|c| c.is_whitespace() || c.is_control()) {
            return Err(KeysError::ApiKey);
        }
        Ok(Self {
            sha256: Sha256::digest(key.as_bytes()).into(),
        })
    }
}

/// One stored key: never the key itself.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct KeyRecord {
    /// Short public id: the first characters of the key after [`KEY_PREFIX`].
    pub id: String,
    pub tenant: String,
    /// Hex SHA-256 of the whole key.
    pub sha256: String,
    /// Unix seconds.
    pub created: u64,
}

/// The keys file's contents.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct KeyStore {
    pub keys: Vec<KeyRecord>,
}

impl KeyStore {
    /// Reads `path`; a missing file is an empty store.
    pub fn load(path: &Path) -> Result<Self, KeysError> {
        let text = match fs::read_to_string(path) {
            Ok(text) => text,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Self::default()),
            Err(source) => {
                return Err(KeysError::Io {
                    path: path.to_path_buf(),
                    source,
                });
            }
        };
        serde_json::from_str(&text).map_err(|source| KeysError::Parse {
            path: path.to_path_buf(),
            source,
        })
    }

    /// Writes `path` atomically (a temporary file renamed over it), readable by the owner only.
    pub fn save(&self, path: &Path) -> Result<(), KeysError> {
        let io = |source| KeysError::Io {
            path: path.to_path_buf(),
            source,
        };
        if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
            fs::create_dir_all(dir).map_err(io)?;
        }
        let mut tmp = path.as_os_str().to_owned();
        tmp.push(".tmp");
        let tmp = PathBuf::from(tmp);
        let mut text = serde_json::to_string_pretty(self).map_err(|e| io(e.into()))?;
        text.push('\n');
        let mut options = fs::OpenOptions::new();
        options.write(true).create(true).truncate(true);
        #[cfg(unix)]
        std::os::unix::fs::OpenOptionsExt::mode(&mut options, 0o600);
        let mut file = options.open(&tmp).map_err(io)?;
        file.write_all(text.as_bytes()).map_err(io)?;
        file.sync_all().map_err(io)?;
        drop(file);
        fs::rename(&tmp, path).map_err(io)
    }

    /// Makes a key for `tenant`, stores its hash and returns the key (shown once).
    pub fn add(&mut self, tenant: &str, created: u64) -> Result<(KeyRecord, String), KeysError> {
        if tenant.is_empty() || tenant.chars().any(|c| c.is_whitespace() || c.is_control()) {
            return Err(KeysError::TenantName(tenant.to_string()));
        }
        loop {
            let mut random = [0u8; 32];
            fs::File::open("/dev/urandom")
                .and_then(|mut f| f.read_exact(&mut random))
                .map_err(KeysError::Random)?;
            let secret = hex(&random);
            let id = secret[..8].to_string();
            if self.keys.iter().any(|k| k.id == id) {
                continue;
            }
            let key = format!("{KEY_PREFIX}{secret}");
            let record = KeyRecord {
                id,
                tenant: tenant.to_string(),
                sha256: hex(&Sha256::digest(key.as_bytes())),
                created,
            };
            self.keys.push(record.clone());
            return Ok((record, key));
        }
    }

    pub fn revoke(&mut self, id: &str) -> Result<KeyRecord, KeysError> {
        let index = self
            .keys
            .iter()
            .position(|k| k.id == id)
            .ok_or_else(|| KeysError::UnknownId(id.to_string()))?;
        Ok(self.keys.remove(index))
    }
}

/// Who a request runs as.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Tenant {
    pub name: Arc<str>,
    /// Salts every KV block hash of this tenant's requests.
    pub cache_salt: u64,
}

impl Tenant {
    /// The tenant of an open server: salt 0, shared by every client.
    pub fn anonymous() -> Self {
        Self {
            name: Arc::from(""),
            cache_salt: 0,
        }
    }

    /// Stable across restarts: the first 8 bytes of SHA-256("strata-tenant:" + name).
    pub fn named(name: &str) -> Self {
        let digest = Sha256::digest(format!("strata-tenant:{name}").as_bytes());
        let mut salt = [0u8; 8];
        salt.copy_from_slice(&digest[..8]);
        Self {
            name: Arc::from(name),
            cache_salt: u64::from_le_bytes(salt),
        }
    }
}

/// The keys a running server accepts, as raw hashes.
#[derive(Debug)]
pub struct KeyRing {
    keys: Vec<([u8; 32], Tenant)>,
    /// The hash of the server's own key ([`ApiKey`]), kept across reloads of the file.
    api_key: Option<[u8; 32]>,
    /// Every client is accepted. Only a server that started without keys is open, and it
    /// stays open only while it has none: revoking keys never opens a server.
    open: bool,
}

impl Default for KeyRing {
    fn default() -> Self {
        Self::new(&KeyStore::default())
    }
}

impl KeyRing {
    /// Records with a malformed hash are skipped: they could never match. No usable key = open.
    pub fn new(store: &KeyStore) -> Self {
        let keys = Self::parse(store);
        let open = keys.is_empty();
        Self {
            keys,
            api_key: None,
            open,
        }
    }

    /// The ring accepting `key` too; a server with its own key is never open.
    pub fn with_api_key(mut self, key: Option<&ApiKey>) -> Self {
        self.api_key = key.map(|k| k.sha256);
        self.open &= self.api_key.is_none();
        self
    }

    /// The ring after the keys file changed under a running server whose ring was `previous`:
    /// open only if it was open and still has no keys. A closed server whose last key is
    /// revoked refuses everyone until a key is added.
    pub fn reloaded(store: &KeyStore, previous: &KeyRing) -> Self {
        let keys = Self::parse(store);
        let open = previous.open && keys.is_empty();
        Self {
            keys,
            api_key: previous.api_key,
            open,
        }
    }

    fn parse(store: &KeyStore) -> Vec<([u8; 32], Tenant)> {
        store
            .keys
            .iter()
            .filter_map(|k| Some((unhex32(&k.sha256)?, Tenant::named(&k.tenant))))
            .collect()
    }

    pub fn is_open(&self) -> bool {
        self.open
    }

    pub fn len(&self) -> usize {
        self.keys.len()
    }

    pub fn is_empty(&self) -> bool {
        self.keys.is_empty()
    }

    /// Closed with no key to open it: every request is refused.
    pub fn refuses_everyone(&self) -> bool {
        !self.open && self.keys.is_empty() && self.api_key.is_none()
    }

    /// The tenant of `key`. Every stored hash is compared in constant time, with no early exit.
    pub fn tenant(&self, key: &str) -> Option<Tenant> {
        let digest: [u8; 32] = Sha256::digest(key.as_bytes()).into();
        let mut found = None;
        for (hash, tenant) in &self.keys {
            if constant_time_eq(hash, &digest) {
                found = Some(tenant.clone());
            }
        }
        let server_key = self
            .api_key
            .is_some_and(|hash| constant_time_eq(&hash, &digest));
        match found {
            None if server_key => Some(Tenant::anonymous()),
            found => found,
        }
    }
}

/// The ring in force, replaced whole when the keys file changes: a request sees either the old
/// keys or the new ones, never a mix. The lock is held only to clone the `Arc`.
#[derive(Debug, Default)]
pub struct LiveKeys {
    ring: RwLock<Arc<KeyRing>>,
}

impl LiveKeys {
    pub fn new(ring: KeyRing) -> Self {
        Self {
            ring: RwLock::new(Arc::new(ring)),
        }
    }

    pub fn current(&self) -> Arc<KeyRing> {
        self.ring.read().unwrap_or_else(|e| e.into_inner()).clone()
    }

    pub fn replace(&self, ring: KeyRing) {
        *self.ring.write().unwrap_or_else(|e| e.into_inner()) = Arc::new(ring);
    }
}

/// What is compared between polls: a rewrite (`strata keys` renames a new file over the old)
/// changes the inode, an edit in place the modification time or the length.
#[derive(Debug, Clone, PartialEq, Eq)]
struct FileStamp {
    modified: Option<SystemTime>,
    len: u64,
    inode: u64,
}

impl FileStamp {
    /// `None` when the file cannot be examined (absent, most often).
    fn of(path: &Path) -> Option<Self> {
        let meta = fs::metadata(path).ok()?;
        #[cfg(unix)]
        let inode = std::os::unix::fs::MetadataExt::ino(&meta);
        #[cfg(not(unix))]
        let inode = 0;
        Some(Self {
            modified: meta.modified().ok(),
            len: meta.len(),
            inode,
        })
    }
}

/// Follows one keys file for a running server.
#[derive(Debug)]
pub struct KeysFileWatch {
    path: PathBuf,
    live: Arc<LiveKeys>,
    /// The store behind the ring in force.
    store: KeyStore,
    /// `None` before the first poll, so the first poll rereads the file: it may have changed
    /// between the server's start and the watch's.
    stamp: Option<Option<FileStamp>>,
}

impl KeysFileWatch {
    /// `store` is what `live` was built from.
    pub fn new(path: PathBuf, store: KeyStore, live: Arc<LiveKeys>) -> Self {
        Self {
            path,
            live,
            store,
            stamp: None,
        }
    }

    /// Looks at the file once; rereads it when it changed. A file that cannot be read or parsed
    /// leaves the keys in force (and is logged); so does a file that disappears, since losing
    /// the file must not open the server.
    pub fn poll(&mut self) {
        let stamp = FileStamp::of(&self.path);
        if self.stamp.as_ref() == Some(&stamp) {
            return;
        }
        self.stamp = Some(stamp.clone());
        let path = self.path.display();
        if stamp.is_none() {
            if !self.store.keys.is_empty() {
                tracing::warn!(
                    "keys file {path} is gone; keeping the {} keys in force",
                    self.store.keys.len()
                );
            }
            return;
        }
        let store = match KeyStore::load(&self.path) {
            Ok(store) => store,
            Err(e) => {
                tracing::error!("keys file not reloaded, the keys in force stay: {e}");
                return;
            }
        };
        if store == self.store {
            return;
        }
        let ring = KeyRing::reloaded(&store, &self.live.current());
        if ring.refuses_everyone() {
            tracing::warn!(
                "keys file {path} holds no keys: every request is refused until one is added"
            );
        } else {
            tracing::info!("keys file {path} reloaded: {} keys", ring.len());
        }
        self.live.replace(ring);
        self.store = store;
    }

    /// Polls every `interval`, forever (the task ends with the runtime).
    pub async fn run(mut self, interval: Duration) {
        let mut ticks = tokio::time::interval(interval);
        ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            ticks.tick().await;
            self.poll();
        }
    }
}

/// Paths anyone may read: liveness, readiness, metrics, the API description, and the
/// dashboard (which shows what /metrics does, and plans from shipped profiles).
fn is_public(path: &str) -> bool {
    matches!(
        path,
        "/health" | "/ping" | "/ready" | "/metrics" | "/openapi.json"
    ) || path == "/dashboard"
        || path.starts_with("/dashboard/")
}

/// The key a client presented: `Authorization: Bearer <key>` or `x-api-key: <key>`.
fn presented_key(headers: &HeaderMap) -> Option<&str> {
    let bearer = headers
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| {
            v.strip_prefix("Bearer ")
                .or_else(|| v.strip_prefix("bearer "))
        });
    bearer
        .or_else(|| headers.get("x-api-key").and_then(|v| v.to_str().ok()))
        .map(str::trim)
}

/// Middleware: sets the request's [`Tenant`] or answers 401 in the surface's error shape.
pub async fn require_key(
    State(live): State<Arc<LiveKeys>>,
    mut request: Request,
    next: Next,
) -> Response {
    let ring = live.current();
    let tenant = if ring.is_open() || is_public(request.uri().path()) {
        Ok(Tenant::anonymous())
    } else {
        match presented_key(request.headers()) {
            None => {
                Err("missing API key: send `Authorization: Bearer <key>` (or `x-api-key: <key>`)")
            }
            Some(key) => ring.tenant(key).ok_or("invalid API key"),
        }
    };
    match tenant {
        Ok(tenant) => {
            if !tenant.name.is_empty() {
                tracing::Span::current().record("tenant", &*tenant.name);
            }
            request.extensions_mut().insert(tenant);
            next.run(request).await
        }
        Err(message) => refusal(
            request.uri().path(),
            StatusCode::UNAUTHORIZED,
            "authentication_error",
            Some("invalid_api_key"),
            message,
        ),
    }
}

fn constant_time_eq(a: &[u8; 32], b: &[u8; 32]) -> bool {
    let diff = a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y));
    std::hint::black_box(diff) == 0
}

fn hex(bytes: &[u8]) -> String {
    const DIGITS: &[u8; 16] = b"0123456789abcdef";
    let mut out = String::with_capacity(bytes.len() * 2);
    for &b in bytes {
        out.push(DIGITS[usize::from(b >> 4)] as char);
        out.push(DIGITS[usize::from(b & 15)] as char);
    }
    out
}

fn unhex32(text: &str) -> Option<[u8; 32]> {
    let bytes = text.as_bytes();
    if bytes.len() != 64 {
        return None;
    }
    let nibble = |c: u8| (c as char).to_digit(16).map(|d| d as u8);
    let mut out = [0u8; 32];
    for (i, pair) in bytes.chunks_exact(2).enumerate() {
        out[i] = nibble(pair[0])? << 4 | nibble(pair[1])?;
    }
    Some(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_key_maps_to_its_tenant_and_only_its_hash_is_stored() {
        let mut store = KeyStore::default();
        let (record, key) = store.add("acme", 1).unwrap();
        assert!(key.starts_with(KEY_PREFIX) && key.len() == KEY_PREFIX.len() + 64);
        assert!(key[KEY_PREFIX.len()..].starts_with(&record.id));
        let text = serde_json::to_string(&store).unwrap();
        assert!(!text.contains(&key[KEY_PREFIX.len()..]), "{text}");
        let ring = KeyRing::new(&store);
        assert_eq!(ring.tenant(&key), Some(Tenant::named("acme")));
        assert_eq!(ring.tenant("sk-strata-wrong"), None);
    }

    #[test]
    fn tenants_get_distinct_stable_salts() {
        assert_eq!(Tenant::named("a"), Tenant::named("a"));
        assert_ne!(Tenant::named("a").cache_salt, Tenant::named("b").cache_salt);
        assert_ne!(Tenant::named("a").cache_salt, 0);
    }

    #[test]
    fn revoking_an_unknown_id_is_an_error() {
        let mut store = KeyStore::default();
        let (record, _) = store.add("acme", 1).unwrap();
        assert!(store.revoke("nope").is_err());
        assert_eq!(store.revoke(&record.id).unwrap(), record);
        assert!(store.keys.is_empty());
    }

    #[test]
    fn save_and_load_round_trip() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("sub/keys.json");
        let mut store = KeyStore::default();
        store.add("acme", 7).unwrap();
        store.save(&path).unwrap();
        assert_eq!(KeyStore::load(&path).unwrap(), store);
        #[cfg(unix)]
        {
            use std::os::unix::fs::PermissionsExt;
            let mode = fs::metadata(&path).unwrap().permissions().mode();
            assert_eq!(mode & 0o777, 0o600);
        }
        assert_eq!(
            KeyStore::load(&dir.path().join("absent")).unwrap(),
            KeyStore::default()
        );
    }

    /// A watch over a fresh keys file holding one key of `acme`; returns it with the key.
    fn watched(dir: &Path) -> (KeysFileWatch, Arc<LiveKeys>, KeyStore, String) {
        let path = dir.join("keys.json");
        let mut store = KeyStore::default();
        let (_, key) = store.add("acme", 1).unwrap();
        store.save(&path).unwrap();
        let live = Arc::new(LiveKeys::new(KeyRing::new(&store)));
        let watch = KeysFileWatch::new(path, store.clone(), live.clone());
        (watch, live, store, key)
    }

    #[test]
    fn a_revoked_key_stops_working_after_a_poll() {
        let dir = tempfile::tempdir().unwrap();
        let (mut watch, live, mut store, key) = watched(dir.path());
        watch.poll();
        let (_, other) = store.add("beta", 2).unwrap();
        let first = store.keys[0].id.clone();
        store.revoke(&first).unwrap();
        store.save(&watch.path).unwrap();
        assert!(live.current().tenant(&key).is_some(), "not polled yet");
        watch.poll();
        assert_eq!(live.current().tenant(&key), None);
        assert_eq!(live.current().tenant(&other), Some(Tenant::named("beta")));
    }

    #[test]
    fn a_broken_or_vanished_file_keeps_the_keys_in_force() {
        let dir = tempfile::tempdir().unwrap();
        let (mut watch, live, _, key) = watched(dir.path());
        fs::write(&watch.path, "{not json").unwrap();
        watch.poll();
        assert!(live.current().tenant(&key).is_some());
        fs::remove_file(&watch.path).unwrap();
        watch.poll();
        assert!(live.current().tenant(&key).is_some());
        assert!(!live.current().is_open());
    }

    #[test]
    fn revoking_the_last_key_refuses_everyone_rather_than_opening() {
        let dir = tempfile::tempdir().unwrap();
        let (mut watch, live, mut store, key) = watched(dir.path());
        let id = store.keys[0].id.clone();
        store.revoke(&id).unwrap();
        store.save(&watch.path).unwrap();
        watch.poll();
        let ring = live.current();
        assert!(!ring.is_open() && ring.is_empty());
        assert_eq!(ring.tenant(&key), None);
    }

    #[test]
    fn the_servers_own_key_closes_it_and_outlives_reloads() {
        let dir = tempfile::tempdir().unwrap();
        let own = ApiKey::new("vllm-style-key").unwrap();
        let ring = KeyRing::new(&KeyStore::default()).with_api_key(Some(&own));
        assert!(!ring.is_open() && !ring.refuses_everyone());
        assert_eq!(ring.tenant("vllm-style-key"), Some(Tenant::anonymous()));
        assert_eq!(ring.tenant("vllm-style-kez"), None);
        // A keys file written later adds its keys; the server's own key stays.
        let path = dir.path().join("keys.json");
        let live = Arc::new(LiveKeys::new(ring));
        let mut watch = KeysFileWatch::new(path.clone(), KeyStore::default(), live.clone());
        let mut store = KeyStore::default();
        let (_, key) = store.add("acme", 1).unwrap();
        store.save(&path).unwrap();
        watch.poll();
        let ring = live.current();
        assert_eq!(ring.tenant(&key), Some(Tenant::named("acme")));
        assert_eq!(ring.tenant("vllm-style-key"), Some(Tenant::anonymous()));
        for bad in ["", "two words", " padded"] {
            assert!(ApiKey::new(bad).is_err(), "{bad:?} was accepted");
        }
    }

    #[test]
    fn an_open_server_closes_when_its_first_key_is_added() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("keys.json");
        let live = Arc::new(LiveKeys::new(KeyRing::new(&KeyStore::default())));
        let mut watch = KeysFileWatch::new(path.clone(), KeyStore::default(), live.clone());
        watch.poll();
        assert!(live.current().is_open());
        let mut store = KeyStore::default();
        let (_, key) = store.add("acme", 1).unwrap();
        store.save(&path).unwrap();
        watch.poll();
        assert!(!live.current().is_open());
        assert!(live.current().tenant(&key).is_some());
    }
}
