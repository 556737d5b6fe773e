//! The capacity planner: how many nodes a workload needs, from what one node was measured to do.
//!
//! A [`Profile`] is one node's measured engine: its decode step time at several batch sizes and
//! its prefill rate, each figure naming the receipt it came from (the profiles shipped in the
//! binary, [`builtin`]), or measured on the spot by `strata plan measure`. A [`Workload`] is a
//! request rate (open loop) or a number of clients each keeping one request in flight (closed
//! loop), prompt and output lengths, the share of prompt tokens found in the prefix cache, and
//! latency targets. [`Profile::node`] predicts one node's steady state under its share of the
//! load; [`Profile::size`] finds the fewest nodes meeting the targets, with the headroom left.
//!
//! The model (docs/OPERATIONS.md, "Capacity planning"): a node alternates decode steps and
//! prefill. Prefill takes `f = λ · P(1 − s) / R` of its time (λ its request rate, P prompt
//! tokens, s the prefix share, R its prefill rate); decode steps of `B` running sequences take
//! `t(B)` (interpolated between measured batches) and are stretched by the prefill they share
//! the engine with, so the inter-token latency is `t(B) / (1 − f)`. Little's law closes it:
//! `B = λ · O · t(B) / (1 − f)` for O output tokens. Time to first token is the prefill of the
//! uncached prompt plus the wait for the prefill queue (M/D/1 at utilization f) and half a step.

pub mod profiles;

use serde::{Deserialize, Serialize};

pub use profiles::{builtin, builtin_names};

/// Where a figure came from: a receipt under docs/receipts and the JSON pointer into it, or a
/// measurement made by `strata plan measure` (`receipt` names the run).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Source {
    pub receipt: String,
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub pointer: String,
}

/// One measured decode step.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DecodePoint {
    /// Sequences in the step.
    pub batch: usize,
    /// Median step time, milliseconds.
    pub step_ms: f64,
    pub source: Source,
}

/// The measured prefill rate.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Prefill {
    /// The prompt length it was measured at.
    pub prompt_tokens: usize,
    pub tokens_per_s: f64,
    pub source: Source,
}

/// What one node (one engine: a GPU, a tensor-parallel group, or the CPU) was measured to do.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Profile {
    pub name: String,
    /// The device in words ("NVIDIA H200", "cpu").
    pub device: String,
    /// The model, in words.
    pub model: String,
    /// GPUs per node (its tensor-parallel degree; 0 on the CPU).
    pub gpus_per_node: usize,
    /// The most sequences the engine runs at once (`max_running`).
    pub max_batch: usize,
    /// Measured decode steps, by ascending batch.
    pub decode: Vec<DecodePoint>,
    pub prefill: Prefill,
}

/// How load arrives.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Load {
    /// Requests per second, arriving independently of answers (open loop).
    Rate(f64),
    /// Clients each keeping one request in flight (closed loop), spread evenly over the nodes.
    Concurrency(f64),
}

/// What the cluster must serve.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Workload {
    pub load: Load,
    /// Mean prompt tokens per request.
    pub prompt_tokens: f64,
    /// Mean output tokens per request.
    pub output_tokens: f64,
    /// Share of prompt tokens found in the prefix cache (0 to 1): not prefilled again.
    #[serde(default)]
    pub prefix_share: f64,
    /// Targets a plan must meet (milliseconds); none means any.
    #[serde(default)]
    pub ttft_ms: Option<f64>,
    #[serde(default)]
    pub itl_ms: Option<f64>,
}

/// Why a workload is not a plan's input.
#[derive(Debug, thiserror::Error, PartialEq)]
pub enum PlanError {
    #[error("{0}")]
    Workload(String),
    #[error("profile `{name}`: {why}")]
    Profile { name: String, why: String },
    #[error("no cluster of up to {max} nodes of `{profile}` meets the targets: {why}")]
    Unreachable {
        profile: String,
        max: usize,
        why: String,
    },
}

/// One node's predicted steady state under its share of the load.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct NodeState {
    /// Requests per second it serves.
    pub requests_per_s: f64,
    /// Output tokens per second it delivers.
    pub output_tokens_per_s: f64,
    /// Sequences decoding at once, on average.
    pub batch: f64,
    /// Share of its time spent in prefill.
    pub prefill_share: f64,
    pub itl_ms: f64,
    pub ttft_ms: f64,
    /// Whether it keeps up (open loop: the queue does not grow).
    pub stable: bool,
    /// Why not, when it does not.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub limit: Option<String>,
}

