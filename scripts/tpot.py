#!/usr/bin/env python3
"""Time per output token of a running hearth server, as a streaming client sees it.

Sends greedy streamed /v1/completions requests and times the gaps between tokens (the
first token, which includes the prompt, is excluded). Prints one line:
    tpot_best_s tpot_median_s ttft_median_s tokens
Standard library only, so it runs wherever Python does.

    scripts/tpot.py http://127.0.0.1:8080 --max-tokens 128 --reps 3
"""
import argparse
import statistics
import sys

from load import stream  # this folder's: the same streaming client


def one(url, prompt, max_tokens, suppress, timeout, temperature=0.0, seed=None):
    times, t0 = stream(url, prompt, max_tokens, timeout, suppress, temperature, seed)
    if len(times) < 2:
        sys.exit(f"tpot.py: only {len(times)} tokens streamed")
    return (times[-1] - times[0]) / (len(times) - 1), times[0] - t0, len(times)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("url")
    p.add_argument("--prompt", default="Explain in detail how a bicycle works, part by part.")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--suppress", default="", help="comma-separated token ids never to sample (e.g. end-of-text)")
    p.add_argument("--timeout", type=float, default=600)
    p.add_argument("--temperature", type=float, default=0.0, help="0 is greedy")
    p.add_argument("--seed", type=int, default=None)
    a = p.parse_args()
    suppress = [int(t) for t in a.suppress.split(",") if t]
    runs = [one(a.url, a.prompt, a.max_tokens, suppress, a.timeout, a.temperature, a.seed) for _ in range(a.reps)]
    tpots = [r[0] for r in runs]
    print(f"{min(tpots):.5f} {statistics.median(tpots):.5f} {statistics.median(r[1] for r in runs):.3f} {runs[0][2]}")


if __name__ == "__main__":
    main()
