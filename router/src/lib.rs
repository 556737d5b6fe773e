//! strata-router: the HTTP front door. Today it serves one model through an in-process engine
//! (`strata serve`) over the OpenAI, Anthropic and Bedrock Converse surfaces; see docs/SERVING.md.

pub mod admission;
pub mod anthropic;
pub mod auth;
pub mod body;
pub mod cluster;
pub mod converse;
pub mod cors;
pub mod dashboard;
pub mod drain;
pub mod error;
pub mod memory;
pub mod metrics;
pub mod openai;
pub mod openapi;
pub mod parking;
pub mod plan;
pub mod process_metrics;
pub mod request_id;
pub mod routing;
pub mod sampling;
pub mod serving;
pub mod serving_options;
pub mod state;
pub mod tools;
pub mod watcher;

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use axum::Router;
use axum::extract::DefaultBodyLimit;
use axum::middleware::from_fn_with_state;
use axum::routing::get;
use axum::serve::{ListenerExt, TapIo};
use tokio::net::{TcpListener, TcpStream};

use crate::admission::{Admission, AdmissionLimits};
use crate::auth::{ApiKey, KeyRing, KeyStore, KeysFileWatch, LiveKeys};
use crate::cors::AllowedOrigins;
use crate::drain::StopSignals;
use crate::error::ApiError;
use crate::request_id::RequestIds;
pub use crate::serving_options::{OptionsError, ServingOptions};
pub use crate::state::{AppState, EngineHandle, ServedModel};
use strata_engine_api::client::{StartEngine, StartError};
use strata_model::ModelConfig;

/// Everything `strata serve` needs to start.
#[derive(Debug, Clone)]
pub struct ServeConfig {
    /// Checkpoint directory (HF layout).
    pub model_dir: PathBuf,
    /// The name clients pass as `model`.
    pub model_name: String,
    /// `owned_by` in /v1/models.
    pub owned_by: String,
    pub addr: SocketAddr,
    /// How to start the engine (strata-node's `EngineSpec`: the router only calls it).
    pub engine: Arc<dyn StartEngine>,
    /// Aliases, a smaller context window, a chat template file.
    pub options: ServingOptions,
}

