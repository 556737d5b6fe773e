//! The in-process engine handle: a thread that owns the backend and the scheduler, fed by
//! submit / cancel commands, streaming token events back per request.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc;
use std::sync::{Arc, Mutex, PoisonError};
use std::thread::JoinHandle;
use std::time::Duration;

use strata_model::ModelConfig;
use strata_model::grammar::GrammarCompiler;
use strata_protocol::{FinishReason, GenerateRequest};
use tokio::sync::mpsc::unbounded_channel;

use crate::backend::Backend;
use crate::kv::{
    BlockHash, BlockManager, BlockManagerConfig, KvDump, KvError, KvEvent, KvLayout, PinStatus,
};
use crate::scheduler::{EngineLoad, Scheduler, SchedulerLimits, Sequence, StepTimes};
use crate::spec::KvTiers;
use crate::speculative::{SpeculativeConfig, Speculator};
use strata_engine_api::client::{EngineClient, Reply};
pub use strata_engine_api::submit::{Admission, RequestStream, SubmitError};

/// Steps computing at least this many tokens are timed for [`EngineLoad::tokens_per_s`]:
/// smaller ones (decode) say little about the prefill rate.
pub const RATE_SAMPLE_TOKENS: usize = 64;

/// A moving average of rates: each new sample weighs this much.
const RATE_WEIGHT: f64 = 0.25;

/// Folds `sample` into the moving average `avg` (0 = none yet).
pub fn average_rate(avg: u64, sample: f64) -> u64 {
    if avg == 0 {
        return sample as u64;
    }
    (avg as f64 * (1.0 - RATE_WEIGHT) + sample * RATE_WEIGHT) as u64
}

#[derive(Debug, Clone)]
pub struct EngineConfig {
    pub limits: SchedulerLimits,
    /// Host and disk tiers under the device's KV cache, sized in bytes.
    pub tiers: KvTiers,
    /// End-of-sequence ids of the model.
    pub eos_token_ids: Vec<u32>,
    /// Compiles requests' output constraints; `None` refuses constrained requests.
    pub grammar: Option<Arc<GrammarCompiler>>,
    /// Speculative decoding, when configured.
    pub speculative: Option<SpeculativeConfig>,
}

enum Command {
    Submit(Box<Sequence>),
    Cancel(u64),
    Dump(mpsc::Sender<KvDump>),
    ExportKv {
        hashes: Vec<BlockHash>,
        reply: mpsc::Sender<Vec<(BlockHash, Vec<u8>)>>,
    },
    ImportKv {
        parent: Option<BlockHash>,
        blocks: Vec<(BlockHash, Vec<u8>)>,
        reply: mpsc::Sender<usize>,
    },
    Pin {
        name: String,
        hashes: Vec<BlockHash>,
        expires: Option<std::time::Instant>,
        reply: mpsc::Sender<Result<PinStatus, KvError>>,
    },
    Unpin {
        name: String,
        reply: mpsc::Sender<bool>,
    },
    Pins(mpsc::Sender<(Vec<PinStatus>, usize)>),
    ParkOnDisk(mpsc::Sender<usize>),
}

pub struct Engine {
    commands: Option<mpsc::Sender<Command>>,
    kv_events: tokio::sync::broadcast::Sender<KvEvent>,
    thread: Option<JoinHandle<()>>,
    next_id: AtomicU64,
    config: ModelConfig,
    block_size: usize,
    device_blocks: usize,
    kv_layout: KvLayout,
    grammar: Option<Arc<GrammarCompiler>>,
    /// Whether the backend computes embeddings.
    embeds: bool,
    /// The scheduler's load as of its last step or command, and its steps' times so far.
    load: Arc<Mutex<(EngineLoad, StepTimes)>>,
}

impl Engine {
    /// Starts the engine thread over `backend`, speculating as `config.speculative` says (a
    /// proposer needing no model of its own).
    pub fn start(backend: Box<dyn Backend>, config: EngineConfig) -> Result<Self, KvError> {
        let speculator = config
            .speculative
            .clone()
            .map(Speculator::new)
            .transpose()
            .map_err(KvError::Config)?;
        Self::start_with(backend, config, speculator)
    }

