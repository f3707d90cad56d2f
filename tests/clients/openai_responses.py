"""hearth's Responses API driven by the official OpenAI Python SDK, as Codex CLI and the
Agents SDK use it.

Usage: python3 openai_responses.py BASE_URL API_KEY [TURNS]
Exits non-zero (with the failing check) if anything differs from what the SDK expects.
TURNS (default 10) is the length of the tool-calling agent loop.
"""
import json
import sys

import openai
from openai import OpenAI

base, key = sys.argv[1], sys.argv[2]
turns = int(sys.argv[3]) if len(sys.argv) > 3 else 10
client = OpenAI(base_url=base + "/v1", api_key=key, max_retries=0, timeout=300)
model = client.models.list().data[0].id

# A response, whole and streamed: the same text.
r = client.responses.create(model=model, input="What is the capital of France?", instructions="You are concise.", max_output_tokens=24, temperature=0)
assert r.object == "response" and r.status in ("completed", "incomplete") and r.output_text, r
assert r.usage.input_tokens > 0 and r.usage.output_tokens > 0 and r.usage.total_tokens == r.usage.input_tokens + r.usage.output_tokens, r.usage
with client.responses.stream(model=model, input="What is the capital of France?", instructions="You are concise.", max_output_tokens=24, temperature=0) as s:
    deltas = [e.delta for e in s if e.type == "response.output_text.delta"]
    final = s.get_final_response()
assert "".join(deltas) == r.output_text == final.output_text, (deltas, r.output_text, final.output_text)

# Stored responses: retrieve, continue, delete.
assert client.responses.retrieve(r.id).output_text == r.output_text
r2 = client.responses.create(model=model, input="And of Germany?", previous_response_id=r.id, max_output_tokens=16, temperature=0)
assert r2.previous_response_id == r.id and r2.usage.input_tokens > r.usage.input_tokens, (r2.usage, r.usage)
client.responses.delete(r2.id)
try:
    client.responses.retrieve(r2.id)
    raise SystemExit("a deleted response was found")
except openai.NotFoundError:
    pass

# Structured output.
schema = {"type": "object", "properties": {"city": {"type": "string"}, "country": {"type": "string"}}, "required": ["city", "country"], "additionalProperties": False}
j = client.responses.create(model=model, input="Name a city and its country.", text={"format": {"type": "json_schema", "name": "city", "schema": schema, "strict": True}}, max_output_tokens=60, temperature=0)
assert set(json.loads(j.output_text)) == {"city", "country"}, j.output_text

# A tool-calling agent loop chained by previous_response_id: each turn the model must call
# the function (grammar-enforced), its output goes back, and at the end it answers in text.
tools = [{"type": "function", "name": "get_weather", "description": "Current weather in a city", "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}]
prev = None
nxt = "What is the weather in Oslo?"
for turn in range(turns):
    r = client.responses.create(model=model, input=nxt, tools=tools, tool_choice="required", previous_response_id=prev, max_output_tokens=60, temperature=0, parallel_tool_calls=False)
    calls = [o for o in r.output if o.type == "function_call"]
    assert len(calls) == 1 and calls[0].name == "get_weather" and "city" in json.loads(calls[0].arguments), r.output
    prev = r.id
    nxt = [{"type": "function_call_output", "call_id": calls[0].call_id, "output": json.dumps({"temp_c": 20 + turn})}]
final = client.responses.create(model=model, input=nxt, tools=tools, tool_choice="none", previous_response_id=prev, max_output_tokens=30, temperature=0)
assert final.output_text and not [o for o in final.output if o.type == "function_call"], final.output

# Codex's shape: stateless (store false), streamed, the whole history as items (developer
# message, earlier call and its output), hosted tools beside the functions; items arrive
# through response.output_item.done and the stream ends after response.completed.
history = [
    {"type": "message", "role": "developer", "content": [{"type": "input_text", "text": "You are a coding agent."}]},
    {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "What is the weather in Oslo?"}]},
    {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": "{\"city\": \"Oslo\"}"},
    {"type": "function_call_output", "call_id": "call_1", "output": "{\"temp_c\": 21}"},
]
stream = client.responses.create(model=model, input=history, instructions="Answer briefly.", tools=tools + [{"type": "web_search"}], tool_choice="auto", store=False, stream=True, include=["reasoning.encrypted_content"], max_output_tokens=40, temperature=0)
kinds, items, seqs, done_id = [], [], [], None
for e in stream:
    kinds.append(e.type)
    seqs.append(e.sequence_number)
    if e.type == "response.output_item.done":
        items.append(e.item)
    if e.type in ("response.completed", "response.incomplete"):
        done_id = e.response.id
assert kinds[0] == "response.created" and kinds[-1] in ("response.completed", "response.incomplete"), kinds
assert seqs == list(range(len(seqs))), seqs
assert items, kinds
try:
    client.responses.retrieve(done_id)
    raise SystemExit("a store=false response was kept")
except openai.NotFoundError:
    pass

# Errors raise the SDK's classes.
try:
    client.responses.create(model=model, input="hi", temperature=5)
    raise SystemExit("temperature=5 was accepted")
except openai.BadRequestError as e:
    assert e.status_code == 400, e
try:
    client.responses.create(model="no-such-model", input="hi")
    raise SystemExit("an unknown model was accepted")
except openai.NotFoundError:
    pass
try:
    client.responses.create(model=model, input="hi", previous_response_id="resp_missing")
    raise SystemExit("a missing previous response was accepted")
except openai.BadRequestError as e:
    assert e.param == "previous_response_id", e

print(f"openai responses: all checks passed ({turns}-turn tool loop)")
