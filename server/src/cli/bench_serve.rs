//! `hearth bench-serve`: load on the HTTP API. Starts the server in-process, then runs
//! 1, 4 and 8 (by default) concurrent streaming clients and prints aggregate generated
//! tokens/s, time to first token and time per output token (p50/p99) per level, next to
//! the engine's own single-sequence decode time measured in the same run.

use std::sync::Arc;
use std::time::{Duration, Instant};

use engine::{LocalPipeline, ModelFile, Stage, StageConfig};
use futures::StreamExt;
use serde_json::{json, Value};

use clap::Parser;

use crate::cli::BenchServeArgs;

/// One streamed request's timings.
struct Sample {
    ttft: Duration,
    tpot: Option<Duration>,
    tokens: usize,
}

pub fn run(args: BenchServeArgs) -> Result<(), Box<dyn std::error::Error>> {
    let path = args.model.resolve()?;
    let threads = args.threads.unwrap_or_else(engine::stage::default_threads);
    let levels: Vec<usize> = args.clients.clone();
    let parallel = levels.iter().copied().max().unwrap_or(1);
    let engine_one = engine_decode_rate(&path, threads, args.max_tokens, 1)?;
    let engine_all = engine_decode_rate(&path, threads, args.max_tokens, parallel)?;
    let engine_tpot = Duration::from_secs_f64(1.0 / engine_one);
    // The flags a user would pass, so every other setting keeps its real default.
    let (threads_flag, parallel_flag) = (threads.to_string(), parallel.to_string());
    let path_flag = path.to_string_lossy().into_owned();
    let flags = ["hearth", "serve", "--model", &path_flag, "--port", "0", "--threads", &threads_flag, "--ctx-size", "1024", "--parallel", &parallel_flag];
    let serve = match crate::cli::Cli::try_parse_from(flags)?.command {
        crate::cli::Command::Serve(serve) => serve,
        _ => unreachable!("parsed a serve command"),
    };
    let rt = crate::process::http_runtime()?;
    rt.block_on(async move {
        let (state, addr) = crate::cli::serve::build(&serve)?;
        let listener = tokio::net::TcpListener::bind(addr).await?;
        let url = format!("http://{}/v1/chat/completions", listener.local_addr()?);
        let limits = crate::cli::serve::connection_limits(&serve);
        tokio::spawn(crate::http::server::serve_api(listener, crate::http::router(state), limits, std::future::pending()));
        let client = reqwest::Client::new();
        println!("model: {}, threads: {threads}, {} tokens per request, {} requests per client", path.display(), args.max_tokens, args.requests);
        println!("engine alone (no HTTP): 1 sequence {engine_one:.1} tokens/s ({:.2} ms/token); {parallel} sequences batched {engine_all:.1} tokens/s ({:.2}x)", engine_tpot.as_secs_f64() * 1e3, engine_all / engine_one);
        println!();
        println!("| clients | tokens/s | x 1 client | TTFT p50 ms | TTFT p99 ms | TPOT p50 ms | TPOT p99 ms | TPOT p50 / engine |");
        println!("|--------:|---------:|-----------:|------------:|------------:|------------:|------------:|------------------:|");
        let mut single = None;
        for &c in &levels {
            let start = Instant::now();
            let tasks: Vec<_> = (0..c)
                .map(|i| {
                    let (client, url) = (client.clone(), url.clone());
                    let (n, max_tokens) = (args.requests, args.max_tokens);
                    tokio::spawn(async move {
                        let mut out = Vec::new();
                        for r in 0..n {
                            out.push(one_request(&client, &url, (i * 1000 + r) as u64, max_tokens).await?);
                        }
                        Ok::<_, String>(out)
                    })
                })
                .collect();
            let mut samples = Vec::new();
            for t in tasks {
                samples.extend(t.await.map_err(|e| e.to_string())??);
            }
            let wall = start.elapsed().as_secs_f64();
            let tokens: usize = samples.iter().map(|s| s.tokens).sum();
            let tps = tokens as f64 / wall;
            let base = *single.get_or_insert(tps);
            let mut ttft: Vec<f64> = samples.iter().map(|s| s.ttft.as_secs_f64() * 1e3).collect();
            let mut tpot: Vec<f64> = samples.iter().filter_map(|s| s.tpot).map(|d| d.as_secs_f64() * 1e3).collect();
            let tpot50 = percentile(&mut tpot, 0.5);
            println!(
                "| {c:>7} | {tps:>8.1} | {:>9.2}x | {:>11.1} | {:>11.1} | {:>11.2} | {:>11.2} | {:>16.3}x |",
                tps / base,
                percentile(&mut ttft, 0.5),
                percentile(&mut ttft, 0.99),
                tpot50,
                percentile(&mut tpot, 0.99),
                tpot50 / (engine_tpot.as_secs_f64() * 1e3)
            );
        }
        Ok::<(), Box<dyn std::error::Error>>(())
    })
}

