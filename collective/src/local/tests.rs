use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::thread;
use std::time::{Duration, Instant};

use super::{DEFAULT_TIMEOUT, LocalCommunicator, LocalGroup};
use crate::{Collective, CollectiveError, CollectiveKind, Communicator, GroupPosition};

const WORLD_SIZES: [usize; 5] = [1, 2, 3, 4, 8];
/// Varying sizes in one group: the shared buffers must shrink and grow between collectives.
const LENGTHS: [usize; 6] = [1000, 0, 1, 7, 64, 4097];

/// SplitMix64: reproducible randomness in a few lines, without a dependency.
struct SplitMix64(u64);

impl SplitMix64 {
    fn new(seed: u64) -> Self {
        SplitMix64(seed)
    }

    fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    fn below(&mut self, n: usize) -> usize {
        (self.next_u64() % n as u64) as usize
    }

    /// Signed values over six decades of magnitude, so the order of a sum shows in its bits.
    fn value(&mut self) -> f32 {
        let unit = (self.next_u64() >> 40) as f32 / (1u64 << 24) as f32 - 0.5;
        unit * 2f32.powi(self.below(21) as i32 - 10)
    }
}

/// Rank `rank`'s input to collective `step` of a test seeded `seed`: every rank can rebuild every
/// other rank's input, which is how each rank checks its own result.
fn input(seed: u64, rank: usize, step: usize, len: usize) -> Vec<f32> {
    let mut rng =
        SplitMix64::new(seed ^ ((rank as u64) << 48) ^ (step as u64).wrapping_mul(0x1_0001));
    (0..len).map(|_| rng.value()).collect()
}

/// The sequential reference: `((x₀ + x₁) + x₂) + …`, element-wise in f32.
fn rank_order_sum(inputs: &[Vec<f32>]) -> Vec<f32> {
    let mut sum = inputs[0].clone();
    for x in &inputs[1..] {
        sum.iter_mut().zip(x).for_each(|(s, x)| *s += *x);
    }
    sum
}

/// The same sum in the opposite order: what a wrong implementation might compute.
fn reverse_order_sum(inputs: &[Vec<f32>]) -> Vec<f32> {
    let reversed: Vec<Vec<f32>> = inputs.iter().rev().cloned().collect();
    rank_order_sum(&reversed)
}

fn bits(values: &[f32]) -> Vec<u32> {
    values.iter().map(|v| v.to_bits()).collect()
}

/// Runs `body` on every rank, one thread each (the handle is dropped when its thread ends), and
/// returns the results in rank order.
fn on_every_rank<T: Send>(
    comms: Vec<LocalCommunicator>,
    body: impl Fn(&dyn Communicator) -> T + Sync,
) -> Vec<T> {
    let body = &body;
    thread::scope(|scope| {
        let threads: Vec<_> = comms
            .into_iter()
            .map(|comm| scope.spawn(move || body(&comm)))
            .collect();
        threads
            .into_iter()
            .map(|t| t.join().expect("a rank thread panicked"))
            .collect()
    })
}

#[test]
fn all_reduce_is_the_rank_order_sum_bit_for_bit() {
    for world_size in WORLD_SIZES {
        let inputs: Vec<Vec<Vec<f32>>> = (0..LENGTHS.len())
            .map(|step| {
                (0..world_size)
                    .map(|rank| input(11, rank, step, LENGTHS[step]))
                    .collect()
            })
            .collect();
        let results = on_every_rank(LocalGroup::new(world_size), |comm| {
            (0..LENGTHS.len())
                .map(|step| {
                    let mut buf = inputs[step][comm.rank()].clone();
                    comm.all_reduce_sum_f32(&mut buf).unwrap();
                    buf
                })
                .collect::<Vec<_>>()
        });
        for (step, per_rank) in inputs.iter().enumerate() {
            let expected = bits(&rank_order_sum(per_rank));
            for (rank, result) in results.iter().enumerate() {
                assert_eq!(
                    bits(&result[step]),
                    expected,
                    "world size {world_size}, rank {rank}, length {}",
                    LENGTHS[step]
                );
            }
            // Teeth: on this very data, another order would have been caught.
            if world_size >= 3 && LENGTHS[step] >= 1000 {
                assert_ne!(bits(&reverse_order_sum(per_rank)), expected);
            }
        }
    }
}

