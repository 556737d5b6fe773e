//! The mixture-of-experts fields of config.json (Qwen2-MoE, Qwen3-MoE, Mixtral): how many
//! experts, how many each token uses, their width, which layers are sparse, and Qwen2-MoE's
//! shared expert.

use serde::Deserialize;

use super::Architecture;

/// A sparse MLP: a router scores every expert per token (a linear map to `experts` logits, a
/// softmax in f32), the top `experts_per_token` run (each a gated MLP of width
/// `expert_intermediate`), and their outputs are summed weighted by their probabilities.
#[derive(Debug, Clone, PartialEq)]
pub struct Moe {
    pub experts: usize,
    pub experts_per_token: usize,
    pub expert_intermediate: usize,
    /// Whether the chosen probabilities are divided by their sum (Qwen's `norm_topk_prob`;
    /// Mixtral always).
    pub norm_topk_prob: bool,
    /// Per layer: whether its MLP is sparse (the others are dense, `intermediate_size` wide).
    pub sparse_layers: Vec<bool>,
    /// Qwen2-MoE's shared expert: its width (it runs for every token, scaled by a sigmoid gate).
    pub shared_expert_intermediate: Option<usize>,
}

impl Moe {
    /// Whether layer `layer`'s MLP is sparse.
    pub fn is_sparse(&self, layer: usize) -> bool {
        self.sparse_layers.get(layer).copied().unwrap_or(false)
    }
}

/// The raw MoE fields (flattened into the config's raw fields).
#[derive(Debug, Default, Deserialize)]
pub(super) struct RawMoe {
    num_experts: Option<usize>,
    num_local_experts: Option<usize>,
    num_experts_per_tok: Option<usize>,
    moe_intermediate_size: Option<usize>,
    shared_expert_intermediate_size: Option<usize>,
    norm_topk_prob: Option<bool>,
    decoder_sparse_step: Option<usize>,
    mlp_only_layers: Option<Vec<usize>>,
    /// Qwen2-MoE's name for the q/k/v biases (true when absent).
    pub(super) qkv_bias: Option<bool>,
    // Routing variants of other families, refused by name.
    n_group: Option<serde_json::Value>,
    topk_group: Option<serde_json::Value>,
    scoring_func: Option<String>,
    topk_method: Option<String>,
    n_shared_experts: Option<serde_json::Value>,
}

impl RawMoe {
    /// The mixture `arch` describes with these fields, over `layers` layers whose dense MLPs
    /// are `intermediate` wide.
    pub(super) fn parse(
        &self,
        arch: Architecture,
        layers: usize,
        intermediate: usize,
    ) -> Result<Moe, String> {
        self.refuse_variants()?;
        let positive = |v: Option<usize>, name: &str| match v {
            Some(0) => Err(format!("{name} must be > 0")),
            Some(n) => Ok(n),
            None => Err(format!("missing required field {name}")),
        };
        let (experts, expert_intermediate) = match arch {
            Architecture::Mixtral => (
                positive(self.num_local_experts, "num_local_experts")?,
                intermediate,
            ),
            _ => (
                positive(self.num_experts, "num_experts")?,
                positive(self.moe_intermediate_size, "moe_intermediate_size")?,
            ),
        };
        let experts_per_token = positive(self.num_experts_per_tok, "num_experts_per_tok")?;
        if experts_per_token > experts {
            return Err(format!(
                "num_experts_per_tok ({experts_per_token}) exceeds the {experts} experts"
            ));
        }
        let sparse_layers = match arch {
            Architecture::Mixtral => vec![true; layers],
            _ => {
                let step = positive(self.decoder_sparse_step.or(Some(1)), "decoder_sparse_step")?;
                let dense = self.mlp_only_layers.clone().unwrap_or_default();
                if let Some(bad) = dense.iter().find(|&&l| l >= layers) {
                    return Err(format!(
                        "mlp_only_layers names layer {bad} of a {layers}-layer model"
                    ));
                }
                (0..layers)
                    .map(|l| !dense.contains(&l) && (l + 1) % step == 0)
                    .collect()
            }
        };
        let shared_expert_intermediate = match arch {
            Architecture::Qwen2Moe => Some(positive(
                self.shared_expert_intermediate_size,
                "shared_expert_intermediate_size",
            )?),
            _ if self.shared_expert_intermediate_size.is_some_and(|n| n > 0) => {
                return Err(format!(
                    "shared_expert_intermediate_size is not part of {arch} (only \
                     Qwen2MoeForCausalLM has a shared expert)"
                ));
            }
            _ => None,
        };
        Ok(Moe {
            experts,
            experts_per_token,
            expert_intermediate,
            norm_topk_prob: arch == Architecture::Mixtral || self.norm_topk_prob == Some(true),
            sparse_layers,
            shared_expert_intermediate,
        })
    }

    /// A dense family's config carrying expert fields: refused rather than run dense.
    pub(super) fn refuse_without(&self, arch: Architecture) -> Result<(), String> {
        let counts = [self.num_experts, self.num_local_experts];
        if counts.iter().flatten().any(|&n| n > 0) {
            return Err(format!(
                "{arch} with experts (num_experts / num_local_experts) is not supported: \
                 mixtures of experts load as Qwen2MoeForCausalLM, Qwen3MoeForCausalLM or \
                 MixtralForCausalLM"
            ));
        }
        Ok(())
    }

    /// Routing this engine does not implement (DeepSeek's grouped top-k, sigmoid scoring,
    /// several shared experts): refused by name rather than computed wrongly.
    fn refuse_variants(&self) -> Result<(), String> {
        let set = |v: &Option<serde_json::Value>| v.as_ref().is_some_and(|v| !v.is_null());
        for (name, present) in [
            ("n_group (grouped top-k routing)", set(&self.n_group)),
            ("topk_group (grouped top-k routing)", set(&self.topk_group)),
            ("n_shared_experts", set(&self.n_shared_experts)),
            ("topk_method", self.topk_method.is_some()),
        ] {
            if present {
                return Err(format!("{name} is not supported"));
            }
        }
        match self.scoring_func.as_deref() {
            None | Some("softmax") => Ok(()),
            Some(other) => Err(format!(
                "scoring_func \"{other}\" is not supported (only softmax routing)"
            )),
        }
    }
}
