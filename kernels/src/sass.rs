//! The instruction budget without a GPU: a kernel's SASS as `nvdisasm` lists it
//! ([`crate::check::sass`]), its hot loop found, and the loop's instructions counted per weight.
//!
//! The GEMV kernels' K loop is the loop that holds their tensor-core instructions: the backward
//! branch whose body (from the branch target to the branch) holds the most `HMMA`s. An m16n8k16
//! MMA multiplies 8 × 16 weights per warp, 4 per lane, so a one-x-tile kernel's loop issues
//! `instructions / (4 × HMMAs)` instructions per weight and lane — everything the loop does per
//! weight: loads, address arithmetic, decoding, the MMAs. bf16's loop (no decoding) is the
//! yardstick a block format's decoding is measured against.

use std::collections::HashMap;

use crate::BlockFormat;

/// Weights one lane feeds a warp's m16n8k16 MMA: 8 rows × 16 k over 32 lanes.
pub const WEIGHTS_PER_LANE_MMA: usize = 4;

/// One instruction of a listing: its opcode with modifiers (`HMMA.16816.F32.BF16`, `@P0 `
/// predicates dropped) and its operands.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Instruction {
    pub opcode: String,
    pub operands: String,
}

impl Instruction {
    /// The opcode without modifiers: `HMMA`, `LDG`, `LOP3`.
    pub fn base(&self) -> &str {
        self.opcode.split('.').next().unwrap_or("")
    }

    /// The label a branch goes to, for `BRA`.
    fn branch_target(&self) -> Option<&str> {
        if self.base() != "BRA" {
            return None;
        }
        let start = self.operands.find("`(")? + 2;
        let end = start + self.operands[start..].find(')')?;
        Some(&self.operands[start..end])
    }
}

/// One function of a listing: its instructions in address order and where its labels point
/// (the index of the instruction that follows each).
#[derive(Debug, Clone, Default)]
pub struct Function {
    pub name: String,
    pub instructions: Vec<Instruction>,
    labels: HashMap<String, usize>,
}

/// A loop: the instructions from a backward branch's target to the branch, both included.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Loop {
    pub first: usize,
    pub last: usize,
    /// Tensor-core MMAs (`HMMA`) in the body.
    pub mma: usize,
}

impl Loop {
    /// Instructions in the body.
    pub fn instructions(&self) -> usize {
        self.last + 1 - self.first
    }

    /// Instructions per weight and lane, for a kernel whose MMAs each take a fresh weight
    /// fragment (one x tile) as the B operand ([`WEIGHTS_PER_LANE_MMA`]); `None` for a loop
    /// without MMAs.
    pub fn per_weight(&self) -> Option<f64> {
        self.per_weight_at(WEIGHTS_PER_LANE_MMA)
    }

    /// [`Loop::per_weight`] for MMAs that each take `weights` weights per lane (8 where the
    /// weight is the A operand, `cuda/gemv_tiles.cu`).
    pub fn per_weight_at(&self, weights: usize) -> Option<f64> {
        (self.mma > 0).then(|| self.instructions() as f64 / (self.mma * weights) as f64)
    }
}

impl Function {
    /// Every loop closed by a backward branch, in branch order.
    pub fn loops(&self) -> Vec<Loop> {
        let mut loops = Vec::new();
        for (last, ins) in self.instructions.iter().enumerate() {
            let Some(&first) = ins.branch_target().and_then(|l| self.labels.get(l)) else {
                continue;
            };
            if first <= last {
                let mma = self.instructions[first..=last]
                    .iter()
                    .filter(|i| i.base() == "HMMA")
                    .count();
                loops.push(Loop { first, last, mma });
            }
        }
        loops
    }

    /// The loop holding the most MMAs (the first of equals), if any holds one.
    pub fn hot_loop(&self) -> Option<Loop> {
        self.loops()
            .into_iter()
            .filter(|l| l.mma > 0)
            .reduce(|best, l| if l.mma > best.mma { l } else { best })
    }

