//! The cluster behind the engine seam: the surfaces speak to the nodes behind a router through
//! the same [`EngineClient`] they use for an engine in this process.

use std::sync::Arc;
use std::time::Duration;

use strata_engine_api::client::{EngineClient, Reply, summed_pins};
use strata_engine_api::kv::{BlockHash, KvDump};
use strata_engine_api::load::{EngineLoad, StepTimes};
use strata_engine_api::rpc::PinReport;
use strata_engine_api::submit::{RequestStream, SubmitError};
use strata_model::ModelConfig;
use strata_protocol::GenerateRequest;

use super::Cluster;

/// The nodes behind this router, as one engine.
pub struct ClusterClient(pub Arc<Cluster>);

impl EngineClient for ClusterClient {
    fn model_config(&self) -> &ModelConfig {
        self.0.model_config()
    }

    fn block_size(&self) -> usize {
        self.0.block_size()
    }

    fn submit(&self, request: GenerateRequest) -> Result<RequestStream, SubmitError> {
        self.0.submit(request)
    }

    fn cancel(&self, id: u64) -> Result<(), SubmitError> {
        self.0.cancel(id);
        Ok(())
    }

    fn available(&self) -> bool {
        self.0.has_available_node()
    }

    fn loads(&self) -> Vec<(String, EngineLoad)> {
        self.0.node_loads()
    }

    fn step_times(&self) -> Option<StepTimes> {
        None
    }

    fn kv_dump(&self) -> Reply<Option<KvDump>> {
        Box::pin(async { Ok(None) })
    }

    /// Pins on every connected node (a primed context stays where its prompt ran, or where a
    /// failover took it): the best-placed node's report, or the first node's refusal when none
    /// holds a block.
    fn pin(
        &self,
        name: String,
        hashes: Vec<BlockHash>,
        ttl: Duration,
    ) -> Reply<Result<PinReport, String>> {
        let cluster = self.0.clone();
        Box::pin(async move {
            let (mut reports, mut errors) = (Vec::new(), Vec::new());
            for answer in cluster.pin(&name, &hashes, ttl).await {
                match answer {
                    Ok(report) => reports.push(report),
                    Err(e) => errors.push(e),
                }
            }
            if reports.iter().all(|r| r.blocks == 0)
                && let Some(first) = errors.into_iter().next()
            {
                return Ok(Err(first));
            }
            Ok(summed_pins(reports)
                .into_iter()
                .next()
                .ok_or_else(|| "no node answered the pin".to_string()))
        })
    }

    fn pin_detached(&self, name: String, hashes: Vec<BlockHash>, ttl: Duration) {
        let cluster = self.0.clone();
        tokio::spawn(async move {
            for answer in cluster.pin(&name, &hashes, ttl).await {
                if let Err(e) = answer {
                    tracing::debug!("pinning {name} on a node: {e}");
                }
            }
        });
    }

    fn unpin(&self, name: String) -> Reply<bool> {
        let cluster = self.0.clone();
        Box::pin(async move { Ok(cluster.unpin(&name).await) })
    }

    fn pins(&self) -> Reply<Vec<PinReport>> {
        let cluster = self.0.clone();
        Box::pin(async move { Ok(summed_pins(cluster.pins().await)) })
    }

    fn park_on_disk(&self) -> Reply<Option<usize>> {
        Box::pin(async { Ok(None) })
    }
}
