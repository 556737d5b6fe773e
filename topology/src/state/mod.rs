//! The replicated cluster state and its deterministic `apply`.
//!
//! `ClusterState` is plain data; `apply` is a pure function of (state, command). Nothing here
//! reads a clock, a random source or the environment, and every collection is ordered, so two
//! replicas applying the same entries hold equal states and serialize them to equal bytes.

mod command;
mod health;
mod join_tokens;
mod members;
mod placement;
mod routers;
mod tenants;

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

pub use command::{Applied, Change, Command, Outcome, Rejection};
pub use health::{Health, HealthPolicy, HealthTransition, Lease};
pub use join_tokens::{DEFAULT_JOIN_TOKEN_TTL_MS, JoinToken, JoinTokens, UnixMillis};
pub use members::{Capacity, Gpu, Member, MemberAddresses, MemberSpec, NodeId, RaftRole};
pub use placement::{ModelPlacement, PlacementRequest, TpGroup, place};
pub use routers::{RouterRegistration, RouterRegistry};
pub use tenants::{ApiKey, Tenant, TenantRegistry};

use crate::ring::{OwnershipRing, VNODES_PER_GPU};

#[cfg(test)]
pub(crate) use members::test_spec;

/// Everything the group agrees on.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ClusterState {
    /// Group time: the largest `at_ms` applied.
    clock_ms: u64,
    health_policy: HealthPolicy,
    members: BTreeMap<NodeId, Member>,
    placements: BTreeMap<String, ModelPlacement>,
    ring: OwnershipRing,
    tenants: TenantRegistry,
    routers: RouterRegistry,
    /// Absent in states written before join tokens existed.
    #[serde(default)]
    join_tokens: JoinTokens,
    /// Identities the group no longer accepts (absent in states written before revocation).
    #[serde(default)]
    revoked: Revoked,
}

/// Certificates the group has withdrawn: members that left and operators revoked by name. Every
/// member refuses a call whose peer certificate names one of them, raft's included; member ids
/// are never reused (each is assigned above every id a token ever admitted), so a revoked id
/// names one identity forever.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Revoked {
    pub members: std::collections::BTreeSet<NodeId>,
    pub operators: std::collections::BTreeSet<String>,
}

impl ClusterState {
    pub fn clock_ms(&self) -> u64 {
        self.clock_ms
    }

    pub fn health_policy(&self) -> &HealthPolicy {
        &self.health_policy
    }

    pub fn members(&self) -> &BTreeMap<NodeId, Member> {
        &self.members
    }

    pub fn placements(&self) -> &BTreeMap<String, ModelPlacement> {
        &self.placements
    }

    pub fn ring(&self) -> &OwnershipRing {
        &self.ring
    }

    pub fn tenants(&self) -> &TenantRegistry {
        &self.tenants
    }

    pub fn routers(&self) -> &RouterRegistry {
        &self.routers
    }

    pub fn join_tokens(&self) -> &JoinTokens {
        &self.join_tokens
    }

    pub fn revoked(&self) -> &Revoked {
        &self.revoked
    }

    /// Applies one command. A rejected command leaves the state as it was, except that group
    /// time still advances (the entry was committed at that time).
    pub fn apply(&mut self, command: &Command) -> Outcome {
        self.clock_ms = self.clock_ms.max(command.at_ms);
        let now = self.clock_ms;
        let mut applied = Applied::default();
        match &command.change {
            Change::AddMember(spec) => self.add_member(spec, now)?,
            Change::UpdateMember(spec) => applied.removed = self.update_member(spec)?,
            Change::RemoveMember { id } => applied.removed = self.remove_member(*id)?,
            Change::SetRole { id, role } => self.member_mut(*id)?.spec.role = *role,
            Change::Heartbeat { id } => {
                let member = self.member_mut(*id)?;
                applied.transitions.extend(member.lease.renew(*id, now));
            }
            Change::EvaluateLeases => applied.transitions = self.evaluate_leases(now),
            Change::SetHealthPolicy(policy) => {
                if !policy.is_valid() {
                    return Err(Rejection::InvalidHealthPolicy);
                }
                self.health_policy = *policy;
            }
            Change::PlaceModel(request) => applied.placed = self.place_model(request)?,
            Change::RemoveModel { model } => {
                self.placements
                    .remove(model)
                    .ok_or_else(|| Rejection::NotFound(format!("model `{model}`")))?;
            }
            Change::PutTenant { name } => self.tenants.put_tenant(name, now)?,
            Change::RemoveTenant { name } => applied.removed = self.tenants.remove_tenant(name)?,
            Change::PutApiKey { id, tenant, sha256 } => {
                self.tenants.put_key(id, tenant, sha256, now)?
            }
            Change::RevokeApiKey { id } => self.tenants.revoke_key(id)?,
            Change::RegisterRouter { id, http_addr } => {
                self.routers.register(id, http_addr, now)?
            }
            Change::DeregisterRouter { id } => self.routers.deregister(id)?,
            Change::RevokeMember { id } => {
                // A member is revoked once it has left: its record goes first (`cluster leave`).
                if self.members.contains_key(id) {
                    return Err(Rejection::InvalidMember {
                        id: *id,
                        why: "still a member; remove it before revoking its certificate".into(),
                    });
                }
                self.revoked.members.insert(*id);
            }
            Change::RevokeOperator { name } => {
                if !tenants::valid_name(name) {
                    return Err(Rejection::InvalidName(name.clone()));
                }
                self.revoked.operators.insert(name.clone());
            }
            Change::PutJoinToken { sha256, ttl_ms } => {
                self.join_tokens.put(sha256, now, *ttl_ms)?
            }
            Change::ConsumeJoinToken {
                sha256,
                id,
                key_sha256,
            } => {
                if self.members.contains_key(id) {
                    return Err(Rejection::MemberExists(*id));
                }
                self.join_tokens
                    .consume(sha256, *id, key_sha256.as_deref(), now)?
            }
        }
        self.ring.update(self.live_ring_members());
        applied.ring_epoch = self.ring.epoch();
        Ok(applied)
    }

