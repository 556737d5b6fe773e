//! The engine's vocabulary, what a router and the surfaces speak to an engine without linking
//! one (issue 37): KV block identities, events and dumps ([`kv`]); an engine's load and step
//! times ([`load`]); what submitting a request checks and how it is refused ([`submit`]); the
//! node RPC's messages and client ([`rpc`]); and the one seam between the surfaces and an
//! engine in this process ([`client`]). strata-node re-exports each at its old path.

pub mod client;
mod hash;
pub mod kv;
pub mod load;
pub mod rpc;
pub mod submit;
