//! Embeddings through the HTTP API, in-process: the default chat model with a tiny random
//! embedding model beside it (`--embedding-model`). Every route's vectors equal llama.cpp's
//! own output of the same file pooled and normalised (whatever else shares the decode),
//! every input shape gives the same vector, and every bad input is a clear 400 in the
//! route's envelope. The real SDKs drive the same routes in tests/client_sdks.rs.

mod common;

use base64::Engine as _;
use engine::embedder::{normalize, Pooling};
use engine::reference::Reference;
use serde_json::{json, Value};

const KEY: &str = "emb-key";

struct Server {
    base: String,
    client: reqwest::Client,
}

impl Server {
    async fn start(arch: &str) -> Server {
        let model = common::tiny_embedding_model(arch).to_string_lossy().into_owned();
        let (base, _) = common::serve_in_process(&["--threads", "1", "--ctx-size", "512", "--parallel", "2", "--api-key", KEY, "--embedding-model", &model]).await;
        Server { base, client: reqwest::Client::new() }
    }

    async fn post(&self, path: &str, body: &Value) -> (u16, Value) {
        let r = self.client.post(format!("{}{path}", self.base)).bearer_auth(KEY).json(body).send().await.unwrap();
        (r.status().as_u16(), r.json().await.unwrap_or(Value::Null))
    }

    async fn get(&self, path: &str) -> Value {
        let r = self.client.get(format!("{}{path}", self.base)).bearer_auth(KEY).send().await.unwrap();
        assert_eq!(r.status(), 200);
        r.json().await.unwrap()
    }

    /// `/v1/embeddings` of `input`, as floats.
    async fn embed(&self, input: Value) -> Vec<Vec<f32>> {
        let (status, body) = self.post("/v1/embeddings", &json!({"model": id(), "input": input})).await;
        assert_eq!(status, 200, "{body}");
        floats(&body)
    }
}

fn id() -> &'static str {
    "tiny-embed-bert"
}

fn floats(body: &Value) -> Vec<Vec<f32>> {
    body["data"].as_array().unwrap().iter().enumerate().map(|(i, d)| {
        assert_eq!(d["index"], i);
        assert_eq!(d["object"], "embedding");
        d["embedding"].as_array().unwrap().iter().map(|x| x.as_f64().unwrap() as f32).collect()
    }).collect()
}

fn text() -> String {
    std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/../testdata/prima-cpp-excerpt.txt")).unwrap()
}

fn close(a: &[f32], b: &[f32]) -> bool {
    a.len() == b.len() && a.iter().zip(b).all(|(x, y)| (x - y).abs() <= 1e-4 + 1e-3 * y.abs())
}