#[test]
fn all_gather_places_every_rank_in_rank_order() {
    for world_size in WORLD_SIZES {
        let results = on_every_rank(LocalGroup::new(world_size), |comm| {
            LENGTHS
                .iter()
                .enumerate()
                .map(|(step, &len)| {
                    let mine = input(12, comm.rank(), step, len);
                    let mut output = vec![f32::NAN; world_size * len];
                    comm.all_gather_f32(&mine, &mut output).unwrap();
                    output
                })
                .collect::<Vec<_>>()
        });
        for (step, &len) in LENGTHS.iter().enumerate() {
            let expected: Vec<f32> = (0..world_size)
                .flat_map(|rank| input(12, rank, step, len))
                .collect();
            for result in &results {
                assert_eq!(
                    bits(&result[step]),
                    bits(&expected),
                    "world size {world_size}"
                );
            }
        }
    }
}

#[test]
fn broadcast_copies_the_root_to_every_rank() {
    for world_size in WORLD_SIZES {
        let results = on_every_rank(LocalGroup::new(world_size), |comm| {
            let mut out = Vec::new();
            for root in 0..world_size {
                for (step, &len) in LENGTHS.iter().enumerate() {
                    let mut buf = input(13 + root as u64, comm.rank(), step, len);
                    comm.broadcast_f32(&mut buf, root).unwrap();
                    out.push(buf);
                }
            }
            out
        });
        let mut i = 0;
        for root in 0..world_size {
            for (step, &len) in LENGTHS.iter().enumerate() {
                let expected = bits(&input(13 + root as u64, root, step, len));
                for result in &results {
                    assert_eq!(
                        bits(&result[i]),
                        expected,
                        "world size {world_size}, root {root}"
                    );
                }
                i += 1;
            }
        }
    }
}

#[test]
fn barrier_holds_every_rank_until_all_have_arrived() {
    const ROUNDS: usize = 50;
    for world_size in WORLD_SIZES {
        let arrivals = AtomicUsize::new(0);
        on_every_rank(LocalGroup::new(world_size), |comm| {
            for round in 0..ROUNDS {
                if (comm.rank() + round) % world_size == 0 {
                    thread::sleep(Duration::from_micros(200));
                }
                arrivals.fetch_add(1, Ordering::SeqCst);
                comm.barrier().unwrap();
                let seen = arrivals.load(Ordering::SeqCst);
                assert!(
                    seen >= (round + 1) * world_size,
                    "rank {} left barrier {round} after only {seen} arrivals",
                    comm.rank()
                );
            }
        });
    }
}

#[test]
fn a_group_matches_the_same_collectives_issued_one_by_one() {
    let world_size = 3;
    let results = on_every_rank(LocalGroup::new(world_size), |comm| {
        let rank = comm.rank();
        let mut reduced = input(14, rank, 0, 300);
        let gather_in = input(14, rank, 1, 50);
        let mut gathered = vec![0.0; world_size * 50];
        let mut broadcast = input(14, rank, 2, 20);
        comm.run_group(&mut []).unwrap();
        comm.run_group(&mut [
            Collective::AllReduceSum { buf: &mut reduced },
            Collective::AllGather {
                input: &gather_in,
                output: &mut gathered,
            },
            Collective::Broadcast {
                buf: &mut broadcast,
                root: 2,
            },
        ])
        .unwrap();
        (reduced, gathered, broadcast)
    });
    let inputs = |step, len| -> Vec<Vec<f32>> {
        (0..world_size)
            .map(|rank| input(14, rank, step, len))
            .collect()
    };
    let reduced = bits(&rank_order_sum(&inputs(0, 300)));
    let gathered = bits(&inputs(1, 50).concat());
    let broadcast = bits(&input(14, 2, 2, 20));
    for (r, g, b) in &results {
        assert_eq!(bits(r), reduced);
        assert_eq!(bits(g), gathered);
        assert_eq!(bits(b), broadcast);
    }
}

/// One step of the stress schedule, drawn identically by every rank from the shared seed.
#[derive(Debug, Clone, Copy)]
enum Step {
    AllReduce(usize),
    AllGather(usize),
    Broadcast(usize, usize),
    Barrier,
    /// An all-reduce and an all-gather of the given lengths, as one group.
    Group(usize, usize),
}