    /// [`Engine::start`] with speculation already built (a draft model's proposer).
    pub fn start_with(
        mut backend: Box<dyn Backend>,
        config: EngineConfig,
        speculator: Option<Speculator>,
    ) -> Result<Self, KvError> {
        let model = backend.model_config().clone();
        let block_size = backend.block_size();
        let device_blocks = backend.num_blocks();
        let embeds = backend.embeds();
        let kv_layout = KvLayout {
            backend: backend.kv_layout(),
            model_type: model.architecture.model_type().to_string(),
            num_layers: model.num_layers,
            num_kv_heads: model.num_kv_heads,
            head_dim: model.head_dim,
            block_size,
            block_bytes: backend.block_bytes(),
        };
        let (host_blocks, disk) = config
            .tiers
            .blocks(backend.block_bytes())
            .map_err(KvError::Config)?;
        let memory = backend.host_memory(host_blocks * backend.block_bytes())?;
        let mut manager = BlockManager::with_host_memory(
            BlockManagerConfig {
                block_size,
                device_blocks,
                host_blocks,
                disk,
            },
            backend.block_bytes(),
            memory,
        )?;
        manager.set_restore_policy(config.tiers.restore);
        let kv_events = manager.event_sender();
        let scheduler = Scheduler::new(
            config.limits,
            manager,
            config.eos_token_ids.clone(),
            model.max_position_embeddings,
        )
        .with_speculation(speculator);
        let (tx, rx) = mpsc::channel();
        let load = Arc::new(Mutex::new((scheduler.load(), scheduler.times())));
        let published = Arc::clone(&load);
        let thread = std::thread::Builder::new()
            .name("strata-engine".into())
            .spawn(move || run(backend, scheduler, rx, &published))
            .map_err(|e| KvError::Config(format!("cannot start the engine thread: {e}")))?;
        Ok(Self {
            commands: Some(tx),
            kv_events,
            thread: Some(thread),
            next_id: AtomicU64::new(1),
            config: model,
            block_size,
            device_blocks,
            kv_layout,
            grammar: config.grammar,
            embeds,
            load,
        })
    }

    /// Tokens per KV block.
    pub fn block_size(&self) -> usize {
        self.block_size
    }

    /// How this engine's KV blocks are laid out, for exchanging them with other nodes.
    pub fn kv_layout(&self) -> &KvLayout {
        &self.kv_layout
    }

    /// The load as of the scheduler's last step (or command, when idle).
    pub fn load(&self) -> EngineLoad {
        self.load.lock().unwrap_or_else(PoisonError::into_inner).0
    }

    /// Where the engine thread's steps spent their time so far (as of its last step).
    pub fn step_times(&self) -> StepTimes {
        self.load.lock().unwrap_or_else(PoisonError::into_inner).1
    }

    pub fn model_config(&self) -> &ModelConfig {
        &self.config
    }

    /// Validates and enqueues a request; its tokens arrive on the returned stream.
    pub fn submit(&self, request: GenerateRequest) -> Result<RequestStream, SubmitError> {
        let limits = Admission {
            config: &self.config,
            block_size: self.block_size,
            device_blocks: self.device_blocks,
            pinned_blocks: self.load().pinned_blocks as usize,
            grammar: self.grammar.as_deref(),
            embeds: self.embeds,
        };
        let (sampler, constraint) = limits.admit(&request)?;
        let id = self.next_id.fetch_add(1, Ordering::Relaxed);
        let (tx, rx) = unbounded_channel();
        let seq = Sequence::new(id, request, sampler, tx).with_constraint(constraint);
        self.send(Command::Submit(Box::new(seq)))?;
        Ok(RequestStream { id, events: rx })
    }

    /// Cancels request `id`; its blocks are freed before the next step.
    pub fn cancel(&self, id: u64) -> Result<(), SubmitError> {
        self.send(Command::Cancel(id))
    }

    /// The node's KV events (stored / removed / tier-changed), numbered without gaps. A consumer
    /// that falls behind or sees a gap resynchronises from [`Engine::kv_dump`].
    pub fn subscribe_kv_events(&self) -> tokio::sync::broadcast::Receiver<KvEvent> {
        self.kv_events.subscribe()
    }

    /// Every cached block and its tier as of the event numbered `seq` in the dump.
    pub fn kv_dump(&self) -> Result<KvDump, SubmitError> {
        answer(self.ask(Command::Dump))
    }

    /// The bytes of the leading run of `hashes` cached here (any tier), for another node.
    /// Blocks the engine thread between two steps for the copy.
    pub fn kv_export(
        &self,
        hashes: Vec<BlockHash>,
    ) -> Result<Vec<(BlockHash, Vec<u8>)>, SubmitError> {
        answer(self.ask(|reply| Command::ExportKv { hashes, reply }))
    }

    /// Caches `blocks` (a run of a hash chain after `parent`, with bytes in this engine's
    /// [`KvLayout`]) as if computed here; returns how many leading blocks are now cached.
    pub fn kv_import(
        &self,
        parent: Option<BlockHash>,
        blocks: Vec<(BlockHash, Vec<u8>)>,
    ) -> Result<usize, SubmitError> {
        answer(self.ask(|reply| Command::ImportKv {
            parent,
            blocks,
            reply,
        }))
    }

