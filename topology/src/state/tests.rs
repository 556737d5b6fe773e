use super::*;

fn cmd(at_ms: u64, change: Change) -> Command {
    Command::new(at_ms, change)
}

fn three_members() -> Vec<Command> {
    vec![
        cmd(1_000, Change::AddMember(test_spec(1, &[(0, 0), (1, 0)]))),
        cmd(1_000, Change::AddMember(test_spec(2, &[(0, 0), (1, 0)]))),
        cmd(1_000, Change::AddMember(test_spec(3, &[(0, 0), (1, 1)]))),
    ]
}

fn apply_all(state: &mut ClusterState, commands: &[Command]) -> Vec<Outcome> {
    commands.iter().map(|c| state.apply(c)).collect()
}

#[test]
fn members_join_into_the_ring_one_epoch_each() {
    let mut s = ClusterState::default();
    let out = apply_all(&mut s, &three_members());
    let epochs: Vec<u64> = out.iter().map(|o| o.as_ref().unwrap().ring_epoch).collect();
    assert_eq!(epochs, vec![1, 2, 3]);
    assert_eq!(s.ring().members().len(), 3);
    assert_eq!(s.ring().members()[&1], 2 * crate::ring::VNODES_PER_GPU);
    assert_eq!(
        s.apply(&cmd(1_001, Change::AddMember(test_spec(1, &[])))),
        Err(Rejection::MemberExists(1))
    );
    assert_eq!(
        s.ring().epoch(),
        3,
        "a rejected command does not move the ring"
    );
}

#[test]
fn missed_heartbeats_walk_suspect_then_down_and_only_down_moves_the_ring() {
    let mut s = ClusterState::default();
    apply_all(&mut s, &three_members());
    let policy = *s.health_policy();
    // Nodes 1 and 2 keep heartbeating; node 3 goes silent after joining at 1_000.
    let t_suspect = 1_000 + policy.suspect_after_ms;
    for id in [1, 2] {
        s.apply(&cmd(t_suspect - 1, Change::Heartbeat { id }))
            .unwrap();
    }
    let out = s.apply(&cmd(t_suspect, Change::EvaluateLeases)).unwrap();
    assert_eq!(out.transitions.len(), 1);
    let t = out.transitions[0];
    assert_eq!(
        (t.node, t.from, t.to, t.at_ms),
        (3, Health::Alive, Health::Suspect, t_suspect)
    );
    assert_eq!(out.ring_epoch, 3, "a suspect member keeps its share");

    let t_down = 1_000 + policy.down_after_ms;
    for id in [1, 2] {
        s.apply(&cmd(t_down - 1, Change::Heartbeat { id })).unwrap();
    }
    let out = s.apply(&cmd(t_down, Change::EvaluateLeases)).unwrap();
    assert_eq!(out.transitions.len(), 1);
    assert_eq!(out.transitions[0].to, Health::Down);
    assert_eq!(out.ring_epoch, 4);
    assert!(!s.ring().members().contains_key(&3));

    // Evaluating again commits nothing new.
    let out = s.apply(&cmd(t_down + 1, Change::EvaluateLeases)).unwrap();
    assert!(out.transitions.is_empty());
    assert_eq!(out.ring_epoch, 4);

    // The member comes back.
    let out = s
        .apply(&cmd(t_down + 2, Change::Heartbeat { id: 3 }))
        .unwrap();
    assert_eq!(out.transitions[0].to, Health::Alive);
    assert_eq!(out.ring_epoch, 5);
    assert_eq!(s.members()[&3].lease.since_ms, t_down + 2);
}

#[test]
fn group_time_never_moves_backwards() {
    let mut s = ClusterState::default();
    apply_all(&mut s, &three_members());
    s.apply(&cmd(50_000, Change::Heartbeat { id: 1 })).unwrap();
    // A new leader whose clock is behind proposes a heartbeat and an evaluation.
    s.apply(&cmd(2_000, Change::Heartbeat { id: 2 })).unwrap();
    assert_eq!(s.clock_ms(), 50_000);
    assert_eq!(s.members()[&2].lease.renewed_ms, 50_000);
    let out = s.apply(&cmd(2_001, Change::EvaluateLeases)).unwrap();
    // Node 3 last renewed at 1_000, judged at group time 50_000: down.
    let down: Vec<NodeId> = out
        .transitions
        .iter()
        .filter(|t| t.to == Health::Down)
        .map(|t| t.node)
        .collect();
    assert_eq!(down, vec![3]);
}

