"""The HTTP side: an OpenAI-compatible API (vLLM's form) over the engine thread.

It turns requests into token ids and `Request` settings, hands them to the `EngineWorker` and turns the
events it gets back into JSON or server-sent events. It knows nothing of slots or of the device.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import logging
import random
import time
import uuid
from typing import Optional, Union

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException as StarletteHTTPException

from jaxgpt.engine import Engine
from jaxgpt.serve import output, protocol
from jaxgpt.serve.metrics import Metrics
from jaxgpt.serve.protocol import ApiError, bad
from jaxgpt.serve.worker import EngineWorker

log = logging.getLogger("jaxgpt.serve")

MAX_REQUEST_BYTES = 16 * 2 ** 20  # the largest request body accepted by default (jaxgpt-serve's --max_request_bytes)
INLINE_BYTES = 64 * 2 ** 10       # a body past this is parsed and tokenized on a worker thread, off the event loop


class Service:
    """What the routes share: the tokenizer, the worker, the metrics and the model's name and sizes."""

    def __init__(self, worker: EngineWorker, tokenizer, *, model_name: str, max_len: int, vocab_size: int,
                 max_logprobs: int, api_key: Optional[str], log_requests: bool, chat_template: Optional[str],
                 max_request_bytes: int = MAX_REQUEST_BYTES):
        self.worker, self.tokenizer, self.model_name = worker, tokenizer, model_name
        self.max_request_bytes = max_request_bytes
        self.max_len, self.vocab_size, self.max_logprobs = max_len, vocab_size, max_logprobs
        self.api_key, self.log_requests, self.chat_template = api_key, log_requests, chat_template
        self.metrics = Metrics(worker)
        self.created = int(time.time())
        self.eos_id = getattr(tokenizer, "eos_id", None)

    def check_model(self, body: dict) -> None:
        model = body.get("model")
        if model is not None and model != self.model_name:
            raise ApiError(404, f"The model `{model}` does not exist; this server serves `{self.model_name}`",
                           "model")

    def check_ready(self) -> None:
        if not self.worker.ready.is_set():
            raise ApiError(503, "the server is starting (compiling the engine's programs); retry shortly")


def create_app(engine: Engine, tokenizer, *, model_name: str = "jaxgpt", max_waiting: Optional[int] = 256,
               api_key: Optional[str] = None, log_requests: bool = False, chat_template: Optional[str] = None,
               warmup: Union[bool, str] = True, progress: bool = False, max_request_bytes: int = MAX_REQUEST_BYTES,
               profiler=None) -> FastAPI:
    """The FastAPI app serving `engine` with `tokenizer` (encode, decode, vocab_size, eos_id). Its engine
    thread starts (and warms the engine up: /health is 503 until then; `progress`: a bar on stderr
    meanwhile, on a terminal; `warmup="background"`: a paged engine answers once its largest step's
    programs are compiled and compiles the rest beside its steps) with the app's lifespan. A request body past `max_request_bytes` is a 413.
    `profiler`: a StepProfiler (jaxgpt/training/profiling.py) tracing a window of engine steps."""
    if not (isinstance(max_request_bytes, int) and max_request_bytes >= 1):
        raise ValueError(f"max_request_bytes must be an integer >= 1, got {max_request_bytes!r}")
    worker = EngineWorker.for_engine(engine, max_waiting, warmup=warmup, progress=progress, profiler=profiler)
    svc = Service(worker, tokenizer, model_name=model_name, max_len=engine.max_len,
                  vocab_size=engine.config.vocab_size, max_logprobs=engine.max_logprobs, api_key=api_key,
                  log_requests=log_requests, chat_template=chat_template, max_request_bytes=max_request_bytes)

    @contextlib.asynccontextmanager
    async def lifespan(app):
        worker.start()
        try:
            yield
        finally:
            await asyncio.get_running_loop().run_in_executor(None, worker.stop)

    app = FastAPI(title="jaxgpt-serve", lifespan=lifespan)
    app.state.service = svc
    _errors(app)
    _auth(app, svc)
    _routes(app, svc)
    return app


# -- errors and the key -------------------------------------------------------------------------------

def _json_error(status: int, message: str, param: Optional[str] = None) -> JSONResponse:
    return JSONResponse(protocol.error_body(status, message, param), status_code=status)


