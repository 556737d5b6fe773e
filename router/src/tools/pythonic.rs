//! Pythonic tool calls (Llama 3.2 / 4): the whole output is a Python list of calls,
//! `[get_weather(city="Paris", days=3), get_time()]`, keyword arguments holding Python literals
//! (strings in either quote, ints, floats, `True` / `False` / `None`, lists, tuples, dicts).
//! A Llama 3.1 JSON output is read too: the grammar that forces a call writes that form (see
//! [`super::constraint`]).

use serde_json::{Map, Number, Value};

use super::calls::{ToolCall, call_from_json};

/// The example call Llama's templates give when they teach this form.
pub(super) const TEMPLATE_EXAMPLE: &str = "[func_name1(";

/// Nesting deeper than this is no call (and keeps recursion bounded on any input).
const MAX_DEPTH: usize = 32;

/// The calls a whole output holds; `None` when it is not (only) calls.
pub(super) fn calls_from_output(text: &str) -> Option<Vec<ToolCall>> {
    let text = text.trim();
    if text.starts_with('{') {
        return call_from_json(text, &["parameters", "arguments"]).map(|call| vec![call]);
    }
    let mut reader = Reader { rest: text };
    let calls = reader.calls()?;
    reader.rest.trim_start().is_empty().then_some(calls)
}

/// A cursor over the output.
struct Reader<'a> {
    rest: &'a str,
}

impl<'a> Reader<'a> {
    fn skip_blank(&mut self) {
        self.rest = self.rest.trim_start();
    }

    /// Consumes `c` (after blanks) if it comes next.
    fn eat(&mut self, c: char) -> bool {
        self.skip_blank();
        match self.rest.strip_prefix(c) {
            Some(rest) => {
                self.rest = rest;
                true
            }
            None => false,
        }
    }

    /// `[call, call, ...]`, at least one call.
    fn calls(&mut self) -> Option<Vec<ToolCall>> {
        let mut calls = Vec::new();
        self.eat('[').then_some(())?;
        loop {
            if self.eat(']') {
                return (!calls.is_empty()).then_some(calls);
            }
            calls.push(self.call()?);
            if !self.eat(',') {
                self.eat(']').then_some(())?;
                return Some(calls);
            }
        }
    }

    /// `name(key=value, ...)`; a positional argument is no call.
    fn call(&mut self) -> Option<ToolCall> {
        let name = self.identifier(true)?;
        self.eat('(').then_some(())?;
        let mut arguments = Map::new();
        loop {
            if self.eat(')') {
                break;
            }
            let key = self.identifier(false)?;
            self.eat('=').then_some(())?;
            let value = self.literal(0)?;
            arguments.insert(key.to_string(), value);
            if !self.eat(',') {
                self.eat(')').then_some(())?;
                break;
            }
        }
        Some(ToolCall {
            name: name.to_string(),
            arguments: Value::Object(arguments).to_string(),
        })
    }

    /// A Python identifier; a function name may be dotted (`module.function`).
    fn identifier(&mut self, dotted: bool) -> Option<&'a str> {
        self.skip_blank();
        let rest = self.rest;
        let len = rest
            .find(|c: char| !(c.is_alphanumeric() || c == '_' || (dotted && c == '.')))
            .unwrap_or(rest.len());
        let name = &rest[..len];
        if name.is_empty() || name.starts_with(|c: char| c.is_ascii_digit()) {
            return None;
        }
        self.rest = &rest[len..];
        Some(name)
    }

    fn literal(&mut self, depth: usize) -> Option<Value> {
        if depth > MAX_DEPTH {
            return None;
        }
        self.skip_blank();
        match self.rest.chars().next()? {
            '\'' | '"' => self.string().map(Value::String),
            '[' => self.sequence('[', ']', depth).map(Value::Array),
            '(' => self.sequence('(', ')', depth).map(Value::Array),
            '{' => self.dict(depth),
            _ => self.word(),
        }
    }

    /// A quoted string with the common escapes; no triple quotes or prefixes.
    fn string(&mut self) -> Option<String> {
        let mut chars = self.rest.char_indices();
        let (_, quote) = chars.next().filter(|(_, q)| matches!(q, '\'' | '"'))?;
        let mut out = String::new();
        while let Some((i, c)) = chars.next() {
            match c {
                '\\' => {
                    let (_, escaped) = chars.next()?;
                    out.push(match escaped {
                        'n' => '\n',
                        't' => '\t',
                        'r' => '\r',
                        '0' => '\0',
                        other => other,
                    });
                }
                '\n' => return None,
                c if c == quote => {
                    self.rest = &self.rest[i + c.len_utf8()..];
                    return Some(out);
                }
                c => out.push(c),
            }
        }
        None
    }

    fn sequence(&mut self, open: char, close: char, depth: usize) -> Option<Vec<Value>> {
        self.eat(open).then_some(())?;
        let mut items = Vec::new();
        loop {
            if self.eat(close) {
                return Some(items);
            }
            items.push(self.literal(depth + 1)?);
            if !self.eat(',') {
                return self.eat(close).then_some(items);
            }
        }
    }

    /// `{key: value, ...}` with string keys.
    fn dict(&mut self, depth: usize) -> Option<Value> {
        self.eat('{').then_some(())?;
        let mut object = Map::new();
        loop {
            if self.eat('}') {
                return Some(Value::Object(object));
            }
            self.skip_blank();
            let key = self.string()?;
            self.eat(':').then_some(())?;
            object.insert(key, self.literal(depth + 1)?);
            if !self.eat(',') {
                return self.eat('}').then_some(Value::Object(object));
            }
        }
    }

    /// `True`, `False`, `None` or a number.
    fn word(&mut self) -> Option<Value> {
        let len = self
            .rest
            .find(|c: char| !(c.is_ascii_alphanumeric() || matches!(c, '.' | '-' | '+' | '_')))
            .unwrap_or(self.rest.len());
        let word = &self.rest[..len];
        let value = match word {
            "True" => Value::Bool(true),
            "False" => Value::Bool(false),
            "None" => Value::Null,
            _ => number(word)?,
        };
        self.rest = &self.rest[len..];
        Some(value)
    }
}

