//! Seeded, bounded fuzzing on stable Rust (docs/DECISIONS.md: cargo-fuzz's libFuzzer needs a
//! nightly toolchain this project does not use), shared by every crate's fuzz tests.
//!
//! A [`Campaign`] takes a seed corpus of valid inputs and feeds a target mutations of them —
//! bits flipped, bytes overwritten, extreme tokens inserted (huge and negative numbers, `null`,
//! lone surrogates, template and grammar syntax, deep nesting, control characters), ranges
//! deleted, duplicated or spliced in from another input, truncation — until a case count or a
//! wall-clock budget runs out. The target answers each case with a label of its outcome ("ok",
//! "refused", …); a panic fails the campaign naming the seed, the case and the input that caused
//! it, and a case still running after [`HANG`] ends the run naming it. CI runs every campaign
//! bounded (seconds); `Campaign::long` runs one for ten minutes and
//! prints a receipt line (`scripts/fuzz-long.sh` gathers them into docs/receipts/fuzz-long.json).

#![allow(dead_code)]

use std::collections::BTreeMap;
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use rand_chacha::ChaCha8Rng;
use rand_core::{Rng, SeedableRng};

/// The recorded runs' length per target (issue 40: at least ten minutes each).
pub const LONG: Duration = Duration::from_secs(600);

/// A case still running after this long is a hang: the campaign's watchdog prints the case and
/// its input and ends the process with a failure (a fuzzer's timeout crash).
pub const HANG: Duration = Duration::from_secs(30);

/// Tokens a mutation may insert: values at the edges of what parsers and limits expect.
const TOKENS: &[&str] = &[
    "0",
    "-1",
    "-0",
    "4294967296",
    "18446744073709551615",
    "-9223372036854775809",
    "1e309",
    "-1e309",
    "0.0000000000000000000001",
    "NaN",
    "null",
    "true",
    "[]",
    "{}",
    "\"\"",
    "\"\\ud800\"",
    "\"\\u0000\"",
    "\\",
    "\"",
    "\u{0}",
    "\u{feff}",
    "\u{202e}",
    "\u{10ffff}",
    "\r\n",
    "{{",
    "}}",
    "{%",
    "%}",
    "{# ",
    "<|im_end|>",
    "<|im_start|>",
    "</s>",
    "$ref",
    "#/$defs/x",
    "(a|b)*",
    "a{99999}",
    "[^",
    "\\p{L}",
    "😀",
];

/// What one campaign ran.
#[derive(Debug, Clone, Default)]
pub struct Report {
    pub target: String,
    pub seed: u64,
    pub cases: usize,
    pub seconds: f64,
    /// How many cases ended each way, by the target's label.
    pub outcomes: BTreeMap<&'static str, usize>,
    /// The test process's peak resident memory when the campaign ended (kB, Linux's VmHWM).
    pub peak_rss_kb: Option<u64>,
}

impl Report {
    pub fn count(&self, outcome: &str) -> usize {
        self.outcomes.get(outcome).copied().unwrap_or(0)
    }

