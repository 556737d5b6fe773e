//! `strata gpu nccl`: the NCCL communicator on real GPUs, one rank thread per device.
//!
//! Correctness first, every collective against a host reference bit for bit — all-reduce (f32
//! and bf16) against `strata_collective::ordered` (rank order, from rank 0's value), all-gather,
//! broadcast, barrier and a group of mixed collectives — with a canary arm that must fail (a
//! reference sum started from +0.0 instead of rank 0's value, which turns the -0.0 every rank
//! holds at element 0 into +0.0). Then latency: all-reduce and all-gather timed with CUDA events
//! for the message sizes of Llama-3.1-8B decode (hidden 4096 × batch bf16, and f32 logits rows of
//! vocab 128256), median of many runs.

use std::path::PathBuf;
use std::time::Instant;

use anyhow::{Context, Result, ensure};
use clap::Args;
use half::bf16;
use serde_json::{Value, json};
use strata_collective::nccl::{NcclGroup, nccl_version};
use strata_collective::ordered::{ordered_sum_bf16, ordered_sum_f32};
use strata_collective::{
    DeviceBuf, DeviceBufMut, DeviceCollective, DeviceCommunicator, NcclCommunicator,
};
use strata_kernels::cudarc::driver::sys::CUevent_flags;
use strata_kernels::cudarc::driver::{CudaSlice, CudaStream, DeviceRepr};

#[derive(Args)]
pub struct NcclArgs {
    /// CUDA devices, comma separated: one rank per device, rank r on the r-th.
    #[arg(long, value_delimiter = ',', default_value = "0")]
    devices: Vec<usize>,
    /// Timed calls per message size (after 20 warm-up calls).
    #[arg(long, default_value_t = 200)]
    runs: usize,
    /// Seed of the test data (default: drawn from the clock, printed).
    #[arg(long)]
    seed: Option<u64>,
    /// Write the checks and timings (per rank) as JSON to this file.
    #[arg(long)]
    json: Option<PathBuf>,
}

/// Message sizes timed: Llama-3.1-8B decode's hidden-state all-reduce per batch size (bf16), and
/// f32 logits rows of the full vocabulary.
const HIDDEN: usize = 4096;
const VOCAB: usize = 128_256;
const BATCHES: [usize; 4] = [1, 8, 32, 64];
const LOGIT_ROWS: [usize; 2] = [1, 8];
/// Lengths checked: odd and even, tiny and large (grid-stride loop, several blocks).
const CHECK_LENS: [usize; 4] = [1, 7, HIDDEN, HIDDEN * 64 + 3];

