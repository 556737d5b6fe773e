//! The engine's byte-identity gates (CPU backend; greedy token streams must be identical) and the
//! refcount audit. Each gate has a canary arm: a deliberately broken variant that must fail it.
//!
//! The scheduler is driven step by step here, so "staggered arrival" means a request is submitted
//! at a chosen step — the same schedule on every run.

use strata_model::config::Architecture;
use strata_model::cpu::CpuModel;
use strata_model::synth::{SynthSpec, synthesize};
use strata_protocol::{FinishReason, GenerateRequest, SamplingParams, TokenEvent};
use tokio::sync::mpsc::UnboundedReceiver;

use crate::backend::{Backend, BackendError, CpuBackend, StepSeq};
use crate::kv::{
    BlockId, BlockManager, BlockManagerConfig, KvBlockIo, KvError, KvEventKind, Tier,
    prompt_block_hashes,
};
use crate::scheduler::{Faults, Scheduler, SchedulerLimits, Sequence};
use crate::speculative::{DraftModelProposer, SpeculativeConfig, Speculator};
use strata_model::ModelConfig;
use strata_model::sampler::Sampler;

const BLOCK: usize = 16;

/// Backend faults for canaries.
#[derive(Clone, Copy, PartialEq, Eq, Default)]
pub(crate) enum BackendFault {
    #[default]
    None,
    /// Logits depend on how many sequences share the step (like a batch-variant GEMM).
    BatchVariant,
    /// The KV of a prefill chunk that does not end the prompt is lost.
    DropChunkWrite,
    /// Copying a block back from a lower tier fails (as a CUDA copy error would).
    FailImport,
    /// A block restored from a lower tier is not written.
    DropImport,
    /// Prompt rows come out other than generated rows (as the GPU's prompt GEMM and decode
    /// GEMV differ in their last bits): a large nudge to one logit per prompt row.
    PromptPathDiffers,
}

struct TestBackend {
    inner: CpuBackend,
    fault: BackendFault,
}

impl KvBlockIo for TestBackend {
    fn block_bytes(&self) -> usize {
        self.inner.block_bytes()
    }
    fn export_block(&self, id: BlockId, out: &mut [u8]) -> Result<(), KvError> {
        self.inner.export_block(id, out)
    }
    fn import_block(&mut self, id: BlockId, data: &[u8]) -> Result<(), KvError> {
        match self.fault {
            BackendFault::DropImport => Ok(()),
            BackendFault::FailImport => Err(KvError::Copy {
                id,
                detail: "injected copy failure".into(),
            }),
            _ => self.inner.import_block(id, data),
        }
    }
}

