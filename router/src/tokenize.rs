//! Tokens as the engine sees them: a model directory's own tokenizer (`tokenizer.json`, read by
//! the `tokenizers` crate) and chat template (`tokenizer_config.json`'s `chat_template`, or
//! `chat_template.jinja`), rendered with `minijinja` the way Hugging Face's `apply_chat_template`
//! renders it. Nothing is downloaded.
//!
//! What vLLM's OpenAI server does, and so what this does:
//! - a completion's text prompt is encoded with the special tokens (`add_special_tokens`
//!   defaults to true): the tokenizer's post-processor adds what the model's tokenizer adds;
//! - a chat request's messages are rendered through the template with `add_generation_prompt`
//!   (default true; false when `continue_final_message`), `tools`, `documents`,
//!   `chat_template_kwargs` and the tokenizer's special tokens (`bos_token`, `eos_token`,
//!   `unk_token`, `pad_token`), then encoded without the special tokens (`add_special_tokens`
//!   defaults to false: the template writes them);
//! - the messages are what vLLM's parser makes of them (`vllm_message`): a `content` that is
//!   a list of parts becomes the parts' `text` joined by newlines (vLLM's "string" content
//!   format, what text-only templates read), a tool call's `arguments` string its object;
//! - `continue_final_message` ends the text where the final message's content ends.
//!
//! The template environment is Jinja2's as Hugging Face sets it: `trim_blocks`, `lstrip_blocks`,
//! loop controls, Python's string and dict methods (`minijinja-contrib`'s pycompat), `tojson` as
//! Python's `json.dumps` writes it (`", "` and `": "` separators, no ASCII escaping, keys in the
//! request's order), `raise_exception` and `strftime_now` (UTC).

use std::path::{Path, PathBuf};

use minijinja::value::{Kwargs, Value, ValueKind};
use minijinja::{Environment, Error as TemplateError, ErrorKind};

/// Why a tokenizer could not be loaded, or a request not tokenized.
#[derive(Debug, thiserror::Error)]
pub enum TokenizeError {
    #[error("{path}: {reason}")]
    Load { path: PathBuf, reason: String },
    #[error("the request is not JSON: {0}")]
    Body(String),
    #[error("the request has no prompt or messages to tokenize")]
    NoPrompt,
    #[error("the model has no chat template (tokenizer_config.json's chat_template, or chat_template.jinja)")]
    NoTemplate,
    #[error("chat template: {0}")]
    Template(String),
    #[error("tokenizer: {0}")]
    Encode(String),
}

/// The special tokens a template sees, from `tokenizer_config.json`.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct SpecialTokens {
    pub bos_token: Option<String>,
    pub eos_token: Option<String>,
    pub unk_token: Option<String>,
    pub pad_token: Option<String>,
}

/// A model's tokenizer and chat template.
pub struct Tokenizer {
    tokenizer: tokenizers::Tokenizer,
    env: Option<Environment<'static>>,
    special: SpecialTokens,
    dir: PathBuf,
}

impl std::fmt::Debug for Tokenizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Tokenizer").field("dir", &self.dir).field("chat_template", &self.env.is_some()).finish()
    }
}

/// A prompt to tokenize, read from a completion or chat request's body.
#[derive(Debug, Clone, PartialEq)]
pub enum Prompt {
    /// `"prompt": [1, 2, 3]` (or the first of a batch of them): nothing to tokenize.
    Ids(Vec<u64>),
    /// `"prompt": "text"` (or the first of a batch of them), with `add_special_tokens`.
    Text { text: String, add_special_tokens: bool },
    /// `"messages": [...]`: the chat request's body as it came (its maps' order is the
    /// template's, as in Python's dicts), rendered through the template.
    Chat(String),
}

