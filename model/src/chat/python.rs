//! Python's spellings of values, which Jinja2 under transformers produces and templates' output
//! depends on: `str()` of floats and containers, and `json.dumps` behind the `tojson` filter.

use std::fmt::Write as _;

use minijinja::value::{Kwargs, Value, ValueKind};
use minijinja::{Error, ErrorKind};

/// Python's `str(value)`: strings as they are, everything else as `repr`.
pub(super) fn py_str(value: &Value) -> Result<String, Error> {
    if let Some(s) = value.as_str() {
        return Ok(s.to_owned());
    }
    if value.is_undefined() {
        return Ok(String::new());
    }
    let mut out = String::new();
    py_repr(&mut out, value)?;
    Ok(out)
}

fn py_repr(out: &mut String, value: &Value) -> Result<(), Error> {
    match value.kind() {
        ValueKind::Number if !value.is_integer() => {
            push_py_float(out, f64::try_from(value.clone())?, "nan", "inf");
        }
        ValueKind::Seq => {
            out.push('[');
            for (i, item) in value.try_iter()?.enumerate() {
                if i > 0 {
                    out.push_str(", ");
                }
                py_repr(out, &item)?;
            }
            out.push(']');
        }
        ValueKind::Map => {
            out.push('{');
            for (i, key) in value.try_iter()?.enumerate() {
                if i > 0 {
                    out.push_str(", ");
                }
                py_repr(out, &key)?;
                out.push_str(": ");
                py_repr(out, &value.get_item(&key)?)?;
            }
            out.push('}');
        }
        // minijinja's Debug of a string is Python's repr (quote choice and escapes).
        ValueKind::String => {
            let _ = write!(out, "{value:?}");
        }
        ValueKind::Undefined => {}
        _ => {
            let _ = write!(out, "{value}");
        }
    }
    Ok(())
}

/// Python's `repr(float)`: shortest round-trip digits, positional notation for exponents in
/// [-4, 16), otherwise `1e+16` style with at least two exponent digits; always a `.0` on
/// integral positional values.
fn push_py_float(out: &mut String, f: f64, nan: &str, inf: &str) {
    if f.is_nan() {
        out.push_str(nan);
        return;
    }
    if f.is_infinite() {
        if f < 0.0 {
            out.push('-');
        }
        out.push_str(inf);
        return;
    }
    // `{:e}` yields the shortest round-trip digits as `d.ddde±x`.
    let sci = format!("{f:e}");
    let (mantissa, exponent) = sci.split_once('e').unwrap_or((&sci, "0"));
    let exponent: i32 = exponent.parse().unwrap_or(0);
    let (sign, mantissa) = match mantissa.strip_prefix('-') {
        Some(rest) => ("-", rest),
        None => ("", mantissa),
    };
    let digits: String = mantissa.chars().filter(char::is_ascii_digit).collect();
    out.push_str(sign);
    if !(-4..16).contains(&exponent) {
        out.push_str(&digits[..1]);
        if digits.len() > 1 {
            out.push('.');
            out.push_str(&digits[1..]);
        }
        let _ = write!(
            out,
            "e{}{:02}",
            if exponent < 0 { '-' } else { '+' },
            exponent.abs()
        );
    } else if exponent < 0 {
        out.push_str("0.");
        out.extend(std::iter::repeat_n('0', (-exponent - 1) as usize));
        out.push_str(&digits);
    } else {
        let int_len = exponent as usize + 1;
        if digits.len() <= int_len {
            out.push_str(&digits);
            out.extend(std::iter::repeat_n('0', int_len - digits.len()));
            out.push_str(".0");
        } else {
            out.push_str(&digits[..int_len]);
            out.push('.');
            out.push_str(&digits[int_len..]);
        }
    }
}

