//! The front's tokenization against Hugging Face's: `data/tokenize/expected.json` holds what
//! Hugging Face's Python `tokenizers` and Jinja2 (in the environment `apply_chat_template` sets)
//! made of `data/tokenize/cases.json` with the tiny model's tokenizer (`data/tokenize/tiny`) and a
//! corpus of chat templates in the styles of the model families (`data/tokenize/templates`);
//! `scripts/tokenizer/make.sh` remakes it. Every text and every token id must be the same here.
//! Then the front routes text prompts and chat messages by the tokens the engine sees.

use std::path::{Path, PathBuf};

use kv_router::tokenize::{Prompt, SpecialTokens, TokenizeError, Tokenizer};

fn data() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/data/tokenize")
}

fn expected() -> serde_json::Value {
    let text = std::fs::read_to_string(data().join("expected.json")).unwrap();
    serde_json::from_str(&text).unwrap()
}

fn ids(v: &serde_json::Value) -> Vec<u64> {
    v.as_array().unwrap().iter().map(|i| i.as_u64().unwrap()).collect()
}

#[test]
fn the_tiny_tokenizer_encodes_as_hugging_face_does() {
    let t = Tokenizer::from_dir(&data().join("tiny")).unwrap();
    let cases = expected()["encode"].as_array().unwrap().clone();
    assert_eq!(cases.len(), 9);
    for c in &cases {
        let text = c["text"].as_str().unwrap();
        let add = c["add_special_tokens"].as_bool().unwrap();
        assert_eq!(t.encode(text, add).unwrap(), ids(&c["ids"]), "{text:?} (add_special_tokens {add})");
    }
    // The post-processor puts <s> (id 0) in front only with the special tokens.
    assert_eq!(ids(&cases[0]["ids"])[0], 0);
    assert_eq!(ids(&cases[0]["ids"])[1..], ids(&cases[1]["ids"])[..]);
    assert_eq!(
        t.special_tokens(),
        &SpecialTokens {
            bos_token: Some("<s>".into()),
            eos_token: Some("<|im_end|>".into()),
            unk_token: Some("<unk>".into()),
            pad_token: Some("<pad>".into()),
        }
    );
    assert!(t.has_chat_template());
}

/// A chat case of expected.json, its request as written (maps in their order).
#[derive(serde::Deserialize)]
struct ChatCase {
    name: String,
    template: String,
    request: Box<serde_json::value::RawValue>,
    text: Option<String>,
    ids: Option<Vec<u64>>,
    error: Option<String>,
}

#[test]
fn every_template_of_the_corpus_renders_and_encodes_as_hugging_face_does() {
    #[derive(serde::Deserialize)]
    struct Expected {
        chat: Vec<ChatCase>,
    }
    let text = std::fs::read_to_string(data().join("expected.json")).unwrap();
    let cases = serde_json::from_str::<Expected>(&text).unwrap().chat;
    assert_eq!(cases.len(), 12);
    let (mut rendered, mut refused) = (0, 0);
    for c in &cases {
        let name = &c.name;
        let template = std::fs::read_to_string(data().join("templates").join(&c.template)).unwrap();
        let t = Tokenizer::from_dir(&data().join("tiny")).unwrap().with_chat_template(&template).unwrap();
        let request = c.request.get();
        match &c.error {
            Some(error) => {
                let got = t.render_chat(request).unwrap_err();
                assert!(
                    matches!(&got, TokenizeError::Template(m) if m.contains(error.as_str())),
                    "{name}: {got} (want {error:?})"
                );
                refused += 1;
            }
            None => {
                assert_eq!(Some(t.render_chat(request).unwrap()), c.text, "{name}");
                assert_eq!(Some(t.tokens(&Prompt::Chat(request.to_string())).unwrap()), c.ids, "{name}");
                rendered += 1;
            }
        }
    }
    assert_eq!((rendered, refused), (10, 2));
}

