//! A linearizability checker for the histories the cluster fault battery records.
//!
//! A history is the client-visible record of operations: each with the instant it was invoked, the
//! instant its answer arrived (none when the client gave up: a timeout, a lost leader), and the
//! answer. The history is linearizable against a sequential model when every operation can be
//! given one point between its invocation and its answer such that the answers are those the model
//! gives when the operations run one by one in that order (Herlihy & Wing). An operation without
//! an answer may take effect at any point after its invocation, or never; any answer is accepted
//! for it (it is placed last if it never took effect, which no observation contradicts).
//!
//! The search is Wing & Gong's, with Lowe's memoization of (set of linearized operations, model
//! state) pairs, run separately for each key: the models here are maps of independent keys, so a
//! history is linearizable exactly when each key's sub-history is (P-compositionality). A step
//! budget turns pathological inputs into [`Verdict::Undecided`] rather than an endless search.

#![allow(dead_code)] // each test binary that includes this module uses a part of it

pub mod recorder;
pub mod registry;

use std::collections::{BTreeMap, HashSet};
use std::hash::Hash;
use std::time::Duration;

/// A sequential specification.
pub trait Model {
    type Key: Ord + Clone + std::fmt::Debug;
    type State: Clone + Eq + Hash + std::fmt::Debug;
    type Input: Clone + std::fmt::Debug;
    type Output: Clone + PartialEq + std::fmt::Debug;

    /// The state of a key no operation has touched.
    fn init(&self) -> Self::State;
    /// The key an operation acts on.
    fn key(&self, input: &Self::Input) -> Self::Key;
    /// Runs `input` on `state`: the next state and the answer the model gives.
    fn step(&self, state: &Self::State, input: &Self::Input) -> (Self::State, Self::Output);
}

/// One client operation as recorded.
#[derive(Debug, Clone)]
pub struct Operation<I, O> {
    pub client: usize,
    pub input: I,
    /// When the client sent it, on one monotonic clock for the whole history.
    pub invoked: Duration,
    /// When the answer arrived and what it was; `None` when the client never learned the outcome.
    pub returned: Option<(Duration, O)>,
}

/// One operation of a model's history.
pub type OperationOf<M> = Operation<<M as Model>::Input, <M as Model>::Output>;

/// The checker's answer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Verdict<K> {
    Linearizable,
    /// No order explains the answers recorded for this key.
    Violation {
        key: K,
    },
    /// The search ran out of its step budget on this key.
    Undecided {
        key: K,
    },
}

/// Checks `history` against `model`, at most `budget` search steps per key.
pub fn check<M: Model>(model: &M, history: &[OperationOf<M>], budget: u64) -> Verdict<M::Key> {
    let mut by_key: BTreeMap<M::Key, Vec<&OperationOf<M>>> = BTreeMap::new();
    for op in history {
        by_key.entry(model.key(&op.input)).or_default().push(op);
    }
    for (key, ops) in by_key {
        match check_key(model, &ops, budget) {
            Some(true) => {}
            Some(false) => return Verdict::Violation { key },
            None => return Verdict::Undecided { key },
        }
    }
    Verdict::Linearizable
}

/// One call or return event of the search's list.
#[derive(Debug, Clone, Copy)]
struct Event {
    op: usize,
    is_call: bool,
    prev: usize,
    next: usize,
}

