use strata_engine_api::kv::{BlockHash, KvDump, KvEvent, KvEventKind, Tier};

use super::*;

fn stored(seq: u64, hash: u128, tier: Tier) -> KvEvent {
    KvEvent {
        seq,
        kind: KvEventKind::Stored {
            hash: BlockHash(hash),
            parent: None,
            tier,
        },
    }
}

fn chain(hashes: &[u128]) -> Vec<BlockHash> {
    hashes.iter().map(|&h| BlockHash(h)).collect()
}

/// Two nodes: slot a holds blocks 1, 2, 3 on the device; slot b holds 1 on the host and 2 on
/// disk, but not 3.
fn two_nodes() -> (PrefixIndex, Slot, Slot) {
    let mut index = PrefixIndex::new();
    let a = index.add_node().unwrap();
    let b = index.add_node().unwrap();
    for (seq, h) in [1, 2, 3].into_iter().enumerate() {
        index
            .apply(a, &stored(seq as u64 + 1, h, Tier::Device))
            .unwrap();
    }
    index.apply(b, &stored(1, 1, Tier::Host)).unwrap();
    index.apply(b, &stored(2, 2, Tier::Disk)).unwrap();
    (index, a, b)
}

#[test]
fn overlap_counts_each_nodes_gapless_prefix_with_tier_credit() {
    let (index, a, b) = two_nodes();
    let o = index.overlap(&chain(&[1, 2, 3, 4]), [1.0, 0.75, 0.25]);
    assert_eq!(o.blocks[a.index()], 3);
    assert_eq!(o.blocks[b.index()], 2);
    assert_eq!(o.credit[a.index()], 3.0);
    assert_eq!(o.credit[b.index()], 1.0);
    // A gap ends a node's prefix even if later blocks are held.
    let o = index.overlap(&chain(&[9, 1, 2]), [1.0; 3]);
    assert_eq!(o.blocks[a.index()], 0);
}

#[test]
fn events_move_and_remove_blocks_and_gaps_are_refused() {
    let (mut index, a, _) = two_nodes();
    let moved = KvEvent {
        seq: 4,
        kind: KvEventKind::TierChanged {
            hash: BlockHash(2),
            from: Tier::Device,
            to: Tier::Disk,
        },
    };
    index.apply(a, &moved).unwrap();
    let o = index.overlap(&chain(&[1, 2]), [1.0, 0.75, 0.25]);
    assert_eq!(o.credit[a.index()], 1.25);
    let removed = KvEvent {
        seq: 5,
        kind: KvEventKind::Removed {
            hash: BlockHash(1),
            tier: Tier::Device,
        },
    };
    index.apply(a, &removed).unwrap();
    assert_eq!(
        index.overlap(&chain(&[1, 2]), [1.0; 3]).blocks[a.index()],
        0
    );
    assert_eq!(index.node_state(a), Some((2, 5)));
    // Replayed events are ignored; a skipped one is a gap.
    index.apply(a, &stored(5, 77, Tier::Device)).unwrap();
    assert_eq!(
        index.apply(a, &stored(7, 77, Tier::Device)),
        Err(IndexError::Gap {
            slot: a.index(),
            expected: 6,
            got: 7
        })
    );
    // Removing a block the node never had is a contradiction (resync from a dump).
    let bogus = KvEvent {
        seq: 6,
        kind: KvEventKind::Removed {
            hash: BlockHash(1234),
            tier: Tier::Device,
        },
    };
    assert!(matches!(
        index.apply(a, &bogus),
        Err(IndexError::Mismatch { .. })
    ));
}