/// A cluster's predicted state: `nodes` nodes sharing the workload evenly.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ClusterState {
    pub nodes: usize,
    pub gpus: usize,
    pub per_node: NodeState,
    /// Output tokens per second of the whole cluster.
    pub output_tokens_per_s: f64,
    /// Whether every target is met and every node keeps up.
    pub meets_targets: bool,
    /// The factor the load could grow by with every target still met (open loop; 0 when the
    /// targets are not met now).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub headroom: Option<f64>,
}

/// A sizing answer: the smallest cluster meeting the targets, and the figures it rests on.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Plan {
    pub profile: String,
    pub device: String,
    pub model: String,
    pub workload: Workload,
    pub cluster: ClusterState,
    /// Every figure of the profile the answer used, with its receipt.
    pub sources: Vec<FigureSource>,
}

/// A figure and where it came from.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct FigureSource {
    pub figure: String,
    pub value: f64,
    pub source: Source,
}

/// The largest cluster [`Profile::size`] considers.
pub const MAX_NODES: usize = 4096;

impl Workload {
    pub fn check(&self) -> Result<(), PlanError> {
        let bad = |what: &str| Err(PlanError::Workload(what.to_string()));
        match self.load {
            Load::Rate(r) if !(r.is_finite() && r > 0.0) => {
                return bad("the request rate must be a positive number of requests per second");
            }
            Load::Concurrency(c) if !(c.is_finite() && c >= 1.0) => {
                return bad("the concurrency must be at least 1");
            }
            _ => {}
        }
        if !(self.prompt_tokens.is_finite() && self.prompt_tokens >= 1.0) {
            return bad("prompt tokens must be at least 1");
        }
        if !(self.output_tokens.is_finite() && self.output_tokens >= 1.0) {
            return bad("output tokens must be at least 1");
        }
        if !(0.0..=1.0).contains(&self.prefix_share) {
            return bad("the prefix share must be in [0, 1]");
        }
        for (name, target) in [("ttft_ms", self.ttft_ms), ("itl_ms", self.itl_ms)] {
            if let Some(t) = target
                && !(t.is_finite() && t > 0.0)
            {
                return bad(&format!("{name} must be a positive number of milliseconds"));
            }
        }
        Ok(())
    }

    /// The same workload with its load multiplied by `factor`.
    pub fn scaled(&self, factor: f64) -> Self {
        let load = match self.load {
            Load::Rate(r) => Load::Rate(r * factor),
            Load::Concurrency(c) => Load::Concurrency(c * factor),
        };
        Self {
            load,
            ..self.clone()
        }
    }

    /// Prompt tokens each request really prefills.
    fn prefilled(&self) -> f64 {
        self.prompt_tokens * (1.0 - self.prefix_share)
    }
}

impl Profile {
    /// Checks the profile can be planned with: at least one decode point, batches ascending and
    /// positive, times and the prefill rate positive.
    pub fn check(&self) -> Result<(), PlanError> {
        let bad = |why: &str| {
            Err(PlanError::Profile {
                name: self.name.clone(),
                why: why.to_string(),
            })
        };
        if self.decode.is_empty() {
            return bad("no decode step was measured");
        }
        if self.decode.windows(2).any(|w| w[0].batch >= w[1].batch) || self.decode[0].batch == 0 {
            return bad("decode batches must be positive and ascending");
        }
        if self
            .decode
            .iter()
            .any(|p| !(p.step_ms.is_finite() && p.step_ms > 0.0))
        {
            return bad("every decode step time must be positive");
        }
        if !(self.prefill.tokens_per_s.is_finite() && self.prefill.tokens_per_s > 0.0) {
            return bad("the prefill rate must be positive");
        }
        if self.max_batch == 0 {
            return bad("max_batch must be at least 1");
        }
        Ok(())
    }

    /// Decode step time (seconds) at `batch` sequences: piecewise linear through the measured
    /// points; below the first point its time; beyond the last, the last two points' slope
    /// (never below the last point's time).
    pub fn step_s(&self, batch: f64) -> f64 {
        let points = &self.decode;
        let at = |i: usize| (points[i].batch as f64, points[i].step_ms / 1e3);
        let (b0, t0) = at(0);
        if batch <= b0 || points.len() == 1 {
            return if batch <= b0 { t0 } else { t0 * batch / b0 };
        }
        for i in 1..points.len() {
            let (b1, t1) = at(i);
            if batch <= b1 {
                let (ba, ta) = at(i - 1);
                return ta + (t1 - ta) * (batch - ba) / (b1 - ba);
            }
        }
        let (ba, ta) = at(points.len() - 2);
        let (bb, tb) = at(points.len() - 1);
        (tb + (tb - ta) / (bb - ba) * (batch - bb)).max(tb)
    }

