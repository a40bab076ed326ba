"""Training-throughput benchmark: jaxgpt's real train step (the runner train.py uses) against PyTorch peers
doing the same work in the same run: transformers' GPT2LMHeadModel + AdamW (eager), and nanoGPT's own
model.py + its configure_optimizers (run in a subprocess on a copy of --nanogpt; --no-nanogpt skips it).

python bench/train.py [--configs baby 6l] [--dtypes float32 bfloat16] [--kernels auto portable] [--steps 20]
                      [--no-torch] [--nanogpt ../shared/peers/nanogpt | --no-nanogpt]

Prints the machine's measured matmul peak and bandwidth, then tokens/s, ms/step and MFU (6N + 12*L*T*D
FLOPs per token, attention not halved) of each, median over --steps timed steps after warm-up.
"""

from __future__ import annotations

import argparse
import os
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import numpy as np  # noqa: E402

from bench.common import ceilings, machine, write_results  # noqa: E402
from jaxgpt import GPTConfig, init_params  # noqa: E402
from jaxgpt.config import default_config  # noqa: E402
from jaxgpt.training import create_train_state, make_optimizer, make_runner, make_schedule  # noqa: E402
from jaxgpt.training.metrics import measured_matmul_flops  # noqa: E402

CONFIGS = {  # name: (n_layer, n_head, n_embd, block_size, batch, vocab)
    "baby": (4, 4, 128, 64, 12, 65),
    "6l": (6, 6, 384, 256, 8, 65),
}


def batches(n, b, t, vocab, seed=0):
    r = np.random.default_rng(seed)
    return [r.integers(0, vocab, (b, t + 1)).astype(np.int32) for _ in range(n)]


def bench_jax(name, dtype, steps, attention, kernels="auto", scan_layers=False, remat="none"):
    L, H, D, T, B, V = CONFIGS[name]
    cfg = GPTConfig(vocab_size=V, block_size=T, n_layer=L, n_head=H, n_embd=D, dtype=dtype, attention=attention,
                    kernels=kernels, scan_layers=scan_layers, remat=remat)
    tc = default_config().train
    opt = make_optimizer(tc)
    runner = make_runner("pmap", cfg, opt, 1, make_schedule(tc))
    state = runner.put_state(create_train_state(init_params(cfg, jax.random.key(0)), opt, jax.random.key(1)))
    data = batches(steps + 2, B, T, V)
    t0 = time.perf_counter()
    state, m = runner.step(state, data[0][:, :-1], data[0][:, 1:])
    jax.block_until_ready(m)
    compile_s = time.perf_counter() - t0
    state, m = runner.step(state, data[1][:, :-1], data[1][:, 1:])
    jax.block_until_ready(m)
    times = []
    for d in data[2:]:
        t0 = time.perf_counter()
        state, m = runner.step(state, d[:, :-1], d[:, 1:])
        jax.block_until_ready(m)
        times.append(time.perf_counter() - t0)
    return cfg, statistics.median(times), compile_s


def bench_torch(name, steps, compile_=False):
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    L, H, D, T, B, V = CONFIGS[name]
    torch.manual_seed(0)
    hf = GPT2Config(vocab_size=V, n_positions=T, n_embd=D, n_layer=L, n_head=H, resid_pdrop=0.0,
                    embd_pdrop=0.0, attn_pdrop=0.0)
    model = GPT2LMHeadModel(hf)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.9, 0.99), weight_decay=0.1)
    fwd = torch.compile(model) if compile_ else model
    data = [torch.from_numpy(d.astype(np.int64)) for d in batches(steps + 2, B, T, V)]

    def step(d):
        x, y = d[:, :-1], d[:, 1:]
        logits = fwd(input_ids=x).logits
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, V), y.reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        return loss.item()

    step(data[0])
    step(data[1])
    times = []
    for d in data[2:]:
        t0 = time.perf_counter()
        step(d)
        times.append(time.perf_counter() - t0)
    return statistics.median(times), torch.__version__


# Runs in a fresh process inside a copy of nanoGPT's folder: builds nanoGPT's GPT and optimizer with the
# benchmark's shape (its defaults otherwise: no bias, no dropout, eager) and prints the median step time.
NANOGPT_PEER = r"""
import json, statistics, sys, time
import numpy as np, torch
from model import GPT, GPTConfig
L, H, D, T, B, V, steps = json.loads(sys.argv[1])
torch.manual_seed(0)
model = GPT(GPTConfig(block_size=T, vocab_size=V, n_layer=L, n_head=H, n_embd=D, dropout=0.0, bias=False))
model.train()
opt = model.configure_optimizers(0.1, 1e-3, (0.9, 0.99), "cpu")
r = np.random.default_rng(0)
data = [torch.from_numpy(r.integers(0, V, (B, T + 1)).astype(np.int64)) for _ in range(steps + 2)]
data = [(d[:, :-1].contiguous(), d[:, 1:].contiguous()) for d in data]  # as nanoGPT's get_batch gives them
times = []
for i, (x, y) in enumerate(data):
    t0 = time.perf_counter()
    _, loss = model(x, y)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    opt.zero_grad(set_to_none=True)
    loss.item()
    if i >= 2:
        times.append(time.perf_counter() - t0)
print(json.dumps({"seconds": statistics.median(times), "torch": torch.__version__}))
"""


