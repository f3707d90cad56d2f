//! The 2026 families served as a user serves them: tiny random models of Gemma 4 E2B/E4B's
//! block, DeepSeek's (V3.1's template) and Llama 4's with their own chat templates make a
//! required tool call, parsed into `tool_calls`, and take its result (Qwen3.5's is in
//! `recurrent.rs`, beside its other tests).

mod common;

/// Gemma 4 E2B/E4B's block (per-layer inputs, layers sharing K/V) with Gemma 4's template
/// (its own call syntax and quotes, the thought channel).
#[test]
fn gemma4_e_with_its_own_template_makes_a_required_tool_call_and_takes_its_result() {
    let dir = std::env::temp_dir().join(format!("hearth-families-gemma4-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let mut m = engine::random_model::RandomModel::new("gemma4", 6, 64, 128, 4, 2);
    (m.n_expert, m.n_expert_used, m.full_every, m.per_layer_embd, m.shared_kv_layers, m.n_swa) = (0, 0, 3, 32, 3, 8);
    let path = dir.join("gemma4-e.gguf");
    m.write(&common::default_model(), &path).unwrap();
    common::own_template_makes_a_required_tool_call_and_takes_its_result(&path, concat!(env!("CARGO_MANIFEST_DIR"), "/../testdata/gemma4-chat-template.jinja"), &[]);
    std::fs::remove_dir_all(&dir).ok();
}

/// DeepSeek's block (latent attention, routed and shared experts) with DeepSeek V3.1's
/// template (its tool-call tokens, `<think>`).
#[test]
fn deepseek2_with_its_own_template_makes_a_required_tool_call_and_takes_its_result() {
    let dir = std::env::temp_dir().join(format!("hearth-families-deepseek2-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let mut m = engine::random_model::RandomModel::new("deepseek2", 4, 64, 128, 4, 2);
    m.n_ff_exp = 64;
    let path = dir.join("deepseek2.gguf");
    m.write(&common::default_model(), &path).unwrap();
    common::own_template_makes_a_required_tool_call_and_takes_its_result(&path, concat!(env!("CARGO_MANIFEST_DIR"), "/../testdata/deepseek-v3.1-chat-template.jinja"), &[]);
    std::fs::remove_dir_all(&dir).ok();
}

/// Llama 4's block (NoPE layer, chunked attention, interleaved experts) with Llama 4's
/// template (tools in the first user message, calls as JSON with `parameters`, results
/// under `ipython`).
#[test]
fn llama4_with_its_own_template_makes_a_required_tool_call_and_takes_its_result() {
    let dir = std::env::temp_dir().join(format!("hearth-families-llama4-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let mut m = engine::random_model::RandomModel::new("llama4", 4, 64, 128, 4, 2);
    m.n_ff_exp = 64;
    let path = dir.join("llama4.gguf");
    m.write(&common::default_model(), &path).unwrap();
    common::own_template_makes_a_required_tool_call_and_takes_its_result(&path, concat!(env!("CARGO_MANIFEST_DIR"), "/../testdata/llama4-chat-template.jinja"), &[]);
    std::fs::remove_dir_all(&dir).ok();
}
