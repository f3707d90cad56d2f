//! `hearth serve`: the head node. Turns the flags into the runtime's and the API's
//! settings, loads the model (fetching the default one on first use), starts the head and
//! serves the OpenAI API until SIGTERM or Ctrl-C; then it stops taking requests and lets
//! running ones finish.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use engine::chat_template::ChatTemplate;
use engine::template_sandbox::SandboxConfig;
use engine::tokenizer::Tokenizer;

use crate::cli::{ServeArgs, DEFAULT_RING_LISTEN};
use crate::http::server::{serve_api, ConnectionLimits};
use crate::http::{self, AppState};
use crate::process::{http_runtime, now_secs, shutdown_signal};
use crate::runtime::ring::{cluster_secret, hop_delay, SecretUser};
use crate::runtime::{Head, HeadConfig, RingSetup, Runtime, Speculation};

pub fn run(args: ServeArgs) -> Result<(), Box<dyn std::error::Error>> {
    // Built before the runtime runs: forming a ring blocks on its own runtime.
    let (state, addr) = build(&args)?;
    let rt = http_runtime()?;
    rt.block_on(async move {
        let listener = tokio::net::TcpListener::bind(addr).await.map_err(|e| format!("cannot listen on {addr}: {e}"))?;
        let signal = shutdown_signal()?;
        let shutdown = async move {
            signal.await;
            tracing::info!("shutting down: finishing running requests");
        };
        tracing::info!("hearth listening on http://{}", listener.local_addr()?);
        let runtime = state.runtime.clone();
        serve_api(listener, http::router(state), connection_limits(&args), shutdown).await;
        tokio::task::spawn_blocking(move || runtime.shutdown()).await?;
        Ok::<(), Box<dyn std::error::Error>>(())
    })
}

/// What the API tells clients of the model (Ollama's tags and show).
fn model_facts(file: &engine::ModelFile) -> crate::http::ModelFacts {
    crate::http::ModelFacts { digest: file.fingerprint(), ..gguf_facts(&file.gguf, &file.spec.arch_name, file.spec.n_ctx_train, file.spec.n_embd) }
}

/// [`model_facts`] of any GGUF (an embedding model's architecture may be one the engine
/// does not run).
fn gguf_facts(gguf: &engine::gguf::GgufFile, arch: &str, context_length: usize, embedding_length: usize) -> crate::http::ModelFacts {
    let tensors = gguf.meta().tensors();
    let file_type = gguf.meta().get_u64("general.file_type").and_then(|t| engine::reference::file_type_name(t as u32));
    crate::http::ModelFacts {
        arch: arch.to_string(),
        parameters: tensors.iter().map(|t| t.n_elements()).sum(),
        weight_bytes: tensors.iter().map(|t| t.n_bytes).sum(),
        quantization: file_type.map(str::to_uppercase).unwrap_or_default(),
        context_length,
        embedding_length,
        digest: String::new(),
    }
}

/// `--embedding-model`: loaded, its thread started, its facts read.
fn embeddings(args: &ServeArgs, threads: usize) -> Result<Option<Arc<crate::http::Embeddings>>, Box<dyn std::error::Error>> {
    let Some(path) = &args.embedding_model else { return Ok(None) };
    let config = engine::embedder::EmbedderConfig {
        threads,
        ctx_size: args.embedding_ctx_size.filter(|&n| n > 0),
        pooling: args.embedding_pooling.as_deref().and_then(engine::embedder::Pooling::parse),
    };
    let id = path.file_stem().map(|s| s.to_string_lossy().into_owned()).unwrap_or_else(|| "embedding".into());
    let service = crate::runtime::embeddings::EmbeddingService::load(id, path, &config).map_err(|e| format!("--embedding-model {}: {e}", path.display()))?;
    let gguf = engine::gguf::GgufFile::open(path)?;
    let m = &service.model;
    let n_ctx_train = gguf.meta().get_u64(&format!("{}.context_length", m.arch)).unwrap_or(m.n_ctx as u64) as usize;
    let facts = crate::http::ModelFacts { digest: engine::model_file::fingerprint_of(&gguf), ..gguf_facts(&gguf, &m.arch, n_ctx_train, m.dims) };
    tracing::info!("embedding model {} ({}, {} values, {} pooling, {} tokens per input)", m.id, m.arch, m.dims, m.pooling.name(), m.n_ctx);
    Ok(Some(Arc::new(crate::http::Embeddings { service, facts })))
}

