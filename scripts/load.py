#!/usr/bin/env python3
"""Load on any OpenAI-compatible server (hearth, llama-server), as its users send it.

    scripts/load.py URL tpot    [--max-tokens 128] [--reps 3]
    scripts/load.py URL streams N [--max-tokens 128] [--reps 1]
    scripts/load.py URL ttft    TOKENS [--reps 3]
    scripts/load.py URL shared  TOKENS [--reps 3]
    scripts/load.py URL agents  TOKENS [--agents 4] [--turns 20] [--max-tokens 24]

tpot:    one greedy stream at a time; prints the median time per output token (s).
streams: N concurrent greedy streams, each its own prompt; prints the aggregate generated
         tokens/s (every token of every stream over the wall time from the first request
         to the last stream's end), the best of --reps rounds; with --steady also that
         round's rate while every stream was decoding (prompts done, none ended).
ttft:    a prompt of about TOKENS tokens of real prose (from the prima.cpp paper), one token
         asked for, a different part of the text each time so no prompt cache helps;
         prints the median seconds to the answer and the prompt's token count.
shared:  an agent's request arriving while another agent's answer streams: a system prompt
         of about TOKENS tokens, then its own question; the other agent's request has the
         same system prompt (rounds "shared") or another part of the text in its place
         ("unshared", what every request costs without a prefix cache across slots),
         alternating. Prints the median seconds to the arriving request's answer (one
         token) of each, and the cached prompt tokens the server reported for each.

agents:  --agents coding agents at once, each a --turns-turn conversation through
         /v1/chat/completions (streamed) with its own system prompt of about TOKENS tokens
         of the text (another part of it per agent, as agents on different projects) and
         tools, each turn a new user message and the answer sent back. Prints one line per
         turn: the turn, the median and largest seconds to the first answer chunk over the
         agents, and the median cached prompt tokens; then "all" with the means over
         turns 2 on. The same TOKENS, agents and turns give the same conversations (greedy),
         so a run after a restart sends what the run before sent.

Standard library only; text from testdata/prima-cpp-excerpt.txt (or --text FILE).
"""
import argparse
import http.client
import json
import os
import statistics
import sys
import threading
import time
import urllib.parse

HERE = os.path.dirname(os.path.abspath(__file__))
# Prose (the paper's tables and formulas tokenize unlike what users send).
DEFAULT_TEXT = os.path.join(HERE, "..", "testdata", "prima-cpp-excerpt.txt")
# Characters per token of English prose under the small models' tokenizers: where to cut
# the text for a prompt of about N tokens (the server reports the exact count).
CHARS_PER_TOKEN = 4.2
# A passage for a stream to continue: a few sentences.
PASSAGE_CHARS = 300


def post(url, body, timeout, stream=False):
    u = urllib.parse.urlparse(url)
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=timeout)
    conn.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
    resp = conn.getresponse()
    if resp.status != 200:
        sys.exit(f"load.py: HTTP {resp.status}: {resp.read()[:500]!r}")
    return conn, resp


def stream(url, prompt, max_tokens, timeout, suppress, temperature=0.0, seed=None):
    """Streams one completion (greedy by default): (token arrival times, start time)."""
    body = {"model": "", "prompt": prompt, "max_tokens": max_tokens, "temperature": temperature, "stream": True}
    if seed is not None:
        body["seed"] = seed
    if suppress:
        # Random-weight models may emit end-of-text at once; keep them generating.
        body["logit_bias"] = {str(t): -100 for t in suppress}
    t0 = time.monotonic()
    conn, resp = post(url, body, timeout)
    times = []
    for line in resp:
        line = line.strip()
        if not line.startswith(b"data: ") or line == b"data: [DONE]":
            continue
        event = json.loads(line[6:])
        if "error" in event:
            sys.exit(f"load.py: {event['error']}")
        choice = (event.get("choices") or [{}])[0]
        # A token's chunk; the closing chunk (finish_reason set) carries no new token.
        if choice.get("text") is not None and choice.get("finish_reason") is None:
            times.append(time.monotonic())
    conn.close()
    return times, t0


def generated(url):
    """hearth's count of generated tokens (/metrics), 0 where it has none."""
    u = urllib.parse.urlparse(url)
    try:
        conn = http.client.HTTPConnection(u.hostname, u.port, timeout=10)
        conn.request("GET", "/metrics")
        body = conn.getresponse().read().decode()
        conn.close()
    except OSError:
        return 0.0
    return next((float(l.split()[1]) for l in body.splitlines() if l.startswith("hearth_generated_tokens_total ")), 0.0)