    /// The body of `l` counted by base opcode, most frequent first (ties by name).
    pub fn histogram(&self, l: &Loop) -> Vec<(String, usize)> {
        let mut counts: HashMap<&str, usize> = HashMap::new();
        for ins in &self.instructions[l.first..=l.last] {
            *counts.entry(ins.base()).or_default() += 1;
        }
        let mut out: Vec<(String, usize)> = counts
            .into_iter()
            .map(|(k, v)| (k.to_string(), v))
            .collect();
        out.sort_by(|a, b| b.1.cmp(&a.1).then_with(|| a.0.cmp(&b.0)));
        out
    }
}

/// The functions of an `nvdisasm --print-code` listing, by name.
pub fn parse(listing: &str) -> HashMap<String, Function> {
    let mut functions: HashMap<String, Function> = HashMap::new();
    let mut current: Option<Function> = None;
    for line in listing.lines() {
        let trimmed = line.trim();
        if let Some(name) = trimmed
            .strip_prefix(".text.")
            .and_then(|r| r.strip_suffix(':'))
        {
            if let Some(f) = current.take() {
                functions.insert(f.name.clone(), f);
            }
            current = Some(Function {
                name: name.to_string(),
                ..Function::default()
            });
            continue;
        }
        let Some(f) = current.as_mut() else {
            continue;
        };
        // Instructions: `/*0100*/  @P0 BRA `(.L_x_888) ;`
        if let Some(rest) = trimmed.strip_prefix("/*")
            && let Some((address, text)) = rest.split_once("*/")
            && address.chars().all(|c| c.is_ascii_hexdigit())
        {
            let text = text.trim().trim_end_matches(';').trim();
            let text = match text.strip_prefix('@') {
                Some(predicated) => predicated.split_once(' ').map_or("", |(_, t)| t.trim()),
                None => text,
            };
            let (opcode, operands) = text.split_once(' ').unwrap_or((text, ""));
            if !opcode.is_empty() {
                f.instructions.push(Instruction {
                    opcode: opcode.to_string(),
                    operands: operands.trim().to_string(),
                });
            }
            continue;
        }
        // Labels: `.L_x_899:` at the start of a line.
        if !line.starts_with(char::is_whitespace)
            && let Some(label) = trimmed.strip_suffix(':')
            && !label.contains(char::is_whitespace)
        {
            f.labels.insert(label.to_string(), f.instructions.len());
        }
    }
    if let Some(f) = current {
        functions.insert(f.name.clone(), f);
    }
    functions
}

/// One row of the decode GEMV budget: a weight format's one-tile GEMV and its hot loop.
#[derive(Debug, Clone)]
pub struct BudgetRow {
    /// `bf16`, or a [`crate::BlockFormat`]'s kernel name.
    pub format: String,
    pub function: String,
    pub instructions: usize,
    pub mma: usize,
    pub per_weight: f64,
    /// The loop's opcodes, most frequent first.
    pub histogram: Vec<(String, usize)>,
}