#[derive(Debug, thiserror::Error)]
pub enum ServeError {
    #[error("{}: {source}", path.display())]
    Model { path: PathBuf, source: StartError },
    #[error("cannot listen on {addr}: {source}")]
    Bind {
        addr: SocketAddr,
        source: std::io::Error,
    },
    #[error(transparent)]
    Options(#[from] OptionsError),
    #[error("server: {0}")]
    Io(#[from] std::io::Error),
}

/// Loads the checkpoint and starts its engine, presented as `config.options` say. The options
/// are checked first: a wrong one is reported at once, not after the weights have loaded.
pub fn load_state(config: &ServeConfig) -> Result<AppState, ServeError> {
    let model_err = |source| ServeError::Model {
        path: config.model_dir.clone(),
        source,
    };
    let options = &config.options;
    let template = options.chat_template(&config.model_dir)?;
    if options.max_model_len.is_some() {
        let model = ModelConfig::from_dir(&config.model_dir).map_err(|e| model_err(Box::new(e)))?;
        options.context_window(model.max_position_embeddings)?;
    }
    let (engine, mut parts) = config.engine.start(&config.model_dir).map_err(model_err)?;
    if template.is_some() {
        parts.template = template;
    }
    let served = ServedModel::new(
        config.model_name.clone(),
        config.owned_by.clone(),
        engine,
        parts,
    );
    Ok(Arc::new(served.serving(options)?))
}

/// Who may use the server, from where, and how much of it at once. The default is open to
/// every client (no keys, no CORS headers), with the default admission limits.
#[derive(Debug, Clone, Default)]
pub struct Access {
    /// Accepted API keys; none (and no `api_key`) = open.
    pub keys: KeyStore,
    /// A key accepted beside the keys file's (`--api-key`).
    pub api_key: Option<ApiKey>,
    pub limits: AdmissionLimits,
    /// Browser origins answered with CORS headers (`--allowed-origins`); none by default.
    pub cors: AllowedOrigins,
}

impl Access {
    /// The keys accepted when the server starts.
    pub fn key_ring(&self) -> KeyRing {
        KeyRing::new(&self.keys).with_api_key(self.api_key.as_ref())
    }
}

/// Every route, over `state`, open, with the default limits.
pub fn build_app(state: AppState) -> Router {
    build_app_with(state, &Access::default())
}

/// Every route, over `state`, behind `access`: request id, CORS (when origins are allowed),
/// body limit, request counting, API keys, then admission of generations (outermost first).
pub fn build_app_with(state: AppState, access: &Access) -> Router {
    let keys = Arc::new(LiveKeys::new(access.key_ring()));
    build_app_live(state, access, keys)
}

/// [`build_app_with`] over keys that may change while it serves (see [`KeysFileWatch`]).
pub fn build_app_live(state: AppState, access: &Access, keys: Arc<LiveKeys>) -> Router {
    let limits = access.limits;
    let admission = (Arc::new(Admission::new(limits)), state.clone());
    let app = Router::new()
        .route("/health", get(|| async { "ok" }))
        // vLLM's and SageMaker's liveness probe, both methods.
        .route("/ping", get(|| async { "ok" }).post(|| async { "ok" }))
        .merge(openai::routes())
        .merge(openai::responses::routes())
        .merge(openai::cache::routes())
        .merge(openai::embeddings::routes())
        .merge(anthropic::routes())
        .merge(converse::routes())
        .fallback(|uri: axum::http::Uri| async move {
            ApiError::not_found(format!("no route for {uri}"))
        })
        .merge(metrics::routes())
        .merge(dashboard::routes())
        .merge(openapi::routes())
        .layer(from_fn_with_state(admission, admission::admit))
        .layer(from_fn_with_state(keys, auth::require_key))
        .layer(from_fn_with_state(state.clone(), metrics::count_requests))
        .layer(from_fn_with_state(limits, admission::shape_plain_errors))
        .layer(DefaultBodyLimit::max(limits.max_body_bytes));
    // Outside the key check: a browser's preflight carries no key.
    let app = match access.cors.layer() {
        Some(cors) => app.layer(cors),
        None => app,
    };
    app.layer(from_fn_with_state(
        Arc::new(RequestIds::new()),
        request_id::tag_request,
    ))
    .with_state(state)
}

/// Serves `state` on `listener`, open, until `shutdown` resolves; in-flight requests then finish.
pub async fn serve_on(
    listener: TcpListener,
    state: AppState,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> Result<(), ServeError> {
    serve_on_with(listener, state, &Access::default(), shutdown).await
}

/// [`serve_on`] behind `access`.
pub async fn serve_on_with(
    listener: TcpListener,
    state: AppState,
    access: &Access,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> Result<(), ServeError> {
    axum::serve(no_delay(listener), build_app_with(state, access))
        .with_graceful_shutdown(shutdown)
        .await?;
    Ok(())
}

/// Every accepted connection sends its writes at once (TCP_NODELAY): a streamed token is one
/// small write, and Nagle's algorithm would hold it back until the previous one is acknowledged
/// (delayed ACKs make that tens of milliseconds on a reused connection).
fn no_delay(listener: TcpListener) -> TapIo<TcpListener, fn(&mut TcpStream)> {
    listener.tap_io(set_no_delay)
}

fn set_no_delay(tcp: &mut TcpStream) {
    if let Err(e) = tcp.set_nodelay(true) {
        tracing::warn!("cannot set TCP_NODELAY on a connection: {e}");
    }
}

/// How often a running server looks at its keys file.
pub const KEYS_POLL_INTERVAL: Duration = Duration::from_secs(1);

/// `strata serve`: load, bind, announce, serve until Ctrl-C or SIGTERM, then let in-flight
/// requests (streams included) finish; SIGTERM first drains for `drain_delay` ([`drain`]). With
/// `keys_file`, keys added to or revoked from it apply within [`KEYS_POLL_INTERVAL`].
pub async fn serve(
    config: ServeConfig,
    access: Access,
    keys_file: Option<PathBuf>,
    drain_delay: Duration,
) -> Result<(), ServeError> {
    // Installed before the port opens: a SIGTERM from then on drains instead of killing.
    let signals = StopSignals::install()?;
    // Bound before the model loads, so that a taken port is reported at once, not after a load
    // of minutes; connections wait in the backlog until the model is up.
    let listener = bind(config.addr).await?;
    let state = load_state(&config)?;
    let shutdown = drain::stop_after_drain(signals, state.draining.clone(), drain_delay);
    serve_listener(state, listener, access, keys_file, shutdown).await
}

async fn bind(addr: SocketAddr) -> Result<TcpListener, ServeError> {
    TcpListener::bind(addr)
        .await
        .map_err(|source| ServeError::Bind { addr, source })
}

/// Serves the HTTP surfaces over `state` (a local engine or a cluster of nodes) on `addr` until
/// `shutdown`; in-flight requests then finish.
pub async fn serve_state(
    state: AppState,
    addr: SocketAddr,
    access: Access,
    keys_file: Option<PathBuf>,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> Result<(), ServeError> {
    let listener = bind(addr).await?;
    serve_listener(state, listener, access, keys_file, shutdown).await
}

/// [`serve_state`] on a listener already bound.
async fn serve_listener(
    state: AppState,
    listener: TcpListener,
    access: Access,
    keys_file: Option<PathBuf>,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> Result<(), ServeError> {
    let addr = listener.local_addr()?;
    tracing::info!(
        "serving `{}` on http://{addr} (OpenAI API at http://{addr}/v1)",
        state.name
    );
    announce_access(&access, addr);
    let keys = Arc::new(LiveKeys::new(access.key_ring()));
    if let Some(path) = keys_file {
        let watch = KeysFileWatch::new(path, access.keys.clone(), keys.clone());
        tokio::spawn(watch.run(KEYS_POLL_INTERVAL));
    }
    let app = build_app_live(state.clone(), &access, keys);
    axum::serve(no_delay(listener), app)
        .with_graceful_shutdown(shutdown)
        .await?;
    tracing::info!("stopped: every in-flight request has finished");
    // A local engine with a disk tier keeps what it has cached for its next start.
    match state.engine.park_on_disk().await {
        Ok(Some(parked)) if parked > 0 => {
            tracing::info!(parked, "cached KV blocks parked on the disk tier")
        }
        Ok(_) => {}
        Err(e) => tracing::warn!("parking the cached KV: {e}"),
    }
    Ok(())
}

fn announce_access(access: &Access, addr: SocketAddr) {
    let keys = &access.keys;
    let open = keys.keys.is_empty() && access.api_key.is_none();
    if open {
        tracing::info!("the server is open: no API keys are configured, every client is accepted");
    } else {
        let mut tenants: Vec<&str> = keys.keys.iter().map(|k| k.tenant.as_str()).collect();
        tenants.sort_unstable();
        tenants.dedup();
        let own = if access.api_key.is_some() {
            "the --api-key key and "
        } else {
            ""
        };
        tracing::info!(
            "API keys required: {own}{} keys for {} tenants",
            keys.keys.len(),
            tenants.len()
        );
    }
    match &access.cors {
        AllowedOrigins::None => {}
        AllowedOrigins::Any => tracing::info!("CORS: every origin is allowed"),
        AllowedOrigins::List(origins) => tracing::info!("CORS: {} origins allowed", origins.len()),
    }
    if open && !addr.ip().is_loopback() {
        tracing::warn!(
            "listening beyond loopback ({}) without API keys: anyone who can reach this \
             address can use the model",
            addr.ip()
        );
    }
}

#[cfg(test)]
mod tests {
    use axum::serve::Listener;

    use super::*;

    #[tokio::test]
    async fn accepted_connections_send_without_delay() {
        let plain = TcpListener::bind(SocketAddr::from(([127, 0, 0, 1], 0)))
            .await
            .unwrap();
        let addr = plain.local_addr().unwrap();
        let mut listener = no_delay(plain);
        let client = tokio::net::TcpStream::connect(addr).await.unwrap();
        let (server_side, _) = listener.accept().await;
        assert!(server_side.nodelay().unwrap(), "TCP_NODELAY is set");
        // The canary: a connection accepted without the wrapper keeps Nagle's algorithm on.
        let plain = TcpListener::bind(SocketAddr::from(([127, 0, 0, 1], 0)))
            .await
            .unwrap();
        let addr = plain.local_addr().unwrap();
        let _other = tokio::net::TcpStream::connect(addr).await.unwrap();
        let (bare, _) = plain.accept().await.unwrap();
        assert!(!bare.nodelay().unwrap());
        drop(client);
    }
}
