//! Process-wide llama.cpp/ggml initialisation. llama.cpp's backend may be initialised
//! once per process, yet the engine, the tokenizer and the reference model all need it,
//! so every entry point goes through `init()`. Its logs are routed to `tracing`.

use std::sync::OnceLock;

use llama_cpp_2::llama_backend::LlamaBackend;

static BACKEND: OnceLock<LlamaBackend> = OnceLock::new();

pub fn init() -> &'static LlamaBackend {
    BACKEND.get_or_init(|| {
        llama_cpp_2::send_logs_to_tracing(llama_cpp_2::LogOptions::default());
        LlamaBackend::init().expect("llama.cpp backend initialised twice outside hearth's OnceLock")
    })
}
