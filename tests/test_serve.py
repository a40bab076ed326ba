"""jaxgpt-serve: the OpenAI API (vLLM's form) over the engine. In process through the app (Starlette's test
client, the engine thread running): greedy text equals `generate`, streams equal their whole answers,
seeded sampling holds among concurrent requests, echo logprobs equal the full forward's log-softmax,
every bad input is a 4xx in OpenAI's error form (a body past the size limit a 413 left unread, a request
that can never fit a 400), a large body is parsed off the event loop, a bug's 500 is logged once, a
dropped stream frees its slot, a full queue answers 429 at once. One slow test runs `jaxgpt-serve` in a
subprocess against the `openai` client and SIGTERM (decoding speculatively with n-gram proposals: its
answers must still equal `generate`'s)."""

import asyncio
import collections
import json
import logging
import os
import re
import signal
import subprocess
import sys
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

pytest.importorskip("fastapi", reason="the server needs the serve extra")
from starlette.testclient import TestClient  # noqa: E402

import jaxgpt  # noqa: E402
from jaxgpt.data import CharTokenizer  # noqa: E402
from jaxgpt.engine import Engine  # noqa: E402
from jaxgpt.serve import create_app  # noqa: E402

CHARS = "\n !$&',-.3:;?ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz"
TOK = CharTokenizer(CHARS)
CFG = jaxgpt.GPTConfig(vocab_size=TOK.vocab_size, block_size=64, n_layer=2, n_head=2, n_embd=32)
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _params():
    from tests.helpers import varied_params
    return varied_params(CFG)


@pytest.fixture(scope="module")
def params():
    return _params()


@pytest.fixture(scope="module")
def client(params):
    app = create_app(Engine(params, CFG, slots=4, prefill_chunk=16), TOK, model_name="tiny", warmup=False)
    with TestClient(app, raise_server_exceptions=False) as c:
        _wait_healthy(c)
        yield c


def _wait_healthy(c):
    for _ in range(600):
        if c.get("/health").status_code == 200:
            return
        time.sleep(0.05)
    raise AssertionError("the server never became healthy")


def _greedy(params, text, n):
    ids = TOK.encode(text)
    out = jaxgpt.generate(params, CFG, np.array([ids]), n, jax.random.key(0), temperature=0.0)
    return TOK.decode(np.asarray(out.tokens[0, len(ids):]))


def _log_softmax(params, ids):
    return np.asarray(jax.nn.log_softmax(jaxgpt.GPT(CFG).apply({"params": params}, jnp.array([ids]))[0], -1))


def _stream_text(c, body):
    """(text per choice index, finish reasons, the raw event lines) of a streamed completion."""
    with c.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        lines = [ln for ln in r.iter_lines() if ln]
    assert lines[-1] == "data: [DONE]"
    texts, reasons = {}, {}
    for ln in lines[:-1]:
        for ch in json.loads(ln[len("data: "):])["choices"]:
            texts[ch["index"]] = texts.get(ch["index"], "") + ch["text"]
            if ch["finish_reason"]:
                reasons[ch["index"]] = ch["finish_reason"]
    return texts, reasons, lines


# -- the API ------------------------------------------------------------------------------------------

def test_health_models_and_not_ready_before_start(client, params):
    assert client.get("/health").status_code == 200
    models = client.get("/v1/models").json()
    assert models["object"] == "list" and models["data"][0]["id"] == "tiny"
    cold = create_app(Engine(params, CFG, slots=1, prefill_chunk=16), TOK, warmup=False)
    c = TestClient(cold, raise_server_exceptions=False)  # (no lifespan: the engine thread never starts)
    assert c.get("/health").status_code == 503
    r = c.post("/v1/completions", json={"prompt": "ab"})
    assert r.status_code == 503 and r.json()["error"]["code"] == 503


def test_greedy_completion_equals_generate_for_every_prompt_form(client, params):
    prompts = ["To be or", "KING:\n"]
    r = client.post("/v1/completions", json={"model": "tiny", "prompt": prompts, "max_tokens": 12,
                                             "temperature": 0})
    assert r.status_code == 200
    body = r.json()
    assert body["object"] == "text_completion" and body["id"].startswith("cmpl-")
    assert [ch["index"] for ch in body["choices"]] == [0, 1]
    for ch, p in zip(body["choices"], prompts):
        assert ch["text"] == _greedy(params, p, 12) and ch["finish_reason"] == "length"
    assert body["usage"] == {"prompt_tokens": 14, "completion_tokens": 24, "total_tokens": 38}
    # token ids, and lists of token ids, give the same text
    ids = [TOK.encode(p) for p in prompts]
    for prompt in (ids[0], ids):
        again = client.post("/v1/completions", json={"prompt": prompt, "max_tokens": 12, "temperature": 0}).json()
        assert [ch["text"] for ch in again["choices"]] == [ch["text"] for ch in body["choices"]][:len(again["choices"])]


def test_stream_concatenates_to_the_whole_answer(client):
    body = {"prompt": "To be", "max_tokens": 20, "temperature": 0.9, "top_k": 20, "seed": 7, "n": 2}
    whole = client.post("/v1/completions", json=body).json()
    texts, reasons, lines = _stream_text(client, {**body, "stream_options": {"include_usage": True}})
    assert texts == {ch["index"]: ch["text"] for ch in whole["choices"]}
    assert reasons == {0: "length", 1: "length"}
    assert texts[0] != texts[1]  # the n choices draw differently
    assert json.loads(lines[-2][6:])["usage"]["completion_tokens"] == 40


def test_seeded_sampling_is_reproducible_among_concurrent_requests(client):
    bodies = [{"prompt": p, "max_tokens": 16, "temperature": 1.0, "top_p": 0.9, "seed": s}
              for p, s in (("To be", 1), ("To be", 2), ("KING", 1), ("my lord", 5))]
    alone = [client.post("/v1/completions", json=b).json()["choices"][0]["text"] for b in bodies]
    results = [None] * (2 * len(bodies))

    def ask(i):
        results[i] = client.post("/v1/completions", json=bodies[i % len(bodies)]).json()["choices"][0]["text"]

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(len(results))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results == alone + alone
    assert alone[0] != alone[1]


