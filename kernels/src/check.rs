//! Compile-check without a GPU: every kernel source through NVRTC for each architecture, then
//! (where a `ptxas` is found) its resource report per kernel function — registers, static shared
//! memory, stack frame, spills. A syntax error or a spill never costs GPU time.

use std::fmt::Write as _;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::atomic::{AtomicUsize, Ordering};

use crate::compile::{self, Compiler};
use crate::{SOURCES, Source, libs};

/// ptxas's resource report for one kernel function on one architecture.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct FunctionResources {
    pub module: String,
    pub arch: String,
    pub function: String,
    pub registers: u32,
    /// Static shared memory, bytes.
    pub shared_bytes: u32,
    pub stack_frame_bytes: u32,
    pub spill_store_bytes: u32,
    pub spill_load_bytes: u32,
}

impl FunctionResources {
    pub fn spills(&self) -> bool {
        self.spill_store_bytes > 0 || self.spill_load_bytes > 0
    }
}

/// A module that failed to compile or assemble.
#[derive(Debug, Clone)]
pub struct CheckFailure {
    pub module: String,
    pub arch: String,
    pub message: String,
}

/// The outcome of [`check`].
#[derive(Debug, Clone, Default)]
pub struct Report {
    pub arches: Vec<String>,
    /// Kernel entry points per (module, arch) found in the PTX, whether or not ptxas ran.
    pub entries: Vec<(String, String, Vec<String>)>,
    /// ptxas resources, one per (arch, function); empty when no ptxas was found.
    pub functions: Vec<FunctionResources>,
    pub failures: Vec<CheckFailure>,
    /// The ptxas used, if any.
    pub ptxas: Option<PathBuf>,
    /// NVRTC's version, when it loaded.
    pub nvrtc_version: Option<(i32, i32)>,
}

impl Report {
    pub fn ok(&self) -> bool {
        self.failures.is_empty()
    }

    /// Whether `function` compiled for `arch` (it appears in the PTX).
    pub fn has_entry(&self, arch: &str, function: &str) -> bool {
        self.entries
            .iter()
            .any(|(_, a, names)| a == arch && names.iter().any(|n| n == function))
    }

    pub fn resources(&self, arch: &str, function: &str) -> Option<&FunctionResources> {
        self.functions
            .iter()
            .find(|f| f.arch == arch && f.function == function)
    }

    /// A plain-text table: one line per (arch, function), then the failures.
    pub fn table(&self) -> String {
        let mut out = String::new();
        let nvrtc = self
            .nvrtc_version
            .map(|(a, b)| format!("{a}.{b}"))
            .unwrap_or_else(|| "not loaded".to_string());
        let ptxas = self
            .ptxas
            .as_ref()
            .map(|p| p.display().to_string())
            .unwrap_or_else(|| "not found (resources not reported)".to_string());
        let _ = writeln!(out, "NVRTC {nvrtc}; ptxas: {ptxas}");
        if !self.functions.is_empty() {
            let _ = writeln!(
                out,
                "{:<9} {:<12} {:<18} {:>5} {:>8} {:>6} {:>7} {:>7}",
                "arch", "module", "function", "regs", "smem(B)", "stack", "spill-st", "spill-ld"
            );
            for f in &self.functions {
                let _ = writeln!(
                    out,
                    "{:<9} {:<12} {:<18} {:>5} {:>8} {:>6} {:>7} {:>7}{}",
                    f.arch,
                    f.module,
                    f.function,
                    f.registers,
                    f.shared_bytes,
                    f.stack_frame_bytes,
                    f.spill_store_bytes,
                    f.spill_load_bytes,
                    if f.spills() { "  SPILLS" } else { "" }
                );
            }
        } else {
            for (module, arch, names) in &self.entries {
                let _ = writeln!(out, "{arch:<9} {module:<12} {}", names.join(" "));
            }
        }
        for failure in &self.failures {
            let _ = writeln!(
                out,
                "FAILED {} {}: {}",
                failure.arch, failure.module, failure.message
            );
        }
        out
    }
}

/// Compiles every kernel source for each of `arches` (e.g. `sm_90a`) and collects ptxas's
/// resource report. Never fails: problems (no NVRTC, a compile error) become report failures.
pub fn check(arches: &[&str]) -> Report {
    check_sources(SOURCES, arches)
}