impl Backend for TestBackend {
    fn kv_layout(&self) -> String {
        self.inner.kv_layout()
    }
    fn model_config(&self) -> &ModelConfig {
        self.inner.model_config()
    }
    fn block_size(&self) -> usize {
        self.inner.block_size()
    }
    fn num_blocks(&self) -> usize {
        self.inner.num_blocks()
    }
    fn step(&mut self, seqs: &[StepSeq<'_>]) -> Result<Vec<f32>, BackendError> {
        let mut logits = self.inner.step(seqs)?;
        match self.fault {
            BackendFault::BatchVariant if seqs.len() > 1 => {
                for (i, v) in logits.iter_mut().enumerate() {
                    *v += ((i * 7919 + seqs.len()) % 13) as f32 * 0.2;
                }
            }
            BackendFault::PromptPathDiffers => {
                let vocab = self.inner.model_config().vocab_size;
                let mut rows = logits.chunks_exact_mut(vocab);
                for s in seqs {
                    let end = s.first_position + s.tokens.len();
                    for position in end - s.logit_rows..end {
                        let row = rows.next().expect("a row per logit row");
                        if position < s.prompt_len {
                            row[(position * 31 + 7) % vocab] += 100.0;
                        }
                    }
                }
            }
            BackendFault::DropChunkWrite => {
                let zeros = vec![0; self.inner.block_bytes()];
                for s in seqs.iter().filter(|s| !s.wants_logits()) {
                    let last = s.first_position + s.tokens.len() - 1;
                    self.inner
                        .import_block(s.block_table[last / BLOCK], &zeros)
                        .unwrap();
                }
            }
            _ => {}
        }
        Ok(logits)
    }
}

pub(crate) struct Setup {
    pub(crate) device_blocks: usize,
    pub(crate) host_blocks: usize,
    pub(crate) disk_blocks: usize,
    pub(crate) limits: SchedulerLimits,
    pub(crate) backend_fault: BackendFault,
    pub(crate) faults: Faults,
    pub(crate) speculative: Option<SpeculativeConfig>,
    /// With `speculative`: a synthesized model of this seed (the target's architecture and
    /// tokenizer) drafts the proposals.
    pub(crate) draft_seed: Option<u64>,
    /// Run a tiny Qwen3-MoE (8 experts, 2 per token, a dense layer between sparse ones) instead
    /// of the dense Qwen3.
    pub(crate) moe: bool,
}

impl Default for Setup {
    fn default() -> Self {
        Self {
            device_blocks: 256,
            host_blocks: 0,
            disk_blocks: 0,
            limits: SchedulerLimits::default(),
            backend_fault: BackendFault::None,
            faults: Faults::default(),
            speculative: None,
            draft_seed: None,
            moe: false,
        }
    }
}

pub(crate) struct Harness {
    backend: TestBackend,
    pub(crate) scheduler: Scheduler,
    next_id: u64,
    _disk: tempfile::TempDir,
}

fn model_dir(moe: bool) -> &'static std::path::Path {
    synthesized(42, moe)
}

/// A tiny synthesized Qwen3 (or Qwen3-MoE) of `seed`, made once per test process.
fn synthesized(seed: u64, moe: bool) -> &'static std::path::Path {
    type Dirs = Vec<((u64, bool), &'static tempfile::TempDir)>;
    static DIRS: std::sync::Mutex<Dirs> = std::sync::Mutex::new(Vec::new());
    let mut dirs = DIRS
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    if let Some((_, dir)) = dirs.iter().find(|(k, _)| *k == (seed, moe)) {
        return dir.path();
    }
    let dir: &'static tempfile::TempDir = Box::leak(Box::new(tempfile::tempdir().unwrap()));
    let spec = if moe {
        SynthSpec::tiny_moe(seed)
    } else {
        SynthSpec::tiny(Architecture::Qwen3, seed)
    };
    synthesize(&spec, dir.path(), None).unwrap();
    dirs.push(((seed, moe), dir));
    dir.path()
}

impl Harness {
    pub(crate) fn new(setup: Setup) -> Self {
        let model = CpuModel::load(model_dir(setup.moe)).unwrap();
        let backend = TestBackend {
            inner: CpuBackend::with_blocks(model, BLOCK, setup.device_blocks),
            fault: setup.backend_fault,
        };
        let disk = tempfile::tempdir().unwrap();
        let manager = BlockManager::new(
            BlockManagerConfig {
                block_size: BLOCK,
                device_blocks: setup.device_blocks,
                host_blocks: setup.host_blocks,
                disk: (setup.disk_blocks > 0)
                    .then(|| (disk.path().to_path_buf(), setup.disk_blocks)),
            },
            backend.block_bytes(),
        )
        .unwrap();
        let speculator = setup.speculative.map(|c| {
            match setup.draft_seed {
                Some(seed) => {
                    let draft = CpuModel::load(synthesized(seed, setup.moe)).unwrap();
                    let backend = CpuBackend::with_blocks(draft, BLOCK, 256);
                    Speculator::with_proposer(
                        c,
                        Box::new(DraftModelProposer::new(Box::new(backend))),
                    )
                }
                None => Speculator::new(c).expect("a valid speculative config"),
            }
            .unconditional()
        });
        let mut scheduler =
            Scheduler::new(setup.limits, manager, vec![], 256).with_speculation(speculator);
        scheduler.faults = setup.faults;
        Self {
            backend,
            scheduler,
            next_id: 1,
            _disk: disk,
        }
    }

