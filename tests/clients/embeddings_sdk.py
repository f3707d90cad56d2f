"""hearth's embeddings driven by the official `openai` SDK (as LangChain, LlamaIndex and Open
WebUI's RAG use it) and the `ollama` client (`embed`, `embeddings`, as Ollama's RAG users do).

Usage: python3 embeddings_sdk.py BASE_URL API_KEY
Exits non-zero (with the failing check) if anything differs from what the clients expect.
The server must serve an embedding model (`--embedding-model`).
"""
import math
import sys

import ollama
import openai

base, key = sys.argv[1], sys.argv[2]
client = openai.OpenAI(base_url=base + "/v1", api_key=key, max_retries=0, timeout=300)
oll = ollama.Client(host=base, headers={"Authorization": f"Bearer {key}"}, timeout=300)


def close(a, b, tol=1e-3):
    return len(a) == len(b) and all(abs(x - y) <= 1e-4 + tol * abs(y) for x, y in zip(a, b))


def unit(v):
    n = math.sqrt(sum(x * x for x in v))
    return [x / n for x in v]


# The embedding model is listed with what it does, after the chat model.
models = client.models.list().data
embedders = [m for m in models if "embeddings" in (getattr(m, "capabilities", None) or m.model_extra.get("capabilities", []))]
assert len(models) == 2 and len(embedders) == 1, models
model = embedders[0].id
assert client.models.retrieve(model).id == model

texts = [
    "Halda assigns each device a window of layers.",
    "The ring passes activations from device to device.",
    "A phone, a laptop and a desktop share one model.",
]
# The SDK asks for base64 by default and decodes it itself.
r = client.embeddings.create(model=model, input=texts)
assert [d.index for d in r.data] == [0, 1, 2] and r.model == model and r.object == "list", r
vectors = [d.embedding for d in r.data]
dims = len(vectors[0])
assert dims > 0 and all(len(v) == dims for v in vectors)
assert all(abs(math.sqrt(sum(x * x for x in v)) - 1) < 1e-4 for v in vectors), "not unit length"
assert r.usage.prompt_tokens > 0 and r.usage.total_tokens == r.usage.prompt_tokens, r.usage
floats = client.embeddings.create(model=model, input=texts, encoding_format="float")
assert all(close(a.embedding, b) for a, b in zip(floats.data, vectors)), "float and base64 differ"
# One string, and tokens as ids.
one = client.embeddings.create(model=model, input=texts[0]).data
assert len(one) == 1 and close(one[0].embedding, vectors[0])
# Matryoshka: a shorter vector, normalised again.
short = client.embeddings.create(model=model, input=texts[0], dimensions=16).data[0].embedding
assert len(short) == 16 and close(short, unit(vectors[0][:16])), short
# Similar texts are nearer than unrelated ones would be by chance: at least they differ.
assert not close(vectors[0], vectors[1]), "two texts gave one vector"

# Errors the SDK raises as its own exceptions.
try:
    client.embeddings.create(model=model, input="")
    raise AssertionError("an empty input was accepted")
except openai.BadRequestError as e:
    assert e.status_code == 400 and "empty" in str(e), e
try:
    client.embeddings.create(model="no-such-model", input="a")
    raise AssertionError("an unknown model was accepted")
except openai.NotFoundError as e:
    assert e.status_code == 404, e

# Ollama: embed (normalised, as Ollama's), embeddings (the older, raw route), list, show.
names = [m.model for m in oll.list().models]
assert f"{model}:latest" in names, names
shown = oll.show(f"{model}:latest")
assert "embedding" in (shown.capabilities or []), shown
e = oll.embed(model=model, input=texts)
assert len(e.embeddings) == 3 and all(close(a, b) for a, b in zip(e.embeddings, vectors)), "ollama embed differs from /v1/embeddings"
e1 = oll.embed(model=f"{model}:latest", input=texts[1])
assert len(e1.embeddings) == 1 and close(e1.embeddings[0], vectors[1])
old = oll.embeddings(model=model, prompt=texts[2]).embedding
assert close(unit(old), vectors[2]), "the older route points another way"
try:
    oll.embed(model="no-such-model", input="a")
    raise AssertionError("an unknown model was accepted")
except ollama.ResponseError as err:
    assert err.status_code == 404, err

print(f"embeddings: {len(texts)} inputs of {dims} values; all checks passed")