impl Prompt {
    /// The prompt of a request to `path` (`/v1/completions` or `/v1/chat/completions`).
    pub fn of(path: &str, body: &[u8]) -> Result<Prompt, TokenizeError> {
        let v: serde_json::Value = serde_json::from_slice(body).map_err(|e| TokenizeError::Body(e.to_string()))?;
        if path.ends_with("/chat/completions") {
            if !v.get("messages").is_some_and(serde_json::Value::is_array) {
                return Err(TokenizeError::NoPrompt);
            }
            let text = String::from_utf8(body.to_vec()).map_err(|e| TokenizeError::Body(e.to_string()))?;
            return Ok(Prompt::Chat(text));
        }
        let add_special_tokens = v.get("add_special_tokens").and_then(serde_json::Value::as_bool).unwrap_or(true);
        let first = match v.get("prompt") {
            Some(serde_json::Value::Array(a)) => match a.first() {
                Some(inner @ (serde_json::Value::Array(_) | serde_json::Value::String(_))) => inner.clone(),
                _ => serde_json::Value::Array(a.clone()),
            },
            Some(p) => p.clone(),
            None => return Err(TokenizeError::NoPrompt),
        };
        match first {
            serde_json::Value::String(text) => Ok(Prompt::Text { text, add_special_tokens }),
            serde_json::Value::Array(ids) => ids
                .iter()
                .map(serde_json::Value::as_u64)
                .collect::<Option<Vec<u64>>>()
                .map(Prompt::Ids)
                .ok_or(TokenizeError::NoPrompt),
            _ => Err(TokenizeError::NoPrompt),
        }
    }
}

fn load_err(path: &Path, reason: impl std::fmt::Display) -> TokenizeError {
    TokenizeError::Load { path: path.to_path_buf(), reason: reason.to_string() }
}

/// A special token as `tokenizer_config.json` writes it: a string, or `{"content": ...}`.
fn token_text(v: Option<&serde_json::Value>) -> Option<String> {
    match v? {
        serde_json::Value::String(s) => Some(s.clone()),
        serde_json::Value::Object(o) => o.get("content").and_then(|c| c.as_str()).map(str::to_string),
        _ => None,
    }
}

impl Tokenizer {
    /// Loads `dir/tokenizer.json`, and the chat template and special tokens from
    /// `dir/tokenizer_config.json` (a `chat_template` string, or a list of named templates of which
    /// `default` is taken) or `dir/chat_template.jinja`.
    pub fn from_dir(dir: &Path) -> Result<Tokenizer, TokenizeError> {
        let tj = dir.join("tokenizer.json");
        let tokenizer = tokenizers::Tokenizer::from_file(&tj).map_err(|e| load_err(&tj, e))?;
        let cfg_path = dir.join("tokenizer_config.json");
        let cfg: serde_json::Value = match std::fs::read(&cfg_path) {
            Ok(b) => serde_json::from_slice(&b).map_err(|e| load_err(&cfg_path, e))?,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => serde_json::Value::Null,
            Err(e) => return Err(load_err(&cfg_path, e)),
        };
        let special = SpecialTokens {
            bos_token: token_text(cfg.get("bos_token")),
            eos_token: token_text(cfg.get("eos_token")),
            unk_token: token_text(cfg.get("unk_token")),
            pad_token: token_text(cfg.get("pad_token")),
        };
        let template = match cfg.get("chat_template") {
            Some(serde_json::Value::String(t)) => Some(t.clone()),
            Some(serde_json::Value::Array(named)) => named
                .iter()
                .find(|t| t.get("name").and_then(|n| n.as_str()) == Some("default"))
                .and_then(|t| t.get("template"))
                .and_then(|t| t.as_str())
                .map(str::to_string),
            _ => None,
        };
        let template = match template {
            Some(t) => Some(t),
            None => {
                let p = dir.join("chat_template.jinja");
                match std::fs::read_to_string(&p) {
                    Ok(t) => Some(t),
                    Err(e) if e.kind() == std::io::ErrorKind::NotFound => None,
                    Err(e) => return Err(load_err(&p, e)),
                }
            }
        };
        let env = template.map(|t| environment(t).map_err(|e| load_err(&cfg_path, template_error(&e)))).transpose()?;
        Ok(Tokenizer { tokenizer, env, special, dir: dir.to_path_buf() })
    }

