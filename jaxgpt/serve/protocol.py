"""The OpenAI API's requests as vLLM accepts them: parsed and checked field by field, so that every bad
value is a 400 naming its field (`ApiError`), never an exception from deeper in."""

from __future__ import annotations

import dataclasses
import math
import reprlib
from typing import Any, Optional

from jaxgpt.checks import SEED_MAX, SEED_MIN

_TYPES = {400: "BadRequestError", 401: "AuthenticationError", 404: "NotFoundError", 405: "MethodNotAllowed",
          413: "RequestTooLarge", 429: "RateLimitError", 500: "InternalServerError", 503: "ServiceUnavailableError"}


class ApiError(Exception):
    """An error answered in OpenAI's form: {"error": {"message", "type", "param", "code"}}."""

    def __init__(self, status: int, message: str, param: Optional[str] = None):
        super().__init__(message)
        self.status, self.message, self.param = status, message, param

    def body(self) -> dict:
        return error_body(self.status, self.message, self.param)


def error_body(status: int, message: str, param: Optional[str] = None) -> dict:
    return {"error": {"message": message, "type": _TYPES.get(status, "BadRequestError" if status < 500 else
                                                             "InternalServerError"),
                      "param": param, "code": status}}


def bad(param: str, message: str) -> ApiError:
    return ApiError(400, message, param)


# -- single fields ------------------------------------------------------------------------------------

def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v) -> bool:
    return (isinstance(v, (int, float)) and not isinstance(v, bool)) and math.isfinite(v)


INT32_MIN, INT32_MAX = -2 ** 31, 2 ** 31 - 1


def _shown(v) -> str:
    """A value for an error message, cut short (an 830-digit integer, a long list: their ends elided)."""
    return reprlib.repr(v)


def get_int(body: dict, name: str, default, lo: int = INT32_MIN, hi: int = INT32_MAX):
    """An integer field in [lo, hi] (by default int32's range: what the engine's arrays hold); a float
    without a fractional part counts as its integer (16.0), any other float is refused."""
    v = body.get(name)
    if v is None:
        return default
    n = int(v) if isinstance(v, float) and v.is_integer() else v
    if not _is_int(n) or not lo <= n <= hi:
        raise bad(name, f"{name} must be an integer in [{lo}, {hi}], got {_shown(v)}")
    return n


def get_number(body: dict, name: str, default):
    v = body.get(name)
    if v is None:
        return default
    if not _is_number(v):
        raise bad(name, f"{name} must be a number, got {v!r}")
    return float(v)


def get_bool(body: dict, name: str, default: bool) -> bool:
    v = body.get(name)
    if v is None:
        return default
    if not isinstance(v, bool):
        raise bad(name, f"{name} must be true or false, got {v!r}")
    return v


def get_stop(body: dict) -> list:
    v = body.get("stop")
    if v is None:
        return []
    if isinstance(v, str):
        v = [v]
    if not isinstance(v, list) or not all(isinstance(s, str) for s in v):
        raise bad("stop", f"stop must be a string or a list of strings, got {v!r}")
    return [s for s in v if s]


# -- the sampling fields both endpoints share ---------------------------------------------------------

@dataclasses.dataclass
class Sampling:
    """What a completion request asks of the engine and of the text."""

    max_tokens: Optional[int]  # None: 16, or what the context leaves when that is less
    temperature: float
    top_p: Optional[float]
    top_k: Optional[int]
    seed: Optional[int]
    n: int
    stop: list
    stop_token_ids: list
    ignore_eos: bool
    stream: bool
    include_usage: bool
    logprobs: Optional[int]