fn stress_schedule(seed: u64, steps: usize, world_size: usize) -> Vec<Step> {
    let mut rng = SplitMix64::new(seed);
    (0..steps)
        .map(|_| {
            let len = rng.below(257);
            match rng.below(5) {
                0 => Step::AllReduce(len),
                1 => Step::AllGather(len),
                2 => Step::Broadcast(len, rng.below(world_size)),
                3 => Step::Barrier,
                _ => Step::Group(len, rng.below(33)),
            }
        })
        .collect()
}

#[test]
fn ten_thousand_mixed_collectives_back_to_back() {
    const SEED: u64 = 15;
    const WORLD: usize = 4;
    let schedule = stress_schedule(SEED, 10_000, WORLD);
    let everyone = |step: usize, len: usize| -> Vec<Vec<f32>> {
        (0..WORLD).map(|r| input(SEED, r, step, len)).collect()
    };
    let completed = on_every_rank(LocalGroup::new(WORLD), |comm| {
        let rank = comm.rank();
        for (step, &op) in schedule.iter().enumerate() {
            match op {
                Step::AllReduce(len) => {
                    let mut buf = input(SEED, rank, step, len);
                    comm.all_reduce_sum_f32(&mut buf).unwrap();
                    assert_eq!(bits(&buf), bits(&rank_order_sum(&everyone(step, len))));
                }
                Step::AllGather(len) => {
                    let mut out = vec![0.0; WORLD * len];
                    comm.all_gather_f32(&input(SEED, rank, step, len), &mut out)
                        .unwrap();
                    assert_eq!(bits(&out), bits(&everyone(step, len).concat()));
                }
                Step::Broadcast(len, root) => {
                    let mut buf = input(SEED, rank, step, len);
                    comm.broadcast_f32(&mut buf, root).unwrap();
                    assert_eq!(bits(&buf), bits(&input(SEED, root, step, len)));
                }
                Step::Barrier => comm.barrier().unwrap(),
                Step::Group(reduce_len, gather_len) => {
                    let mut reduced = input(SEED, rank, step, reduce_len);
                    let gather_in = input(SEED ^ 1, rank, step, gather_len);
                    let mut gathered = vec![0.0; WORLD * gather_len];
                    comm.run_group(&mut [
                        Collective::AllReduceSum { buf: &mut reduced },
                        Collective::AllGather {
                            input: &gather_in,
                            output: &mut gathered,
                        },
                    ])
                    .unwrap();
                    assert_eq!(
                        bits(&reduced),
                        bits(&rank_order_sum(&everyone(step, reduce_len)))
                    );
                    let expected: Vec<f32> = (0..WORLD)
                        .flat_map(|r| input(SEED ^ 1, r, step, gather_len))
                        .collect();
                    assert_eq!(bits(&gathered), bits(&expected));
                }
            }
        }
        schedule.len()
    });
    assert_eq!(completed, vec![10_000; WORLD]);
}

/// Issues `call` on every rank of a fresh group of `world_size`, checks that every rank got
/// `expected` with its buffer untouched, then that the group still works.
fn assert_mismatch(
    world_size: usize,
    expected: CollectiveError,
    call: impl Fn(&dyn Communicator, &mut Vec<f32>) -> Result<(), CollectiveError> + Sync,
) {
    let results = on_every_rank(LocalGroup::new(world_size), |comm| {
        let mut buf = vec![comm.rank() as f32; 4];
        let failed = call(comm, &mut buf);
        let untouched = buf == vec![comm.rank() as f32; 4];
        let mut again = vec![1.0; 3];
        comm.all_reduce_sum_f32(&mut again).unwrap();
        (failed, untouched, again)
    });
    for (rank, (failed, untouched, again)) in results.into_iter().enumerate() {
        assert_eq!(failed, Err(expected.clone()), "rank {rank}");
        assert!(
            untouched,
            "rank {rank}'s buffer was written by a failed collective"
        );
        assert_eq!(
            again,
            vec![world_size as f32; 3],
            "rank {rank} after the error"
        );
    }
}