    /// The same tokenizer with `template` as its chat template.
    pub fn with_chat_template(mut self, template: &str) -> Result<Tokenizer, TokenizeError> {
        let env = environment(template.to_string()).map_err(|e| TokenizeError::Template(template_error(&e)))?;
        self.env = Some(env);
        Ok(self)
    }

    /// The directory it was loaded from.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// Whether the model has a chat template.
    pub fn has_chat_template(&self) -> bool {
        self.env.is_some()
    }

    /// The special tokens a template sees.
    pub fn special_tokens(&self) -> &SpecialTokens {
        &self.special
    }

    /// `text`'s token ids, with the tokenizer's special tokens when `add_special_tokens`.
    pub fn encode(&self, text: &str, add_special_tokens: bool) -> Result<Vec<u64>, TokenizeError> {
        let enc = self.tokenizer.encode(text, add_special_tokens).map_err(|e| TokenizeError::Encode(e.to_string()))?;
        Ok(enc.get_ids().iter().map(|&i| u64::from(i)).collect())
    }

    /// A chat request's prompt text: its messages (the request's JSON) rendered through the
    /// chat template.
    pub fn render_chat(&self, request: &str) -> Result<String, TokenizeError> {
        let env = self.env.as_ref().ok_or(TokenizeError::NoTemplate)?;
        // Parsed straight into the template's values: maps keep the request's order.
        let req: Value = serde_json::from_str(request).map_err(|e| TokenizeError::Body(e.to_string()))?;
        let messages = field(&req, "messages").filter(|m| m.kind() == ValueKind::Seq).ok_or(TokenizeError::NoPrompt)?;
        let messages: Vec<Value> =
            messages.try_iter().map_err(|e| TokenizeError::Body(e.to_string()))?.map(|m| vllm_message(&m)).collect();
        let flag = |k: &str, d: bool| field(&req, k).map_or(d, |v| v.is_true());
        let continue_final = flag("continue_final_message", false);
        // vLLM: a continued final message gets no generation prompt.
        let add_generation_prompt = flag("add_generation_prompt", true) && !continue_final;
        let mut ctx: Vec<(Value, Value)> = Vec::new();
        // The template's own keyword arguments first; the request's fields win over them.
        if let Some(kw) = field(&req, "chat_template_kwargs").filter(|k| k.kind() == ValueKind::Map) {
            ctx.extend(entries(&kw));
        }
        let mut set = |k: &str, v: Value| {
            ctx.retain(|(key, _)| key.as_str() != Some(k));
            ctx.push((Value::from(k), v));
        };
        let last_content = messages.last().and_then(|m| field(m, "content")).map(|c| c.to_string()).unwrap_or_default();
        set("messages", Value::from(messages));
        set("add_generation_prompt", Value::from(add_generation_prompt));
        set("tools", field(&req, "tools").unwrap_or(Value::from(())));
        set("documents", field(&req, "documents").unwrap_or(Value::from(())));
        let sp = &self.special;
        for (k, v) in [
            ("bos_token", &sp.bos_token),
            ("eos_token", &sp.eos_token),
            ("unk_token", &sp.unk_token),
            ("pad_token", &sp.pad_token),
        ] {
            if let Some(v) = v {
                set(k, Value::from(v.as_str()));
            }
        }
        let tmpl = env.get_template(TEMPLATE).map_err(|e| TokenizeError::Template(template_error(&e)))?;
        let text = tmpl.render(Value::from_iter(ctx)).map_err(|e| TokenizeError::Template(template_error(&e)))?;
        if !continue_final {
            return Ok(text);
        }
        // Continuing the final message: the text ends where that message's content ends.
        let content = last_content.as_str();
        let end = text
            .rfind(content)
            .map(|i| i + content.len())
            .or_else(|| text.rfind(content.trim()).map(|i| i + content.trim().len()))
            .filter(|_| !content.trim().is_empty())
            .ok_or_else(|| {
                TokenizeError::Template("continue_final_message: the final message is not in the rendered chat".into())
            })?;
        Ok(text[..end].to_string())
    }

