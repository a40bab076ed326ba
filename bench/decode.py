"""Decode benchmark: jaxgpt.Decoder.generate (what generate runs) on the GPT-2 124M shape with random weights.

python bench/decode.py [--batch 1 8] [--dtypes float32 bfloat16] [--kernels auto portable] [--reps 3]
                       [--quantize none int8 w8a8] [--llama VENV] [--no-peer]
                       [--speculative TARGET_RUN DRAFT_RUN] [--engine-speculative RUN] [--k 4] [--out NAME]

16-token prompt, 128 new tokens, top-k 50 sampling. Every configuration is compiled first, then the
repetitions are timed interleaved (one of each in turn). Reports tokens/s (median of reps, compile excluded),
compile time (first call minus a warm call), and the achieved bytes/s of weights plus KV cache read per
decode step over the machine's measured read bandwidth (with --quantize int8 or w8a8 the kernels count one
byte per weight plus their scales).

Peers, same run: transformers' generate (skipped with --no-peer or without torch), and with `--llama VENV`
(made by ../shared/peers/install_llama_cpp.sh; skipped when absent) llama.cpp through llama-cpp-python at
batch 1, 2 threads, on GGUF files converted by llama.cpp's own converter from the same random weights
(exported with jaxgpt.save_pretrained) in f32 and q8_0.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import numpy as np  # noqa: E402

import jaxgpt  # noqa: E402
from bench.common import ceilings, machine, median_time, write_results  # noqa: E402


def gpt2_config(dtype: str, kernels: str = "auto") -> jaxgpt.GPTConfig:
    return jaxgpt.GPTConfig(vocab_size=50257, block_size=1024, n_layer=12, n_head=12, n_embd=768,
                            dtype=dtype, param_dtype=dtype, kernels=kernels)


def prepare(batch: int, dtype: str, prompt_len: int, new_tokens: int, kernels: str = "auto", quantize: str = "none",
            kv_dtype: str = "none") -> dict:
    """One configuration made ready to time: its Decoder built, weights prepared and the program compiled.
    {"call": the timed call, "first": the first call's seconds, "prepare_s", and what `finish` needs}."""
    cfg = gpt2_config(dtype, kernels)
    params = jaxgpt.init_params(cfg, jax.random.key(0))
    prompts = np.random.default_rng(0).integers(0, cfg.vocab_size, (batch, prompt_len))

    # one Decoder for every call, as a program that decodes repeatedly holds one: the backend's prepared
    # decode weights (the CPU backend's packed kernels) are made once, timed apart as prepare_s
    q = None if quantize == "none" else quantize
    kv = None if kv_dtype == "none" else kv_dtype
    decoder = jaxgpt.Decoder(params, cfg, quantize=q, kv_dtype=kv)
    t0 = time.perf_counter()
    jax.block_until_ready(decoder.weights(batch))
    prepare_s = time.perf_counter() - t0

    def call():
        out = decoder.generate(prompts, new_tokens, jax.random.key(1), temperature=1.0, top_k=50)
        out.tokens.block_until_ready()

    t0 = time.perf_counter()
    call()
    first = time.perf_counter() - t0
    n_params = jaxgpt.count_params(params)
    itemsize = np.dtype(cfg.dtype).itemsize
    # per decode step: every weight once (wpe: one row, ignored) plus the whole allocated cache
    cache = jaxgpt.cache_bytes(cfg, batch, prompt_len + new_tokens, kv)
    bytes_per_step = (n_params - cfg.block_size * cfg.n_embd) * itemsize + cache
    if q in ("int8", "w8a8"):  # the int8 kernels (and their scales) are read instead of their float values
        from jaxgpt.quantize import int8_bytes
        nb = int8_bytes(params, cfg)
        bytes_per_step += nb["int8"] - nb["float"]
    meta = {"batch": batch, "dtype": dtype, "kernels": kernels, "quantize": quantize, "kv_dtype": kv_dtype}
    return {"meta": meta, "call": call, "first": first, "prepare_s": prepare_s, "cache": cache,
            "bytes_per_step": bytes_per_step, "new_tokens": new_tokens}


def time_cases(cases: list, reps: int) -> list:
    """Each case's call timed `reps` times, the cases interleaved (rep 1 of each, then rep 2, ...): on a
    noisy machine their ratios then compare like with like. Returns each case's times."""
    times = [[] for _ in cases]
    for _ in range(reps):
        for case, ts in zip(cases, times):
            t0 = time.perf_counter()
            case["call"]()
            ts.append(time.perf_counter() - t0)
    return times


def finish(case: dict, times: list, bandwidth: float) -> dict:
    """A case's row of results from its times."""
    t = float(np.median(times))
    batch, new_tokens, bytes_per_step = case["meta"]["batch"], case["new_tokens"], case["bytes_per_step"]
    steps_per_s = new_tokens / t
    return {**case["meta"], "tokens_per_s": batch * new_tokens / t, "seconds": t, "all_seconds": times,
            "compile_s": case["first"] - t, "prepare_s": case["prepare_s"], "kv_cache_bytes": case["cache"],
            "bytes_per_step": bytes_per_step, "achieved_read_bytes_per_s": bytes_per_step * steps_per_s,
            "fraction_of_read_bandwidth": bytes_per_step * steps_per_s / bandwidth}


def run(batch: int, dtype: str, prompt_len: int, new_tokens: int, reps: int, bandwidth: float,
        kernels: str = "auto", quantize: str = "none", kv_dtype: str = "none") -> dict:
    """One configuration prepared and timed on its own."""
    case = prepare(batch, dtype, prompt_len, new_tokens, kernels, quantize, kv_dtype)
    return finish(case, time_cases([case], reps)[0], bandwidth)


def run_peer(batch: int, prompt_len: int, new_tokens: int, reps: int) -> dict:
    """transformers' GPT2LMHeadModel.generate (PyTorch CPU, KV cache, top-k 50), same shapes."""
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config()).eval()
    prompts = torch.from_numpy(np.random.default_rng(0).integers(0, 50257, (batch, prompt_len)))

    def call():
        with torch.no_grad():
            model.generate(prompts, attention_mask=torch.ones_like(prompts), do_sample=True, top_k=50,
                           max_new_tokens=new_tokens, min_new_tokens=new_tokens, pad_token_id=0)

    call()
    t, times = median_time(call, reps)
    return {"batch": batch, "tokens_per_s": batch * new_tokens / t, "seconds": t, "torch": torch.__version__}