/// The `tojson` filter: Python's `json.dumps(value, ensure_ascii=False, indent=None,
/// separators=None, sort_keys=False)` with those keywords overridable, as transformers defines
/// it. Unlike minijinja's built-in it does not HTML-escape `<`, `>`, `&` or `'`.
pub(super) fn tojson(value: &Value, kwargs: Kwargs) -> Result<String, Error> {
    let indent = match kwargs.get::<Option<Value>>("indent")? {
        None => None,
        Some(v) if v.is_none() => None,
        Some(v) => match v.as_str() {
            Some(s) => Some(s.to_owned()),
            // Python: an int indent of n means n spaces; negative means none.
            None => Some(" ".repeat(v.as_i64().unwrap_or(0).max(0) as usize)),
        },
    };
    let (item_sep, key_sep) = match kwargs.get::<Option<Value>>("separators")? {
        Some(seps) if !seps.is_none() => {
            let item = seps.get_item(&Value::from(0))?;
            let key = seps.get_item(&Value::from(1))?;
            match (item.as_str(), key.as_str()) {
                (Some(item), Some(key)) => (item.to_owned(), key.to_owned()),
                _ => {
                    return Err(Error::new(
                        ErrorKind::InvalidOperation,
                        "tojson: separators must be two strings",
                    ));
                }
            }
        }
        _ => match indent {
            Some(_) => (",".to_owned(), ": ".to_owned()),
            None => (", ".to_owned(), ": ".to_owned()),
        },
    };
    let writer = PyJson {
        indent,
        item_sep,
        key_sep,
        ensure_ascii: kwargs.get::<Option<bool>>("ensure_ascii")?.unwrap_or(false),
        sort_keys: kwargs.get::<Option<bool>>("sort_keys")?.unwrap_or(false),
    };
    kwargs.assert_all_used()?;
    let mut out = String::new();
    writer.write(&mut out, value, 0)?;
    Ok(out)
}

struct PyJson {
    indent: Option<String>,
    item_sep: String,
    key_sep: String,
    ensure_ascii: bool,
    sort_keys: bool,
}

impl PyJson {
    fn write(&self, out: &mut String, value: &Value, depth: usize) -> Result<(), Error> {
        match value.kind() {
            ValueKind::None => out.push_str("null"),
            ValueKind::Bool => out.push_str(if value.is_true() { "true" } else { "false" }),
            ValueKind::Number if value.is_integer() => {
                let _ = write!(out, "{value}");
            }
            ValueKind::Number => {
                push_py_float(out, f64::try_from(value.clone())?, "NaN", "Infinity");
            }
            ValueKind::String => self.write_str(out, value.as_str().unwrap_or_default()),
            ValueKind::Seq | ValueKind::Iterable => {
                let items: Vec<Value> = value.try_iter()?.collect();
                self.write_container(out, ('[', ']'), items.len(), depth, |out, i| {
                    self.write(out, &items[i], depth + 1)
                })?;
            }
            ValueKind::Map => {
                let mut entries = Vec::new();
                for key in value.try_iter()? {
                    let item = value.get_item(&key)?;
                    entries.push((self.key_string(&key)?, item));
                }
                if self.sort_keys {
                    entries.sort_by(|a, b| a.0.cmp(&b.0));
                }
                self.write_container(out, ('{', '}'), entries.len(), depth, |out, i| {
                    self.write_str(out, &entries[i].0);
                    out.push_str(&self.key_sep);
                    self.write(out, &entries[i].1, depth + 1)
                })?;
            }
            kind => {
                let kind = if value.is_undefined() {
                    "Undefined".to_owned()
                } else {
                    kind.to_string()
                };
                return Err(Error::new(
                    ErrorKind::InvalidOperation,
                    format!("tojson: Object of type {kind} is not JSON serializable"),
                ));
            }
        }
        Ok(())
    }

    /// Writes `len` items between `open` and `close`, laid out like `json.dumps`.
    fn write_container(
        &self,
        out: &mut String,
        (open, close): (char, char),
        len: usize,
        depth: usize,
        mut item: impl FnMut(&mut String, usize) -> Result<(), Error>,
    ) -> Result<(), Error> {
        out.push(open);
        if len == 0 {
            out.push(close);
            return Ok(());
        }
        for i in 0..len {
            if i > 0 {
                out.push_str(&self.item_sep);
            }
            self.newline(out, depth + 1);
            item(out, i)?;
        }
        self.newline(out, depth);
        out.push(close);
        Ok(())
    }

    fn newline(&self, out: &mut String, depth: usize) {
        if let Some(indent) = &self.indent {
            out.push('\n');
            for _ in 0..depth {
                out.push_str(indent);
            }
        }
    }

