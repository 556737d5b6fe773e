//! Named pins over the block manager: the blocks of primed contexts and marked prefixes, kept
//! cached (in some tier) until unpinned or expired.

use std::collections::HashSet;
use std::time::Instant;

use super::{BlockManager, KvError};
use crate::kv::types::{BlockHash, Tier};

/// A named, pinned prefix: the blocks of a primed context, kept cached (in some tier) until it is
/// unpinned or expires. Pinned blocks are evicted from a tier only after every unpinned one, and
/// never from the lowest tier.
#[derive(Debug, Clone)]
pub(super) struct Pin {
    pub(super) hashes: Vec<BlockHash>,
    pub(super) expires: Option<Instant>,
}

/// Where a pinned prefix's blocks are now.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PinStatus {
    pub name: String,
    /// Blocks pinned (the leading cached run of the hashes given when pinning).
    pub blocks: usize,
    /// How many of them are on the device, in host memory and on disk now.
    pub device: usize,
    pub host: usize,
    pub disk: usize,
    pub expires: Option<Instant>,
}

impl BlockManager {
    /// Pins the leading cached run of `hashes` under `name` (replacing a pin of that name) until
    /// `expires`. Refused when the pinned blocks of every pin would exceed what the lowest tier
    /// holds (disk, else host; with neither, half the device), so unpinned traffic always has
    /// room.
    pub fn pin(
        &mut self,
        name: &str,
        hashes: &[BlockHash],
        expires: Option<Instant>,
    ) -> Result<PinStatus, KvError> {
        let cached = hashes
            .iter()
            .take_while(|h| self.index.contains_key(h))
            .count();
        let hashes = hashes[..cached].to_vec();
        // The hashes pinned once this pin replaces any of the same name.
        let old: HashSet<BlockHash> = self
            .pins
            .get(name)
            .map(|p| p.hashes.iter().copied().collect())
            .unwrap_or_default();
        let mut after: HashSet<BlockHash> = self
            .pinned
            .iter()
            .filter(|(h, holders)| !(**holders == 1 && old.contains(h)))
            .map(|(h, _)| *h)
            .collect();
        after.extend(&hashes);
        let room = self.pin_room();
        if after.len() > room {
            return Err(KvError::PinCapacity {
                needed: after.len(),
                room,
            });
        }
        self.unpin(name);
        for hash in &hashes {
            *self.pinned.entry(*hash).or_insert(0) += 1;
        }
        self.pins.insert(name.to_string(), Pin { hashes, expires });
        Ok(self.pin_status(name).expect("just pinned"))
    }

    /// Blocks all pins together may hold: the lowest tier's capacity (half the device's when
    /// there is no lower tier).
    pub fn pin_room(&self) -> usize {
        match (&self.disk, self.host.capacity()) {
            (Some(disk), _) if disk.capacity() > 0 => disk.capacity(),
            (_, host) if host > 0 => host,
            _ => self.blocks.len() / 2,
        }
    }

    /// Drops the pin `name`; whether there was one. Its blocks stay cached, unpinned.
    pub fn unpin(&mut self, name: &str) -> bool {
        let Some(pin) = self.pins.remove(name) else {
            return false;
        };
        for hash in pin.hashes {
            if let Some(holders) = self.pinned.get_mut(&hash) {
                *holders -= 1;
                if *holders == 0 {
                    self.pinned.remove(&hash);
                }
            }
        }
        true
    }

    /// Drops the pins that expired by `now`.
    pub fn expire_pins(&mut self, now: Instant) {
        if self.pins.is_empty() {
            return;
        }
        let expired: Vec<String> = self
            .pins
            .iter()
            .filter(|(_, p)| p.expires.is_some_and(|e| e <= now))
            .map(|(name, _)| name.clone())
            .collect();
        for name in expired {
            self.unpin(&name);
        }
    }

    /// Where the blocks of pin `name` are now.
    pub fn pin_status(&self, name: &str) -> Option<PinStatus> {
        let pin = self.pins.get(name)?;
        let mut status = PinStatus {
            name: name.to_string(),
            blocks: pin.hashes.len(),
            device: 0,
            host: 0,
            disk: 0,
            expires: pin.expires,
        };
        for hash in &pin.hashes {
            match self.tier_of(*hash) {
                Some(Tier::Device) => status.device += 1,
                Some(Tier::Host) => status.host += 1,
                Some(Tier::Disk) => status.disk += 1,
                None => {}
            }
        }
        Some(status)
    }

    /// Every pin, by name.
    pub fn pin_statuses(&self) -> Vec<PinStatus> {
        let mut names: Vec<&String> = self.pins.keys().collect();
        names.sort();
        names
            .into_iter()
            .filter_map(|n| self.pin_status(n))
            .collect()
    }
}