def _errors(app: FastAPI) -> None:
    @app.exception_handler(ApiError)
    async def api_error(request, e: ApiError):
        return JSONResponse(e.body(), status_code=e.status)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request, e):
        return _json_error(e.status_code, str(e.detail))

    @app.exception_handler(RequestValidationError)
    async def validation_error(request, e):
        return _json_error(400, str(e))

    app.add_middleware(_InternalErrors)


class _InternalErrors:
    """A bug, not the client's doing: its traceback logged once, with a request id that the 500's message
    gives the client, and no traceback in the answer. (Starlette's handler for Exception re-raises once it
    has answered, and uvicorn logs the same traceback a second time: hence a middleware that ends it.)"""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        started = False

        async def send_and_note(message):
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive, send_and_note)
        except Exception as e:
            rid = uuid.uuid4().hex
            log.exception("internal error in request %s (%s %s)", rid, scope.get("method"), scope.get("path"))
            if not started:  # (once the answer has begun, the client can only see the connection end)
                response = _json_error(500, f"internal server error ({type(e).__name__}; request id {rid})")
                await response(scope, receive, send)


class _KeyCheck:
    """With a key set, /v1/ answers 401 to a request without `Authorization: Bearer KEY` (as vLLM does). A
    plain ASGI middleware: it leaves streaming and disconnects alone."""

    def __init__(self, app, key: str):
        self.app, self.expected = app, f"Bearer {key}".encode()

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope["path"].startswith("/v1"):
            given = dict(scope["headers"]).get(b"authorization", b"")
            if not hmac.compare_digest(given, self.expected):
                response = _json_error(401, "missing or wrong API key: send it as 'Authorization: Bearer KEY'")
                return await response(scope, receive, send)
        return await self.app(scope, receive, send)


def _auth(app: FastAPI, svc: Service) -> None:
    if svc.api_key:
        app.add_middleware(_KeyCheck, key=svc.api_key)


# -- request bodies -----------------------------------------------------------------------------------

async def _read(request: Request, limit: int) -> bytes:
    """The request's body; 413 past `limit` bytes: before reading it by its Content-Length, and for a body
    sent without one (chunked) as soon as what has arrived passes the limit (the rest is not read)."""
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise _too_large(limit, f" ({int(declared)} bytes)")
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise _too_large(limit)
        chunks.append(chunk)
    return b"".join(chunks)


def _too_large(limit: int, size: str = "") -> ApiError:
    return ApiError(413, f"the request body{size} is larger than this server's limit of {limit} bytes "
                         "(jaxgpt-serve --max_request_bytes)")


def _json_object(raw: bytes) -> dict:
    try:
        body = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as e:
        raise bad("body", f"the request body is not valid JSON ({e})") from None
    if not isinstance(body, dict):
        raise bad("body", "the request body must be a JSON object")
    return body


async def _parsed(request: Request, svc: Service, parse):
    """`parse(body)` of the request's JSON object body. A body past INLINE_BYTES is parsed (JSON, then
    `parse`: checks, tokenizing, chat templates) on a worker thread, so that a large request never holds
    up the event loop and the requests it serves meanwhile (/health among them)."""
    raw = await _read(request, svc.max_request_bytes)
    if len(raw) <= INLINE_BYTES:
        return parse(_json_object(raw))
    return await run_in_threadpool(lambda: parse(_json_object(raw)))


def _json_list(items: list, step: int = 2 ** 16) -> str:
    """json.dumps(items), a slice at a time: each call into the C encoder holds the GIL, and so the event
    loop's thread, for one slice (one call for millions of token ids would hold it for all of them)."""
    parts = (json.dumps(items[i:i + step], ensure_ascii=False, separators=(",", ":"))[1:-1]
             for i in range(0, len(items), step))
    return "[" + ",".join(parts) + "]"


# -- routes -------------------------------------------------------------------------------------------

