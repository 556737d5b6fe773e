use super::*;

fn source() -> Source {
    Source {
        receipt: "test".into(),
        pointer: String::new(),
    }
}

/// A node whose decode step takes `points` (batch, ms) and which prefills `rate` tokens/s.
fn profile(points: &[(usize, f64)], rate: f64) -> Profile {
    Profile {
        name: "test".into(),
        device: "test".into(),
        model: "test".into(),
        gpus_per_node: 2,
        max_batch: 256,
        decode: points
            .iter()
            .map(|&(batch, step_ms)| DecodePoint {
                batch,
                step_ms,
                source: source(),
            })
            .collect(),
        prefill: Prefill {
            prompt_tokens: 1000,
            tokens_per_s: rate,
            source: source(),
        },
    }
}

fn work(load: Load) -> Workload {
    Workload {
        load,
        prompt_tokens: 1000.0,
        output_tokens: 100.0,
        prefix_share: 0.0,
        ttft_ms: None,
        itl_ms: None,
    }
}

fn near(a: f64, b: f64, rel: f64) -> bool {
    (a - b).abs() <= rel * b.abs().max(1e-12)
}

#[test]
fn step_time_interpolates_and_extrapolates() {
    let p = profile(&[(1, 5.0), (16, 6.0), (64, 12.0)], 1e4);
    assert!(near(p.step_s(1.0), 0.005, 1e-12));
    assert!(near(p.step_s(0.3), 0.005, 1e-12));
    assert!(near(p.step_s(40.0), 0.009, 1e-12));
    // Beyond the last point: the last slope, 6 ms per 48 sequences.
    assert!(near(p.step_s(112.0), 0.018, 1e-12));
}

#[test]
fn open_loop_matches_the_model_worked_by_hand() {
    // Flat 10 ms steps, 100k prompt tokens/s, 10 requests/s of 1000 + 100 tokens:
    // f = 0.1, B = 10·100·0.01/0.9, ITL = 10/0.9 ms, TTFT = 10 + 0.1/1.8·10 + 5 ms.
    let p = profile(&[(1, 10.0), (256, 10.0)], 1e5);
    let s = p.node(&work(Load::Rate(10.0)), 1);
    assert!(s.stable);
    assert!(near(s.prefill_share, 0.1, 1e-9));
    assert!(near(s.batch, 10.0 / 0.9, 1e-6), "{}", s.batch);
    assert!(near(s.itl_ms, 10.0 / 0.9, 1e-6));
    assert!(near(s.ttft_ms, 10.0 + 0.1 / 1.8 * 10.0 + 5.0, 1e-6));
    assert!(near(s.output_tokens_per_s, 1000.0, 1e-12));
    // Two nodes take half the rate each.
    let two = p.cluster(&work(Load::Rate(10.0)), 2);
    assert!(near(two.per_node.requests_per_s, 5.0, 1e-12));
    assert_eq!(two.gpus, 4);
}

#[test]
fn a_prefix_share_removes_its_prefill() {
    let p = profile(&[(1, 10.0), (256, 10.0)], 1e5);
    let mut w = work(Load::Rate(10.0));
    w.prefix_share = 0.5;
    assert!(near(p.node(&w, 1).prefill_share, 0.05, 1e-9));
}

#[test]
fn overload_is_named() {
    let p = profile(&[(1, 10.0), (256, 10.0)], 1e5);
    // 200 requests/s of 1000 prompt tokens is twice the prefill rate.
    let s = p.node(&work(Load::Rate(200.0)), 1);
    assert!(!s.stable);
    assert!(s.limit.unwrap().contains("prefill alone"));
    // Decode-bound: 256 sequences at 10 ms make at most 25 600 tokens/s.
    let mut w = work(Load::Rate(30.0));
    w.prompt_tokens = 1.0;
    w.output_tokens = 1000.0;
    let s = p.node(&w, 1);
    assert!(!s.stable);
    assert!(s.limit.unwrap().contains("decode cannot keep up"));
}

#[test]
fn closed_loop_matches_the_quadratic() {
    // X·(0.01 + 100·0.01/(1 − 0.01·X)) = 4  ⇔  0.0001·X² − 1.05·X + 4 = 0.
    let p = profile(&[(1, 10.0), (256, 10.0)], 1e5);
    let s = p.node(&work(Load::Concurrency(8.0)), 2);
    let x = (1.05 - (1.05f64 * 1.05 - 4.0 * 0.0001 * 4.0).sqrt()) / (2.0 * 0.0001);
    assert!(
        near(s.requests_per_s, x, 1e-9),
        "{} vs {x}",
        s.requests_per_s
    );
    assert!(near(s.output_tokens_per_s, 100.0 * x, 1e-9));
}

#[test]
fn sizing_finds_the_fewest_nodes_and_the_headroom() {
    // ITL = 10 ms / (1 − f) ≤ 20 ms needs f ≤ 0.5: at most 50 requests/s per node.
    let p = profile(&[(1, 10.0), (256, 10.0)], 1e5);
    let mut w = work(Load::Rate(120.0));
    w.itl_ms = Some(20.0);
    let plan = p.size(&w).unwrap();
    assert_eq!(plan.cluster.nodes, 3);
    assert!(plan.cluster.meets_targets);
    assert!(!p.cluster(&w, 2).meets_targets);
    // 3 nodes carry up to 150 requests/s: headroom 1.25 (to the bisection's 1 %).
    let headroom = plan.cluster.headroom.unwrap();
    assert!(near(headroom, 1.25, 0.011), "{headroom}");
    // Every profile figure is reported with its source.
    assert_eq!(plan.sources.len(), 3);
}

#[test]
fn unreachable_targets_and_bad_input_are_refused_by_name() {
    let p = profile(&[(1, 10.0), (256, 10.0)], 1e5);
    let mut w = work(Load::Rate(1.0));
    w.itl_ms = Some(5.0);
    let e = p.size(&w).unwrap_err().to_string();
    assert!(e.contains("inter-token latency"), "{e}");
    for (bad, what) in [
        (Load::Rate(0.0), "request rate"),
        (Load::Rate(f64::NAN), "request rate"),
        (Load::Concurrency(0.5), "concurrency"),
    ] {
        let e = p.size(&work(bad)).unwrap_err().to_string();
        assert!(e.contains(what), "{e}");
    }
    let mut w = work(Load::Rate(1.0));
    w.prefix_share = 1.5;
    assert!(p.size(&w).unwrap_err().to_string().contains("prefix share"));
    let broken = profile(&[(16, 5.0), (1, 4.0)], 1e5);
    assert!(
        broken
            .size(&work(Load::Rate(1.0)))
            .unwrap_err()
            .to_string()
            .contains("ascending")
    );
    assert!(p.evaluate(&work(Load::Rate(1.0)), 0).is_err());
}
