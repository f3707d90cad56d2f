"""hearth driven by the official `ollama` Python client, as Home Assistant and Open WebUI use it.

Usage: python3 ollama_sdk.py BASE_URL API_KEY [TURNS]
Exits non-zero (with the failing check) if anything differs from what the client expects.
TURNS (default 10) is the length of the tool-calling conversation.
"""
import json
import sys

import httpx
import ollama

base, key = sys.argv[1], sys.argv[2]
turns = int(sys.argv[3]) if len(sys.argv) > 3 else 10
# Home Assistant and Open WebUI send a configured key as a Bearer token.
client = ollama.Client(host=base, headers={"Authorization": f"Bearer {key}"}, timeout=300)

# Open WebUI checks the version first, without a key; Home Assistant lists the models.
assert httpx.get(base + "/api/version").json()["version"], "no version"
assert httpx.get(base + "/").status_code == 200
models = client.list().models
# The chat model first; an embedding model, when served, after it.
assert len(models) >= 1 and models[0].model.endswith(":latest"), models
model = models[0].model
assert models[0].details.format == "gguf" and models[0].details.family and models[0].size > 0, models[0]
shown = client.show(model)
assert shown.details.family == models[0].details.family and shown.modelinfo["general.architecture"], shown
running = client.ps().models
assert running and running[0].model == model and running[0].expires_at is not None, running
# Home Assistant pulls the model it was set up with when it is not listed exactly.
assert client.pull(model).status == "success"
assert [p.status for p in client.pull(model, stream=True)] == ["success"]

greedy = {"temperature": 0, "num_predict": 24, "num_ctx": 2048}
ask = [{"role": "system", "content": "You are a concise assistant."}, {"role": "user", "content": "What is the capital of France?"}]

# Chat, whole and streamed (the default for Home Assistant): the same text; keep_alive as
# Home Assistant sends it (the integer -1).
r = client.chat(model=model, messages=ask, options=greedy, keep_alive=-1)
assert r.done and r.done_reason in ("stop", "length") and r.message.role == "assistant" and r.message.content, r
assert r.prompt_eval_count > 0 and r.eval_count > 0 and r.total_duration > 0, r
parts = list(client.chat(model=model, messages=ask, options=greedy, stream=True, keep_alive="5m"))
assert parts[-1].done and not any(p.done for p in parts[:-1]), parts
assert "".join(p.message.content for p in parts) == r.message.content, (parts, r)
assert parts[-1].eval_count == r.eval_count

# Generate, whole and streamed; raw skips the template.
g = client.generate(model=model, prompt="What is the capital of France?", system="You are a concise assistant.", options=greedy)
assert g.done and g.response == r.message.content, (g.response, r.message.content)
streamed = "".join(p.response for p in client.generate(model=model, prompt="What is the capital of France?", system="You are a concise assistant.", options=greedy, stream=True))
assert streamed == g.response
raw = client.generate(model=model, prompt="The capital of France is", raw=True, options={"temperature": 0, "num_predict": 5})
assert raw.done and raw.response, raw
# An empty request loads the model, as Ollama answers it.
assert client.generate(model=model).done_reason == "load"

# JSON output: "json", and a schema (both enforced by grammar).
j = client.chat(model=model, messages=[{"role": "user", "content": "Give a city and its country as JSON."}], format="json", options={"temperature": 0, "num_predict": 60})
json.loads(j.message.content)
schema = {"type": "object", "properties": {"city": {"type": "string"}, "country": {"type": "string"}}, "required": ["city", "country"]}
j = client.chat(model=model, messages=[{"role": "user", "content": "Name a city and its country."}], format=schema, options={"temperature": 0, "num_predict": 60})
assert set(json.loads(j.message.content)) >= {"city", "country"}, j.message.content

# A Home Assistant-style conversation with tools: each turn the history holds the
# assistant's tool call (arguments as an object) and the tool's JSON result; every answer
# must parse, and any call the model makes names a defined tool with object arguments.
tools = [{"type": "function", "function": {"name": "HassTurnOn", "description": "Turns on a device", "parameters": {"type": "object", "properties": {"name": {"type": "string"}}, "required": ["name"]}}}]
messages = [{"role": "system", "content": "You control a smart home."}]
calls_made = 0
for turn in range(turns):
    messages.append({"role": "user", "content": f"Turn on light {turn}."})
    r = client.chat(model=model, messages=messages, tools=tools, options={"temperature": 0, "num_predict": 40, "num_ctx": 4096}, keep_alive=-1, stream=turn % 2 == 0)
    if turn % 2 == 0:
        chunks = list(r)
        assert chunks[-1].done, chunks
        calls = [c for ch in chunks for c in (ch.message.tool_calls or [])]
    else:
        calls = r.message.tool_calls or []
    for c in calls:
        assert c.function.name == "HassTurnOn" and isinstance(c.function.arguments, dict), c
    calls_made += len(calls)
    messages.append({"role": "assistant", "content": "", "tool_calls": [{"function": {"name": "HassTurnOn", "arguments": {"name": f"light {turn}"}}}]})
    messages.append({"role": "tool", "content": json.dumps({"success": True}), "tool_name": "HassTurnOn"})
messages.append({"role": "user", "content": "Which lights are on?"})
final = client.chat(model=model, messages=messages, options={"temperature": 0, "num_predict": 30, "num_ctx": 4096})
assert final.done and final.message.content, final

# Errors raise the client's ResponseError with Ollama's status codes.
for bad, status in [(lambda: client.chat(model="no-such-model", messages=ask), 404), (lambda: client.chat(model=model, messages=ask, options={"num_ctx": 10**7}), 400), (lambda: client.chat(model=model, messages=[{"role": "user", "content": "hi", "images": ["AAAA"]}]), 400)]:
    try:
        bad()
        raise SystemExit(f"expected {status}")
    except ollama.ResponseError as e:
        assert e.status_code == status and e.error, (e.status_code, e.error)
try:
    ollama.Client(host=base, headers={"Authorization": "Bearer wrong"}).list()
    raise SystemExit("a wrong key was accepted")
except ollama.ResponseError as e:
    assert e.status_code == 401, e

print(f"ollama client: all checks passed ({turns}-turn tool conversation, {calls_made} calls made by the model)")
