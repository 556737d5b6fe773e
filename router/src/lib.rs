//! strata-router: the HTTP front door. Today it serves one model through an in-process engine
//! (`strata serve`) over the OpenAI surface; see docs/SERVING.md.

pub mod admission;
pub mod anthropic;
pub mod auth;
pub mod converse;
pub mod error;
pub mod metrics;
pub mod openai;
pub mod state;

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;

use axum::Router;
use axum::extract::DefaultBodyLimit;
use axum::middleware::from_fn_with_state;
use axum::routing::get;
use tokio::net::TcpListener;

use crate::admission::{Admission, AdmissionLimits};
use crate::auth::{KeyRing, KeyStore};
use crate::error::ApiError;
pub use crate::state::{AppState, LoadedModel, ModelLoadError, ServedModel, eos_ids};

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
    pub kv_cache_mib: usize,
    pub block_size: usize,
}

#[derive(Debug, thiserror::Error)]
pub enum ServeError {
    #[error("{}: {source}", path.display())]
    Model {
        path: PathBuf,
        source: ModelLoadError,
    },
    #[error("cannot listen on {addr}: {source}")]
    Bind {
        addr: SocketAddr,
        source: std::io::Error,
    },
    #[error("server: {0}")]
    Io(#[from] std::io::Error),
}

/// Loads the checkpoint and starts its engine.
pub fn load_state(config: &ServeConfig) -> Result<AppState, ServeError> {
    let model_err = |source| ServeError::Model {
        path: config.model_dir.clone(),
        source,
    };
    let loaded = LoadedModel::load(&config.model_dir).map_err(model_err)?;
    let (engine, parts) = loaded
        .start_engine(config.block_size, config.kv_cache_mib << 20)
        .map_err(model_err)?;
    Ok(Arc::new(ServedModel::new(
        config.model_name.clone(),
        config.owned_by.clone(),
        engine,
        parts,
    )))
}

/// Who may use the server and how much of it at once. The default is open, with the default
/// admission limits.
#[derive(Debug, Clone, Default)]
pub struct Access {
    /// Accepted API keys; none = open.
    pub keys: KeyStore,
    pub limits: AdmissionLimits,
}

/// Every route, over `state`, open, with the default limits.
pub fn build_app(state: AppState) -> Router {
    build_app_with(state, &Access::default())
}

/// Every route, over `state`, behind `access`: body limit, request counting, API keys, then
/// admission of generations (outermost first).
pub fn build_app_with(state: AppState, access: &Access) -> Router {
    let limits = access.limits;
    let admission = (Arc::new(Admission::new(limits)), state.clone());
    let keys = Arc::new(KeyRing::new(&access.keys));
    Router::new()
        .route("/health", get(|| async { "ok" }))
        .merge(openai::routes())
        .merge(openai::responses::routes())
        .merge(anthropic::routes())
        .merge(converse::routes())
        .fallback(|uri: axum::http::Uri| async move {
            ApiError::not_found(format!("no route for {uri}"))
        })
        .merge(metrics::routes())
        .layer(from_fn_with_state(admission, admission::admit))
        .layer(from_fn_with_state(keys, auth::require_key))
        .layer(from_fn_with_state(state.clone(), metrics::count_requests))
        .layer(from_fn_with_state(limits, admission::shape_oversize))
        .layer(DefaultBodyLimit::max(limits.max_body_bytes))
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
    axum::serve(listener, build_app_with(state, access))
        .with_graceful_shutdown(shutdown)
        .await?;
    Ok(())
}

/// `strata serve`: load, bind, announce, serve until Ctrl-C or SIGTERM.
pub async fn serve(config: ServeConfig, access: Access) -> Result<(), ServeError> {
    let state = load_state(&config)?;
    let listener = TcpListener::bind(config.addr)
        .await
        .map_err(|source| ServeError::Bind {
            addr: config.addr,
            source,
        })?;
    let addr = listener.local_addr()?;
    eprintln!(
        "serving `{}` on http://{addr} (OpenAI API at http://{addr}/v1)",
        config.model_name
    );
    if access.keys.keys.is_empty() {
        eprintln!("the server is open: no API keys are configured, every client is accepted");
    } else {
        let mut tenants: Vec<&str> = access.keys.keys.iter().map(|k| k.tenant.as_str()).collect();
        tenants.sort_unstable();
        tenants.dedup();
        eprintln!(
            "API keys required: {} keys for {} tenants",
            access.keys.keys.len(),
            tenants.len()
        );
    }
    if access.keys.keys.is_empty() && !addr.ip().is_loopback() {
        eprintln!(
            "warning: listening beyond loopback ({}) without API keys: anyone who can reach this \
             address can use the model",
            addr.ip()
        );
    }
    serve_on_with(listener, state, &access, shutdown_signal()).await
}

async fn shutdown_signal() {
    let ctrl_c = async {
        let _ = tokio::signal::ctrl_c().await;
    };
    #[cfg(unix)]
    let terminate = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut s) => {
                s.recv().await;
            }
            Err(_) => std::future::pending::<()>().await,
        }
    };
    #[cfg(not(unix))]
    let terminate = std::future::pending::<()>();
    tokio::select! {
        () = ctrl_c => {},
        () = terminate => {},
    }
}
