//! Disk blocks read on threads ahead of the promotions that need them. A restore from the disk
//! tier reads one file per block; read one after another on the engine thread, a disk's queue
//! stays nearly empty and the thread's own work (the copy to the device, the bookkeeping) adds
//! to every read. Readers run ahead of the promotions by a bounded window instead, in any order,
//! and the engine thread takes each block's bytes when it promotes it.

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::mpsc;
use std::time::Duration;

use super::KvError;
use super::tiers::read_block_file;
use super::types::{BlockHash, BlockHashMap};

/// Blocks read ahead of the latest promotion at most (2 MiB each for Llama-3.1-8B), and the
/// threads reading them.
const WINDOW: usize = 32;
const READERS: usize = 8;

/// A block's bytes as read, for [`BlockManager`](super::BlockManager)'s promotions; `None` for a
/// block that is not read ahead.
pub(super) type Fetch<'a> = dyn FnMut(BlockHash) -> Option<Result<Vec<u8>, KvError>> + 'a;

/// Runs `body` while `files` (a restore's disk blocks, in the order it promotes them, each with
/// its file) are read ahead on threads; `body` takes each block's bytes through the fetch it is
/// given. Readers stop when `body` returns.
pub(super) fn with_read_ahead<R>(
    files: Vec<(BlockHash, PathBuf)>,
    block_bytes: usize,
    body: impl FnOnce(&mut Fetch<'_>) -> R,
) -> R {
    if files.is_empty() {
        return body(&mut |_| None);
    }
    let next = AtomicUsize::new(0);
    let taken = AtomicUsize::new(0);
    let stop = AtomicBool::new(false);
    std::thread::scope(|scope| {
        let (tx, rx) = mpsc::channel();
        for _ in 0..READERS.min(files.len()) {
            let (tx, files, next, taken, stop) = (tx.clone(), &files, &next, &taken, &stop);
            scope.spawn(move || {
                loop {
                    let i = next.fetch_add(1, Ordering::Relaxed);
                    if i >= files.len() {
                        return;
                    }
                    while i >= taken.load(Ordering::Acquire) + WINDOW {
                        if stop.load(Ordering::Acquire) {
                            return;
                        }
                        std::thread::sleep(Duration::from_micros(100));
                    }
                    if stop.load(Ordering::Acquire) {
                        return;
                    }
                    let mut bytes = Vec::new();
                    let read = read_block_file(&files[i].1, block_bytes, &mut bytes);
                    if tx.send((i, read.map(|()| bytes))).is_err() {
                        return;
                    }
                }
            });
        }
        drop(tx);
        let order: BlockHashMap<usize> = files
            .iter()
            .enumerate()
            .map(|(i, (h, _))| (*h, i))
            .collect();
        let mut arrived = HashMap::new();
        let mut fetch = |hash: BlockHash| {
            let i = *order.get(&hash)?;
            taken.fetch_max(i + 1, Ordering::Release);
            loop {
                if let Some(read) = arrived.remove(&i) {
                    return Some(read);
                }
                let (j, read) = rx.recv().ok()?;
                arrived.insert(j, read);
            }
        };
        let out = body(&mut fetch);
        stop.store(true, Ordering::Release);
        out
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_block_arrives_with_its_own_bytes_in_any_order_of_reading() {
        let dir = tempfile::tempdir().unwrap();
        let mut tier = super::super::DiskTier::open(dir.path(), 100, 8).unwrap().0;
        let files: Vec<(BlockHash, PathBuf)> = (0..70u128)
            .map(|i| {
                let hash = BlockHash(i + 1);
                tier.insert(hash, None, &[i as u8; 8]).unwrap();
                (hash, tier.block_path(hash))
            })
            .collect();
        let got = with_read_ahead(files.clone(), 8, |fetch| {
            // Out of order, and one block not in the run: it is not read ahead.
            let mut got: Vec<Vec<u8>> = files
                .iter()
                .rev()
                .map(|(h, _)| fetch(*h).unwrap().unwrap())
                .collect();
            assert!(fetch(BlockHash(999)).is_none());
            got.reverse();
            got
        });
        for (i, bytes) in got.iter().enumerate() {
            assert_eq!(bytes, &vec![i as u8; 8]);
        }
        // A body that stops early ends the readers too.
        let first = with_read_ahead(files.clone(), 8, |fetch| fetch(files[0].0));
        assert_eq!(first.unwrap().unwrap(), vec![0u8; 8]);
    }
}
