//! `/v1/embeddings` and `/v1/rerank` over real HTTP: vectors equal to the reference model's
//! pooled, normalized hidden states, in both encodings, truncated by `dimensions`; batches in
//! order; documents ranked by cosine similarity; bad input refused by name.

mod support;

use std::time::Duration;

use base64::Engine as _;
use serde_json::{Value, json};
use strata_model::cpu::{CpuModel, LogitRows, SeqChunk};
use strata_router::Access;
use support::http;

fn floats(v: &Value) -> Vec<f32> {
    v.as_array()
        .unwrap_or_else(|| panic!("not an array: {v}"))
        .iter()
        .map(|x| x.as_f64().unwrap() as f32)
        .collect()
}

fn norm(v: &[f32]) -> f64 {
    v.iter().map(|x| f64::from(*x).powi(2)).sum::<f64>().sqrt()
}

/// The reference model's last-token final hidden state of `ids`, scaled to unit length.
fn reference(model: &CpuModel, ids: &[u32]) -> Vec<f32> {
    let mut cache = model.new_cache();
    let chunk = SeqChunk {
        tokens: ids,
        first_position: 0,
        logits: LogitRows::None,
    };
    let rows = model
        .forward_batch_rows(&[chunk], &[LogitRows::Last], &mut cache)
        .unwrap();
    let n = norm(&rows.hidden);
    rows.hidden
        .iter()
        .map(|x| (f64::from(*x) / n) as f32)
        .collect()
}