#[test]
fn a_length_mismatch_fails_on_every_rank() {
    let expected = CollectiveError::LengthMismatch {
        kind: CollectiveKind::AllReduceSum,
        rank: 2,
        len: 3,
        expected: 4,
    };
    assert_mismatch(3, expected, |comm, buf| {
        let len = if comm.rank() == 2 { 3 } else { 4 };
        comm.all_reduce_sum_f32(&mut buf[..len])
    });
    let expected = CollectiveError::LengthMismatch {
        kind: CollectiveKind::Broadcast,
        rank: 1,
        len: 2,
        expected: 4,
    };
    assert_mismatch(2, expected, |comm, buf| {
        let len = if comm.rank() == 1 { 2 } else { 4 };
        comm.broadcast_f32(&mut buf[..len], 0)
    });
}

#[test]
fn other_disagreements_fail_on_every_rank() {
    let expected = CollectiveError::GatherOutputLength {
        rank: 1,
        output: 7,
        expected: 8,
    };
    assert_mismatch(2, expected, |comm, buf| {
        let mut output = vec![0.0; if comm.rank() == 1 { 7 } else { 8 }];
        let result = comm.all_gather_f32(buf, &mut output);
        if comm.rank() == 1 {
            assert_eq!(
                output,
                vec![0.0; 7],
                "output written by a failed all-gather"
            );
        }
        result
    });
    let expected = CollectiveError::RootOutOfRange {
        root: 3,
        world_size: 3,
    };
    assert_mismatch(3, expected, |comm, buf| comm.broadcast_f32(buf, 3));
    let expected = CollectiveError::RootMismatch {
        rank: 1,
        root: 1,
        expected: 0,
    };
    assert_mismatch(3, expected, |comm, buf| {
        comm.broadcast_f32(buf, usize::from(comm.rank() >= 1))
    });
    let expected = CollectiveError::KindMismatch {
        rank: 1,
        expected: CollectiveKind::AllReduceSum,
        found: CollectiveKind::Barrier,
    };
    assert_mismatch(2, expected, |comm, buf| match comm.rank() {
        0 => comm.all_reduce_sum_f32(buf),
        _ => comm.barrier(),
    });
    let expected = CollectiveError::GroupMismatch {
        rank: 1,
        expected: GroupPosition::InGroup { index: 0, len: 2 },
        found: GroupPosition::InGroup { index: 0, len: 1 },
    };
    assert_mismatch(2, expected, |comm, buf| {
        let (first, second) = buf.split_at_mut(2);
        match comm.rank() {
            0 => comm.run_group(&mut [
                Collective::AllReduceSum { buf: first },
                Collective::AllReduceSum { buf: second },
            ]),
            _ => comm.run_group(&mut [Collective::AllReduceSum { buf }]),
        }
    });
}

#[test]
fn a_dropped_handle_fails_the_waiting_ranks_at_once() {
    let started = Instant::now();
    let mut comms = LocalGroup::new(3);
    let gone = comms.pop().unwrap();
    let results = thread::scope(|scope| {
        scope.spawn(move || {
            thread::sleep(Duration::from_millis(50));
            drop(gone);
        });
        on_every_rank(comms, |comm| {
            let mut buf = vec![1.0; 16];
            let first = comm.all_reduce_sum_f32(&mut buf);
            let later = comm.barrier();
            (first, later, buf)
        })
    });
    let expected = Err(CollectiveError::PeerGone { rank: 2 });
    for (first, later, buf) in results {
        assert_eq!(first, expected);
        assert_eq!(later, expected, "a broken group must stay broken");
        assert_eq!(buf, vec![1.0; 16]);
    }
    // DEFAULT_TIMEOUT is a minute: the error came from the drop, not from a timeout.
    assert!(DEFAULT_TIMEOUT >= Duration::from_secs(10));
    assert!(
        started.elapsed() < Duration::from_secs(2),
        "took {:?}",
        started.elapsed()
    );
}

#[test]
fn a_rank_that_panics_fails_the_others() {
    let started = Instant::now();
    let mut comms = LocalGroup::new(2);
    let doomed = comms.pop().unwrap();
    let survivor = comms.pop().unwrap();
    let panicked = thread::spawn(move || {
        let _handle = doomed;
        thread::sleep(Duration::from_millis(50));
        panic!("rank 1 fails between collectives (expected by this test)");
    });
    let result = survivor.all_gather_f32(&[1.0], &mut [0.0, 0.0]);
    assert_eq!(result, Err(CollectiveError::PeerGone { rank: 1 }));
    assert!(panicked.join().is_err());
    assert!(
        started.elapsed() < Duration::from_secs(2),
        "took {:?}",
        started.elapsed()
    );
}

