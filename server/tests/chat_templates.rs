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

/// Doubles a string forty times (a terabyte) in a handful of template steps: fuel does not
/// see it, only the renderer's memory bound does. `TRIGGER` is the text that sets it off:
/// empty for "always", a word for a template that is hostile to some inputs only.
fn doubling_template(trigger: &str) -> String {
    format!(
        "{{% set ns = namespace(s='x') %}}{{% for m in messages %}}{{% if '{trigger}' in m.content %}}{{% for i in range(40) %}}{{% set ns.s = ns.s ~ ns.s %}}{{% endfor %}}{{% endif %}}<|im_start|>{{{{ m.role }}}}\n{{{{ m.content }}}}<|im_end|>\n{{% endfor %}}{{% if add_generation_prompt %}}<|im_start|>assistant\n{{% endif %}}{{{{ ns.s | length }}}}"
    )
}

/// Three nested loops of 100,000 when a message holds `trigger`.
fn looping_template(trigger: &str) -> String {
    format!("{{% for m in messages %}}{{% if '{trigger}' in m.content %}}{{% for a in range(100000) %}}{{% for b in range(100000) %}}{{% for c in range(100000) %}}{{% endfor %}}{{% endfor %}}{{% endfor %}}{{% endif %}}[{{{{ m.role }}}}] {{{{ m.content }}}}\n{{% endfor %}}")
}

fn sandbox_config() -> engine::template_sandbox::SandboxConfig {
    engine::template_sandbox::SandboxConfig::for_input(PathBuf::from(env!("CARGO_BIN_EXE_hearth")), vec!["render-template".into()], 1 << 20)
}

fn write_template(name: &str, source: &str) -> PathBuf {
    let file = std::env::temp_dir().join(format!("hearth-{name}-{}.jinja", std::process::id()));
    std::fs::write(&file, source).unwrap();
    file
}

/// The sandbox (the hearth binary's `render-template` child) bounds a render's memory: a
/// string doubled forty times fails that render with a limit error while this process
/// lives on, and the next render gets a fresh child. Work is bounded there as in process.
#[test]
fn a_sandboxed_render_is_bounded_in_memory_and_the_next_one_works() {
    use engine::chat_template::ChatTemplate;
    let user = |text: &str| vec![json!({"role": "user", "content": text})];
    let t = ChatTemplate::isolated(&doubling_template("KABOOM"), "", "", sandbox_config()).unwrap();
    assert!(t.render(&user("hello"), None, true).unwrap().ends_with("assistant\n1"));
    for _ in 0..2 {
        let err = t.render(&user("say KABOOM"), None, true).unwrap_err();
        assert!(matches!(&err, engine::Error::TemplateLimit(m) if m.contains("memory bound")), "{err}");
        assert!(t.render(&user("hello again"), None, true).unwrap().contains("hello again"));
    }
    // A template doubling on every input is refused by the probe.
    let always = ChatTemplate::isolated(&doubling_template(""), "", "", sandbox_config()).unwrap();
    assert!(matches!(always.probe(), Err(engine::Error::TemplateLimit(_))));

    let t = ChatTemplate::isolated(&looping_template("KABOOM"), "", "", sandbox_config()).unwrap();
    let err = t.render(&user("KABOOM"), None, true).unwrap_err();
    assert!(matches!(&err, engine::Error::TemplateLimit(m) if m.contains("template steps")), "{err}");
    assert_eq!(t.render(&user("hi"), None, true).unwrap(), "[user] hi\n");

    // A broken template is refused with the parser's message, here and not in a child.
    assert!(ChatTemplate::isolated("{% for m in messages %}", "", "", sandbox_config()).err().unwrap().to_string().contains("cannot parse"));
}