pub fn run(args: NcclArgs) -> Result<()> {
    let seed = args.seed.unwrap_or_else(|| {
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_nanos() as u64)
            .unwrap_or(1)
    });
    let comms = NcclGroup::new(&args.devices).context("starting the NCCL group")?;
    let version = nccl_version()?;
    let world = comms.len();
    println!(
        "nccl {version}: {world} rank(s) on device(s) {:?}, seed {seed}",
        args.devices
    );
    let runs = args.runs.max(1);
    let reports: Vec<RankReport> = std::thread::scope(|s| {
        let threads: Vec<_> = comms
            .into_iter()
            .map(|comm| s.spawn(move || rank_main(comm, seed, runs)))
            .collect();
        threads
            .into_iter()
            .map(|t| {
                t.join()
                    .map_err(|_| anyhow::anyhow!("a rank thread panicked"))?
            })
            .collect::<Result<Vec<_>>>()
    })?;

    let mut checks = Vec::new();
    println!("{:<5} {:<44} {:<6} detail", "rank", "check", "result");
    for report in &reports {
        for c in &report.checks {
            println!(
                "{:<5} {:<44} {:<6} {}",
                report.rank,
                c.name,
                if c.ok { "ok" } else { "FAIL" },
                c.detail
            );
            checks.push(
                json!({"rank": report.rank, "check": c.name, "canary": c.canary,
                               "ok": c.ok, "detail": c.detail}),
            );
        }
    }
    let passed = reports.iter().all(|r| r.checks.iter().all(|c| c.ok));

    println!(
        "\n{:<12} {:<5} {:>9} {:>10} {:>11} {:>11} {:>10}",
        "collective", "dtype", "elements", "bytes", "median_us", "max_rk_us", "host_us"
    );
    let mut timings = Vec::new();
    for (i, t) in reports[0].timings.iter().enumerate() {
        // The slowest rank's median: a collective is as fast as its last rank.
        let worst = reports
            .iter()
            .map(|r| r.timings[i].median_us)
            .fold(0.0, f64::max);
        println!(
            "{:<12} {:<5} {:>9} {:>10} {:>11.2} {:>11.2} {:>10.2}",
            t.collective, t.dtype, t.elements, t.bytes, t.median_us, worst, t.host_median_us
        );
        let per_rank: Vec<Value> = reports
            .iter()
            .map(|r| {
                let t = &r.timings[i];
                json!({"rank": r.rank, "min_us": t.min_us, "median_us": t.median_us,
                       "max_us": t.max_us, "host_median_us": t.host_median_us})
            })
            .collect();
        timings.push(
            json!({"collective": t.collective, "dtype": t.dtype, "case": t.case,
                            "elements": t.elements, "bytes": t.bytes, "runs": runs,
                            "slowest_rank_median_us": worst, "ranks": per_rank}),
        );
    }
    if world == 1 {
        println!("(one rank: the all-reduce is the identity and launches nothing)");
    }
    println!("\nnccl checks: {}", if passed { "PASS" } else { "FAIL" });
    let receipt = json!({"devices": args.devices, "world_size": world, "nccl_version": version,
        "device_names": reports.iter().map(|r| r.device_name.clone()).collect::<Vec<_>>(),
        "seed": seed, "timing": "CUDA events around each call on the rank's stream",
        "checks": checks, "timings": timings, "passed": passed});
    if let Some(path) = &args.json {
        std::fs::write(path, serde_json::to_string_pretty(&receipt)?)
            .with_context(|| format!("writing {}", path.display()))?;
    }
    ensure!(
        passed,
        "NCCL collectives differ from the host reference (or a canary passed)"
    );
    Ok(())
}

struct Check {
    name: String,
    canary: bool,
    ok: bool,
    detail: String,
}

struct Timing {
    collective: &'static str,
    dtype: &'static str,
    case: String,
    elements: usize,
    bytes: usize,
    min_us: f64,
    median_us: f64,
    max_us: f64,
    host_median_us: f64,
}

struct RankReport {
    rank: usize,
    device_name: String,
    checks: Vec<Check>,
    timings: Vec<Timing>,
}

/// One rank's program: every rank runs the same sequence of collectives.
fn rank_main(mut comm: NcclCommunicator, seed: u64, runs: usize) -> Result<RankReport> {
    let device_name = comm.stream().context().name().unwrap_or_default();
    let mut checks = Vec::new();
    for &n in &CHECK_LENS {
        checks.extend(check_all_reduce(&mut comm, seed, n)?);
        checks.push(check_all_gather(&mut comm, seed, n)?);
        checks.push(check_broadcast(&mut comm, seed, n)?);
    }
    checks.push(check_group(&mut comm, seed)?);
    let barrier = comm.barrier();
    checks.push(Check {
        name: "barrier".into(),
        canary: false,
        ok: barrier.is_ok(),
        detail: barrier.err().map(|e| e.to_string()).unwrap_or_default(),
    });
    let timings = time_all(&mut comm, runs)?;
    Ok(RankReport {
        rank: comm.rank(),
        device_name,
        checks,
        timings,
    })
}

