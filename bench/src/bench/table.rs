//! The sweep as a plain-text table, one row per point; latencies in milliseconds.

use std::fmt::Write;

use super::report::{PointReport, Summary};

const HEADER: [&str; 13] = [
    "load",
    "ok",
    "failed",
    "out tok/s",
    "req/s",
    "TTFT p50",
    "TTFT p90",
    "TTFT p99",
    "ITL p50",
    "ITL p99",
    "TPOT p50",
    "e2e p50",
    "e2e p99",
];

pub fn render(points: &[PointReport]) -> String {
    let rows: Vec<[String; 13]> = points.iter().map(row).collect();
    let mut widths = HEADER.map(str::len);
    for row in &rows {
        for (w, cell) in widths.iter_mut().zip(row) {
            *w = (*w).max(cell.len());
        }
    }
    let mut out = String::new();
    let header = HEADER.map(str::to_string);
    for cells in std::iter::once(&header).chain(&rows) {
        for (i, (cell, w)) in cells.iter().zip(widths).enumerate() {
            // The load column reads left to right; numbers line up on the right.
            let _ = match i {
                0 => write!(out, "{cell:<w$}"),
                _ => write!(out, "  {cell:>w$}"),
            };
        }
        out.push('\n');
    }
    out
}

fn row(p: &PointReport) -> [String; 13] {
    let ms = |s: Option<Summary>, pick: fn(&Summary) -> f64| {
        s.as_ref()
            .map_or("-".to_string(), |s| format!("{:.1}", pick(s)))
    };
    [
        p.load.to_string(),
        p.completed.to_string(),
        p.failed.to_string(),
        format!("{:.1}", p.output_tok_s),
        format!("{:.2}", p.request_s),
        ms(p.ttft_ms, |s| s.p50),
        ms(p.ttft_ms, |s| s.p90),
        ms(p.ttft_ms, |s| s.p99),
        ms(p.itl_ms, |s| s.p50),
        ms(p.itl_ms, |s| s.p99),
        ms(p.tpot_ms, |s| s.p50),
        ms(p.e2e_ms, |s| s.p50),
        ms(p.e2e_ms, |s| s.p99),
    ]
}

#[cfg(test)]
mod tests {
    use super::super::load::Load;
    use super::*;

    #[test]
    fn one_aligned_row_per_point_and_dashes_for_missing_latencies() {
        let point = |load, ttft| PointReport {
            load,
            concurrency: None,
            request_rate: None,
            num_prompts: 4,
            duration_s: 1.0,
            completed: 4,
            failed: 0,
            input_tokens: 64,
            output_tokens: 32,
            output_tok_s: 32.0,
            request_s: 4.0,
            ttft_ms: ttft,
            itl_ms: None,
            tpot_ms: None,
            e2e_ms: None,
            errors: Vec::new(),
            spec_decode: None,
        };
        let ttft = Summary {
            mean: 12.0,
            p50: 11.04,
            p90: 13.0,
            p99: 14.0,
        };
        let text = render(&[
            point(Load::Concurrency(1), Some(ttft)),
            point(Load::Concurrency(64), None),
        ]);
        let lines: Vec<&str> = text.lines().collect();
        assert_eq!(lines.len(), 3);
        assert!(lines[0].starts_with("load") && lines[0].contains("TTFT p50"));
        assert!(lines[1].starts_with("concurrency 1 ") && lines[1].contains("11.0"));
        assert!(lines[2].contains(" -"));
        assert!(lines.iter().all(|l| l.len() == lines[0].len()));
    }
}