#[test]
fn join_tokens_expire_at_group_time_carried_by_the_log() {
    let put = |sha: &str, ttl_ms| Change::PutJoinToken {
        sha256: sha.repeat(32),
        ttl_ms,
    };
    let consume = |sha: &str, id| Change::ConsumeJoinToken {
        sha256: sha.repeat(32),
        id,
        key_sha256: None,
    };
    let log = vec![
        cmd(1_000, put("ab", 500)),
        cmd(1_000, put("cd", 500)),
        cmd(1_000, put("ef", 5_000)),
        // Within the TTL: admitted.
        cmd(1_499, consume("ab", 7)),
        // Stamped past the expiry by whoever proposed it: refused, spending nothing.
        cmd(1_500, consume("cd", 8)),
        // Some other entry moves group time on; a spend stamped by a slow clock afterwards is
        // judged at group time, not at its own stamp.
        cmd(9_000, Change::EvaluateLeases),
        cmd(1_200, consume("ef", 9)),
    ];
    let mut replica = ClusterState::default();
    let outcomes = apply_all(&mut replica, &log);
    assert!(outcomes[3].is_ok(), "{:?}", outcomes[3]);
    assert_eq!(
        outcomes[4],
        Err(Rejection::JoinTokenExpired {
            expired_ms: 1_500,
            now_ms: 1_500
        })
    );
    assert_eq!(
        outcomes[6],
        Err(Rejection::JoinTokenExpired {
            expired_ms: 6_000,
            now_ms: 9_000
        })
    );
    let message = outcomes[6].clone().unwrap_err().to_string();
    assert!(
        message.contains("expired at 1970-01-01T00:00:06.000Z"),
        "{message}"
    );
    let tokens = replica.join_tokens().tokens();
    assert_eq!(tokens[&"ab".repeat(32)].consumed_by, Some(7));
    for expired in ["cd", "ef"] {
        let token = &tokens[&expired.repeat(32)];
        assert_eq!(token.consumed_by, None, "an expired token stays unspent");
        assert!(token.expired(replica.clock_ms()));
    }
    // Whatever each replica's own clock says, the same log gives the same verdicts.
    let mut other = ClusterState::default();
    assert_eq!(apply_all(&mut other, &log), outcomes);
    assert_eq!(other, replica);
}

#[test]
fn placement_is_stored_and_removing_a_member_drops_its_groups() {
    let mut s = ClusterState::default();
    apply_all(&mut s, &three_members());
    let request = PlacementRequest {
        model: "llama".into(),
        tp_size: 2,
        replicas: 3,
        min_gpu_memory_mib: 0,
        required_labels: BTreeMap::new(),
        experts: 0,
    };
    let out = s.apply(&cmd(1_100, Change::PlaceModel(request))).unwrap();
    let nodes: Vec<(NodeId, bool)> = out.placed.iter().map(|g| (g.node, g.linked)).collect();
    // Node 3's GPUs span two links, so it is chosen last.
    assert_eq!(nodes, vec![(1, true), (2, true), (3, false)]);
    assert_eq!(s.placements()["llama"].groups, out.placed);

    let out = s
        .apply(&cmd(1_200, Change::RemoveMember { id: 2 }))
        .unwrap();
    assert_eq!(out.removed, 1);
    assert!(s.placements()["llama"].groups.iter().all(|g| g.node != 2));
    assert_eq!(
        s.apply(&cmd(
            1_300,
            Change::RemoveModel {
                model: "nope".into()
            }
        )),
        Err(Rejection::NotFound("model `nope`".into()))
    );
}

#[test]
fn rejections_leave_state_unchanged_but_for_the_clock() {
    let mut s = ClusterState::default();
    apply_all(&mut s, &three_members());
    let before = s.clone();
    let bad = [
        Change::Heartbeat { id: 99 },
        Change::SetHealthPolicy(HealthPolicy {
            suspect_after_ms: 10,
            down_after_ms: 5,
        }),
        Change::UpdateMember(MemberSpec {
            addresses: MemberAddresses {
                raft: String::new(),
                rpc: String::new(),
            },
            ..test_spec(1, &[])
        }),
        Change::PutApiKey {
            id: "k".into(),
            tenant: "none".into(),
            sha256: "00".repeat(32),
        },
        Change::DeregisterRouter { id: "r".into() },
    ];
    for change in bad {
        assert!(s.apply(&cmd(1_000, change)).is_err());
    }
    assert_eq!(s, before);
}