def _routes(app: FastAPI, svc: Service) -> None:
    @app.get("/health")
    async def health():
        if not svc.worker.ready.is_set():
            return Response(status_code=503)
        return Response(status_code=200)

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": svc.model_name, "object": "model", "created": svc.created,
                                            "owned_by": "jaxgpt", "root": svc.model_name, "parent": None,
                                            "max_model_len": svc.max_len}]}

    @app.get("/metrics")
    async def metrics():
        return Response(svc.metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await _completions(svc, request, await _parsed(request, svc, lambda b: _parse_completion(svc, b)))

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        return await _chat(svc, request, await _parsed(request, svc, lambda b: _parse_chat(svc, b)))

    @app.post("/tokenize")
    async def tokenize(request: Request):
        return await _parsed(request, svc, lambda b: _tokenize(svc, b))

    @app.post("/detokenize")
    async def detokenize(request: Request):
        return await _parsed(request, svc, lambda b: _detokenize(svc, b))

    @app.get("/tokenizer_info")
    async def tokenizer_info():
        eos = svc.eos_id
        return {"tokenizer_class": type(svc.tokenizer).__name__,
                "eos_token": None if eos is None else output.token_str(svc.tokenizer, eos),
                "eos_token_id": eos, "bos_token": None, "pad_token": None, "vocab_size": svc.vocab_size,
                "model_max_length": svc.max_len, "chat_template": svc.chat_template}


def _tokenize(svc: Service, body: dict) -> Response:
    """/tokenize's answer, its JSON rendered here (on the worker thread for a large body)."""
    svc.check_model(body)
    if "messages" in body:
        ids = protocol.encode(svc.tokenizer, _render_chat(svc, body), "messages")
    elif isinstance(body.get("prompt"), str):
        ids = protocol.encode(svc.tokenizer, body["prompt"])
    else:
        raise bad("prompt", "tokenize takes a string prompt (or chat messages)")
    strs = [output.token_str(svc.tokenizer, t) for t in ids] if body.get("return_token_strs") else None
    text = (f'{{"count":{len(ids)},"max_model_len":{svc.max_len},"tokens":{_json_list(ids)},'
            f'"token_strs":{"null" if strs is None else _json_list(strs)}}}')
    return Response(text.encode("utf-8"), media_type="application/json")


def _detokenize(svc: Service, body: dict) -> JSONResponse:
    svc.check_model(body)
    ids = body.get("tokens")
    if not isinstance(ids, list) or not all(isinstance(t, int) and not isinstance(t, bool)
                                            and 0 <= t < svc.vocab_size for t in ids):
        raise bad("tokens", f"tokens must be a list of token ids in [0, {svc.vocab_size})")
    return JSONResponse({"prompt": svc.tokenizer.decode(ids)})


# -- generation ---------------------------------------------------------------------------------------

class Generation:
    """The engine requests of one API request (one per prompt and choice) and their choices' text."""

    def __init__(self, svc: Service, prompts: list, sampling: protocol.Sampling, logprobs: Optional[int],
                 prompt_logprobs: bool, prompt_param: str = "prompt"):
        self.svc, self.prompts, self.sampling, self.k = svc, prompts, sampling, logprobs
        self.events: asyncio.Queue = asyncio.Queue()
        hidden = list(sampling.stop_token_ids)
        if svc.eos_id is not None and not sampling.ignore_eos:
            hidden.append(svc.eos_id)
        seed = sampling.seed if sampling.seed is not None else random.SystemRandom().randrange(2 ** 31)
        self.requests, self.choices, self.prompt_of = [], [], []
        for i, p in enumerate(prompts):
            max_tokens = _max_tokens(svc, p, sampling.max_tokens, prompt_param)
            for j in range(sampling.n):
                self.requests.append((p, dict(max_tokens=max_tokens, temperature=sampling.temperature,
                                              top_k=sampling.top_k, top_p=sampling.top_p,
                                              seed=(seed + j) % 2 ** 31, stop_token_ids=tuple(hidden),
                                              logprobs=logprobs, prompt_logprobs=prompt_logprobs)))
                self.choices.append(output.Choice(svc.tokenizer, sampling.stop, hidden))
                self.prompt_of.append(i)
        self.completions: list = [None] * len(self.choices)
        self.tickets: list = []
        self.arrived = time.perf_counter()

    def submit(self) -> None:
        tickets = self.svc.worker.submit(self.requests, events=self.events)
        if tickets is None:
            self.svc.metrics.requests.labels("rejected").inc()
            raise ApiError(429, "the server's queue is full; retry later")
        self.tickets = tickets
        self.svc.metrics.prompt_tokens.inc(sum(len(p) for p, _ in self.requests))

    def cancel(self) -> None:
        """Cancel the choices still going (the client left, or an error): each counts as cancelled."""
        for t, choice in zip(self.tickets, self.choices):
            if choice.finish_reason is None:
                self.svc.worker.cancel(t)
                self._ended(choice, "cancelled")

    def _ended(self, choice: output.Choice, reason: str) -> None:
        if choice.finish_reason is None:
            self.svc.metrics.requests.labels(choice.finish(reason)).inc()

    async def run_batches(self):
        """Yield lists of (choice index, new token or None, whether the choice had stopped once it had that
        token): each list every event that had arrived (a decode call's tokens come together), until every
        choice has finished."""
        index = {id(t): i for i, t in enumerate(self.tickets)}
        last = [None] * len(self.tickets)
        left = len(self.tickets)
        while left:
            items = [await self.events.get()]
            while not self.events.empty():
                items.append(self.events.get_nowait())
            batch = []
            for ticket, item, at in items:
                i = index[id(ticket)]
                if isinstance(item, Exception):
                    self.cancel()
                    raise (bad("prompt", str(item)) if isinstance(item, ValueError) else item)
                choice = self.choices[i]
                if item.token is not None:
                    self._timing(last, i, at)
                    self.svc.metrics.generation_tokens.inc()
                    choice.push(item.token)
                    if choice.stopped and item.finish_reason is None:
                        self.svc.worker.cancel(ticket)  # a stop string: free the slot now
                if item.finish_reason is not None:
                    left -= 1
                    self.completions[i] = item.completion
                    self._ended(choice, item.finish_reason)
                    self.svc.metrics.e2e.observe(at - self.arrived)
                batch.append((i, item.token, choice.stopped))
            yield batch

    async def run(self):
        """Yield (choice index, new token or None) as events come, until every choice has finished."""
        async for batch in self.run_batches():
            for i, token, _ in batch:
                yield i, token

    def shown(self, batch: list) -> dict:
        """{choice index: its tokens in `batch` that the API shows} for the choices with events there (not a
        hidden end or stop token)."""
        out: dict = {}
        for i, token, stopped in batch:
            tokens = out.setdefault(i, [])
            if token is not None and not (stopped and token.id in self.choices[i].hidden):
                tokens.append(token)
        return out

    def _timing(self, last: list, i: int, at: float) -> None:
        if last[i] is None:
            self.svc.metrics.ttft.observe(at - self.arrived)
        else:
            self.svc.metrics.itl.observe(at - last[i])
        last[i] = at

    def usage(self) -> dict:
        prompt = sum(len(p) for p in self.prompts)
        done = sum(c.generated for c in self.choices)
        return {"prompt_tokens": prompt, "completion_tokens": done, "total_tokens": prompt + done}


def _max_tokens(svc: Service, prompt: list, asked: Optional[int], prompt_param: str = "prompt") -> int:
    """The completion's length: `asked`, or by default 16 or what the context leaves; a 400 past the
    context (on `prompt_param`: the chat's messages are its prompt)."""
    room = svc.max_len - len(prompt)
    if room < 0:
        raise bad(prompt_param, f"This model's maximum context length is {svc.max_len} tokens; the prompt has "
                                f"{len(prompt)} tokens: shorten it")
    if asked is None:
        return min(16, room)
    if asked > room:
        raise bad("max_tokens", f"This model's maximum context length is {svc.max_len} tokens; you asked for "
                                f"{len(prompt) + asked} ({len(prompt)} in the prompt, {asked} in the completion): "
                                "ask for fewer tokens or shorten the prompt")
    return asked


@contextlib.asynccontextmanager
async def _until_disconnect(request: Request, gen: Generation):
    """Cancel the generation's engine requests if the client goes away before it has its answer."""
    async def watch():
        while True:
            message = await request.receive()
            if message["type"] == "http.disconnect":
                gen.cancel()
                return

    task = asyncio.create_task(watch())
    try:
        yield
    finally:
        task.cancel()


def _log(svc: Service, kind: str, prompts, texts) -> None:
    """--log_requests: each prompt (token ids, as the engine got them) as text, and the outputs."""
    if svc.log_requests:
        log.info("%s prompt=%r output=%r", kind, [svc.tokenizer.decode(list(p)) for p in prompts], texts)


# -- /v1/completions ----------------------------------------------------------------------------------

def _parse_completion(svc: Service, body: dict) -> tuple:
    svc.check_model(body)
    sampling = protocol.parse_sampling(body, vocab_size=svc.vocab_size)
    k = protocol.completion_logprobs(body, svc.max_logprobs)
    echo = protocol.get_bool(body, "echo", False)
    if "prompt" not in body:
        raise bad("prompt", "prompt is required")
    prompts = protocol.parse_prompts(body["prompt"], svc.tokenizer, svc.vocab_size)
    _check_fits(svc, len(prompts), sampling.n)
    if sampling.stream and echo and k is not None:
        raise bad("echo", "echo with logprobs is not supported when streaming; ask without stream")
    return sampling, k, echo, prompts


def _check_fits(svc: Service, prompts: int, n: int) -> None:
    """A request for more completions than the server ever holds at once is a 400 naming that limit: a 429
    would have its client retry for ever (429 stays for a request that fits once the queue drains)."""
    capacity = svc.worker.capacity
    if capacity is None or prompts * n <= capacity:
        return
    slots = svc.worker.engine.slots
    raise bad("n" if prompts == 1 else "prompt",
              f"this request asks for {prompts * n} completions ({prompts} prompts x n = {n}), more than this "
              f"server ever holds at once ({capacity}: --slots {slots} + --max_waiting {capacity - slots}); "
              f"send at most {capacity} per request")


async def _completions(svc: Service, request: Request, parsed: tuple):
    sampling, k, echo, prompts = parsed
    svc.check_ready()
    gen = Generation(svc, prompts, sampling, k, prompt_logprobs=echo and k is not None)
    gen.submit()
    rid, created = f"cmpl-{uuid.uuid4().hex}", int(time.time())
    head = {"id": rid, "object": "text_completion", "created": created, "model": svc.model_name}
    if sampling.stream:
        return _sse(_completion_chunks(svc, gen, head, echo, k), gen, rid)
    async with _until_disconnect(request, gen):
        async for _ in gen.run():
            pass
    choices = [_completion_choice(svc, gen, i, echo, k) for i in range(len(gen.choices))]
    _log(svc, "completion", prompts, [c["text"] for c in choices])
    return {**head, "choices": choices, "usage": gen.usage()}


def _completion_choice(svc: Service, gen: Generation, i: int, echo: bool, k: Optional[int]) -> dict:
    choice, prompt = gen.choices[i], gen.prompts[gen.prompt_of[i]]
    prefix = svc.tokenizer.decode(prompt) if echo else ""
    logprobs = None
    if k is not None:
        entries = output.generated_entries(choice.tokens, k)
        if echo:
            entries = output.prompt_entries(gen.completions[i], k) + entries
        logprobs = output.completion_logprobs(svc.tokenizer, entries)
    return {"index": i, "text": prefix + choice.text, "logprobs": logprobs,
            "finish_reason": choice.finish_reason, "stop_reason": None}


async def _completion_chunks(svc: Service, gen: Generation, head: dict, echo: bool, k: Optional[int]):
    offsets = [0] * len(gen.choices)
    if echo:
        for i in range(len(gen.choices)):
            text = svc.tokenizer.decode(gen.prompts[gen.prompt_of[i]])
            offsets[i] = len(text)
            yield {**head, "choices": [{"index": i, "text": text, "logprobs": None, "finish_reason": None}]}
    async for batch in gen.run_batches():  # one chunk per choice for what arrived together
        for i, tokens in gen.shown(batch).items():
            choice = gen.choices[i]
            text, logprobs = choice.delta(), None
            if k is not None and tokens:
                logprobs = output.completion_logprobs(svc.tokenizer, output.generated_entries(tokens, k), offsets[i])
                offsets[i] += sum(len(t) for t in logprobs["tokens"])
            if text or logprobs or choice.finish_reason:
                yield {**head, "choices": [{"index": i, "text": text, "logprobs": logprobs,
                                            "finish_reason": choice.finish_reason}]}
    if gen.sampling.include_usage:
        yield {**head, "choices": [], "usage": gen.usage()}
    _log(svc, "completion", gen.prompts, [c.text for c in gen.choices])


def _sse(chunks, gen: Generation, rid: str) -> StreamingResponse:
    """Server-sent events: `data: {json}` per chunk, then `data: [DONE]`; a dropped client (or an error
    past the first byte) cancels the generation's engine requests. An internal error is logged once, with
    the response's id `rid`, and told in the stream."""
    async def events():
        try:
            async for chunk in chunks:
                yield f"data: {json.dumps(chunk, ensure_ascii=False)}\n\n"
        except ApiError as e:
            yield f"data: {json.dumps(e.body())}\n\n"
        except Exception as e:  # past the first byte, an error can only be told in the stream
            log.exception("internal error while streaming %s", rid)
            message = f"internal server error ({type(e).__name__}; request id {rid})"
            yield f"data: {json.dumps(protocol.error_body(500, message))}\n\n"
        finally:
            gen.cancel()
        yield "data: [DONE]\n\n"

    return StreamingResponse(events(), media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


# -- /v1/chat/completions -----------------------------------------------------------------------------

def _render_chat(svc: Service, body: dict) -> str:
    if not svc.chat_template:
        raise bad("messages", f"the model `{svc.model_name}` has no chat template (its tokenizer carries "
                              "none); use /v1/completions, or start jaxgpt-serve with --chat_template=FILE")
    messages = protocol.parse_messages(body.get("messages"))
    try:
        import jinja2
        from jinja2.sandbox import ImmutableSandboxedEnvironment
    except ImportError:
        raise bad("messages", "chat templates need jinja2 (pip install jinja2)") from None

    def raise_exception(message):
        raise jinja2.TemplateError(message)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.globals["raise_exception"] = raise_exception
    eos = None if svc.eos_id is None else output.token_str(svc.tokenizer, svc.eos_id)
    try:
        return env.from_string(svc.chat_template).render(
            messages=messages, add_generation_prompt=protocol.get_bool(body, "add_generation_prompt", True),
            bos_token="", eos_token=eos or "")
    except jinja2.TemplateError as e:
        raise bad("messages", f"the chat template could not render these messages: {e}") from None


def _parse_chat(svc: Service, body: dict) -> tuple:
    svc.check_model(body)
    name = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    sampling = protocol.parse_sampling(body, vocab_size=svc.vocab_size, max_tokens_name=name)
    k = protocol.chat_logprobs(body, svc.max_logprobs)
    prompt = protocol.encode(svc.tokenizer, _render_chat(svc, body), "messages")
    if not prompt:
        raise bad("messages", "the messages render to no tokens")
    _check_fits(svc, 1, sampling.n)
    return sampling, k, prompt


async def _chat(svc: Service, request: Request, parsed: tuple):
    sampling, k, prompt = parsed
    svc.check_ready()
    gen = Generation(svc, [prompt], sampling, k, prompt_logprobs=False, prompt_param="messages")
    gen.submit()
    head = {"id": f"chatcmpl-{uuid.uuid4().hex}", "created": int(time.time()), "model": svc.model_name}
    if sampling.stream:
        return _sse(_chat_chunks(svc, gen, {**head, "object": "chat.completion.chunk"}, k), gen, head["id"])
    async with _until_disconnect(request, gen):
        async for _ in gen.run():
            pass
    choices = [{"index": i, "message": {"role": "assistant", "content": c.text},
                "logprobs": None if k is None else output.chat_logprobs(svc.tokenizer, c.tokens, k),
                "finish_reason": c.finish_reason} for i, c in enumerate(gen.choices)]
    _log(svc, "chat", [prompt], [c.text for c in gen.choices])
    return {**head, "object": "chat.completion", "choices": choices, "usage": gen.usage()}


async def _chat_chunks(svc: Service, gen: Generation, head: dict, k: Optional[int]):
    for i in range(len(gen.choices)):
        yield {**head, "choices": [{"index": i, "delta": {"role": "assistant", "content": ""},
                                    "logprobs": None, "finish_reason": None}]}
    async for batch in gen.run_batches():  # one chunk per choice for what arrived together
        for i, tokens in gen.shown(batch).items():
            choice = gen.choices[i]
            text, logprobs = choice.delta(), None
            if k is not None and tokens:
                logprobs = output.chat_logprobs(svc.tokenizer, tokens, k)
            if text or logprobs or choice.finish_reason:
                yield {**head, "choices": [{"index": i, "delta": {"content": text} if text else {},
                                            "logprobs": logprobs, "finish_reason": choice.finish_reason}]}
    if gen.sampling.include_usage:
        yield {**head, "choices": [], "usage": gen.usage()}