/// Rank `rank`'s test data for a case: varied magnitudes and signs, denormals, and -0.0 at
/// element 0 (on every rank, so the rank-order sum keeps it and a sum from +0.0 does not).
fn data(seed: u64, case: u64, rank: usize, n: usize) -> Vec<f32> {
    let mut state = seed ^ case.wrapping_mul(0x9e37_79b9_7f4a_7c15) ^ ((rank as u64 + 1) << 32);
    (0..n)
        .map(|i| {
            state = state
                .wrapping_mul(6_364_136_223_846_793_005)
                .wrapping_add(1_442_695_040_888_963_407);
            let r = (state >> 33) as u32;
            match i {
                0 => -0.0,
                _ if r.is_multiple_of(97) => f32::from_bits(r % 0x0080_0000), // denormal
                _ => {
                    let mantissa = (r % 2_000_001) as f32 / 1_000_000.0 - 1.0;
                    mantissa * 2f32.powi((r % 41) as i32 - 20)
                }
            }
        })
        .collect()
}

fn data_bf16(seed: u64, case: u64, rank: usize, n: usize) -> Vec<bf16> {
    data(seed, case, rank, n)
        .into_iter()
        .map(bf16::from_f32)
        .collect()
}

/// Every rank's data, rank-major, as the all-gather lays it out.
fn gathered<T>(world: usize, one: impl Fn(usize) -> Vec<T>) -> Vec<T> {
    (0..world).flat_map(one).collect()
}

/// Bit-for-bit comparison: the count of differing elements and the first one.
fn compare<T: Copy + PartialEq + std::fmt::Debug>(got: &[T], want: &[T]) -> (bool, String) {
    if got.len() != want.len() {
        return (false, format!("length {} ≠ {}", got.len(), want.len()));
    }
    let differing = got.iter().zip(want).filter(|(a, b)| a != b).count();
    match got.iter().zip(want).position(|(a, b)| a != b) {
        None => (true, format!("{} elements bit-identical", got.len())),
        Some(i) => (
            false,
            format!(
                "{differing} of {} differ; first at {i}: {:?} ≠ {:?}",
                got.len(),
                got[i],
                want[i]
            ),
        ),
    }
}

fn outcome(name: String, canary: bool, (same, detail): (bool, String)) -> Check {
    Check {
        name,
        canary,
        ok: same != canary,
        detail,
    }
}

fn upload<T: DeviceRepr>(stream: &std::sync::Arc<CudaStream>, xs: &[T]) -> Result<CudaSlice<T>> {
    stream.clone_htod(xs).context("copying to the device")
}

fn check_all_reduce(comm: &mut NcclCommunicator, seed: u64, n: usize) -> Result<Vec<Check>> {
    let (rank, world) = (comm.rank(), comm.world_size());
    let stream = comm.stream().clone();
    let mut checks = Vec::new();

    let mine = data(seed, 1, rank, n);
    let mut buf = upload(&stream, &mine)?;
    comm.all_reduce_sum(DeviceBufMut::from(&mut buf))?;
    let got = stream.clone_dtoh(&buf)?;
    let all = gathered(world, |r| data(seed, 1, r, n));
    let mut want = vec![0.0f32; n];
    ordered_sum_f32(&all, world, &mut want);
    let bits = |xs: &[f32]| xs.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
    checks.push(outcome(
        format!("all_reduce f32 n={n}"),
        false,
        compare(&bits(&got), &bits(&want)),
    ));
    // The canary: the sum a naive kernel computes, from +0.0.
    let mut from_zero = vec![0.0f32; n];
    for row in all.chunks_exact(n) {
        for (acc, x) in from_zero.iter_mut().zip(row) {
            *acc += *x;
        }
    }
    checks.push(outcome(
        format!("canary: all_reduce f32 n={n} vs sum from +0.0"),
        true,
        compare(&bits(&got), &bits(&from_zero)),
    ));

    let mine = data_bf16(seed, 2, rank, n);
    let mut buf = upload(&stream, &mine)?;
    comm.all_reduce_sum(DeviceBufMut::from(&mut buf))?;
    let got = stream.clone_dtoh(&buf)?;
    let all = gathered(world, |r| data_bf16(seed, 2, r, n));
    let mut want = vec![bf16::ZERO; n];
    if world == 1 {
        want.copy_from_slice(&mine);
    } else {
        ordered_sum_bf16(&all, world, &mut want);
    }
    let bits16 = |xs: &[bf16]| xs.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
    checks.push(outcome(
        format!("all_reduce bf16 n={n}"),
        false,
        compare(&bits16(&got), &bits16(&want)),
    ));
    Ok(checks)
}