    /// The prompt's token ids, as the engine would make them.
    pub fn tokens(&self, prompt: &Prompt) -> Result<Vec<u64>, TokenizeError> {
        match prompt {
            Prompt::Ids(ids) => Ok(ids.clone()),
            Prompt::Text { text, add_special_tokens } => self.encode(text, *add_special_tokens),
            Prompt::Chat(request) => {
                let text = self.render_chat(request)?;
                #[derive(serde::Deserialize)]
                struct Flags {
                    add_special_tokens: Option<bool>,
                }
                let add = serde_json::from_str::<Flags>(request).ok().and_then(|f| f.add_special_tokens);
                self.encode(&text, add.unwrap_or(false))
            }
        }
    }
}

/// `v[key]`, when `v` is a map that has it.
fn field(v: &Value, key: &str) -> Option<Value> {
    v.get_attr(key).ok().filter(|x| !x.is_undefined())
}

/// A map's entries, in its order.
fn entries(v: &Value) -> Vec<(Value, Value)> {
    let Ok(keys) = v.try_iter() else { return Vec::new() };
    keys.map(|k| {
        let item = v.get_item(&k).unwrap_or_default();
        (k, item)
    })
    .collect()
}

/// A message as vLLM's chat parser hands it to the template: `role` and `content` (a list of
/// parts becomes their `text` joined by newlines, vLLM's "string" content format; none
/// becomes empty), `name` when a string, an assistant's `tool_calls` (each `arguments` JSON
/// string parsed to its object, none or empty to `{}`; an empty list dropped) and `reasoning`,
/// a tool's `tool_call_id`. Other fields are not passed.
fn vllm_message(m: &Value) -> Value {
    let role = field(m, "role").unwrap_or(Value::from(()));
    let content = match field(m, "content") {
        Some(c) if c.kind() == ValueKind::String => c,
        Some(parts) if parts.kind() == ValueKind::Seq => {
            let text: Vec<String> = parts
                .try_iter()
                .into_iter()
                .flatten()
                .filter(|p| field(p, "type").is_none_or(|t| t.as_str() == Some("text")))
                .filter_map(|p| field(&p, "text").and_then(|t| t.as_str().map(str::to_string)))
                .collect();
            Value::from(text.join("\n"))
        }
        _ => Value::from(""),
    };
    let mut out: Vec<(&str, Value)> = vec![("role", role.clone()), ("content", content)];
    match role.as_str() {
        Some("assistant") => {
            let calls = field(m, "tool_calls").filter(|c| c.kind() == ValueKind::Seq && c.len() != Some(0));
            if let Some(calls) = calls {
                let calls: Vec<Value> = calls.try_iter().into_iter().flatten().map(|c| tool_call(&c)).collect();
                out.push(("tool_calls", Value::from(calls)));
            }
            if let Some(r) = field(m, "reasoning").or_else(|| field(m, "reasoning_content")).filter(|r| !r.is_none()) {
                out.push(("reasoning", r.clone()));
                out.push(("reasoning_content", r));
            }
        }
        Some("tool") => {
            if let Some(id) = field(m, "tool_call_id") {
                out.push(("tool_call_id", id));
            }
        }
        _ => {}
    }
    if let Some(name) = field(m, "name").filter(|n| n.kind() == ValueKind::String) {
        out.push(("name", name));
    }
    Value::from_iter(out)
}

