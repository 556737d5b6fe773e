//! Submitting a request: what an engine checks before it takes one ([`Admission`]), why it
//! refuses ([`SubmitError`]), and the stream a taken request's events arrive on.

use strata_model::ModelConfig;
use strata_model::grammar::{ConstrainedDecoder, GrammarCompiler, GrammarError};
use strata_model::sampler::{Sampler, SamplerError};
use strata_protocol::{GenerateRequest, TokenEvent};
use tokio::sync::mpsc::UnboundedReceiver;

/// Why a request was refused at submission, with the numbers.
#[derive(Debug, thiserror::Error)]
pub enum SubmitError {
    #[error("the prompt is empty")]
    EmptyPrompt,
    #[error(
        "prompt of {prompt} tokens exceeds the context window of {window} (room is needed for at least one generated token)"
    )]
    ContextWindow { prompt: usize, window: usize },
    #[error(
        "prompt of {prompt} tokens needs {blocks} KV blocks but the device holds {capacity} blocks of {block_size} tokens{}",
        pinned_note(*.pinned)
    )]
    KvCapacity {
        prompt: usize,
        blocks: usize,
        /// Blocks a request can have: the device's, less those only pins hold.
        capacity: usize,
        block_size: usize,
        /// Device blocks held by pinned cached prefixes (not counted in `capacity`).
        pinned: usize,
    },
    #[error("token id {token} is outside the vocabulary of {vocab_size}")]
    TokenOutOfRange { token: u32, vocab_size: usize },
    #[error(transparent)]
    Sampling(#[from] SamplerError),
    #[error(transparent)]
    Grammar(#[from] GrammarError),
    #[error("this engine has no grammar compiler, so it cannot constrain output")]
    GrammarUnavailable,
    #[error(
        "the request resumes after {output} generated tokens, which spends its max_tokens of {max_tokens}"
    )]
    ResumeSpent { output: usize, max_tokens: u32 },
    #[error(
        "this engine does not compute embeddings (its backend returns no hidden states: a \
         tensor-parallel engine, for now)"
    )]
    NoEmbeddings,
    #[error("an embedding request generates nothing: it takes no output constraint or resume")]
    EmbedWithGeneration,
    #[error("the engine has stopped")]
    Stopped,
    /// A remote node refused the request (the router's view of a node's [`SubmitError`]).
    #[error(transparent)]
    Remote(crate::rpc::Refusal),
}

/// What a request must satisfy to be admitted: the checks of the engine's `submit`, also run by
/// a router before it sends a request to a remote node.
pub struct Admission<'a> {
    pub config: &'a ModelConfig,
    pub block_size: usize,
    /// KV blocks of the device (of the smallest node, for a router).
    pub device_blocks: usize,
    /// Of those, blocks only pinned cached prefixes hold (as of the engine's last step).
    pub pinned_blocks: usize,
    pub grammar: Option<&'a GrammarCompiler>,
    /// Whether the backend computes embeddings (`Backend::embeds` in strata-node).
    pub embeds: bool,
}

/// The part of a KV-capacity refusal that names the pinned blocks, if any.
fn pinned_note(pinned: usize) -> String {
    if pinned == 0 {
        String::new()
    } else {
        format!(
            " besides {pinned} held by pinned cached prefixes (unpin them, wait for their TTL, or \
             give the engine a host KV tier)"
        )
    }
}

impl Admission<'_> {
    /// The request's sampler and compiled constraint, or why it cannot run.
    pub fn admit(
        &self,
        request: &GenerateRequest,
    ) -> Result<(Sampler, Option<ConstrainedDecoder>), SubmitError> {
        let window = self.config.max_position_embeddings;
        if request.prompt.is_empty() {
            return Err(SubmitError::EmptyPrompt);
        }
        if request.embed.is_some() {
            if !self.embeds {
                return Err(SubmitError::NoEmbeddings);
            }
            if request.constraint.is_some() || request.resume.is_some() {
                return Err(SubmitError::EmbedWithGeneration);
            }
        }
        // Room for one generated token, unless the request only embeds its prompt.
        let room = usize::from(request.embed.is_none());
        let output = request.resume.as_ref().map_or(&[][..], |r| &r.output[..]);
        if room > 0 && output.len() >= request.sampling.max_tokens as usize {
            return Err(SubmitError::ResumeSpent {
                output: output.len(),
                max_tokens: request.sampling.max_tokens,
            });
        }
        // A continued request holds its output in the KV like its prompt.
        let prompt = request.prompt.len() + output.len();
        if prompt + room > window {
            return Err(SubmitError::ContextWindow { prompt, window });
        }
        let blocks = (prompt + room).div_ceil(self.block_size);
        let capacity = self.device_blocks.saturating_sub(self.pinned_blocks);
        if blocks > capacity {
            return Err(SubmitError::KvCapacity {
                prompt,
                blocks,
                capacity,
                block_size: self.block_size,
                pinned: self.pinned_blocks,
            });
        }
        let vocab_size = self.config.vocab_size;
        let tokens = request.prompt.iter().chain(output);
        if let Some(&token) = tokens.into_iter().find(|&&t| t as usize >= vocab_size) {
            return Err(SubmitError::TokenOutOfRange { token, vocab_size });
        }
        let mut sampler = Sampler::new(&request.sampling, vocab_size)?;
        let mut constraint = match &request.constraint {
            None => None,
            Some(c) => Some(
                self.grammar
                    .ok_or(SubmitError::GrammarUnavailable)?
                    .compile(c)?,
            ),
        };
        if let Some(resume) = &request.resume {
            sampler.resume(&resume.output, resume.rng_pos)?;
            if let Some(c) = constraint.as_mut() {
                for &token in &resume.output {
                    c.advance(token)?;
                }
            }
        }
        Ok((sampler, constraint))
    }
}

/// Events of one submitted request. Dropping it cancels the request.
pub struct RequestStream {
    pub id: u64,
    pub events: UnboundedReceiver<TokenEvent>,
}