fn check_all_gather(comm: &mut NcclCommunicator, seed: u64, n: usize) -> Result<Check> {
    let (rank, world) = (comm.rank(), comm.world_size());
    let stream = comm.stream().clone();
    let input = upload(&stream, &data_bf16(seed, 3, rank, n))?;
    // Poisoned output: an element NCCL does not write is a NaN that no input holds.
    let mut output = upload(&stream, &vec![bf16::from_bits(0x7fa5); world * n])?;
    comm.all_gather(DeviceBuf::from(&input), DeviceBufMut::from(&mut output))?;
    let got = stream.clone_dtoh(&output)?;
    let want = gathered(world, |r| data_bf16(seed, 3, r, n));
    let bits = |xs: &[bf16]| xs.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
    Ok(outcome(
        format!("all_gather bf16 n={n}"),
        false,
        compare(&bits(&got), &bits(&want)),
    ))
}

fn check_broadcast(comm: &mut NcclCommunicator, seed: u64, n: usize) -> Result<Check> {
    let (rank, world) = (comm.rank(), comm.world_size());
    let root = world - 1;
    let stream = comm.stream().clone();
    let mut buf = upload(&stream, &data(seed, 4, rank, n))?;
    comm.broadcast(DeviceBufMut::from(&mut buf), root)?;
    let got = stream.clone_dtoh(&buf)?;
    let want = data(seed, 4, root, n);
    let bits = |xs: &[f32]| xs.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
    Ok(outcome(
        format!("broadcast f32 n={n} root={root}"),
        false,
        compare(&bits(&got), &bits(&want)),
    ))
}

/// A group as a decode step would issue it: two all-reduces of different types, an all-gather
/// and a broadcast, one NCCL group.
fn check_group(comm: &mut NcclCommunicator, seed: u64) -> Result<Check> {
    let (rank, world) = (comm.rank(), comm.world_size());
    let stream = comm.stream().clone();
    let (n_a, n_b, n_c, n_d) = (HIDDEN, HIDDEN * 8, 1000, 333);
    let mut a = upload(&stream, &data(seed, 10, rank, n_a))?;
    let mut b = upload(&stream, &data_bf16(seed, 11, rank, n_b))?;
    let c_in = upload(&stream, &data(seed, 12, rank, n_c))?;
    let mut c_out = upload(&stream, &vec![f32::NAN; world * n_c])?;
    let mut d = upload(&stream, &data(seed, 13, rank, n_d))?;
    comm.run_group(&mut [
        DeviceCollective::AllReduceSum {
            buf: (&mut a).into(),
        },
        DeviceCollective::AllReduceSum {
            buf: (&mut b).into(),
        },
        DeviceCollective::AllGather {
            input: (&c_in).into(),
            output: (&mut c_out).into(),
        },
        DeviceCollective::Broadcast {
            buf: (&mut d).into(),
            root: 0,
        },
    ])?;
    let f = |xs: Vec<f32>| xs.into_iter().map(f32::to_bits).collect::<Vec<_>>();
    let h = |xs: Vec<bf16>| {
        xs.into_iter()
            .map(|x| x.to_bits() as u32)
            .collect::<Vec<_>>()
    };
    let mut got = f(stream.clone_dtoh(&a)?);
    got.extend(h(stream.clone_dtoh(&b)?));
    got.extend(f(stream.clone_dtoh(&c_out)?));
    got.extend(f(stream.clone_dtoh(&d)?));

    let mut want_a = vec![0.0f32; n_a];
    ordered_sum_f32(
        &gathered(world, |r| data(seed, 10, r, n_a)),
        world,
        &mut want_a,
    );
    let mut want_b = data_bf16(seed, 11, rank, n_b);
    if world > 1 {
        ordered_sum_bf16(
            &gathered(world, |r| data_bf16(seed, 11, r, n_b)),
            world,
            &mut want_b,
        );
    }
    let mut want = f(want_a);
    want.extend(h(want_b));
    want.extend(f(gathered(world, |r| data(seed, 12, r, n_c))));
    want.extend(f(data(seed, 13, 0, n_d)));
    Ok(outcome(
        "group: 2 all_reduce + all_gather + broadcast".into(),
        false,
        compare(&got, &want),
    ))
}

