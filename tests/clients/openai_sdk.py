"""hearth driven by the official OpenAI Python SDK, as a user's program would.

Usage: python3 openai_sdk.py BASE_URL API_KEY
Exits non-zero (with the failing check) if anything differs from what the SDK expects.
"""
import json
import sys

import openai
from openai import OpenAI
from pydantic import BaseModel

base, key = sys.argv[1], sys.argv[2]
client = OpenAI(base_url=base + "/v1", api_key=key, max_retries=0, timeout=120)
model = client.models.list().data[0].id
msgs = [{"role": "user", "content": "What is the capital of France?"}]

# Chat, whole and streamed.
r = client.chat.completions.create(model=model, messages=msgs, max_tokens=20, temperature=0)
whole = r.choices[0].message.content
assert whole and r.choices[0].finish_reason in ("stop", "length"), r
assert r.usage.prompt_tokens > 0 and r.usage.completion_tokens > 0, r.usage

stream = client.chat.completions.create(model=model, messages=msgs, max_tokens=20, temperature=0, stream=True, stream_options={"include_usage": True})
parts, usage, finish = [], None, None
for chunk in stream:
    if chunk.usage:
        usage = chunk.usage
    for c in chunk.choices:
        if c.delta.content:
            parts.append(c.delta.content)
        if c.finish_reason:
            finish = c.finish_reason
assert "".join(parts) == whole, ("".join(parts), whole)
assert usage is not None and usage.completion_tokens == r.usage.completion_tokens, usage
assert finish == r.choices[0].finish_reason

# Completions.
c = client.completions.create(model=model, prompt="The capital of France is", max_tokens=5, temperature=0)
assert c.choices[0].text and c.object == "text_completion", c

# n and logprobs.
r = client.chat.completions.create(model=model, messages=msgs, max_tokens=5, n=2, temperature=1, seed=3, logprobs=True, top_logprobs=2)
assert len(r.choices) == 2, r
assert r.choices[0].logprobs.content[0].top_logprobs[0].logprob <= 0

# Structured output through the SDK's parse helper.
class City(BaseModel):
    name: str
    country: str

parsed = client.beta.chat.completions.parse(model=model, messages=[{"role": "user", "content": "Name a city and its country."}], response_format=City, max_tokens=60, temperature=0)
city = parsed.choices[0].message.parsed
assert isinstance(city, City), parsed

# A tool-call round trip.
tools = [{"type": "function", "function": {"name": "get_weather", "description": "Current weather", "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]
ask = [{"role": "user", "content": "What is the weather in Oslo?"}]
r = client.chat.completions.create(model=model, messages=ask, tools=tools, tool_choice="required", max_tokens=60, temperature=0)
msg = r.choices[0].message
assert r.choices[0].finish_reason == "tool_calls" and msg.tool_calls, r
call = msg.tool_calls[0]
assert call.function.name == "get_weather" and "city" in json.loads(call.function.arguments)
follow = ask + [msg.model_dump(exclude_none=True), {"role": "tool", "tool_call_id": call.id, "content": json.dumps({"temp_c": 21})}]
r = client.chat.completions.create(model=model, messages=follow, tools=tools, max_tokens=30, temperature=0)
assert r.choices[0].message.content or r.choices[0].message.tool_calls, r

# Errors raise the SDK's exception classes.
try:
    client.chat.completions.create(model=model, messages=msgs, temperature=5)
    raise SystemExit("temperature=5 was accepted")
except openai.BadRequestError as e:
    assert e.status_code == 400 and "temperature" in str(e), e
try:
    OpenAI(base_url=base + "/v1", api_key="wrong", max_retries=0).models.list()
    raise SystemExit("a wrong API key was accepted")
except openai.AuthenticationError as e:
    assert e.status_code == 401, e
try:
    client.chat.completions.create(model="no-such-model", messages=msgs)
    raise SystemExit("an unknown model was accepted")
except openai.NotFoundError as e:
    assert e.status_code == 404 and e.code == "model_not_found", e
try:
    client.models.retrieve("no-such-model")
    raise SystemExit("an unknown model was described")
except openai.NotFoundError as e:
    assert e.status_code == 404, e
assert client.models.retrieve(model).id == model

# Requests over the server's limits are refused with the parameter named, never a crash.
wide = {"type": "object", "properties": {f"p{i}": {"type": "string"} for i in range(5000)}}
try:
    client.chat.completions.create(model=model, messages=msgs, response_format={"type": "json_schema", "json_schema": {"name": "wide", "schema": wide}})
    raise SystemExit("a 5,000-property schema was accepted")
except openai.BadRequestError as e:
    assert e.status_code == 400 and e.param == "response_format.json_schema.schema", e

# echo with max_tokens 0 scores the prompt: the prompt back, nothing generated.
c = client.completions.create(model=model, prompt="The capital of France is", max_tokens=0, echo=True)
assert c.choices[0].text == "The capital of France is" and c.usage.completion_tokens == 0, c

print("openai sdk: all checks passed")