_LLAMA_SCRIPT = r"""
import json, statistics, sys, time
import numpy as np
from llama_cpp import Llama
path, prompt_len, new_tokens, reps = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
llm = Llama(model_path=path, n_ctx=prompt_len + new_tokens + 8, n_threads=2, n_threads_batch=2, n_batch=64,
            seed=1, verbose=False)
prompt = [int(t) for t in np.random.default_rng(0).integers(0, llm.n_vocab(), prompt_len)]
def call():
    n = 0
    for _ in llm.generate(prompt, top_k=50, top_p=1.0, min_p=0.0, temp=1.0, repeat_penalty=1.0, reset=True):
        n += 1
        if n == new_tokens:
            break
call()
times = []
for _ in range(reps):
    t0 = time.perf_counter()
    call()
    times.append(time.perf_counter() - t0)
print(json.dumps({"seconds": statistics.median(times), "all_seconds": times}))
"""


def run_llama(venv: str, prompt_len: int, new_tokens: int, reps: int, work: str) -> list:
    """llama.cpp at batch 1 on f32 and q8_0 GGUFs of the benchmark's random weights (bench/serve.py's
    Hugging Face folder, converted by the venv's convert.sh); [] when the venv is absent."""
    import subprocess

    from bench.serve import make_model_folder

    python, convert = os.path.join(venv, "bin", "python"), os.path.join(venv, "src", "convert.sh")
    if not (os.path.exists(python) and os.path.exists(convert)):
        print(f"llama.cpp: no venv at {venv} (../shared/peers/install_llama_cpp.sh makes one); skipped")
        return []
    folder = make_model_folder(os.path.join(work, "hf"), smoke=False)
    rows = []
    for kind in ("f32", "q8_0"):
        gguf = os.path.join(work, f"model-{kind}.gguf")
        if not os.path.exists(gguf):
            subprocess.run([convert, folder, gguf, kind], check=True, capture_output=True,
                           env={**os.environ, "PYTHON": sys.executable})
        out = subprocess.run([python, "-c", _LLAMA_SCRIPT, gguf, str(prompt_len), str(new_tokens), str(reps)],
                             check=True, capture_output=True, text=True)
        r = json.loads(out.stdout.strip().splitlines()[-1])
        rows.append({"peer": f"llama.cpp {kind}", "batch": 1, "tokens_per_s": new_tokens / r["seconds"], **r})
    return rows


