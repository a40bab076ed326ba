"""jaxgpt-serve: an OpenAI-compatible HTTP server (vLLM's API) over the engine, for a training run's
checkpoint or a Hugging Face folder."""

from __future__ import annotations

import argparse
import logging
import math
import os
import signal
import sys
import threading

from jaxgpt.cli import cpu_unless_accelerated


DEFAULT_DECODE_STEPS_TEXT = "1:16,2:8,4:4"


def decode_steps_arg(text: str):
    """--decode_steps: "4" (every batch) or "1:16,2:8,4:4" (rows: steps) -> an int or a dict (Engine's)."""
    try:
        table = dict(part.split(":") for part in text.split(",")) if ":" in text else {"1": text}
        table = {int(r): int(k) for r, k in table.items()}
        if 1 not in table or min(table) < 1 or min(table.values()) < 1:
            raise ValueError(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"expected N or ROWS:N,... (integers >= 1, with ROWS 1), got {text!r}") from e
    return table[1] if ":" not in text else table


DEFAULT_DECODE_STEPS = decode_steps_arg(DEFAULT_DECODE_STEPS_TEXT)
DEFAULT_TOKEN_BUDGET = 512  # the paged engine's own (engine/paged.py; not imported here: --help stays light)
DEFAULT_MAX_REQUEST_BYTES = 16 * 2 ** 20

# the numeric flags' ranges (None: no bound that side), checked before anything loads or compiles
_RANGES = {"port": (0, 65535), "step": (0, None), "slots": (1, None), "max_len": (2, None),
           "prefill_chunk": (1, None), "prefill_budget": (1, None), "max_logprobs": (1, None),
           "max_waiting": (0, None), "max_request_bytes": (1, None), "speculative_k": (1, 15), "ngram": (1, None),
           "page_size": (1, None), "num_pages": (2, None), "token_budget": (1, None)}


def check_numbers(args) -> str | None:
    """What is wrong with the numeric flags, in one line (None: nothing): each in its range, so that a bad
    one is refused at once, not after minutes of loading and compiling (or, for a port past 65535, by
    serving on another port than the one announced)."""
    for name, (lo, hi) in _RANGES.items():
        value = getattr(args, name)
        if value is None or ((lo is None or value >= lo) and (hi is None or value <= hi)):
            continue
        if hi is None:
            return f"--{name} must be >= {lo}, got {value}"
        zero = " (0: any free port)" if name == "port" else ""
        return f"--{name} must be in {lo}..{hi}{zero}, got {value}"
    if args.engine == "paged" and args.speculative != "none":
        return "--speculative is not available with --engine paged (use --engine slots)"
    if not (math.isfinite(args.grace_period) and args.grace_period >= 0):
        return f"--grace_period must be a number of seconds >= 0, got {args.grace_period}"
    if args.profile:
        from jaxgpt.training.profiling import parse_window
        try:
            parse_window(args.profile, key="--profile")
        except ValueError as e:
            return str(e).replace("traces steps", "traces engine steps")
    return None


def _paged_engine(args, params, config):
    from jaxgpt.engine.paged import PagedEngine
    return PagedEngine(params, config, max_requests=args.slots, max_len=args.max_len, page_size=args.page_size,
                       num_pages=args.num_pages, token_budget=args.token_budget,
                       max_logprobs=min(args.max_logprobs, config.vocab_size),
                       quantize=None if args.quantize == "none" else args.quantize,
                       kv_dtype=None if args.kv_dtype == "none" else args.kv_dtype,
                       prefix_caching=not args.no_prefix_caching, decode_steps=args.decode_steps)