    pub(crate) fn submit(&mut self, request: GenerateRequest) -> UnboundedReceiver<TokenEvent> {
        let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
        let sampler = Sampler::new(&request.sampling, 320).unwrap();
        self.scheduler
            .add(Sequence::new(self.next_id, request, sampler, tx));
        self.next_id += 1;
        rx
    }

    /// Submits each request at its step and steps until all have finished; returns the tokens.
    pub(crate) fn run(&mut self, arrivals: &[(u64, GenerateRequest)]) -> Vec<Vec<u32>> {
        self.outcomes(arrivals)
            .into_iter()
            .map(|o| o.unwrap_or_else(|message| panic!("request failed: {message}")))
            .collect()
    }

    /// [`Harness::run`], each request's tokens or its failure.
    pub(crate) fn outcomes(
        &mut self,
        arrivals: &[(u64, GenerateRequest)],
    ) -> Vec<Result<Vec<u32>, String>> {
        let mut streams: Vec<Option<UnboundedReceiver<TokenEvent>>> = vec![];
        streams.resize_with(arrivals.len(), || None);
        let mut step = 0u64;
        loop {
            for (i, (at, request)) in arrivals.iter().enumerate() {
                if *at == step {
                    streams[i] = Some(self.submit(request.clone()));
                }
            }
            if self.scheduler.is_idle() && arrivals.iter().all(|(at, _)| *at <= step) {
                break;
            }
            self.scheduler.step(&mut self.backend).unwrap();
            self.scheduler.block_manager().audit().unwrap();
            step += 1;
            assert!(step < 100_000, "the schedule does not terminate");
        }
        streams.into_iter().map(|s| tokens(s.unwrap())).collect()
    }
}

fn tokens(mut rx: UnboundedReceiver<TokenEvent>) -> Result<Vec<u32>, String> {
    let mut out = Vec::new();
    while let Ok(event) = rx.try_recv() {
        match event {
            TokenEvent::Token { id, .. } => out.push(id),
            // A stop token ends a request that has some (the speculative gates' do).
            TokenEvent::Finished { reason, .. } => assert!(
                matches!(reason, FinishReason::Length | FinishReason::Stop),
                "{reason:?}"
            ),
            TokenEvent::Failed { message } | TokenEvent::Unavailable { message } => {
                return Err(message);
            }
            TokenEvent::Embedding { .. } => return Err("an embedding for a generation".into()),
        }
    }
    Ok(out)
}

pub(crate) fn request(prompt: Vec<u32>) -> GenerateRequest {
    GenerateRequest {
        resume: None,
        embed: None,
        prompt,
        sampling: SamplingParams {
            max_tokens: 20,
            ignore_eos: true,
            ..SamplingParams::greedy()
        },
        cache_salt: 7,
        deadline: None,
        constraint: None,
    }
}

/// A deterministic prompt of `len` tokens from `seed`.
pub(crate) fn prompt(seed: u32, len: usize) -> Vec<u32> {
    (0..len as u32)
        .map(|i| (i.wrapping_mul(2654435761) ^ seed.wrapping_mul(40503)) % 300)
        .collect()
}

fn alone(setup: Setup, r: &GenerateRequest) -> Vec<u32> {
    Harness::new(setup).run(&[(0, r.clone())]).remove(0)
}

/// Gate 1: each of 16 sequences, arriving two steps apart, generates what it generates alone.
fn batch_gate(fault: BackendFault) -> bool {
    batch_gate_of(16, fault, false)
}