def parse_sampling(body: dict, *, vocab_size: int, max_tokens_name: str = "max_tokens") -> Sampling:
    """The sampling fields, each checked (integers within int32, seed within int64 as vLLM takes it); a
    top_k past the vocabulary is the vocabulary (it keeps every token)."""
    max_tokens = get_int(body, max_tokens_name, None, lo=0)
    temperature = get_number(body, "temperature", 1.0)
    if temperature < 0:
        raise bad("temperature", f"temperature must be >= 0 (0 = greedy), got {temperature!r}")
    top_p = get_number(body, "top_p", None)
    if top_p is not None and not 0.0 < top_p <= 1.0:
        raise bad("top_p", f"top_p must be in (0, 1], got {top_p!r}")
    top_k = get_int(body, "top_k", None, lo=-1)
    seed = get_int(body, "seed", None, lo=SEED_MIN, hi=SEED_MAX)  # vLLM's range too (a signed 64-bit integer)
    n = get_int(body, "n", 1, lo=1, hi=128)
    if body.get("best_of") not in (None, n):
        raise bad("best_of", "best_of is not supported (only best_of = n)")
    stop_ids = body.get("stop_token_ids") or []
    if not isinstance(stop_ids, list) or not all(_is_int(t) for t in stop_ids):
        raise bad("stop_token_ids", f"stop_token_ids must be a list of token ids, got {_shown(stop_ids)}")
    outside = [t for t in stop_ids if not 0 <= t < vocab_size]
    if outside:
        raise bad("stop_token_ids", f"stop token {_shown(outside[0])} is outside the vocabulary [0, {vocab_size})")
    options = body.get("stream_options") or {}
    if not isinstance(options, dict):
        raise bad("stream_options", "stream_options must be an object")
    return Sampling(max_tokens=max_tokens, temperature=temperature, top_p=None if top_p == 1.0 else top_p,
                    top_k=min(top_k, vocab_size) if top_k and top_k > 0 else None, seed=seed, n=n,
                    stop=get_stop(body),
                    stop_token_ids=stop_ids, ignore_eos=get_bool(body, "ignore_eos", False),
                    stream=get_bool(body, "stream", False),
                    include_usage=get_bool(options, "include_usage", False), logprobs=None)


def completion_logprobs(body: dict, max_logprobs: int) -> Optional[int]:
    """/v1/completions' `logprobs`: how many alternatives per token (None: no logprobs)."""
    return get_int(body, "logprobs", None, lo=0, hi=max_logprobs)


def chat_logprobs(body: dict, max_logprobs: int) -> Optional[int]:
    """/v1/chat/completions' `logprobs` (bool) and `top_logprobs` (int) as one number (None: off)."""
    top = get_int(body, "top_logprobs", None, lo=0, hi=max_logprobs)
    if not get_bool(body, "logprobs", False):
        if top:
            raise bad("top_logprobs", "top_logprobs needs logprobs: true")
        return None
    return top or 0


# -- prompts ------------------------------------------------------------------------------------------

def encode(tokenizer, text: str, param: str = "prompt") -> list:
    """A text's token ids; a character the tokenizer cannot encode is a 400 on `param`."""
    try:
        return [int(t) for t in tokenizer.encode(text)]
    except ValueError as e:
        raise bad(param, f"{param}: {e}") from None


def parse_prompts(value: Any, tokenizer, vocab_size: int) -> list:
    """`prompt` as a string, a list of strings, token ids or lists of token ids: a list of id lists."""
    def ids(v):
        if not all(_is_int(t) for t in v):
            raise bad("prompt", "prompt must be a string, a list of strings, a list of token ids or a list of "
                                "lists of token ids")
        bad_ids = [t for t in v if not 0 <= t < vocab_size]
        if bad_ids:
            raise bad("prompt", f"prompt token {_shown(bad_ids[0])} is outside the vocabulary [0, {vocab_size})")
        return list(v)

    if isinstance(value, str):
        prompts = [encode(tokenizer, value)]
    elif isinstance(value, list) and value and all(isinstance(v, str) for v in value):
        prompts = [encode(tokenizer, v) for v in value]
    elif isinstance(value, list) and value and all(isinstance(v, list) for v in value):
        prompts = [ids(v) for v in value]
    elif isinstance(value, list) and value:
        prompts = [ids(value)]
    else:
        raise bad("prompt", f"prompt must be a non-empty string, list of strings, list of token ids or list of "
                            f"lists of token ids, got {str(value)[:60]!r}")
    if any(not p for p in prompts):
        raise bad("prompt", "prompt is empty (encodes to no tokens); give at least one token")
    return prompts


def parse_messages(value: Any) -> list:
    """Chat `messages`: [{"role", "content"}], a content given as text parts joined into one string."""
    if not isinstance(value, list) or not value:
        raise bad("messages", "messages must be a non-empty list of {role, content} objects")
    out = []
    for i, m in enumerate(value):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise bad("messages", f"messages[{i}] must be an object with a string role")
        content = m.get("content")
        if isinstance(content, list):
            if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
                       for p in content):
                raise bad("messages", f"messages[{i}].content: only text parts are supported")
            content = "".join(p["text"] for p in content)
        if content is None:
            content = ""
        if not isinstance(content, str):
            raise bad("messages", f"messages[{i}].content must be a string or a list of text parts")
        out.append({**m, "content": content})
    return out