    /// Pins the leading cached run of `hashes` (a primed prompt's blocks) under `name` until
    /// `expires`, replacing a pin of that name: its blocks are evicted from each tier after
    /// every unpinned block, and never dropped ([`BlockManager::pin`]).
    pub fn pin(
        &self,
        name: String,
        hashes: Vec<BlockHash>,
        expires: Option<std::time::Instant>,
    ) -> Result<Result<PinStatus, KvError>, SubmitError> {
        answer(self.ask_pin(name, hashes, expires))
    }

    fn ask_pin(
        &self,
        name: String,
        hashes: Vec<BlockHash>,
        expires: Option<std::time::Instant>,
    ) -> Result<mpsc::Receiver<Result<PinStatus, KvError>>, SubmitError> {
        self.ask(|reply| Command::Pin {
            name,
            hashes,
            expires,
            reply,
        })
    }

    /// [`Engine::pin`] without waiting for the engine thread (a refusal is dropped): for
    /// request handlers that park a prefix once their request has run.
    pub fn pin_detached(
        &self,
        name: String,
        hashes: Vec<BlockHash>,
        expires: Option<std::time::Instant>,
    ) {
        let _ = self.ask_pin(name, hashes, expires);
    }

    /// Writes every cached block of the device and the host tier to the disk tier, for a node
    /// about to stop ([`BlockManager::park_on_disk`]); how many were written.
    pub fn park_on_disk(&self) -> Result<usize, SubmitError> {
        answer(self.ask(Command::ParkOnDisk))
    }

    /// Drops the pin `name` (its blocks stay cached, unpinned); whether there was one.
    pub fn unpin(&self, name: String) -> Result<bool, SubmitError> {
        answer(self.ask(|reply| Command::Unpin { name, reply }))
    }

    /// Every pin and where its blocks are, with the blocks all pins may hold together.
    pub fn pins(&self) -> Result<(Vec<PinStatus>, usize), SubmitError> {
        answer(self.ask(Command::Pins))
    }

    fn send(&self, command: Command) -> Result<(), SubmitError> {
        let tx = self.commands.as_ref().ok_or(SubmitError::Stopped)?;
        tx.send(command).map_err(|_| SubmitError::Stopped)
    }

    /// Sends the command `make` builds around a reply channel; where its answer will arrive.
    fn ask<T>(
        &self,
        make: impl FnOnce(mpsc::Sender<T>) -> Command,
    ) -> Result<mpsc::Receiver<T>, SubmitError> {
        let (reply, rx) = mpsc::channel();
        self.send(make(reply))?;
        Ok(rx)
    }
}

/// Waits for the engine thread's answer (at most one step).
fn answer<T>(asked: Result<mpsc::Receiver<T>, SubmitError>) -> Result<T, SubmitError> {
    asked?.recv().map_err(|_| SubmitError::Stopped)
}

/// The engine thread's answer as a [`Reply`]: awaited on a blocking thread, so the async
/// workers never wait for a step.
fn later<T: Send + 'static, U: 'static>(
    asked: Result<mpsc::Receiver<T>, SubmitError>,
    then: impl FnOnce(T) -> U + Send + 'static,
) -> Reply<U> {
    Box::pin(async move {
        let rx = asked?;
        let got = tokio::task::spawn_blocking(move || rx.recv())
            .await
            .map_err(|_| SubmitError::Stopped)?;
        got.map(then).map_err(|_| SubmitError::Stopped)
    })
}

