use super::*;

fn params(f: impl FnOnce(&mut SamplingParams)) -> SamplingParams {
    let mut p = SamplingParams::default();
    f(&mut p);
    p
}

/// Deterministic pseudo-random logits in [-4, 4).
fn random_rows(seed: u64, rows: usize, vocab: usize) -> Vec<Vec<f32>> {
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    (0..rows)
        .map(|_| {
            (0..vocab)
                .map(|_| (unit_f64(rng.next_u64()) * 8.0 - 4.0) as f32)
                .collect()
        })
        .collect()
}

/// 53 random bits → uniform in [0, 1).
fn unit_f64(bits: u64) -> f64 {
    (bits >> 11) as f64 * (1.0 / (1u64 << 53) as f64)
}

fn pick(sampler: &mut Sampler, logits: &[f32]) -> Sampled {
    sampler.sample(&mut logits.to_vec()).unwrap()
}

fn run(sampler: &mut Sampler, rows: &[Vec<f32>]) -> Vec<u32> {
    rows.iter()
        .map(|r| sampler.sample(&mut r.clone()).unwrap().token)
        .collect()
}

fn log_softmax(logits: &[f32], t: f64) -> Vec<f64> {
    let max = logits.iter().fold(f32::MIN, |a, &b| a.max(b)) as f64;
    let total: f64 = logits.iter().map(|&l| ((l as f64 - max) / t).exp()).sum();
    logits
        .iter()
        .map(|&l| (l as f64 - max) / t - total.ln())
        .collect()
}

#[test]
fn greedy_takes_argmax_with_lowest_id_on_ties_and_never_nan() {
    let mut s = Sampler::new(&SamplingParams::greedy(), 5).unwrap();
    let out = pick(&mut s, &[f32::NAN, 1.0, 3.0, 3.0, -2.0]);
    assert_eq!(
        (out.token, out.logprob),
        (2, None),
        "no logprob unless asked"
    );
    let mut asked = Sampler::new(
        &params(|p| {
            p.temperature = 0.0;
            p.logprobs = Some(0);
        }),
        5,
    )
    .unwrap();
    let out = pick(&mut asked, &[f32::NAN, 1.0, 3.0, 3.0, -2.0]);
    let expected = log_softmax(&[1.0, 3.0, 3.0, -2.0], 1.0)[1];
    assert!(
        (out.logprob.unwrap() as f64 - expected).abs() < 1e-6,
        "{out:?} vs {expected}"
    );
    let nan = f32::NAN;
    assert_eq!(pick(&mut s, &[nan, nan, -1.0, nan, -1.0]).token, 2);
    assert_eq!(
        pick(&mut s, &[1.0, f32::INFINITY, 0.0, f32::INFINITY, 2.0]).token,
        1
    );
    assert_eq!(s.sample(&mut [nan; 5]), Err(SamplerError::NoFiniteLogit));
}

#[test]
fn logit_bias_flips_the_argmax() {
    let p = params(|p| {
        p.temperature = 0.0;
        p.logit_bias.insert(3, 5.0);
        p.logit_bias.insert(99, 100.0); // outside the vocabulary: ignored
    });
    let mut s = Sampler::new(&p, 4).unwrap();
    let mut logits = [2.0, 0.0, 1.0, -2.5];
    assert_eq!(s.sample(&mut logits).unwrap().token, 3);
    assert_eq!(logits, [2.0, 0.0, 1.0, 2.5]);
}

#[test]
fn repetition_penalty_divides_positive_and_multiplies_negative_seen_logits() {
    let p = params(|p| {
        p.temperature = 0.0;
        p.repetition_penalty = 2.0;
    });
    let mut s = Sampler::new(&p, 5).unwrap();
    s.observe_prompt(&[0, 1, 1, 7_000]);
    let mut logits = [3.0, -1.0, 2.0, 0.5, -4.0];
    assert_eq!(s.sample(&mut logits).unwrap().token, 2);
    assert_eq!(logits, [1.5, -2.0, 2.0, 0.5, -4.0]);
    // Token 2 is now in the output, so it is penalized too; each seen token exactly once.
    let mut logits = [3.0, -1.0, 2.0, 0.5, -4.0];
    assert_eq!(s.sample(&mut logits).unwrap().token, 0);
    assert_eq!(logits, [1.5, -2.0, 1.0, 0.5, -4.0]);
}