/// llama.cpp's vector of `text`: its per-token output of the same file, mean-pooled and
/// normalised here.
fn reference(path: &std::path::Path, tokens: &[i32], pooling: Pooling) -> Vec<f32> {
    let r = Reference::load(path, 1).unwrap();
    let rows = r.token_embeddings(tokens).unwrap();
    let mut v: Vec<f32> = match pooling {
        Pooling::Mean => (0..rows[0].len()).map(|j| (rows.iter().map(|r| r[j] as f64).sum::<f64>() / rows.len() as f64) as f32).collect(),
        Pooling::Cls => rows[0].clone(),
        Pooling::Last => rows[rows.len() - 1].clone(),
    };
    normalize(&mut v);
    v
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn openai_embeddings_equal_llama_cpp_in_every_input_shape() {
    let s = Server::start("bert").await;
    let path = common::tiny_embedding_model("bert");
    let text = text();
    let words: Vec<&str> = text.split_whitespace().take(400).collect();
    // About 4.5 tokens a word in the tiny vocabulary: ~400 of the 512 tokens.
    let long = words[..90].join(" ");
    let texts = vec!["home".to_string(), words[..12].join(" "), long.clone(), words[300..320].join(" ")];

    let many = s.embed(json!(texts)).await;
    assert_eq!(many.len(), texts.len());
    let tok = engine::tokenizer::Tokenizer::load(&path).unwrap();
    for (t, v) in texts.iter().zip(&many) {
        let tokens = tok.tokenize_with(t, true, true);
        assert!(close(v, &reference(&path, &tokens, Pooling::Mean)), "`{}`: hearth's vector differs from llama.cpp's", &t[..t.len().min(40)]);
        let norm: f32 = v.iter().map(|x| x * x).sum::<f32>().sqrt();
        assert!((norm - 1.0).abs() < 1e-4, "not unit length: {norm}");
        // One string alone, and its tokens sent as ids, give the same vector.
        assert!(close(&s.embed(json!(t)).await[0], v));
        assert!(close(&s.embed(json!(tokens)).await[0], v));
    }
    let lists: Vec<Vec<i32>> = texts.iter().map(|t| tok.tokenize_with(t, true, true)).collect();
    let by_ids = s.embed(json!(lists)).await;
    for (a, b) in by_ids.iter().zip(&many) {
        assert!(close(a, b));
    }

    // base64: the little-endian f32 bytes of the same vector.
    let (status, b64) = s.post("/v1/embeddings", &json!({"input": texts[1], "encoding_format": "base64"})).await;
    assert_eq!(status, 200, "{b64}");
    let bytes = base64::engine::general_purpose::STANDARD.decode(b64["data"][0]["embedding"].as_str().unwrap()).unwrap();
    let decoded: Vec<f32> = bytes.chunks_exact(4).map(|c| f32::from_le_bytes(c.try_into().unwrap())).collect();
    assert!(close(&decoded, &many[1]));

    // dimensions: the first values, normalised again.
    let (status, short) = s.post("/v1/embeddings", &json!({"input": texts[1], "dimensions": 16})).await;
    assert_eq!(status, 200, "{short}");
    let mut want = many[1][..16].to_vec();
    normalize(&mut want);
    assert!(close(&floats(&short)[0], &want));

    // Usage counts the tokens, the model is named.
    let (_, body) = s.post("/v1/embeddings", &json!({"input": texts})).await;
    let n: usize = lists.iter().map(Vec::len).sum();
    assert_eq!(body["usage"]["prompt_tokens"], n);
    assert_eq!(body["usage"]["total_tokens"], n);
    assert_eq!(body["model"], id());
    assert_eq!(body["object"], "list");

    // Both models are listed, each with what it does.
    let models = s.get("/v1/models").await;
    let cards = models["data"].as_array().unwrap();
    assert_eq!(cards.len(), 2, "{models}");
    assert_eq!(cards[1]["id"], id());
    assert_eq!(cards[1]["capabilities"], json!(["embeddings"]));
    assert_eq!(cards[1]["context_length"], 512);
    assert!(cards[0]["capabilities"].as_array().unwrap().contains(&json!("chat")));
    assert_eq!(s.get(&format!("/v1/models/{}", id())).await["capabilities"], json!(["embeddings"]));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn embedding_refusals_are_clear_400s_in_each_envelope() {
    let s = Server::start("bert").await;
    let long: String = text().split_whitespace().take(700).collect::<Vec<_>>().join(" ");
    for (body, param, what) in [
        (json!({"input": ""}), "input", "empty"),
        (json!({"input": []}), "input", "at least one"),
        (json!({"input": ["a", ""]}), "input", "input[1] is empty"),
        (json!({"input": [[101, 99999, 102]]}), "input[0]", "outside"),
        (json!({"input": [-5]}), "input[0]", "outside"),
        (json!({"input": long}), "input", "maximum context length is 512"),
        (json!({"input": "a", "dimensions": 0}), "dimensions", "1 to 64"),
        (json!({"input": "a", "dimensions": 65}), "dimensions", "1 to 64"),
        (json!({"input": "a", "encoding_format": "int8"}), "encoding_format", "base64"),
    ] {
        let (status, err) = s.post("/v1/embeddings", &body).await;
        assert_eq!(status, 400, "{body} -> {err}");
        assert_eq!(err["error"]["param"], param, "{body} -> {err}");
        assert!(err["error"]["message"].as_str().unwrap().contains(what), "{body} -> {err}");
    }
    let (status, err) = s.post("/v1/embeddings", &json!({"input": "a", "model": "text-embedding-3-small"})).await;
    assert_eq!(status, 404, "{err}");
    assert_eq!(err["error"]["code"], "model_not_found");
    // No key, no vectors.
    let r = s.client.post(format!("{}/v1/embeddings", s.base)).json(&json!({"input": "a"})).send().await.unwrap();
    assert_eq!(r.status(), 401);
    // Ollama: its envelope; a long input is cut to fit unless truncate is false.
    let (status, err) = s.post("/api/embed", &json!({"model": id(), "input": long, "truncate": false})).await;
    assert_eq!(status, 400);
    assert!(err["error"].as_str().unwrap().contains("512"), "{err}");
    let (status, ok) = s.post("/api/embed", &json!({"model": id(), "input": long})).await;
    assert_eq!(status, 200, "{ok}");
    assert_eq!(ok["prompt_eval_count"], 512);
    let (status, err) = s.post("/api/embed", &json!({"model": "nomic-embed-text", "input": "a"})).await;
    assert_eq!(status, 404);
    assert!(err["error"].is_string(), "{err}");
    // The server still answers after all of them.
    assert_eq!(s.embed(json!("home")).await.len(), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ollama_embed_routes_and_listing() {
    let s = Server::start("bert").await;
    let texts = ["the memory of the home cluster", "a token", "layers"];
    let openai = s.embed(json!(texts)).await;
    let (status, body) = s.post("/api/embed", &json!({"model": format!("{}:latest", id()), "input": texts})).await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(body["model"], format!("{}:latest", id()));
    let vectors: Vec<Vec<f32>> = body["embeddings"].as_array().unwrap().iter().map(|v| v.as_array().unwrap().iter().map(|x| x.as_f64().unwrap() as f32).collect()).collect();
    for (a, b) in vectors.iter().zip(&openai) {
        assert!(close(a, b));
    }
    assert!(body["prompt_eval_count"].as_u64().unwrap() >= 3 * 3);
    // One string is one input.
    let (_, one) = s.post("/api/embed", &json!({"model": id(), "input": texts[0]})).await;
    assert_eq!(one["embeddings"].as_array().unwrap().len(), 1);
    // The older route: the pooled vector as it is, in the same direction.
    let (status, old) = s.post("/api/embeddings", &json!({"model": id(), "prompt": texts[0]})).await;
    assert_eq!(status, 200, "{old}");
    let mut raw: Vec<f32> = old["embedding"].as_array().unwrap().iter().map(|x| x.as_f64().unwrap() as f32).collect();
    let norm: f32 = raw.iter().map(|x| x * x).sum::<f32>().sqrt();
    assert!((norm - 1.0).abs() > 1e-3, "the older route is not normalised (norm {norm})");
    normalize(&mut raw);
    assert!(close(&raw, &openai[0]));
    let (_, empty) = s.post("/api/embeddings", &json!({"model": id(), "prompt": ""})).await;
    assert_eq!(empty["embedding"], json!([]));
    // Listed beside the chat model.
    let tags = s.get("/api/tags").await;
    let names: Vec<&str> = tags["models"].as_array().unwrap().iter().map(|m| m["name"].as_str().unwrap()).collect();
    assert_eq!(names.len(), 2, "{tags}");
    assert_eq!(names[1], format!("{}:latest", id()));
    assert_eq!(tags["models"][1]["capabilities"], json!(["embedding"]));
    assert_eq!(tags["models"][1]["details"]["family"], "bert");
    assert_eq!(tags["models"][1]["details"]["embedding_length"], 64);
    let (status, show) = s.post("/api/show", &json!({"model": id()})).await;
    assert_eq!(status, 200, "{show}");
    assert_eq!(show["capabilities"], json!(["embedding"]));
    assert_eq!(show["model_info"]["general.architecture"], "bert");
    assert_eq!(s.get("/api/ps").await["models"].as_array().unwrap().len(), 2);
}

/// Requests at once, with a chat generating beside them: each gets its own vectors, the same
/// as alone, and the chat its own answer.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_requests_share_decodes_and_keep_their_answers() {
    let s = std::sync::Arc::new(Server::start("bert").await);
    let words: Vec<String> = text().split_whitespace().map(str::to_string).collect();
    let inputs: Vec<Vec<String>> = (0..8).map(|i| (0..1 + i % 3).map(|j| words[i * 40 + j * 7..i * 40 + j * 7 + 5 + 9 * i].join(" ")).collect()).collect();
    let mut alone = Vec::new();
    for input in &inputs {
        alone.push(s.embed(json!(input)).await);
    }
    let chat = json!({"model": "", "messages": [{"role": "user", "content": "Name three planets."}], "max_tokens": 24, "temperature": 0});
    let (_, chat_alone) = s.post("/v1/chat/completions", &chat).await;
    let mut tasks = Vec::new();
    for input in inputs.clone() {
        let s = s.clone();
        tasks.push(tokio::spawn(async move { s.embed(json!(input)).await }));
    }
    let chat_task = {
        let (s, chat) = (s.clone(), chat.clone());
        tokio::spawn(async move { s.post("/v1/chat/completions", &chat).await })
    };
    for (task, want) in tasks.into_iter().zip(&alone) {
        let got = task.await.unwrap();
        assert_eq!(got.len(), want.len());
        for (a, b) in got.iter().zip(want) {
            assert!(close(a, b), "a request's vector changed when others shared its decode");
        }
    }
    let (status, chat_together) = chat_task.await.unwrap();
    assert_eq!(status, 200, "{chat_together}");
    assert_eq!(chat_together["choices"][0]["message"]["content"], chat_alone["choices"][0]["message"]["content"]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nomic_bert_and_last_token_embedders_serve_too() {
    for (arch, pooling) in [("nomic-bert", Pooling::Mean), ("qwen3", Pooling::Last)] {
        let path = common::tiny_embedding_model(arch);
        let model = path.to_string_lossy().into_owned();
        let (base, _) = common::serve_in_process(&["--threads", "1", "--ctx-size", "256", "--parallel", "1", "--embedding-model", &model]).await;
        let text = "Halda assigns the layers of the model to the devices of the home.";
        let r: Value = reqwest::Client::new().post(format!("{base}/v1/embeddings")).json(&json!({"input": text})).send().await.unwrap().json().await.unwrap();
        let got = &floats(&r)[0];
        let tok = engine::tokenizer::Tokenizer::load(&path).unwrap();
        let want = reference(&path, &tok.tokenize_with(text, true, true), pooling);
        assert!(close(got, &want), "{arch}: hearth's vector differs from llama.cpp's");
    }
}
