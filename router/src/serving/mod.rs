//! The serving core under the surfaces: a request's run through the engine as text
//! ([`generation::Generation`]), one assistant turn with stop sequences and parking
//! ([`turn::Turn`]), and what a request used ([`usage::UsageBody`]). OpenAI, Anthropic and Converse
//! depend on it and never on each other; each dresses its errors ([`crate::error::ApiError`]) in
//! its own shape.

pub mod generation;
pub mod turn;
pub mod usage;