def text(path):
    for p in (path, DEFAULT_TEXT):
        if p and os.path.exists(p):
            with open(p, encoding="utf-8", errors="replace") as f:
                return " ".join(f.read().split())
    sys.exit("load.py: no text to make prompts from")


TOOLS = [
    {"type": "function", "function": {"name": "read_file", "description": "Read a file of the project.", "parameters": {"type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]}}},
    {"type": "function", "function": {"name": "grep", "description": "Search the project for a pattern.", "parameters": {"type": "object", "properties": {"pattern": {"type": "string"}, "path": {"type": "string"}}, "required": ["pattern"]}}},
    {"type": "function", "function": {"name": "run", "description": "Run a shell command in the project.", "parameters": {"type": "object", "properties": {"command": {"type": "string"}}, "required": ["command"]}}},
]


def chat_turn(url, messages, max_tokens, timeout):
    """One streamed greedy chat turn: (seconds to the first chunk carrying any answer, the
    answer's text, cached prompt tokens)."""
    u = urllib.parse.urlparse(url)
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=timeout)
    body = {"model": "", "messages": messages, "tools": TOOLS, "max_tokens": max_tokens, "temperature": 0, "stream": True, "stream_options": {"include_usage": True}}
    t0 = time.monotonic()
    conn.request("POST", "/v1/chat/completions", json.dumps(body), {"Content-Type": "application/json"})
    resp = conn.getresponse()
    if resp.status != 200:
        sys.exit(f"load.py: HTTP {resp.status}: {resp.read()[:500]!r}")
    first, text, cached = None, [], 0
    for line in resp:
        line = line.strip()
        if not line.startswith(b"data: ") or line == b"data: [DONE]":
            continue
        chunk = json.loads(line[6:])
        for c in chunk.get("choices", []):
            d = c.get("delta", {})
            piece = (d.get("content") or "") + (d.get("reasoning_content") or "") + json.dumps(d.get("tool_calls") or "")
            if first is None and piece.strip('"'):
                first = time.monotonic() - t0
            text.append(d.get("content") or "")
        if chunk.get("usage"):
            cached = chunk["usage"].get("prompt_tokens_details", {}).get("cached_tokens", 0)
    conn.close()
    return (first if first is not None else time.monotonic() - t0), "".join(text), cached


def agents(a, words):
    n_chars = int(a.n * CHARS_PER_TOKEN)
    ttft = [[None] * a.agents for _ in range(a.turns)]
    cached = [[0] * a.agents for _ in range(a.turns)]

    failed = []

    def agent(i):
        start = (i * n_chars + i * 977) % max(1, len(words) - n_chars)
        system = "You are a coding agent working on this project. Its design document:\n" + words[start:start + n_chars]
        messages = [{"role": "system", "content": system}]
        for turn in range(a.turns):
            q = (i * 104729 + turn * 7919) % max(1, len(words) - 400)
            messages.append({"role": "user", "content": "Next step: " + words[q:q + 400]})
            try:
                took, answer, hit = chat_turn(a.url, messages, a.max_tokens, a.timeout)
            except (SystemExit, Exception) as e:  # a refused turn (past the context): said, not a missing number
                failed.append(f"agent {i}, turn {turn + 1}: {e}")
                return
            ttft[turn][i], cached[turn][i] = took, hit
            messages.append({"role": "assistant", "content": answer})

    threads = [threading.Thread(target=agent, args=(i,)) for i in range(a.agents)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if failed:
        sys.exit("load.py: " + "; ".join(failed))
    for turn in range(a.turns):
        print(f"{turn + 1} {statistics.median(ttft[turn]):.3f} {max(ttft[turn]):.3f} {statistics.median(cached[turn]):.0f}")
    later = [x for row in ttft[1:] for x in row]
    print(f"all {statistics.mean(later) if later else float('nan'):.3f} {max(later) if later else float('nan'):.3f} {statistics.mean(x for row in cached[1:] for x in row) if later else 0:.0f}")


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("url")
    p.add_argument("mode", choices=["tpot", "streams", "ttft", "shared", "agents"])
    p.add_argument("n", nargs="?", type=int, default=1, help="streams: how many; ttft: prompt tokens")
    p.add_argument("--agents", type=int, default=4, help="agents: how many at once")
    p.add_argument("--turns", type=int, default=20, help="agents: turns per conversation")
    p.add_argument("--steady", action="store_true", help="streams: also print the tokens/s while every stream decodes (no prompt, no stream ended)")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--timeout", type=float, default=1200)
    p.add_argument("--text")
    p.add_argument("--suppress", default="", help="comma-separated token ids never to sample (end-of-text)")
    a = p.parse_args()
    words = text(a.text)
    suppress = [int(t) for t in a.suppress.split(",") if t]
    # Streams continue passages of the text (a raw completion of a question may end at
    # once with end-of-text): each its own, so no prompt cache is shared.
    def passage(i):
        start = (i * 104729) % max(1, len(words) - PASSAGE_CHARS)
        return words[start:start + PASSAGE_CHARS]

    if a.mode == "tpot":
        tpots = []
        for r in range(a.reps * 3):
            times, _ = stream(a.url, passage(r), a.max_tokens, a.timeout, suppress)
            # An answer that ended at once times nothing: take another passage.
            if len(times) >= 2:
                tpots.append((times[-1] - times[0]) / (len(times) - 1))
            if len(tpots) == a.reps:
                break
        if not tpots:
            sys.exit("load.py: every answer ended before its second token")
        print(f"{statistics.median(tpots):.6f}")
    elif a.mode == "streams":
        best = 0.0
        for r in range(a.reps):
            results = [None] * a.n
            def run(i):
                results[i] = stream(a.url, passage(1000 + r * a.n + i), a.max_tokens, a.timeout, suppress)
            threads = [threading.Thread(target=run, args=(i,)) for i in range(a.n)]
            t0 = time.monotonic()
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            end = max(times[-1] for times, _ in results if times)
            tokens = sum(len(times) for times, _ in results)
            if tokens / (end - t0) > best:
                best = tokens / (end - t0)
                # Decoding alone: tokens that arrived while every stream was past its
                # first token and none had ended (what a decode forecast is about).
                lo = max(times[0] for times, _ in results if times)
                hi = min(times[-1] for times, _ in results if times)
                inside = sum(1 for times, _ in results for t in times if lo < t <= hi)
                steady = inside / (hi - lo) if hi > lo else float("nan")
                # Where the wall time went (stderr, for a reader of a benchmark's log):
                # until every stream had its first token, every stream decoding, and the
                # tail after the first stream ended.
                lengths = sorted(len(times) for times, _ in results)
                print(f"load.py: streams: {lo - t0:.2f} s until every stream had a token, {hi - lo:.2f} s all decoding, {end - hi:.2f} s of tail; tokens per stream {lengths}", file=sys.stderr)
        print(f"{best:.3f} {steady:.3f}" if a.steady else f"{best:.3f}")
    elif a.mode == "shared":
        n_chars = int(a.n * CHARS_PER_TOKEN)
        took = {"shared": [], "unshared": []}
        cached = {"shared": [], "unshared": []}
        for r in range(a.reps * 2):
            kind = "shared" if r % 2 == 0 else "unshared"
            # A fresh system prompt each round, so nothing an earlier round left helps.
            start = (r * 7919 * 13) % max(1, len(words) - 2 * n_chars)
            system = words[start:start + n_chars]
            other = words[start + n_chars:start + 2 * n_chars]
            running_prompt = (system if kind == "shared" else other) + " " + passage(r)
            before = generated(a.url)
            t = threading.Thread(target=stream, args=(a.url, running_prompt, a.max_tokens, a.timeout, suppress))
            t.start()
            # The arriving request comes once the running one streams (its prompt is in).
            while t.is_alive() and generated(a.url) < before + 2:
                time.sleep(0.02)
            question = " Question: " + passage(5000 + r)[:200]
            t0 = time.monotonic()
            conn, resp = post(a.url, {"model": "", "prompt": system + question, "max_tokens": 1, "temperature": 0}, a.timeout)
            v = json.loads(resp.read())
            conn.close()
            took[kind].append(time.monotonic() - t0)
            cached[kind].append(v.get("usage", {}).get("prompt_tokens_details", {}).get("cached_tokens", 0))
            t.join()
        print(f"{statistics.median(took['shared']):.6f} {statistics.median(took['unshared']):.6f} {statistics.median(cached['shared']):.0f} {statistics.median(cached['unshared']):.0f}")
    elif a.mode == "agents":
        agents(a, words)
    else:
        n_chars = int(a.n * CHARS_PER_TOKEN)
        took, counts = [], []
        for r in range(a.reps):
            start = (r * 7919 * 13) % max(1, len(words) - n_chars)
            prompt = words[start:start + n_chars]
            t0 = time.monotonic()
            conn, resp = post(a.url, {"model": "", "prompt": prompt, "max_tokens": 1, "temperature": 0}, a.timeout)
            v = json.loads(resp.read())
            conn.close()
            took.append(time.monotonic() - t0)
            counts.append(v.get("usage", {}).get("prompt_tokens", 0))
        print(f"{statistics.median(took):.6f} {statistics.median(counts):.0f}")


if __name__ == "__main__":
    main()