#[test]
fn requests_give_their_prompts_as_vllm_reads_them() {
    let of = |path: &str, body: &str| Prompt::of(path, body.as_bytes());
    assert_eq!(of("/v1/completions", r#"{"prompt": [1, 2, 3]}"#).unwrap(), Prompt::Ids(vec![1, 2, 3]));
    assert_eq!(of("/v1/completions", r#"{"prompt": [[4, 5], [6]]}"#).unwrap(), Prompt::Ids(vec![4, 5]));
    assert_eq!(
        of("/v1/completions", r#"{"prompt": "hi"}"#).unwrap(),
        Prompt::Text { text: "hi".into(), add_special_tokens: true }
    );
    assert_eq!(
        of("/v1/completions", r#"{"prompt": ["a", "b"], "add_special_tokens": false}"#).unwrap(),
        Prompt::Text { text: "a".into(), add_special_tokens: false }
    );
    let chat = r#"{"messages": [{"role": "user", "content": "x"}]}"#;
    assert!(matches!(of("/v1/chat/completions", chat).unwrap(), Prompt::Chat(_)));
    assert!(matches!(of("/v1/completions", r#"{"prompt": [1, -2]}"#), Err(TokenizeError::NoPrompt)));
    assert!(matches!(of("/v1/completions", r#"{"model": "m"}"#), Err(TokenizeError::NoPrompt)));
    assert!(matches!(of("/v1/chat/completions", r#"{"prompt": "x"}"#), Err(TokenizeError::NoPrompt)));
    assert!(matches!(of("/v1/completions", "not json"), Err(TokenizeError::Body(_))));
}

#[test]
fn chat_requests_are_rendered_with_vllms_message_rules() {
    let template = "{% for m in messages %}[{{ m.role }}|{{ m.content }}|{{ m.tool_calls | tojson }}|{{ m.extra is defined }}]{% endfor %}{% if add_generation_prompt %}+{% endif %}";
    let t = Tokenizer::from_dir(&data().join("tiny")).unwrap().with_chat_template(template).unwrap();
    let req = r#"{"messages": [
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "image_url", "image_url": {"url": "x"}}, {"type": "text", "text": "b"}], "extra": 1},
        {"role": "assistant", "content": null, "tool_calls": [{"id": "1", "type": "function", "function": {"name": "f", "arguments": "{\"k\": [1, 2]}"}}, {"id": "2", "type": "function", "function": {"name": "g", "arguments": ""}}]},
        {"role": "assistant", "content": "c", "tool_calls": []}
    ]}"#;
    assert_eq!(
        t.render_chat(req).unwrap(),
        concat!(
            "[user|a\nb|null|False]",
            r#"[assistant||[{"id": "1", "type": "function", "function": {"name": "f", "arguments": {"k": [1, 2]}}}, {"id": "2", "type": "function", "function": {"name": "g", "arguments": {}}}]|False]"#,
            "[assistant|c|null|False]+"
        )
    );
    // Continuing the final message: no generation prompt, and the text ends with its content.
    let cont = req.replacen('{', r#"{"continue_final_message": true, "#, 1);
    assert_eq!(t.render_chat(&cont).unwrap().rsplit_once("[assistant|").unwrap().1, "c");
    // A template's own error is the request's.
    let bad =
        Tokenizer::from_dir(&data().join("tiny")).unwrap().with_chat_template("{{ raise_exception('no') }}").unwrap();
    assert!(matches!(bad.render_chat(req), Err(TokenizeError::Template(m)) if m.contains("no")));
    assert!(matches!(
        Tokenizer::from_dir(&data().join("tiny")).unwrap().with_chat_template("{% if %}"),
        Err(TokenizeError::Template(_))
    ));
}

#[test]
fn a_missing_or_broken_model_directory_is_a_clear_error() {
    let dir = tempfile::tempdir().unwrap();
    let e = Tokenizer::from_dir(dir.path()).unwrap_err();
    assert!(e.to_string().starts_with(&dir.path().join("tokenizer.json").display().to_string()), "{e}");
    std::fs::copy(data().join("tiny/tokenizer.json"), dir.path().join("tokenizer.json")).unwrap();
    // No tokenizer_config.json: a tokenizer without a chat template.
    let t = Tokenizer::from_dir(dir.path()).unwrap();
    assert!(!t.has_chat_template());
    assert!(matches!(t.render_chat(r#"{"messages": []}"#), Err(TokenizeError::NoTemplate)));
    // chat_template.jinja is read when the config names none.
    std::fs::write(dir.path().join("chat_template.jinja"), "{{ messages | length }}").unwrap();
    let t = Tokenizer::from_dir(dir.path()).unwrap();
    assert_eq!(t.render_chat(r#"{"messages": [{"role": "user", "content": "x"}]}"#).unwrap(), "1");
    std::fs::write(dir.path().join("tokenizer_config.json"), "{not json").unwrap();
    let e = Tokenizer::from_dir(dir.path()).unwrap_err();
    assert!(e.to_string().contains("tokenizer_config.json"), "{e}");
    std::fs::write(dir.path().join("tokenizer_config.json"), r#"{"chat_template": "{% for %}"}"#).unwrap();
    assert!(matches!(Tokenizer::from_dir(dir.path()), Err(TokenizeError::Load { .. })));
}