def _paged_flags(p: argparse.ArgumentParser) -> None:
    """The engine's kind and the paged engine's own flags."""
    p.add_argument("--engine", default="auto", choices=["auto", "paged", "slots"],
                   help="paged: a pool of pages shared through block tables, one ragged step a call under "
                        "--token_budget, prefixes reused by block hash (jaxgpt.engine.PagedEngine); slots: dense "
                        "slots, each a cache row of --max_len (jaxgpt.Engine; --prefill_chunk, --prefill_budget "
                        "and --speculative are its own); auto (default): paged, or slots with --speculative")
    p.add_argument("--page_size", type=int, default=16, help="with --engine paged: positions per page (default 16)")
    p.add_argument("--num_pages", type=int, default=None,
                   help="with --engine paged: pages in the pool (default: --slots x --max_len positions, plus the "
                        "padding page)")
    p.add_argument("--token_budget", type=int, default=DEFAULT_TOKEN_BUDGET,
                   help="with --engine paged: most tokens per step, decode tokens and prompt chunks together "
                        f"(default {DEFAULT_TOKEN_BUDGET}: lower TTFT than 256 on a CPU under load, at a higher ITL "
                        "while prompts arrive)")
    p.add_argument("--no_prefix_caching", action="store_true",
                   help="with --engine paged: do not keep full pages for reuse by later requests")
    p.add_argument("--compile", default="background", choices=["background", "all"],
                   help="with --engine paged: background (default): answer once the largest step's programs are "
                        "compiled (they hold any step) and compile the others beside the engine's steps, which "
                        "are padded to compiled ones meanwhile (/metrics: jaxgpt_engine_programs_pending); all: "
                        "compile every program before answering")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="jaxgpt-serve", description=__doc__)
    p.add_argument("--out_dir", default="out", help="training run folder holding checkpoints/ (default: out)")
    p.add_argument("--init_from", default=None,
                   help="instead of --out_dir: a GPT-2 name (gpt2, ...) or a Hugging Face folder (served with "
                        "the tokenizer.json it holds)")
    p.add_argument("--step", type=int, default=None, help="with --out_dir: checkpoint step (default: the latest)")
    p.add_argument("--tokenizer", default=None,
                   help="with --init_from, when the folder has no tokenizer.json: a tokenizer name (default gpt2)")
    p.add_argument("--import", dest="imports", action="append", default=[], metavar="MODULE",
                   help="import this module first: one that registers the run's block or attention (repeatable; "
                        "the modules a run recorded are imported without it)")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1: this machine only)")
    p.add_argument("--port", type=int, default=8000, help="port (default 8000; 0: any free port, printed when ready)")
    p.add_argument("--slots", type=int, default=8, help="requests decoded at once (the engine's slots)")
    _paged_flags(p)
    p.add_argument("--max_len", type=int, default=None,
                   help="positions per slot: prompt + completion (default: the model's block_size)")
    p.add_argument("--prefill_chunk", type=int, default=256,
                   help="most prompt tokens of one request in one prefill call (the longest prefill program)")
    p.add_argument("--prefill_budget", type=int, default=None,
                   help="prompt tokens prefilled per engine step, over as many waiting requests as it reaches "
                        "(default: --prefill_chunk): more lets a burst of arrivals in sooner, at the cost of the "
                        "running requests' pace while they enter")
    p.add_argument("--decode_steps", type=decode_steps_arg, default=DEFAULT_DECODE_STEPS,
                   help="decode steps per compiled call while no prompt is entering: N for every batch, or "
                        "ROWS:N,... by the decode's rows (each batch takes the entry of the largest ROWS at most "
                        f"its own; default {DEFAULT_DECODE_STEPS_TEXT}: a call's fixed cost weighs most on a "
                        "step over few rows, bench/README.md). The same tokens with less fixed cost per token; a "
                        "request that arrives meanwhile waits up to that many steps, and tokens stream that many "
                        "at a time (1: a call per token; ignored with --speculative)")
    p.add_argument("--max_logprobs", type=int, default=20, help="most alternatives a request may ask logprobs for")
    p.add_argument("--max_waiting", type=int, default=256,
                   help="requests that may wait for a slot; past it the server answers 429 at once")
    p.add_argument("--max_request_bytes", type=int, default=DEFAULT_MAX_REQUEST_BYTES,
                   help="largest request body accepted, in bytes (default 16 MiB, 16777216); a larger one is "
                        "answered 413 without being read further")
    p.add_argument("--api_key", default=None,
                   help="require 'Authorization: Bearer KEY' on /v1/ (default: none; also $JAXGPT_API_KEY)")
    p.add_argument("--served_model_name", default=None,
                   help="the model's name in the API (default: the run folder's or model's name)")
    p.add_argument("--chat_template", default=None,
                   help="a Jinja chat template file for /v1/chat/completions (default: the HF folder's "
                        "tokenizer_config.json chat_template, if any)")
    p.add_argument("--grace_period", type=float, default=30.0,
                   help="seconds that requests in flight get to finish after SIGTERM (default 30)")
    p.add_argument("--log_requests", action="store_true", help="log prompts and outputs (off: never logged)")
    p.add_argument("--compile_cache", default="auto",
                   help="compiled programs kept on disk, so that the next start skips compiling them: 'auto' "
                        "($JAXGPT_CACHE/xla, where jaxgpt-train keeps them), 'off', or a folder")
    p.add_argument("--cpu_dispatch", default="async", choices=["async", "inline"],
                   help="on a CPU, where compiled calls run: on JAX's own thread (async, the default) or on the "
                        "engine thread that makes them (inline, as jaxgpt-train runs); async measured as fast or "
                        "faster at 1, 8 and 32 requests with 32 slots (bench/README.md)")
    p.add_argument("--quantize", default="none", choices=["none", "int8", "w8a8"],
                   help="decode with int8 weights (a scale per output channel, made at load; default none); w8a8: "
                        "the activations rounded to int8 per row too, prompts' included (faster at 8+ rows and in "
                        "prefill on a CPU with AVX512-VNNI)")
    p.add_argument("--kv_dtype", default="none", choices=["none", "int8", "bfloat16", "float32"],
                   help="the KV cache's dtype (none: the model's compute dtype; int8: a scale per position and head)")
    p.add_argument("--speculative", default="none", choices=["none", "ngram"],
                   help="decode speculatively with n-gram proposals looked up in each request's own text (no "
                        "second model); every request's tokens stay what plain decoding gives (default none)")
    p.add_argument("--speculative_k", type=int, default=4, help="tokens proposed per step and request (default 4)")
    p.add_argument("--ngram", type=int, default=3, help="with --speculative=ngram: tokens matched (default 3)")
    p.add_argument("--profile", default=None, metavar="START:STOP",
                   help="a jax.profiler trace of engine steps START..STOP-1 (counted from 0 at the first step after "
                        "the warm-up), each step annotated, the device synchronised at both ends; into --profile_dir")
    p.add_argument("--profile_dir", default="jaxgpt-serve-profile",
                   help="with --profile: the trace's folder (default ./jaxgpt-serve-profile; TensorBoard's profile "
                        "plugin and Perfetto read it)")
    return p