/// [`check`] over an explicit list of sources (the canary test hands it a broken one).
pub fn check_sources(sources: &[Source], arches: &[&str]) -> Report {
    let mut report = Report {
        arches: arches.iter().map(|a| a.to_string()).collect(),
        ptxas: libs::find_ptxas(),
        ..Report::default()
    };
    let compiler = match Compiler::uncached() {
        Ok(c) => c,
        Err(e) => {
            report.failures.push(CheckFailure {
                module: "*".to_string(),
                arch: "*".to_string(),
                message: e.to_string(),
            });
            return report;
        }
    };
    report.nvrtc_version = Some(compiler.nvrtc_version());
    // Every (arch, module) compiles on its own thread; the report keeps the sequential order.
    let ptxas = report.ptxas.clone();
    let jobs: Vec<(&str, &Source)> = arches
        .iter()
        .flat_map(|arch| sources.iter().map(move |source| (*arch, source)))
        .collect();
    let outcomes: Vec<Outcome> = std::thread::scope(|scope| {
        let threads: Vec<_> = jobs
            .iter()
            .map(|&(arch, source)| {
                let (compiler, ptxas) = (&compiler, ptxas.as_deref());
                scope.spawn(move || check_one(compiler, ptxas, source, arch))
            })
            .collect();
        threads
            .into_iter()
            .zip(&jobs)
            .map(|(thread, &(arch, source))| {
                thread.join().unwrap_or_else(|_| Outcome {
                    failures: vec![failure(source, arch, "the checking thread panicked".into())],
                    ..Outcome::default()
                })
            })
            .collect()
    });
    for outcome in outcomes {
        report.entries.extend(outcome.entries);
        report.functions.extend(outcome.functions);
        report.failures.extend(outcome.failures);
    }
    report
}

/// What checking one module for one architecture found.
#[derive(Default)]
struct Outcome {
    entries: Vec<(String, String, Vec<String>)>,
    functions: Vec<FunctionResources>,
    failures: Vec<CheckFailure>,
}

/// Compiles `source` for `arch`, lists its entries and, with ptxas, its resources.
fn check_one(compiler: &Compiler, ptxas: Option<&Path>, source: &Source, arch: &str) -> Outcome {
    let mut outcome = Outcome::default();
    let ptx = match compiler.compile(source, arch) {
        Ok(ptx) => ptx,
        Err(e) => {
            outcome.failures.push(failure(source, arch, e.to_string()));
            return outcome;
        }
    };
    outcome.entries.push((
        source.module.to_string(),
        arch.to_string(),
        compile::entry_names(&ptx),
    ));
    if let Some(ptxas) = ptxas {
        match run_ptxas(ptxas, arch, &ptx) {
            Ok(text) => outcome
                .functions
                .extend(parse_ptxas(&text, source.module, arch)),
            Err(message) => outcome.failures.push(failure(source, arch, message)),
        }
    }
    outcome
}

fn failure(source: &Source, arch: &str, message: String) -> CheckFailure {
    CheckFailure {
        module: source.module.to_string(),
        arch: arch.to_string(),
        message,
    }
}

/// Assembles `ptx` with `ptxas -arch=<arch> -v` and returns its report (stderr and stdout).
fn run_ptxas(ptxas: &Path, arch: &str, ptx: &str) -> Result<String, String> {
    assemble(ptxas, arch, ptx, |_, report| Ok(report))
}

/// The SASS of `source` for `arch` as `nvdisasm` lists it (labels at branch targets): NVRTC,
/// then ptxas, then nvdisasm (`libs::find_nvdisasm`). What the instruction budget reads ([`crate::sass`]).
pub fn sass(source: &Source, arch: &str) -> Result<String, String> {
    let ptxas = libs::find_ptxas().ok_or("no ptxas found (STRATA_PTXAS, CUDA_HOME)")?;
    let nvdisasm = libs::find_nvdisasm().ok_or("no nvdisasm found (STRATA_NVDISASM, CUDA_HOME)")?;
    let compiler = Compiler::uncached().map_err(|e| e.to_string())?;
    let ptx = compiler.compile(source, arch).map_err(|e| e.to_string())?;
    assemble(&ptxas, arch, &ptx, |cubin, _| {
        let out = Command::new(&nvdisasm)
            .arg("--print-code")
            .arg(cubin)
            .output()
            .map_err(|e| format!("running {}: {e}", nvdisasm.display()))?;
        if !out.status.success() {
            return Err(format!(
                "nvdisasm exited with {}: {}",
                out.status,
                String::from_utf8_lossy(&out.stderr)
            ));
        }
        Ok(String::from_utf8_lossy(&out.stdout).into_owned())
    })
}

