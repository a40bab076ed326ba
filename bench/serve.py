"""Serving benchmark: the same load, one client, against jaxgpt-serve and vLLM's CPU build on the same weights.

python bench/serve.py [--vllm /tmp/vllm-cpu] [--concurrency 1 8 32] [--num-prompts 32 256 256]
                      [--vllm-bindings [default] [both]] [--jaxgpt-args "--slots 32" [--jaxgpt-args ...]]
                      [--rounds 1] [--generate-prompts 8] [--smoke]

GPT-2 124M shape (vocab 50257, 1024 positions, 12 layers, 12 heads, 768 wide), float32, random weights made
with jaxgpt.init_params and exported with jaxgpt.save_pretrained to one Hugging Face folder (with n_ctx in
config.json and a byte-level BPE tokenizer.json of 50257 tokens built here: 256 bytes, 50,000 two-byte
merges, <|endoftext|>; a GPT-2 tokenizer cannot be downloaded on these machines and any byte-level BPE of
the right size gives the same work). Both servers serve that folder on 127.0.0.1, one after the other
(never at once): `jaxgpt-serve --init_from=FOLDER`, then `vllm serve FOLDER --dtype float32
--max-model-len 1024` in each binding asked for: `default` (vLLM's own: one core for its engine, one for
its HTTP server on 2 cores) and `both` (VLLM_CPU_NUM_OF_RESERVED_CPU=0 VLLM_CPU_OMP_THREADS_BIND=0-N: its
engine gets every core). The load, from vLLM's own client `vllm bench serve` (nobody's home game): random
prompts of 64-192 tokens, 128 output tokens each with ignore_eos, streamed, at each concurrency; each
server first gets an unrecorded warm-up at the largest concurrency. Reports output tokens/s, time to first
token p50/p99 and inter-token latency p50/p99 per server and concurrency, and for jaxgpt-serve how the load
became engine calls (its /metrics counters), and beside its figure at 1 request `Decoder.generate` at
batch 1 on requests of the same kind, in this process before any server starts and again right after
jaxgpt-serve's run at 1 request (the server idle: this machine's bandwidth drifts); bench/results/serve.json.
`--vllm-bindings` with no binding after it measures jaxgpt-serve alone under vLLM's client. Several
`--jaxgpt-args` compare jaxgpt-serve configurations in one run: one server each, in turn, `--rounds` times
(A B A B), each at 1 request against `generate` with its own kernels and cache, and a table of each one's
rounds and their mean (this machine's drifts between runs are as large as most differences worth measuring).

Without --vllm the vLLM side is skipped and jaxgpt-serve is measured with a small built-in client (threads,
streaming, the same metrics); --smoke runs a tiny model with a few requests that way (the test).
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.common import engine_summary, format_engine_summary, write_results  # noqa: E402

MODEL_NAME = "gpt2"  # both servers' --served-model-name
ENDOFTEXT = "<|endoftext|>"


# -- the model folder ------------------------------------------------------------------------------------

def gpt2_config(smoke: bool):
    import jaxgpt

    if smoke:
        return jaxgpt.GPTConfig(vocab_size=512, block_size=64, n_layer=2, n_head=2, n_embd=32)
    return jaxgpt.GPTConfig(vocab_size=50257, block_size=1024, n_layer=12, n_head=12, n_embd=768)


def _byte_alphabet() -> list:
    """GPT-2's byte-level alphabet: the character each byte 0..255 is written as, in byte order."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), 256))
    out, extra = {}, 0
    for b in range(256):
        if b in keep:
            out[b] = chr(b)
        else:
            out[b] = chr(256 + extra)
            extra += 1
    return [out[b] for b in range(256)]


