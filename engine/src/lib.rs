//! hearth's engine: runs any set of layer windows of a GGUF model (llama-like dense, MoE
//! and sliding-window architectures) on one device with llama.cpp's ggml kernels (through
//! `llama-cpp-sys-2`), weights zero-copy from the file's mmap or repacked as llama.cpp
//! repacks them; plus llama.cpp's tokenizer and samplers, the model's Jinja chat
//! template, embedding models (run whole by llama.cpp), and llama.cpp itself as the reference hearth is tested and benchmarked
//! against.
//!
//! It must not depend on the server, the network or OpenAI's JSON: callers hand it
//! token ids, hidden states and sequence ids, and get logits or hidden states back.

mod backend;
pub mod chat_template;
pub mod template_sandbox;
pub mod embedder;
mod error;
mod expert_reads;
mod ggml;
pub mod gguf;
mod graph;
pub mod kv_cache;
pub mod model;
pub mod model_file;
pub mod op_profile;
pub mod pipeline;
pub mod profiler;
pub mod random_model;
pub mod reference;
pub mod residency;
pub mod sampler;
pub mod stage;
pub mod tokenizer;
mod weights;

pub use error::{Error, Result};
pub use ggml::{accelerators, Accelerator, AcceleratorInfo};
pub use kv_cache::{CacheType, CacheTypes, SeqId};
pub use model::{Arch, ModelSpec};
pub use model_file::ModelFile;
pub use pipeline::LocalPipeline;
pub use stage::{BatchToken, Logits, Stage, StageConfig, StageInput, StageOutput};
