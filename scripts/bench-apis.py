#!/usr/bin/env python3
"""What each client API adds per token over chat completions, in one run against one server.

Usage: scripts/bench-apis.py BASE_URL [ROUNDS] [TOKENS]
Start the server with one slot so the requests run alone, e.g.
  hearth serve --parallel 1 --threads 2 --ctx-size 2048

The same greedy request (the same prompt, temperature 0, TOKENS tokens) is streamed through
chat completions, Anthropic Messages, the Responses API and Ollama's chat, the four
interleaved in every round. Per API: the median over rounds of the time per output token
between the first and the last streamed piece, and its ratio to chat completions. Every
API must have generated the same number of tokens (checked), so the ratio is the API's own
cost: request conversion, its events, its framing.
"""
import json
import statistics
import sys
import time

import httpx

base = sys.argv[1].rstrip("/")
rounds = int(sys.argv[2]) if len(sys.argv) > 2 else 5
tokens = int(sys.argv[3]) if len(sys.argv) > 3 else 128
prompt = "Write a long story about a lighthouse keeper and the ships she saw."
client = httpx.Client(timeout=600)


def timed(method, url, body, is_piece, count):
    """(output tokens, seconds per token after the first) of one streamed request."""
    first = last = None
    n = None
    with client.stream(method, url, json=body) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            payload = line[len("data: "):] if line.startswith("data: ") else line
            if not payload.startswith("{"):
                continue
            d = json.loads(payload)
            now = time.perf_counter()
            if is_piece(d):
                first = first or now
                last = now
            n = count(d) or n
    return n, (last - first) / max(n - 1, 1)


apis = {
    "chat/completions": lambda: timed("POST", f"{base}/v1/chat/completions",
        {"model": "", "messages": [{"role": "user", "content": prompt}], "max_tokens": tokens, "temperature": 0, "stream": True, "stream_options": {"include_usage": True}},
        lambda d: any(c.get("delta", {}).get("content") for c in d.get("choices", [])),
        lambda d: (d.get("usage") or {}).get("completion_tokens")),
    "anthropic messages": lambda: timed("POST", f"{base}/v1/messages",
        {"model": "claude-x", "messages": [{"role": "user", "content": prompt}], "max_tokens": tokens, "temperature": 0, "stream": True},
        lambda d: d.get("type") == "content_block_delta",
        lambda d: d.get("usage", {}).get("output_tokens") if d.get("type") == "message_delta" else None),
    "responses": lambda: timed("POST", f"{base}/v1/responses",
        {"model": "", "input": [{"role": "user", "content": prompt}], "max_output_tokens": tokens, "temperature": 0, "stream": True, "store": False},
        lambda d: d.get("type") == "response.output_text.delta",
        lambda d: (d.get("response") or {}).get("usage", {}).get("output_tokens") if d.get("type", "").startswith("response.") and (d.get("response") or {}).get("usage") else None),
    "ollama chat": lambda: timed("POST", f"{base}/api/chat",
        {"model": "", "messages": [{"role": "user", "content": prompt}], "options": {"num_predict": tokens, "temperature": 0, "repeat_penalty": 1.0}},
        lambda d: bool(d.get("message", {}).get("content")),
        lambda d: d.get("eval_count") if d.get("done") else None),
}

results = {name: [] for name in apis}
counts = {}
for name, run in apis.items():  # warm-up: the prompt's cache, the allocator
    counts[name] = run()[0]
assert len(set(counts.values())) == 1, f"the APIs generated different token counts: {counts}"
for _ in range(rounds):
    for name, run in apis.items():
        n, per_token = run()
        assert n == counts[name], (name, n)
        results[name].append(per_token)

base_ms = statistics.median(results["chat/completions"]) * 1000
print(f"{rounds} rounds, {counts['chat/completions']} output tokens each, the same greedy text through every API")
print(f"{'API':<20} {'TPOT ms (median)':>17} {'min':>7} {'max':>7} {'vs chat':>8}")
for name, xs in results.items():
    med = statistics.median(xs) * 1000
    print(f"{name:<20} {med:17.3f} {min(xs) * 1000:7.3f} {max(xs) * 1000:7.3f} {med / base_ms:8.3f}")
