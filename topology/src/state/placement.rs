//! Placement: which nodes serve a model, and on which GPUs each tensor-parallel group runs.
//!
//! A placement is computed once, when its command is applied, from the members and the GPUs
//! other models already hold; it is then stored, so later changes elsewhere never move it
//! silently. The computation is deterministic (ordered maps, ties broken by node id and GPU
//! index), which is what lets every replica store the same result.
//!
//! Preferences, in order, for each replica:
//! 1. a node that does not yet serve this model (replicas spread over failures);
//! 2. a group whose GPUs share one link group (NVLink pair or island) over one that spans links;
//! 3. the tightest fit: the link group (or node) left with the fewest free GPUs, so large
//!    islands stay whole for large groups;
//! 4. the smaller node id.

use std::collections::{BTreeMap, BTreeSet};

use serde::{Deserialize, Serialize};

use super::Rejection;
use super::health::Health;
use super::members::{Member, NodeId};

/// The largest tensor-parallel group one node can host.
pub const MAX_TP_SIZE: u32 = 64;

/// What the operator asks for.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PlacementRequest {
    pub model: String,
    /// GPUs per tensor-parallel group; a group never spans nodes.
    pub tp_size: u32,
    /// Groups to run.
    pub replicas: u32,
    /// Every GPU of a group needs at least this much memory.
    pub min_gpu_memory_mib: u64,
    /// Only members carrying all of these labels qualify.
    pub required_labels: BTreeMap<String, String>,
    /// Experts per sparse layer of a mixture of experts (0: a dense model). A group's ranks
    /// hold an equal run of them each (expert parallel), so `tp_size` must divide it.
    #[serde(default)]
    pub experts: u32,
}

/// One tensor-parallel group: GPUs of one node.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct TpGroup {
    pub node: NodeId,
    /// Device indices, ascending; rank i runs on `gpus[i]`.
    pub gpus: Vec<u32>,
    /// Whether all of the group's GPUs share one link group.
    pub linked: bool,
    /// Of a mixture of experts: the experts rank i holds, `[start, end)` (the run the engine's
    /// tensor-parallel layout gives it); empty for a dense model.
    #[serde(default)]
    pub experts: Vec<[u32; 2]>,
}

/// A model's stored placement.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ModelPlacement {
    pub request: PlacementRequest,
    pub groups: Vec<TpGroup>,
}

/// A candidate group on one node, with the key it is ranked by (smaller is better).
struct Candidate {
    rank: (bool, bool, usize, NodeId),
    group: TpGroup,
}

/// Computes a placement for `request`, or says why none exists. `placements` are the other
/// models' placements, whose GPUs are taken; a previous placement of the same model is ignored
/// (re-placing a model may reuse its own GPUs).
pub fn place(
    request: &PlacementRequest,
    members: &BTreeMap<NodeId, Member>,
    placements: &BTreeMap<String, ModelPlacement>,
) -> Result<Vec<TpGroup>, Rejection> {
    validate(request)?;
    let mut taken: BTreeMap<NodeId, BTreeSet<u32>> = BTreeMap::new();
    for (model, placement) in placements {
        if model == &request.model {
            continue;
        }
        for group in &placement.groups {
            taken.entry(group.node).or_default().extend(&group.gpus);
        }
    }
    let tp = request.tp_size as usize;
    let mut groups: Vec<TpGroup> = Vec::new();
    for _ in 0..request.replicas {
        let best = members
            .values()
            .filter(|m| {
                m.lease.health == Health::Alive && m.spec.has_labels(&request.required_labels)
            })
            .filter_map(|m| {
                let free: Vec<(u32, u32)> = m
                    .spec
                    .gpus
                    .iter()
                    .filter(|g| g.memory_mib >= request.min_gpu_memory_mib)
                    .filter(|g| !taken.get(&m.spec.id).is_some_and(|t| t.contains(&g.index)))
                    .map(|g| (g.index, g.link_group))
                    .collect();
                let already = groups.iter().any(|g| g.node == m.spec.id);
                best_group_on_node(m.spec.id, &free, tp).map(|(group, leftover)| Candidate {
                    rank: (already, !group.linked, leftover, m.spec.id),
                    group,
                })
            })
            .min_by_key(|c| c.rank);
        let Some(candidate) = best else {
            return Err(Rejection::InsufficientCapacity {
                model: request.model.clone(),
                wanted: request.replicas,
                placeable: groups.len() as u32,
            });
        };
        taken
            .entry(candidate.group.node)
            .or_default()
            .extend(&candidate.group.gpus);
        groups.push(TpGroup {
            experts: expert_runs(request.experts, request.tp_size),
            ..candidate.group
        });
    }
    Ok(groups)
}

