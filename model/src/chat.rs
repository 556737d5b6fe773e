//! The checkpoint's own chat template, rendered with minijinja the way HF transformers'
//! `apply_chat_template` renders it with Jinja2.
//!
//! transformers compiles templates in an `ImmutableSandboxedEnvironment(trim_blocks=True,
//! lstrip_blocks=True)` with loop controls, a `tojson` filter that is plain `json.dumps`, and the
//! globals `raise_exception` and `strftime_now`; the context holds `messages`, `tools` (None when
//! absent), `documents` (None), `add_generation_prompt`, the special tokens and every extra
//! keyword. This module reproduces that, plus the Python behaviours templates lean on:
//! pycompat string/dict methods (`.startswith`, `.split`, `.items()`), and Python's `str()` of
//! floats when printed (`1e-05`, not `0.00001`).
//! `tests/real_tokenizers.rs` checks the result byte for byte against Jinja2.

mod python;
mod sources;

use std::fmt::Write as _;
use std::path::PathBuf;

use minijinja::value::{Value, ValueKind};
use minijinja::{Environment, Error, ErrorKind, State};
use serde_json::Value as Json;

use python::{py_str, tojson};
use sources::TemplateSource;

/// Everything a template sees besides the special tokens.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct ChatRequest {
    /// Messages as sent by the client: arbitrary JSON, so tool calls, tool results and
    /// `reasoning_content` reach the template untouched.
    pub messages: Vec<Json>,
    pub tools: Option<Vec<Json>>,
    pub add_generation_prompt: bool,
    /// Extra template variables (`enable_thinking`, `date_string`, ...). They override the
    /// special tokens, as keyword arguments do in transformers.
    pub extra: serde_json::Map<String, Json>,
}

/// Why a chat template could not be loaded or rendered. One line naming the source.
#[derive(Debug, thiserror::Error)]
pub enum TemplateError {
    #[error("{}: cannot read: {error}", path.display())]
    Read {
        path: PathBuf,
        error: std::io::Error,
    },
    #[error("{}: malformed JSON: {message}", path.display())]
    MalformedJson { path: PathBuf, message: String },
    #[error("{}: {message}", path.display())]
    MalformedConfig { path: PathBuf, message: String },
    #[error("{origin}: template does not compile: {message}")]
    Compile { origin: String, message: String },
    #[error("{origin}: no chat template named {name:?} (available: {available})")]
    UnknownTemplate {
        origin: String,
        name: String,
        available: String,
    },
    /// The template called `raise_exception(message)`: usually a request it does not support.
    #[error("{origin}: template raised an exception: {message}")]
    Raised { origin: String, message: String },
    #[error("{origin}: render failed: {message}")]
    Render { origin: String, message: String },
}

/// The name transformers gives the unnamed template and picks when none is asked for.
const DEFAULT_NAME: &str = "default";
/// The named template transformers picks when the request carries tools.
const TOOL_USE_NAME: &str = "tool_use";

/// One or more compiled templates (HF's named-list form) and the special tokens they see.
pub struct ChatTemplate {
    env: Environment<'static>,
    /// (template name, where it came from) in definition order; names are unique.
    templates: Vec<(String, String)>,
    bos_token: Option<String>,
    eos_token: Option<String>,
}

impl std::fmt::Debug for ChatTemplate {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ChatTemplate")
            .field("templates", &self.templates)
            .field("bos_token", &self.bos_token)
            .field("eos_token", &self.eos_token)
            .finish()
    }
}

impl ChatTemplate {
    /// A single template from source; compile errors are reported here, not at render time.
    pub fn new(
        source: String,
        bos_token: Option<String>,
        eos_token: Option<String>,
    ) -> Result<Self, TemplateError> {
        let sources = vec![TemplateSource {
            name: DEFAULT_NAME.into(),
            origin: "chat template".into(),
            source,
        }];
        Self::from_sources(sources, bos_token, eos_token)
    }

