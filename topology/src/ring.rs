//! The ownership ring: which node owns a prefix no node has cached yet.
//!
//! Rendezvous (highest random weight) hashing over virtual nodes: every live member contributes
//! `vnodes` points; a key's owner is the member whose point scores highest for that key. Two
//! properties matter to routers:
//! - every router holding the same member set computes the same owner for every key, since the
//!   score is a fixed function of (key, member id, vnode index) and ties break on member id;
//! - when a member leaves, only the keys it owned move; when one joins, only keys it now wins
//!   move to it.
//!
//! The `epoch` names the member set: it increases by one each time the set of live members (or
//! a member's weight) changes, so routers can tell that they agree on the ring by comparing one
//! number.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};
use xxhash_rust::xxh3::{xxh3_64, xxh3_64_with_seed};

use crate::state::NodeId;

/// Virtual nodes a member gets per GPU (a member without GPUs counts as one).
pub const VNODES_PER_GPU: u32 = 8;

/// The agreed ring at one epoch.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct OwnershipRing {
    epoch: u64,
    /// Live members and their virtual node counts.
    members: BTreeMap<NodeId, u32>,
}

impl OwnershipRing {
    pub fn epoch(&self) -> u64 {
        self.epoch
    }

    pub fn members(&self) -> &BTreeMap<NodeId, u32> {
        &self.members
    }

    pub fn is_empty(&self) -> bool {
        self.members.is_empty()
    }

    /// Replaces the member set; the epoch advances only if the set actually differs.
    /// Returns whether it did.
    pub fn update(&mut self, members: BTreeMap<NodeId, u32>) -> bool {
        let members: BTreeMap<NodeId, u32> = members.into_iter().filter(|&(_, v)| v > 0).collect();
        if members == self.members {
            return false;
        }
        self.members = members;
        self.epoch += 1;
        true
    }

    /// The member owning `key`, or `None` on an empty ring.
    pub fn owner(&self, key: &[u8]) -> Option<NodeId> {
        let hashed = key_hash(key);
        self.members
            .iter()
            .map(|(&node, &vnodes)| (member_score(hashed, node, vnodes), node))
            // Ties (astronomically rare) go to the smaller id: max_by_key keeps the last
            // maximum, and the iteration is by increasing id, so compare on reversed id.
            .max_by_key(|&(score, node)| (score, std::cmp::Reverse(node)))
            .map(|(_, node)| node)
    }

    /// Every member, best owner of `key` first: the order a router walks when the owner is
    /// over its load bound.
    pub fn ranked(&self, key: &[u8]) -> Vec<NodeId> {
        let hashed = key_hash(key);
        let mut scored: Vec<(u64, NodeId)> = self
            .members
            .iter()
            .map(|(&node, &vnodes)| (member_score(hashed, node, vnodes), node))
            .collect();
        scored.sort_by(|a, b| b.0.cmp(&a.0).then(a.1.cmp(&b.1)));
        scored.into_iter().map(|(_, node)| node).collect()
    }
}

/// A key's hash, the first argument of [`member_score`].
pub fn key_hash(key: &[u8]) -> u64 {
    xxh3_64(key)
}

/// The highest score among a member's virtual nodes for a key: the member that scores highest
/// owns the key (ties: the smaller id). Routers rank their candidates with it, so that they
/// agree with the group's ring without holding it.
pub fn member_score(key_hash: u64, node: NodeId, vnodes: u32) -> u64 {
    (0..vnodes)
        .map(|vnode| point_score(key_hash, node, vnode))
        .max()
        .unwrap_or(0)
}