def test_a_huge_top_k_among_concurrent_requests_harms_none(client):
    """top_k 2**31 overflowed the engine step's int32 arrays: a 500 for it and for the requests sharing its
    step, and every later step failed. It is refused at parsing now (a 400 on top_k: integer fields fit
    int32; a top_k within int32 but past the vocabulary is the vocabulary), and each of the concurrent
    requests beside it answers 200 with its text alone, and the server keeps serving."""
    bodies = [{"prompt": p, "max_tokens": 12, "temperature": 0.9, "seed": s}
              for p, s in (("To be", 1), ("KING", 2), ("my lord", 3), ("To be", 4))]
    alone = [client.post("/v1/completions", json=b).json()["choices"][0]["text"] for b in bodies]
    bodies.append({**bodies[0], "top_k": 2 ** 31})
    results = [None] * (2 * len(bodies))

    def ask(i):
        r = client.post("/v1/completions", json=bodies[i % len(bodies)])
        results[i] = (r.status_code, r.json()["choices"][0]["text"] if r.status_code == 200
                      else r.json()["error"]["param"])

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(len(results))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results == ([(200, text) for text in alone] + [(400, "top_k")]) * 2
    again = client.post("/v1/completions", json=bodies[1])
    assert again.status_code == 200 and again.json()["choices"][0]["text"] == alone[1]


def test_echo_logprobs_equal_the_full_forward(client, params):
    prompt = "To be or not"
    r = client.post("/v1/completions", json={"prompt": prompt, "max_tokens": 5, "temperature": 0, "echo": True,
                                             "logprobs": 3})
    ch = r.json()["choices"][0]
    lp = ch["logprobs"]
    ids = TOK.encode(ch["text"])
    assert ch["text"].startswith(prompt) and len(lp["tokens"]) == len(ids) == len(prompt) + 5
    assert lp["tokens"] == [TOK.decode([i]) for i in ids] and lp["text_offset"] == list(range(len(ids)))
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    rows = _log_softmax(params, ids)
    np.testing.assert_allclose(lp["token_logprobs"][1:], rows[np.arange(len(ids) - 1), ids[1:]], atol=1e-4)
    for pos in range(1, len(ids)):
        top = lp["top_logprobs"][pos]
        best = int(np.argmax(rows[pos - 1]))
        assert TOK.decode([best]) in top and top[TOK.decode([best])] == pytest.approx(rows[pos - 1, best], abs=1e-4)
    # lm-evaluation-harness's log-likelihood request: token ids, echo, logprobs 1, no new tokens
    r = client.post("/v1/completions", json={"prompt": ids[:8], "max_tokens": 0, "echo": True, "logprobs": 1,
                                             "temperature": 0})
    ch = r.json()["choices"][0]
    assert ch["text"] == TOK.decode(ids[:8]) and len(ch["logprobs"]["token_logprobs"]) == 8
    np.testing.assert_allclose(ch["logprobs"]["token_logprobs"][1:], rows[np.arange(7), ids[1:8]], atol=1e-4)


def test_stop_strings_cut_the_text_whole_and_streamed(client, params):
    full = _greedy(params, "To be", 20)
    stop = full[5:7]
    want = full[:full.find(stop)]
    body = {"prompt": "To be", "max_tokens": 20, "temperature": 0, "stop": [stop, "QQQ"]}
    ch = client.post("/v1/completions", json=body).json()["choices"][0]
    assert ch["text"] == want and ch["finish_reason"] == "stop"
    texts, reasons, _ = _stream_text(client, body)
    assert texts == {0: want} and reasons == {0: "stop"}


def test_a_calls_tokens_stream_as_one_chunk_with_the_whole_answers_logprobs(params):
    """With several decode steps a call, the tokens a call made reach the stream together, as one chunk per
    choice: the chunks still add up to the non-streamed answer, text and logprobs (tokens, offsets,
    alternatives), a stop string's cut included."""
    app = create_app(Engine(params, CFG, slots=2, prefill_chunk=16, decode_steps=4), TOK, model_name="tiny",
                     warmup=False)
    with TestClient(app, raise_server_exceptions=False) as c:
        _wait_healthy(c)
        body = {"prompt": "To be", "max_tokens": 19, "temperature": 0.9, "seed": 3, "n": 2, "logprobs": 2}
        whole = c.post("/v1/completions", json=body).json()["choices"]
        texts, reasons, lines = _stream_text(c, body)
        assert texts == {ch["index"]: ch["text"] for ch in whole} and reasons == {0: "length", 1: "length"}
        got = {0: collections.defaultdict(list), 1: collections.defaultdict(list)}
        sizes = []
        for ln in lines[:-1]:
            for ch in json.loads(ln[len("data: "):])["choices"]:
                if ch["logprobs"]:
                    sizes.append(len(ch["logprobs"]["tokens"]))
                    for key, values in ch["logprobs"].items():
                        got[ch["index"]][key] += values
        assert max(sizes) > 1 and sum(sizes) == 2 * 19  # a call's tokens in one chunk
        for ch in whole:  # (the same tokens; logprobs from other calls' programs: equal to 1e-5)
            mine, lp = got[ch["index"]], ch["logprobs"]
            assert (mine["tokens"], mine["text_offset"]) == (lp["tokens"], lp["text_offset"])
            np.testing.assert_allclose(mine["token_logprobs"], lp["token_logprobs"], atol=1e-5)
            assert [sorted(t) for t in mine["top_logprobs"]] == [sorted(t) for t in lp["top_logprobs"]]
            np.testing.assert_allclose([v for t in mine["top_logprobs"] for _, v in sorted(t.items())],
                                       [v for t in lp["top_logprobs"] for _, v in sorted(t.items())], atol=1e-5)
        full = whole[0]["text"]
        stop = full[6:8]
        cut = {"prompt": "To be", "max_tokens": 19, "temperature": 0.9, "seed": 3, "stop": [stop]}
        assert c.post("/v1/completions", json=cut).json()["choices"][0]["text"] == full[:full.find(stop)]
        assert _stream_text(c, cut)[:2] == ({0: full[:full.find(stop)]}, {0: "stop"})