    /// The report of a campaign that keeps its own loop (binary formats with their own
    /// mutations): printed like [`Campaign::run`]'s.
    pub fn of(
        target: &str,
        seed: u64,
        started: Instant,
        cases: usize,
        outcomes: &[(&'static str, usize)],
    ) -> Report {
        let report = Report {
            target: target.to_string(),
            seed,
            cases,
            seconds: started.elapsed().as_secs_f64(),
            outcomes: outcomes.iter().copied().collect(),
            peak_rss_kb: peak_rss_kb(),
        };
        eprintln!("{}", report.receipt_line());
        report
    }

    /// One line of JSON for the recorded runs' receipt.
    pub fn receipt_line(&self) -> String {
        let outcomes: Vec<String> = self
            .outcomes
            .iter()
            .map(|(k, v)| format!("\"{k}\": {v}"))
            .collect();
        format!(
            "FUZZ-RECEIPT {{\"target\": \"{}\", \"seed\": {}, \"cases\": {}, \"seconds\": {:.1}, \"crashes\": 0, \"outcomes\": {{{}}}, \"peak_rss_kb\": {}}}",
            self.target,
            self.seed,
            self.cases,
            self.seconds,
            outcomes.join(", "),
            self.peak_rss_kb
                .map_or_else(|| "null".to_string(), |k| k.to_string())
        )
    }
}

/// A bounded fuzz run of one target.
pub struct Campaign {
    target: String,
    seed: u64,
    max_cases: usize,
    budget: Duration,
}

impl Campaign {
    /// A CI-sized campaign: at most `max_cases` cases within `budget`.
    pub fn new(target: &str, seed: u64, max_cases: usize, budget: Duration) -> Self {
        Self {
            target: target.to_string(),
            seed,
            max_cases,
            budget,
        }
    }

    /// The recorded run of the same target: ten minutes, no case limit.
    pub fn long(self) -> Self {
        Self {
            max_cases: usize::MAX,
            budget: LONG,
            ..self
        }
    }

    /// Feeds `check` mutations of `corpus` (each case mutates one input, now and then the input
    /// itself unchanged) until the cases or the budget run out. A panic in `check` fails here,
    /// naming the case and printing its input.
    pub fn run(&self, corpus: &[Vec<u8>], mut check: impl FnMut(&[u8]) -> &'static str) -> Report {
        let keyed: Vec<((), Vec<u8>)> = corpus.iter().map(|c| ((), c.clone())).collect();
        self.run_keyed(&keyed, |(), input| check(input))
    }

    /// [`Campaign::run`] over inputs that each come with a key the mutations leave alone (the
    /// route a body is sent to, the file a text is written as): one target, several entry points.
    pub fn run_keyed<K: std::fmt::Debug>(
        &self,
        corpus: &[(K, Vec<u8>)],
        mut check: impl FnMut(&K, &[u8]) -> &'static str,
    ) -> Report {
        assert!(!corpus.is_empty(), "{}: an empty seed corpus", self.target);
        let mut rng = ChaCha8Rng::seed_from_u64(self.seed);
        let started = Instant::now();
        let watchdog = Watchdog::start(&self.target, self.seed);
        let mut report = Report {
            target: self.target.clone(),
            seed: self.seed,
            ..Report::default()
        };
        while report.cases < self.max_cases && started.elapsed() < self.budget {
            report.cases += 1;
            let (key, base) = &corpus[rng.next_u32() as usize % corpus.len()];
            let input = match rng.next_u32() % 16 {
                0 => base.clone(),
                // Half the cases keep JSON well formed and change its values and shape, so that
                // they get past the parser to what reads the fields.
                1..=8 => match serde_json::from_slice::<serde_json::Value>(base) {
                    Ok(mut value) => {
                        mutate_json(&mut rng, &mut value);
                        serde_json::to_vec(&value).expect("a JSON value serializes")
                    }
                    Err(_) => base.clone(),
                },
                _ => {
                    let (_, other) = &corpus[rng.next_u32() as usize % corpus.len()];
                    mutate(&mut rng, base, other)
                }
            };
            watchdog.begin(report.cases, &format!("{key:?}"), &input);
            let outcome = catch_unwind(AssertUnwindSafe(|| check(key, &input)));
            watchdog.end();
            match outcome {
                Ok(outcome) => *report.outcomes.entry(outcome).or_default() += 1,
                Err(_) => panic!(
                    "{}: case {} (seed {:#x}, {key:?}) panicked on input {:?}",
                    self.target,
                    report.cases,
                    self.seed,
                    String::from_utf8_lossy(&input)
                ),
            }
        }
        report.seconds = started.elapsed().as_secs_f64();
        report.peak_rss_kb = peak_rss_kb();
        eprintln!("{}", report.receipt_line());
        report
    }
}

/// The case a campaign is running, watched from a thread of its own: one still running after
/// [`HANG`] is printed and the process exits with a failure.
struct Watchdog {
    current: Arc<Mutex<Option<Running>>>,
}

struct Running {
    case: usize,
    since: Instant,
    key: String,
    input: Vec<u8>,
}

impl Watchdog {
    fn start(target: &str, seed: u64) -> Self {
        let current: Arc<Mutex<Option<Running>>> = Arc::default();
        let watched = Arc::downgrade(&current);
        let target = target.to_string();
        std::thread::spawn(move || {
            while let Some(current) = watched.upgrade() {
                if let Some(r) = current.lock().unwrap_or_else(|p| p.into_inner()).as_ref()
                    && r.since.elapsed() > HANG
                {
                    eprintln!(
                        "{target}: case {} (seed {seed:#x}, {}) still running after {:?}: a hang \
                         on input {:?}",
                        r.case,
                        r.key,
                        HANG,
                        String::from_utf8_lossy(&r.input)
                    );
                    std::process::exit(101);
                }
                drop(current);
                std::thread::sleep(Duration::from_millis(250));
            }
        });
        Self { current }
    }

    fn begin(&self, case: usize, key: &str, input: &[u8]) {
        *self.current.lock().unwrap_or_else(|p| p.into_inner()) = Some(Running {
            case,
            since: Instant::now(),
            key: key.to_string(),
            input: input.to_vec(),
        });
    }

    fn end(&self) {
        *self.current.lock().unwrap_or_else(|p| p.into_inner()) = None;
    }
}

/// One to four mutations of `input`; `other` is another corpus entry to splice from.
pub fn mutate(rng: &mut ChaCha8Rng, input: &[u8], other: &[u8]) -> Vec<u8> {
    let mut bytes = input.to_vec();
    for _ in 0..1 + rng.next_u32() % 4 {
        let at = |rng: &mut ChaCha8Rng, len: usize| rng.next_u32() as usize % (len + 1);
        match rng.next_u32() % 9 {
            0 if !bytes.is_empty() => {
                let i = at(rng, bytes.len() - 1);
                bytes[i] ^= 1 << (rng.next_u32() % 8);
            }
            1 if !bytes.is_empty() => {
                let i = at(rng, bytes.len() - 1);
                bytes[i] = rng.next_u32() as u8;
            }
            2 | 3 => {
                let token = TOKENS[rng.next_u32() as usize % TOKENS.len()];
                let i = at(rng, bytes.len());
                bytes.splice(i..i, token.bytes());
            }
            4 => {
                // A number already there made extreme: the first digit run at or after a point.
                let from = at(rng, bytes.len());
                if let Some(start) = bytes[from..].iter().position(u8::is_ascii_digit) {
                    let start = from + start;
                    let end = bytes[start..]
                        .iter()
                        .position(|b| !b.is_ascii_digit())
                        .map_or(bytes.len(), |e| start + e);
                    let token = ["0", "-1", "4294967296", "18446744073709551615", "1e309"]
                        [rng.next_u32() as usize % 5];
                    bytes.splice(start..end, token.bytes());
                }
            }
            5 => {
                let i = at(rng, bytes.len());
                let j = (i + 1 + rng.next_u32() as usize % 64).min(bytes.len());
                bytes.drain(i..j);
            }
            6 => {
                // A range repeated: deep nesting and long runs.
                let i = at(rng, bytes.len());
                let j = (i + 1 + rng.next_u32() as usize % 16).min(bytes.len());
                let piece = bytes[i..j].to_vec();
                for _ in 0..1 + rng.next_u32() % 64 {
                    bytes.splice(j..j, piece.iter().copied());
                }
            }
            7 if !other.is_empty() => {
                let i = at(rng, bytes.len());
                let j = (i + rng.next_u32() as usize % 64).min(bytes.len());
                let s = at(rng, other.len() - 1);
                let t = (s + 1 + rng.next_u32() as usize % 64).min(other.len());
                bytes.splice(i..j, other[s..t].iter().copied());
            }
            _ => {
                let len = at(rng, bytes.len());
                bytes.truncate(len);
            }
        }
    }
    bytes
}

/// Values a JSON mutation may put in place of another: edges of ranges and types, long and
/// nested ones.
fn extreme_value(rng: &mut ChaCha8Rng) -> serde_json::Value {
    use serde_json::json;
    match rng.next_u32() % 18 {
        0 => json!(0),
        1 => json!(-1),
        2 => json!(u64::MAX),
        3 => json!(i64::MIN),
        4 => json!(4_294_967_296u64),
        5 => json!(1e308),
        6 => json!(-0.5),
        7 => json!(2.5),
        8 => json!(true),
        9 => serde_json::Value::Null,
        10 => json!(""),
        11 => json!("x".repeat(1 + rng.next_u32() as usize % 20_000)),
        12 => json!("\u{0}\u{feff}\u{202e}😀<|im_end|>{{x}}"),
        13 => json!([]),
        14 => json!({}),
        15 => {
            let mut v = json!(1);
            for _ in 0..1 + rng.next_u32() % 100 {
                v = json!([v]);
            }
            v
        }
        16 => json!(TOKENS[rng.next_u32() as usize % TOKENS.len()]),
        _ => json!({"type": "object", "properties": {}, "$ref": "#/nowhere"}),
    }
}

/// One to three changes inside a JSON value: a field or element replaced by an extreme value,
/// removed, or repeated; a field added.
pub fn mutate_json(rng: &mut ChaCha8Rng, value: &mut serde_json::Value) {
    for _ in 0..1 + rng.next_u32() % 3 {
        // A random walk down to some node.
        let mut node = &mut *value;
        loop {
            let children = match &*node {
                serde_json::Value::Object(o) => o.len(),
                serde_json::Value::Array(a) => a.len(),
                _ => 0,
            };
            if children == 0 || rng.next_u32().is_multiple_of(3) {
                break;
            }
            let pick = rng.next_u32() as usize % children;
            node = match node {
                serde_json::Value::Object(o) => o.values_mut().nth(pick).expect("in range"),
                serde_json::Value::Array(a) => &mut a[pick],
                _ => unreachable!("only containers have children"),
            };
        }
        let replacement = extreme_value(rng);
        match node {
            serde_json::Value::Object(o) if !o.is_empty() && rng.next_u32().is_multiple_of(3) => {
                let key = o.keys().nth(rng.next_u32() as usize % o.len()).cloned();
                if let Some(key) = key {
                    o.remove(&key);
                }
            }
            serde_json::Value::Object(o) if rng.next_u32().is_multiple_of(4) => {
                o.insert(format!("x{}", rng.next_u32() % 8), replacement);
            }
            serde_json::Value::Array(a) if !a.is_empty() && rng.next_u32().is_multiple_of(3) => {
                let copy = a[rng.next_u32() as usize % a.len()].clone();
                let times = 1 + rng.next_u32() as usize % 300;
                a.extend(std::iter::repeat_n(copy, times));
            }
            other => *other = replacement,
        }
    }
}

/// This process's peak resident memory, kB (Linux).
pub fn peak_rss_kb() -> Option<u64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = status.lines().find(|l| l.starts_with("VmHWM:"))?;
    line.split_whitespace().nth(1)?.parse().ok()
}
