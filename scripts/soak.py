#!/usr/bin/env python3
"""Soak load against a running hearth head: many concurrent clients for a fixed time with
a mix of what users send -- short streamed chats, long prompts of real text, clients that
cancel mid-stream, JSON-schema grammars, stop strings, several choices -- while the head's
(and workers') memory is sampled. Standard library only.

Exits non-zero when the head died, answered 5xx other than a ring 503, a 429 came without
Retry-After, memory kept growing, or slots/queue were not free at the end.

  scripts/soak.py --url http://127.0.0.1:8080 --pids 1234,5678 --clients 64 --seconds 600
"""
import argparse
import http.client
import json
import os
import random
import socket
import threading
import time
import urllib.parse
from collections import Counter

HERE = os.path.dirname(os.path.abspath(__file__))
TEXT = open(os.path.join(HERE, "..", "testdata", "prima-cpp-excerpt.txt"), encoding="utf-8").read()
PARAS = [p.strip() for p in TEXT.split("\n\n") if len(p.strip()) > 200]

SCHEMA = {
    "type": "object",
    "properties": {"title": {"type": "string"}, "year": {"type": "integer"}, "devices": {"type": "array", "items": {"type": "string"}}},
    "required": ["title", "year"],
}


def rss_kib(pid):
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1])
    except OSError:
        return None
    return None


class Stats:
    def __init__(self):
        self.lock = threading.Lock()
        self.kinds = Counter()
        self.status = Counter()
        self.problems = []
        self.ok_seconds = Counter()
        self.ok_count = Counter()

    def add(self, kind, status, problem=None, seconds=None):
        with self.lock:
            self.kinds[kind] += 1
            self.status[status] += 1
            if status == 200 and seconds is not None:
                self.ok_seconds[kind] += seconds
                self.ok_count[kind] += 1
            if problem and len(self.problems) < 50:
                self.problems.append(f"{kind}: {problem}")


def request(host, port, body, timeout, read_events=None):
    """POSTs a chat or completions body. Returns (status, headers, text). With
    `read_events`, reads that many SSE events and then closes the connection (a client
    that goes away)."""
    conn = http.client.HTTPConnection(host, port, timeout=timeout)
    path = "/v1/completions" if "prompt" in body else "/v1/chat/completions"
    conn.request("POST", path, json.dumps(body), {"Content-Type": "application/json"})
    resp = conn.getresponse()
    headers = {k.lower(): v for k, v in resp.getheaders()}
    if read_events is not None and resp.status == 200:
        seen = 0
        while seen < read_events:
            line = resp.fp.readline()
            if not line:
                break
            if line.startswith(b"data: "):
                seen += 1
        conn.sock.shutdown(socket.SHUT_RDWR)
        conn.close()
        return resp.status, headers, ""
    text = resp.read().decode("utf-8", "replace")
    conn.close()
    return resp.status, headers, text


def one(rng, max_long_chars):
    """A random request of the mix: (kind, body, events to read before cancelling)."""
    r = rng.random()
    para = rng.choice(PARAS)
    if r < 0.35:
        return "stream", {"model": "", "stream": True, "max_tokens": rng.randint(8, 64), "messages": [{"role": "user", "content": para[:400]}]}, None
    if r < 0.50:
        start = rng.randint(0, max(0, len(TEXT) - max_long_chars))
        return "long", {"model": "", "prompt": TEXT[start:start + max_long_chars], "max_tokens": 16, "temperature": 0}, None
    if r < 0.65:
        return "cancel", {"model": "", "stream": True, "max_tokens": 200, "messages": [{"role": "user", "content": para[:300]}]}, rng.randint(1, 6)
    if r < 0.80:
        return "grammar", {"model": "", "max_tokens": 48, "messages": [{"role": "user", "content": "Describe this paper as JSON: " + para[:300]}],
                            "response_format": {"type": "json_schema", "json_schema": {"name": "paper", "schema": SCHEMA}}}, None
    if r < 0.90:
        return "stop", {"model": "", "max_tokens": 48, "stop": ["\n\n", ".", "devices"], "messages": [{"role": "user", "content": para[:300]}]}, None
    return "n2", {"model": "", "n": 2, "max_tokens": 24, "temperature": 0.9, "messages": [{"role": "user", "content": para[:200]}]}, None