def run_speculative(target_dir: str, draft_dir: str, k: int, new_tokens: int, reps: int) -> list:
    """Greedy batch-1 decoding of a trained target: plain, speculative with the trained draft model, and
    speculative with n-gram lookup on a prompt that repeats a passage (its continuation can be copied)."""
    from jaxgpt.loading import load_model

    cfg, params, tok, _ = load_model(target_dir)
    d_cfg, d_params, d_tok, _ = load_model(draft_dir)
    if tok.to_dict() != d_tok.to_dict():
        raise SystemExit("--speculative: the two runs use different tokenizers")
    text = ("ROMEO:\nBut soft, what light through yonder window breaks?\nIt is the east, and Juliet is the sun.\n"
            "Arise, fair sun, and kill the envious moon,\n")
    prompts = {"shakespeare": tok.encode("ROMEO:\n"), "repetitive": tok.encode(text + text[:40])}
    plain = jaxgpt.Decoder(params, cfg)
    drafts = {"draft model": jaxgpt.Speculative(k=k, draft=(d_params, d_cfg)),
              "n-gram": jaxgpt.Speculative(k=k, draft="ngram", ngram=3)}
    rows = []
    for pname, ids in prompts.items():
        ids = np.array([ids[-(cfg.block_size - new_tokens - k):]], np.int32)
        decoders = {"plain": plain, **{name: jaxgpt.Decoder(params, cfg, speculative=s) for name, s in drafts.items()}}
        calls = {name: (lambda dec=dec: dec.generate(ids, new_tokens, jax.random.key(0),
                                                     temperature=0.0).tokens.block_until_ready())
                 for name, dec in decoders.items()}
        firsts = {name: np.asarray(call()) for name, call in calls.items()}  # (compiles)
        stats = {name: dec.last_speculative_stats for name, dec in decoders.items() if name != "plain"}
        times = {name: [] for name in calls}
        for _ in range(reps):  # interleaved: the machine's drift falls on all three alike
            for name, call in calls.items():
                t0 = time.perf_counter()
                call()
                times[name].append(time.perf_counter() - t0)
        base = float(np.median(times["plain"]))
        for name in calls:
            t = float(np.median(times[name]))
            row = {"name": f"{name} on the {pname} prompt", "tokens_per_s": new_tokens / t, "seconds": t,
                   "all_seconds": times[name], "k": k, "same_as_plain": None, "speedup": base / t}
            if name != "plain":
                st = stats[name]
                row.update(acceptance=st["acceptance"], rounds=st["rounds"], tokens_per_round=new_tokens / st["rounds"],
                           same_as_plain=bool((firsts[name] == firsts["plain"]).all()))
            rows.append(row)
    return rows


def run_engine_speculative(target_dir: str, k: int, new_tokens: int, reps: int) -> list:
    """A lone greedy request on jaxgpt.Engine (one slot), plain against n-gram speculative decoding, on the
    same two prompts as run_speculative; programs compiled by warmup() first, then one untimed run."""
    from jaxgpt.engine import Engine
    from jaxgpt.loading import load_model

    cfg, params, tok, _ = load_model(target_dir)
    text = ("ROMEO:\nBut soft, what light through yonder window breaks?\nIt is the east, and Juliet is the sun.\n"
            "Arise, fair sun, and kill the envious moon,\n")
    prompts = {"shakespeare": tok.encode("ROMEO:\n"), "repetitive": tok.encode(text + text[:40])}
    engines = {"engine plain": Engine(params, cfg, slots=1, prefill_chunk=128),
               "engine n-gram": Engine(params, cfg, slots=1, prefill_chunk=128,
                                       speculative=jaxgpt.Speculative(k=k, draft="ngram", ngram=3))}
    for eng in engines.values():
        eng.warmup(prompt_logprobs=False)
    rows = []
    for pname, ids in prompts.items():
        ids = ids[-(cfg.block_size - new_tokens - k):]
        base = base_tokens = None
        for name, eng in engines.items():
            def call(eng=eng):
                return eng.run([dict(prompt=ids, max_tokens=new_tokens, temperature=0.0)])[0].token_ids
            first = call()
            before = dict(eng.stats)
            t, times = median_time(call, reps)
            steps = (eng.stats["decode_steps"] - before.get("decode_steps", 0)) / reps
            row = {"name": f"{name} on the {pname} prompt", "tokens_per_s": new_tokens / t, "seconds": t,
                   "all_seconds": times, "k": k, "decode_steps": steps, "same_as_plain": None}
            if base is None:
                base, base_tokens = t, first
            else:
                proposed = eng.stats["proposed"] - before.get("proposed", 0)
                row.update(acceptance=(eng.stats["accepted"] - before.get("accepted", 0)) / max(1, proposed),
                           tokens_per_round=new_tokens / steps, same_as_plain=first == base_tokens)
            row["speedup"] = base / t
            rows.append(row)
    return rows