@pytest.mark.parametrize("body, status, param", [
    ({"prompt": "ab", "max_tokens": -1}, 400, "max_tokens"),
    ({"prompt": "ab", "temperature": -0.5}, 400, "temperature"),
    ({"prompt": "ab", "top_p": 0}, 400, "top_p"),
    ({"prompt": "ab", "top_p": 1.5}, 400, "top_p"),
    ({"prompt": "ab", "n": 0}, 400, "n"),
    ({"prompt": "ab", "logprobs": 999}, 400, "logprobs"),
    ({"prompt": "ab", "stop": 3}, 400, "stop"),
    ({"prompt": "ab", "seed": 10 ** 30}, 400, "seed"),  # past a signed 64-bit integer (it was taken mod 2**31)
    ({"prompt": "ab", "seed": -2 ** 63 - 1}, 400, "seed"),
    ({"prompt": "a" * 65}, 400, "prompt"),            # longer than the context
    ({"prompt": "a" * 60, "max_tokens": 10}, 400, "max_tokens"),
    ({"prompt": "caf\u00e9"}, 400, "prompt"),          # a character the char tokenizer lacks
    ({"prompt": [1, 2, 999]}, 400, "prompt"),
    ({"prompt": ""}, 400, "prompt"),
    ({"prompt": {"x": 1}}, 400, "prompt"),
    ({}, 400, "prompt"),
    ({"prompt": "ab", "model": "gpt-4"}, 404, "model"),
    # integers: whole, and within int32 (seed: int64), a huge one not echoed whole; token ids in the vocabulary
    ({"prompt": "ab", "max_tokens": 1.5}, 400, "max_tokens"),
    ({"prompt": "ab", "max_tokens": 1e300}, 400, "max_tokens"),
    ({"prompt": "ab", "max_tokens": 10 ** 830}, 400, "max_tokens"),
    ({"prompt": "ab", "n": 1e300}, 400, "n"),
    ({"prompt": "ab", "top_k": 2 ** 31}, 400, "top_k"),
    ({"prompt": "ab", "seed": 10 ** 30}, 400, "seed"),
    ({"prompt": "ab", "logprobs": 2.5}, 400, "logprobs"),
    ({"prompt": "ab", "stop_token_ids": [999]}, 400, "stop_token_ids"),
    ({"prompt": ["a"] * 300, "max_tokens": 1}, 400, "prompt"),  # more than 4 slots + 256 waiting ever hold
])
def test_bad_inputs_are_openai_errors(client, body, status, param):
    r = client.post("/v1/completions", json=body)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["param"] == param and err["code"] == status and err["message"] and err["type"]
    assert len(err["message"]) < 250, err["message"]


def test_a_top_k_past_the_vocabulary_keeps_the_whole_vocabulary(client):
    body = {"prompt": "To be", "max_tokens": 6, "temperature": 1.0, "seed": 3}
    whole = client.post("/v1/completions", json={**body, "top_k": CFG.vocab_size}).json()["choices"][0]["text"]
    r = client.post("/v1/completions", json={**body, "top_k": 2 ** 31 - 1})
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == whole


def test_a_request_that_can_never_fit_is_a_400_naming_the_limit(params):
    """1 slot + 2 waiting: 4 completions can never be held at once, so no retry would help (not a 429). The
    app is not started: the 400 comes before the server's readiness, as every bad parameter's does."""
    app = create_app(Engine(params, CFG, slots=1, prefill_chunk=16), TOK, max_waiting=2, warmup=False)
    c = TestClient(app, raise_server_exceptions=False)
    for body, param in (({"prompt": "ab", "n": 4}, "n"), ({"prompt": ["ab", "cd"], "n": 2}, "prompt"),
                        ({"prompt": [[1], [2], [3], [4]], "max_tokens": 1}, "prompt")):
        r = c.post("/v1/completions", json=body)
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err["param"] == param and "(3: --slots 1 + --max_waiting 2)" in err["message"], err
    assert c.post("/v1/completions", json={"prompt": "ab", "n": 3}).status_code == 503  # fits: not refused


def test_malformed_requests_and_keys(client, params):
    for raw in (b"{not json", b"[1, 2]", b"\xff\xfe"):
        r = client.post("/v1/completions", content=raw, headers={"content-type": "application/json"})
        assert r.status_code == 400 and "error" in r.json()
    r = client.get("/v1/nothing")
    assert r.status_code == 404 and r.json()["error"]["code"] == 404
    r = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}]})
    assert r.status_code == 400 and "chat template" in r.json()["error"]["message"]
    keyed = TestClient(create_app(Engine(params, CFG, slots=1, prefill_chunk=16), TOK, api_key="sesame",
                                  warmup=False), raise_server_exceptions=False)
    assert keyed.post("/v1/completions", json={"prompt": "ab"}).status_code == 401
    wrong = keyed.get("/v1/models", headers={"Authorization": "Bearer nope"})
    assert wrong.status_code == 401 and wrong.json()["error"]["type"] == "AuthenticationError"
    assert keyed.get("/v1/models", headers={"Authorization": "Bearer sesame"}).status_code == 200