#[test]
fn presence_and_frequency_count_output_tokens_only() {
    let p = params(|p| {
        p.temperature = 0.0;
        p.presence_penalty = 0.5;
        p.frequency_penalty = 0.25;
    });
    let mut s = Sampler::new(&p, 4).unwrap();
    s.observe_prompt(&[0, 1]);
    assert_eq!(s.sample(&mut [0.0, 0.0, 10.0, 0.0]).unwrap().token, 2);
    assert_eq!(s.sample(&mut [0.0, 0.0, 10.0, 0.0]).unwrap().token, 2);
    assert_eq!(s.sample(&mut [0.0, 0.0, 0.0, 5.0]).unwrap().token, 3);
    let mut logits = [0.0; 4];
    s.sample(&mut logits).unwrap();
    assert_eq!(logits, [0.0, 0.0, -1.0, -0.75]);
    assert_eq!(s.output(), &[2, 2, 3, 0]);
}

#[test]
fn top_k_one_equals_greedy() {
    let rows = random_rows(1, 50, 64);
    let mut greedy = Sampler::new(&SamplingParams::greedy(), 64).unwrap();
    let mut top1 = Sampler::new(&params(|p| p.top_k = 1), 64).unwrap();
    assert_eq!(run(&mut greedy, &rows), run(&mut top1, &rows));
    assert_eq!(pick(&mut top1, &rows[0]).logprob, Some(0.0));
}

#[test]
fn top_k_ties_at_the_boundary_keep_the_lowest_ids() {
    let mut s = Sampler::new(&params(|p| p.top_k = 2), 6).unwrap();
    for _ in 0..200 {
        let out = pick(&mut s, &[1.0; 6]);
        assert!(out.token < 2, "token {}", out.token);
        assert!((out.logprob.unwrap() - 0.5f32.ln()).abs() < 1e-6);
    }
}

#[test]
fn tiny_top_p_keeps_only_the_top_token() {
    let rows = random_rows(2, 50, 64);
    let mut greedy = Sampler::new(&SamplingParams::greedy(), 64).unwrap();
    let mut nucleus = Sampler::new(&params(|p| p.top_p = 1e-6), 64).unwrap();
    assert_eq!(run(&mut greedy, &rows), run(&mut nucleus, &rows));
}

#[test]
fn top_p_keeps_exactly_the_full_sort_nucleus() {
    let (n, top_p, t) = (4000, 0.9f32, 0.7);
    let peaked = random_rows(6, 20, n)
        .into_iter()
        .map(|r| r.iter().map(|l| l * 4.0).collect());
    let flat = random_rows(7, 5, n)
        .into_iter()
        .map(|r| r.iter().map(|l| l * 0.02).collect());
    // Tight case for the pre-sort floor: one token just short of `top_p`, the rest spread
    // evenly, so the cutoff token weighs barely more than (1 - top_p) / n.
    let mut edge = vec![0.0f32; n];
    edge[7] = (t * (0.89999 * (n - 1) as f64 / 0.10001).ln()) as f32;
    let mut s = Sampler::new(&params(|p| (p.top_p, p.temperature) = (top_p, t as f32)), n);
    let s = s.as_mut().unwrap();
    for row in peaked.chain(flat).chain([edge]).collect::<Vec<Vec<f32>>>() {
        let logp = log_softmax(&row, t);
        let mut order: Vec<usize> = (0..n).collect();
        order.sort_by(|&a, &b| logp[b].total_cmp(&logp[a]).then(a.cmp(&b)));
        let mut mass = 0.0;
        let cut = order.iter().position(|&i| {
            mass += logp[i].exp();
            mass >= f64::from(top_p)
        });
        let nucleus = &order[..=cut.unwrap()];

        let plan = s.clone().plan(Vec::new());
        let summary = RowSummary::of(&row, &plan.draw).unwrap();
        let prefix: Vec<usize> = summary.prefix.iter().map(|c| c.0 as usize).collect();
        assert!(nucleus.iter().all(|i| prefix.contains(i)), "{nucleus:?}");

        let out = pick(s, &row);
        assert!(nucleus.contains(&(out.token as usize)), "{out:?}");
        let expected = logp[out.token as usize] - mass.ln();
        assert!(
            (f64::from(out.logprob.unwrap()) - expected).abs() < 1e-4,
            "{out:?} vs {expected}"
        );
    }
}

#[test]
fn min_p_drops_tokens_below_the_fraction_of_the_top() {
    let logits: Vec<f32> = [0.5f32, 0.3, 0.2].iter().map(|p| p.ln()).collect();
    let mut s = Sampler::new(&params(|p| p.min_p = 0.5), 3).unwrap();
    let mut counts = [0u32; 3];
    for _ in 0..1000 {
        let out = pick(&mut s, &logits);
        counts[out.token as usize] += 1;
        let expected = [0.5f32 / 0.8, 0.3 / 0.8][out.token as usize].ln();
        assert!((out.logprob.unwrap() - expected).abs() < 1e-5);
    }
    assert_eq!(counts[2], 0);
    assert!(counts[0] > counts[1] && counts[1] > 0, "{counts:?}");
}