#[test]
fn replicas_applying_the_same_log_serialize_identically() {
    let mut log = three_members();
    log.extend([
        cmd(
            1_500,
            Change::PutTenant {
                name: "acme".into(),
            },
        ),
        cmd(
            1_600,
            Change::PutApiKey {
                id: "k1".into(),
                tenant: "acme".into(),
                sha256: "ab".repeat(32),
            },
        ),
        cmd(
            1_700,
            Change::RegisterRouter {
                id: "r1".into(),
                http_addr: "10.0.0.9:8080".into(),
            },
        ),
        cmd(
            1_800,
            Change::SetRole {
                id: 3,
                role: RaftRole::Learner,
            },
        ),
        cmd(20_000, Change::EvaluateLeases),
        cmd(20_001, Change::Heartbeat { id: 2 }),
    ]);
    let (mut a, mut b) = (ClusterState::default(), ClusterState::default());
    let out_a = apply_all(&mut a, &log);
    let out_b = apply_all(&mut b, &log);
    assert_eq!(out_a, out_b);
    assert_eq!(a, b);
    let bytes = serde_json::to_vec(&a).unwrap();
    assert_eq!(bytes, serde_json::to_vec(&b).unwrap());
    let back: ClusterState = serde_json::from_slice(&bytes).unwrap();
    assert_eq!(back, a);
    assert_eq!(a.members()[&3].spec.role, RaftRole::Learner);
    assert_eq!(
        a.ring().members().keys().copied().collect::<Vec<_>>(),
        vec![2]
    );
    assert!(a.tenants().key_by_sha256(&"ab".repeat(32)).is_some());
    assert_eq!(a.routers().routers().len(), 1);
}

/// A small deterministic generator, so the random-sequence tests replay exactly.
struct XorShift(u64);

impl XorShift {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }

    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
}

fn random_command(rng: &mut XorShift, at_ms: u64) -> Command {
    let id = 1 + rng.below(6);
    let change = match rng.below(14) {
        0 => {
            let gpus: Vec<(u32, u32)> = (0..rng.below(5) as u32).map(|i| (i, i / 2)).collect();
            Change::AddMember(test_spec(id, &gpus))
        }
        1 if rng.below(2) == 0 => Change::RemoveMember { id },
        1 => {
            let gpus: Vec<(u32, u32)> = (0..rng.below(5) as u32).map(|i| (i, i % 2)).collect();
            Change::UpdateMember(test_spec(id, &gpus))
        }
        2..=4 => Change::Heartbeat { id },
        5 | 6 => Change::EvaluateLeases,
        7 => Change::PlaceModel(PlacementRequest {
            model: format!("m{}", rng.below(3)),
            tp_size: 1 + rng.below(2) as u32,
            replicas: 1 + rng.below(3) as u32,
            min_gpu_memory_mib: 0,
            required_labels: BTreeMap::new(),
            experts: 0,
        }),
        8 => Change::RemoveModel {
            model: format!("m{}", rng.below(3)),
        },
        9 => Change::PutTenant {
            name: format!("t{}", rng.below(4)),
        },
        10 => Change::PutApiKey {
            id: format!("k{}", rng.below(8)),
            tenant: format!("t{}", rng.below(4)),
            sha256: format!("{:064x}", rng.below(8)),
        },
        11 => Change::PutJoinToken {
            sha256: format!("{:064x}", rng.below(4)),
            ttl_ms: rng.below(3_000),
        },
        12 => Change::ConsumeJoinToken {
            sha256: format!("{:064x}", rng.below(4)),
            id: 6 + rng.below(4),
            key_sha256: [None, Some("11".repeat(32))][rng.below(2) as usize].clone(),
        },
        _ => Change::RemoveTenant {
            name: format!("t{}", rng.below(4)),
        },
    };
    Command::new(at_ms, change)
}