/// Gate 1 over `n` sequences (of the MoE model with `moe`).
fn batch_gate_of(n: u32, fault: BackendFault, moe: bool) -> bool {
    let requests: Vec<GenerateRequest> = (0..n)
        .map(|i| request(prompt(i, 5 + 3 * i as usize)))
        .collect();
    let arrivals: Vec<(u64, GenerateRequest)> = requests
        .iter()
        .enumerate()
        .map(|(i, r)| (2 * i as u64, r.clone()))
        .collect();
    let batched = Harness::new(Setup {
        backend_fault: fault,
        moe,
        ..Setup::default()
    })
    .run(&arrivals);
    requests.iter().zip(&batched).all(|(r, b)| {
        let solo = Setup {
            moe,
            ..Setup::default()
        };
        alone(solo, r) == *b
    })
}

/// A mixture of experts routes each token alone: 32 staggered sequences of an MoE model generate
/// what each generates alone, and a prompt prefilled a token at a time (decode rows) generates
/// what one whole-prompt prefill does.
#[test]
fn gate_moe_batch_of_32_and_prefill_equals_decode() {
    assert!(batch_gate_of(32, BackendFault::None, true));
    assert!(
        !batch_gate_of(32, BackendFault::BatchVariant, true),
        "canary: batch-variant logits must fail"
    );
    let r = request(prompt(3, 40));
    let whole = alone(
        Setup {
            moe: true,
            ..Setup::default()
        },
        &r,
    );
    let one_at_a_time = Setup {
        moe: true,
        limits: SchedulerLimits {
            max_batch_tokens: 1,
            max_running: 64,
        },
        ..Setup::default()
    };
    assert_eq!(alone(one_at_a_time, &r), whole);
}

#[test]
fn gate_batch_of_16_with_staggered_arrivals() {
    assert!(batch_gate(BackendFault::None));
    assert!(
        !batch_gate(BackendFault::BatchVariant),
        "canary: batch-variant logits must fail"
    );
}

/// Gate 2: prefill in chunks of 1, 7 and 64 tokens generates what a whole-prompt prefill does.
fn chunk_gate(fault: BackendFault) -> bool {
    let r = request(prompt(3, 100));
    let whole = alone(Setup::default(), &r);
    [1, 7, 64].iter().all(|&chunk| {
        let setup = Setup {
            limits: SchedulerLimits {
                max_batch_tokens: chunk,
                max_running: 64,
            },
            backend_fault: fault,
            ..Setup::default()
        };
        alone(setup, &r) == whole
    })
}

#[test]
fn gate_prefill_chunk_sizes() {
    assert!(chunk_gate(BackendFault::None));
    assert!(
        !chunk_gate(BackendFault::DropChunkWrite),
        "canary: a dropped KV write must fail"
    );
}

/// Gate 3: a request served from the prefix cache generates what it generates cold, and a prompt
/// that differs only in a block's last token is not served the other's block.
fn prefix_gate(faults: Faults) -> bool {
    let shared = prompt(5, 48);
    let with = |tail: &[u32]| request([shared.clone(), tail.to_vec()].concat());
    let first = with(&[1, 2, 3]);
    let hit = with(&[9, 8]);
    let mut near = with(&[9, 8]);
    near.prompt[15] = (near.prompt[15] + 1) % 300;
    let mut h = Harness::new(Setup {
        faults,
        ..Setup::default()
    });
    let mut warm = h.run(&[(0, first)]);
    warm.extend(h.run(&[(0, hit.clone())]));
    warm.extend(h.run(&[(0, near.clone())]));
    warm[1] == alone(Setup::default(), &hit) && warm[2] == alone(Setup::default(), &near)
}

#[test]
fn gate_prefix_cache_hit_vs_cold() {
    assert!(prefix_gate(Faults::default()));
    let stale = Faults {
        hash_skips_last_token: true,
        ..Faults::default()
    };
    assert!(
        !prefix_gate(stale),
        "canary: a stale block handed out must fail"
    );
}