    fn from_sources(
        sources: Vec<TemplateSource>,
        bos_token: Option<String>,
        eos_token: Option<String>,
    ) -> Result<Self, TemplateError> {
        let mut env = hf_environment();
        let mut templates = Vec::with_capacity(sources.len());
        for TemplateSource {
            name,
            origin,
            source,
        } in sources
        {
            env.add_template_owned(name.clone(), source)
                .map_err(|e| TemplateError::Compile {
                    origin: origin.clone(),
                    message: e.to_string(),
                })?;
            templates.retain(|(existing, _)| *existing != name);
            templates.push((name, origin));
        }
        Ok(ChatTemplate {
            env,
            templates,
            bos_token,
            eos_token,
        })
    }

    /// Names of the available templates, `default` first when the checkpoint has one.
    pub fn names(&self) -> impl Iterator<Item = &str> {
        self.templates.iter().map(|(name, _)| name.as_str())
    }

    pub fn bos_token(&self) -> Option<&str> {
        self.bos_token.as_deref()
    }

    pub fn eos_token(&self) -> Option<&str> {
        self.eos_token.as_deref()
    }

    /// Renders with the template transformers would pick: `tool_use` when the request has tools
    /// and the checkpoint names one, else `default`.
    pub fn render(&self, request: &ChatRequest) -> Result<String, TemplateError> {
        let has_tool_use = self.templates.iter().any(|(n, _)| n == TOOL_USE_NAME);
        let name = match request.tools.is_some() && has_tool_use {
            true => TOOL_USE_NAME,
            false => DEFAULT_NAME,
        };
        self.render_named(name, request)
    }

    /// Renders with the named template (`default`, `tool_use`, ...).
    pub fn render_named(&self, name: &str, request: &ChatRequest) -> Result<String, TemplateError> {
        let Some((_, origin)) = self.templates.iter().find(|(n, _)| n == name) else {
            let available = self.names().collect::<Vec<_>>().join(", ");
            let origin = self
                .templates
                .first()
                .map(|(_, o)| o.clone())
                .unwrap_or_default();
            return Err(TemplateError::UnknownTemplate {
                origin,
                name: name.into(),
                available,
            });
        };
        let render_error = |e: Error| match raised_message(&e) {
            Some(message) => TemplateError::Raised {
                origin: origin.clone(),
                message: message.into(),
            },
            None => TemplateError::Render {
                origin: origin.clone(),
                message: e.to_string(),
            },
        };
        let template = self.env.get_template(name).map_err(render_error)?;
        template.render(self.context(request)).map_err(render_error)
    }

    fn context(&self, request: &ChatRequest) -> Value {
        let tokens = [
            ("bos_token", &self.bos_token),
            ("eos_token", &self.eos_token),
        ];
        let tokens = tokens
            .into_iter()
            .filter_map(|(key, token)| Some((key, Value::from(token.as_deref()?))));
        let extra = request
            .extra
            .iter()
            .map(|(k, v)| (k.as_str(), json_to_value(v)));
        let documents = match request.extra.contains_key("documents") {
            true => None,
            false => Some(("documents", Value::from(()))),
        };
        let tools = match &request.tools {
            Some(tools) => Value::from(tools.iter().map(json_to_value).collect::<Vec<_>>()),
            None => Value::from(()),
        };
        let messages = request
            .messages
            .iter()
            .map(json_to_value)
            .collect::<Vec<_>>();
        // Later pairs win: the request's own fields cannot be shadowed by `extra`.
        Value::from_pairs(tokens.chain(extra).chain(documents).chain([
            ("messages", Value::from(messages)),
            ("tools", tools),
            (
                "add_generation_prompt",
                Value::from(request.add_generation_prompt),
            ),
        ]))
    }
}

