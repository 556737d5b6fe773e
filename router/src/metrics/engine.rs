//! The engine's gauges and counters in the Prometheus text: the local engine's load or each
//! node's last report (sequences, KV use and tiers, preemptions, speculation), and the engine
//! thread's step times.

use std::fmt::Write as _;

use strata_engine_api::load::{EngineLoad, SpecCounters, StepTimes};

/// `name{labels}`: the sample's node label first, then `extra` (either may be empty).
fn sample(name: &str, node: &str, extra: &str) -> String {
    let labels: Vec<&str> = [node, extra]
        .into_iter()
        .filter(|l| !l.is_empty())
        .collect();
    if labels.is_empty() {
        name.to_string()
    } else {
        format!("{name}{{{}}}", labels.join(","))
    }
}

/// Engine gauges: the local engine's load (`node` empty), or each node's last report to a
/// router (labelled `node="ADDR"`): sequences, KV use, preemptions and the KV tiers' traffic. Each
/// family is written once, with a sample per load.
pub(super) fn render_engine_loads(out: &mut String, loads: &[(String, EngineLoad)]) {
    if loads.is_empty() {
        return;
    }
    let nodes: Vec<(String, &EngineLoad)> = loads
        .iter()
        .map(|(addr, load)| {
            let label = if addr.is_empty() {
                String::new()
            } else {
                format!("node=\"{addr}\"")
            };
            (label, load)
        })
        .collect();
    type Value = fn(&EngineLoad) -> String;
    let families: [(&str, &str, &str, Value); 4] = [
        (
            "strata_engine_requests_running",
            "gauge",
            "Sequences the engine is running.",
            |l| l.running.to_string(),
        ),
        (
            "strata_engine_requests_waiting",
            "gauge",
            "Sequences waiting in the engine for KV blocks or a running slot.",
            |l| l.waiting.to_string(),
        ),
        (
            "strata_kv_usage_ratio",
            "gauge",
            "Device KV blocks held by running sequences / device KV blocks (0..1).",
            |l| {
                if l.capacity_blocks == 0 {
                    "0".to_string()
                } else {
                    (l.active_blocks as f64 / l.capacity_blocks as f64).to_string()
                }
            },
        ),
        (
            "strata_preemptions_total",
            "counter",
            "Sequences preempted when the KV cache ran out (they resume later).",
            |l| l.preemptions.to_string(),
        ),
    ];
    for (name, kind, help, value) in families {
        let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} {kind}");
        for (node, load) in &nodes {
            let _ = writeln!(out, "{} {}", sample(name, node, ""), value(load));
        }
    }

    render_kv_tiers(out, &nodes);
    render_spec_decode(out, &nodes);
}

/// The KV tiers: capacity by tier, bytes and time moved between the device and host / disk, and
/// copies that failed.
fn render_kv_tiers(out: &mut String, nodes: &[(String, &EngineLoad)]) {
    let name = "strata_kv_tier_capacity_blocks";
    let _ = writeln!(
        out,
        "# HELP {name} KV blocks each tier holds at most.\n# TYPE {name} gauge"
    );
    for (node, l) in nodes {
        for (tier, n) in [
            ("device", l.capacity_blocks),
            ("host", l.host_capacity_blocks),
            ("disk", l.disk_capacity_blocks),
        ] {
            let _ = writeln!(
                out,
                "{} {n}",
                sample(name, node, &format!("tier=\"{tier}\""))
            );
        }
    }
    type Tiers = fn(&EngineLoad) -> [String; 2];
    let traffic: [(&str, &str, &str, Tiers); 3] = [
        (
            "strata_kv_restored_bytes_total",
            "counter",
            "KV bytes copied back to the device from a lower tier.",
            |l| {
                l.restored_blocks
                    .map(|b| b.saturating_mul(l.block_bytes).to_string())
            },
        ),
        (
            "strata_kv_restore_seconds_total",
            "counter",
            "Engine-thread time restoring KV blocks from a lower tier (reading them, and copying \
             or, from page-locked memory on CUDA, queueing the copy to the device).",
            |l| l.restore_ns.map(|ns| (ns as f64 / 1e9).to_string()),
        ),
        (
            "strata_kv_demoted_bytes_total",
            "counter",
            "KV bytes written into a lower tier (evicted from the tier above).",
            |l| {
                l.demoted_blocks
                    .map(|b| b.saturating_mul(l.block_bytes).to_string())
            },
        ),
    ];
    for (name, kind, help, values) in traffic {
        let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} {kind}");
        for (node, l) in nodes {
            let [host, disk] = values(l);
            let _ = writeln!(out, "{} {host}", sample(name, node, "tier=\"host\""));
            let _ = writeln!(out, "{} {disk}", sample(name, node, "tier=\"disk\""));
        }
    }
    let name = "strata_kv_tier_copy_failures_total";
    let _ = writeln!(
        out,
        "# HELP {name} Copies between KV tiers that failed (each cost a cached block or one \
         request).\n# TYPE {name} counter"
    );
    for (node, l) in nodes {
        let _ = writeln!(out, "{} {}", sample(name, node, ""), l.tier_copy_failures);
    }
}

