"""Engine benchmark: c concurrent requests served by jaxgpt.Engine or by Decoder.generate in fixed batches.

python bench/engine.py [--concurrency 1 8 32] [--new-tokens 128] [--min-new-tokens N] [--min-prompt 16]
                       [--max-prompt 256] [--max-len N] [--decode-steps 1:16,2:8,4:4] [--top-k 50]
                       [--dtype float32|bfloat16] [--quantize none|int8|w8a8] [--kv-dtype none|int8]
                       [--prefill-budget N] [--packed] [--paged] [--token-budget N ...] [--compare-async]
                       [--no-lone] [--tiny]

GPT-2 124M shape, random float32 weights. Each request: a prompt of 16 to 256 random tokens (uniform), 128
new tokens (no stop), top-k 50 sampling (--top-k) with its own seed. At concurrency c a client keeps c
requests in flight (as `vllm bench serve --max-concurrency` does), 4c requests in all (at least 8): the first c arrive
one decode step apart, and each later one when an earlier one is done. The engine (c slots) takes each as
it arrives; the fixed batches take them c at a time (a batch's requests are in flight together, so the
next c arrive when it returns), prompts padded to the batch's longest (compile excluded: every batch
shape is run once first). Reports output tokens/s, time to first token (TTFT, from arrival; a fixed
batch's tokens all come when its call returns), how far each engine TTFT is past its own prefill in
decode steps (p99) and past the serial bound (its prefill after those of every request that arrived before
it, back to back: what no server prefilling one prompt at a time can beat), the engine's program count and
warm-up time; and a lone request's decode rate on the engine against Decoder.generate at batch 1. With
--paged it also fits the paged engine's calls as a + b x tokens (seconds) and prints what share of its
time the ramp's prompts ask for and the step that share settles at: past a full step of the budget, every
ramp step is full and an arrival waits a whole one before its own.

With every request asking for the same number of tokens, a fixed batch's rows end together: what the engine
can save is the padding of each batch's prompts to its longest. The bench also times the fixed batches'
prefill alone (generate with 1 new token) and the share of its positions that are padding, so that the
bound on the engine's gain is a measured figure. `--min-new-tokens N` draws each request's max_tokens from
N..--new-tokens instead: a fixed batch then decodes until its longest row is done, counting only the tokens
its requests asked for.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import numpy as np  # noqa: E402

import jaxgpt  # noqa: E402
from bench.common import engine_summary, format_engine_summary, machine, write_results  # noqa: E402
from jaxgpt.cli.serve import DEFAULT_DECODE_STEPS, DEFAULT_DECODE_STEPS_TEXT, decode_steps_arg  # noqa: E402
from jaxgpt.engine import Engine  # noqa: E402
from jaxgpt.engine.paged import DEFAULT_TOKEN_BUDGET  # noqa: E402

TOP_K = 50  # every request's top_k (--top-k; None: drawn over the whole vocabulary, as an API's default is)


def config(tiny: bool) -> jaxgpt.GPTConfig:
    if tiny:
        return jaxgpt.GPTConfig(vocab_size=97, block_size=64, n_layer=2, n_head=2, n_embd=32)
    return jaxgpt.GPTConfig(vocab_size=50257, block_size=1024, n_layer=12, n_head=12, n_embd=768)


def workload(cfg, n: int, lo: int, hi: int, seed: int = 0) -> list:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, cfg.vocab_size, int(rng.integers(lo, hi + 1))).tolist() for _ in range(n)]


def percentile(xs, q) -> float:
    return float(np.percentile(np.asarray(xs, np.float64), q))


def step_time(engine: Engine, new_tokens: int, k: int = 8) -> float:
    """Median seconds of one decode step with every slot generating (a throwaway batch of requests; with
    several decode steps a call, each call's time over its steps)."""
    n = max(1, min(k * engine.decode_steps, engine.max_len - 7))
    for i in range(engine.slots):
        engine.submit([1, 2, 3], max_tokens=n + 4, temperature=1.0, top_k=TOP_K, seed=i)
    engine.step()  # prefill and the first decode
    times = []
    while engine.has_work():
        before = engine.stats["decode_steps"]
        t0 = time.perf_counter()
        engine.step()
        steps = engine.stats["decode_steps"] - before
        if steps:
            times.append((time.perf_counter() - t0) / steps)
    return float(np.median(times))


def new_token_counts(n: int, lo: int, hi: int, seed: int) -> list:
    """Each request's max_tokens: uniform in lo..hi (all hi when lo >= hi)."""
    if lo >= hi:
        return [hi] * n
    return np.random.default_rng(seed + 1000).integers(lo, hi + 1, n).tolist()


def replay_engine(engine: Engine, prompts, new_tokens: list, stagger: float) -> dict:
    """A closed loop of engine.slots requests in flight over `prompts` (request i asks for new_tokens[i])."""
    start, outs, nxt, seen, steps = time.perf_counter(), {}, 0, {}, []

    def submit(i, at):
        seen[i] = []  # when each of its tokens reached the caller (a call's tokens come together)
        rid = engine.submit(prompts[i], max_tokens=new_tokens[i], temperature=1.0, top_k=TOP_K, seed=i,
                            callback=lambda e, i=i: seen[i].append(time.perf_counter()) if e.token is not None
                            else None)
        outs[i] = engine._live[rid].out if isinstance(engine._live, dict) else engine._waiting[-1].out
        outs[i].submitted = at  # its arrival, not when this loop got to it

    while nxt < len(prompts) or engine.has_work():
        now = time.perf_counter()
        while nxt < min(engine.slots, len(prompts)) and start + nxt * stagger <= now:  # the first ones
            submit(nxt, start + nxt * stagger)
            nxt += 1
        if nxt >= engine.slots:  # each request done since the last step is replaced at once
            for i in [i for i, o in outs.items() if o.finished is not None and not getattr(o, "_replaced", False)]:
                outs[i]._replaced = True
                if nxt < len(prompts):
                    submit(nxt, outs[i].finished)
                    nxt += 1
        if engine.has_work():
            before, t0 = run_tokens(engine), time.perf_counter()
            engine.step()
            steps.append((run_tokens(engine) - before, time.perf_counter() - t0))
        elif nxt < min(engine.slots, len(prompts)):
            time.sleep(max(0.0, start + nxt * stagger - time.perf_counter()))
    total = time.perf_counter() - start
    done = [outs[i] for i in range(len(prompts))]
    tokens = sum(len(o.tokens) for o in done)
    return {"seconds": total, "tokens": tokens, "tokens_per_s": tokens / total,
            "ttft_s": [o.first_token - o.submitted for o in done],
            "ttft_past_prefill_s": [o.first_token - o.submitted - o.prefill_s for o in done],
            "ttft_past_serial_s": [o.first_token - o.submitted - b for o, b in zip(done, serial_bound(done))],
            "itl_s": [b - a for i in range(len(prompts)) for a, b in zip(seen[i], seen[i][1:])],
            "steps": steps}


def run_tokens(engine) -> int:
    """Tokens the engine has run so far (prompt and decode; 0 where its stats do not count them)."""
    return engine.stats.get("prompt_tokens", 0) + engine.stats.get("decode_tokens", 0)


def step_cost(steps) -> tuple:
    """(a, b): seconds of an engine.step() call fitted as a + b x tokens run (least squares over the calls
    that ran any), or (nan, nan) with fewer than two sizes of call."""
    pairs = [(n, t) for n, t in steps if n > 0]
    if len({n for n, _ in pairs}) < 2:
        return float("nan"), float("nan")
    b, a = np.polyfit([n for n, _ in pairs], [t for _, t in pairs], 1)
    return float(a), float(b)


def serial_bound(done) -> list:
    """Each request's time to first token had its prompt been prefilled as soon as the prompts before it
    (by arrival) were, back to back, at the cost its own prefill calls measured, and nothing else run: the
    least a server that prefills one prompt at a time can give these arrivals (the wait behind earlier
    prompts included, which "past its own prefill" counts against the engine)."""
    bound, free = [0.0] * len(done), -float("inf")
    for i in sorted(range(len(done)), key=lambda i: done[i].submitted):
        free = max(free, done[i].submitted) + done[i].prefill_s
        bound[i] = free - done[i].submitted
    return bound


def replay_fixed(decoder, prompts, c: int, new_tokens: list, stagger: float) -> dict:
    """The same requests c at a time: each batch's prompts padded to its longest, decoded for its longest
    max_tokens; then the batches' prefill alone (1 new token), and the share of prefill positions that pad."""
    batches = [list(range(i, min(i + c, len(prompts)))) for i in range(0, len(prompts), c)]

    def call(batch, n=None):
        p = max(len(prompts[i]) for i in batch)
        arr = np.zeros((len(batch), p), np.int32)
        for r, i in enumerate(batch):
            arr[r, :len(prompts[i])] = prompts[i]
        n = max(new_tokens[i] for i in batch) if n is None else n
        out = decoder.generate(arr, n, jax.random.key(batch[0]), prompt_lengths=[len(prompts[i]) for i in batch],
                               temperature=1.0, top_k=TOP_K)
        out.tokens.block_until_ready()

    for batch in batches:  # compile every shape first
        call(batch)
        call(batch, 1)
    start, ttft, tokens = time.perf_counter(), [], 0
    time.sleep(stagger * (len(batches[0]) - 1))  # the first batch starts when its last request arrives
    arrivals = [stagger * r for r in range(len(batches[0]))]
    for batch in batches:
        call(batch)
        now = time.perf_counter() - start
        ttft += [now - a for a in arrivals]
        tokens += sum(new_tokens[i] for i in batch)
        arrivals = [now] * c  # the client sends the next c as these return
    total = time.perf_counter() - start
    t0 = time.perf_counter()
    for batch in batches:
        call(batch, 1)
    prefill = time.perf_counter() - t0
    padded = sum(len(batch) * max(len(prompts[i]) for i in batch) for batch in batches)
    return {"seconds": total, "tokens_per_s": tokens / total, "ttft_s": ttft, "prefill_s": prefill,
            "prefill_padding_share": 1.0 - sum(len(p) for p in prompts) / padded}


def lone_decode(params, cfg, slots: int, new_tokens: int, decode_steps, numerics=None, paged=None) -> dict:
    """Decode tokens/s of one request: the engine (`slots` slots, one busy; `decode_steps` per call, and
    one) and Decoder.generate at batch 1, all from a 16-token prompt, prefill excluded (time for new_tokens
    minus time for 1), interleaved over 4 repetitions (medians). `paged` (a dict of PagedEngine options):
    the paged engine of as many requests too, with `decode_steps` per call."""
    prompt = workload(cfg, 1, 16, 16, seed=1)[0]
    numerics = numerics or {}
    decoder = jaxgpt.Decoder(params, cfg, **numerics)

    def gen(n):
        out = decoder.generate(np.array([prompt]), n, jax.random.key(0), temperature=1.0, top_k=TOP_K)
        out.tokens.block_until_ready()

    engines = {name: Engine(params, cfg, slots=slots, max_len=16 + new_tokens, prefill_chunk=16, decode_steps=k,
                            **numerics)
               for name, k in (("engine", decode_steps), ("engine_1_step", 1))}
    if paged is not None:
        from jaxgpt.engine.paged import PagedEngine
        engines["paged"] = PagedEngine(params, cfg, max_requests=slots, max_len=16 + new_tokens,
                                       decode_steps=decode_steps, **numerics, **paged)

    def runner(engine):
        return lambda n: engine.run([dict(prompt=prompt, max_tokens=n, temperature=1.0, top_k=TOP_K)])

    out = {"decode_steps": str(decode_steps)}
    fns = {"generate": gen, **{name: runner(e) for name, e in engines.items()}}
    for fn in fns.values():
        fn(1), fn(new_tokens)  # compile
    per_token = {name: [] for name in fns}
    for _ in range(4):  # interleaved: the machine's drift falls on all three alike
        for name, fn in fns.items():
            t0 = time.perf_counter()
            fn(new_tokens)
            t1 = time.perf_counter()
            fn(1)
            per_token[name].append((t1 - t0 - (time.perf_counter() - t1)) / (new_tokens - 1))
    for name, times in per_token.items():
        out[name + "_tokens_per_s"] = 1.0 / float(np.median(times))
    out["engine_over_generate"] = out["engine_tokens_per_s"] / out["generate_tokens_per_s"]
    out["engine_1_step_over_generate"] = out["engine_1_step_tokens_per_s"] / out["generate_tokens_per_s"]
    if paged is not None:
        out["paged_over_generate"] = out["paged_tokens_per_s"] / out["generate_tokens_per_s"]
    return out


def paged_run(params, cfg, c, max_len, args, prompts, counts, step, fixed, numerics, budget: int,
              async_scheduling=None) -> dict:
    """The same requests through a PagedEngine of c requests: tok/s, TTFT, ITL, the share of wall time its
    thread spent outside compiled calls, pages held at most, programs and warm-up; and its calls' seconds
    fitted as a + b x tokens, with the share of the engine's time the ramp's prompts ask for (b x the mean
    prompt / the decode step that separates arrivals) and the step that share settles at, a / (1 - share)."""
    from jaxgpt.engine.paged import PagedEngine

    engine = PagedEngine(params, cfg, max_requests=c, max_len=max_len, page_size=args.page_size,
                         token_budget=budget, async_scheduling=async_scheduling, **numerics)
    t0 = time.perf_counter()
    programs = engine.warmup(prompt_logprobs=False)
    warm = time.perf_counter() - t0
    one = replay_engine(engine, prompts, counts, stagger=step)
    st = engine.stats
    # what the ramp asks of the engine: b x (prompt tokens a step apart) of each second, and the step that
    # load settles at, a / (1 - load), against the largest step the budget allows
    a, b = step_cost(one["steps"])
    mean_prompt = float(np.mean([len(p) for p in prompts]))
    load = b * mean_prompt / step
    settled = a / (1 - load) if load < 1 else float("inf")
    out = dict(paged_tokens_per_s=one["tokens_per_s"], paged_over_fixed=one["tokens_per_s"] / fixed["tokens_per_s"],
               paged_ttft_p50_s=percentile(one["ttft_s"], 50), paged_ttft_p99_s=percentile(one["ttft_s"], 99),
               paged_ttft_past_prefill_p99_steps=percentile(one["ttft_past_prefill_s"], 99) / step,
               paged_ttft_past_serial_p99_steps=percentile(one["ttft_past_serial_s"], 99) / step,
               paged_itl_p50_s=percentile(one["itl_s"], 50), paged_itl_p99_s=percentile(one["itl_s"], 99),
               paged_host_share=st.host_seconds / one["seconds"], paged_steps=st.steps,
               paged_padding_share=st.padding_tokens / max(1, st.padding_tokens + st.prompt_tokens + st.decode_tokens),
               paged_peak_pages=st.peak_pages, paged_page_size=args.page_size, paged_programs=programs,
               paged_warmup_s=warm, paged_token_budget=budget, paged_async_scheduling=engine.async_scheduling,
               paged_step_fixed_s=a, paged_step_per_token_s=b, paged_mean_prompt=mean_prompt, paged_ramp_load=load,
               paged_settled_step_s=settled, paged_full_step_s=a + b * budget)
    print(f"       paged engine, budget {budget}{', async' if engine.async_scheduling else ''}: "
          f"{one['tokens_per_s']:8.1f} tok/s  x{out['paged_over_fixed']:.2f}  TTFT p50/p99 "
          f"{out['paged_ttft_p50_s']:.3f}/{out['paged_ttft_p99_s']:.3f} s  ITL p50/p99 {out['paged_itl_p50_s']:.3f}/"
          f"{out['paged_itl_p99_s']:.3f} s  p99 past prefill {out['paged_ttft_past_prefill_p99_steps']:.2f} steps "
          f"(past serial prefills {out['paged_ttft_past_serial_p99_steps']:.2f})  host {out['paged_host_share']:.1%}  "
          f"peak pages {st.peak_pages} of {engine.num_pages - 1}  {programs} programs in {warm:.1f} s", flush=True)
    print(f"       a step: {1e3 * a:.1f} ms + {1e3 * b:.3f} ms a token (fit over {len(one['steps'])} calls); the "
          f"ramp's prompts take {load:.2f} of its time: steps settle at {1e3 * settled:.0f} ms (a full one "
          f"{1e3 * out['paged_full_step_s']:.0f} ms, a decode step {1e3 * step:.1f} ms)", flush=True)
    return out


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--new-tokens", type=int, default=128, help="each request's max_tokens (the most, with "
                    "--min-new-tokens)")
    ap.add_argument("--min-new-tokens", type=int, default=None,
                    help="draw each request's max_tokens uniformly from this to --new-tokens (default: all equal)")
    ap.add_argument("--min-prompt", type=int, default=16)
    ap.add_argument("--max-prompt", type=int, default=256)
    ap.add_argument("--max-len", type=int, default=None,
                    help="the engine's positions a slot (default --max-prompt + --new-tokens; jaxgpt-serve's is the "
                         "model's context)")
    ap.add_argument("--prefill-chunk", type=int, default=256)
    ap.add_argument("--prefill-budget", type=int, default=None,
                    help="prompt tokens per engine step (Engine(prefill_budget=...); default --prefill-chunk)")
    ap.add_argument("--packed", action="store_true",
                    help="also replay an engine that packs whole prompts into one prefill call (packed_prefill=True)")
    ap.add_argument("--paged", action="store_true",
                    help="also replay the paged engine (jaxgpt.engine.PagedEngine: one ragged step a call)")
    ap.add_argument("--token-budget", type=int, nargs="+", default=[DEFAULT_TOKEN_BUDGET],
                    help=f"with --paged: tokens a step (default the engine's, {DEFAULT_TOKEN_BUDGET}); several: the "
                         "paged replay once for each, the first's figures as paged_*, all under paged_by_budget")
    ap.add_argument("--compare-async", action="store_true",
                    help="with --paged: also replay the first budget with asynchronous scheduling on (the "
                         "default on CPUs is off), figures under paged_async")
    ap.add_argument("--page-size", type=int, default=16, help="with --paged: positions a page (default 16)")
    ap.add_argument("--decode-steps", type=decode_steps_arg, default=DEFAULT_DECODE_STEPS,
                    help="the engine's decode steps per call, N or ROWS:N,... (Engine(decode_steps=...); default "
                         f"jaxgpt-serve's, {DEFAULT_DECODE_STEPS_TEXT})")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"],
                    help="the model's compute dtype (GPTConfig.dtype; params stay float32), for both sides")
    ap.add_argument("--quantize", default="none", choices=["none", "int8", "w8a8"],
                    help="the engine's and Decoder's quantize= (both sides alike; default none)")
    ap.add_argument("--kv-dtype", default="none", choices=["none", "int8"],
                    help="the engines' and Decoder's kv_dtype= (an int8 cache, both sides alike; default none)")
    ap.add_argument("--top-k", type=int, default=50,
                    help="each request's top_k, both sides (0: none, a draw over the whole vocabulary, what an "
                         "OpenAI-style request without top_k gets)")
    ap.add_argument("--no-lone", dest="lone", action="store_false", help="skip the lone-request comparison")
    ap.add_argument("--tiny", action="store_true", help="a tiny model and short runs (the smoke test)")
    ap.add_argument("--out", default=None, help="results file name (default engine.json, tiny: not written)")
    args = ap.parse_args(argv)
    global TOP_K
    TOP_K = args.top_k or None
    cfg = config(args.tiny).replace(dtype=args.dtype)
    quantize = None if args.quantize == "none" else args.quantize
    numerics = dict(quantize=quantize, kv_dtype=None if args.kv_dtype == "none" else args.kv_dtype)
    min_new = args.new_tokens if args.min_new_tokens is None else args.min_new_tokens
    if not 1 <= min_new <= args.new_tokens:
        ap.error(f"--min-new-tokens must be in 1..--new-tokens ({args.new_tokens}), got {min_new}")
    params = jaxgpt.init_params(cfg, jax.random.key(0))
    max_len = args.max_len or args.max_prompt + args.new_tokens
    if max_len < args.max_prompt + args.new_tokens:
        ap.error(f"--max-len must hold --max-prompt + --new-tokens ({args.max_prompt + args.new_tokens})")
    results = {"machine": machine(), "cpu_flags": sorted(f for f in jaxgpt.backends.cpu.cpu_flags()
                                                         if f.startswith(("avx512", "amx", "avx2"))),
               "config": "tiny" if args.tiny else "gpt2-124m", "dtype": args.dtype, "quantize": args.quantize,
               "kv_dtype": args.kv_dtype,
               "top_k": TOP_K,
               "new_tokens": args.new_tokens, "min_new_tokens": min_new,
               "prompt_range": [args.min_prompt, args.max_prompt], "runs": []}
    decoder = jaxgpt.Decoder(params, cfg, **numerics)
    for c in args.concurrency:
        def make(packed=False):
            return Engine(params, cfg, slots=c, max_len=max_len, prefill_chunk=args.prefill_chunk,
                          prefill_budget=args.prefill_budget, decode_steps=args.decode_steps, **numerics,
                          packed_prefill=packed)
        engine = make()
        t0 = time.perf_counter()
        programs = engine.warmup(prompt_logprobs=False)
        warm = time.perf_counter() - t0
        step = step_time(engine, args.new_tokens)
        n = max(8, 4 * c)
        prompts = workload(cfg, n, args.min_prompt, args.max_prompt, seed=c)
        counts = new_token_counts(n, min_new, args.new_tokens, seed=c)
        before = dict(engine.stats)
        eng = replay_engine(engine, prompts, counts, stagger=step)
        calls = engine_summary(before, dict(engine.stats), n, eng["seconds"])
        fixed = replay_fixed(decoder, prompts, c, counts, stagger=step)
        run = {"concurrency": c, "requests": n, "decode_step_s": step, "engine_tokens": eng["tokens"],
               "engine_programs": programs, "engine_warmup_s": warm, "kv_cache_bytes": engine.cache_bytes,
               "engine_tokens_per_s": eng["tokens_per_s"], "fixed_tokens_per_s": fixed["tokens_per_s"],
               "engine_over_fixed": eng["tokens_per_s"] / fixed["tokens_per_s"],
               "engine_ttft_p50_s": percentile(eng["ttft_s"], 50), "engine_ttft_p99_s": percentile(eng["ttft_s"], 99),
               "fixed_ttft_p50_s": percentile(fixed["ttft_s"], 50), "fixed_ttft_p99_s": percentile(fixed["ttft_s"], 99),
               "engine_ttft_past_prefill_p99_steps": percentile(eng["ttft_past_prefill_s"], 99) / step,
               "engine_ttft_past_serial_p99_steps": percentile(eng["ttft_past_serial_s"], 99) / step,
               "engine_itl_p50_s": percentile(eng["itl_s"], 50), "engine_itl_p99_s": percentile(eng["itl_s"], 99),
               "prefill_budget": engine.prefill_budget,
               "fixed_seconds": fixed["seconds"], "fixed_prefill_s": fixed["prefill_s"],
               "fixed_prefill_padding_share": fixed["prefill_padding_share"], "engine_calls": calls}
        if args.packed:  # the same requests through an engine that packs whole prompts into one call
            other = make(packed=True)
            other.warmup(prompt_logprobs=False)
            one = replay_engine(other, prompts, counts, stagger=step)
            run.update(packed_tokens_per_s=one["tokens_per_s"], packed_over_fixed=one["tokens_per_s"] /
                       fixed["tokens_per_s"], packed_ttft_p50_s=percentile(one["ttft_s"], 50),
                       packed_ttft_p99_s=percentile(one["ttft_s"], 99),
                       packed_ttft_past_prefill_p99_steps=percentile(one["ttft_past_prefill_s"], 99) / step,
                       packed_calls=other.stats["prefill_packed_calls"])
            print(f"       packed prompts: {one['tokens_per_s']:8.1f} tok/s  x{run['packed_over_fixed']:.2f}  "
                  f"TTFT p50/p99 {run['packed_ttft_p50_s']:.3f}/{run['packed_ttft_p99_s']:.3f} s  p99 past "
                  f"prefill {run['packed_ttft_past_prefill_p99_steps']:.2f} steps", flush=True)
        if args.paged:
            by_budget = [paged_run(params, cfg, c, max_len, args, prompts, counts, step, fixed, numerics, b)
                         for b in args.token_budget]
            run.update(by_budget[0], paged_by_budget=by_budget)
            if args.compare_async:
                run["paged_async"] = paged_run(params, cfg, c, max_len, args, prompts, counts, step, fixed, numerics,
                                               args.token_budget[0], async_scheduling=True)
        results["runs"].append(run)
        del engine
        if args.packed:
            del other
        # this run's programs go: every compiled program holds memory mappings, and a run of 1, 8 and 32
        # reached Linux's limit in the lone-request part (LLVM: "Cannot allocate memory", then a SIGSEGV)
        jax.clear_caches()
        print(f"c={c:3d}  engine {run['engine_tokens_per_s']:8.1f} tok/s  fixed {run['fixed_tokens_per_s']:8.1f} tok/s"
              f"  x{run['engine_over_fixed']:.2f}  TTFT p50/p99 engine {run['engine_ttft_p50_s']:.3f}/"
              f"{run['engine_ttft_p99_s']:.3f} s fixed {run['fixed_ttft_p50_s']:.3f}/{run['fixed_ttft_p99_s']:.3f} s"
              f"  p99 past prefill {run['engine_ttft_past_prefill_p99_steps']:.2f} steps"
              f" (past serial prefills {run['engine_ttft_past_serial_p99_steps']:.2f})"
              f"  ITL p50/p99 {1e3 * run['engine_itl_p50_s']:.0f}/{1e3 * run['engine_itl_p99_s']:.0f} ms"
              f"  ({programs} programs, warm-up {warm:.1f} s)\n"
              f"       fixed batches: {fixed['seconds']:.1f} s, their prefill alone {fixed['prefill_s']:.1f} s, "
              f"{100 * fixed['prefill_padding_share']:.0f}% of its positions padding\n"
              f"       {format_engine_summary(calls)}", flush=True)
    for slots in sorted({1, max(args.concurrency)}) if args.lone else ():
        paged = dict(page_size=args.page_size, token_budget=args.token_budget[0]) if args.paged else None
        lone = lone_decode(params, cfg, slots, args.new_tokens, args.decode_steps, numerics, paged=paged)
        results[f"lone_request_slots_{slots}"] = lone
        print(f"lone request, engine of {slots} slot(s): {lone['engine_tokens_per_s']:.1f} tok/s "
              f"({args.decode_steps} steps a call; one: {lone['engine_1_step_tokens_per_s']:.1f}), "
              f"Decoder.generate batch 1: {lone['generate_tokens_per_s']:.1f} tok/s "
              f"(x{lone['engine_over_generate']:.2f}; one step a call x{lone['engine_1_step_over_generate']:.2f})"
              + (f"; paged engine {lone['paged_tokens_per_s']:.1f} tok/s (x{lone['paged_over_generate']:.2f})"
                 if paged else ""), flush=True)
    if args.out or not args.tiny:
        print("wrote", write_results(args.out or "engine", results))
    return results


if __name__ == "__main__":
    main()