#[test]
fn prefix_hits_are_counted_in_usage() {
    let mut h = Harness::new(Setup::default());
    let shared = prompt(5, 48);
    h.run(&[(0, request([shared.clone(), vec![1]].concat()))]);
    let mut rx = h.submit(request([shared, vec![2]].concat()));
    while !h.scheduler.is_idle() {
        h.scheduler.step(&mut h.backend).unwrap();
    }
    let mut cached = None;
    while let Ok(e) = rx.try_recv() {
        if let TokenEvent::Finished { usage, .. } = e {
            cached = Some(usage.cached_tokens);
        }
    }
    assert_eq!(cached, Some(48));
}

/// Gate 4: a prefix demoted to host (or disk), then promoted back, generates what it does cold.
fn tier_gate(lower: Tier, fault: BackendFault) -> bool {
    let setup = || Setup {
        device_blocks: 12,
        host_blocks: if lower == Tier::Host { 64 } else { 1 },
        disk_blocks: if lower == Tier::Disk { 64 } else { 0 },
        backend_fault: fault,
        ..Setup::default()
    };
    let shared = prompt(11, 64);
    let target = request([shared.clone(), vec![4, 5]].concat());
    let mut h = Harness::new(setup());
    let mut events = h.scheduler.block_manager().subscribe();
    h.run(&[(0, request([shared, vec![7]].concat()))]);
    // Other traffic pushes the shared prefix out of the 12 device blocks.
    for i in 0..4 {
        h.run(&[(0, request(prompt(100 + i, 120)))]);
    }
    let restored = h.run(&[(0, target.clone())]).remove(0);
    let mut promoted = false;
    while let Ok(e) = events.try_recv() {
        promoted |= matches!(e.kind, KvEventKind::TierChanged { from, to: Tier::Device, .. } if from == lower);
    }
    assert!(
        promoted,
        "the target's prefix was restored from the {lower:?} tier"
    );
    restored == alone(Setup::default(), &target)
}

#[test]
fn gate_restore_from_host_and_disk_tiers() {
    assert!(tier_gate(Tier::Host, BackendFault::None));
    assert!(tier_gate(Tier::Disk, BackendFault::None));
    assert!(
        !tier_gate(Tier::Host, BackendFault::DropImport),
        "canary: a dropped restore must fail"
    );
    assert!(
        !tier_gate(Tier::Disk, BackendFault::DropImport),
        "canary: a dropped restore must fail"
    );
}

/// A restore whose copy to the device fails fails that one request, by name, holding nothing;
/// the engine goes on: the same prompt asked again runs cold (the failed block left the cache)
/// and generates what it does alone, and no block stays referenced.
#[test]
fn a_failing_restore_fails_one_request_and_the_next_succeeds() {
    let mut h = Harness::new(Setup {
        device_blocks: 12,
        host_blocks: 64,
        backend_fault: BackendFault::FailImport,
        ..Setup::default()
    });
    let shared = prompt(11, 64);
    let target = request([shared.clone(), vec![4, 5]].concat());
    h.run(&[(0, request([shared, vec![7]].concat()))]);
    for i in 0..4 {
        h.run(&[(0, request(prompt(100 + i, 120)))]);
    }
    let before = h.scheduler.block_manager().lower_tier_failures();
    let failed = h.outcomes(&[(0, target.clone())]).remove(0);
    let message = failed.expect_err("the restore's copy failed");
    assert!(
        message.contains("restoring the cached prompt prefix failed")
            && message.contains("injected copy failure"),
        "{message}"
    );
    assert_eq!(
        h.scheduler.block_manager().lower_tier_failures(),
        before + 1
    );
    assert_eq!(h.scheduler.block_manager().referenced_blocks(), 0);
    let again = h.outcomes(&[(0, target.clone())]).remove(0);
    assert_eq!(again, Ok(alone(Setup::default(), &target)));
}

