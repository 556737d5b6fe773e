//! Request routing across nodes: the exact prefix index fed by each node's KV events, and the
//! policy that scores nodes by cached prefix and load (DESIGN.md §6).

mod index;
mod policy;
#[cfg(test)]
mod tests;

pub use index::{IndexError, MAX_NODES, Overlap, PrefixIndex, Slot};
pub use policy::{Candidate, Decision, NodeLoad, Policy, Reason, Router, RoutingConfig};