    fn add_member(&mut self, spec: &MemberSpec, now: u64) -> Result<(), Rejection> {
        spec.validate()?;
        if self.members.contains_key(&spec.id) {
            return Err(Rejection::MemberExists(spec.id));
        }
        let member = Member {
            spec: spec.clone(),
            lease: Lease::new(now),
        };
        self.members.insert(spec.id, member);
        Ok(())
    }

    /// Replaces a member's declaration; returns how many placement groups it invalidated.
    fn update_member(&mut self, spec: &MemberSpec) -> Result<usize, Rejection> {
        spec.validate()?;
        self.member_mut(spec.id)?.spec = spec.clone();
        // Groups on GPUs the member no longer declares cannot run.
        let declared = |index: &u32| spec.gpus.iter().any(|gpu| gpu.index == *index);
        Ok(self.drop_groups(|g| g.node == spec.id && !g.gpus.iter().all(declared)))
    }

    /// Removes a member; returns how many placement groups went with it.
    fn remove_member(&mut self, id: NodeId) -> Result<usize, Rejection> {
        self.members
            .remove(&id)
            .ok_or(Rejection::UnknownMember(id))?;
        Ok(self.drop_groups(|g| g.node == id))
    }

    fn evaluate_leases(&mut self, now: u64) -> Vec<HealthTransition> {
        let policy = self.health_policy;
        self.members
            .iter_mut()
            .filter_map(|(id, member)| member.lease.evaluate(*id, &policy, now))
            .collect()
    }

    fn place_model(&mut self, request: &PlacementRequest) -> Result<Vec<TpGroup>, Rejection> {
        let groups = place(request, &self.members, &self.placements)?;
        let placement = ModelPlacement {
            request: request.clone(),
            groups: groups.clone(),
        };
        self.placements.insert(request.model.clone(), placement);
        Ok(groups)
    }

    /// The outcome of an entry that carries no command (raft's blank and membership
    /// entries): nothing changed.
    pub fn unchanged(&self) -> Applied {
        Applied {
            ring_epoch: self.ring.epoch(),
            ..Applied::default()
        }
    }

    /// Drops every placement group matching `doomed`; returns how many went. A model left
    /// with fewer groups keeps its request, so an operator (or a later controller) can
    /// re-place it.
    fn drop_groups(&mut self, doomed: impl Fn(&TpGroup) -> bool) -> usize {
        let mut dropped = 0;
        for placement in self.placements.values_mut() {
            let before = placement.groups.len();
            placement.groups.retain(|g| !doomed(g));
            dropped += before - placement.groups.len();
        }
        dropped
    }

    fn member_mut(&mut self, id: NodeId) -> Result<&mut Member, Rejection> {
        self.members
            .get_mut(&id)
            .ok_or(Rejection::UnknownMember(id))
    }

    /// Members that own a share of the ring: every member not down, weighted by GPUs.
    fn live_ring_members(&self) -> BTreeMap<NodeId, u32> {
        self.members
            .iter()
            .filter(|(_, m)| m.lease.health != Health::Down)
            .map(|(&id, m)| {
                let gpus = u32::try_from(m.spec.gpus.len()).unwrap_or(u32::MAX).max(1);
                (id, gpus.saturating_mul(VNODES_PER_GPU))
            })
            .collect()
    }
}

#[cfg(test)]
mod tests;