def bench_nanogpt(name, steps, nanogpt):
    L, H, D, T, B, V = CONFIGS[name]
    with tempfile.TemporaryDirectory(prefix="jaxgpt-bench-nanogpt-") as work:
        copy = os.path.join(work, "nanogpt")
        shutil.copytree(nanogpt, copy, ignore=shutil.ignore_patterns("out*", "data"))
        proc = subprocess.run([sys.executable, "-c", NANOGPT_PEER, json.dumps([L, H, D, T, B, V, steps])], cwd=copy,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"nanoGPT peer failed:\n{proc.stderr[-3000:]}")
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    return out["seconds"], out["torch"]


def main():
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--configs", nargs="+", default=["baby", "6l"], choices=sorted(CONFIGS))
    p.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    p.add_argument("--attention", default="dot_product", choices=["dot_product", "einsum"])
    p.add_argument("--kernels", nargs="+", default=["auto"], choices=["auto", "portable", "cpu"])
    p.add_argument("--scan-layers", action="store_true", help="GPTConfig.scan_layers")
    p.add_argument("--remat", default="none", choices=["none", "block", "dots"])
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--no-torch", action="store_true")
    p.add_argument("--torch-compile", action="store_true")
    p.add_argument("--nanogpt", default=os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                                     "..", "shared", "peers", "nanogpt"),
                   help="nanoGPT's folder (copied, never modified)")
    p.add_argument("--no-nanogpt", action="store_true")
    args = p.parse_args()
    ceil = ceilings()
    rows = []
    for name in args.configs:
        L, H, D, T, B, V = CONFIGS[name]
        peer = None
        if not args.no_torch:
            t_torch, tv = bench_torch(name, args.steps, args.torch_compile)
            peer = {"ms_per_step": 1e3 * t_torch, "tokens_per_s": B * T / t_torch, "torch": tv}
        nano = None
        if not args.no_nanogpt:
            if not os.path.isfile(os.path.join(args.nanogpt, "model.py")):
                raise SystemExit(f"no nanoGPT model.py under {args.nanogpt} (pass --nanogpt or --no-nanogpt)")
            t_nano, tv = bench_nanogpt(name, args.steps, args.nanogpt)
            nano = {"ms_per_step": 1e3 * t_nano, "tokens_per_s": B * T / t_nano, "torch": tv}
        for dtype, kernels in [(d, k) for d in args.dtypes for k in args.kernels]:
            cfg, t, compile_s = bench_jax(name, dtype, args.steps, args.attention, kernels, args.scan_layers,
                                          args.remat)
            # MFU against the compute dtype's measured rate at the model's own largest matmul shape
            peak = measured_matmul_flops(dtype, (B * T, D, cfg.mlp_hidden))
            tok_s = B * T / t
            row = {"config": name, "dtype": dtype, "kernels": kernels, "ms_per_step": 1e3 * t, "tokens_per_s": tok_s,
                   "mfu_peak_flops": peak, "mfu_peak_shape": [B * T, D, cfg.mlp_hidden],
                   "compile_s": compile_s, "mfu": cfg.flops_per_token(T) * tok_s / peak, "peer": peer,
                   "speedup_vs_peer": (tok_s / peer["tokens_per_s"]) if peer else None, "nanogpt": nano,
                   "speedup_vs_nanogpt": (tok_s / nano["tokens_per_s"]) if nano else None}
            rows.append(row)
            sp = f"{row['speedup_vs_peer']:.2f}x" if peer else "-"
            sn = f"{row['speedup_vs_nanogpt']:.2f}x" if nano else "-"
            print(f"{name:>5} {dtype:>9} {kernels:>8}: jaxgpt {row['ms_per_step']:8.1f} ms/step {tok_s:9.0f} tok/s "
                  f"MFU {100 * row['mfu']:5.1f}% compile {compile_s:5.1f}s | transformers "
                  f"{peer['ms_per_step'] if peer else float('nan'):8.1f} ms/step ({sp}) | nanoGPT "
                  f"{nano['ms_per_step'] if nano else float('nan'):8.1f} ms/step ({sn})", flush=True)
    path = write_results("train", {"machine": machine(), "ceilings": ceil, "settings": vars(args), "runs": rows})
    print(f"ceilings: fp32 {ceil['matmul_fp32_flops'] / 1e9:.0f} GFLOP/s, bf16 {ceil['matmul_bf16_flops'] / 1e9:.0f} "
          f"GFLOP/s, read {ceil['read_bytes_per_s'] / 1e9:.1f} GB/s; results: {path}")


if __name__ == "__main__":
    main()