    fn prefill_rate(&self) -> f64 {
        self.prefill.tokens_per_s
    }

    /// One node's steady state under `share` of the workload (`1 / nodes`).
    pub fn node(&self, work: &Workload, nodes: usize) -> NodeState {
        let share = 1.0 / nodes as f64;
        match work.load {
            Load::Rate(rate) => self.open_loop(work, rate * share),
            Load::Concurrency(c) => self.closed_loop(work, c * share),
        }
    }

    /// Requests at `rate` per second: solve `B = λ·O·t(B)/(1 − f)` for the decode batch.
    fn open_loop(&self, work: &Workload, rate: f64) -> NodeState {
        let prefill_s = work.prefilled() / self.prefill_rate();
        let f = rate * prefill_s;
        let unstable = |why: String, batch: f64| NodeState {
            requests_per_s: rate,
            output_tokens_per_s: rate * work.output_tokens,
            batch,
            prefill_share: f.min(1.0),
            itl_ms: f64::INFINITY,
            ttft_ms: f64::INFINITY,
            stable: false,
            limit: Some(why),
        };
        if f >= 1.0 {
            return unstable(
                format!(
                    "prefill alone needs {:.0} % of the node ({:.0} prompt tokens/s against {:.0})",
                    f * 100.0,
                    rate * work.prefilled(),
                    self.prefill_rate()
                ),
                0.0,
            );
        }
        // Fixed point of g(B) = λ·O·t(max(B, 1))/(1 − f): g is increasing and its slope is below
        // one wherever the node keeps up, so iteration from 0 climbs to the smallest solution.
        let g = |b: f64| rate * work.output_tokens * self.step_s(b.max(1.0)) / (1.0 - f);
        let cap = self.max_batch as f64;
        let mut b = 0.0;
        let mut solved = false;
        for _ in 0..10_000 {
            let next = g(b);
            if next > cap * 4.0 {
                break;
            }
            if (next - b).abs() <= 1e-9 * next.max(1.0) {
                b = next;
                solved = true;
                break;
            }
            b = next;
        }
        if !solved || b > cap {
            let most = self.most_tokens_per_s(f);
            return unstable(
                format!(
                    "decode cannot keep up: {:.0} output tokens/s asked, at most {most:.0} with \
                     {:.0} % of the time in prefill (batch limit {})",
                    rate * work.output_tokens,
                    f * 100.0,
                    self.max_batch
                ),
                b.min(cap),
            );
        }
        let step = self.step_s(b.max(1.0));
        let itl = step / (1.0 - f);
        // Waiting for the prefills ahead (M/D/1 at utilization f), then the prompt's own
        // prefill, then on average half a step to join the batch.
        let wait = f / (2.0 * (1.0 - f)) * prefill_s;
        NodeState {
            requests_per_s: rate,
            output_tokens_per_s: rate * work.output_tokens,
            batch: b,
            prefill_share: f,
            itl_ms: itl * 1e3,
            ttft_ms: (prefill_s + wait + step / 2.0) * 1e3,
            stable: true,
            limit: None,
        }
    }

    /// The most decode tokens per second a node delivers with `f` of its time in prefill.
    fn most_tokens_per_s(&self, f: f64) -> f64 {
        let b = self.max_batch as f64;
        b / self.step_s(b) * (1.0 - f)
    }

    /// `clients` each keeping one request in flight: a request takes its prefill and `O` steps
    /// stretched by the others' prefills, `X·(P/R + O·t(B)/(1 − X·P/R)) = B`, solved for the
    /// request rate `X` by bisection (the left side grows with X).
    fn closed_loop(&self, work: &Workload, clients: f64) -> NodeState {
        let prefill_s = work.prefilled() / self.prefill_rate();
        let batch = clients.min(self.max_batch as f64);
        let step = self.step_s(batch.max(1.0));
        let latency = |x: f64| prefill_s + work.output_tokens * step / (1.0 - x * prefill_s);
        let (mut lo, mut hi) = (0.0, 1.0 / prefill_s);
        for _ in 0..200 {
            let mid = 0.5 * (lo + hi);
            if mid * latency(mid) < batch {
                lo = mid;
            } else {
                hi = mid;
            }
        }
        let x = lo;
        let f = x * prefill_s;
        NodeState {
            requests_per_s: x,
            output_tokens_per_s: x * work.output_tokens,
            batch,
            prefill_share: f,
            itl_ms: step / (1.0 - f) * 1e3,
            ttft_ms: (prefill_s + step / 2.0) * 1e3,
            stable: true,
            limit: (clients > self.max_batch as f64).then(|| {
                format!(
                    "{clients:.0} clients per node exceed its batch limit {}: the rest queue",
                    self.max_batch
                )
            }),
        }
    }

