//! A GGUF without a chat template is served as llama-server serves it (completions always,
//! chat in llama.cpp's chatml fallback), and `--chat-template NAME|FILE` chooses another
//! format: one of llama.cpp's built-in templates, or a Jinja file, on such a model and on
//! one with a template of its own. Each rendering is checked by the prompt's token count
//! against the format written out by hand.

mod common;

use std::path::PathBuf;

use engine::gguf::{GgufFile, GgufWriter};
use engine::random_model::RandomModel;
use engine::tokenizer::Tokenizer;
use serde_json::{json, Value};

/// A tiny random llama with the default model's vocabulary and no `tokenizer.chat_template`
/// (as base models and many converted GGUFs are published), written once per process.
fn model_without_template() -> PathBuf {
    static PATH: std::sync::OnceLock<PathBuf> = std::sync::OnceLock::new();
    PATH.get_or_init(|| {
        let dir = std::env::temp_dir().join(format!("hearth-no-template-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let vocab = dir.join("vocab.gguf");
        let mut w = GgufWriter::from_meta(GgufFile::open(common::vocabulary_fixture()).unwrap().meta());
        assert!(w.remove("tokenizer.chat_template").is_some(), "the fixture has a template to remove");
        w.write_to(&vocab).unwrap();
        let mut m = RandomModel::new("llama", 2, 64, 128, 4, 4);
        m.context_length = 1024;
        let path = dir.join("base-model.gguf");
        m.write(&vocab, &path).unwrap();
        assert!(Tokenizer::load(&path).unwrap().chat_template_source().is_none());
        path
    })
    .clone()
}

async fn post(base: &str, path: &str, body: &Value) -> (u16, Value) {
    let r = reqwest::Client::new().post(format!("{base}{path}")).json(body).send().await.unwrap();
    (r.status().as_u16(), r.json().await.unwrap_or(Value::Null))
}

/// The prompt tokens of a one-message chat.
async fn prompt_tokens(base: &str, content: &str) -> u64 {
    let (status, body) = post(base, "/v1/chat/completions", &json!({"model": "", "messages": [{"role": "user", "content": content}], "max_tokens": 2, "temperature": 0})).await;
    assert_eq!(status, 200, "{body}");
    body["usage"]["prompt_tokens"].as_u64().unwrap()
}

fn count(model: &std::path::Path, text: &str) -> u64 {
    Tokenizer::load(model).unwrap().tokenize(text, true).len() as u64
}

const ARGS: [&str; 4] = ["--threads", "1", "--ctx-size", "512"];

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_model_without_a_chat_template_is_served_with_chatml() {
    let model = model_without_template();
    let (base, _) = common::serve_model_in_process(&model, &ARGS).await;
    // Completions take the raw prompt.
    let (status, body) = post(&base, "/v1/completions", &json!({"model": "", "prompt": "The cluster", "max_tokens": 4, "temperature": 0})).await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(body["usage"]["prompt_tokens"].as_u64().unwrap(), count(&model, "The cluster"));
    // Chat in llama.cpp's chatml.
    assert_eq!(prompt_tokens(&base, "Hi there").await, count(&model, "<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n"));
    // Tools are described in a system message and a required call is enforced.
    let tools = json!([{"type": "function", "function": {"name": "lights", "description": "Turn the lights on or off", "parameters": {"type": "object", "properties": {"on": {"type": "boolean"}}, "required": ["on"]}}}]);
    let (status, body) = post(&base, "/v1/chat/completions", &json!({"model": "", "messages": [{"role": "user", "content": "Lights off"}], "tools": tools, "tool_choice": "required", "max_tokens": 48, "temperature": 0})).await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(body["choices"][0]["message"]["tool_calls"][0]["function"]["name"], "lights", "{body}");
    // Ollama's clients see which template is used.
    let (status, show) = post(&base, "/api/show", &json!({"model": "base-model"})).await;
    assert_eq!(status, 200, "{show}");
    assert_eq!(show["template"], "chatml");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn chat_template_chooses_a_builtin_name_or_a_jinja_file() {
    let model = model_without_template();
    let (base, _) = common::serve_model_in_process(&model, &[&ARGS[..], &["--chat-template", "llama3"]].concat()).await;
    assert_eq!(prompt_tokens(&base, "Hi there").await, count(&model, "<|start_header_id|>user<|end_header_id|>\n\nHi there<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n"));

    let file = std::env::temp_dir().join(format!("hearth-template-{}.jinja", std::process::id()));
    std::fs::write(&file, "{% for m in messages %}[{{ m.role }}] {{ m.content }}\n{% endfor %}{% if add_generation_prompt %}[assistant] {% endif %}").unwrap();
    let (base, _) = common::serve_model_in_process(&model, &[&ARGS[..], &["--chat-template", file.to_str().unwrap()]].concat()).await;
    assert_eq!(prompt_tokens(&base, "Hi there").await, count(&model, "[user] Hi there\n[assistant] "));

    // A model's own template can be overridden too: SmolLM2's adds a system prompt,
    // chatml does not.
    let smol = common::default_model();
    let (own, _) = common::serve_model_in_process(&smol, &ARGS).await;
    let (chatml, _) = common::serve_model_in_process(&smol, &[&ARGS[..], &["--chat-template", "chatml"]].concat()).await;
    let want = count(&smol, "<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n");
    assert_eq!(prompt_tokens(&chatml, "Hi there").await, want);
    assert!(prompt_tokens(&own, "Hi there").await > want + 5);
}

#[test]
fn a_wrong_chat_template_is_refused_at_start_with_what_would_work() {
    let model = model_without_template();
    let err = common::build(&model, &[&ARGS[..], &["--chat-template", "llama9"]].concat()).err().expect("an unknown name").to_string();
    assert!(err.contains("llama9") && err.contains("chatml") && err.contains("mistral-v7"), "{err}");
    let bad = std::env::temp_dir().join(format!("hearth-bad-template-{}.jinja", std::process::id()));
    std::fs::write(&bad, "{% for m in messages %}").unwrap();
    let err = common::build(&model, &[&ARGS[..], &["--chat-template", bad.to_str().unwrap()]].concat()).err().expect("a broken file").to_string();
    assert!(err.contains("cannot parse"), "{err}");
}