/// Real templates (the default model's and every family's in testdata) render exactly the
/// same in the sandbox as in process: plain and marked, tools included.
#[test]
fn real_templates_render_the_same_in_the_sandbox() {
    use engine::chat_template::{probe_conversation, ChatTemplate};
    let tok = Tokenizer::load(common::vocabulary_fixture()).unwrap();
    let mut sources = vec![("smollm2".to_string(), tok.chat_template_source().unwrap())];
    for e in std::fs::read_dir(concat!(env!("CARGO_MANIFEST_DIR"), "/../testdata")).unwrap() {
        let p = e.unwrap().path();
        if p.extension().is_some_and(|x| x == "jinja") {
            sources.push((p.display().to_string(), std::fs::read_to_string(&p).unwrap()));
        }
    }
    let (messages, tools) = probe_conversation();
    for (name, source) in &sources {
        let here = ChatTemplate::new(source, &tok.bos_text(), &tok.eos_text()).unwrap();
        let there = ChatTemplate::isolated(source, &tok.bos_text(), &tok.eos_text(), sandbox_config()).unwrap();
        for (m, t) in [(&messages[..], Some(&tools)), (&messages[1..2], None)] {
            match (here.render(m, t, true), there.render(m, t, true)) {
                (Ok(a), Ok(b)) => assert_eq!(a, b, "{name}"),
                (Err(a), Err(b)) => assert_eq!(a.to_string(), b.to_string(), "{name}"),
                (a, b) => panic!("{name}: {a:?} in process, {b:?} in the sandbox"),
            }
            let tokens = |r: &engine::chat_template::RenderedChat| tok.tokenize_chat(r).unwrap();
            if let (Ok(a), Ok(b)) = (here.render_chat(m, t, true), there.render_chat(m, t, true)) {
                assert_eq!(a.text, b.text, "{name}");
                assert_eq!(tokens(&a), tokens(&b), "{name}");
            }
        }
    }
}

/// `hearth serve --chat-template FILE` with a template that blows its bounds on any
/// conversation does not start, and says which template.
#[test]
fn a_hostile_template_is_refused_at_start_with_its_name() {
    let model = model_without_template();
    for (name, source) in [("doubling", doubling_template("")), ("looping", looping_template(""))] {
        let file = write_template(name, &source);
        let err = common::build(&model, &[&ARGS[..], &["--chat-template", file.to_str().unwrap()]].concat()).err().expect("a hostile template").to_string();
        assert!(err.contains(file.to_str().unwrap()) && err.contains("refused") && err.contains("bounds"), "{err}");
    }
}

/// A template that is hostile only to some inputs (it explodes when a message holds a
/// marker word) answers those requests with a clear 400 in each API's envelope, while
/// ordinary requests sent at the same time and /health are answered and the server stays up.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_template_hostile_to_some_inputs_fails_those_requests_only() {
    let model = model_without_template();
    let file = write_template("trap", &doubling_template("KABOOM"));
    let (base, _) = common::serve_model_in_process(&model, &[&ARGS[..], &["--chat-template", file.to_str().unwrap()]].concat()).await;
    let chat = |text: &str| json!({"model": "", "messages": [{"role": "user", "content": text}], "max_tokens": 2, "temperature": 0});
    let hostile = [
        ("/v1/chat/completions", chat("KABOOM")),
        ("/v1/messages", json!({"model": "", "max_tokens": 2, "messages": [{"role": "user", "content": "KABOOM"}]})),
        ("/v1/messages/count_tokens", json!({"model": "", "messages": [{"role": "user", "content": "KABOOM"}]})),
        ("/api/chat", json!({"model": "base-model", "stream": false, "messages": [{"role": "user", "content": "KABOOM"}]})),
        ("/api/generate", json!({"model": "base-model", "stream": false, "prompt": "KABOOM"})),
        ("/v1/responses", json!({"model": "", "input": "KABOOM", "max_output_tokens": 2})),
    ];
    for round in 0..2 {
        let bad = hostile.iter().map(|(path, body)| {
            let base = base.clone();
            async move { (*path, post(&base, path, body).await) }
        });
        let good = (0..4).map(|i| {
            let base = base.clone();
            async move { post(&base, "/v1/chat/completions", &chat(&format!("hello {i}"))).await }
        });
        let health = async { reqwest::get(format!("{base}/health")).await.unwrap().status().as_u16() };
        let (bad, good, health) = tokio::join!(futures::future::join_all(bad), futures::future::join_all(good), health);
        assert_eq!(health, 200, "round {round}");
        for (status, body) in good {
            assert_eq!(status, 200, "round {round}: {body}");
        }
        for (path, (status, body)) in bad {
            assert_eq!(status, 400, "{path}: {body}");
            let message = match path {
                "/v1/messages" | "/v1/messages/count_tokens" => {
                    assert_eq!(body["error"]["type"], "invalid_request_error", "{path}: {body}");
                    body["error"]["message"].as_str().unwrap().to_string()
                }
                "/api/chat" | "/api/generate" => body["error"].as_str().unwrap().to_string(),
                _ => {
                    assert_eq!(body["error"]["code"], "chat_template_limit", "{path}: {body}");
                    body["error"]["message"].as_str().unwrap().to_string()
                }
            };
            assert!(message.contains("chat template") && message.contains("memory bound"), "{path}: {message}");
        }
    }
    assert_eq!(post(&base, "/v1/chat/completions", &chat("still here?")).await.0, 200);
}
