//! The operator's dashboard, served by routers and by `strata serve`: one self-contained page
//! (`/dashboard`, its script and style embedded in the binary, nothing fetched from elsewhere)
//! fed by a JSON snapshot (`/dashboard/state`), and the capacity planner behind it
//! (`/dashboard/profiles`, `POST /dashboard/plan`: the same answers as `strata plan`).

use axum::extract::State;
use axum::http::{StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use serde::{Deserialize, Serialize};
use serde_json::json;

use crate::cluster::{MemberView, NodeView};
use crate::metrics::MetricsSummary;
use crate::plan::{self, Profile, Workload};
use crate::state::{AppState, unix_now};

const PAGE: &str = include_str!("../assets/dashboard.html");

pub fn routes() -> Router<AppState> {
    Router::new()
        .route("/dashboard", get(page))
        .route("/dashboard/state", get(snapshot))
        .route("/dashboard/profiles", get(profiles))
        .route("/dashboard/plan", post(plan_request))
}

async fn page() -> Response {
    (
        [
            (header::CONTENT_TYPE, "text/html; charset=utf-8"),
            // Everything the page needs is in it: no other origin may be reached from it.
            (
                header::CONTENT_SECURITY_POLICY,
                "default-src 'none'; script-src 'unsafe-inline'; style-src 'unsafe-inline'; \
                 connect-src 'self'; img-src data:",
            ),
            (header::CACHE_CONTROL, "no-store"),
        ],
        PAGE,
    )
        .into_response()
}

/// What `/dashboard/state` answers.
#[derive(Debug, Serialize)]
pub struct Snapshot {
    pub model: String,
    /// `router` (nodes behind it) or `server` (the engine in this process).
    pub role: &'static str,
    pub uptime_s: u64,
    /// Unix time of the snapshot, milliseconds.
    pub at_ms: u128,
    pub metrics: MetricsSummary,
    pub nodes: Vec<NodeView>,
    pub members: Vec<MemberView>,
    pub ring_epoch: Option<u64>,
}

async fn snapshot(State(state): State<AppState>) -> Json<Snapshot> {
    let (role, nodes, members, ring_epoch) = match state.engine.cluster() {
        None => (
            "server",
            state
                .engine
                .loads()
                .into_iter()
                .map(|(_, load)| NodeView {
                    addr: "local".into(),
                    alive: true,
                    routed: 0,
                    load: Some(load),
                })
                .collect(),
            Vec::new(),
            None,
        ),
        Some(cluster) => (
            "router",
            cluster.node_views(),
            cluster.members(),
            Some(cluster.ring_epoch()),
        ),
    };
    let at_ms = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis());
    Json(Snapshot {
        model: state.name.clone(),
        role,
        uptime_s: unix_now().saturating_sub(state.created),
        at_ms,
        metrics: state.metrics.summary(),
        nodes,
        members,
        ring_epoch,
    })
}

async fn profiles() -> Json<Vec<Profile>> {
    Json(
        plan::builtin_names()
            .into_iter()
            .filter_map(plan::builtin)
            .collect(),
    )
}

/// `POST /dashboard/plan`: a shipped profile (by name; a measured profile file is
/// `strata plan --profile FILE`'s), a workload, and optionally a node count to evaluate instead
/// of sizing.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct PlanRequest {
    profile: String,
    workload: Workload,
    /// A whole number (JSON Schema's integer: `2.0` is one).
    #[serde(default)]
    nodes: Option<f64>,
}

async fn plan_request(body: axum::body::Bytes) -> Response {
    let bad = |message: String| {
        (
            StatusCode::BAD_REQUEST,
            Json(json!({"error": {"message": message, "type": "invalid_request_error"}})),
        )
            .into_response()
    };
    let request: PlanRequest = match serde_json::from_slice(&body) {
        Ok(r) => r,
        Err(e) => return bad(format!("the plan request does not parse: {e}")),
    };
    let Some(profile) = plan::builtin(&request.profile) else {
        return bad(format!(
            "no shipped profile `{}` (there are: {})",
            request.profile,
            plan::builtin_names().join(", ")
        ));
    };
    let nodes = match request.nodes {
        Some(n) if n.fract() == 0.0 && (1.0..=plan::MAX_NODES as f64).contains(&n) => {
            Some(n as usize)
        }
        Some(n) => {
            return bad(format!(
                "nodes must be a whole number from 1 to {} (got {n})",
                plan::MAX_NODES
            ));
        }
        None => None,
    };
    let answer = match nodes {
        Some(n) => profile.evaluate(&request.workload, n),
        None => profile.size(&request.workload),
    };
    match answer {
        Ok(plan) => Json(plan).into_response(),
        // A valid question whose answer is "no cluster size": said in the answer, not as an error.
        Err(e @ plan::PlanError::Unreachable { .. }) => Json(json!({
            "profile": profile.name,
            "workload": request.workload,
            "cluster": null,
            "sources": [],
            "unreachable": e.to_string(),
        }))
        .into_response(),
        Err(e) => bad(e.to_string()),
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn the_api_document_lists_the_shipped_profiles() {
        let doc: serde_json::Value = serde_json::from_str(crate::openapi::DOCUMENT).unwrap();
        let listed = &doc["paths"]["/dashboard/plan"]["post"]["requestBody"]["content"]["application/json"]
            ["schema"]["properties"]["profile"]["enum"];
        let listed: Vec<&str> = listed
            .as_array()
            .unwrap()
            .iter()
            .map(|v| v.as_str().unwrap())
            .collect();
        assert_eq!(listed, super::plan::builtin_names());
    }
}