impl Drop for Engine {
    fn drop(&mut self) {
        self.commands.take();
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

fn run(
    mut backend: Box<dyn Backend>,
    mut scheduler: Scheduler,
    rx: mpsc::Receiver<Command>,
    load: &Mutex<(EngineLoad, StepTimes)>,
) {
    // The compute rate of prefill-heavy steps, carried into every published load.
    let mut tokens_per_s = 0;
    let publish = |scheduler: &Scheduler, tokens_per_s: u64| {
        let load_now = EngineLoad {
            tokens_per_s,
            ..scheduler.load()
        };
        *load.lock().unwrap_or_else(PoisonError::into_inner) = (load_now, scheduler.times());
    };
    let apply =
        |scheduler: &mut Scheduler, backend: &mut dyn Backend, command: Command| match command {
            Command::Submit(seq) => scheduler.add(*seq),
            Command::Dump(reply) => {
                let _ = reply.send(scheduler.block_manager().dump());
            }
            Command::ExportKv { hashes, reply } => {
                let _ = reply.send(scheduler.block_manager().export_prefix(&hashes, backend));
            }
            Command::ImportKv {
                parent,
                blocks,
                reply,
            } => {
                let imported = scheduler
                    .block_manager_mut()
                    .import_prefix(parent, &blocks, backend);
                let _ = reply.send(imported);
            }
            Command::Pin {
                name,
                hashes,
                expires,
                reply,
            } => {
                let blocks = scheduler.block_manager_mut();
                blocks.expire_pins(std::time::Instant::now());
                let _ = reply.send(blocks.pin(&name, &hashes, expires));
            }
            Command::Unpin { name, reply } => {
                let _ = reply.send(scheduler.block_manager_mut().unpin(&name));
            }
            Command::ParkOnDisk(reply) => {
                let _ = reply.send(scheduler.block_manager_mut().park_on_disk(backend));
            }
            Command::Pins(reply) => {
                let blocks = scheduler.block_manager_mut();
                blocks.expire_pins(std::time::Instant::now());
                let _ = reply.send((blocks.pin_statuses(), blocks.pin_room()));
            }
            Command::Cancel(id) => {
                if let Err(e) = scheduler.cancel(id, FinishReason::Cancelled) {
                    scheduler.fail_all(&e.to_string());
                }
            }
        };
    loop {
        if scheduler.is_idle() {
            match rx.recv() {
                Ok(command) => apply(&mut scheduler, backend.as_mut(), command),
                Err(_) => return,
            }
        }
        loop {
            match rx.try_recv() {
                Ok(command) => apply(&mut scheduler, backend.as_mut(), command),
                Err(mpsc::TryRecvError::Empty) => break,
                Err(mpsc::TryRecvError::Disconnected) if scheduler.is_idle() => return,
                Err(mpsc::TryRecvError::Disconnected) => break,
            }
        }
        publish(&scheduler, tokens_per_s);
        let started = std::time::Instant::now();
        match scheduler.step(backend.as_mut()) {
            Ok(0) => std::thread::yield_now(),
            Ok(n) if n >= RATE_SAMPLE_TOKENS => {
                let seconds = started.elapsed().as_secs_f64().max(1e-9);
                tokens_per_s = average_rate(tokens_per_s, n as f64 / seconds);
                scheduler.block_manager_mut().set_compute_rate(tokens_per_s);
            }
            Ok(_) => {}
            // A failed step is a bug or a broken backend: every request in flight learns why.
            Err(e) => scheduler.fail_all(&e.to_string()),
        }
        if scheduler.is_idle() {
            publish(&scheduler, tokens_per_s);
        }
    }
}

/// The surfaces' view of this engine (strata-engine-api's seam): the same calls, answers that
/// wait for the engine thread awaited off the async workers, pins reported as the node RPC
/// reports them.
impl EngineClient for Engine {
    fn model_config(&self) -> &ModelConfig {
        Engine::model_config(self)
    }

    fn block_size(&self) -> usize {
        Engine::block_size(self)
    }

    fn submit(&self, request: GenerateRequest) -> Result<RequestStream, SubmitError> {
        Engine::submit(self, request)
    }

    fn cancel(&self, id: u64) -> Result<(), SubmitError> {
        Engine::cancel(self, id)
    }

    fn available(&self) -> bool {
        self.commands.is_some()
    }

    fn loads(&self) -> Vec<(String, EngineLoad)> {
        vec![(String::new(), Engine::load(self))]
    }

    fn step_times(&self) -> Option<StepTimes> {
        Some(Engine::step_times(self))
    }

    fn kv_dump(&self) -> Reply<Option<KvDump>> {
        later(self.ask(Command::Dump), Some)
    }

    fn pin(
        &self,
        name: String,
        hashes: Vec<BlockHash>,
        ttl: Duration,
    ) -> Reply<Result<crate::rpc::PinReport, String>> {
        let asked = self.ask_pin(name, hashes, std::time::Instant::now().checked_add(ttl));
        later(asked, |pinned| {
            pinned
                .map(crate::rpc::pin_report)
                .map_err(|e| e.to_string())
        })
    }

    fn pin_detached(&self, name: String, hashes: Vec<BlockHash>, ttl: Duration) {
        Engine::pin_detached(
            self,
            name,
            hashes,
            std::time::Instant::now().checked_add(ttl),
        )
    }

    fn unpin(&self, name: String) -> Reply<bool> {
        later(self.ask(|reply| Command::Unpin { name, reply }), |held| {
            held
        })
    }

    fn pins(&self) -> Reply<Vec<crate::rpc::PinReport>> {
        later(self.ask(Command::Pins), |(pins, _)| {
            pins.into_iter().map(crate::rpc::pin_report).collect()
        })
    }

    fn park_on_disk(&self) -> Reply<Option<usize>> {
        later(self.ask(Command::ParkOnDisk), Some)
    }
}