/// A fixed, platform-independent function of (key, member, vnode): little-endian bytes hashed
/// with xxh3 seeded by the key's hash.
fn point_score(key_hash: u64, node: NodeId, vnode: u32) -> u64 {
    let mut bytes = [0u8; 12];
    bytes[..8].copy_from_slice(&node.to_le_bytes());
    bytes[8..].copy_from_slice(&vnode.to_le_bytes());
    xxh3_64_with_seed(&bytes, key_hash)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ring(members: &[(NodeId, u32)]) -> OwnershipRing {
        let mut ring = OwnershipRing::default();
        ring.update(members.iter().copied().collect());
        ring
    }

    fn owners(ring: &OwnershipRing, n: u32) -> Vec<NodeId> {
        (0..n)
            .map(|i| ring.owner(&i.to_le_bytes()).expect("non-empty ring"))
            .collect()
    }

    #[test]
    fn empty_ring_has_no_owner() {
        let ring = OwnershipRing::default();
        assert_eq!(ring.owner(b"x"), None);
        assert!(ring.ranked(b"x").is_empty());
    }

    #[test]
    fn owner_is_a_fixed_function_of_key_and_members() {
        // Pinned values: a change of hash, byte order or tie rule would make routers running
        // different builds disagree on owners, so it must fail here first.
        let ring = ring(&[(1, 8), (2, 8), (3, 8)]);
        assert_eq!(owners(&ring, 12), vec![1, 2, 3, 2, 2, 2, 1, 2, 1, 1, 2, 1]);
        assert_eq!(ring.ranked(b"abc"), vec![1, 2, 3]);
        let mut same_members_other_order = OwnershipRing::default();
        same_members_other_order.update([(3, 8), (1, 8), (2, 8)].into_iter().collect());
        assert_eq!(owners(&same_members_other_order, 12), owners(&ring, 12));
    }

    #[test]
    fn equal_members_share_keys_evenly() {
        let ring = ring(&[(1, 8), (2, 8), (3, 8), (4, 8)]);
        let mut counts = BTreeMap::new();
        for owner in owners(&ring, 20_000) {
            *counts.entry(owner).or_insert(0u32) += 1;
        }
        for (node, count) in counts {
            // 5000 expected each; 10% tolerance is many standard deviations wide.
            assert!((4_500..=5_500).contains(&count), "node {node} owns {count}");
        }
    }

    #[test]
    fn vnodes_weight_ownership() {
        let ring = ring(&[(1, 8), (2, 24)]);
        let heavy = owners(&ring, 20_000).iter().filter(|&&n| n == 2).count();
        // 24 of 32 points: about 75%.
        assert!(
            (14_000..=16_000).contains(&heavy),
            "heavy member owns {heavy}"
        );
    }

    #[test]
    fn leaving_member_moves_only_its_own_keys() {
        let before = ring(&[(1, 8), (2, 8), (3, 8), (4, 8)]);
        let after = ring(&[(1, 8), (2, 8), (4, 8)]);
        let (a, b) = (owners(&before, 10_000), owners(&after, 10_000));
        let mut moved_from_3 = 0;
        for (x, y) in a.iter().zip(&b) {
            if x == &3 {
                assert_ne!(y, &3);
                moved_from_3 += 1;
            } else {
                assert_eq!(x, y, "a key not owned by the leaver moved");
            }
        }
        assert!(moved_from_3 > 2_000);
    }

    #[test]
    fn ranked_lists_every_member_once() {
        let ring = ring(&[(5, 8), (9, 8), (2, 8)]);
        let mut ranked = ring.ranked(b"prefix");
        assert_eq!(ranked.len(), 3);
        ranked.sort();
        assert_eq!(ranked, vec![2, 5, 9]);
    }

    #[test]
    fn epoch_advances_only_when_members_change() {
        let mut ring = OwnershipRing::default();
        assert!(ring.update([(1, 8), (2, 8)].into_iter().collect()));
        assert_eq!(ring.epoch(), 1);
        assert!(!ring.update([(2, 8), (1, 8)].into_iter().collect()));
        assert_eq!(ring.epoch(), 1);
        assert!(
            ring.update([(1, 8), (2, 16)].into_iter().collect()),
            "weight change"
        );
        assert_eq!(ring.epoch(), 2);
        assert!(
            !ring.update([(1, 8), (2, 16), (3, 0)].into_iter().collect()),
            "zero weight is absent"
        );
        assert_eq!(ring.epoch(), 2);
    }
}
