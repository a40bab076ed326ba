"""One choice's tokens turned into the API's text and logprobs: detokenizing as tokens arrive, cutting at
stop strings (and holding back, while streaming, text that may turn out to start one), and vLLM's
logprobs shapes for completions and for chat."""

from __future__ import annotations

from typing import Optional, Sequence


class Choice:
    """The text of one choice so far. Tokens in `hidden_ids` (the end token, stop token ids) end it and
    are not shown; a stop string ends it and is cut from the text."""

    def __init__(self, tokenizer, stop: Sequence[str], hidden_ids: Sequence[int]):
        self.tokenizer, self.stop, self.hidden = tokenizer, list(stop), set(hidden_ids)
        self.tokens: list = []     # engine Tokens shown (the hidden end token is not)
        self.generated = 0         # every token the engine made for it
        self.text = ""
        self.sent = 0              # characters of `text` already streamed
        self.stopped = False       # a stop string or hidden stop token ended it
        self.finish_reason: Optional[str] = None

    def push(self, token) -> None:
        """Add one generated token."""
        self.generated += 1
        if self.stopped:
            return
        if token.id in self.hidden:
            self.stopped = True
            return
        self.tokens.append(token)
        text = self.tokenizer.decode([t.id for t in self.tokens])
        cuts = [text.find(s) for s in self.stop if s in text]
        if cuts:
            text, self.stopped = text[:min(cuts)], True
        self.text = text

    def finish(self, engine_reason: str) -> str:
        """The finish reason ("stop" for a stop string or token, else the engine's)."""
        self.finish_reason = "stop" if self.stopped else engine_reason
        return self.finish_reason

    def delta(self) -> str:
        """Text not streamed yet that no later token can change: the end of the text that may begin a stop
        string, or is an incomplete character, waits until the choice has finished."""
        safe = len(self.text)
        if self.finish_reason is None and not self.stopped:
            safe -= self._held_back()
        out = self.text[self.sent:safe] if safe > self.sent else ""
        self.sent = max(self.sent, safe)
        return out

    def _held_back(self) -> int:
        text, hold = self.text, 0
        for s in self.stop:
            for k in range(min(len(s) - 1, len(text)), hold, -1):
                if text.endswith(s[:k]):
                    hold = k
                    break
        tail = len(text) - len(text.rstrip("\ufffd"))  # a multi-byte character not complete yet
        return max(hold, tail)


def token_str(tokenizer, token_id: int) -> str:
    return tokenizer.decode([token_id])


def _top(tokenizer, chosen: int, chosen_lp: Optional[float], top: Optional[list]) -> Optional[dict]:
    """{token text: logprob} of the alternatives, the chosen token included (as vLLM gives them)."""
    if top is None or chosen_lp is None:
        return None
    out = {token_str(tokenizer, a): b for a, b in top}
    out.setdefault(token_str(tokenizer, chosen), chosen_lp)
    return out


def completion_logprobs(tokenizer, entries: Sequence[tuple], offset: int = 0) -> dict:
    """/v1/completions' logprobs object from (token id, logprob or None, alternatives or None) entries;
    text offsets count from `offset`."""
    out = {"text_offset": [], "token_logprobs": [], "tokens": [], "top_logprobs": []}
    for tid, lp, top in entries:
        s = token_str(tokenizer, tid)
        out["text_offset"].append(offset)
        out["token_logprobs"].append(lp)
        out["tokens"].append(s)
        out["top_logprobs"].append(_top(tokenizer, tid, lp, top))
        offset += len(s)
    return out


def generated_entries(tokens: Sequence, k: Optional[int]) -> list:
    """(id, logprob, alternatives) of generated engine Tokens; alternatives only when k is not None."""
    return [(t.id, t.logprob, t.top if k is not None else None) for t in tokens]


def prompt_entries(completion, k: int) -> list:
    """(id, logprob, alternatives) of the prompt's tokens from an engine Completion with prompt
    logprobs; the first token has none."""
    out = []
    for i, tid in enumerate(completion.prompt):
        lp = completion.prompt_logprobs[i] if completion.prompt_logprobs else None
        top = completion.prompt_top[i] if completion.prompt_top and lp is not None else None
        out.append((int(tid), lp, top))
    return out


def chat_logprobs(tokenizer, tokens: Sequence, k: int) -> dict:
    """/v1/chat/completions' logprobs object: {"content": [{token, logprob, bytes, top_logprobs}]}."""
    def one(tid, lp):
        s = token_str(tokenizer, tid)
        return {"token": s, "logprob": lp, "bytes": list(s.encode("utf-8", "surrogatepass"))}

    return {"content": [{**one(t.id, t.logprob), "top_logprobs": [one(a, b) for a, b in t.top[:k]]}
                        for t in tokens]}