#[test]
fn a_dump_replaces_the_nodes_view_and_removing_a_node_forgets_its_blocks() {
    let (mut index, a, b) = two_nodes();
    let dump = KvDump {
        seq: 40,
        blocks: vec![
            (BlockHash(1), None, Tier::Host),
            (BlockHash(5), None, Tier::Device),
        ],
    };
    index.load_dump(a, &dump).unwrap();
    assert_eq!(index.node_state(a), Some((2, 40)));
    let o = index.overlap(&chain(&[1, 2]), [1.0, 0.75, 0.25]);
    assert_eq!((o.blocks[a.index()], o.credit[a.index()]), (1, 0.75));
    index.remove_node(b).unwrap();
    assert_eq!(index.node_state(b), None);
    assert_eq!(index.len(), 2, "only a's blocks 1 and 5 remain");
    assert_eq!(
        index.apply(b, &stored(3, 1, Tier::Device)),
        Err(IndexError::UnknownSlot(b.index()))
    );
    // The slot is reused, empty.
    assert_eq!(index.add_node().unwrap(), b);
    assert_eq!(index.node_state(b), Some((0, 0)));
}

#[test]
fn the_index_holds_at_most_max_nodes() {
    let mut index = PrefixIndex::new();
    for _ in 0..MAX_NODES {
        index.add_node().unwrap();
    }
    assert_eq!(index.add_node(), Err(IndexError::Full));
}

fn candidate(slot: Slot, used: u64) -> Candidate {
    Candidate {
        slot,
        ring_id: slot.index() as u64 * 7919 + 1,
        vnodes: VNODES_PER_GPU,
        load: NodeLoad {
            queued_prefill_tokens: 0,
            active_blocks: used,
            capacity_blocks: 100,
        },
    }
}

#[test]
fn cache_aware_prefers_the_longest_cached_prefix_unless_its_node_is_busy() {
    let (index, a, b) = two_nodes();
    let mut router = Router::new(Policy::default());
    let req = chain(&[1, 2, 3, 4]);
    let d = router
        .route(&index, &[candidate(a, 10), candidate(b, 10)], &req, 1, 16)
        .unwrap();
    assert_eq!((d.slot, d.cached_blocks, d.reason), (a, 3, Reason::Cache));
    // a is nearly full: 3 blocks of credit minus 4 × 0.95 loses to b's 1.0 minus 4 × 0.
    let d = router
        .route(&index, &[candidate(a, 95), candidate(b, 0)], &req, 1, 16)
        .unwrap();
    assert_eq!((d.slot, d.reason), (b, Reason::Cache));
}

#[test]
fn an_uncached_prefix_goes_to_its_ring_owner_under_bounded_load() {
    let mut index = PrefixIndex::new();
    let slots: Vec<Slot> = (0..8).map(|_| index.add_node().unwrap()).collect();
    let mut router = Router::new(Policy::default());
    let idle: Vec<Candidate> = slots.iter().map(|&s| candidate(s, 0)).collect();
    let mut owners = std::collections::HashMap::new();
    for key in 0..800u128 {
        let key = key.wrapping_mul(0x9e37_79b9_7f4a_7c15_f39c_c060_5ced_c835);
        let d = router
            .route(&index, &idle, &chain(&[key]), key, 16)
            .unwrap();
        assert_eq!(d.reason, Reason::Ring);
        // Stable: the same key, the same owner.
        let again = router
            .route(&index, &idle, &chain(&[key]), key, 16)
            .unwrap();
        assert_eq!(again.slot, d.slot);
        *owners.entry(d.slot).or_insert(0) += 1;
    }
    assert_eq!(owners.len(), 8, "every node owns some prefixes");
    assert!(owners.values().all(|&n| n > 50), "{owners:?}");
    // The owner of a key, loaded far above the mean, is skipped for the next node on the ring.
    let key = 12345u128;
    let owner = router
        .route(&index, &idle, &chain(&[key]), key, 16)
        .unwrap()
        .slot;
    let loaded: Vec<Candidate> = slots
        .iter()
        .map(|&s| candidate(s, if s == owner { 90 } else { 10 }))
        .collect();
    let d = router
        .route(&index, &loaded, &chain(&[key]), key, 16)
        .unwrap();
    assert_ne!(d.slot, owner);
    assert_eq!(d.reason, Reason::Ring);
}