/// The chat template `--chat-template` names (a Jinja file, else a built-in name), or the
/// model's own, or llama-server's fallback for a GGUF without one: such a model is served
/// (completions always, chat in the fallback's format) rather than refused. A Jinja template
/// renders in sandboxed child processes (`engine::template_sandbox`) and must render a probe
/// conversation within its bounds, or the server does not start: its name is in the error.
pub fn chat_template(args: &ServeArgs, model: &std::path::Path, tokenizer: &Tokenizer) -> Result<ChatTemplate, Box<dyn std::error::Error>> {
    let jinja = |source: &str, name: &str| -> Result<ChatTemplate, Box<dyn std::error::Error>> {
        let config = SandboxConfig::for_input(template_renderer(args.template_renderer.as_deref()), vec!["render-template".into()], args.body_limit);
        let template = ChatTemplate::isolated(source, &tokenizer.bos_text(), &tokenizer.eos_text(), config).map_err(|e| format!("{name}: {e}"))?;
        template.probe().map_err(|e| format!("{name} is refused: it cannot render a short probe conversation within its bounds, so every chat would fail or hang ({e})"))?;
        Ok(template)
    };
    match args.chat_template.as_deref().filter(|c| !c.is_empty()) {
        Some(c) if std::path::Path::new(c).is_file() => {
            let source = std::fs::read_to_string(c).map_err(|e| format!("--chat-template {c}: {e}"))?;
            jinja(&source, &format!("the chat template --chat-template {c}"))
        }
        Some(name) => Ok(ChatTemplate::builtin(name).map_err(|e| format!("--chat-template: {e}"))?),
        None => match tokenizer.chat_template_source() {
            Some(source) => jinja(&source, &format!("the chat template of {} (tokenizer.chat_template)", model.display())),
            None => {
                tracing::warn!(
                    "the model has no chat template (tokenizer.chat_template): chat is formatted as {} (choose another with --chat-template NAME|FILE); /v1/completions takes raw prompts",
                    engine::chat_template::FALLBACK_TEMPLATE
                );
                Ok(ChatTemplate::builtin(engine::chat_template::FALLBACK_TEMPLATE)?)
            }
        },
    }
}

/// The program whose `render-template` subcommand renders chat templates: `--template-renderer`,
/// else this binary. A test harness that serves in process is not hearth; cargo builds it in
/// `deps/` beside the folder that holds the hearth binary, which is used then.
fn template_renderer(flag: Option<&std::path::Path>) -> std::path::PathBuf {
    if let Some(p) = flag {
        return p.to_path_buf();
    }
    let exe = std::env::current_exe().unwrap_or_else(|_| "hearth".into());
    if exe.parent().and_then(|d| d.file_name()).is_some_and(|n| n == "deps") {
        let beside = exe.parent().and_then(std::path::Path::parent).map(|d| d.join(format!("hearth{}", std::env::consts::EXE_SUFFIX)));
        if let Some(bin) = beside.filter(|b| b.is_file()) {
            return bin;
        }
    }
    // The running binary itself even after an upgrade replaced the file: a renderer of the
    // same build.
    #[cfg(target_os = "linux")]
    if std::path::Path::new("/proc/self/exe").exists() {
        return "/proc/self/exe".into();
    }
    exe
}

/// `--max-connections`, `--max-console-streams` and `--header-timeout`.
pub fn connection_limits(args: &ServeArgs) -> ConnectionLimits {
    ConnectionLimits { max_connections: args.max_connections.max(1), max_streams: args.max_console_streams.max(1), header_timeout: Duration::from_secs(args.header_timeout.max(1)) }
}