/// Every timed case on this rank, in the same order on every rank.
fn time_all(comm: &mut NcclCommunicator, runs: usize) -> Result<Vec<Timing>> {
    let world = comm.world_size();
    let stream = comm.stream().clone();
    let mut timings = Vec::new();
    for batch in BATCHES {
        let n = HIDDEN * batch;
        let mut buf = stream.alloc_zeros::<bf16>(n)?;
        let case = format!("hidden {HIDDEN} x batch {batch}");
        timings.push(time(comm, runs, "all_reduce", "bf16", &case, n, 2, |c| {
            c.all_reduce_sum(DeviceBufMut::from(&mut buf))
        })?);
        let mut out = stream.alloc_zeros::<bf16>(n * world)?;
        timings.push(time(comm, runs, "all_gather", "bf16", &case, n, 2, |c| {
            c.all_gather(DeviceBuf::from(&buf), DeviceBufMut::from(&mut out))
        })?);
    }
    for rows in LOGIT_ROWS {
        let n = VOCAB * rows;
        let mut buf = stream.alloc_zeros::<f32>(n)?;
        let case = format!("logits {VOCAB} x {rows}");
        timings.push(time(comm, runs, "all_reduce", "f32", &case, n, 4, |c| {
            c.all_reduce_sum(DeviceBufMut::from(&mut buf))
        })?);
    }
    Ok(timings)
}

/// Times `call` with CUDA events around each call on the rank's stream (and the host time of
/// the enqueue), after 20 warm-up calls; min, median, max over `runs`.
#[expect(
    clippy::too_many_arguments,
    reason = "one timed case, described in full"
)]
fn time(
    comm: &mut NcclCommunicator,
    runs: usize,
    collective: &'static str,
    dtype: &'static str,
    case: &str,
    elements: usize,
    elem_bytes: usize,
    mut call: impl FnMut(&mut NcclCommunicator) -> Result<(), strata_collective::CollectiveError>,
) -> Result<Timing> {
    let stream = comm.stream().clone();
    let ctx = stream.context().clone();
    for _ in 0..20 {
        call(comm)?;
    }
    stream.synchronize()?;
    let (mut device, mut host) = (Vec::with_capacity(runs), Vec::with_capacity(runs));
    let start = ctx.new_event(Some(CUevent_flags::CU_EVENT_DEFAULT))?;
    let end = ctx.new_event(Some(CUevent_flags::CU_EVENT_DEFAULT))?;
    for _ in 0..runs {
        start.record(&stream)?;
        let t = Instant::now();
        call(comm)?;
        host.push(t.elapsed().as_secs_f64() * 1e6);
        end.record(&stream)?;
        device.push(start.elapsed_ms(&end)? as f64 * 1e3);
    }
    device.sort_by(f64::total_cmp);
    host.sort_by(f64::total_cmp);
    Ok(Timing {
        collective,
        dtype,
        case: case.to_string(),
        elements,
        bytes: elements * elem_bytes,
        min_us: device[0],
        median_us: device[runs / 2],
        max_us: device[runs - 1],
        host_median_us: host[runs / 2],
    })
}