#[test]
fn a_rank_that_never_arrives_times_out() {
    let timeout = Duration::from_millis(100);
    let comms = LocalGroup::with_timeout(2, timeout);
    let started = Instant::now();
    let result = comms[0].barrier();
    let waited = started.elapsed();
    let expected = CollectiveError::Timeout {
        timeout,
        missing: vec![1],
    };
    assert_eq!(result, Err(expected.clone()));
    assert!(
        waited >= timeout && waited < Duration::from_secs(2),
        "waited {waited:?}"
    );
    // The late rank learns that the group broke instead of waiting in turn.
    assert_eq!(comms[1].all_reduce_sum_f32(&mut [1.0]), Err(expected));
}

#[test]
fn one_handle_refuses_two_concurrent_collectives() {
    let comms = LocalGroup::new(2);
    thread::scope(|scope| {
        let waiting = scope.spawn(|| {
            let mut buf = [2.0];
            comms[0].all_reduce_sum_f32(&mut buf).map(|()| buf)
        });
        // Wait until rank 0 is registered in the rendezvous, so the second call is concurrent.
        while !comms[0].shared.control.lock().unwrap().arrived[0] {
            thread::sleep(Duration::from_millis(1));
        }
        assert_eq!(
            comms[0].barrier(),
            Err(CollectiveError::ConcurrentCall { rank: 0 })
        );
        let mut buf = [3.0];
        comms[1].all_reduce_sum_f32(&mut buf).unwrap();
        assert_eq!(buf, [5.0]);
        assert_eq!(waiting.join().unwrap(), Ok([5.0]));
    });
}

#[test]
fn canary_another_summation_order_changes_the_bits() {
    // Rank order: (1 + 1e8) + -1e8 = 0, since 1e8 + 1 rounds to 1e8 in f32. Reverse: 1.
    let inputs = vec![vec![1.0f32], vec![1e8], vec![-1e8]];
    assert_eq!(rank_order_sum(&inputs), vec![0.0]);
    assert_eq!(reverse_order_sum(&inputs), vec![1.0]);
    let results = on_every_rank(LocalGroup::new(3), |comm| {
        let mut buf = inputs[comm.rank()].clone();
        comm.all_reduce_sum_f32(&mut buf).unwrap();
        buf
    });
    assert_eq!(results, vec![vec![0.0]; 3]);
    // And on random data, as the bitwise tests use: differences on many elements, not one.
    for world_size in [3, 4, 8] {
        let inputs: Vec<Vec<f32>> = (0..world_size).map(|r| input(16, r, 0, 1000)).collect();
        let forward = bits(&rank_order_sum(&inputs));
        let reverse = bits(&reverse_order_sum(&inputs));
        let differing = forward.iter().zip(&reverse).filter(|(a, b)| a != b).count();
        assert!(
            differing >= 10,
            "world size {world_size}: {differing} of 1000 differ"
        );
    }
}

#[test]
fn handles_know_their_place_and_work_behind_dyn() {
    assert!(LocalGroup::new(0).is_empty());
    let comms: Vec<Arc<dyn Communicator>> = LocalGroup::new(4)
        .into_iter()
        .map(|c| Arc::new(c) as Arc<dyn Communicator>)
        .collect();
    for (rank, comm) in comms.iter().enumerate() {
        assert_eq!((comm.rank(), comm.world_size()), (rank, 4));
    }
    let mut alone = LocalGroup::new(1);
    let mut buf = [-0.0f32, f32::MIN_POSITIVE];
    alone[0].all_reduce_sum_f32(&mut buf).unwrap();
    // One rank: the input, bit for bit — the sum starts from rank 0's value, not from +0.0.
    assert_eq!(bits(&buf), bits(&[-0.0, f32::MIN_POSITIVE]));
    alone[0].broadcast_f32(&mut buf, 0).unwrap();
    alone.pop();
}

#[test]
fn an_unbounded_timeout_is_accepted() {
    let results = on_every_rank(LocalGroup::with_timeout(2, Duration::MAX), |comm| {
        let mut buf = [comm.rank() as f32 + 1.0];
        comm.all_reduce_sum_f32(&mut buf).map(|()| buf)
    });
    assert_eq!(results, vec![Ok([3.0]); 2]);
}