/// Admission by memory: a request whose cached prefix sits in the host tier waits while a long
/// request holds the device, and is restored once, when its first chunk fits; both generate
/// what they do alone. Returns how many times a block of its prefix was copied back.
fn admission_restores(faults: Faults) -> usize {
    let setup = || Setup {
        device_blocks: 12,
        host_blocks: 64,
        faults,
        ..Setup::default()
    };
    let shared = prompt(11, 64);
    let target = request([shared.clone(), vec![4, 5]].concat());
    let mut long = request(prompt(300, 120));
    long.sampling.max_tokens = 40;
    let mut h = Harness::new(setup());
    h.run(&[(0, request([shared.clone(), vec![7]].concat()))]);
    for i in 0..4 {
        h.run(&[(0, request(prompt(100 + i, 120)))]);
    }
    let prefix = prompt_block_hashes(&shared, BLOCK, target.cache_salt);
    assert!(
        prefix
            .iter()
            .all(|&p| h.scheduler.block_manager().tier_of(p) == Some(Tier::Host)),
        "the target's prefix waits in the host tier"
    );
    let mut events = h.scheduler.block_manager().subscribe();
    let out = h.run(&[(0, long.clone()), (1, target.clone())]);
    assert_eq!(out[0], alone(Setup::default(), &long));
    assert_eq!(out[1], alone(Setup::default(), &target));
    let mut restores = 0;
    while let Ok(e) = events.try_recv() {
        if let KvEventKind::TierChanged {
            hash,
            to: Tier::Device,
            ..
        } = e.kind
            && prefix.contains(&hash)
        {
            restores += 1;
        }
    }
    restores
}

#[test]
fn gate_a_waiting_request_is_restored_once_when_it_fits() {
    assert_eq!(
        admission_restores(Faults::default()),
        4,
        "each prefix block restored once"
    );
    let churn = admission_restores(Faults {
        admit_without_room: true,
        ..Faults::default()
    });
    assert!(
        churn > 4,
        "canary: admitted without room, its prefix is restored again: {churn}"
    );
}

/// Gate 5: sequences preempted for lack of blocks and resumed generate what they do alone.
fn preempt_gate(faults: Faults) -> bool {
    let requests: Vec<GenerateRequest> = (0..6).map(|i| request(prompt(50 + i, 40))).collect();
    let arrivals: Vec<(u64, GenerateRequest)> = requests.iter().map(|r| (0, r.clone())).collect();
    let mut h = Harness::new(Setup {
        device_blocks: 10,
        faults,
        ..Setup::default()
    });
    let out = h.run(&arrivals);
    assert!(
        h.scheduler.preemptions() > 0,
        "the setup must force preemption"
    );
    requests
        .iter()
        .zip(&out)
        .all(|(r, o)| alone(Setup::default(), r) == *o)
}

#[test]
fn gate_preempted_and_resumed_vs_uninterrupted() {
    assert!(preempt_gate(Faults::default()));
    let lossy = Faults {
        forget_generated_on_preempt: true,
        ..Faults::default()
    };
    assert!(
        !preempt_gate(lossy),
        "canary: a resume that loses state must fail"
    );
}

