//! The house stays readable (issue 37): no non-test function over 120 lines and no non-test file
//! over 900 lines. The ones that predate the rule are listed with their size today; the list only
//! shrinks — a new offender fails, a listed one that grows fails, and one brought under the limit
//! must leave the list. Test code (`tests/`, `benches/`, a file's `#[cfg(test)] mod tests`) is
//! not counted.

use std::path::PathBuf;
use std::process::Command;

const MAX_FUNCTION_LINES: usize = 120;
const MAX_FILE_LINES: usize = 900;

/// (file, function, lines today).
const LONG_FUNCTIONS: [(&str, &str, usize); 0] = [];

/// (file, lines today, test module excluded).
const LONG_FILES: [(&str, usize); 0] = [];

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

/// Tracked Rust files outside test folders.
fn sources() -> Vec<String> {
    let out = Command::new("git")
        .args(["ls-files", "*.rs"])
        .current_dir(root())
        .output()
        .expect("git ls-files");
    String::from_utf8(out.stdout)
        .expect("utf-8 paths")
        .lines()
        .filter(|f| !f.starts_with("tests/") && !f.contains("/tests/"))
        .map(str::to_string)
        .collect()
}

/// `line` without comments, string and char literals (their braces are not code); `in_comment`
/// carries a block comment across lines. Bytes, not chars: every delimiter is ASCII.
fn code_of(line: &str, in_comment: &mut bool) -> String {
    let b = line.as_bytes();
    let mut out = String::new();
    let mut i = 0;
    while i < b.len() {
        if *in_comment {
            match line[i..].find("*/") {
                Some(at) => {
                    i += at + 2;
                    *in_comment = false;
                    continue;
                }
                None => return out,
            }
        }
        match (b[i], b.get(i + 1)) {
            (b'/', Some(b'/')) => return out,
            (b'/', Some(b'*')) => {
                *in_comment = true;
                i += 2;
            }
            (b'"', _) => {
                i += 1;
                while i < b.len() && b[i] != b'"' {
                    i += if b[i] == b'\\' { 2 } else { 1 };
                }
                i += 1;
            }
            // A char literal ('{', '\n'), not a lifetime ('a).
            (b'\'', Some(b'\\')) => {
                i += 2;
                while i < b.len() && b[i] != b'\'' {
                    i += 1;
                }
                i += 1;
            }
            (b'\'', Some(_)) if b.get(i + 2) == Some(&b'\'') => i += 3,
            (c, _) => {
                if c.is_ascii() {
                    out.push(c as char);
                }
                i += 1;
            }
        }
    }
    out
}

/// The file's lines before its `#[cfg(test)] mod tests`.
fn non_test_lines(text: &str) -> Vec<&str> {
    let lines: Vec<&str> = text.lines().collect();
    let end = lines
        .windows(2)
        .position(|w| {
            w[0].trim() == "#[cfg(test)]"
                && ["mod tests", "pub mod tests", "pub(crate) mod tests"]
                    .iter()
                    .any(|m| w[1].trim_start().starts_with(m))
        })
        .unwrap_or(lines.len());
    lines[..end].to_vec()
}

/// Every function with a body longer than `limit` lines: (name, lines).
fn long_functions(lines: &[&str], limit: usize) -> Vec<(String, usize)> {
    // (name, first line, brace depth outside it, body opened)
    let mut open: Vec<(String, usize, usize, bool)> = Vec::new();
    let mut depth = 0usize;
    let mut in_comment = false;
    let mut found = Vec::new();
    for (n, line) in lines.iter().enumerate() {
        let code = code_of(line, &mut in_comment);
        if let Some(at) = code.find("fn ").filter(|&at| {
            at == 0 || !code[..at].ends_with(|c: char| c.is_alphanumeric() || c == '_')
        }) {
            let name: String = code[at + 3..]
                .trim_start()
                .chars()
                .take_while(|c| c.is_alphanumeric() || *c == '_')
                .collect();
            if !name.is_empty() {
                open.push((name, n, depth, false));
            }
        }
        for c in code.chars() {
            match c {
                '{' => {
                    if let Some(f) = open.last_mut().filter(|f| !f.3 && f.2 == depth) {
                        f.3 = true;
                    }
                    depth += 1;
                }
                '}' => {
                    depth = depth.saturating_sub(1);
                    if open.last().is_some_and(|f| f.3 && f.2 == depth) {
                        let (name, first, _, _) = open.pop().expect("checked");
                        if n + 1 - first > limit {
                            found.push((name, n + 1 - first));
                        }
                    }
                }
                _ => {}
            }
        }
        // A declaration without a body (a trait method, an extern fn).
        if open.last().is_some_and(|f| !f.3) && code.trim_end().ends_with(';') {
            open.pop();
        }
    }
    found
}

#[test]
fn no_new_long_functions_or_files_and_the_listed_ones_only_shrink() {
    let mut problems = Vec::new();
    let mut seen_functions = Vec::new();
    let mut seen_files = Vec::new();
    for file in sources() {
        let text = std::fs::read_to_string(root().join(&file)).expect("a source file");
        let lines = non_test_lines(&text);
        if lines.len() > MAX_FILE_LINES {
            seen_files.push(file.clone());
            match LONG_FILES.iter().find(|(f, _)| *f == file) {
                Some(&(_, was)) if lines.len() <= was => {}
                Some(&(_, was)) => {
                    problems.push(format!("{file}: {} lines, was {was}", lines.len()))
                }
                None => problems.push(format!(
                    "{file}: {} lines (at most {MAX_FILE_LINES})",
                    lines.len()
                )),
            }
        }
        for (name, len) in long_functions(&lines, MAX_FUNCTION_LINES) {
            seen_functions.push((file.clone(), name.clone()));
            match LONG_FUNCTIONS
                .iter()
                .find(|(f, n, _)| *f == file && *n == name)
            {
                Some(&(_, _, was)) if len <= was => {}
                Some(&(_, _, was)) => {
                    problems.push(format!("{file}: fn {name}: {len} lines, was {was}"))
                }
                None => problems.push(format!(
                    "{file}: fn {name}: {len} lines (at most {MAX_FUNCTION_LINES})"
                )),
            }
        }
    }
    for (file, name, _) in LONG_FUNCTIONS {
        if !seen_functions.iter().any(|(f, n)| f == file && n == name) {
            problems.push(format!(
                "{file}: fn {name} is within the limit now: take it off the list"
            ));
        }
    }
    for (file, _) in LONG_FILES {
        if !seen_files.iter().any(|f| f == file) {
            problems.push(format!(
                "{file} is within the limit now: take it off the list"
            ));
        }
    }
    assert!(problems.is_empty(), "{}", problems.join("\n"));
}

#[test]
fn the_counter_sees_bodies_not_braces_in_strings_or_comments() {
    let mut source = vec![
        "fn short() { let s = \"}}}\"; }",
        "/// fn not_code() {",
        "fn long() {",
    ];
    source.extend(std::iter::repeat_n("    let c = '}'; // }", 125));
    source.push("}");
    source.push("trait T { fn declared(&self); }");
    let found = long_functions(&source, MAX_FUNCTION_LINES);
    assert_eq!(found, vec![("long".to_string(), 127)]);
}