def client(idx, host, port, deadline, stats, max_long_chars):
    rng = random.Random(idx)
    while time.time() < deadline:
        kind, body, cancel_after = one(rng, max_long_chars)
        t0 = time.time()
        try:
            status, headers, text = request(host, port, body, timeout=300, read_events=cancel_after)
        except (OSError, http.client.HTTPException) as e:
            stats.add(kind, "error", repr(e))
            time.sleep(0.5)
            continue
        problem = None
        if status == 429:
            if "retry-after" not in headers:
                problem = "429 without Retry-After"
            time.sleep(float(headers.get("retry-after", "1")))
        elif status == 503 and "ring_unavailable" in text:
            pass
        elif status >= 500:
            problem = f"{status}: {text[:200]}"
        elif status != 200:
            problem = f"{status}: {text[:200]}"
        stats.add(kind, status, problem, time.time() - t0)


def metric(text, name):
    for line in text.splitlines():
        if line.startswith(name + " ") or line.startswith(name + "{"):
            return float(line.rsplit(" ", 1)[1])
    return None


def get(host, port, path):
    conn = http.client.HTTPConnection(host, port, timeout=30)
    conn.request("GET", path)
    r = conn.getresponse()
    body = r.read().decode()
    conn.close()
    return r.status, body


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--url", default="http://127.0.0.1:8080")
    ap.add_argument("--pids", default="", help="comma-separated PIDs to sample RSS of (head first)")
    ap.add_argument("--clients", type=int, default=64)
    ap.add_argument("--seconds", type=int, default=600)
    ap.add_argument("--long-chars", type=int, default=6000, help="characters of the long prompts (~1,500 tokens)")
    ap.add_argument("--label", default="soak")
    a = ap.parse_args()
    u = urllib.parse.urlparse(a.url)
    host, port = u.hostname, u.port or 80
    pids = [int(p) for p in a.pids.split(",") if p]
    stats = Stats()
    start_rss = [rss_kib(p) for p in pids]
    peak = list(start_rss)
    t0 = time.time()
    deadline = t0 + a.seconds
    threads = [threading.Thread(target=client, args=(i, host, port, deadline, stats, a.long_chars), daemon=True) for i in range(a.clients)]
    for t in threads:
        t.start()
    samples = []
    while any(t.is_alive() for t in threads):
        time.sleep(1)
        now = [rss_kib(p) for p in pids]
        samples.append(now)
        peak = [max(x or 0, y or 0) for x, y in zip(peak, now)]
        if pids and now[0] is None:
            stats.add("head", "died", "the head process is gone")
            break
        if time.time() > deadline + 330:
            stats.add("clients", "stuck", "clients still running 330 s after the deadline")
            break
    # Every slot free and the queue empty once the clients are gone.
    time.sleep(2)
    status, metrics = get(host, port, "/metrics")
    running, queued = metric(metrics, "hearth_running_sequences"), metric(metrics, "hearth_queue_size")
    end_rss = [rss_kib(p) for p in pids]
    _, health = get(host, port, "/health")
    print(f"== {a.label}: {a.clients} clients for {a.seconds} s ({time.time() - t0:.0f} s with the tail)")
    print("requests by kind:", dict(stats.kinds))
    print("answers by status:", dict(stats.status))
    print("mean seconds of a 200 by kind:", {k: round(stats.ok_seconds[k] / n, 1) for k, n in stats.ok_count.items()})
    for i, p in enumerate(pids):
        role = "head" if i == 0 else f"worker {i}"
        print(f"RSS {role} (pid {p}): start {start_rss[i] / 1024:.0f} MiB, peak {peak[i] / 1024:.0f} MiB, end {(end_rss[i] or 0) / 1024:.0f} MiB")
    print(f"at the end: running sequences {running}, queued {queued}, health {health.strip()}")
    bad = list(stats.problems)
    if running not in (0, 0.0) or queued not in (0, 0.0):
        bad.append(f"slots not free at the end: running {running}, queued {queued}")
    # Memory: the last minute's samples may not exceed the first minute's peak by more
    # than 25% (a leak grows without bound over ten minutes; caches settle early).
    if pids and len(samples) > 120:
        early = max(s[0] or 0 for s in samples[:60])
        late = max(s[0] or 0 for s in samples[-60:])
        print(f"head RSS: first-minute peak {early / 1024:.0f} MiB, last-minute peak {late / 1024:.0f} MiB")
        if late > early * 1.25:
            bad.append(f"head RSS grew from {early} KiB to {late} KiB")
    for p in bad:
        print("PROBLEM:", p)
    raise SystemExit(1 if bad else 0)


if __name__ == "__main__":
    main()