/// `text`'s ids as the server tokenizes it.
async fn ids(addr: std::net::SocketAddr, text: &str) -> Vec<u32> {
    let out = http::post(addr, "/tokenize", &json!({"prompt": text}))
        .await
        .json();
    serde_json::from_value(out["tokens"].clone()).unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn embeddings_are_the_models_pooled_hidden_states() {
    let model_dir = tempfile::tempdir().unwrap();
    let state = support::paced_tiny_state(model_dir.path(), Duration::ZERO, Default::default());
    let hidden = state.engine.model_config().hidden_size;
    let addr = http::serve(state, Access::default()).await;
    let model = CpuModel::load(model_dir.path()).unwrap();

    let texts = [
        "The cat sat on the mat.",
        "Rain in Spain",
        "The cat sat on the mat.",
    ];
    let out = http::post(
        addr,
        "/v1/embeddings",
        &json!({"model": "tiny", "input": texts, "encoding_format": "float"}),
    )
    .await;
    assert_eq!(out.status, 200, "{}", out.describe());
    let out = out.json();
    assert_eq!(out["object"], "list");
    assert_eq!(out["model"], "tiny");
    let data = out["data"].as_array().unwrap();
    assert_eq!(data.len(), 3);
    let mut tokens = 0;
    for (i, (item, text)) in data.iter().zip(texts).enumerate() {
        assert_eq!(
            (item["object"].as_str(), item["index"].as_u64()),
            (Some("embedding"), Some(i as u64))
        );
        let v = floats(&item["embedding"]);
        assert_eq!(v.len(), hidden);
        assert!((norm(&v) - 1.0).abs() < 1e-5, "unit length: {}", norm(&v));
        let ids = ids(addr, text).await;
        tokens += ids.len() as u64;
        assert_eq!(
            v,
            reference(&model, &ids),
            "input {i} against the reference pass"
        );
    }
    assert_eq!(floats(&data[0]["embedding"]), floats(&data[2]["embedding"]));
    assert_ne!(floats(&data[0]["embedding"]), floats(&data[1]["embedding"]));
    assert_eq!(out["usage"]["prompt_tokens"], tokens);
    assert_eq!(out["usage"]["total_tokens"], tokens);

    // base64 (what the openai SDK asks for by default): the same floats, little-endian.
    let b64 = http::post(
        addr,
        "/v1/embeddings",
        &json!({"model": "tiny", "input": texts[0], "encoding_format": "base64"}),
    )
    .await
    .json();
    let bytes = base64::engine::general_purpose::STANDARD
        .decode(b64["data"][0]["embedding"].as_str().unwrap())
        .unwrap();
    let decoded: Vec<f32> = bytes
        .chunks_exact(4)
        .map(|b| f32::from_le_bytes(b.try_into().unwrap()))
        .collect();
    assert_eq!(decoded, floats(&data[0]["embedding"]));

    // Token ids are taken as they are; `dimensions` keeps the leading values, renormalized.
    let first = ids(addr, texts[0]).await;
    let by_ids = http::post(
        addr,
        "/v1/embeddings",
        &json!({"model": "tiny", "input": [first], "dimensions": 8}),
    )
    .await
    .json();
    let short = floats(&by_ids["data"][0]["embedding"]);
    assert_eq!(short.len(), 8);
    assert!((norm(&short) - 1.0).abs() < 1e-5);
    let full = floats(&data[0]["embedding"]);
    let head = norm(&full[..8]);
    for (s, f) in short.iter().zip(&full) {
        assert!(
            (f64::from(*s) - f64::from(*f) / head).abs() < 1e-6,
            "{s} vs {f}"
        );
    }

    // Refusals name their field, in OpenAI's error shape.
    for (body, param) in [
        (
            json!({"model": "tiny", "input": "x", "encoding_format": "hex"}),
            "encoding_format",
        ),
        (
            json!({"model": "tiny", "input": "x", "dimensions": 0}),
            "dimensions",
        ),
        (
            json!({"model": "tiny", "input": "x", "dimensions": hidden + 1}),
            "dimensions",
        ),
        (json!({"model": "tiny", "input": []}), "input"),
        (json!({"model": "tiny", "input": [[]]}), "input"),
        (json!({"model": "tiny", "input": {"text": "x"}}), "input"),
        (json!({"model": "tiny", "input": [999_999]}), "input"),
    ] {
        let out = http::post(addr, "/v1/embeddings", &body).await;
        assert_eq!(out.status, 400, "{body}: {}", out.describe());
        assert_eq!(
            out.json()["error"]["param"],
            param,
            "{body}: {}",
            out.describe()
        );
    }
    let unknown = json!({"model": "tiny", "input": "x", "truncate_prompt_tokens": 4});
    let out = http::post(addr, "/v1/embeddings", &unknown).await;
    assert_eq!(out.status, 400, "{}", out.describe());
    assert!(
        out.text().contains("truncate_prompt_tokens"),
        "{}",
        out.describe()
    );
    let out = http::post(
        addr,
        "/v1/embeddings",
        &json!({"model": "nope", "input": "x"}),
    )
    .await;
    assert_eq!(out.status, 404, "{}", out.describe());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rerank_orders_documents_by_cosine_similarity_with_the_query() {
    let model_dir = tempfile::tempdir().unwrap();
    let state = support::paced_tiny_state(model_dir.path(), Duration::ZERO, Default::default());
    let addr = http::serve(state, Access::default()).await;
    let query = "where did the cat sit";
    let documents = json!(["dogs bark at night", query, {"text": "rain falls mainly"}]);
    let embed = |input: Value| async move {
        let out = http::post(
            addr,
            "/v1/embeddings",
            &json!({"model": "tiny", "input": input}),
        )
        .await
        .json();
        out["data"]
            .as_array()
            .unwrap()
            .iter()
            .map(|d| floats(&d["embedding"]))
            .collect::<Vec<_>>()
    };
    let vectors = embed(json!([
        query,
        "dogs bark at night",
        query,
        "rain falls mainly"
    ]))
    .await;
    let cosine = |a: &[f32], b: &[f32]| {
        a.iter()
            .zip(b)
            .map(|(x, y)| f64::from(*x) * f64::from(*y))
            .sum::<f64>()
    };
    let want: Vec<f64> = vectors[1..]
        .iter()
        .map(|d| cosine(&vectors[0], d))
        .collect();

    let mut first = None;
    for path in ["/v1/rerank", "/rerank", "/v2/rerank"] {
        let out = http::post(
            addr,
            path,
            &json!({"model": "tiny", "query": query, "documents": documents}),
        )
        .await;
        assert_eq!(out.status, 200, "{path}: {}", out.describe());
        let out = out.json();
        let results = out["results"].as_array().unwrap();
        assert_eq!(results.len(), 3);
        // The query itself is the best match; scores fall; each is the cosine similarity.
        assert_eq!(results[0]["index"], 1, "{out}");
        let scores: Vec<f64> = results
            .iter()
            .map(|r| r["relevance_score"].as_f64().unwrap())
            .collect();
        assert!(scores.windows(2).all(|w| w[0] >= w[1]), "{scores:?}");
        for r in results {
            let i = r["index"].as_u64().unwrap() as usize;
            assert!(
                (r["relevance_score"].as_f64().unwrap() - want[i]).abs() < 1e-6,
                "{r}"
            );
            let text = documents[i]
                .as_str()
                .or(documents[i]["text"].as_str())
                .unwrap();
            assert_eq!(r["document"]["text"], text);
        }
        assert!(out["usage"]["total_tokens"].as_u64().unwrap() > 0);
        assert!(out["id"].as_str().unwrap().starts_with("rerank-"));
        let order: Vec<Value> = results.iter().map(|r| r["index"].clone()).collect();
        assert_eq!(*first.get_or_insert(order.clone()), order, "{path}");
    }

    let top = http::post(
        addr,
        "/v1/rerank",
        &json!({"model": "tiny", "query": query, "documents": documents, "top_n": 1, "return_documents": false}),
    )
    .await
    .json();
    let results = top["results"].as_array().unwrap();
    assert_eq!(results.len(), 1);
    assert_eq!(results[0]["index"], 1);
    assert!(results[0].get("document").is_none(), "{top}");

    for (body, param) in [
        (
            json!({"model": "tiny", "query": query, "documents": []}),
            "documents",
        ),
        (
            json!({"model": "tiny", "query": query, "documents": ["a"], "top_n": 0}),
            "top_n",
        ),
        (
            json!({"model": "tiny", "query": query, "documents": ["a"], "max_tokens_per_doc": 0}),
            "max_tokens_per_doc",
        ),
    ] {
        let out = http::post(addr, "/v1/rerank", &body).await;
        assert_eq!(out.status, 400, "{body}: {}", out.describe());
        assert_eq!(out.json()["error"]["param"], param, "{body}");
    }
    let out = http::post(
        addr,
        "/v1/rerank",
        &json!({"model": "tiny", "query": query, "documents": ["a"], "priority": 1}),
    )
    .await;
    assert_eq!(out.status, 400, "{}", out.describe());
    assert!(out.text().contains("priority"), "{}", out.describe());
}