/// The hot loop of `gemv_mma_<format>_bf16_x1` (the decode GEMV at one x tile, 1..=16 rows) for
/// bf16 and every block format, compiled for `arch`: bf16 first, then [`BlockFormat::every`]'s
/// order. Needs NVRTC, ptxas and nvdisasm ([`crate::check::sass`]).
pub fn decode_gemv_budget(arch: &str) -> Result<Vec<BudgetRow>, String> {
    let mut wanted: Vec<(String, &'static str, String, usize)> = vec![(
        "bf16".into(),
        "gemv",
        "gemv_mma_bf16_x1".into(),
        WEIGHTS_PER_LANE_MMA,
    )];
    for format in BlockFormat::every() {
        let name = format.kernel_name();
        wanted.push((
            name.to_string(),
            format.module(),
            format!("gemv_mma_{name}_bf16_x1"),
            WEIGHTS_PER_LANE_MMA,
        ));
    }
    // The fragment-ordered tiles (weights as the A operand: 8 per lane and MMA).
    for (format, function) in crate::tiles::BUDGETED {
        wanted.push((format.into(), "gemv_tiles", function.into(), 8));
    }
    let listings: Vec<Result<String, String>> = std::thread::scope(|scope| {
        let threads: Vec<_> = wanted
            .iter()
            .map(|(_, module, _, _)| {
                scope.spawn(move || {
                    let source = crate::SOURCES
                        .iter()
                        .find(|s| s.module == *module)
                        .ok_or_else(|| format!("no kernel module `{module}`"))?;
                    crate::check::sass(source, arch)
                })
            })
            .collect();
        threads
            .into_iter()
            .map(|t| {
                t.join()
                    .unwrap_or_else(|_| Err("the thread panicked".into()))
            })
            .collect()
    });
    wanted
        .into_iter()
        .zip(listings)
        .map(|((format, module, function, weights), listing)| {
            let functions = parse(&listing.map_err(|e| format!("{module} for {arch}: {e}"))?);
            let f = functions
                .get(&function)
                .ok_or_else(|| format!("{module} for {arch} has no `{function}`"))?;
            let hot = f
                .hot_loop()
                .ok_or_else(|| format!("`{function}` for {arch}: no loop holds an MMA"))?;
            Ok(BudgetRow {
                format,
                per_weight: hot.per_weight_at(weights).expect("a hot loop holds MMAs"),
                instructions: hot.instructions(),
                mma: hot.mma,
                histogram: f.histogram(&hot),
                function,
            })
        })
        .collect()
}

/// The budget as a table: per format its loop's instructions, MMAs, instructions per weight, the
/// ratio to bf16's and its five most frequent opcodes.
pub fn budget_table(rows: &[BudgetRow]) -> String {
    let bf16 = rows
        .iter()
        .find(|r| r.format == "bf16")
        .map_or(f64::NAN, |r| r.per_weight);
    let mut out = format!(
        "{:<16} {:>6} {:>5} {:>10} {:>7}  top opcodes\n",
        "format", "loop", "mma", "per weight", "÷ bf16"
    );
    for r in rows {
        let top: Vec<String> = r
            .histogram
            .iter()
            .take(5)
            .map(|(op, n)| format!("{op} {n}"))
            .collect();
        out += &format!(
            "{:<16} {:>6} {:>5} {:>10.2} {:>7.2}  {}\n",
            r.format,
            r.instructions,
            r.mma,
            r.per_weight,
            r.per_weight / bf16,
            top.join(", ")
        );
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    const LISTING: &str = "\
//--------------------- .text.k          --------------------------
\t.section\t.text.k,\"ax\",@progbits
k:
.text.k:
        /*0000*/                   MOV R1, c[0x0][0x28] ;
        /*0010*/               @P0 BRA `(.L_x_2) ;
.L_x_1:
        /*0020*/                   LDG.E.128.CONSTANT R4, desc[UR4][R2.64] ;
        /*0030*/                   LOP3.LUT R8, R4, 0xf, RZ, 0xc0, !PT ;
        /*0040*/                   HMMA.16816.F32.BF16 R12, R8, R6, R12 ;
        /*0050*/                   HMMA.16816.F32.BF16 R12, R9, R7, R12 ;
        /*0060*/              @!P1 BRA `(.L_x_1) ;
.L_x_2:
        /*0070*/                   EXIT ;
.L_x_3:
        /*0080*/                   BRA `(.L_x_3);
";

    #[test]
    fn the_hot_loop_is_the_backward_branch_around_the_mmas() {
        let functions = parse(LISTING);
        let k = &functions["k"];
        assert_eq!(k.instructions.len(), 9);
        assert_eq!(k.instructions[4].opcode, "HMMA.16816.F32.BF16");
        assert_eq!(k.instructions[6].base(), "BRA", "the predicate is dropped");
        // Two backward branches: the K loop and the trailing self-loop.
        assert_eq!(k.loops().len(), 2);
        let hot = k.hot_loop().expect("a loop with MMAs");
        assert_eq!((hot.first, hot.last, hot.mma), (2, 6, 2));
        // Five instructions for two MMAs of four weights per lane each.
        assert_eq!(hot.per_weight(), Some(5.0 / 8.0));
        assert_eq!(k.histogram(&hot)[0], ("HMMA".to_string(), 2));
    }
}