/// The minijinja counterpart of transformers' Jinja2 environment.
fn hf_environment() -> Environment<'static> {
    let mut env = Environment::new();
    let syntax = minijinja::syntax::SyntaxConfig::builder()
        .trim_blocks(true)
        .lstrip_blocks(true)
        .build();
    // The default syntax with two whitespace flags cannot fail to build.
    env.set_syntax(syntax.expect("default delimiters are valid"));
    // Jinja2's default Undefined: printing and iterating are fine, attribute access fails.
    env.set_undefined_behavior(minijinja::UndefinedBehavior::Lenient);
    // transformers never autoescapes; minijinja would for names ending in .html/.json.
    env.set_auto_escape_callback(|_| minijinja::AutoEscape::None);
    // Debug info clones render state into every error; our errors are one line anyway.
    env.set_debug(false);
    env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
    env.set_formatter(python_formatter);
    env.add_filter("tojson", tojson);
    env.add_filter("string", |value: &Value| py_str(value));
    env.add_filter("trim", trim);
    env.add_function("raise_exception", raise_exception);
    env.add_function("strftime_now", strftime_now);
    env
}

/// Marks an error as coming from the template's own `raise_exception`.
#[derive(Debug, thiserror::Error)]
#[error("{0}")]
struct RaisedException(String);

fn raise_exception(message: Value) -> Result<Value, Error> {
    let message = py_str(&message)?;
    Err(Error::new(ErrorKind::InvalidOperation, message.clone())
        .with_source(RaisedException(message)))
}

fn raised_message(error: &Error) -> Option<&str> {
    let mut source = std::error::Error::source(error);
    while let Some(current) = source {
        if let Some(raised) = current.downcast_ref::<RaisedException>() {
            return Some(&raised.0);
        }
        source = current.source();
    }
    None
}

fn strftime_now(format: &str) -> Result<String, Error> {
    let mut out = String::new();
    // Writing (rather than to_string) turns chrono's error on a bad specifier into Err.
    write!(out, "{}", chrono::Local::now().format(format)).map_err(|_| {
        Error::new(
            ErrorKind::InvalidOperation,
            format!("strftime_now: invalid format {format:?}"),
        )
    })?;
    Ok(out)
}

/// Jinja2's `trim`: `str(value).strip(chars)`, so `None | trim` is `"None"`.
fn trim(value: &Value, chars: Option<&str>) -> Result<String, Error> {
    let text = py_str(value)?;
    Ok(match chars {
        Some(chars) => text.trim_matches(|c| chars.contains(c)).to_owned(),
        None => text.trim().to_owned(),
    })
}

/// Prints values as Python's `str()` would, since that is what Jinja2 outputs. minijinja already
/// spells `None`, `True` and string reprs the Python way; floats (`1e-05`, `1e+21`) and
/// containers holding them are what differ.
fn python_formatter(
    out: &mut minijinja::Output,
    state: &mut State,
    value: &Value,
) -> Result<(), Error> {
    match value.kind() {
        ValueKind::Seq | ValueKind::Map => {}
        ValueKind::Number if !value.is_integer() => {}
        _ => return minijinja::escape_formatter(out, state, value),
    }
    out.write_str(&py_str(value)?)
        .map_err(|_| Error::from(ErrorKind::WriteFailure))
}

/// serde_json to minijinja, keeping object key order (minijinja's `preserve_order`).
fn json_to_value(json: &Json) -> Value {
    match json {
        Json::Null => Value::from(()),
        Json::Bool(b) => Value::from(*b),
        Json::Number(n) => match (n.as_u64(), n.as_i64()) {
            (Some(u), _) => Value::from(u),
            (None, Some(i)) => Value::from(i),
            (None, None) => Value::from(n.as_f64().unwrap_or(f64::NAN)),
        },
        Json::String(s) => Value::from(s.as_str()),
        Json::Array(items) => Value::from(items.iter().map(json_to_value).collect::<Vec<_>>()),
        Json::Object(map) => {
            Value::from_pairs(map.iter().map(|(k, v)| (k.as_str(), json_to_value(v))))
        }
    }
}