#[test]
fn same_seed_same_tokens_different_seed_different_tokens() {
    let rows = random_rows(3, 200, 32);
    let sample_with = |seed| {
        let p = params(|p| {
            p.seed = seed;
            p.top_k = 20;
            p.top_p = 0.95;
            p.min_p = 0.01;
            p.temperature = 0.8;
        });
        run(&mut Sampler::new(&p, 32).unwrap(), &rows)
    };
    assert_eq!(sample_with(7), sample_with(7));
    let (a, b) = (sample_with(7), sample_with(8));
    let differing = a.iter().zip(&b).filter(|(x, y)| x != y).count();
    assert!(differing > 100, "only {differing} of 200 tokens differ");
}

#[test]
fn draws_follow_the_softmax_at_temperature_one() {
    let logits = [0.0f32, 1.0, -1.0, 2.0, 0.5, -0.5, 1.5, -2.0];
    let probs: Vec<f64> = log_softmax(&logits, 1.0).iter().map(|l| l.exp()).collect();
    let mut s = Sampler::new(&params(|p| p.seed = 42), 8).unwrap();
    let draws = 20_000;
    let mut counts = [0u32; 8];
    for _ in 0..draws {
        let out = pick(&mut s, &logits);
        let expected = probs[out.token as usize].ln();
        assert!((out.logprob.unwrap() as f64 - expected).abs() < 1e-5);
        counts[out.token as usize] += 1;
    }
    let chi2: f64 = counts
        .iter()
        .zip(&probs)
        .map(|(&c, &p)| (c as f64 - p * draws as f64).powi(2) / (p * draws as f64))
        .sum();
    // 7 degrees of freedom: 24.3 is the 0.1% critical value. The seed is fixed, so this is
    // not flaky; a wrong distribution (e.g. an off-by-one in the walk) lands far above it.
    assert!(chi2 < 24.3, "chi-square {chi2}, counts {counts:?}");
}

#[test]
fn temperature_sharpens_and_reports_the_scaled_logprob() {
    let logits = [1.0f32, 0.0, -1.0];
    let mut s = Sampler::new(&params(|p| p.temperature = 0.5), 3).unwrap();
    let expected = log_softmax(&logits, 0.5);
    let mut zeros = 0;
    for _ in 0..1000 {
        let out = pick(&mut s, &logits);
        assert!((out.logprob.unwrap() as f64 - expected[out.token as usize]).abs() < 1e-5);
        zeros += u32::from(out.token == 0);
    }
    assert!(zeros > 800, "{zeros}"); // p(0) = 0.867 at T = 0.5 vs 0.665 at T = 1
    // A vanishing temperature is effectively greedy, without overflow.
    let mut cold = Sampler::new(&params(|p| p.temperature = 1e-30), 3).unwrap();
    let out = pick(&mut cold, &[0.0, f32::MAX, -f32::MAX]);
    assert_eq!((out.token, out.logprob), (1, Some(0.0)));
}

#[test]
fn restored_state_continues_the_same_stream() {
    let p = params(|p| {
        p.seed = 11;
        p.repetition_penalty = 1.3;
        p.presence_penalty = 0.4;
        p.frequency_penalty = 0.2;
        p.top_k = 16;
    });
    let rows = random_rows(4, 100, 48);
    let mut original = Sampler::new(&p, 48).unwrap();
    original.observe_prompt(&[1, 5, 5, 9, 47]);
    let head = run(&mut original, &rows[..37]);
    let state = original.state();
    let json = serde_json::to_string(&state).unwrap();
    let state: SamplerState = serde_json::from_str(&json).unwrap();
    assert_eq!(state.prompt_tokens, [1, 5, 9, 47]);
    assert_eq!(state.output_tokens, head);

    let mut restored = Sampler::restore(&p, 48, &state).unwrap();
    assert_eq!(
        run(&mut original, &rows[37..]),
        run(&mut restored, &rows[37..])
    );

    // Without the penalty history or the RNG position the continuation differs: the test
    // above could fail.
    let mut fresh = Sampler::new(&p, 48).unwrap();
    let mut original = Sampler::restore(&p, 48, &state).unwrap();
    assert_ne!(
        run(&mut original, &rows[37..]),
        run(&mut fresh, &rows[37..])
    );
}

#[test]
fn restore_rejects_foreign_state() {
    let p = params(|p| p.seed = 1);
    let state = Sampler::new(&p, 8).unwrap().state();
    let other_seed = params(|p| p.seed = 2);
    assert_eq!(
        Sampler::restore(&other_seed, 8, &state).unwrap_err(),
        SamplerError::SeedMismatch {
            state: 1,
            params: 2
        }
    );
    let big = SamplerState {
        output_tokens: vec![3, 8],
        ..state
    };
    assert_eq!(
        Sampler::restore(&p, 8, &big).unwrap_err(),
        SamplerError::TokenOutOfVocab {
            token: 8,
            vocab_size: 8
        }
    );
}