def _profiler(args):
    """The StepProfiler of --profile (None without it)."""
    if not args.profile:
        return None
    from jaxgpt.training.profiling import StepProfiler, parse_window
    return StepProfiler(parse_window(args.profile, key="--profile"), os.path.expanduser(args.profile_dir),
                        name="engine")


def _chat_template(args, folder) -> str | None:
    from jaxgpt.loading import tokenizer_config

    if args.chat_template:
        with open(os.path.expanduser(args.chat_template), encoding="utf-8") as f:
            return f.read()
    template = tokenizer_config(folder).get("chat_template") if folder else None
    if isinstance(template, list):  # named templates: the default one
        template = next((t.get("template") for t in template if t.get("name") == "default"), None)
    return template if isinstance(template, str) else None


def _load(args):
    """(config, params, tokenizer, model name, chat template)."""
    from jaxgpt import loading
    if args.init_from:
        config, params, tok, meta, _ = loading.load(args.init_from, step=args.step,
                                                    tokenizer=args.tokenizer or "gpt2", imports=args.imports)
        folder = os.path.expanduser(args.init_from)
        name = os.path.basename(os.path.normpath(args.init_from))
        # a Hugging Face folder's template (a run's or a GPT-2 name's: none)
        return config, params, tok, name, _chat_template(args, folder if os.path.isdir(folder) and not meta else None)
    config, params, tok, _, _ = loading.load_run(args.out_dir, args.step, imports=args.imports)
    name = os.path.basename(os.path.abspath(os.path.expanduser(args.out_dir)))
    return config, params, tok, name, _chat_template(args, None)


def _announce_when_ready(server, worker, args, name: str) -> None:
    """Print the one ready line once the engine is warm and the socket is listening."""
    worker.ready.wait()
    while not server.started and not server.should_exit:
        threading.Event().wait(0.05)
    if not server.started:
        return
    import jax

    from jaxgpt.backends.cpu import cpu_dispatch

    port = server.servers[0].sockets[0].getsockname()[1] if server.servers else args.port
    dispatch = f"; CPU dispatch {cpu_dispatch()}" if jax.default_backend() == "cpu" else ""
    eng = worker.engine
    sizes = (f"paged engine: {eng.max_requests} requests of up to {eng.max_len} positions, {eng.num_pages} pages "
             f"of {eng.page_size}" if hasattr(eng, "page_size") else
             f"slots engine: {eng.slots} slots of {eng.max_len} positions")
    print(f"jaxgpt-serve: ready at http://{args.host}:{port}/v1 (model {name}; {sizes}{dispatch})", flush=True)