/// 10,000 requests with shared prefixes, random cancellations, client disconnects and expired
/// deadlines, through a pool small enough to force eviction, demotion and preemption: the block
/// manager stays consistent after every step and no block is left referenced at the end.
#[test]
fn randomized_workload_leaves_no_block_referenced() {
    use rand_chacha::ChaCha8Rng;
    use rand_core::{Rng, SeedableRng};
    let mut rng = ChaCha8Rng::seed_from_u64(2026);
    let mut below = |n: u32| rng.next_u32() % n;
    let mut h = Harness::new(Setup {
        device_blocks: 20,
        host_blocks: 32,
        limits: SchedulerLimits {
            max_batch_tokens: 256,
            max_running: 32,
        },
        ..Setup::default()
    });
    let prefixes: Vec<Vec<u32>> = (0..8).map(|i| prompt(900 + i, 40)).collect();
    let mut live: Vec<(u64, UnboundedReceiver<TokenEvent>)> = Vec::new();
    let (mut submitted, mut cancelled, mut steps) = (0, 0, 0u64);
    while submitted < 10_000 || !h.scheduler.is_idle() {
        for _ in 0..below(4) {
            if submitted == 10_000 {
                break;
            }
            let prefix = &prefixes[below(8) as usize][..below(41) as usize];
            let tail = prompt(below(1000), 1 + below(20) as usize);
            let mut r = request([prefix, &tail].concat());
            r.sampling.max_tokens = 1 + below(6);
            if below(50) == 0 {
                r.deadline = Some(std::time::Duration::ZERO);
            }
            live.push((h.next_id, h.submit(r)));
            submitted += 1;
        }
        if !live.is_empty() && below(4) == 0 {
            let (id, rx) = live.swap_remove(below(live.len() as u32) as usize);
            if below(2) == 0 {
                h.scheduler.cancel(id, FinishReason::Cancelled).unwrap();
            } else {
                drop(rx); // the client went away
            }
            cancelled += 1;
        }
        h.scheduler.step(&mut h.backend).unwrap();
        steps += 1;
        if steps % 50 == 0 {
            h.scheduler.block_manager().audit().unwrap();
        }
        live.retain_mut(|(_, rx)| {
            let mut done = false;
            while let Ok(e) = rx.try_recv() {
                done |= !matches!(e, TokenEvent::Token { .. });
            }
            !done
        });
    }
    let blocks = h.scheduler.block_manager();
    blocks.audit().unwrap();
    assert_eq!(
        blocks.referenced_blocks(),
        0,
        "after {steps} steps and {cancelled} cancellations"
    );
    eprintln!(
        "{steps} steps, {cancelled} cancellations, {} preemptions",
        h.scheduler.preemptions()
    );
    assert!(h.scheduler.preemptions() > 0 && cancelled > 100);
}

/// `request(prompt)` generating `max_tokens`.
fn request_of(prompt: Vec<u32>, max_tokens: u32) -> GenerateRequest {
    let mut r = request(prompt);
    r.sampling.max_tokens = max_tokens;
    r
}

/// Cached blocks only a pin holds, with no lower tier to take them, are not capacity: a prompt
/// that fits the device but not the device less them ends with a refusal naming the pins once
/// nothing else runs (before, it was admitted, preempted for want of blocks and re-admitted
/// forever, stalling every request: the harness's step bound fails), a sequence growing into
/// them ends with its length, and once unpinned the same prompt runs.
#[test]
fn blocks_only_pins_hold_are_not_capacity() {
    let mut h = Harness::new(Setup {
        device_blocks: 11,
        ..Setup::default()
    });
    let primed = prompt(1, 40);
    h.run(&[(0, request_of(primed.clone(), 1))]);
    let hashes = prompt_block_hashes(&primed[..2 * BLOCK], BLOCK, 7);
    h.scheduler
        .block_manager_mut()
        .pin("doc", &hashes, None)
        .unwrap();
    assert_eq!(h.scheduler.block_manager().held_by_pins(), 2);
    assert_eq!(h.scheduler.load().pinned_blocks, 2);

    // 150 + 1 positions take 10 blocks: the device has 11, 2 of them pinned.
    let refused = h.outcomes(&[(0, request_of(prompt(2, 150), 1))]);
    let message = refused[0].as_ref().expect_err("the prompt cannot run");
    assert!(message.contains("held by pinned"), "{message}");
    // 9 blocks hold 144 positions; the 145th token is sampled but never needs KV.
    let grown = h.run(&[(0, request_of(prompt(3, 20), 1_000))]);
    assert_eq!(grown[0].len(), 145 - 20);

    assert!(h.scheduler.block_manager_mut().unpin("doc"));
    assert_eq!(h.scheduler.block_manager().held_by_pins(), 0);
    let ran = h.run(&[(0, request_of(prompt(2, 150), 1))]);
    assert_eq!(ran[0].len(), 1);
}