def byte_level_bpe_json(vocab_size: int) -> str:
    """A GPT-2-style byte-level BPE of `vocab_size` tokens: the 256 bytes, vocab_size - 257 merges of two
    bytes (printable ASCII pairs first), and <|endoftext|> last (GPT-2's id 50256 at full size)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors

    if vocab_size < 257:
        raise ValueError(f"a byte-level BPE needs vocab_size >= 257, got {vocab_size}")
    alphabet = _byte_alphabet()
    order = sorted(range(256), key=lambda b: (not 32 <= b < 127, b))  # printable ASCII first
    vocab = {alphabet[b]: b for b in range(256)}
    merges = []
    for a in order:
        for b in order:
            if len(merges) == vocab_size - 257:
                break
            merges.append((alphabet[a], alphabet[b]))
            vocab[alphabet[a] + alphabet[b]] = len(vocab)
    tk = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tk.decoder = decoders.ByteLevel()
    tk.post_processor = processors.ByteLevel(trim_offsets=False)
    tk.add_special_tokens([ENDOFTEXT])
    assert tk.get_vocab_size() == vocab_size and tk.token_to_id(ENDOFTEXT) == vocab_size - 1
    return tk.to_str()


def make_model_folder(folder: str, smoke: bool, seed: int = 0) -> str:
    """Random float32 weights of the benchmark's shape as a Hugging Face folder both servers load."""
    import jax

    import jaxgpt

    cfg = gpt2_config(smoke)
    params = jaxgpt.init_params(cfg, jax.random.PRNGKey(seed))
    jaxgpt.save_pretrained(params, cfg, folder)
    path = os.path.join(folder, "config.json")
    with open(path) as f:
        hf = json.load(f)
    hf["n_ctx"] = cfg.block_size  # llama.cpp's converter and older readers want it
    with open(path, "w") as f:
        json.dump(hf, f, indent=2)
    with open(os.path.join(folder, "tokenizer.json"), "w", encoding="utf-8") as f:
        f.write(byte_level_bpe_json(cfg.vocab_size))
    with open(os.path.join(folder, "tokenizer_config.json"), "w") as f:
        json.dump({"tokenizer_class": "GPT2TokenizerFast", "bos_token": ENDOFTEXT, "eos_token": ENDOFTEXT,
                   "unk_token": ENDOFTEXT, "model_max_length": cfg.block_size, "add_prefix_space": False}, f,
                  indent=2)
    return folder


# -- servers ---------------------------------------------------------------------------------------------

def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _get(port: int, path: str, timeout: float = 5.0) -> int:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        conn.request("GET", path)
        resp = conn.getresponse()
        resp.read()
        return resp.status
    finally:
        conn.close()


def _metrics(port: int) -> str:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    try:
        conn.request("GET", "/metrics")
        return conn.getresponse().read().decode()
    finally:
        conn.close()


def engine_counters(port: int) -> dict:
    """jaxgpt-serve's engine counters from its /metrics (jaxgpt_engine_<key>_total -> {key: value})."""
    out = {}
    for line in _metrics(port).splitlines():
        if line.startswith("jaxgpt_engine_") and "_total " in line:
            name, value = line.split()
            out[name[len("jaxgpt_engine_"):-len("_total")]] = float(value)
    return out


def programs_pending(port: int) -> int:
    """The programs jaxgpt-serve still compiles in the background (0 when its /metrics lacks the gauge)."""
    for line in _metrics(port).splitlines():
        if line.startswith("jaxgpt_engine_programs_pending "):
            return int(float(line.split()[1]))
    return 0