def _asgi_post(app, path, chunks, content_length=None):
    """POST `chunks` (the body's parts, as a chunked body arrives) to the ASGI app itself: (status, the answer's
    JSON, how many parts the app read)."""
    headers = [(b"content-type", b"application/json"), (b"host", b"t")]
    if content_length is not None:
        headers.append((b"content-length", str(content_length).encode()))
    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST", "scheme": "http",
             "path": path, "raw_path": path.encode(), "query_string": b"", "root_path": "", "headers": headers,
             "server": ("t", 80), "client": ("c", 1)}
    read, sent = [], []

    async def receive():
        if len(read) == len(chunks):
            await asyncio.sleep(3600)  # (the client stays; the test's wait_for ends a hang)
        read.append(chunks[len(read)])
        return {"type": "http.request", "body": read[-1], "more_body": len(read) < len(chunks)}

    async def send(message):
        sent.append(message)

    asyncio.run(asyncio.wait_for(app(scope, receive, send), 60))
    status = next(m["status"] for m in sent if m["type"] == "http.response.start")
    body = b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")
    return status, json.loads(body), len(read)


def test_a_body_past_the_limit_is_a_413_and_is_not_read_further(params):
    """--max_request_bytes (16 MiB by default; 1000 here): a larger body is a 413 in OpenAI's form, refused by
    its Content-Length before any of it is read, and without one (chunked) once what arrived passes the limit."""
    from jaxgpt.cli.serve import build_parser
    from jaxgpt.serve.app import MAX_REQUEST_BYTES

    assert build_parser().parse_args([]).max_request_bytes == MAX_REQUEST_BYTES == 16 * 2 ** 20
    app = create_app(Engine(params, CFG, slots=1, prefill_chunk=16), TOK, warmup=False, max_request_bytes=1000)
    c = TestClient(app, raise_server_exceptions=False)  # (/tokenize needs no engine thread)
    ok = c.post("/tokenize", json={"prompt": "a" * 900})
    assert ok.status_code == 200 and ok.json()["count"] == 900
    for r in (c.post("/tokenize", json={"prompt": "a" * 1000}),
              c.post("/v1/completions", content=(b'{"prompt": "' + b"a" * 300 + b'"' for _ in range(4)))):
        assert r.status_code == 413, r.text
        err = r.json()["error"]
        assert err["code"] == 413 and err["type"] and "1000 bytes" in err["message"]
    body = json.dumps({"prompt": "a" * 3000}).encode()
    parts = [body[i:i + 300] for i in range(0, len(body), 300)]
    for path in ("/v1/completions", "/tokenize"):
        status, answer, read = _asgi_post(app, path, parts, content_length=len(body))
        assert (status, answer["error"]["code"], read) == (413, 413, 0)  # by its Content-Length: nothing read
        status, answer, read = _asgi_post(app, path, parts)
        assert (status, answer["error"]["code"], read) == (413, 413, 4)  # chunked: 1200 bytes read, then no more
    status, answer, read = _asgi_post(app, "/tokenize", [b'{"prompt": ', b'"To be"}'])
    assert (status, answer["count"], read) == (200, 5, 2)


class _GatedTokenizer(CharTokenizer):
    """A char tokenizer whose `encode` of a long text waits until the test releases it (`released`: whether
    it was released rather than timed out); "boom" is a bug (a KeyError)."""

    def __init__(self, chars):
        super().__init__(chars)
        self.entered, self.release, self.released = threading.Event(), threading.Event(), None

    def encode(self, text):
        if text == "boom":
            raise KeyError("boom")
        if len(text) > 10_000:
            self.entered.set()
            self.released = self.release.wait(20)
        return super().encode(text)


@pytest.mark.parametrize("path, status", [("/tokenize", 200), ("/v1/completions", 400)])
def test_health_answers_while_a_large_request_is_tokenized(params, path, status):
    """A 100 KB prompt is parsed and tokenized on a worker thread: while its tokenizing waits, /health (on the
    same event loop) answers. On the loop itself it would hold /health until the tokenizing ended."""
    tok = _GatedTokenizer(CHARS)
    app = create_app(Engine(params, CFG, slots=1, prefill_chunk=16), tok, warmup=False)
    with TestClient(app, raise_server_exceptions=False) as c:
        _wait_healthy(c)
        big = {}
        thread = threading.Thread(target=lambda: big.update(r=c.post(path, json={"prompt": "a" * 100_000})))
        thread.start()
        try:
            assert tok.entered.wait(60)
            health = c.get("/health")  # the large request's tokenizing is still waiting for `release`
        finally:
            tok.release.set()
            thread.join(60)
    assert health.status_code == 200 and tok.released, "/health waited for the large request's tokenizing"
    assert big["r"].status_code == status  # (the completion: longer than the context)


def test_an_internal_error_is_logged_once_with_its_request_id(params):
    """A bug's 500: its traceback logged once, with the request id the answer gives; the exception does not
    leave the app (uvicorn would log it a second time; here the test client would raise it)."""
    app = create_app(Engine(params, CFG, slots=1, prefill_chunk=16), _GatedTokenizer(CHARS), warmup=False)
    records, handler, own = [], logging.Handler(logging.ERROR), logging.getLogger("jaxgpt.serve")
    handler.emit = records.append
    own.addHandler(handler)
    try:
        r = TestClient(app, raise_server_exceptions=True).post("/tokenize", json={"prompt": "boom"})
    finally:
        own.removeHandler(handler)
    assert r.status_code == 500 and r.json()["error"]["type"] == "InternalServerError"
    rid = re.search(r"KeyError; request id (\w+)", r.json()["error"]["message"]).group(1)
    assert len(records) == 1 and rid in records[0].getMessage() and records[0].exc_info


@pytest.mark.parametrize("flag", ["--port=70000", "--port=-1", "--slots=0", "--max_len=1", "--max_waiting=-1",
                                  "--max_request_bytes=0", "--speculative_k=16", "--grace_period=nan"])
def test_jaxgpt_serve_refuses_a_number_out_of_range_before_loading(flag, monkeypatch, capsys):
    """In one line, status 2, before it loads (or compiles) anything."""
    from jaxgpt.cli import serve

    def load(args):
        raise AssertionError("loaded the model before checking the flags")

    monkeypatch.setattr(serve, "_load", load)
    assert serve.main([flag, "--out_dir=/nonexistent", "--compile_cache=off"]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"jaxgpt-serve: {flag.split('=')[0]} must be"), lines