fn validate(request: &PlacementRequest) -> Result<(), Rejection> {
    let bad = |why: &str| {
        Err(Rejection::InvalidPlacement {
            model: request.model.clone(),
            why: why.to_string(),
        })
    };
    if request.model.trim().is_empty() {
        return bad("the model name is empty");
    }
    if request.tp_size == 0 || request.tp_size > MAX_TP_SIZE {
        return bad("tp_size must be between 1 and 64");
    }
    if request.replicas == 0 {
        return bad("replicas must be at least 1");
    }
    if !request.experts.is_multiple_of(request.tp_size) {
        return bad("tp_size must divide the experts (each rank holds an equal run of them)");
    }
    Ok(())
}

/// The experts each of `tp` ranks holds: equal runs in rank order.
pub fn expert_runs(experts: u32, tp: u32) -> Vec<[u32; 2]> {
    if experts == 0 {
        return Vec::new();
    }
    let per = experts / tp;
    (0..tp).map(|r| [r * per, (r + 1) * per]).collect()
}

/// The best group of `tp` GPUs among a node's free `(index, link_group)` GPUs, and how many
/// GPUs the chosen link group (or the node, for a spanning group) has left afterwards.
fn best_group_on_node(node: NodeId, free: &[(u32, u32)], tp: usize) -> Option<(TpGroup, usize)> {
    let mut by_link: BTreeMap<u32, Vec<u32>> = BTreeMap::new();
    for &(index, link) in free {
        by_link.entry(link).or_default().push(index);
    }
    let linked = by_link
        .values()
        .filter(|gpus| gpus.len() >= tp)
        .min_by_key(|gpus| gpus.len());
    if let Some(gpus) = linked {
        let mut chosen = gpus.clone();
        chosen.sort_unstable();
        let leftover = chosen.len() - tp;
        chosen.truncate(tp);
        return Some((
            TpGroup {
                node,
                gpus: chosen,
                linked: true,
                experts: Vec::new(),
            },
            leftover,
        ));
    }
    if free.len() < tp {
        return None;
    }
    let mut chosen: Vec<u32> = free.iter().map(|&(index, _)| index).collect();
    chosen.sort_unstable();
    let leftover = chosen.len() - tp;
    chosen.truncate(tp);
    // A single GPU is always "linked" to itself, so spanning groups only occur for tp >= 2.
    Some((
        TpGroup {
            node,
            gpus: chosen,
            linked: false,
            experts: Vec::new(),
        },
        leftover,
    ))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::state::health::Lease;
    use crate::state::members::test_spec;

    fn members(specs: &[(NodeId, &[(u32, u32)])]) -> BTreeMap<NodeId, Member> {
        specs
            .iter()
            .map(|&(id, gpus)| {
                (
                    id,
                    Member {
                        spec: test_spec(id, gpus),
                        lease: Lease::new(0),
                    },
                )
            })
            .collect()
    }

    fn request(model: &str, tp: u32, replicas: u32) -> PlacementRequest {
        PlacementRequest {
            model: model.into(),
            tp_size: tp,
            replicas,
            min_gpu_memory_mib: 0,
            required_labels: BTreeMap::new(),
            experts: 0,
        }
    }

    #[test]
    fn tp2_prefers_a_linked_pair_over_lower_indices() {
        // Node 1: GPUs 0 and 1 sit on different links; 2 and 3 form a pair.
        let m = members(&[(1, &[(0, 0), (1, 1), (2, 2), (3, 2)])]);
        let groups = place(&request("m", 2, 1), &m, &BTreeMap::new()).unwrap();
        assert_eq!(
            groups,
            vec![TpGroup {
                node: 1,
                gpus: vec![2, 3],
                linked: true,
                experts: Vec::new(),
            }]
        );
    }

    #[test]
    fn a_mixture_of_experts_records_each_ranks_experts() {
        let m = members(&[(1, &[(0, 0), (1, 0), (2, 0), (3, 0)])]);
        let moe = PlacementRequest {
            experts: 128,
            ..request("moe", 4, 1)
        };
        let groups = place(&moe, &m, &BTreeMap::new()).unwrap();
        assert_eq!(groups[0].experts, [[0, 32], [32, 64], [64, 96], [96, 128]]);
        // A degree that does not divide the experts is refused, naming why.
        let uneven = PlacementRequest {
            experts: 6,
            ..request("moe", 4, 1)
        };
        let err = place(&uneven, &m, &BTreeMap::new()).unwrap_err();
        assert!(format!("{err:?}").contains("divide the experts"), "{err:?}");
        // A record stored before the field existed still reads (as dense).
        let old = r#"{"model":"m","tp_size":2,"replicas":1,"min_gpu_memory_mib":0,
                      "required_labels":{}}"#;
        let read: PlacementRequest = serde_json::from_str(old).unwrap();
        assert_eq!(read.experts, 0);
    }

    #[test]
    fn linked_node_beats_smaller_id_with_spanning_gpus() {
        let m = members(&[(1, &[(0, 0), (1, 1)]), (2, &[(0, 0), (1, 0)])]);
        let groups = place(&request("m", 2, 1), &m, &BTreeMap::new()).unwrap();
        assert_eq!(groups[0].node, 2);
        assert!(groups[0].linked);
    }

    #[test]
    fn falls_back_to_spanning_group_when_no_pair_is_free() {
        let m = members(&[(1, &[(0, 0), (1, 1), (2, 2)])]);
        let groups = place(&request("m", 2, 1), &m, &BTreeMap::new()).unwrap();
        assert_eq!(groups[0].gpus, vec![0, 1]);
        assert!(!groups[0].linked);
    }

    #[test]
    fn replicas_spread_over_nodes_then_share() {
        let m = members(&[(1, &[(0, 0), (1, 0)]), (2, &[(0, 0), (1, 0)])]);
        let groups = place(&request("m", 1, 3), &m, &BTreeMap::new()).unwrap();
        let nodes: Vec<NodeId> = groups.iter().map(|g| g.node).collect();
        assert_eq!(nodes, vec![1, 2, 1]);
        assert_ne!(groups[0].gpus, groups[2].gpus, "a GPU is never given twice");
    }

    #[test]
    fn other_models_gpus_are_taken_and_capacity_is_checked() {
        let m = members(&[(1, &[(0, 0), (1, 0), (2, 1), (3, 1)])]);
        let mut placements = BTreeMap::new();
        let first = place(&request("a", 2, 1), &m, &placements).unwrap();
        placements.insert(
            "a".to_string(),
            ModelPlacement {
                request: request("a", 2, 1),
                groups: first.clone(),
            },
        );
        let second = place(&request("b", 2, 1), &m, &placements).unwrap();
        assert!(first[0].gpus.iter().all(|g| !second[0].gpus.contains(g)));
        let err = place(
            &request("c", 2, 1),
            &m,
            &placements_with(&placements, "b", &second),
        );
        assert_eq!(
            err,
            Err(Rejection::InsufficientCapacity {
                model: "c".into(),
                wanted: 1,
                placeable: 0
            })
        );
        // Re-placing "a" may reuse its own GPUs.
        assert!(
            place(
                &request("a", 2, 1),
                &m,
                &placements_with(&placements, "b", &second)
            )
            .is_ok()
        );
    }

    fn placements_with(
        base: &BTreeMap<String, ModelPlacement>,
        model: &str,
        groups: &[TpGroup],
    ) -> BTreeMap<String, ModelPlacement> {
        let mut p = base.clone();
        p.insert(
            model.to_string(),
            ModelPlacement {
                request: request(model, 2, 1),
                groups: groups.to_vec(),
            },
        );
        p
    }

    #[test]
    fn unhealthy_unlabelled_and_small_gpus_are_skipped() {
        let mut m = members(&[(1, &[(0, 0)]), (2, &[(0, 0)]), (3, &[(0, 0)])]);
        m.get_mut(&1).unwrap().lease.health = Health::Suspect;
        m.get_mut(&2)
            .unwrap()
            .spec
            .labels
            .insert("zone".into(), "b".into());
        m.get_mut(&3)
            .unwrap()
            .spec
            .labels
            .insert("zone".into(), "a".into());
        let mut req = request("m", 1, 1);
        req.required_labels.insert("zone".into(), "a".into());
        assert_eq!(place(&req, &m, &BTreeMap::new()).unwrap()[0].node, 3);
        req.min_gpu_memory_mib = 200 * 1024;
        assert!(place(&req, &m, &BTreeMap::new()).is_err());
    }

    #[test]
    fn invalid_requests_are_rejected() {
        let m = members(&[(1, &[(0, 0)])]);
        for bad in [request("", 1, 1), request("m", 0, 1), request("m", 1, 0)] {
            assert!(matches!(
                place(&bad, &m, &BTreeMap::new()),
                Err(Rejection::InvalidPlacement { .. })
            ));
        }
    }
}
