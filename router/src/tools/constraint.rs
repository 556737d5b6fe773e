//! Forcing a tool call: `tool_choice` `required` (OpenAI) / `any` (Anthropic, Converse) or a
//! named tool becomes a grammar the output must follow — the family's call syntax around a JSON
//! object whose `name` is one of the allowed tools and whose arguments follow that tool's
//! parameter schema. The engine enforces it token by token (llguidance), so the call the parser
//! reads back is always well formed.
//!
//! Each format has the grammar of a call form its parser reads. Mistral's is its JSON list
//! (`[TOOL_CALLS][{...}]`). Qwen3-Coder's XML arguments and pythonic arguments would need a
//! grammar per parameter type, so those formats force the JSON form of their family instead
//! (Hermes `<tool_call>` JSON for Qwen3-Coder, Llama 3.1 JSON for pythonic), which their parsers
//! also read.

use serde_json::{Value, json};
use strata_protocol::Constraint;

use super::ToolFormat;

/// What may follow the last call before the end of sequence: one newline.
const END: &str = "\"\\n\"?";

/// Which calls the output must consist of.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ForcedCall {
    /// One or more calls (one, in Llama's format) of any of the tools.
    Any,
    /// Exactly one call of this tool.
    Named(String),
}

/// The grammar for `forced` calls of `tools` (template-shaped function tools:
/// `{"type": "function", "function": {"name", "parameters"}}`) written in `format`.
pub fn forced_call(format: &ToolFormat, tools: &[Value], forced: &ForcedCall) -> Constraint {
    let family = Family::of(format);
    let arguments_key = match family {
        Family::Hermes | Family::Mistral => "arguments",
        Family::LlamaJson => "parameters",
    };
    let chosen = tools.iter().filter_map(|tool| {
        let function = tool.get("function")?;
        let name = function.get("name")?.as_str()?;
        if let ForcedCall::Named(wanted) = forced
            && wanted != name
        {
            return None;
        }
        Some((name, function.get("parameters").filter(|p| p.is_object())))
    });
    let variants: Vec<Value> = chosen
        .enumerate()
        .map(|(i, (name, parameters))| {
            let mut parameters = parameters
                .cloned()
                .unwrap_or_else(|| json!({"type": "object"}));
            // The tool's own references (`#/$defs/…`, `#`) point into its schema, which now
            // sits inside the grammar's: they are rebased onto where it sits.
            rebase_refs(
                &mut parameters,
                &format!("#/anyOf/{i}/properties/{arguments_key}"),
            );
            json!({
                "type": "object",
                "properties": {"name": {"const": name}, arguments_key: parameters},
                "required": ["name", arguments_key],
                "additionalProperties": false,
            })
        })
        .collect();
    let schema = json!({
        "anyOf": variants,
        "x-guidance": {"whitespace_flexible": false},
    });
    // Every form may end with a newline before the end of sequence: after a call a model's most
    // likely token is often "\n", and a grammar that allowed it only before another call made the
    // model write the same call again and again until `max_tokens`.
    let lark = match (family, forced) {
        (Family::Hermes, ForcedCall::Any) => {
            format!(
                "start: call (\"\\n\" call)* {END}\ncall: \"<tool_call>\\n\" %json {schema} \"\\n</tool_call>\"\n"
            )
        }
        (Family::Hermes, ForcedCall::Named(_)) => {
            format!("start: \"<tool_call>\\n\" %json {schema} \"\\n</tool_call>\" {END}\n")
        }
        (Family::Mistral, ForcedCall::Any) => {
            format!(
                "start: \"[TOOL_CALLS][\" call (\", \" call)* \"]\" {END}\ncall: %json {schema}\n"
            )
        }
        (Family::Mistral, ForcedCall::Named(_)) => {
            format!("start: \"[TOOL_CALLS][\" %json {schema} \"]\" {END}\n")
        }
        (Family::LlamaJson, _) => format!("start: %json {schema} {END}\n"),
    };
    Constraint::Lark(lark)
}

/// Every local `$ref` in `schema` (`#` or `#/…`) rewritten to start at `base` instead of the
/// schema's root; references to other documents are left as they are.
fn rebase_refs(schema: &mut Value, base: &str) {
    match schema {
        Value::Object(map) => {
            for (key, value) in map.iter_mut() {
                match value {
                    Value::String(r) if key == "$ref" => {
                        if let Some(rest) = r.strip_prefix('#') {
                            *r = format!("{base}{rest}");
                        }
                    }
                    other => rebase_refs(other, base),
                }
            }
        }
        Value::Array(items) => items.iter_mut().for_each(|v| rebase_refs(v, base)),
        _ => {}
    }
}