    /// The cluster of `nodes` nodes under `work`: each node's state, the total, whether the
    /// targets are met, and (open loop) the headroom.
    pub fn cluster(&self, work: &Workload, nodes: usize) -> ClusterState {
        let per_node = self.node(work, nodes);
        let meets = meets(&per_node, work);
        let headroom = match work.load {
            Load::Rate(_) if meets => Some(self.headroom(work, nodes)),
            Load::Rate(_) => Some(0.0),
            Load::Concurrency(_) => None,
        };
        ClusterState {
            nodes,
            gpus: nodes.saturating_mul(self.gpus_per_node),
            output_tokens_per_s: per_node.output_tokens_per_s * nodes as f64,
            per_node,
            meets_targets: meets,
            headroom,
        }
    }

    /// The largest factor (to 1 %) the load can grow by with `nodes` nodes still meeting the
    /// targets; at least 1 when they are met now.
    fn headroom(&self, work: &Workload, nodes: usize) -> f64 {
        let ok = |k: f64| meets(&self.node(&work.scaled(k), nodes), work);
        let (mut lo, mut hi) = (1.0, 2.0);
        while ok(hi) && hi < 1e6 {
            lo = hi;
            hi *= 2.0;
        }
        while hi / lo > 1.01 {
            let mid = (lo * hi).sqrt();
            if ok(mid) {
                lo = mid;
            } else {
                hi = mid;
            }
        }
        lo
    }

    /// The fewest nodes (at most [`MAX_NODES`]) meeting `work`'s targets.
    pub fn size(&self, work: &Workload) -> Result<Plan, PlanError> {
        work.check()?;
        self.check()?;
        // Meeting the targets only gets easier with more nodes: bisect on the node count.
        let ok = |n: usize| meets(&self.node(work, n), work);
        if !ok(MAX_NODES) {
            let state = self.node(work, MAX_NODES);
            return Err(PlanError::Unreachable {
                profile: self.name.clone(),
                max: MAX_NODES,
                why: state.limit.clone().unwrap_or_else(|| miss(&state, work)),
            });
        }
        let (mut lo, mut hi) = (0, MAX_NODES);
        while hi - lo > 1 {
            let mid = (lo + hi) / 2;
            if ok(mid) {
                hi = mid;
            } else {
                lo = mid;
            }
        }
        Ok(self.plan(work, hi))
    }

    /// The cluster of exactly `nodes` nodes (a what-if), as a plan.
    pub fn evaluate(&self, work: &Workload, nodes: usize) -> Result<Plan, PlanError> {
        work.check()?;
        self.check()?;
        if nodes == 0 {
            return Err(PlanError::Workload(
                "a cluster needs at least one node".into(),
            ));
        }
        Ok(self.plan(work, nodes))
    }

    fn plan(&self, work: &Workload, nodes: usize) -> Plan {
        let mut sources: Vec<FigureSource> = self
            .decode
            .iter()
            .map(|p| FigureSource {
                figure: format!("decode step at batch {}, ms", p.batch),
                value: p.step_ms,
                source: p.source.clone(),
            })
            .collect();
        sources.push(FigureSource {
            figure: format!(
                "prefill rate at {} prompt tokens, tokens/s",
                self.prefill.prompt_tokens
            ),
            value: self.prefill.tokens_per_s,
            source: self.prefill.source.clone(),
        });
        Plan {
            profile: self.name.clone(),
            device: self.device.clone(),
            model: self.model.clone(),
            workload: work.clone(),
            cluster: self.cluster(work, nodes),
            sources,
        }
    }
}

fn meets(state: &NodeState, work: &Workload) -> bool {
    state.stable
        && state.limit.is_none()
        && work.itl_ms.is_none_or(|t| state.itl_ms <= t)
        && work.ttft_ms.is_none_or(|t| state.ttft_ms <= t)
}

fn miss(state: &NodeState, work: &Workload) -> String {
    let mut why = Vec::new();
    if let Some(t) = work.itl_ms
        && state.itl_ms > t
    {
        why.push(format!(
            "inter-token latency {:.1} ms > {t} ms even at one request per node at a time",
            state.itl_ms
        ));
    }
    if let Some(t) = work.ttft_ms
        && state.ttft_ms > t
    {
        why.push(format!(
            "time to first token {:.0} ms > {t} ms (the prompt's own prefill)",
            state.ttft_ms
        ));
    }
    why.join("; ")
}

#[cfg(test)]
mod tests;