#[test]
fn bad_input_is_an_error_not_a_panic() {
    let bad = params(|p| p.top_p = 0.0);
    assert!(matches!(
        Sampler::new(&bad, 4),
        Err(SamplerError::InvalidParams(_))
    ));
    let mut s = Sampler::new(&SamplingParams::default(), 4).unwrap();
    assert_eq!(
        s.sample(&mut [0.0; 3]).unwrap_err(),
        SamplerError::LengthMismatch {
            expected: 4,
            got: 3
        }
    );
    let mut all_dead = [f32::NAN, f32::NEG_INFINITY, f32::NAN, f32::NEG_INFINITY];
    assert_eq!(s.sample(&mut all_dead), Err(SamplerError::NoFiniteLogit));
    // +inf tokens share the mass; NaN is never drawn.
    for _ in 0..100 {
        let out = pick(&mut s, &[f32::INFINITY, f32::NAN, 3.0, f32::INFINITY]);
        assert!(out.token == 0 || out.token == 3);
        assert!((out.logprob.unwrap() - 0.5f32.ln()).abs() < 1e-6);
    }
    assert!(s.output().iter().all(|&t| t == 0 || t == 3));
}

#[test]
fn finishing_from_a_longer_prefix_in_any_order_changes_nothing() {
    // The GPU's summary may hold more of the ranking than needed (ties at the threshold,
    // a longer rank prefix) and in any order; the finish must not care. Canary: a prefix
    // cut short of the nucleus is refused, not sampled from.
    let rows = random_rows(11, 40, 500);
    for (i, p) in [
        params(|p| (p.top_k, p.temperature) = (7, 0.8)),
        params(|p| (p.top_p, p.min_p) = (0.5, 0.2)),
        params(|p| (p.top_k, p.top_p, p.logprobs) = (40, 0.9, Some(5))),
        params(|p| (p.temperature, p.logprobs) = (0.0, Some(3))),
    ]
    .iter()
    .enumerate()
    {
        let mut a = Sampler::new(p, 500).unwrap();
        let mut b = a.clone();
        for row in &rows {
            let expected = a.sample(&mut row.clone()).unwrap();
            let plan = b.plan(Vec::new());
            let mut summary = RowSummary::of(row, &plan.draw).unwrap();
            let extra: Vec<(u32, f32)> = (0u32..)
                .zip(row)
                .map(|(id, &l)| (id, l))
                .filter(|c| !summary.prefix.contains(c))
                .collect();
            let mut ranked = extra.clone();
            ranked.sort_by(row::rank);
            summary.prefix.extend(ranked.iter().take(10));
            summary.prefix.reverse();
            if i == 1 {
                // Random logits over 500 tokens: the 0.5 nucleus holds many tokens.
                let mut short = summary.clone();
                short.sort_prefix();
                short.prefix.truncate(1);
                assert_eq!(
                    short.finish(&plan.draw),
                    Err(SamplerError::IncompleteSummary("top-p"))
                );
            }
            assert_eq!(b.finish(&plan, summary).unwrap(), expected);
        }
    }
}

#[test]
fn accepting_the_greedy_token_equals_sampling_it() {
    let rows = random_rows(9, 40, 300);
    let mut sampled = Sampler::new(&SamplingParams::greedy(), 300).unwrap();
    let mut accepted = sampled.clone();
    assert!(sampled.is_plain_greedy());
    for row in &rows {
        let token = greedy_token(row).unwrap();
        assert_eq!(pick(&mut sampled, row).token, token);
        assert_eq!(accepted.accept(token).unwrap().token, token);
    }
    assert_eq!(sampled.state(), accepted.state());
    assert!(accepted.accept(300).is_err(), "out of the vocabulary");
    // Anything that shapes the logits or reports from them needs the row on the host.
    for shaped in [
        params(|p| p.temperature = 0.5),
        params(|p| {
            p.temperature = 0.0;
            p.repetition_penalty = 1.1;
        }),
        params(|p| {
            p.temperature = 0.0;
            p.logit_bias.insert(1, 1.0);
        }),
        params(|p| {
            p.temperature = 0.0;
            p.logprobs = Some(0);
        }),
    ] {
        assert!(!Sampler::new(&shaped, 300).unwrap().is_plain_greedy());
    }
}

#[test]
fn greedy_token_sanitizes_like_the_sampler() {
    let (nan, inf) = (f32::NAN, f32::INFINITY);
    assert_eq!(greedy_token(&[nan, -inf, -inf]), None);
    assert_eq!(greedy_token(&[-inf, -inf, -3.0]), Some(2));
    // +inf ranks as f32::MAX: a tie, so the lower id wins.
    assert_eq!(greedy_token(&[0.0, f32::MAX, inf]), Some(1));
    assert_eq!(greedy_token(&[-0.0, 0.0]), Some(0));
}