/// A tool call with its `function.arguments` as an object (vLLM parses the JSON string).
fn tool_call(c: &Value) -> Value {
    if c.kind() != ValueKind::Map {
        return c.clone();
    }
    let args = |a: Option<Value>| match a {
        Some(a) if matches!(a.kind(), ValueKind::Map | ValueKind::Seq) => a,
        Some(a) if a.as_str().is_some_and(|s| !s.is_empty()) => {
            let s = a.as_str().unwrap_or_default();
            serde_json::from_str::<Value>(s).unwrap_or(a.clone())
        }
        _ => Value::from_iter(Vec::<(Value, Value)>::new()),
    };
    let mut out = entries(c);
    for (k, v) in &mut out {
        if k.as_str() == Some("function") && v.kind() == ValueKind::Map {
            let mut f = entries(v);
            match f.iter_mut().find(|(k, _)| k.as_str() == Some("arguments")) {
                Some((_, a)) => *a = args(Some(a.clone())),
                None => f.push((Value::from("arguments"), args(None))),
            }
            *v = Value::from_iter(f);
        }
    }
    Value::from_iter(out)
}

const TEMPLATE: &str = "chat";

fn template_error(e: &TemplateError) -> String {
    let mut s = e.to_string();
    let mut src = std::error::Error::source(e);
    while let Some(c) = src {
        s.push_str(": ");
        s.push_str(&c.to_string());
        src = c.source();
    }
    s
}

/// The template environment Hugging Face renders chat templates in.
fn environment(template: String) -> Result<Environment<'static>, TemplateError> {
    let mut env = Environment::new();
    env.set_trim_blocks(true);
    env.set_lstrip_blocks(true);
    env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
    env.add_filter("tojson", tojson);
    env.add_function("raise_exception", |msg: String| -> Result<Value, TemplateError> {
        Err(TemplateError::new(ErrorKind::InvalidOperation, msg))
    });
    env.add_function("strftime_now", |fmt: String| -> String {
        let now = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_secs());
        strftime(&fmt, now)
    });
    env.add_template_owned(TEMPLATE, template)?;
    Ok(env)
}

/// Python's `json.dumps(value, ensure_ascii=False, indent=indent, separators=separators,
/// sort_keys=sort_keys)`, as Hugging Face's `tojson` filter calls it.
fn tojson(value: &Value, kwargs: Kwargs) -> Result<Value, TemplateError> {
    let indent: Option<usize> = kwargs.get("indent")?;
    let sort_keys: Option<bool> = kwargs.get("sort_keys")?;
    let separators: Option<Vec<String>> = kwargs.get("separators")?;
    let _: Option<bool> = kwargs.get("ensure_ascii")?;
    kwargs.assert_all_used()?;
    let (item, key) = match separators.as_deref() {
        Some([i, k]) => (i.clone(), k.clone()),
        Some(_) => return Err(TemplateError::new(ErrorKind::InvalidOperation, "tojson: separators takes two strings")),
        None if indent.is_some() => (",".to_string(), ": ".to_string()),
        None => (", ".to_string(), ": ".to_string()),
    };
    let mut out = String::new();
    let opts = Dumps { indent, item, key, sort_keys: sort_keys.unwrap_or(false) };
    dumps(value, &opts, 0, &mut out)?;
    Ok(Value::from_safe_string(out))
}

struct Dumps {
    indent: Option<usize>,
    item: String,
    key: String,
    sort_keys: bool,
}