#[test]
fn round_robin_cycles_and_least_loaded_picks_the_emptiest() {
    let (index, a, b) = two_nodes();
    let nodes = [candidate(a, 50), candidate(b, 20)];
    let mut rr = Router::new(Policy::RoundRobin);
    let picks: Vec<Slot> = (0..4)
        .map(|_| rr.route(&index, &nodes, &[], 0, 16).unwrap().slot)
        .collect();
    assert_eq!(picks, vec![a, b, a, b]);
    let mut ll = Router::new(Policy::LeastLoaded);
    assert_eq!(ll.route(&index, &nodes, &[], 0, 16).unwrap().slot, b);
    assert_eq!(ll.route(&index, &[], &[], 0, 16), None);
}

#[test]
fn policies_read_from_config() {
    let p: Policy = serde_json::from_str(r#"{"policy": "round_robin"}"#).unwrap();
    assert_eq!(p, Policy::RoundRobin);
    let p: Policy =
        serde_json::from_str(r#"{"policy": "cache_aware", "load_weight": 2.0}"#).unwrap();
    let Policy::CacheAware(c) = p else {
        panic!("cache aware expected")
    };
    assert_eq!(c.load_weight, 2.0);
    assert_eq!(c.credits, [1.0, 0.75, 0.25]);
    assert!(serde_json::from_str::<Policy>(r#"{"policy": "cache_aware", "lod": 1}"#).is_err());
}

/// Every decision names the candidate holding the most of the prompt: where the chosen node
/// would fetch the rest from.
#[test]
fn decisions_name_the_best_holder() {
    let (index, a, b) = two_nodes();
    let nodes = [candidate(a, 0), candidate(b, 0)];
    let prompt = chain(&[1, 2, 3, 4]);
    let mut rr = Router::new(Policy::RoundRobin);
    let first = rr.route(&index, &nodes, &prompt, 1, 16).unwrap();
    let second = rr.route(&index, &nodes, &prompt, 1, 16).unwrap();
    assert_eq!((first.slot, first.cached_blocks), (a, 3));
    assert_eq!((second.slot, second.cached_blocks), (b, 2));
    assert_eq!(first.holder, Some((a, 3)));
    assert_eq!(second.holder, Some((a, 3)));
    // Without `a`, `b` holds the most.
    let only_b = rr.route(&index, &nodes[1..], &prompt, 1, 16).unwrap();
    assert_eq!(only_b.holder, Some((b, 2)));
    // Nobody holds an unknown prompt.
    let cold = rr.route(&index, &nodes, &chain(&[7, 8]), 7, 16).unwrap();
    assert_eq!(cold.holder, None);
}

/// For a prefix no node holds, every router picks the owner the topology group's ring names:
/// the same member ids and virtual nodes give the same owner for every key.
#[test]
fn cold_prefixes_go_to_the_groups_ring_owner() {
    use strata_topology::ring::OwnershipRing;
    let mut index = PrefixIndex::new();
    let members = [(11u64, 8u32), (42, 16), (7, 8), (99, 24)];
    let nodes: Vec<Candidate> = members
        .iter()
        .map(|&(id, vnodes)| Candidate {
            ring_id: id,
            vnodes,
            ..candidate(index.add_node().unwrap(), 10)
        })
        .collect();
    let mut ring = OwnershipRing::default();
    ring.update(members.into_iter().collect());
    let mut router = Router::new(Policy::default());
    let mut owners = std::collections::HashMap::new();
    for key in 0..2000u128 {
        let prefix_key = key.wrapping_mul(0x9e37_79b9_7f4a_7c15_f39c_c060_5ced_c834);
        let decision = router
            .route(&index, &nodes, &chain(&[prefix_key]), prefix_key, 16)
            .unwrap();
        assert_eq!(decision.reason, Reason::Ring);
        let chosen = nodes.iter().find(|n| n.slot == decision.slot).unwrap();
        assert_eq!(
            Some(chosen.ring_id),
            ring.owner(&prefix_key.to_le_bytes()),
            "key {key}"
        );
        *owners.entry(chosen.ring_id).or_insert(0) += 1;
    }
    // Weighted by virtual nodes: 99 (24) owns about three times what 11 (8) owns.
    assert!(owners[&99] > 2 * owners[&11], "{owners:?}");
}