def main():
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    p.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    p.add_argument("--kernels", nargs="+", default=["auto"], choices=["auto", "portable", "cpu"])
    p.add_argument("--prompt_len", type=int, default=16)
    p.add_argument("--new_tokens", type=int, default=128)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--quantize", nargs="+", default=["none"], choices=["none", "int8", "w8a8"],
                   help="decode weights: as stored (none) and/or int8 with a scale per output channel")
    p.add_argument("--kv-dtype", dest="kv_dtype", nargs="+", default=["none"], choices=["none", "int8", "bfloat16"],
                   help="the KV cache's dtype (none: the compute dtype)")
    p.add_argument("--speculative", nargs=2, default=None, metavar=("TARGET_RUN", "DRAFT_RUN"),
                   help="two trained runs (train.py out_dirs, same tokenizer): greedy decoding at batch 1, plain "
                        "against speculative with the draft model and with n-gram lookup (on a repetitive prompt)")
    p.add_argument("--engine-speculative", dest="engine_speculative", default=None, metavar="RUN",
                   help="a trained run (train.py out_dir): a lone greedy request on the engine, plain against "
                        "n-gram speculative decoding")
    p.add_argument("--k", type=int, default=4, help="tokens proposed per round with --speculative")
    p.add_argument("--no-peer", action="store_true", help="skip the transformers peer")
    p.add_argument("--llama", default=None, metavar="VENV",
                   help="llama.cpp's venv (../shared/peers/install_llama_cpp.sh VENV): its f32 and q8_0 at batch 1")
    p.add_argument("--out", default="decode", help="results file name under bench/results (without .json)")
    p.add_argument("--work", default=os.path.join("bench", "results", "decode-work"),
                   help="where the Hugging Face folder and the GGUF files for llama.cpp are written (reused)")
    args = p.parse_args()
    ceil = ceilings()
    # every configuration compiled first, then timed with the repetitions interleaved
    cases = [prepare(b, d, args.prompt_len, args.new_tokens, k, q, kv) for k in args.kernels for d in args.dtypes
             for q in args.quantize for kv in args.kv_dtype for b in args.batch]
    rows = [finish(c, ts, ceil["read_bytes_per_s"]) for c, ts in zip(cases, time_cases(cases, args.reps))]
    spec = run_speculative(*args.speculative, args.k, args.new_tokens, args.reps) if args.speculative else []
    if args.engine_speculative:
        spec += run_engine_speculative(args.engine_speculative, args.k, args.new_tokens, args.reps)
    peers = {} if args.no_peer else {b: run_peer(b, args.prompt_len, args.new_tokens, args.reps) for b in args.batch}
    llama = run_llama(args.llama, args.prompt_len, args.new_tokens, args.reps, args.work) if args.llama else []
    for r in rows:
        if r["batch"] in peers:
            r["peer_tokens_per_s"] = peers[r["batch"]]["tokens_per_s"]
            r["speedup_vs_peer"] = r["tokens_per_s"] / r["peer_tokens_per_s"]
    path = write_results(args.out, {"machine": machine(), "ceilings": ceil, "settings": vars(args), "runs": rows,
                                    "peer": list(peers.values()), "llama_cpp": llama,
                                    "speculative": spec})
    print(f"read bandwidth {ceil['read_bytes_per_s'] / 1e9:.1f} GB/s, fp32 matmul "
          f"{ceil['matmul_fp32_flops'] / 1e9:.0f} GFLOP/s, bf16 {ceil['matmul_bf16_flops'] / 1e9:.0f} GFLOP/s")
    print(f"{'kernels':>8} {'dtype':>9} {'quantize':>8} {'kv':>8} {'batch':>5} {'tok/s':>8} {'compile s':>9} "
          f"{'prepare s':>9} {'cache MB':>8} {'% read bw':>9} {'peer tok/s':>10}")
    for r in rows:
        peer = f"{r['peer_tokens_per_s']:10.1f} ({r['speedup_vs_peer']:.2f}x)" if "peer_tokens_per_s" in r else ""
        print(f"{r['kernels']:>8} {r['dtype']:>9} {r['quantize']:>8} {r['kv_dtype']:>8} {r['batch']:>5} {r['tokens_per_s']:8.1f} "
              f"{r['compile_s']:9.2f} {r['prepare_s']:9.2f} {r['kv_cache_bytes'] / 2**20:8.1f} "
              f"{100 * r['fraction_of_read_bandwidth']:8.1f}% {peer}")
    for r in llama:
        print(f"{r['peer']:>18} batch 1 {r['tokens_per_s']:8.1f} tok/s")
    for r in spec:
        extra = f", acceptance {r['acceptance']:.2f}, {r['tokens_per_round']:.2f} tokens/round" if "acceptance" in r else ""
        print(f"{r['name']:>34}: {r['tokens_per_s']:7.1f} tok/s ({r['speedup']:.2f}x plain on its prompt){extra}")
    print(f"results: {path}")


if __name__ == "__main__":
    main()