fn dumps(v: &Value, o: &Dumps, depth: usize, out: &mut String) -> Result<(), TemplateError> {
    let newline = |out: &mut String, depth: usize| {
        if let Some(n) = o.indent {
            out.push('\n');
            out.extend(std::iter::repeat_n(' ', n * depth));
        }
    };
    match v.kind() {
        ValueKind::Undefined | ValueKind::None => out.push_str("null"),
        ValueKind::Bool => out.push_str(if v.is_true() { "true" } else { "false" }),
        ValueKind::Number => {
            // An integer as it is; a float (1.0 included) as Python's repr.
            if v.is_integer() {
                out.push_str(&v.to_string());
            } else {
                let f = f64::try_from(v.clone()).unwrap_or(f64::NAN);
                out.push_str(&python_float(f));
            }
        }
        ValueKind::String => json_string(v.as_str().unwrap_or_default(), out),
        ValueKind::Seq | ValueKind::Iterable => {
            let items: Vec<Value> = v.try_iter()?.collect();
            if items.is_empty() {
                out.push_str("[]");
                return Ok(());
            }
            out.push('[');
            for (i, item) in items.iter().enumerate() {
                if i > 0 {
                    out.push_str(&o.item);
                }
                newline(out, depth + 1);
                dumps(item, o, depth + 1, out)?;
            }
            newline(out, depth);
            out.push(']');
        }
        ValueKind::Map => {
            let mut keys: Vec<Value> = v.try_iter()?.collect();
            if o.sort_keys {
                keys.sort();
            }
            if keys.is_empty() {
                out.push_str("{}");
                return Ok(());
            }
            out.push('{');
            for (i, k) in keys.iter().enumerate() {
                if i > 0 {
                    out.push_str(&o.item);
                }
                newline(out, depth + 1);
                match k.as_str() {
                    Some(s) => json_string(s, out),
                    None => json_string(&k.to_string(), out),
                }
                out.push_str(&o.key);
                dumps(&v.get_item(k)?, o, depth + 1, out)?;
            }
            newline(out, depth);
            out.push('}');
        }
        _ => json_string(&v.to_string(), out),
    }
    Ok(())
}

/// A JSON string as Python writes it with `ensure_ascii=False`.
fn json_string(s: &str, out: &mut String) {
    out.push('"');
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            '\u{8}' => out.push_str("\\b"),
            '\u{c}' => out.push_str("\\f"),
            c if (c as u32) < 0x20 => out.push_str(&format!("\\u{:04x}", c as u32)),
            c => out.push(c),
        }
    }
    out.push('"');
}

/// A float as Python's `repr` writes it: `1.0`, `0.5`, `1e-05`, `1e+16`, `Infinity` in JSON.
fn python_float(f: f64) -> String {
    if f.is_nan() {
        return "NaN".into();
    }
    if f.is_infinite() {
        return if f > 0.0 { "Infinity".into() } else { "-Infinity".into() };
    }
    // Python switches to exponent form below 1e-4 and from 1e16; between, positional.
    let a = f.abs();
    if a != 0.0 && !(1e-4..1e16).contains(&a) {
        let s = format!("{f:e}");
        let (mantissa, exp) = s.split_once('e').unwrap_or((&s, "0"));
        let exp: i32 = exp.parse().unwrap_or(0);
        let sign = if exp < 0 { '-' } else { '+' };
        return format!("{mantissa}e{sign}{:02}", exp.abs());
    }
    let s = format!("{f:?}");
    if s.contains('.') || s.contains('e') {
        s
    } else {
        format!("{s}.0")
    }
}

