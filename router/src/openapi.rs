//! `GET /openapi.json`: the OpenAPI 3.1 description of every route, kept by hand in
//! `router/api/openapi.json` and embedded in the binary. It lists every field each request may
//! carry and each answer, as strict as the server: `router/tests/openapi_fuzz.rs` runs
//! schemathesis against it; docs/SERVING.md stays the full reference.
//! `router/tests/operations.rs` fails when a served route is missing from it.

use axum::Router;
use axum::http::header;
use axum::response::IntoResponse;
use axum::routing::get;

use crate::state::AppState;

/// The document, as served.
pub const DOCUMENT: &str = include_str!("../api/openapi.json");

pub fn routes() -> Router<AppState> {
    Router::new().route("/openapi.json", get(document))
}

async fn document() -> impl IntoResponse {
    ([(header::CONTENT_TYPE, "application/json")], DOCUMENT)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_document_is_openapi_3_1_at_this_version() {
        let doc: serde_json::Value = serde_json::from_str(DOCUMENT).unwrap();
        assert!(doc["openapi"].as_str().unwrap().starts_with("3.1."));
        assert_eq!(doc["info"]["version"], env!("CARGO_PKG_VERSION"));
    }

    #[test]
    fn every_reference_resolves() {
        let doc: serde_json::Value = serde_json::from_str(DOCUMENT).unwrap();
        let mut refs = Vec::new();
        collect_refs(&doc, &mut refs);
        assert!(!refs.is_empty());
        for r in refs {
            let pointer = r
                .strip_prefix('#')
                .unwrap_or_else(|| panic!("external $ref {r}"));
            assert!(doc.pointer(pointer).is_some(), "dangling $ref {r}");
        }
    }

    fn collect_refs(value: &serde_json::Value, out: &mut Vec<String>) {
        match value {
            serde_json::Value::Object(map) => {
                for (k, v) in map {
                    match (k.as_str(), v) {
                        ("$ref", serde_json::Value::String(r)) => out.push(r.clone()),
                        _ => collect_refs(v, out),
                    }
                }
            }
            serde_json::Value::Array(items) => items.iter().for_each(|v| collect_refs(v, out)),
            _ => {}
        }
    }
}
