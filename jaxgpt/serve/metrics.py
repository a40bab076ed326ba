"""The server's Prometheus metrics, in a registry of its own (so that several apps in one process, as in
the tests, do not share counters)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily

_LATENCY = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0)

# The engine's own counters (Engine.stats), each exposed as jaxgpt_engine_<key>_total: how the load became
# compiled calls (a client's arrival pattern shows here: single decode steps, half-empty batches).
_ENGINE_COUNTERS = (
    ("prefill_calls", "Prefill calls (a chunk of one prompt, or several whole prompts packed)"),
    ("prefill_packed_calls", "Prefill calls that packed several prompts"),
    ("prefill_tokens", "Prompt tokens prefilled (not those reused from the cache)"),
    ("prefill_padding", "Padded positions of prefill calls"),
    ("prefill_seconds", "Seconds in prefill calls"),
    ("reused_tokens", "Prompt tokens whose keys and values came from the cache (prefix reuse)"),
    ("copies", "Cache rows copied between slots for prefix reuse"),
    ("decode_calls", "Decode calls (each one step, or several steps at once)"),
    ("decode_steps", "Decode steps (a token for every generating request)"),
    ("decode_rows", "Requests generating, summed over decode steps (over decode_steps: the mean batch)"),
    ("decode_width", "Rows the decode steps computed, summed over steps (a power of two of the slots)"),
    ("decode_seconds", "Seconds in decode calls"),
    # the paged engine's (--engine paged)
    ("steps", "Ragged steps run (decode tokens and prompt chunks in one call)"),
    ("calls", "Compiled calls of ragged steps (one may run several decode steps)"),
    ("step_seconds", "Seconds in ragged step calls"),
    ("host_seconds", "Seconds the engine's thread spent outside compiled calls (planning, arrays, events)"),
    ("prompt_tokens", "Prompt tokens run through ragged steps (recomputed ones included)"),
    ("decode_tokens", "Decode tokens run through ragged steps"),
    ("padding_tokens", "Padded token positions of ragged steps"),
    ("prefix_queries", "Prompt tokens looked up in the prefix cache"),
    ("prefix_hits", "Prompt tokens found in the prefix cache (not computed again)"),
    ("preemptions", "Requests preempted for want of pages (recomputed later)"),
)


class _EngineCounters:
    """A collector reading the engine's counters at each scrape (the engine thread writes them)."""

    def __init__(self, stats):
        self.stats = stats

    def collect(self):
        for key, text in _ENGINE_COUNTERS:
            family = CounterMetricFamily(f"jaxgpt_engine_{key}", text)
            family.add_metric([], float(self.stats.get(key, 0)))
            yield family


class Metrics:
    """Requests by outcome, prompt and generated tokens, running and waiting requests, time to first token
    and inter-token latency."""

    def __init__(self, worker):
        r = self.registry = CollectorRegistry()
        self.requests = Counter("jaxgpt_requests", "Requests answered, by outcome (stop, length, cancelled, "
                                "rejected: the queue was full)", ["outcome"], registry=r)
        self.prompt_tokens = Counter("jaxgpt_prompt_tokens", "Prompt tokens submitted to the engine", registry=r)
        self.generation_tokens = Counter("jaxgpt_generation_tokens", "Tokens generated", registry=r)
        running = Gauge("jaxgpt_requests_running", "Requests in an engine slot", registry=r)
        running.set_function(lambda: worker.num_running)
        waiting = Gauge("jaxgpt_requests_waiting", "Requests waiting for a slot", registry=r)
        waiting.set_function(lambda: worker.num_waiting)
        stats = worker.engine.stats  # (the engine thread's counters: read, never written, here)
        proposed = Gauge("jaxgpt_speculative_proposed_tokens", "Tokens proposed by speculative decoding", registry=r)
        proposed.set_function(lambda: stats["proposed"])
        accepted = Gauge("jaxgpt_speculative_accepted_tokens", "Proposed tokens that the model accepted", registry=r)
        accepted.set_function(lambda: stats["accepted"])
        r.register(_EngineCounters(stats))
        programs = getattr(worker.engine, "programs", None)  # (the paged engine's)
        pending = Gauge("jaxgpt_engine_programs_pending", "The engine's programs still to compile (in the "
                        "background, while it serves)", registry=r)
        pending.set_function(lambda: programs.pending if programs is not None else 0)
        self.ttft = Histogram("jaxgpt_time_to_first_token_seconds", "From the request's arrival to its first "
                              "generated token", buckets=_LATENCY, registry=r)
        self.itl = Histogram("jaxgpt_inter_token_latency_seconds", "Between a request's consecutive tokens",
                             buckets=_LATENCY, registry=r)
        self.e2e = Histogram("jaxgpt_request_latency_seconds", "From the request's arrival to its end",
                             buckets=_LATENCY, registry=r)

    def render(self) -> bytes:
        return generate_latest(self.registry)