/// The call syntax a format's forced calls are written in (see the module comment).
#[derive(Clone, Copy)]
enum Family {
    Hermes,
    LlamaJson,
    Mistral,
}

impl Family {
    fn of(format: &ToolFormat) -> Self {
        match format {
            ToolFormat::Hermes | ToolFormat::QwenXml(_) => Family::Hermes,
            ToolFormat::LlamaJson | ToolFormat::Pythonic => Family::LlamaJson,
            ToolFormat::Mistral => Family::Mistral,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tools() -> Vec<Value> {
        vec![
            json!({"type": "function", "function": {"name": "get_weather", "parameters": {
                "type": "object", "properties": {"city": {"type": "string"}},
                "required": ["city"]}}}),
            json!({"type": "function", "function": {"name": "get_time"}}),
        ]
    }

    #[test]
    fn a_named_call_admits_only_that_tool() {
        let Constraint::Lark(lark) = forced_call(
            &ToolFormat::Hermes,
            &tools(),
            &ForcedCall::Named("get_time".into()),
        ) else {
            panic!("a Lark grammar");
        };
        assert!(
            lark.contains("get_time") && !lark.contains("get_weather"),
            "{lark}"
        );
        assert!(lark.starts_with("start: \"<tool_call>\\n\""), "{lark}");
    }

    #[test]
    fn llama_calls_use_parameters() {
        let Constraint::Lark(lark) =
            forced_call(&ToolFormat::LlamaJson, &tools(), &ForcedCall::Any)
        else {
            panic!("a Lark grammar");
        };
        assert!(lark.contains("\"parameters\"") && !lark.contains("\"arguments\""));
        assert!(lark.contains("get_time") && lark.contains("get_weather"));
        let Constraint::Lark(pythonic) =
            forced_call(&ToolFormat::Pythonic, &tools(), &ForcedCall::Any)
        else {
            panic!("a Lark grammar");
        };
        assert_eq!(pythonic, lark, "pythonic forces Llama's JSON form");
    }

    #[test]
    fn mistral_calls_are_a_marked_json_list() {
        let Constraint::Lark(any) = forced_call(&ToolFormat::Mistral, &tools(), &ForcedCall::Any)
        else {
            panic!("a Lark grammar");
        };
        assert!(
            any.starts_with("start: \"[TOOL_CALLS][\" call (\", \" call)* \"]\""),
            "{any}"
        );
        assert!(any.contains("\"arguments\""));
        let Constraint::Lark(named) = forced_call(
            &ToolFormat::Mistral,
            &tools(),
            &ForcedCall::Named("get_weather".into()),
        ) else {
            panic!("a Lark grammar");
        };
        assert!(
            named.starts_with("start: \"[TOOL_CALLS][\" %json"),
            "{named}"
        );
        assert!(!named.contains("get_time"), "{named}");
    }

    /// A tiny model's tokenizer and grammar compiler, to drive forced grammars with text.
    struct Grammars {
        _dir: tempfile::TempDir,
        tok: strata_model::tokenizer::Tokenizer,
        compiler: strata_model::grammar::GrammarCompiler,
        eos: u32,
    }

    impl Grammars {
        fn new() -> Self {
            use strata_model::config::Architecture;
            use strata_model::synth::{SynthSpec, synthesize};

            let dir = tempfile::tempdir().unwrap();
            synthesize(&SynthSpec::tiny(Architecture::Qwen3, 7), dir.path(), None).unwrap();
            let tok = strata_model::tokenizer::Tokenizer::from_dir(dir.path()).unwrap();
            let eos = tok.eos_token_id().unwrap();
            let compiler =
                strata_model::grammar::GrammarCompiler::new(&tok, tok.vocab_size() + 3, &[eos])
                    .unwrap();
            Self {
                _dir: dir,
                tok,
                compiler,
                eos,
            }
        }

        /// Whether `constraint` admits `text` and lets the output end after it.
        fn ends_after(&self, constraint: &Constraint, text: &str) -> bool {
            let mut decoder = self.compiler.compile(constraint).unwrap();
            for id in self.tok.encode(text, false).unwrap() {
                decoder.advance(id).unwrap();
            }
            decoder.ends_with(self.eos)
        }
    }

    /// Every forced form may end with a newline and then the end of sequence (a model's likely
    /// token after a call); the grammar without it refuses the end there (the canary).
    #[test]
    fn every_forced_form_may_end_after_a_newline() {
        let grammars = Grammars::new();
        let ends_after =
            |constraint: &Constraint, text: &str| grammars.ends_after(constraint, text);
        let hermes = "<tool_call>\n{\"name\":\"get_time\",\"arguments\":{}}\n</tool_call>\n";
        let named = ForcedCall::Named("get_time".into());
        for (format, forced, text) in [
            (ToolFormat::Hermes, &ForcedCall::Any, hermes),
            (ToolFormat::Hermes, &named, hermes),
            (
                ToolFormat::Mistral,
                &ForcedCall::Any,
                "[TOOL_CALLS][{\"name\":\"get_time\",\"arguments\":{}}]\n",
            ),
            (
                ToolFormat::LlamaJson,
                &ForcedCall::Any,
                "{\"name\":\"get_time\",\"parameters\":{}}\n",
            ),
        ] {
            let constraint = forced_call(&format, &tools(), forced);
            assert!(
                ends_after(&constraint, text),
                "{format:?} {forced:?}: {text:?}"
            );
            // Without the newline the end is allowed too.
            assert!(
                ends_after(&constraint, text.trim_end()),
                "{format:?} {forced:?}"
            );
        }
        let Constraint::Lark(lark) = forced_call(&ToolFormat::Hermes, &tools(), &ForcedCall::Any)
        else {
            panic!("a Lark grammar");
        };
        let without_end = Constraint::Lark(lark.replacen(&format!(" {END}"), "", 1));
        assert!(!ends_after(&without_end, hermes));
    }

    /// A tool schema with its own definitions (`$defs` + `$ref`, as `pydantic_function_tool`
    /// writes a nested model) compiles when forced, any or named, and admits a call through the
    /// reference; left pointing at the grammar's root, the reference does not resolve (canary).
    #[test]
    fn tool_schemas_with_references_compile_when_forced() {
        let grammars = Grammars::new();
        let nested = json!({"type": "function", "function": {"name": "book", "parameters": {
            "$defs": {"Place": {"type": "object", "properties": {"city": {"type": "string"}},
                                "required": ["city"], "additionalProperties": false}},
            "type": "object", "properties": {"to": {"$ref": "#/$defs/Place"}},
            "required": ["to"], "additionalProperties": false}}});
        let tools = [tools(), vec![nested]].concat();
        let text = "<tool_call>\n{\"name\":\"book\",\"arguments\":{\"to\":{\"city\":\"Oslo\"}}}\n</tool_call>";
        for forced in [ForcedCall::Any, ForcedCall::Named("book".into())] {
            let constraint = forced_call(&ToolFormat::Hermes, &tools, &forced);
            assert!(grammars.ends_after(&constraint, text), "{forced:?}");
        }
        let Constraint::Lark(lark) = forced_call(&ToolFormat::Hermes, &tools, &ForcedCall::Any)
        else {
            panic!("a Lark grammar");
        };
        let unrebased = lark.replace("#/anyOf/2/properties/arguments/$defs", "#/$defs");
        assert!(
            grammars
                .compiler
                .compile(&Constraint::Lark(unrebased))
                .is_err()
        );
    }

    /// What each forced grammar writes is read back as calls by the format's own parser: a
    /// sample output in each grammar's shape.
    #[test]
    fn forced_outputs_parse_as_calls_in_every_format() {
        let hermes = "<tool_call>\n{\"name\":\"get_time\",\"arguments\":{}}\n</tool_call>";
        let llama = "{\"name\":\"get_time\",\"parameters\":{}}";
        let mistral = "[TOOL_CALLS][{\"name\":\"get_time\",\"arguments\":{}}, \
                       {\"name\":\"get_time\",\"arguments\":{}}]";
        for (format, output, calls) in [
            (ToolFormat::Hermes, hermes, 1),
            (ToolFormat::QwenXml(Default::default()), hermes, 1),
            (ToolFormat::LlamaJson, llama, 1),
            (ToolFormat::Pythonic, llama, 1),
            (ToolFormat::Mistral, mistral, 2),
        ] {
            // The newline a forced grammar lets end the output is not content.
            for output in [output.to_string(), format!("{output}\n")] {
                let parsed = super::super::parse(format.clone(), &output, false);
                assert_eq!(parsed.calls.len(), calls, "{format:?}: {parsed:?}");
                assert_eq!(parsed.content, "", "{format:?}: {parsed:?}");
            }
        }
    }
}