/// Everything `serve` needs before it listens; also used by `bench-serve` and the
/// in-process tests.
pub fn build(args: &ServeArgs) -> Result<(Arc<AppState>, SocketAddr), Box<dyn std::error::Error>> {
    crate::metrics::install();
    let addr: SocketAddr = format!("{}:{}", args.host, args.port).parse().map_err(|e| format!("invalid --host/--port: {e}"))?;
    // Checked before the model loads: a typo fails at once.
    let web = http::WebPolicy::new(&args.allowed_hosts, &args.cors_origins)?;
    let cfg = head_config(args)?;
    let tokenizer = Arc::new(Tokenizer::load(&cfg.model)?);
    let template = chat_template(args, &cfg.model, &tokenizer)?;
    let embeddings = embeddings(args, cfg.threads)?;
    let head = Head::start(&cfg, tokenizer.clone())?;
    let model_id = args.model_alias.clone().unwrap_or_else(|| cfg.model.file_stem().map(|s| s.to_string_lossy().into_owned()).unwrap_or_else(|| "model".into()));
    let file = engine::ModelFile::open(&cfg.model)?;
    let arch = file.spec.arch_name.clone();
    let facts = model_facts(&file);
    let state = Arc::new(AppState {
        limits: openapi::Limits { max_n: head.parallel() as u32, ..Default::default() },
        runtime: Arc::new(head),
        tokenizer,
        template_knows_tools: template.knows_tools(),
        reasoning: crate::http::reasoning::ReasoningFormat::detect(template.source()),
        template,
        fingerprint: format!("hearth-{}-{arch}", env!("CARGO_PKG_VERSION")),
        model_id,
        created: now_secs(),
        api_key: args.api_key.clone().filter(|k| !k.is_empty()),
        admin_key: args.admin_key.clone().filter(|k| !k.is_empty()),
        body_limit: args.body_limit,
        facts,
        responses: Default::default(),
        embeddings,
        web,
        endless: http::server::EndlessStreams::new(args.max_console_streams.max(1)),
    });
    Ok((state, addr))
}

/// The head's settings from the flags: where speculation's drafts come from is decided
/// here, once.
pub fn head_config(args: &ServeArgs) -> Result<HeadConfig, Box<dyn std::error::Error>> {
    let speculation = match (args.spec_mode.as_deref(), &args.draft_model) {
        (Some("ngram"), _) => Some(Speculation::Ngram),
        (Some("draft") | None, Some(draft)) => Some(Speculation::Draft(draft.clone())),
        (Some("draft"), None) => return Err("--spec-mode draft needs --draft-model PATH".into()),
        _ => None,
    };
    Ok(HeadConfig {
        model: args.model.resolve()?,
        parallel: args.parallel,
        queue: args.queue_size,
        max_batch: args.max_batch,
        n_ctx_seq: args.ctx_size,
        threads: args.threads.unwrap_or_else(engine::stage::default_threads),
        speculation,
        spec_tokens: args.spec_tokens,
        batch_invariant: args.batch_invariant,
        repack: !args.no_repack,
        kv: args.kv.types(),
        prompt_cache: args.prompt_cache.config(),
        ring: ring_setup(args)?,
        gpu_layers: {
            let p = crate::runtime::GpuPlacement { layers: args.gpu_layers, experts_in_ram: args.experts_in_ram };
            p.layers.check()?;
            p
        },
    })
}

fn ring_setup(args: &ServeArgs) -> Result<Option<RingSetup>, Box<dyn std::error::Error>> {
    let discovery = args.discovery.port(args.cluster_secret.as_deref());
    if args.workers.is_empty() && discovery.is_none() {
        return Ok(None);
    }
    // Workers that join by discovery are on the LAN: the last one must reach the head.
    let ring_listen = match discovery {
        Some(_) if args.ring_listen == DEFAULT_RING_LISTEN => "0.0.0.0:0",
        _ => args.ring_listen.as_str(),
    };
    // A ring's secret, or loopback-only without one: every address must allow it.
    let mut secret = None;
    for w in args.workers.iter().map(String::as_str).chain(std::iter::once(ring_listen)) {
        secret = Some(cluster_secret(args.cluster_secret.as_deref(), w, SecretUser::Head)?);
    }
    let listen: SocketAddr = ring_listen.parse().map_err(|e| format!("invalid --ring-listen {ring_listen}: {e}"))?;
    // Without it, a head listening on every interface tells the last worker its address on
    // the route to that worker.
    let advertise = args.ring_advertise.as_deref().filter(|a| !a.is_empty()).map(str::to_string);
    Ok(Some(RingSetup {
        workers: args.workers.clone(),
        secret: secret.expect("the ring listener's address at least"),
        listen,
        advertise,
        windows: (!args.windows.is_empty()).then(|| args.windows.clone()),
        strategy: args.plan_strategy.parse()?,
        f16: args.f16_activations,
        step_timeout: Duration::from_secs(args.ring_timeout.max(1)),
        member_grace: Duration::from_secs(args.member_grace),
        prefetch: !args.no_prefetch,
        startup_wait: Duration::from_secs(args.ring_wait),
        replan_idle: (args.replan_idle > 0).then(|| Duration::from_secs(args.replan_idle)),
        hop_delay: hop_delay(args.lab.hop.emulate_hop_ms),
        release: args.lab.release_windows.then_some(true),
        micro_batches: args.micro_batches.count(),
        prompt_chunk: args.lab.prompt_chunk,
        discovery,
    }))
}
