//! The linearizability checker the cluster fault battery relies on: it must accept every history a
//! correct atomic registry can produce, and reject the ones a lost or early-acknowledged write
//! produces (the battery's canaries are only as good as this).

mod history;

use std::time::Duration;

use history::{Model, Operation, SetInput, SetModel, SetOutput, Verdict, check};

const BUDGET: u64 = 5_000_000;

fn ms(v: u64) -> Duration {
    Duration::from_millis(v)
}

fn op(
    client: usize,
    input: SetInput,
    invoked: u64,
    returned: Option<(u64, SetOutput)>,
) -> Operation<SetInput, SetOutput> {
    Operation {
        client,
        input,
        invoked: ms(invoked),
        returned: returned.map(|(at, out)| (ms(at), out)),
    }
}

fn add(k: &str) -> SetInput {
    SetInput::Add(k.into())
}
fn remove(k: &str) -> SetInput {
    SetInput::Remove(k.into())
}
fn contains(k: &str) -> SetInput {
    SetInput::Contains(k.into())
}

#[test]
fn a_sequential_history_is_linearizable() {
    let h = vec![
        op(0, add("a"), 0, Some((1, SetOutput::Done))),
        op(0, contains("a"), 2, Some((3, SetOutput::Present(true)))),
        op(0, add("a"), 4, Some((5, SetOutput::Unchanged))),
        op(0, remove("a"), 6, Some((7, SetOutput::Done))),
        op(0, contains("a"), 8, Some((9, SetOutput::Present(false)))),
    ];
    assert_eq!(check(&SetModel, &h, BUDGET), Verdict::Linearizable);
}

#[test]
fn a_read_concurrent_with_a_write_may_see_either_side() {
    for seen in [true, false] {
        let h = vec![
            op(0, add("a"), 0, Some((10, SetOutput::Done))),
            op(1, contains("a"), 2, Some((5, SetOutput::Present(seen)))),
        ];
        assert_eq!(check(&SetModel, &h, BUDGET), Verdict::Linearizable);
    }
}

#[test]
fn a_stale_read_after_an_acknowledged_write_is_a_violation() {
    // The canary shape: a write acknowledged (before it was committed) and then lost.
    let h = vec![
        op(0, add("a"), 0, Some((1, SetOutput::Done))),
        op(1, contains("a"), 2, Some((3, SetOutput::Present(false)))),
    ];
    assert_eq!(
        check(&SetModel, &h, BUDGET),
        Verdict::Violation { key: "a".into() }
    );
}

#[test]
fn two_clients_cannot_both_add_the_same_new_name() {
    let h = vec![
        op(0, add("a"), 0, Some((10, SetOutput::Done))),
        op(1, add("a"), 1, Some((9, SetOutput::Done))),
    ];
    assert_eq!(
        check(&SetModel, &h, BUDGET),
        Verdict::Violation { key: "a".into() }
    );
}

#[test]
fn reads_must_not_go_back_in_time() {
    // Two sequential reads during a long write: once one saw it, a later one must too.
    let h = vec![
        op(0, add("a"), 0, Some((100, SetOutput::Done))),
        op(1, contains("a"), 10, Some((20, SetOutput::Present(true)))),
        op(1, contains("a"), 30, Some((40, SetOutput::Present(false)))),
    ];
    assert_eq!(
        check(&SetModel, &h, BUDGET),
        Verdict::Violation { key: "a".into() }
    );
}

#[test]
fn an_unanswered_write_may_or_may_not_have_taken_effect() {
    for seen in [true, false] {
        let h = vec![
            op(0, add("a"), 0, None),
            op(1, contains("a"), 50, Some((60, SetOutput::Present(seen)))),
        ];
        assert_eq!(check(&SetModel, &h, BUDGET), Verdict::Linearizable);
    }
    // But not before it was sent.
    let h = vec![
        op(1, contains("a"), 0, Some((10, SetOutput::Present(true)))),
        op(0, add("a"), 20, None),
    ];
    assert_eq!(
        check(&SetModel, &h, BUDGET),
        Verdict::Violation { key: "a".into() }
    );
}