async fn one_request(client: &reqwest::Client, url: &str, seed: u64, max_tokens: usize) -> Result<Sample, String> {
    let body = json!({
        "model": "",
        "messages": [{"role": "user", "content": "Write a long story about a lighthouse keeper and the sea."}],
        "max_tokens": max_tokens,
        "temperature": 0.8,
        "seed": seed,
        "stream": true,
        "stream_options": {"include_usage": true}
    });
    let sent = Instant::now();
    let resp = client.post(url).json(&body).send().await.map_err(|e| e.to_string())?;
    if !resp.status().is_success() {
        return Err(format!("HTTP {}", resp.status()));
    }
    let mut stream = resp.bytes_stream();
    let (mut first, mut last, mut tokens, mut buf) = (None, None, 0usize, String::new());
    while let Some(chunk) = stream.next().await {
        buf.push_str(&String::from_utf8_lossy(&chunk.map_err(|e| e.to_string())?));
        while let Some(end) = buf.find("\n\n") {
            let event: String = buf.drain(..end + 2).collect();
            let Some(data) = event.trim().strip_prefix("data: ") else { continue };
            let Ok(v) = serde_json::from_str::<Value>(data) else { continue };
            if v["choices"][0]["delta"]["content"].as_str().is_some_and(|c| !c.is_empty()) {
                let now = Instant::now();
                first.get_or_insert(now);
                last = Some(now);
            }
            if let Some(n) = v["usage"]["completion_tokens"].as_u64() {
                tokens = n as usize;
            }
        }
    }
    let first = first.ok_or("no content came back")?;
    let tpot = match (last, tokens) {
        (Some(l), n) if n > 1 => Some((l - first) / (n as u32 - 1)),
        _ => None,
    };
    Ok(Sample { ttft: first - sent, tpot, tokens })
}

/// Decode throughput of the bare engine (no HTTP, greedy argmax) with `n_seq` sequences
/// decoding together, one token each per step after a short prompt: tokens/s over all
/// sequences. The best of three runs.
fn engine_decode_rate(path: &std::path::Path, threads: usize, n: usize, n_seq: usize) -> Result<f64, engine::Error> {
    let file = Arc::new(ModelFile::open(path)?);
    let cfg = StageConfig { n_seq, n_ctx_seq: 1024, threads, ..StageConfig::whole(&file.spec) };
    let mut p = LocalPipeline::new(vec![Stage::new(file, cfg)?])?;
    let prompts = vec![(0..40).map(|i| 100 + i).collect::<Vec<i32>>(); n_seq];
    let mut best = 0f64;
    for _ in 0..3 {
        // n decode steps after the token the prompt gives.
        best = best.max(p.decode_together(&prompts, n + 1, 512)?.1.gen_tps());
    }
    Ok(best)
}

fn percentile(v: &mut [f64], q: f64) -> f64 {
    if v.is_empty() {
        return f64::NAN;
    }
    v.sort_by(f64::total_cmp);
    v[((v.len() - 1) as f64 * q).round() as usize]
}