/// Wing & Gong with Lowe's cache over one key's operations: `Some(linearizable)`, or `None` when
/// the budget ran out.
fn check_key<M: Model>(model: &M, ops: &[&OperationOf<M>], budget: u64) -> Option<bool> {
    let n = ops.len();
    if n == 0 {
        return Some(true);
    }
    // Events by time; at equal instants calls come before returns (touching intervals overlap,
    // the permissive reading of a clock's resolution). An unanswered operation returns at the end.
    let mut order: Vec<(Duration, bool, usize)> = Vec::with_capacity(2 * n);
    for (i, op) in ops.iter().enumerate() {
        order.push((op.invoked, false, i));
        let end = op.returned.as_ref().map_or(Duration::MAX, |(at, _)| *at);
        order.push((end, true, i));
    }
    order.sort_by(|a, b| a.0.cmp(&b.0).then(a.1.cmp(&b.1)).then(a.2.cmp(&b.2)));
    // Slot 0 is the list head; events sit at 1..=2n; `NIL` ends the list.
    const NIL: usize = usize::MAX;
    let mut events = vec![
        Event {
            op: NIL,
            is_call: false,
            prev: NIL,
            next: 1,
        };
        2 * n + 1
    ];
    let mut call_at = vec![0; n];
    let mut return_at = vec![0; n];
    for (pos, &(_, is_return, op)) in order.iter().enumerate() {
        let slot = pos + 1;
        events[slot] = Event {
            op,
            is_call: !is_return,
            prev: slot - 1,
            next: if slot == 2 * n { NIL } else { slot + 1 },
        };
        if is_return {
            return_at[op] = slot;
        } else {
            call_at[op] = slot;
        }
    }

    let unlink = |events: &mut Vec<Event>, slot: usize| {
        let (prev, next) = (events[slot].prev, events[slot].next);
        events[prev].next = next;
        if next != NIL {
            events[next].prev = prev;
        }
    };
    let relink = |events: &mut Vec<Event>, slot: usize| {
        let (prev, next) = (events[slot].prev, events[slot].next);
        events[prev].next = slot;
        if next != NIL {
            events[next].prev = slot;
        }
    };

    let words = n.div_ceil(64);
    let mut linearized = vec![0u64; words];
    let mut cache: HashSet<(Vec<u64>, M::State)> = HashSet::new();
    // (op, state before it) for every operation placed so far.
    let mut stack: Vec<(usize, M::State)> = Vec::new();
    let mut state = model.init();
    let mut cursor = events[0].next;
    let mut steps = 0u64;
    while events[0].next != NIL {
        steps += 1;
        if steps > budget {
            return None;
        }
        if cursor == NIL {
            // Only reachable through returns, which are handled below; kept for safety.
            return Some(false);
        }
        let event = events[cursor];
        if event.is_call {
            let op = ops[event.op];
            let (next_state, output) = model.step(&state, &op.input);
            let accepted = match &op.returned {
                Some((_, answer)) => *answer == output,
                None => true,
            };
            if accepted {
                let mut set = linearized.clone();
                set[event.op / 64] |= 1 << (event.op % 64);
                if cache.insert((set.clone(), next_state.clone())) {
                    linearized = set;
                    stack.push((event.op, std::mem::replace(&mut state, next_state)));
                    unlink(&mut events, call_at[event.op]);
                    unlink(&mut events, return_at[event.op]);
                    cursor = events[0].next;
                    continue;
                }
            }
            cursor = event.next;
        } else {
            // An operation's answer came before it could be placed: undo the last placement.
            let Some((op, before)) = stack.pop() else {
                return Some(false);
            };
            state = before;
            linearized[op / 64] &= !(1 << (op % 64));
            relink(&mut events, return_at[op]);
            relink(&mut events, call_at[op]);
            cursor = events[call_at[op]].next;
        }
    }
    Some(true)
}

/// The topology registry as clients see it: a set of names (tenants, keys) with add, remove and
/// a linearizable membership read.
#[derive(Debug, Clone, Copy, Default)]
pub struct SetModel;

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum SetInput {
    Add(String),
    Remove(String),
    Contains(String),
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SetOutput {
    /// `Add` of a new name, `Remove` of a present one.
    Done,
    /// `Add` of a present name, `Remove` of an absent one.
    Unchanged,
    Present(bool),
}

impl Model for SetModel {
    type Key = String;
    type State = bool;
    type Input = SetInput;
    type Output = SetOutput;

    fn init(&self) -> bool {
        false
    }

    fn key(&self, input: &SetInput) -> String {
        match input {
            SetInput::Add(k) | SetInput::Remove(k) | SetInput::Contains(k) => k.clone(),
        }
    }

    fn step(&self, present: &bool, input: &SetInput) -> (bool, SetOutput) {
        match (input, *present) {
            (SetInput::Add(_), false) => (true, SetOutput::Done),
            (SetInput::Add(_), true) => (true, SetOutput::Unchanged),
            (SetInput::Remove(_), true) => (false, SetOutput::Done),
            (SetInput::Remove(_), false) => (false, SetOutput::Unchanged),
            (SetInput::Contains(_), p) => (p, SetOutput::Present(p)),
        }
    }
}