def test_tokenize_detokenize_and_tokenizer_info(client):
    r = client.post("/tokenize", json={"prompt": "To be", "add_special_tokens": False}).json()
    assert r == {"count": 5, "max_model_len": 64, "tokens": TOK.encode("To be"), "token_strs": None}
    assert client.post("/detokenize", json={"tokens": r["tokens"]}).json() == {"prompt": "To be"}
    assert client.post("/detokenize", json={"tokens": [999]}).status_code == 400
    assert client.post("/tokenize", json={"prompt": "\u00e9"}).status_code == 400
    info = client.get("/tokenizer_info").json()
    assert "eos_token" in info and info["model_max_length"] == 64


def test_metrics_count_requests_tokens_and_latencies(client):
    client.post("/v1/completions", json={"prompt": "ab", "max_tokens": 3, "temperature": 0})
    text = client.get("/metrics").text
    for name in ("jaxgpt_requests_total{outcome=\"length\"}", "jaxgpt_prompt_tokens_total",
                 "jaxgpt_generation_tokens_total", "jaxgpt_requests_running", "jaxgpt_requests_waiting",
                 "jaxgpt_time_to_first_token_seconds_count", "jaxgpt_inter_token_latency_seconds_count"):
        assert name in text, name
    value = float(re.search(r"^jaxgpt_generation_tokens_total (\S+)$", text, re.M).group(1))
    assert value >= 3
    assert re.search(r"^jaxgpt_requests_running 0\.0$", text, re.M)
    # the engine's own counters: its first token from the prefill, the other two from decode steps
    engine = {m[0]: float(m[1]) for m in re.findall(r"^jaxgpt_engine_(\w+)_total (\S+)$", text, re.M)}
    assert engine["prefill_calls"] >= 1 and engine["decode_steps"] >= 2 and engine["decode_seconds"] > 0
    assert engine["decode_rows"] <= engine["decode_width"] and engine["prefill_tokens"] >= 2, engine


# -- chat, end tokens ---------------------------------------------------------------------------------

TEMPLATE = ("{% for m in messages %}{{ m['role'] | upper }}: {{ m['content'] }}\n{% endfor %}"
            "{% if add_generation_prompt %}ASSISTANT: {% endif %}")


def test_chat_with_a_template_and_the_end_token(params):
    tok = CharTokenizer(CHARS)
    rendered = "USER: hi\nASSISTANT: "
    greedy = _greedy(params, rendered, 12)
    tok.eos_id = TOK.encode(greedy[4])[0]  # the end token: the greedy text's fifth character
    app = create_app(Engine(params, CFG, slots=2, prefill_chunk=16), tok, model_name="tiny", warmup=False,
                     chat_template=TEMPLATE)
    with TestClient(app, raise_server_exceptions=False) as c:
        _wait_healthy(c)
        msgs = [{"role": "user", "content": "hi"}]
        r = c.post("/v1/chat/completions", json={"messages": msgs, "max_tokens": 12, "temperature": 0}).json()
        ch = r["choices"][0]
        assert r["object"] == "chat.completion" and ch["message"]["role"] == "assistant"
        assert ch["message"]["content"] == greedy[:greedy.find(greedy[4])] and ch["finish_reason"] == "stop"
        r = c.post("/v1/chat/completions", json={"messages": msgs, "max_tokens": 12, "temperature": 0,
                                                 "ignore_eos": True, "logprobs": True, "top_logprobs": 2}).json()
        ch = r["choices"][0]
        assert ch["message"]["content"] == greedy and ch["finish_reason"] == "length"
        assert len(ch["logprobs"]["content"]) == 12 and len(ch["logprobs"]["content"][0]["top_logprobs"]) == 2
        with c.stream("POST", "/v1/chat/completions", json={"messages": msgs, "max_tokens": 12, "temperature": 0,
                                                            "ignore_eos": True, "stream": True}) as s:
            chunks = [json.loads(ln[6:]) for ln in s.iter_lines() if ln and ln != "data: [DONE]"]
        assert "".join(ch["choices"][0]["delta"].get("content", "") for ch in chunks) == greedy
        assert c.post("/tokenize", json={"messages": msgs}).json()["count"] == len(rendered)
        r = c.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "a" * 80}]})
        assert r.status_code == 400 and r.json()["error"]["param"] == "messages"  # past the context


# -- load and faults ----------------------------------------------------------------------------------

def test_a_full_queue_answers_429_at_once(params):
    """Capacity 1 (one slot, none waiting) taken by a request the engine thread has not picked up."""
    import httpx

    app = create_app(Engine(params, CFG, slots=1, prefill_chunk=16), TOK, max_waiting=0, warmup=False)
    worker = app.state.service.worker
    worker.ready.set()  # (its thread starts below: until then nothing completes)

    async def scenario():
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as c:
            first = asyncio.create_task(c.post("/v1/completions", json={"prompt": "ab", "max_tokens": 3}))
            while worker.num_waiting == 0:
                await asyncio.sleep(0.01)
            t0 = time.perf_counter()
            second = await c.post("/v1/completions", json={"prompt": "ab", "max_tokens": 3})
            waited = time.perf_counter() - t0
            worker.start()
            return (await first), second, waited

    try:
        first, second, waited = asyncio.run(scenario())
    finally:
        worker.stop()
    assert second.status_code == 429 and second.json()["error"]["code"] == 429 and waited < 2
    assert first.status_code == 200 and first.json()["choices"][0]["finish_reason"] == "length"


