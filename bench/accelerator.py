"""Accelerator benchmark: GPT-2 124M bf16 training MFU and decode bandwidth on whatever device JAX finds.

python bench/accelerator.py [--steps 10] [--batch 16] [--decode-batch 1 8 64] [--out PATH]
python bench/accelerator.py --smoke      # a tiny model on the CPU in seconds (a test runs this)
python bench/accelerator.py --profile DIR  # also a jax.profiler trace of two training steps in DIR

Training: the real train step (AdamW, clipping, bf16 compute with float32 master weights) of GPT-2 124M at
context 1024 with the portable kernels, jitted on one device with the state donated; tokens/s (median of
--steps after warm-up) and MFU = (6N + 12*L*T*D) * tokens/s / the device's dense bf16 peak. Decode:
`generate` with bf16 weights, a 16-token prompt and 128 new tokens at each batch size; tokens/s and the
bytes of weights + KV cache read per decode step times steps/s, over the device's memory bandwidth.
Peaks are datasheet figures for known devices (--peak-flops / --bandwidth override; unknown devices
report no fraction). Everything goes to one JSON file (default bench/results/accelerator.json).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from jaxgpt import GPTConfig, cache_bytes, count_params, generate, flops_per_token, init_params  # noqa: E402
from jaxgpt.training.config import default_config  # noqa: E402
from jaxgpt.training.profiling import StepProfiler  # noqa: E402
from jaxgpt.training.step import create_train_state, make_optimizer, make_train_step  # noqa: E402

# device_kind -> (dense bf16 FLOP/s, memory bytes/s), from the vendors' datasheets
DEVICES = {
    "NVIDIA H200": (989e12, 4.8e12),
    "NVIDIA H100 80GB HBM3": (989e12, 3.35e12),
    "NVIDIA H100 PCIe": (756e12, 2.0e12),
    "NVIDIA A100-SXM4-80GB": (312e12, 2.04e12),
    "NVIDIA A100-SXM4-40GB": (312e12, 1.56e12),
    "NVIDIA L4": (121e12, 0.3e12),
    "TPU v4": (275e12, 1.2e12),
    "TPU v5 lite": (197e12, 0.82e12),
    "TPU v5p": (459e12, 2.76e12),
}


def _median_seconds(fn, reps: int) -> float:
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def bench_train(cfg: GPTConfig, batch: int, steps: int, peak: float | None, loss_chunk: int = 0,
                profile: str | None = None) -> dict:
    train_cfg = default_config().train
    train_cfg.warmup_steps = 0
    opt = make_optimizer(train_cfg)
    state = create_train_state(init_params(cfg, jax.random.key(0)), opt, jax.random.key(1))
    step = jax.jit(make_train_step(cfg, opt, loss_chunk=loss_chunk), donate_argnums=(0,))
    tokens = jax.random.randint(jax.random.key(2), (batch, cfg.block_size + 1), 0, cfg.vocab_size)
    x, y = tokens[:, :-1], tokens[:, 1:]
    t0 = time.perf_counter()
    state, metrics = step(state, x, y)
    jax.block_until_ready(metrics)
    compile_s = time.perf_counter() - t0
    state, metrics = step(state, x, y)
    jax.block_until_ready(metrics)
    holder = [state]

    def one():
        holder[0], m = step(holder[0], x, y)
        jax.block_until_ready(m)

    t = _median_seconds(one, steps)
    if profile:  # two more steps, untimed, traced whole (jaxgpt/training/profiling.py)
        profiler = StepProfiler((0, 2), profile)
        profiler.start(0, holder[0])
        for i in range(2):
            with profiler.annotate(i):
                holder[0], metrics = step(holder[0], x, y)
        profiler.stop(2, holder[0])
    tok_s = batch * cfg.block_size / t
    flops = flops_per_token(cfg, cfg.block_size) * tok_s
    return {"batch": batch, "context": cfg.block_size, "ms_per_step": 1e3 * t, "tokens_per_s": tok_s,
            "model_flops_per_s": flops, "mfu": flops / peak if peak else None, "compile_s": compile_s,
            "loss": float(metrics["loss"]), "profile": profile}


def bench_decode(cfg: GPTConfig, batch: int, prompt_len: int, new_tokens: int, reps: int,
                 bandwidth: float | None) -> dict:
    params = init_params(cfg, jax.random.key(0))
    prompts = np.random.default_rng(0).integers(0, cfg.vocab_size, (batch, prompt_len))

    def call():
        out = generate(params, cfg, prompts, new_tokens, jax.random.key(1), temperature=1.0, top_k=50)
        out.tokens.block_until_ready()

    t0 = time.perf_counter()
    call()
    first = time.perf_counter() - t0
    t = _median_seconds(call, reps)
    weights = (count_params(params) - cfg.block_size * cfg.n_embd) * jnp.dtype(cfg.param_dtype).itemsize
    cache = cache_bytes(cfg, batch, prompt_len + new_tokens)
    bytes_per_s = (weights + cache) * new_tokens / t
    return {"batch": batch, "tokens_per_s": batch * new_tokens / t, "seconds": t, "compile_s": first - t,
            "weight_bytes": weights, "kv_cache_bytes": cache, "bytes_per_s": bytes_per_s,
            "fraction_of_bandwidth": bytes_per_s / bandwidth if bandwidth else None}


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--smoke", action="store_true", help="a tiny float32 model, seconds on a CPU")
    p.add_argument("--steps", type=int, default=10, help="timed training steps")
    p.add_argument("--batch", type=int, default=16, help="training batch (sequences of 1024 tokens)")
    p.add_argument("--decode-batch", type=int, nargs="+", default=[1, 8, 64])
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--reps", type=int, default=3, help="timed generate calls per batch size")
    p.add_argument("--attention", default=None,
                   help="attention implementation (default: cudnn on NVIDIA GPUs, dot_product elsewhere)")
    p.add_argument("--kernels", default="portable", choices=["portable", "auto", "gpu", "tpu"],
                   help="the training step's backend (default portable; auto: the gpu/tpu backend on its chip)")
    p.add_argument("--loss-chunk", type=int, default=0,
                   help="the loss over this many positions at a time (train.loss_chunk; 0: whole logits)")
    p.add_argument("--peak-flops", type=float, default=None, help="override the device's dense bf16 FLOP/s")
    p.add_argument("--bandwidth", type=float, default=None, help="override the device's memory bytes/s")
    p.add_argument("--out", default=None, help="JSON path (default bench/results/accelerator.json)")
    p.add_argument("--profile", default=None, metavar="DIR",
                   help="after timing, trace two training steps with jax.profiler into DIR (TensorBoard's profile "
                        "plugin or Perfetto read DIR/plugins/profile/*/; docs/training.md, 'Profiling a step')")
    args = p.parse_args(argv)

    device = jax.devices()[0]
    peak, bandwidth = DEVICES.get(device.device_kind, (None, None))
    peak, bandwidth = args.peak_flops or peak, args.bandwidth or bandwidth
    attention = args.attention or ("cudnn" if device.platform == "gpu" else "dot_product")
    if args.smoke:
        shape = dict(vocab_size=256, block_size=64, n_layer=2, n_head=4, n_embd=64)
        dtype, batch, steps, decode_batches, new_tokens, reps = "float32", 2, 2, [1, 2], 8, 1
    else:
        shape = dict(vocab_size=50257, block_size=1024, n_layer=12, n_head=12, n_embd=768)
        dtype, batch, steps, decode_batches, new_tokens, reps = ("bfloat16", args.batch, args.steps,
                                                                   args.decode_batch, args.new_tokens, args.reps)
    train_cfg = GPTConfig(**shape, dtype=dtype, kernels=args.kernels, attention=attention)
    results = {"device": device.device_kind, "platform": device.platform, "jax": jax.__version__,
               "peak_flops": peak, "bandwidth": bandwidth, "attention": attention, "kernels": args.kernels,
               "loss_chunk": args.loss_chunk,
               "smoke": args.smoke}
    try:
        results["train"] = bench_train(train_cfg, batch, steps, peak, args.loss_chunk, args.profile)
    except Exception as e:  # e.g. cuDNN attention unsupported here: say so and use XLA's
        if attention == "dot_product":
            raise
        print(f"attention={attention} failed ({type(e).__name__}: {str(e)[:200]}); using dot_product", flush=True)
        results["attention_fallback"] = f"{type(e).__name__}: {str(e)[:500]}"
        results["train"] = bench_train(train_cfg.replace(attention="dot_product"), batch, steps, peak,
                                       args.loss_chunk, args.profile)
    tr = results["train"]
    mfu = f"{100 * tr['mfu']:.1f}%" if tr["mfu"] is not None else "unknown (no peak for this device)"
    print(f"{device.device_kind}: train {tr['tokens_per_s']:,.0f} tok/s, {tr['ms_per_step']:.1f} ms/step, "
          f"MFU {mfu}", flush=True)
    decode_cfg = GPTConfig(**shape, dtype=dtype, param_dtype=dtype, kernels="portable")
    results["decode"] = []
    for b in decode_batches:
        row = bench_decode(decode_cfg, b, 16, new_tokens, reps, bandwidth)
        results["decode"].append(row)
        frac = f"{100 * row['fraction_of_bandwidth']:.1f}%" if row["fraction_of_bandwidth"] else "unknown"
        print(f"decode batch {b:3d}: {row['tokens_per_s']:9.1f} tok/s, {row['bytes_per_s'] / 1e9:7.1f} GB/s "
              f"({frac} of bandwidth)", flush=True)
    from bench.common import write_results
    if args.out:
        import json
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(results, f, indent=2)
        path = args.out
    else:
        path = write_results("accelerator", results)
    print(f"results: {path}")
    return results


if __name__ == "__main__":
    main()