class Server:
    """A server subprocess (its own process group), ready once GET /health and /v1/models answer 200."""

    def __init__(self, name: str, cmd: list, env: dict, port: int, log_path: str, start_timeout: float,
                 wait_compiled: bool = False):
        self.name, self.cmd, self.env, self.port, self.log_path = name, cmd, env, port, log_path
        self.start_timeout, self.proc, self.start_s = start_timeout, None, None
        # jaxgpt-serve answers before its paged engine has compiled every program: the load waits for them
        # (so that no compilation shares the cores with it); compiled_s: from the start until then
        self.wait_compiled, self.compiled_s = wait_compiled, None

    def __enter__(self) -> "Server":
        t0 = time.perf_counter()
        self._log = open(self.log_path, "w")
        self.proc = subprocess.Popen(self.cmd, env=self.env, stdout=self._log, stderr=subprocess.STDOUT,
                                     stdin=subprocess.DEVNULL, start_new_session=True)
        deadline = t0 + self.start_timeout
        while True:
            if self.proc.poll() is not None:
                self._close()
                raise RuntimeError(f"{self.name} exited with {self.proc.returncode} before it was ready:\n"
                                   + self.tail())
            try:
                if _get(self.port, "/health") == 200 and _get(self.port, "/v1/models") == 200:
                    break
            except OSError:
                pass
            if time.perf_counter() > deadline:
                self._close()
                raise RuntimeError(f"{self.name} not ready after {self.start_timeout:.0f} s:\n" + self.tail())
            time.sleep(1.0)
        self.start_s = time.perf_counter() - t0
        while self.wait_compiled and programs_pending(self.port) > 0:
            if time.perf_counter() > deadline:
                self._close()
                raise RuntimeError(f"{self.name}: programs still compiling after {self.start_timeout:.0f} s")
            time.sleep(0.5)
        self.compiled_s = time.perf_counter() - t0
        return self

    def tail(self, n: int = 30) -> str:
        try:
            with open(self.log_path, errors="replace") as f:
                return "".join(f.readlines()[-n:])
        except OSError:
            return ""

    def _close(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGTERM)  # the group this Popen started (vLLM forks its engine)
                self.proc.wait(timeout=60)
            except (subprocess.TimeoutExpired, ProcessLookupError):
                try:
                    os.killpg(self.proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                self.proc.wait()
        self._log.close()

    def __exit__(self, *exc) -> None:
        self._close()


def jaxgpt_server(folder: str, port: int, extra: list, log_path: str, name: str = "jaxgpt-serve") -> Server:
    cmd = [sys.executable, "-m", "jaxgpt.cli.serve", f"--init_from={folder}", "--host=127.0.0.1",
           f"--port={port}", f"--served_model_name={MODEL_NAME}", *extra]
    return Server(name, cmd, dict(os.environ), port, log_path, start_timeout=900, wait_compiled=True)


VLLM_BINDINGS = {
    # vLLM's own choice: on 2 cores one for the engine (one OpenMP thread), one for its HTTP server
    "default": {},
    # its engine on every core
    "both": {"VLLM_CPU_NUM_OF_RESERVED_CPU": "0", "VLLM_CPU_OMP_THREADS_BIND": f"0-{(os.cpu_count() or 2) - 1}"},
}


def vllm_env(binding: str, kv_cache_gib: int) -> dict:
    env = dict(os.environ, VLLM_TARGET_DEVICE="cpu", VLLM_CPU_KVCACHE_SPACE=str(kv_cache_gib))
    for k in ("VLLM_CPU_NUM_OF_RESERVED_CPU", "VLLM_CPU_OMP_THREADS_BIND"):
        env.pop(k, None)
    env.update(VLLM_BINDINGS[binding])
    return env


def vllm_server(vllm_dir: str, folder: str, port: int, binding: str, max_len: int, kv_cache_gib: int,
                log_path: str, dtype: str = "float32") -> Server:
    cmd = [os.path.join(vllm_dir, "bin", "vllm"), "serve", folder, "--dtype", dtype, "--max-model-len",
           str(max_len), "--served-model-name", MODEL_NAME, "--host", "127.0.0.1", "--port", str(port)]
    return Server(f"vllm ({binding})", cmd, vllm_env(binding, kv_cache_gib), port, log_path, start_timeout=1200)


# -- clients ---------------------------------------------------------------------------------------------

KEYS = ("completed", "failed", "duration", "total_input_tokens", "total_output_tokens", "output_throughput",
        "median_ttft_ms", "p99_ttft_ms", "median_itl_ms", "p99_itl_ms", "median_tpot_ms")


def vllm_client(vllm_dir: str, port: int, folder: str, concurrency: int, num_prompts: int, input_len: int,
                output_len: int, range_ratio: float, output_range_ratio: float, seed: int, result_dir: str,
                tag: str) -> dict:
    """One `vllm bench serve` run; its result JSON (the KEYS and the rest)."""
    name = f"{tag}-c{concurrency}.json"
    cmd = [os.path.join(vllm_dir, "bin", "vllm"), "bench", "serve", "--backend", "openai",
           "--base-url", f"http://127.0.0.1:{port}", "--endpoint", "/v1/completions", "--model", MODEL_NAME,
           "--tokenizer", folder, "--dataset-name", "random", "--random-input-len", str(input_len),
           "--random-output-len", str(output_len),
           "--random-range-ratio", json.dumps({"input": range_ratio, "output": output_range_ratio}),
           "--num-prompts", str(num_prompts), "--max-concurrency", str(concurrency), "--ignore-eos",
           "--seed", str(seed), "--percentile-metrics", "ttft,tpot,itl", "--metric-percentiles", "50,99",
           "--save-result", "--result-dir", result_dir, "--result-filename", name]
    env = dict(os.environ, VLLM_TARGET_DEVICE="cpu")
    p = subprocess.run(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    if p.returncode != 0:
        raise RuntimeError(f"vllm bench serve failed ({p.returncode}):\n{p.stdout[-3000:]}")
    with open(os.path.join(result_dir, name)) as f:
        return json.load(f)


def _percentile(xs: list, q: float) -> float:
    if not xs:
        return 0.0
    xs = sorted(xs)
    k = (len(xs) - 1) * q / 100
    lo = int(k)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


def _one_request(port: int, prompt: list, output_len: int) -> dict:
    """A streamed /v1/completions request as vLLM's client sends it (but with token ids for the prompt): the
    arrival time of each chunk with a choice, and the completion tokens the usage chunk counts."""
    body = json.dumps({"model": MODEL_NAME, "prompt": prompt, "repetition_penalty": 1.0, "max_tokens": output_len,
                       "logprobs": None, "stream": True, "stream_options": {"include_usage": True},
                       "ignore_eos": True})  # its payload; no temperature: the server's default (1)
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
    t0 = time.perf_counter()
    times, tokens, error = [], 0, None
    try:
        conn.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
        resp = conn.getresponse()
        if resp.status != 200:
            return {"ok": False, "error": f"{resp.status}: {resp.read()[:300]!r}"}
        for raw in resp:
            line = raw.decode("utf-8").strip()
            if not line.startswith("data:"):
                continue
            data = line[5:].strip()
            if data == "[DONE]":
                break
            chunk = json.loads(data)
            if chunk.get("choices"):  # as vLLM's client times them: every chunk with a choice, text or not
                times.append(time.perf_counter())
            elif chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
    except (OSError, ValueError, KeyError) as e:
        error = repr(e)
    finally:
        conn.close()
    if error or not times:
        return {"ok": False, "error": error or "no choice in the stream"}
    return {"ok": True, "ttft": times[0] - t0, "itl": [b - a for a, b in zip(times, times[1:])],
            "tokens": tokens or len(times)}


def builtin_client(port: int, vocab_size: int, concurrency: int, num_prompts: int, input_len: int,
                   output_len: int, range_ratio: float, output_range_ratio: float, seed: int) -> dict:
    """The same load as `vllm bench serve --dataset-name random` (prompts of random token ids, their lengths
    uniform in input_len * [1 - r, 1 + r], output lengths likewise), `concurrency` at a time; its keys."""
    import random

    rng = random.Random(seed)
    lo, hi = max(1, int(input_len * (1 - range_ratio))), int(input_len * (1 + range_ratio))
    olo, ohi = max(1, int(output_len * (1 - output_range_ratio))), int(output_len * (1 + output_range_ratio))
    loads = [([rng.randrange(vocab_size - 1) for _ in range(rng.randint(lo, hi))], rng.randint(olo, ohi))
             for _ in range(num_prompts)]
    t0 = time.perf_counter()
    with ThreadPoolExecutor(max_workers=concurrency) as pool:
        outs = list(pool.map(lambda load: _one_request(port, *load), loads))
    duration = time.perf_counter() - t0
    ok = [o for o in outs if o["ok"]]
    ttft = [o["ttft"] * 1e3 for o in ok]
    itl = [x * 1e3 for o in ok for x in o["itl"]]
    tokens = sum(o["tokens"] for o in ok)
    return {"completed": len(ok), "failed": len(outs) - len(ok), "duration": duration,
            "total_input_tokens": sum(len(p) for (p, _), o in zip(loads, outs) if o["ok"]),
            "total_output_tokens": tokens, "output_throughput": tokens / duration,
            "median_ttft_ms": statistics.median(ttft) if ttft else 0.0, "p99_ttft_ms": _percentile(ttft, 99),
            "median_itl_ms": statistics.median(itl) if itl else 0.0, "p99_itl_ms": _percentile(itl, 99),
            "errors": sorted({o["error"] for o in outs if not o["ok"]})[:3]}


def generate_baseline(folder: str, num_prompts: int, input_len: int, range_ratio: float, output_len: int,
                      seed: int, quantize=None, kv_dtype=None) -> dict:
    """`Decoder.generate` at batch 1 in this process (before any server starts, and again after jaxgpt-serve's
    run at 1 request) on requests like the load's: random prompts in the same length range, `output_len`
    tokens each, drawn over the whole vocabulary at temperature 1 (what the servers' requests ask for), the
    folder's weights. Each request runs once to
    compile its shape, then timed: output tokens over the seconds of the timed calls, prefill included (as
    a server's figure at 1 request includes its time to first token). `quantize` and `kv_dtype` mirror the
    server's flags, so both sides run the same kernels and cache."""
    import random

    import jax
    import numpy as np

    import jaxgpt
    from jaxgpt.loading import load

    loaded = load(folder, tokenizer=None)
    decoder = jaxgpt.Decoder(loaded.params, loaded.config, quantize=quantize, kv_dtype=kv_dtype)
    rng = random.Random(seed)
    lo, hi = max(1, int(input_len * (1 - range_ratio))), int(input_len * (1 + range_ratio))
    prompts = [[rng.randrange(loaded.config.vocab_size - 1) for _ in range(rng.randint(lo, hi))]
               for _ in range(num_prompts)]
    seconds = 0.0
    for i, prompt in enumerate(prompts):
        for timed in (False, True):
            t0 = time.perf_counter()
            out = decoder.generate(np.array([prompt], np.int32), output_len, jax.random.key(i), temperature=1.0)
            out.tokens.block_until_ready()
            seconds += (time.perf_counter() - t0) if timed else 0.0
    return {"requests": num_prompts, "quantize": quantize, "kv_dtype": kv_dtype, "seconds": seconds,
            "output_throughput": num_prompts * output_len / seconds}


def jaxgpt_flag(extra: list, name: str):
    """The value of jaxgpt-serve's flag `name` ("quantize", "kv_dtype") as its own parser reads `extra`
    (None for "none", its default)."""
    from jaxgpt.cli.serve import build_parser

    value = getattr(build_parser().parse_args(extra), name)
    return None if value == "none" else value


# -- the run ---------------------------------------------------------------------------------------------

def table(rows: list) -> str:
    lines = ["| server | concurrency | prompts | output tok/s | TTFT p50 / p99 (ms) | ITL p50 / p99 (ms) |",
             "| --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        lines.append(f"| {r['server']} | {r['concurrency']} | {r['completed']}/{r['num_prompts']} | "
                     f"{r['output_throughput']:.1f} | {r['median_ttft_ms']:.0f} / {r['p99_ttft_ms']:.0f} | "
                     f"{r['median_itl_ms']:.1f} / {r['p99_itl_ms']:.1f} |")
    return "\n".join(lines)


def by_config(rows: list, configs: list) -> list:
    """Each jaxgpt-serve configuration's figures over its rounds: output tokens/s per concurrency (each
    round's, and their mean), and at 1 request its ratios to generate."""
    out = []
    for k, extra in enumerate(configs, start=1):
        mine = [r for r in rows if r.get("config") == k and r.get("output_throughput")]
        tput = {c: [r["output_throughput"] for r in mine if r["concurrency"] == c]
                for c in dict.fromkeys(r["concurrency"] for r in mine)}
        around = [r["serve_1_over_generate_around"] for r in mine if "serve_1_over_generate_around" in r]
        out.append({"config": k, "jaxgpt_args": extra, "output_throughput": tput,
                    "mean_output_throughput": {c: statistics.fmean(v) for c, v in tput.items()},
                    "serve_1_over_generate_around": around})
    return out


def summary_table(summaries: list) -> str:
    lines = ["| configuration | concurrency | output tok/s, each round | mean | at 1: x generate (mean around) |",
             "| --- | --- | --- | --- | --- |"]
    for s in summaries:
        for c, each in s["output_throughput"].items():
            ratio = ", ".join(f"{x:.2f}" for x in s["serve_1_over_generate_around"]) if c == 1 else ""
            lines.append(f"| #{s['config']} {' '.join(s['jaxgpt_args'])} | {c} | "
                         f"{', '.join(f'{x:.1f}' for x in each)} | {s['mean_output_throughput'][c]:.1f} | {ratio} |")
    return "\n".join(lines)


def with_default_slots(given: list, defaults: list) -> list:
    """`--jaxgpt-args`' flags after the bench's defaults, less a default --slots when they give their own
    (replacing the defaults outright once measured an 8-slot server at 32 requests in flight)."""
    own_slots = any(a == "--slots" or a.startswith("--slots=") for a in given)
    return [a for a in defaults if not (own_slots and a.startswith("--slots="))] + given


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--vllm", default=None, help="vLLM's CPU build's virtual environment "
                    "(../shared/peers/install_vllm_cpu.sh DIR); default: skip vLLM, built-in client")
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--num-prompts", type=int, nargs="+", default=[32, 256, 256],
                    help="requests per concurrency (one number for all, or one each)")
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--range-ratio", type=float, default=0.5, help="prompt lengths input_len * [1 - r, 1 + r]")
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--output-range-ratio", type=float, default=0.0,
                    help="output lengths output_len * [1 - r, 1 + r] (default 0: all output_len)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--vllm-bindings", nargs="*", default=["default", "both"], choices=sorted(VLLM_BINDINGS),
                    help="vLLM's servers to measure (none given: jaxgpt-serve only, still with vLLM's client)")
    ap.add_argument("--vllm-kv-cache-gib", type=int, default=4)
    ap.add_argument("--vllm-dtype", default="float32", choices=["float32", "bfloat16"],
                    help="vLLM's --dtype (default float32, as jaxgpt-serve's weights; bfloat16: its fastest on an "
                         "AVX512_BF16 CPU)")
    ap.add_argument("--jaxgpt-args", action="append", default=None,
                    help="extra jaxgpt-serve flags, after the default --slots=<largest concurrency> (which a --slots "
                         "of their own replaces); given more than once, one server per value, measured in turn")
    ap.add_argument("--rounds", type=int, default=1,
                    help="measure the jaxgpt-serve configurations this many times, in turn (A B A B with two "
                         "--jaxgpt-args): alternating, so that the machine's drifts fall on each alike")
    ap.add_argument("--no-jaxgpt", action="store_true", help="measure vLLM only")
    ap.add_argument("--no-warmup", action="store_true")
    ap.add_argument("--generate-prompts", type=int, default=8,
                    help="requests for the Decoder.generate batch-1 baseline, timed in this process before the "
                         "servers when 1 is among --concurrency (0: skip; --smoke: 2)")
    ap.add_argument("--model-dir", default=None, help="the HF folder to make and serve (default: a temp dir)")
    ap.add_argument("--smoke", action="store_true",
                    help="a tiny model, a few short requests at 1 and 2 concurrent, jaxgpt-serve only")
    ap.add_argument("--out", default=None, help="results name (default serve; --smoke: not written)")
    args = ap.parse_args(argv)

    if args.smoke:
        args.vllm, args.concurrency, args.num_prompts = None, [1, 2], [3, 4]
        args.input_len, args.output_len = 8, 8
        jaxgpt_extra = ["--slots=2", "--max_len=64", "--prefill_chunk=16"]
    else:
        jaxgpt_extra = [f"--slots={max(args.concurrency)}"]
    configs = [with_default_slots(a.split(), jaxgpt_extra) for a in args.jaxgpt_args or [""]]
    jaxgpt_extra = configs[0]
    if args.rounds < 1:
        ap.error(f"--rounds must be >= 1, got {args.rounds}")
    if len(args.num_prompts) == 1:
        args.num_prompts = args.num_prompts * len(args.concurrency)
    if len(args.num_prompts) != len(args.concurrency):
        ap.error("--num-prompts takes one number or one per --concurrency")
    if args.vllm is not None and not os.path.isfile(os.path.join(args.vllm, "bin", "vllm")):
        ap.error(f"--vllm {args.vllm}: no bin/vllm there (install with ../shared/peers/install_vllm_cpu.sh DIR)")
    client = "vllm bench serve" if args.vllm else "built-in"
    cfg = gpt2_config(args.smoke)

    work = tempfile.mkdtemp(prefix="jaxgpt-bench-serve-")
    folder = make_model_folder(args.model_dir or os.path.join(work, "model"), args.smoke, args.seed)
    print(f"model folder: {folder} ({'tiny' if args.smoke else 'GPT-2 124M shape'}, float32, random); "
          f"client: {client}; logs in {work}", flush=True)

    def load(server: Server, tag: str, mirror=None) -> list:
        """The load at each concurrency; for a jaxgpt-serve, `mirror` is its (quantize, kv_dtype): generate
        runs again with them right after its run at 1 request."""
        if args.vllm:
            def run(c, n, seed, out_len=args.output_len, rec=tag):
                return vllm_client(args.vllm, server.port, folder, c, n, args.input_len, out_len,
                                   args.range_ratio, args.output_range_ratio, seed, work, rec)
        else:
            def run(c, n, seed, out_len=args.output_len, rec=tag):
                return builtin_client(server.port, cfg.vocab_size, c, n, args.input_len, out_len,
                                      args.range_ratio, args.output_range_ratio, seed)
        if not args.no_warmup:  # every batch size's programs and the allocator's pools, unrecorded
            c = max(args.concurrency)
            run(c, c, args.seed + 1000, min(16, args.output_len), f"{tag}-warmup")
        rows = []
        # each concurrency its own prompts (vLLM's prefix cache never sees a prompt twice), every server the
        # same ones
        for i, (c, n) in enumerate(zip(args.concurrency, args.num_prompts)):
            own = server.name.startswith("jaxgpt-serve")
            before = engine_counters(server.port) if own else None
            res = run(c, n, args.seed + i)
            row = {"server": server.name, "concurrency": c, "num_prompts": n,
                   "seed": args.seed + i, **{k: res.get(k) for k in KEYS}, "server_start_s": server.start_s,
                   "server_compiled_s": server.compiled_s}
            if res.get("errors"):
                row["errors"] = res["errors"]
            if own:  # how the load reached the engine (compare bench/engine.py's line for the same load)
                row["engine"] = engine_summary(before, engine_counters(server.port), n, res.get("duration") or 0.0)
            rows.append(row)
            if own and c == 1 and mirror in baselines:  # generate again right after, the server idle
                after = generate_baseline(folder, baselines[mirror]["requests"], args.input_len, args.range_ratio,
                                          args.output_len, args.seed, *mirror)
                row["generate_after"] = after
                print(f"Decoder.generate at batch 1 again, right after: {after['output_throughput']:.1f} tok/s",
                      flush=True)
            print(table([row]).splitlines()[-1], flush=True)
            if own:
                print("  " + format_engine_summary(row["engine"]), flush=True)
        return rows

    rows, errors, vllm_version, baselines = [], {}, None, {}
    mirrors = [(jaxgpt_flag(extra, "quantize"), jaxgpt_flag(extra, "kv_dtype")) for extra in configs]
    if 1 in args.concurrency and args.generate_prompts > 0 and not args.no_jaxgpt:
        for mirror in dict.fromkeys(mirrors):  # one baseline per kind of kernels and cache the servers run
            baselines[mirror] = base = generate_baseline(folder, 2 if args.smoke else args.generate_prompts,
                                                         args.input_len, args.range_ratio, args.output_len,
                                                         args.seed, *mirror)
            print(f"Decoder.generate at batch 1 (quantize={base['quantize']}, kv_dtype={base['kv_dtype']}, "
                  f"{base['requests']} requests, prefill included): {base['output_throughput']:.1f} tok/s",
                  flush=True)
    baseline = baselines.get(mirrors[0])

    def side(name: str, make_server, tag: str, mirror=None, **labels) -> None:
        """One server: started, loaded at each concurrency, stopped; a failure is recorded, the run goes on.
        `labels` go into each of its rows."""
        try:
            with make_server() as server:
                print(f"{server.name} ready in {server.start_s:.1f} s" + (
                    f", every program compiled in {server.compiled_s:.1f} s" if server.wait_compiled else ""),
                    flush=True)
                rows.extend({**row, **labels} for row in load(server, tag, mirror))
        except RuntimeError as e:
            print(f"{name}: FAILED: {e}", flush=True)
            errors[name + (f" (round {labels['round']})" if args.rounds > 1 and "round" in labels else "")] = \
                str(e)[-2000:]

    for r in range(args.rounds if not args.no_jaxgpt else 0):
        for k, extra in enumerate(configs):
            name = "jaxgpt-serve" if len(configs) == 1 else f"jaxgpt-serve #{k + 1}"
            tag = "jaxgpt" + (f"-{k + 1}" if len(configs) > 1 else "") + (f"-r{r + 1}" if args.rounds > 1 else "")
            print(f"{name} {' '.join(extra)}" + (f" (round {r + 1} of {args.rounds})" if args.rounds > 1 else ""),
                  flush=True)
            side(name, lambda extra=extra, name=name, tag=tag: jaxgpt_server(
                folder, free_port(), extra, os.path.join(work, f"{tag}-serve.log"), name=name), tag,
                 config=k + 1, round=r + 1, jaxgpt_args=extra, mirror=mirrors[k])
    if args.vllm:
        vllm_version = subprocess.run([os.path.join(args.vllm, "bin", "python"), "-c",
                                       "import importlib.metadata as m; print(m.version('vllm'))"],
                                      stdout=subprocess.PIPE, text=True).stdout.strip()
        for binding in args.vllm_bindings:
            side(f"vllm ({binding}, {args.vllm_dtype})", lambda b=binding: vllm_server(
                args.vllm, folder, free_port(), b, cfg.block_size, args.vllm_kv_cache_gib,
                os.path.join(work, f"vllm-{b}.log"), dtype=args.vllm_dtype), f"vllm-{binding}-{args.vllm_dtype}")
    else:
        print("vLLM: skipped (no --vllm DIR)", flush=True)

    for row in rows:  # a jaxgpt-serve at 1 request against generate with its kernels and cache
        base = baselines.get(mirrors[row["config"] - 1]) if "config" in row else None
        if row["concurrency"] == 1 and base and row.get("output_throughput"):
            row["serve_1_over_generate"] = row["output_throughput"] / base["output_throughput"]
            if row.get("generate_after"):  # against the mean of the two, one on each side of its run in time
                mean = (base["output_throughput"] + row["generate_after"]["output_throughput"]) / 2
                row["serve_1_over_generate_around"] = row["output_throughput"] / mean
    lone = [r for r in rows if r.get("config") == 1 and r["round"] == 1 and r["concurrency"] == 1]
    after = lone[0].get("generate_after") if lone else None
    results = {"smoke": args.smoke, "config": "tiny" if args.smoke else "gpt2-124m", "dtype": "float32",
               "client": client, "cpus": os.cpu_count(), "input_len": args.input_len,
               "range_ratio": args.range_ratio, "output_len": args.output_len,
               "output_range_ratio": args.output_range_ratio, "seed": args.seed,
               "jaxgpt_args": jaxgpt_extra, "jaxgpt_configs": configs, "rounds": args.rounds,
               "vllm": vllm_version, "vllm_bindings":
               {b: VLLM_BINDINGS[b] for b in args.vllm_bindings} if args.vllm else None, "runs": rows,
               "errors": errors, "logs": work, "generate_batch_1": baseline, "generate_batch_1_after": after,
               "generate_batch_1_by_config": [baselines.get(m) for m in mirrors]}
    for key in ("serve_1_over_generate", "serve_1_over_generate_around"):  # the first configuration's first run
        if lone and key in lone[0]:
            results[key] = lone[0][key]
    if not args.model_dir:
        shutil.rmtree(folder, ignore_errors=True)  # the weights (0.5 GB); the logs stay
    print(table(rows))
    if "serve_1_over_generate" in results:
        print(f"jaxgpt-serve at 1 request: x{results['serve_1_over_generate']:.2f} of Decoder.generate at batch 1 "
              f"({baseline['output_throughput']:.1f} tok/s)")
    if "serve_1_over_generate_around" in results:
        print(f"  x{results['serve_1_over_generate_around']:.2f} of the mean of generate before the servers and "
              f"right after its run at 1 request ({after['output_throughput']:.1f} tok/s)")
    if len(configs) > 1 or args.rounds > 1:
        results["by_config"] = by_config(rows, configs)
        print(summary_table(results["by_config"]))
    if args.out or not args.smoke:
        print("wrote", write_results(args.out or "serve", results))
    return results


if __name__ == "__main__":
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # a stopped run stops its server too
    main()