#[cfg(test)]
mod tests {
    use std::fs;

    use super::*;
    use serde_json::json;

    fn request(messages: Json) -> ChatRequest {
        ChatRequest {
            messages: serde_json::from_value(messages).unwrap(),
            ..ChatRequest::default()
        }
    }

    fn render(source: &str, request: &ChatRequest) -> Result<String, TemplateError> {
        ChatTemplate::new(source.into(), Some("<s>".into()), Some("</s>".into()))?.render(request)
    }

    fn render_value(source: &str, value: Json) -> String {
        let mut req = ChatRequest::default();
        req.extra.insert("x".into(), value);
        render(source, &req).unwrap()
    }

    #[test]
    fn shareable_across_request_threads() {
        fn assert_send_sync<T: Send + Sync>() {}
        assert_send_sync::<ChatTemplate>();
    }

    #[test]
    fn renders_a_simple_conversation_with_trim_and_lstrip_blocks() {
        let source = "{{ bos_token }}\n{% for m in messages %}\n    {% if m.role == 'user' %}\n[U]{{ m.content }}\n    {% else %}\n[A]{{ m.content }}{{ eos_token }}\n    {% endif %}\n{% endfor %}\n{% if add_generation_prompt %}[A]{% endif %}\n";
        let mut req = request(json!([
            {"role": "user", "content": "hi"},
            {"role": "assistant", "content": "hello"}
        ]));
        req.add_generation_prompt = true;
        assert_eq!(
            render(source, &req).unwrap(),
            "<s>\n[U]hi\n[A]hello</s>\n[A]"
        );
    }

    #[test]
    fn printed_values_use_python_spelling() {
        assert_eq!(render_value("{{ x }}", json!(null)), "None");
        assert_eq!(
            render_value("{{ x }}|{{ x | string }}", json!(true)),
            "True|True"
        );
        assert_eq!(
            render_value(
                "{{ x }}",
                json!({"a": [1, 2.0, null, false, "it's"], "b": "q"})
            ),
            r#"{'a': [1, 2.0, None, False, "it's"], 'b': 'q'}"#
        );
        // minijinja alone would print 0.00001 and 1000000000000000000000.0 here.
        assert_eq!(
            render_value(
                "{{ x[0] }} {{ x[1] }} {{ x }} {{ x | string }}",
                json!([1e-5, 1e21])
            ),
            "1e-05 1e+21 [1e-05, 1e+21] [1e-05, 1e+21]"
        );
        assert_eq!(
            render_value("{{ x }}", json!("tab\there\u{a0}")),
            "tab\there\u{a0}"
        );
        assert_eq!(render_value("{{ x | trim }}", json!(null)), "None");
        assert_eq!(render_value("{{ x | trim }}", json!("  a \n")), "a");
        assert_eq!(
            render(
                "[{{ missing }}{{ missing | trim }}]",
                &ChatRequest::default()
            )
            .unwrap(),
            "[]"
        );
    }

    #[test]
    fn python_string_methods_work() {
        let source = "{{ x.strip().split(' ')[-1].upper() }}{% for k, v in {'a': 1}.items() %}{{ k }}{{ v }}{% endfor %}{{ x.startswith(' he') }}";
        assert_eq!(render_value(source, json!(" hello world ")), "WORLDa1True");
        let source = "{% for i in x %}{% if i == 2 %}{% continue %}{% endif %}{% if i == 4 %}{% break %}{% endif %}{{ i }}{% endfor %}";
        assert_eq!(render_value(source, json!([1, 2, 3, 4, 5])), "13");
    }