def test_a_dropped_stream_cancels_its_request(client):
    """The ASGI app called directly: the client disconnects after the first event."""
    app, worker = client.app, client.app.state.service.worker
    body = json.dumps({"prompt": "To be", "max_tokens": 50, "temperature": 0, "stream": True}).encode()
    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST", "scheme": "http",
             "path": "/v1/completions", "raw_path": b"/v1/completions", "query_string": b"", "root_path": "",
             "headers": [(b"content-type", b"application/json"), (b"host", b"t")], "server": ("t", 80),
             "client": ("c", 1)}

    def cancelled():
        m = re.search(r'^jaxgpt_requests_total\{outcome="cancelled"\} (\S+)$', client.get("/metrics").text, re.M)
        return float(m.group(1)) if m else 0.0

    before = cancelled()

    async def scenario():
        gone, chunks, sent_body = asyncio.Event(), [], []

        async def receive():
            if not sent_body:
                sent_body.append(True)
                return {"type": "http.request", "body": body, "more_body": False}
            await gone.wait()
            return {"type": "http.disconnect"}

        async def send(message):
            if message["type"] == "http.response.body" and message.get("body"):
                chunks.append(message["body"])
                gone.set()

        await asyncio.wait_for(app(scope, receive, send), 30)
        return chunks

    chunks = asyncio.run(scenario())
    assert chunks[0].startswith(b"data: {") and len(chunks) < 50 and b"[DONE]" not in b"".join(chunks)
    for _ in range(200):  # the engine thread takes the cancel at its next step
        if cancelled() == before + 1 and worker.num_running == 0:
            break
        time.sleep(0.02)
    assert cancelled() == before + 1 and worker.num_running == 0


# -- the real thing -----------------------------------------------------------------------------------

def _write_run(folder, params):
    from jaxgpt.checkpoint import Checkpointer
    ck = Checkpointer(str(folder))
    ck.save(1, {"params": params}, {"step": 1, "model": CFG.to_dict(), "tokenizer": TOK.to_dict()})
    ck.wait()
    ck.close()


def _start_server(run, *flags, env=None):
    proc = subprocess.Popen([sys.executable, "-m", "jaxgpt.cli.serve", f"--out_dir={run}", "--port=0", *flags],
                            cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=None if env is None else {**os.environ, **env})
    err = []
    threading.Thread(target=lambda: err.extend(proc.stderr), daemon=True).start()  # (never blocks on a pipe)
    line = proc.stdout.readline()
    m = re.search(r"ready at (http://127\.0\.0\.1:\d+)/v1", line)
    if not m:
        proc.kill()
        raise AssertionError(f"no ready line: {line!r}\n{''.join(err)[-3000:]}")
    proc.ready_line = line
    return proc, m.group(1), err


@pytest.mark.slow
@pytest.mark.parametrize("engine", ["paged", "slots"])
def test_jaxgpt_serve_with_the_openai_client(tmp_path, params, engine):
    import httpx
    import openai

    _write_run(tmp_path / "run", params)
    hold = tmp_path / "hold"  # while it exists the server's engine takes no step (tests/serve_hold.py)
    # the default engine (paged, its programs compiled in the background), or the slots one with its own
    # flags (--speculative picks it)
    own = ["--prefill_chunk=16", "--speculative=ngram", "--speculative_k=3"] if engine == "slots" else []
    proc, url, err = _start_server(tmp_path / "run", "--slots=2", "--max_waiting=1", *own,
                                   "--api_key=sesame", "--served_model_name=tiny", "--grace_period=30",
                                   "--import=tests.serve_hold", "--log_requests", env={"JAXGPT_TEST_HOLD": str(hold)})
    try:
        assert "; CPU dispatch async)" in proc.ready_line  # (the default: --cpu_dispatch=async)
        assert f"; {engine} engine: " in proc.ready_line
        ready = (r"the engine's programs are ready \(\d+\.\d s\)" if engine == "slots" else
                 r"ready with the largest step's programs \(\d+\.\d s\); the other \d+ are compiled")
        for _ in range(100):  # the warm-up said what it does, on stderr (stdout's first line is the ready one)
            if any(re.search(ready, line) for line in err):
                break
            time.sleep(0.05)
        said = [re.search(r"compiling the engine's (\d+) programs", line) for line in err]
        assert any(m and int(m.group(1)) > 0 for m in said), "".join(err)[-2000:]
        assert any(re.search(ready, line) for line in err), "".join(err)[-2000:]
        c = openai.OpenAI(base_url=url + "/v1", api_key="sesame", max_retries=0, timeout=60)
        assert httpx.get(url + "/health").status_code == 200
        r = c.completions.create(model="tiny", prompt="To be or", max_tokens=12, temperature=0)
        assert r.choices[0].text == _greedy(params, "To be or", 12)
        logged = f"jaxgpt.serve: completion prompt=['To be or'] output=[{r.choices[0].text!r}]"
        for _ in range(100):  # --log_requests: the prompt and the output, on stderr
            if any(logged in line for line in err):
                break
            time.sleep(0.05)
        else:
            raise AssertionError("no request log line: " + "".join(err)[-2000:])
        args = dict(model="tiny", prompt="KING", max_tokens=16, temperature=0.9, seed=4)
        whole = c.completions.create(**args).choices[0].text
        assert "".join(ch.choices[0].text for ch in c.completions.create(**args, stream=True)) == whole

        outs = [None] * 4  # seeded sampling among concurrent requests: 2 slots, 1 waiting, 1 retried on 429

        def ask(i):
            for _ in range(50):
                try:
                    outs[i] = c.completions.create(**args).choices[0].text
                    return
                except openai.RateLimitError:
                    time.sleep(0.05)

        threads = [threading.Thread(target=ask, args=(i,)) for i in range(4)]
        [t.start() for t in threads]
        [t.join() for t in threads]
        assert outs == [whole] * 4

        lp = c.completions.create(model="tiny", prompt="To be", max_tokens=4, temperature=0, echo=True,
                                  logprobs=2).choices[0].logprobs
        ids = TOK.encode("".join(lp.tokens))
        rows = _log_softmax(params, ids)
        assert lp.token_logprobs[0] is None
        np.testing.assert_allclose(lp.token_logprobs[1:], rows[np.arange(len(ids) - 1), ids[1:]], atol=1e-4)

        bad = openai.BadRequestError
        for kw, error in ((dict(max_tokens=-1), bad), (dict(temperature=-1), bad), (dict(top_p=2.0), bad),
                          (dict(n=0), bad), (dict(prompt="a" * 70), bad), (dict(prompt="\u00e9"), bad),
                          (dict(model="nope"), openai.NotFoundError)):
            with pytest.raises(error):
                c.completions.create(**{"model": "tiny", "prompt": "ab", **kw})
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=url + "/v1", api_key="wrong", max_retries=0).models.list()
        with pytest.raises(openai.BadRequestError, match="chat template"):
            c.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}])

        # the README's openai example as written, pointed at this server
        from tests.helpers import doc_example
        readme = doc_example("README.md", "With the `openai` package")
        ns = {}
        exec(readme.replace("http://127.0.0.1:8000", url).replace('"unused"', '"sesame"')
             .replace('"out-shakespeare-char"', '"tiny"'), ns)
        assert ns["text"] == _greedy(params, "ROMEO:", 32)

        assert re.search(r"^jaxgpt_speculative_proposed_tokens \d", httpx.get(url + "/metrics").text, re.M)
        _dropped_streams_and_a_full_queue(c, url, hold)
        _sigterm_finishes_the_request_in_flight(c, proc)
        assert proc.wait(60) == 0, "".join(err)[-3000:]
    finally:
        if proc.poll() is None:
            proc.kill()