/// A Python int or float literal (underscores allowed) as a JSON number.
fn number(word: &str) -> Option<Value> {
    let digits = word.replace('_', "");
    if !digits.starts_with(|c: char| c.is_ascii_digit() || c == '-' || c == '+' || c == '.') {
        return None;
    }
    if let Ok(int) = digits.parse::<i64>() {
        return Some(Value::Number(int.into()));
    }
    let float = digits.parse::<f64>().ok()?;
    Number::from_f64(float).map(Value::Number)
}

#[cfg(test)]
mod tests {
    use super::super::calls::{Parsed, ToolFormat, assert_streaming_matches_whole, call, parse};

    fn pythonic(text: &str, cut: bool) -> Parsed {
        parse(ToolFormat::Pythonic, text, cut)
    }

    #[test]
    fn a_whole_output_of_calls_reads_with_python_literals() {
        let p = pythonic(r#"[get_weather(city="Paris", days=3)]"#, false);
        assert_eq!(p.content, "");
        assert_eq!(
            p.calls,
            vec![call("get_weather", r#"{"city":"Paris","days":3}"#)]
        );
        let p = pythonic(
            r#" [f(a='it\'s', b=-1.5, c=True, d=None, e=[1, (2, 3)], g={'k': "v", "n": False},), t.now()] "#,
            false,
        );
        assert_eq!(
            p.calls,
            vec![
                call(
                    "f",
                    r#"{"a":"it's","b":-1.5,"c":true,"d":null,"e":[1,[2,3]],"g":{"k":"v","n":false}}"#
                ),
                call("t.now", "{}"),
            ]
        );
        // The JSON form (what a forced call writes) reads too.
        let p = pythonic(r#"{"name": "f", "parameters": {"a": 1}}"#, false);
        assert_eq!(p.calls, vec![call("f", r#"{"a":1}"#)]);
    }

    #[test]
    fn text_that_is_not_only_calls_stays_text() {
        for text in [
            "The answer is [f(a=1)]",
            "[f(a=1)] and more",
            "[f(1)]",
            "[f(a=x)]",
            "[f(a=1]",
            "[]",
            "[1, 2, 3]",
            "[see the docs](http://x)",
            "[f(a='unterminated)]",
        ] {
            let p = pythonic(text, false);
            assert_eq!(p.content, text);
            assert!(p.calls.is_empty(), "{text}");
        }
    }

    #[test]
    fn a_cut_call_is_dropped() {
        let p = pythonic(r#"[get_weather(city="Par"#, true);
        assert_eq!(p, Parsed::default());
        // The canary: as a whole output, the same text is returned as written.
        assert_eq!(
            pythonic(r#"[get_weather(city="Par"#, false).content,
            r#"[get_weather(city="Par"#
        );
        assert_eq!(
            pythonic("Plain words cut of", true).content,
            "Plain words cut of"
        );
    }

    #[test]
    fn deep_nesting_is_no_call_and_no_crash() {
        let deep = format!("[f(a={}{})]", "[".repeat(10_000), "]".repeat(10_000));
        assert!(pythonic(&deep, false).calls.is_empty());
    }

    #[test]
    fn streaming_in_small_chunks_matches_whole_parsing() {
        for text in [
            r#"[a(x="é, ]"), b(y=[1, 2])]"#,
            "  [a()]",
            "Plain [a()] text",
            "[f(1)]",
        ] {
            assert_streaming_matches_whole(ToolFormat::Pythonic, text);
        }
    }

    #[test]
    fn detection_takes_the_pythonic_example_over_ipython() {
        let prompt = "Environment: ipython\nIf you decide to invoke any of the function(s), you \
                      MUST put it in the format of [func_name1(params_name1=params_value1, \
                      params_name2=params_value2...), func_name2(params)]";
        assert_eq!(ToolFormat::detect(prompt), ToolFormat::Pythonic);
        assert_eq!(
            ToolFormat::detect("Environment: ipython\n"),
            ToolFormat::LlamaJson
        );
    }
}