/// Assembles `ptx` for `arch` into a cubin in a scratch folder and hands `then` its path and
/// ptxas's report, before the folder goes.
fn assemble<T>(
    ptxas: &Path,
    arch: &str,
    ptx: &str,
    then: impl FnOnce(&Path, String) -> Result<T, String>,
) -> Result<T, String> {
    static RUN: AtomicUsize = AtomicUsize::new(0);
    let run = RUN.fetch_add(1, Ordering::Relaxed);
    let dir = std::env::temp_dir().join(format!("strata-ptxas-{}-{run}", std::process::id()));
    std::fs::create_dir_all(&dir).map_err(|e| format!("{}: {e}", dir.display()))?;
    let input = dir.join(format!("{arch}.ptx"));
    let output = dir.join(format!("{arch}.cubin"));
    let result = std::fs::write(&input, ptx)
        .map_err(|e| format!("{}: {e}", input.display()))
        .and_then(|()| {
            Command::new(ptxas)
                .arg(format!("-arch={arch}"))
                .arg("-v")
                .arg(&input)
                .arg("-o")
                .arg(&output)
                .output()
                .map_err(|e| format!("running {}: {e}", ptxas.display()))
        })
        .and_then(|result| {
            let text = format!(
                "{}{}",
                String::from_utf8_lossy(&result.stderr),
                String::from_utf8_lossy(&result.stdout)
            );
            if result.status.success() {
                then(&output, text)
            } else {
                Err(format!("ptxas exited with {}:\n{text}", result.status))
            }
        });
    let _ = std::fs::remove_dir_all(&dir);
    result
}

/// Parses `ptxas -v` output into one record per function, in the order reported.
pub fn parse_ptxas(text: &str, module: &str, arch: &str) -> Vec<FunctionResources> {
    let mut out: Vec<FunctionResources> = Vec::new();
    let mut current: Option<usize> = None;
    for line in text.lines() {
        if let Some(name) = quoted_after(line, "Compiling entry function '")
            .or_else(|| plain_after(line, "Function properties for "))
        {
            current = Some(match out.iter().position(|f| f.function == name) {
                Some(i) => i,
                None => {
                    out.push(FunctionResources {
                        module: module.to_string(),
                        arch: arch.to_string(),
                        function: name,
                        ..FunctionResources::default()
                    });
                    out.len() - 1
                }
            });
            continue;
        }
        let Some(f) = current.and_then(|i| out.get_mut(i)) else {
            continue;
        };
        if line.contains("bytes stack frame") {
            f.stack_frame_bytes = number_before(line, "bytes stack frame").unwrap_or(0);
            f.spill_store_bytes = number_before(line, "bytes spill stores").unwrap_or(0);
            f.spill_load_bytes = number_before(line, "bytes spill loads").unwrap_or(0);
        } else if line.contains("Used ") && line.contains("registers") {
            f.registers = number_before(line, "registers").unwrap_or(0);
            f.shared_bytes = number_before(line, "bytes smem").unwrap_or(0);
        }
    }
    out
}

fn quoted_after(line: &str, prefix: &str) -> Option<String> {
    let rest = &line[line.find(prefix)? + prefix.len()..];
    Some(rest[..rest.find('\'')?].to_string())
}

fn plain_after(line: &str, prefix: &str) -> Option<String> {
    let rest = line[line.find(prefix)? + prefix.len()..].trim();
    (!rest.is_empty()).then(|| rest.to_string())
}

/// The integer written just before `label` on the line (`"18 registers"` → 18).
fn number_before(line: &str, label: &str) -> Option<u32> {
    let head = line[..line.find(label)?].trim_end();
    let digits: String = head
        .chars()
        .rev()
        .take_while(|c| c.is_ascii_digit())
        .collect();
    digits.chars().rev().collect::<String>().parse().ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_a_ptxas_report() {
        let text = "ptxas info    : 0 bytes gmem\n\
            ptxas info    : Compiling entry function 'rmsnorm' for 'sm_90a'\n\
            ptxas info    : Function properties for rmsnorm\n\
            \x20   8 bytes stack frame, 4 bytes spill stores, 12 bytes spill loads\n\
            ptxas info    : Used 30 registers, used 1 barriers, 128 bytes smem, 400 bytes cmem[0]\n";
        let parsed = parse_ptxas(text, "elementwise", "sm_90a");
        assert_eq!(
            parsed,
            vec![FunctionResources {
                module: "elementwise".into(),
                arch: "sm_90a".into(),
                function: "rmsnorm".into(),
                registers: 30,
                shared_bytes: 128,
                stack_frame_bytes: 8,
                spill_store_bytes: 4,
                spill_load_bytes: 12,
            }]
        );
        assert!(parsed[0].spills());
    }
}