def _dropped_streams_and_a_full_queue(c, url, hold):
    """With the engine held, three streams take the 2 slots and the 1 waiting place; a fourth request is
    refused at once; the three dropped streams count as cancelled and free their slots once it steps."""
    import httpx
    import openai

    def metric(pattern):
        return re.search(pattern, httpx.get(url + "/metrics").text, re.M)

    hold.touch()
    try:
        streams = [c.completions.create(model="tiny", prompt="To be", max_tokens=55, temperature=0, stream=True)
                   for _ in range(3)]  # (the answer's headers come before its first token)
        t0 = time.perf_counter()
        with pytest.raises(openai.RateLimitError):
            c.completions.create(model="tiny", prompt="ab", max_tokens=2)
        assert time.perf_counter() - t0 < 5
        for s in streams:
            s.close()
        for _ in range(300):  # the server sees each disconnect while the engine is still held
            if metric(r'^jaxgpt_requests_total\{outcome="cancelled"\} 3\.0$'):
                break
            time.sleep(0.05)
        assert metric(r'^jaxgpt_requests_total\{outcome="cancelled"\} 3\.0$'), httpx.get(url + "/metrics").text
    finally:
        hold.unlink()
    for _ in range(300):
        if metric(r"^jaxgpt_requests_running 0\.0$") and metric(r"^jaxgpt_requests_waiting 0\.0$"):
            break
        time.sleep(0.05)
    assert metric(r"^jaxgpt_requests_running 0\.0$") and metric(r"^jaxgpt_requests_waiting 0\.0$")
    assert c.completions.create(model="tiny", prompt="ab", max_tokens=2, temperature=0).choices[0].text


def _sigterm_finishes_the_request_in_flight(c, proc):
    stream = c.completions.create(model="tiny", prompt="To be", max_tokens=50, temperature=0, stream=True)
    chunks = iter(stream)
    text = next(chunks).choices[0].text
    proc.send_signal(signal.SIGTERM)
    last = None
    for ch in chunks:
        text += ch.choices[0].text
        last = ch.choices[0].finish_reason or last
    assert last == "length" and len(text) == 50


def test_a_hugging_face_folder_is_served_with_its_tokenizer_and_template(tmp_path):
    from jaxgpt.cli import serve
    from jaxgpt.data import BPETokenizer

    tok = BPETokenizer.train(["the king is dead long live the queen"] * 20, 300)
    cfg = jaxgpt.GPTConfig(vocab_size=tok.vocab_size, block_size=32, n_layer=1, n_head=2, n_embd=16)
    jaxgpt.save_pretrained(jaxgpt.init_params(cfg, jax.random.key(0)), cfg, tmp_path / "hf")
    (tmp_path / "hf" / "tokenizer.json").write_text(tok.to_dict()["tokenizer_json"])
    (tmp_path / "hf" / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|endoftext|>",
                                                                       "chat_template": TEMPLATE}))
    config, _, served, name, template = serve._load(serve.build_parser().parse_args([f"--init_from={tmp_path / 'hf'}"]))
    assert config.vocab_size == served.vocab_size and name == "hf" and template == TEMPLATE
    assert served.eos_id == tok.eos_id and served.encode("the king") == tok.encode("the king")


_FAULTS_SCRIPT = """
import ctypes, resource, sys, threading
if sys.argv[1] == "1":
    from jaxgpt.backends.cpu import single_malloc_arena
    assert single_malloc_arena()
from jaxgpt.backends.cpu import tune_allocator
tune_allocator()  # (every backend's setup)
libc = ctypes.CDLL(None)
libc.malloc.restype = ctypes.c_void_p
libc.free.argtypes = [ctypes.c_void_p]
size = 32 << 20
def step():  # a call's temporaries: 96 MB in all, more than one heap of a thread's arena (64 MB) holds
    blocks = [libc.malloc(size) for _ in range(3)]
    for b in blocks:
        ctypes.memset(b, 1, size)
    for b in blocks:
        libc.free(b)
def run():  # on a thread of its own, as jaxgpt-serve's engine steps
    step()
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(8):
        step()
    print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
t = threading.Thread(target=run)
t.start()
t.join()
"""


@pytest.mark.skipif(sys.platform != "linux" or os.confstr("CS_GNU_LIBC_VERSION") is None
                    or "MALLOC_ARENA_MAX" in os.environ, reason="glibc's malloc arenas")