/// Invariants every reachable state keeps.
fn check_invariants(s: &ClusterState) {
    let live: Vec<NodeId> = s
        .members()
        .iter()
        .filter(|(_, m)| m.lease.health != Health::Down)
        .map(|(&id, _)| id)
        .collect();
    assert_eq!(s.ring().members().keys().copied().collect::<Vec<_>>(), live);
    let mut held = std::collections::BTreeSet::new();
    for placement in s.placements().values() {
        for group in &placement.groups {
            let member = s.members().get(&group.node).expect("group on a member");
            for gpu in &group.gpus {
                assert!(member.spec.gpus.iter().any(|g| g.index == *gpu));
                assert!(held.insert((group.node, *gpu)), "GPU given twice");
            }
        }
    }
    for key in s.tenants().keys().values() {
        assert!(s.tenants().tenants().contains_key(&key.tenant));
    }
    let mut admitted = std::collections::BTreeSet::new();
    for token in s.join_tokens().tokens().values() {
        assert!(token.expires_ms >= token.issued_ms);
        if let Some(id) = token.consumed_by {
            assert!(admitted.insert(id), "member {id} admitted twice");
        }
    }
}

#[test]
fn random_logs_keep_invariants_and_snapshot_replay_matches_direct_apply() {
    let (mut spent, mut expired) = (0, 0);
    for seed in 1..=20u64 {
        let mut rng = XorShift(seed.wrapping_mul(0x9e37_79b9_7f4a_7c15));
        let mut at_ms = 0;
        let log: Vec<Command> = (0..400)
            .map(|_| {
                // Time mostly advances, sometimes jumps back (a leader with a slower clock).
                at_ms = (at_ms + rng.below(2_000)).saturating_sub(rng.below(4) * 500);
                random_command(&mut rng, at_ms)
            })
            .collect();
        let mut direct = ClusterState::default();
        let mut last_epoch = 0;
        let outcomes: Vec<Outcome> = log
            .iter()
            .map(|c| {
                let outcome = direct.apply(c);
                check_invariants(&direct);
                assert!(direct.ring().epoch() >= last_epoch);
                last_epoch = direct.ring().epoch();
                outcome
            })
            .collect();
        assert!(
            outcomes.iter().filter(|o| o.is_ok()).count() > 100,
            "seed {seed}: too few applied"
        );
        for (command, outcome) in log.iter().zip(&outcomes) {
            match (&command.change, outcome) {
                (Change::ConsumeJoinToken { .. }, Ok(_)) => spent += 1,
                (_, Err(Rejection::JoinTokenExpired { .. })) => expired += 1,
                _ => {}
            }
        }

        // A replica that restarts from a snapshot midway ends in the same state, with the
        // same outcomes for the entries after the snapshot.
        let cut = 150 + (seed as usize * 7) % 100;
        let mut replica = ClusterState::default();
        apply_all(&mut replica, &log[..cut]);
        let bytes = serde_json::to_vec(&replica).unwrap();
        let mut restored: ClusterState = serde_json::from_slice(&bytes).unwrap();
        assert_eq!(
            apply_all(&mut restored, &log[cut..]),
            outcomes[cut..].to_vec()
        );
        assert_eq!(restored, direct, "seed {seed}");
    }
    assert!(spent > 0 && expired > 0, "spent {spent}, expired {expired}");
}

#[test]
fn a_member_is_revoked_only_once_removed_and_operators_by_valid_name() {
    let mut s = ClusterState::default();
    s.apply(&cmd(1, Change::AddMember(test_spec(2, &[]))))
        .unwrap();
    assert!(matches!(
        s.apply(&cmd(2, Change::RevokeMember { id: 2 })),
        Err(Rejection::InvalidMember { id: 2, .. })
    ));
    assert!(
        s.revoked().members.is_empty(),
        "a refused revocation changed the list"
    );
    s.apply(&cmd(3, Change::RemoveMember { id: 2 })).unwrap();
    s.apply(&cmd(4, Change::RevokeMember { id: 2 })).unwrap();
    s.apply(&cmd(5, Change::RevokeMember { id: 2 })).unwrap();
    assert_eq!(s.revoked().members, [2].into());
    let bad = Change::RevokeOperator {
        name: "two words".into(),
    };
    assert!(matches!(
        s.apply(&cmd(6, bad)),
        Err(Rejection::InvalidName(_))
    ));
    let alice = Change::RevokeOperator {
        name: "alice".into(),
    };
    s.apply(&cmd(7, alice)).unwrap();
    assert_eq!(s.revoked().operators, ["alice".to_string()].into());
    // A state written before revocation existed reads with nothing revoked.
    let mut old = serde_json::to_value(ClusterState::default()).unwrap();
    old.as_object_mut().unwrap().remove("revoked");
    let old: ClusterState = serde_json::from_value(old).unwrap();
    assert!(old.revoked().members.is_empty() && old.revoked().operators.is_empty());
}
