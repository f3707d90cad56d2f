"""hearth driven by Anthropic's official Python SDK, as Claude Code and agents built on it do.

Usage: python3 anthropic_sdk.py BASE_URL API_KEY [TURNS]
Exits non-zero (with the failing check) if anything differs from what the SDK expects.
TURNS (default 10) is the length of the tool-calling agent loop.
"""
import json
import sys

import anthropic

base, key = sys.argv[1], sys.argv[2]
turns = int(sys.argv[3]) if len(sys.argv) > 3 else 10
# Claude Code sends the key as x-api-key (ANTHROPIC_API_KEY) or as a Bearer token
# (ANTHROPIC_AUTH_TOKEN), and names Claude models.
client = anthropic.Anthropic(base_url=base, api_key=key, max_retries=0, timeout=300)
bearer = anthropic.Anthropic(base_url=base, auth_token=key, max_retries=0, timeout=300)
model = "claude-sonnet-4-6"
# Newer SDKs dropped the sampling parameters from their signatures (current Claude models
# refuse them); the API still takes them, so tests pin greedy decoding through extra_body.
GREEDY = {"temperature": 0}
ask = [{"role": "user", "content": "What is the capital of France?"}]

# A message, whole and streamed: the same text.
m = client.messages.create(model=model, max_tokens=24, extra_body=GREEDY, system="You are concise.", messages=ask)
assert m.type == "message" and m.role == "assistant" and m.model == model, m
assert m.stop_reason in ("end_turn", "max_tokens"), m
text = "".join(b.text for b in m.content if b.type == "text")
assert text, m
assert m.usage.input_tokens + (m.usage.cache_read_input_tokens or 0) > 0 and m.usage.output_tokens > 0, m.usage

with bearer.messages.stream(model=model, max_tokens=24, extra_body=GREEDY, system="You are concise.", messages=ask) as stream:
    streamed = "".join(stream.text_stream)
    final = stream.get_final_message()
assert streamed == text, (streamed, text)
assert final.stop_reason == m.stop_reason and final.usage.output_tokens == m.usage.output_tokens, final

# The raw event stream, as Claude Code reads it (beta client, beta headers).
kinds = [e.type for e in client.beta.messages.create(model=model, max_tokens=8, messages=ask, stream=True, betas=["interleaved-thinking-2025-05-14"])]
assert kinds[0] == "message_start" and kinds[-1] == "message_stop" and "message_delta" in kinds, kinds

# count_tokens counts the prompt the message was generated from.
n = client.messages.count_tokens(model=model, system="You are concise.", messages=ask)
assert n.input_tokens == m.usage.input_tokens + (m.usage.cache_read_input_tokens or 0), (n, m.usage)

# Stop sequences.
s = client.messages.create(model=model, max_tokens=40, extra_body=GREEDY, messages=[{"role": "user", "content": "Count from one to ten in words."}], stop_sequences=["three", "Three"])
assert s.stop_reason in ("stop_sequence", "end_turn", "max_tokens"), s
if s.stop_reason == "stop_sequence":
    assert s.stop_sequence in ("three", "Three"), s

# Structured output: the answer follows the schema (enforced by grammar).
schema = {"type": "object", "properties": {"city": {"type": "string"}, "country": {"type": "string"}}, "required": ["city", "country"], "additionalProperties": False}
j = client.messages.create(model=model, max_tokens=60, extra_body=GREEDY, messages=[{"role": "user", "content": "Name a city and its country."}], output_config={"format": {"type": "json_schema", "schema": schema}})
parsed = json.loads("".join(b.text for b in j.content if b.type == "text"))
assert set(parsed) == {"city", "country"}, parsed

# A tool-calling agent loop: each turn the model must call the tool (grammar-enforced),
# the tool's result goes back as a tool_result, and the model answers in text at the end.
tools = [{"name": "get_weather", "description": "Current weather in a city", "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}]
messages = [{"role": "user", "content": "What is the weather in Oslo?"}]
for turn in range(turns):
    r = client.messages.create(model=model, max_tokens=60, extra_body=GREEDY, messages=messages, tools=tools, tool_choice={"type": "any", "disable_parallel_tool_use": True})
    assert r.stop_reason == "tool_use", r
    calls = [b for b in r.content if b.type == "tool_use"]
    assert len(calls) == 1 and calls[0].name == "get_weather" and isinstance(calls[0].input, dict), r
    messages.append({"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in r.content]})
    messages.append({"role": "user", "content": [{"type": "tool_result", "tool_use_id": calls[0].id, "content": [{"type": "text", "text": json.dumps({"temp_c": 20 + turn})}]}, {"type": "text", "text": "And now?"}]})
with client.messages.stream(model=model, max_tokens=40, extra_body=GREEDY, messages=messages, tools=tools, tool_choice={"type": "none"}) as stream:
    final = stream.get_final_message()
assert final.stop_reason != "tool_use" and any(b.type == "text" and b.text for b in final.content), final

# A streamed tool call arrives as a tool_use block whose input the SDK assembles.
with client.messages.stream(model=model, max_tokens=60, extra_body=GREEDY, messages=messages[:1], tools=tools, tool_choice={"type": "tool", "name": "get_weather"}) as stream:
    final = stream.get_final_message()
call = [b for b in final.content if b.type == "tool_use"]
assert final.stop_reason == "tool_use" and call and "city" in call[0].input, final

# Errors raise the SDK's classes.
try:
    client.messages.create(model=model, max_tokens=5, extra_body={"temperature": 3}, messages=ask)
    raise SystemExit("temperature=3 was accepted")
except anthropic.BadRequestError as e:
    assert e.status_code == 400 and e.body["error"]["type"] == "invalid_request_error", e
try:
    client.messages.create(model="gpt-nothing", max_tokens=5, messages=ask)
    raise SystemExit("an unknown model was accepted")
except anthropic.NotFoundError as e:
    assert e.status_code == 404, e
try:
    anthropic.Anthropic(base_url=base, api_key="wrong", max_retries=0).messages.create(model=model, max_tokens=5, messages=ask)
    raise SystemExit("a wrong key was accepted")
except anthropic.AuthenticationError as e:
    assert e.status_code == 401, e
try:
    client.messages.create(model=model, max_tokens=5, messages=[{"role": "user", "content": "word " * 5000}])
    raise SystemExit("a prompt over the context was accepted")
except anthropic.BadRequestError as e:
    assert "prompt is too long" in str(e), e

print(f"anthropic sdk: all checks passed ({turns}-turn tool loop)")