    /// Python coerces int, float, bool and None keys to strings; other keys are a TypeError.
    fn key_string(&self, key: &Value) -> Result<String, Error> {
        match key.kind() {
            ValueKind::String => Ok(key.as_str().unwrap_or_default().to_owned()),
            ValueKind::None | ValueKind::Bool | ValueKind::Number => {
                let mut out = String::new();
                self.write(&mut out, key, 0)?;
                Ok(out)
            }
            kind => Err(Error::new(
                ErrorKind::InvalidOperation,
                format!("tojson: keys must be str, int, float, bool or None, not {kind}"),
            )),
        }
    }

    fn write_str(&self, out: &mut String, s: &str) {
        out.push('"');
        for c in s.chars() {
            match c {
                '"' => out.push_str("\\\""),
                '\\' => out.push_str("\\\\"),
                '\n' => out.push_str("\\n"),
                '\r' => out.push_str("\\r"),
                '\t' => out.push_str("\\t"),
                '\u{08}' => out.push_str("\\b"),
                '\u{0c}' => out.push_str("\\f"),
                c if (c as u32) < 0x20 || (self.ensure_ascii && !(' '..='~').contains(&c)) => {
                    let mut units = [0u16; 2];
                    for unit in c.encode_utf16(&mut units) {
                        let _ = write!(out, "\\u{unit:04x}");
                    }
                }
                c => out.push(c),
            }
        }
        out.push('"');
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::{Value as Json, json};

    fn dumps(source: &str, x: Json) -> Result<String, Error> {
        let mut env = minijinja::Environment::new();
        env.add_filter("tojson", tojson);
        let ctx = Value::from_pairs([("x", super::super::json_to_value(&x))]);
        env.render_str(source, ctx)
    }

    fn dumps_ok(source: &str, x: Json) -> String {
        dumps(source, x).unwrap()
    }

    #[test]
    fn tojson_matches_python_json_dumps() {
        let value =
            json!({"a": 1, "b": "<x> & 'y' \"z\"", "c": [1.0, 2.5, null, true], "d": {}, "e": []});
        assert_eq!(
            dumps_ok("{{ x | tojson }}", value.clone()),
            r#"{"a": 1, "b": "<x> & 'y' \"z\"", "c": [1.0, 2.5, null, true], "d": {}, "e": []}"#
        );
        assert_eq!(
            dumps_ok("{{ x | tojson(indent=2) }}", value.clone()),
            "{\n  \"a\": 1,\n  \"b\": \"<x> & 'y' \\\"z\\\"\",\n  \"c\": [\n    1.0,\n    2.5,\n    null,\n    true\n  ],\n  \"d\": {},\n  \"e\": []\n}"
        );
        assert_eq!(
            dumps_ok(
                "{{ x | tojson(separators=(',', ':'), sort_keys=true) }}",
                json!({"b": 1, "a": [1, 2]})
            ),
            r#"{"a":[1,2],"b":1}"#
        );
        assert_eq!(
            dumps_ok("{{ x | tojson }}", json!("é😀\n\u{1}")),
            r#""é😀\n\u0001""#
        );
        assert_eq!(
            dumps_ok("{{ x | tojson(ensure_ascii=true) }}", json!("é😀")),
            r#""\u00e9\ud83d\ude00""#
        );
        assert!(
            dumps("{{ x | tojson(bogus=1) }}", json!(1)).is_err(),
            "unknown keyword"
        );
        assert!(dumps("{{ x | tojson(separators=1) }}", json!(1)).is_err());
        assert!(
            dumps("{{ undefined_thing | tojson }}", json!(1)).is_err(),
            "Undefined"
        );
    }

    #[test]
    fn floats_print_like_python() {
        let cases = [
            (1.0, "1.0"),
            (-0.0, "-0.0"),
            (0.1, "0.1"),
            (1e-4, "0.0001"),
            (1e-5, "1e-05"),
            (1.5e-7, "1.5e-07"),
            (1e15, "1000000000000000.0"),
            (1e16, "1e+16"),
            (1.2345e21, "1.2345e+21"),
            (123.456, "123.456"),
            (1e100, "1e+100"),
        ];
        for (f, python) in cases {
            let mut out = String::new();
            push_py_float(&mut out, f, "nan", "inf");
            assert_eq!(out, python, "{f:e}");
        }
    }
}