/// Speculative decoding's counters, in vLLM's `spec_decode_*` families: verifications,
/// proposed and accepted tokens, and verifications by accepted length (a histogram: bucket `le`
/// counts those that accepted at most that many). Written only where an engine speculates.
fn render_spec_decode(out: &mut String, nodes: &[(String, &EngineLoad)]) {
    if nodes.iter().all(|(_, l)| l.spec.drafts == 0) {
        return;
    }
    type Count = fn(&SpecCounters) -> u64;
    let counters: [(&str, &str, Count); 3] = [
        (
            "strata_spec_decode_num_drafts_total",
            "Verifications run: sequence steps that carried proposed tokens.",
            |c| c.drafts,
        ),
        (
            "strata_spec_decode_num_draft_tokens_total",
            "Tokens proposed and verified.",
            |c| c.draft_tokens,
        ),
        (
            "strata_spec_decode_num_accepted_tokens_total",
            "Proposed tokens accepted (each a decode step saved).",
            |c| c.accepted_tokens,
        ),
    ];
    for (name, help, value) in counters {
        let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} counter");
        for (node, l) in nodes {
            let _ = writeln!(out, "{} {}", sample(name, node, ""), value(&l.spec));
        }
    }
    let name = "strata_spec_decode_accepted_length";
    let _ = writeln!(
        out,
        "# HELP {name} Proposed tokens accepted per verification.\n# TYPE {name} histogram"
    );
    for (node, l) in nodes {
        let c = &l.spec;
        let mut cumulative = 0;
        for (len, n) in c.accepted_hist.iter().enumerate() {
            cumulative += n;
            let le = format!("le=\"{len}\"");
            let _ = writeln!(
                out,
                "{} {cumulative}",
                sample(&format!("{name}_bucket"), node, &le)
            );
        }
        let inf = "le=\"+Inf\"";
        let _ = writeln!(
            out,
            "{} {}",
            sample(&format!("{name}_bucket"), node, inf),
            c.drafts
        );
        let _ = writeln!(
            out,
            "{} {}",
            sample(&format!("{name}_sum"), node, ""),
            c.accepted_tokens
        );
        let _ = writeln!(
            out,
            "{} {}",
            sample(&format!("{name}_count"), node, ""),
            c.drafts
        );
    }
}

/// The engine thread's steps: how many, the tokens they computed, and their time by phase
/// (docs/PERFORMANCE.md reads a step's host overhead from these).
pub(super) fn render_step_times(out: &mut String, t: &StepTimes) {
    let name = "strata_engine_steps_total";
    let _ = writeln!(
        out,
        "# HELP {name} Engine steps that computed tokens.\n# TYPE {name} counter\n{name} {}",
        t.steps
    );
    let name = "strata_engine_step_tokens_total";
    let _ = writeln!(
        out,
        "# HELP {name} Tokens computed by engine steps (prompt and generated).\n\
         # TYPE {name} counter\n{name} {}",
        t.tokens
    );
    let name = "strata_engine_step_seconds_total";
    let _ = writeln!(
        out,
        "# HELP {name} Engine step time by phase: plan (scheduling, KV blocks), forward (the \
         backend, with the copy back to the host), sample (sampling and bookkeeping on the \
         host).\n# TYPE {name} counter"
    );
    for (phase, ns) in [
        ("plan", t.plan_ns),
        ("forward", t.forward_ns),
        ("sample", t.sample_ns),
    ] {
        let _ = writeln!(out, "{name}{{phase=\"{phase}\"}} {}", ns as f64 / 1e9);
    }
}