    #[test]
    fn raise_exception_carries_the_message() {
        let err = render(
            "{{ raise_exception('Only user and assistant roles are supported!') }}",
            &ChatRequest::default(),
        )
        .unwrap_err();
        let message = err.to_string();
        assert!(matches!(err, TemplateError::Raised { .. }), "{message}");
        assert!(
            message.contains("Only user and assistant roles are supported!"),
            "{message}"
        );
        assert!(!message.contains('\n'), "{message}");
    }

    #[test]
    fn strftime_now_formats_local_time_and_rejects_bad_formats() {
        let out = render("{{ strftime_now('%Y') }}", &ChatRequest::default()).unwrap();
        assert_eq!(out.len(), 4);
        assert!(out.chars().all(|c| c.is_ascii_digit()));
        let err = render("{{ strftime_now('%Q') }}", &ChatRequest::default()).unwrap_err();
        assert!(err.to_string().contains("invalid format"), "{err}");
    }

    #[test]
    fn context_has_hf_defaults_and_extras() {
        let source = "{{ tools is none }}|{{ documents is none }}|{{ enable_thinking }}|{{ date_string }}|{{ bos_token }}";
        let mut req = ChatRequest::default();
        req.extra.insert("enable_thinking".into(), json!(false));
        req.extra.insert("date_string".into(), json!("26 Jul 2024"));
        req.extra.insert("bos_token".into(), json!("<BOS>"));
        assert_eq!(
            render(source, &req).unwrap(),
            "True|True|False|26 Jul 2024|<BOS>"
        );
        req.tools = Some(vec![json!({"type": "function"})]);
        req.extra.insert("messages".into(), json!("shadowed"));
        assert_eq!(
            render("{{ tools | length }}{{ messages | length }}", &req).unwrap(),
            "10"
        );
        let no_bos = ChatTemplate::new("[{{ bos_token }}]".into(), None, None).unwrap();
        assert_eq!(no_bos.render(&ChatRequest::default()).unwrap(), "[]");
    }

    #[test]
    fn messages_reach_the_template_untouched() {
        let source = "{% for m in messages %}{{ m.tool_calls[0].function.arguments | tojson }} {{ m.reasoning_content }}{% endfor %}";
        let req = request(
            json!([{"role": "assistant", "content": null, "reasoning_content": "why",
            "tool_calls": [{"function": {"name": "f", "arguments": {"z": 1, "a": [true]}}}]}]),
        );
        assert_eq!(
            render(source, &req).unwrap(),
            r#"{"z": 1, "a": [true]} why"#
        );
    }

    #[test]
    fn compile_errors_are_reported_at_construction() {
        let err = ChatTemplate::new("{% for %}".into(), None, None).unwrap_err();
        assert!(matches!(err, TemplateError::Compile { .. }), "{err}");
        assert!(
            err.to_string()
                .starts_with("chat template: template does not compile"),
            "{err}"
        );
    }

    #[test]
    fn named_list_selects_default_and_tool_use() {
        let dir = tempfile::tempdir().unwrap();
        let config = json!({
            "bos_token": {"content": "<s>", "lstrip": false}, "eos_token": "</s>",
            "chat_template": [
                {"name": "default", "template": "D{{ bos_token }}"},
                {"name": "tool_use", "template": "T{{ tools | length }}"},
                {"name": "rag", "template": "R"}
            ]
        });
        fs::write(dir.path().join("tokenizer_config.json"), config.to_string()).unwrap();
        let template = ChatTemplate::from_dir(dir.path()).unwrap().unwrap();
        assert_eq!(
            template.names().collect::<Vec<_>>(),
            ["default", "tool_use", "rag"]
        );
        let mut req = ChatRequest::default();
        assert_eq!(template.render(&req).unwrap(), "D<s>");
        req.tools = Some(vec![json!({}), json!({})]);
        assert_eq!(template.render(&req).unwrap(), "T2");
        assert_eq!(template.render_named("rag", &req).unwrap(), "R");
        let err = template.render_named("nope", &req).unwrap_err();
        assert!(
            err.to_string()
                .contains("available: default, tool_use, rag"),
            "{err}"
        );
    }