def _watch_warmup(server, worker) -> None:
    """Stop the server if the engine's warm-up fails (the error is logged)."""
    while not worker.ready.wait(0.2):
        if worker.failed is not None:
            server.should_exit = True
            return


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    if args.engine == "auto":
        args.engine = "slots" if args.speculative != "none" else "paged"
    problem = check_numbers(args)
    if problem:
        print(f"jaxgpt-serve: {problem}", file=sys.stderr)
        return 2
    from jaxgpt.backends.cpu import single_malloc_arena

    single_malloc_arena()  # before JAX's threads: the engine thread's temporaries stay in the process
    cpu_unless_accelerated()
    from jaxgpt import compile_cache
    from jaxgpt.backends.cpu import inline_cpu_dispatch
    from jaxgpt.report import one_line

    def fail(e) -> int:
        print(f"jaxgpt-serve: {one_line(str(e))}", file=sys.stderr)
        return 2

    compile_cache.enable(args.compile_cache)  # before the first compilation
    if args.cpu_dispatch == "inline":
        inline_cpu_dispatch()  # the engine thread runs each computation itself (backends/cpu.py)

    try:
        import uvicorn

        from jaxgpt.serve import create_app
    except ImportError as e:
        return fail(f"{e}: the server needs the serve extra: pip install 'jaxgpt[serve]'")
    from jaxgpt.checkpoint import CheckpointError
    from jaxgpt.engine import Engine
    from jaxgpt.speculative import Speculative

    # the server's own lines (warm-up, --log_requests, errors) at INFO on stderr, through a handler of its
    # own: the root logger's level and handler are not ours to set (absl sets them when orbax is imported,
    # which made a basicConfig here a no-op, and with it --log_requests), and at INFO they would let
    # every library's chatter through
    own = logging.getLogger("jaxgpt")
    if not own.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s"))
        own.addHandler(handler)
    own.setLevel(logging.INFO)
    own.propagate = False
    try:
        config, params, tok, name, template = _load(args)
        engine = _paged_engine(args, params, config) if args.engine == "paged" else Engine(
                        params, config, slots=args.slots, max_len=args.max_len, prefill_chunk=args.prefill_chunk,
                        prefill_budget=args.prefill_budget,
                        max_logprobs=min(args.max_logprobs, config.vocab_size), decode_steps=args.decode_steps,
                        quantize=None if args.quantize == "none" else args.quantize,
                        kv_dtype=None if args.kv_dtype == "none" else args.kv_dtype,
                        speculative=None if args.speculative == "none" else
                        Speculative(k=args.speculative_k, ngram=args.ngram))
    except (ValueError, CheckpointError, OSError, ImportError) as e:
        return fail(e)
    app = create_app(engine, tok, model_name=args.served_model_name or name, max_waiting=args.max_waiting,
                     max_request_bytes=args.max_request_bytes,
                     api_key=args.api_key or os.environ.get("JAXGPT_API_KEY"), log_requests=args.log_requests,
                     chat_template=template, progress=True, profiler=_profiler(args),
                     warmup="background" if args.compile == "background" else True)
    server = uvicorn.Server(uvicorn.Config(app, host=args.host, port=args.port, log_level="info",
                                           timeout_graceful_shutdown=args.grace_period, lifespan="on"))
    worker = app.state.service.worker
    threading.Thread(target=_announce_when_ready, args=(server, worker, args, args.served_model_name or name),
                     daemon=True).start()
    threading.Thread(target=_watch_warmup, args=(server, worker), daemon=True).start()
    # uvicorn re-raises the SIGTERM or SIGINT that stopped it once it has shut down gracefully: with these
    # handlers in place that ends in a normal exit (status 0), not in death by the signal
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: None)
    server.run()
    if worker.failed is not None:
        return fail(f"the engine's warm-up failed: {worker.failed}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