def test_an_engine_thread_in_one_malloc_arena_keeps_its_temporaries():
    """jaxgpt-serve's engine steps on a thread of its own; in that thread's own glibc arena a step's freed
    temporaries, once more than one of the arena's heaps holds, went back to the OS and the next step faulted
    them in again (GPT-2 124M at 32 rows: bench/README.md). single_malloc_arena (the CLI's first call) keeps
    them in the main arena, whose thresholds tune_allocator raised: those page faults go."""
    def faults(one_arena):
        env = {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": ""}
        p = subprocess.run([sys.executable, "-c", _FAULTS_SCRIPT, "1" if one_arena else "0"], cwd=REPO, env=env,
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, timeout=600)
        assert p.returncode == 0, p.stderr[-3000:]
        return int(p.stdout.split()[-1])

    own, shared = faults(False), faults(True)
    assert shared * 50 < own, (own, shared)


@pytest.mark.parametrize("spec, match", [("3", "must be 'START:STOP'"), ("2:2", "needs 0 <= START < STOP")])
def test_jaxgpt_serve_refuses_a_bad_profile_window_before_loading(spec, match, monkeypatch, capsys):
    from jaxgpt.cli import serve

    monkeypatch.setattr(serve, "_load", lambda args: pytest.fail("loaded the model before checking --profile"))
    assert serve.main([f"--profile={spec}", "--out_dir=/nonexistent", "--compile_cache=off"]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"jaxgpt-serve: --profile: {match}"), lines


def test_profile_traces_a_window_of_engine_steps(params, tmp_path):
    """--profile 1:3: the trace (made as jaxgpt-serve makes it from its flags) holds engine steps 1 and 2, each
    annotated, and the engine's programs; the requests' answers are unchanged by it."""
    from jaxgpt.cli import serve
    from tests.test_profiling import _trace

    folder = str(tmp_path / "prof")
    profiler = serve._profiler(serve.build_parser().parse_args(["--profile", "1:3", f"--profile_dir={folder}"]))
    app = create_app(Engine(params, CFG, slots=2, prefill_chunk=16), TOK, model_name="tiny", warmup=False,
                     profiler=profiler)
    with TestClient(app) as c:
        _wait_healthy(c)
        for prompt in ["ROMEO:", "To be"]:
            r = c.post("/v1/completions", json={"prompt": prompt, "max_tokens": 6, "temperature": 0})
            assert r.status_code == 200 and r.json()["choices"][0]["text"] == _greedy(params, prompt, 6)
    assert profiler.done and not profiler.active
    xplane, events = _trace(folder)
    steps = sorted(int(e["args"]["step_num"]) for e in events if e.get("name") == "engine")
    assert steps == [1, 2]
    assert b"engine" in xplane and b"jit_" in xplane  # the annotations and the engine's compiled calls


# -- the paged engine behind the same server -----------------------------------------------------------

@pytest.fixture(scope="module")
def paged_client(params):
    from jaxgpt.engine.paged import PagedEngine
    engine = PagedEngine(params, CFG, max_requests=4, page_size=8, token_budget=32)
    with TestClient(create_app(engine, TOK, model_name="tiny", warmup=False), raise_server_exceptions=False) as c:
        _wait_healthy(c)
        yield c


@pytest.mark.parametrize("test", [test_greedy_completion_equals_generate_for_every_prompt_form,
                                  test_stream_concatenates_to_the_whole_answer,
                                  test_seeded_sampling_is_reproducible_among_concurrent_requests,
                                  test_echo_logprobs_equal_the_full_forward, test_a_dropped_stream_cancels_its_request],
                         ids=lambda f: f.__name__[5:])
def test_the_paged_engine_serves_as_the_slots_engine_does(paged_client, params, test):
    import inspect
    test(*[dict(client=paged_client, params=params)[a] for a in inspect.signature(test).parameters])


def test_the_paged_engines_counters_in_metrics(paged_client):
    prompt = "To be or not to be, that is the question"  # 40 characters: 5 full pages of 8 for the second
    for _ in range(2):
        assert paged_client.post("/v1/completions", json={"prompt": prompt, "max_tokens": 3}).status_code == 200
    text = paged_client.get("/metrics").text
    engine = {m[0]: float(m[1]) for m in re.findall(r"^jaxgpt_engine_(\w+)_total (\S+)$", text, re.M)}
    assert engine["steps"] >= 3 and engine["step_seconds"] > 0 and engine["decode_tokens"] >= 2, engine
    assert engine["prefix_hits"] >= 32 and engine["prefix_queries"] >= 2 * 40, engine


def test_the_paged_engine_answers_while_it_compiles_its_other_programs(params):
    # warmup="background" (jaxgpt-serve --compile=background, the default): /health says ready once the
    # largest step's programs are compiled; the others (held back here until the test's signal) are counted
    # in /metrics while requests are answered, exactly, by the compiled ones
    from jaxgpt.engine.paged import PagedEngine
    engine = PagedEngine(params, CFG, max_requests=3, page_size=8, token_budget=24)  # (sizes of its own)
    compile_one, largest, go = engine.programs._compile_one, engine.shapes[-1], threading.Event()
    engine.programs._compile_one = (lambda *call: compile_one(*call) if call[0] == largest
                                    else (go.wait(60), compile_one(*call)))
    with TestClient(create_app(engine, TOK, model_name="tiny", warmup="background"),
                    raise_server_exceptions=False) as c:
        _wait_healthy(c)
        pending = engine.warmup_programs() - 2
        assert pending > 0 and f"jaxgpt_engine_programs_pending {float(pending)}" in c.get("/metrics").text
        r = c.post("/v1/completions", json={"prompt": "To be", "max_tokens": 6, "temperature": 0})
        assert r.status_code == 200 and r.json()["choices"][0]["text"] == _greedy(params, "To be", 6)
        go.set()
        assert engine.programs.join(timeout=300) and engine.programs.failed is None
        assert "jaxgpt_engine_programs_pending 0.0" in c.get("/metrics").text