#[test]
fn keys_are_checked_independently() {
    let h = vec![
        op(0, add("a"), 0, Some((1, SetOutput::Done))),
        op(0, add("b"), 2, Some((3, SetOutput::Done))),
        op(1, contains("a"), 4, Some((5, SetOutput::Present(true)))),
        op(1, contains("b"), 6, Some((7, SetOutput::Present(false)))),
    ];
    assert_eq!(
        check(&SetModel, &h, BUDGET),
        Verdict::Violation { key: "b".into() }
    );
}

/// A small xorshift, so the generated histories are reproducible without a dependency.
struct Rng(u64);

impl Rng {
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

/// Histories of a correct atomic set under concurrent clients: each operation takes effect at one
/// instant inside its interval, some answers are lost. Each must be accepted; changing the answer
/// of one read that overlaps no write of its key and saw a definite state must be rejected.
#[test]
fn generated_histories_of_a_correct_set_pass_and_a_flipped_isolated_read_fails() {
    let names = ["a", "b", "c"];
    let mut flipped_checked = 0;
    for seed in 1..=300u64 {
        let mut rng = Rng(seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1);
        let mut present = [false; 3];
        let mut history = Vec::new();
        // Linearization points 10 ms apart; each interval reaches a random distance either side,
        // so intervals of neighbouring operations overlap.
        for i in 0..40u64 {
            let point = 10 * i + 5;
            let k = rng.below(3) as usize;
            let name = names[k];
            let input = match rng.below(3) {
                0 => add(name),
                1 => remove(name),
                _ => contains(name),
            };
            let (state, output) = SetModel.step(&present[k], &input);
            present[k] = state;
            let invoked = point - rng.below(15).min(point);
            let returned = if rng.below(10) == 0 {
                None
            } else {
                Some((point + rng.below(15), output))
            };
            history.push(op((i % 4) as usize, input, invoked, returned));
        }
        assert_eq!(
            check(&SetModel, &history, BUDGET),
            Verdict::Linearizable,
            "seed {seed}: a correct history was rejected"
        );

        // The canary: a read whose interval overlaps no other operation on its key (so its
        // answer is determined) with the answer flipped.
        let isolated = history.iter().position(|o| {
            let SetInput::Contains(name) = &o.input else {
                return false;
            };
            let Some((end, _)) = o.returned else {
                return false;
            };
            history.iter().all(|p| {
                std::ptr::eq(p, o)
                    || SetModel.key(&p.input) != *name
                    || p.returned.as_ref().is_some_and(|(pe, _)| *pe < o.invoked)
                    || p.invoked > end
            })
        });
        if let Some(i) = isolated {
            let mut bad = history.clone();
            if let Some((_, SetOutput::Present(seen))) = &mut bad[i].returned {
                *seen = !*seen;
            }
            assert!(
                matches!(check(&SetModel, &bad, BUDGET), Verdict::Violation { .. }),
                "seed {seed}: a flipped isolated read was accepted"
            );
            flipped_checked += 1;
        }
    }
    assert!(
        flipped_checked > 50,
        "only {flipped_checked} canaries were built"
    );
}

#[test]
fn a_search_out_of_budget_is_undecided_not_an_answer() {
    // 13 adds and 11 removes of one name, all concurrent and all answered `Done`: impossible (the
    // `Done` adds and removes must alternate), but only after trying a vast number of orders.
    let mut h = Vec::new();
    for i in 0..24u64 {
        let input = if i < 13 { add("a") } else { remove("a") };
        h.push(op(i as usize, input, 0, Some((1000, SetOutput::Done))));
    }
    assert_eq!(
        check(&SetModel, &h, 50),
        Verdict::Undecided { key: "a".into() }
    );
    // A few of them are decided quickly.
    assert_eq!(
        check(&SetModel, &h[11..16], BUDGET),
        Verdict::Violation { key: "a".into() }
    );
}