/// `time.strftime(fmt)` for a UTC time: the directives chat templates use (`%Y %y %m %d %e %b
/// %B %a %A %H %I %M %S %p %j %%`); any other is written as it stands.
fn strftime(fmt: &str, unix_secs: u64) -> String {
    const MONTHS: [&str; 12] = [
        "January",
        "February",
        "March",
        "April",
        "May",
        "June",
        "July",
        "August",
        "September",
        "October",
        "November",
        "December",
    ];
    const DAYS: [&str; 7] = ["Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday"];
    let days = (unix_secs / 86_400) as i64;
    let secs = unix_secs % 86_400;
    let (y, m, d) = civil_from_days(days);
    // 1970-01-01 was a Thursday (index 3 from Monday).
    let weekday = ((days + 3).rem_euclid(7)) as usize;
    let yday = days - days_from_civil(y, 1, 1) + 1;
    let (hh, mm, ss) = (secs / 3600, secs / 60 % 60, secs % 60);
    let mut out = String::new();
    let mut chars = fmt.chars();
    while let Some(c) = chars.next() {
        if c != '%' {
            out.push(c);
            continue;
        }
        match chars.next() {
            Some('Y') => out.push_str(&y.to_string()),
            Some('y') => out.push_str(&format!("{:02}", y.rem_euclid(100))),
            Some('m') => out.push_str(&format!("{m:02}")),
            Some('d') => out.push_str(&format!("{d:02}")),
            Some('e') => out.push_str(&format!("{d:>2}")),
            Some('b') => out.push_str(&MONTHS[m as usize - 1][..3]),
            Some('B') => out.push_str(MONTHS[m as usize - 1]),
            Some('a') => out.push_str(&DAYS[weekday][..3]),
            Some('A') => out.push_str(DAYS[weekday]),
            Some('H') => out.push_str(&format!("{hh:02}")),
            Some('I') => out.push_str(&format!("{:02}", if hh % 12 == 0 { 12 } else { hh % 12 })),
            Some('M') => out.push_str(&format!("{mm:02}")),
            Some('S') => out.push_str(&format!("{ss:02}")),
            Some('p') => out.push_str(if hh < 12 { "AM" } else { "PM" }),
            Some('j') => out.push_str(&format!("{yday:03}")),
            Some('%') => out.push('%'),
            Some(other) => {
                out.push('%');
                out.push(other);
            }
            None => out.push('%'),
        }
    }
    out
}

/// The civil date (year, month 1-12, day 1-31) of a count of days since 1970-01-01.
fn civil_from_days(z: i64) -> (i64, u32, u32) {
    let z = z + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = (doy - (153 * mp + 2) / 5 + 1) as u32;
    let m = if mp < 10 { mp + 3 } else { mp - 9 } as u32;
    let y = yoe + era * 400 + i64::from(m <= 2);
    (y, m, d)
}

/// The days since 1970-01-01 of a civil date.
fn days_from_civil(y: i64, m: u32, d: u32) -> i64 {
    let y = if m <= 2 { y - 1 } else { y };
    let era = y.div_euclid(400);
    let yoe = y.rem_euclid(400);
    let mp = i64::from(if m > 2 { m - 3 } else { m + 9 });
    let doy = (153 * mp + 2) / 5 + i64::from(d) - 1;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    era * 146_097 + doe - 719_468
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn strftime_writes_the_directives_templates_use() {
        // 2024-07-26 13:05:09 UTC, a Friday, the 208th day of a leap year.
        let t = 1_722_000_000 - 1_722_000_000 % 86_400 + 13 * 3600 + 5 * 60 + 9;
        assert_eq!(strftime("%d %b %Y", t), "26 Jul 2024");
        assert_eq!(strftime("%A %B %e, %y %H:%M:%S %I%p %j %% %q", t), "Friday July 26, 24 13:05:09 01PM 208 % %q");
        assert_eq!(strftime("%Y-%m-%d %a", 0), "1970-01-01 Thu");
        assert_eq!(strftime("%Y-%m-%d", 951_782_400), "2000-02-29");
        for d in [-1000, 0, 59, 10_957, 20_000, 100_000] {
            let (y, m, dd) = civil_from_days(d);
            assert_eq!(days_from_civil(y, m, dd), d);
        }
    }

    #[test]
    fn floats_are_written_as_python_writes_them() {
        let cases = [
            (1.0, "1.0"),
            (0.5, "0.5"),
            (-2.25, "-2.25"),
            (1e-5, "1e-05"),
            (1.5e16, "1.5e+16"),
            (1e100, "1e+100"),
            (0.0001, "0.0001"),
            (123456789.0, "123456789.0"),
            (f64::INFINITY, "Infinity"),
        ];
        for (f, want) in cases {
            assert_eq!(python_float(f), want, "{f}");
        }
    }
}