    #[test]
    fn named_list_without_default_fails_at_render() {
        let dir = tempfile::tempdir().unwrap();
        let config = json!({"chat_template": [{"name": "tool_use", "template": "T"}]});
        fs::write(dir.path().join("tokenizer_config.json"), config.to_string()).unwrap();
        let template = ChatTemplate::from_dir(dir.path()).unwrap().unwrap();
        assert!(template.render(&ChatRequest::default()).is_err());
        let req = ChatRequest {
            tools: Some(Vec::new()),
            ..ChatRequest::default()
        };
        assert_eq!(template.render(&req).unwrap(), "T");
    }

    #[test]
    fn jinja_files_take_priority_over_the_config() {
        let dir = tempfile::tempdir().unwrap();
        let config = json!({"eos_token": "</s>", "chat_template": "from config"});
        fs::write(dir.path().join("tokenizer_config.json"), config.to_string()).unwrap();
        assert_eq!(
            ChatTemplate::from_dir(dir.path())
                .unwrap()
                .unwrap()
                .render(&ChatRequest::default())
                .unwrap(),
            "from config"
        );
        fs::write(
            dir.path().join("chat_template.jinja"),
            "from file{{ eos_token }}\n",
        )
        .unwrap();
        fs::create_dir(dir.path().join("additional_chat_templates")).unwrap();
        fs::write(
            dir.path().join("additional_chat_templates/tool_use.jinja"),
            "tools",
        )
        .unwrap();
        let template = ChatTemplate::from_dir(dir.path()).unwrap().unwrap();
        // Jinja2 drops a single trailing newline (keep_trailing_newline=False); so must we.
        assert_eq!(
            template.render(&ChatRequest::default()).unwrap(),
            "from file</s>"
        );
        assert_eq!(
            template.names().collect::<Vec<_>>(),
            ["default", "tool_use"]
        );
    }

    #[test]
    fn checkpoints_without_template_give_none() {
        let dir = tempfile::tempdir().unwrap();
        assert!(ChatTemplate::from_dir(dir.path()).unwrap().is_none());
        fs::write(
            dir.path().join("tokenizer_config.json"),
            r#"{"chat_template": null}"#,
        )
        .unwrap();
        assert!(ChatTemplate::from_dir(dir.path()).unwrap().is_none());
    }

    #[test]
    fn malformed_configs_name_the_file() {
        for bad in [
            "{",
            r#"{"chat_template": 3}"#,
            r#"{"chat_template": [{"name": "x"}]}"#,
            r#"{"bos_token": 1, "chat_template": "x"}"#,
        ] {
            let dir = tempfile::tempdir().unwrap();
            fs::write(dir.path().join("tokenizer_config.json"), bad).unwrap();
            let message = ChatTemplate::from_dir(dir.path()).unwrap_err().to_string();
            assert!(
                message.contains("tokenizer_config.json: "),
                "{bad}: {message}"
            );
            assert!(!message.contains('\n'), "{message}");
        }
        let dir = tempfile::tempdir().unwrap();
        fs::write(
            dir.path().join("tokenizer_config.json"),
            r#"{"chat_template": "{% if %}"}"#,
        )
        .unwrap();
        let message = ChatTemplate::from_dir(dir.path()).unwrap_err().to_string();
        assert!(
            message.contains("tokenizer_config.json#chat_template: template does not compile"),
            "{message}"
        );
    }

    #[test]
    fn render_errors_do_not_panic() {
        let req = request(json!([{"role": "user"}]));
        let err = render("{{ messages[0].content.x }}", &req).unwrap_err();
        assert!(matches!(err, TemplateError::Render { .. }), "{err}");
        let err = render("{{ missing | tojson }}", &req).unwrap_err();
        assert!(err.to_string().contains("not JSON serializable"), "{err}");
    }
}
