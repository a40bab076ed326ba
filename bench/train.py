"""Training-throughput benchmark: jaxgpt's real train step (the runner train.py uses) against PyTorch peers
doing the same work in the same run: transformers' GPT2LMHeadModel + AdamW (eager), and nanoGPT's own
model.py + its configure_optimizers (run in a subprocess on a copy of --nanogpt; --no-nanogpt skips it).

python bench/train.py [--configs baby 6l] [--dtypes float32 bfloat16] [--kernels auto portable] [--steps 5]
                      [--rounds 3] [--no-torch] [--nanogpt ../shared/peers/nanogpt | --no-nanogpt]

All sides of a config are built and warmed up first, then timed in turns: each round runs --steps steps of
every jaxgpt variant, then of each peer, so that all of them see the same drifts of the machine's speed
(the 2-core machine's moved 10-30% within minutes). Prints the machine's measured matmul peak and
bandwidth, then tokens/s, ms/step and MFU (6N + 12*L*T*D FLOPs per token, attention not halved) of each,
median over all rounds' timed steps.
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
from jaxgpt import GPTConfig, flops_per_token, init_params  # noqa: E402
from jaxgpt.training.config import default_config  # noqa: E402
from jaxgpt.training import create_train_state, make_optimizer, make_runner, make_schedule  # noqa: E402
from jaxgpt.training.metrics import measured_matmul_flops  # noqa: E402

CONFIGS = {  # name: (n_layer, n_head, n_embd, block_size, batch, vocab)
    "baby": (4, 4, 128, 64, 12, 65),
    "6l": (6, 6, 384, 256, 8, 65),
    "tiny": (1, 2, 32, 16, 4, 65),  # not a benchmark: the tests' run through every side (tests/test_bench.py)
}


def batches(n, b, t, vocab, seed=0):
    r = np.random.default_rng(seed)
    return [r.integers(0, vocab, (b, t + 1)).astype(np.int32) for _ in range(n)]


class JaxSide:
    """jaxgpt's real train step (the runner train.py uses), compiled and warmed up on construction."""

    def __init__(self, name, dtype, attention="dot_product", kernels="auto", scan_layers=False, remat="none"):
        L, H, D, T, B, V = CONFIGS[name]
        self.cfg = GPTConfig(vocab_size=V, block_size=T, n_layer=L, n_head=H, n_embd=D, dtype=dtype,
                             attention=attention, kernels=kernels, scan_layers=scan_layers, remat=remat)
        tc = default_config().train
        opt = make_optimizer(tc)
        self.runner = make_runner("pmap", self.cfg, opt, 1, make_schedule(tc))
        self.state = self.runner.put_state(create_train_state(init_params(self.cfg, jax.random.key(0)), opt,
                                                              jax.random.key(1)))
        self.data = batches(8, B, T, V)
        t0 = time.perf_counter()
        self._step(0)
        self.compile_s = time.perf_counter() - t0
        self._step(1)
        self.calls = 2

    def _step(self, i):
        d = self.data[i % len(self.data)]
        self.state, m = self.runner.step(self.state, d[:, :-1], d[:, 1:])
        jax.block_until_ready(m)

    def run(self, n):
        """Seconds of each of n more steps (one step per call)."""
        times = []
        for _ in range(n):
            t0 = time.perf_counter()
            self._step(self.calls)
            times.append(time.perf_counter() - t0)
            self.calls += 1
        return times


def bench_jax(name, dtype, steps, attention, kernels="auto", scan_layers=False, remat="none"):
    """(config, median seconds per step, compile seconds) of `steps` steps of jaxgpt's train step."""
    side = JaxSide(name, dtype, attention, kernels, scan_layers, remat)
    return side.cfg, statistics.median(side.run(steps)), side.compile_s


class TorchSide:
    """transformers' GPT2LMHeadModel + AdamW, eager (or torch.compile'd), warmed up on construction."""

    def __init__(self, name, compile_=False):
        import torch
        from transformers import GPT2Config, GPT2LMHeadModel

        L, H, D, T, B, V = CONFIGS[name]
        torch.manual_seed(0)
        hf = GPT2Config(vocab_size=V, n_positions=T, n_embd=D, n_layer=L, n_head=H, resid_pdrop=0.0,
                        embd_pdrop=0.0, attn_pdrop=0.0)
        self.model = GPT2LMHeadModel(hf)
        self.model.train()
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-3, betas=(0.9, 0.99), weight_decay=0.1)
        self.fwd = torch.compile(self.model) if compile_ else self.model
        self.vocab = V
        self.data = [torch.from_numpy(d.astype(np.int64)) for d in batches(8, B, T, V)]
        self.version = torch.__version__
        self.calls = 0
        self.run(2)

    def _step(self, d):
        import torch

        x, y = d[:, :-1], d[:, 1:]
        logits = self.fwd(input_ids=x).logits
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, self.vocab), y.reshape(-1))
        self.opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
        self.opt.step()
        return loss.item()

    def run(self, n):
        times = []
        for _ in range(n):
            t0 = time.perf_counter()
            self._step(self.data[self.calls % len(self.data)])
            times.append(time.perf_counter() - t0)
            self.calls += 1
        return times


# Runs in a fresh process inside a copy of nanoGPT's folder: builds nanoGPT's GPT and optimizer with the
# benchmark's shape (its defaults otherwise: no bias, no dropout, eager), warms up two steps, prints "ready",
# then for each line N on stdin times N more steps and prints their seconds as a JSON list.
NANOGPT_PEER = r"""
import json, sys, time
import numpy as np, torch
from model import GPT, GPTConfig
L, H, D, T, B, V = json.loads(sys.argv[1])
torch.manual_seed(0)
model = GPT(GPTConfig(block_size=T, vocab_size=V, n_layer=L, n_head=H, n_embd=D, dropout=0.0, bias=False))
model.train()
opt = model.configure_optimizers(0.1, 1e-3, (0.9, 0.99), "cpu")
r = np.random.default_rng(0)
data = [torch.from_numpy(r.integers(0, V, (B, T + 1)).astype(np.int64)) for _ in range(8)]
data = [(d[:, :-1].contiguous(), d[:, 1:].contiguous()) for d in data]  # as nanoGPT's get_batch gives them
calls = 0
def step():
    global calls
    x, y = data[calls % len(data)]
    calls += 1
    t0 = time.perf_counter()
    _, loss = model(x, y)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    opt.zero_grad(set_to_none=True)
    loss.item()
    return time.perf_counter() - t0
step(); step()
print(json.dumps({"ready": True, "torch": torch.__version__}), flush=True)
for line in sys.stdin:
    print(json.dumps([step() for _ in range(int(line))]), flush=True)
"""


class NanoGPTSide:
    """nanoGPT's own model.py + configure_optimizers in a subprocess on a copy of its folder, kept running
    between rounds (it waits on its stdin, idle, while the others are timed)."""

    def __init__(self, name, nanogpt):
        L, H, D, T, B, V = CONFIGS[name]
        self.work = tempfile.TemporaryDirectory(prefix="jaxgpt-bench-nanogpt-")
        copy = os.path.join(self.work.name, "nanogpt")
        shutil.copytree(nanogpt, copy, ignore=shutil.ignore_patterns("out*", "data"))
        self.proc = subprocess.Popen([sys.executable, "-c", NANOGPT_PEER, json.dumps([L, H, D, T, B, V])], cwd=copy,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        self.version = self._read()["torch"]

    def _read(self):
        while True:  # the peer's own prints (nanoGPT's model prints its size) pass by
            line = self.proc.stdout.readline()
            if not line:
                self.proc.wait()
                raise SystemExit(f"nanoGPT peer failed:\n{self.proc.stderr.read()[-3000:]}")
            if line.startswith(("{", "[")):
                return json.loads(line)

    def run(self, n):
        self.proc.stdin.write(f"{n}\n")
        self.proc.stdin.flush()
        return self._read()

    def close(self):
        self.proc.stdin.close()
        self.proc.wait(timeout=60)
        self.work.cleanup()


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--configs", nargs="+", default=["baby", "6l"], choices=sorted(CONFIGS))
    p.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    p.add_argument("--attention", default="dot_product", choices=["dot_product", "einsum"])
    p.add_argument("--kernels", nargs="+", default=["auto"], choices=["auto", "portable", "cpu"])
    p.add_argument("--scan-layers", action="store_true", help="GPTConfig.scan_layers")
    p.add_argument("--remat", default="none", choices=["none", "block", "dots"])
    p.add_argument("--steps", type=int, default=5, help="timed steps of each side per round")
    p.add_argument("--rounds", type=int, default=3,
                   help="rounds; in each, every side (jaxgpt's variants and the peers) runs --steps steps in turn")
    p.add_argument("--no-torch", action="store_true")
    p.add_argument("--torch-compile", action="store_true")
    p.add_argument("--nanogpt", default=os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                                     "..", "shared", "peers", "nanogpt"),
                   help="nanoGPT's folder (copied, never modified)")
    p.add_argument("--no-nanogpt", action="store_true")
    args = p.parse_args(argv)
    ceil = ceilings()
    rows = []
    for name in args.configs:
        L, H, D, T, B, V = CONFIGS[name]
        sides = {}  # every side built (and warmed up) first, then timed in turns, round after round
        for dtype, kernels in [(d, k) for d in args.dtypes for k in args.kernels]:
            sides[(dtype, kernels)] = JaxSide(name, dtype, args.attention, kernels, args.scan_layers, args.remat)
        if not args.no_torch:
            sides["transformers"] = TorchSide(name, args.torch_compile)
        if not args.no_nanogpt:
            if not os.path.isfile(os.path.join(args.nanogpt, "model.py")):
                raise SystemExit(f"no nanoGPT model.py under {args.nanogpt} (pass --nanogpt or --no-nanogpt)")
            sides["nanogpt"] = NanoGPTSide(name, args.nanogpt)
        times = {key: [] for key in sides}
        try:
            for _ in range(args.rounds):
                for key, side in sides.items():
                    times[key] += side.run(args.steps)
        finally:
            if "nanogpt" in sides:
                sides["nanogpt"].close()
        med = {key: statistics.median(t) for key, t in times.items()}
        peer = nano = None
        if "transformers" in sides:
            peer = {"ms_per_step": 1e3 * med["transformers"], "tokens_per_s": B * T / med["transformers"],
                    "torch": sides["transformers"].version}
        if "nanogpt" in sides:
            nano = {"ms_per_step": 1e3 * med["nanogpt"], "tokens_per_s": B * T / med["nanogpt"],
                    "torch": sides["nanogpt"].version}
        for (dtype, kernels), side in [(k, v) for k, v in sides.items() if isinstance(v, JaxSide)]:
            t, cfg, compile_s = med[(dtype, kernels)], side.cfg, side.compile_s
            # MFU against the compute dtype's measured rate at the model's own largest matmul shape
            peak = measured_matmul_flops(dtype, (B * T, D, cfg.mlp_hidden))
            tok_s = B * T / t
            row = {"config": name, "dtype": dtype, "kernels": kernels, "ms_per_step": 1e3 * t, "tokens_per_s": tok_s,
                   "mfu_peak_flops": peak, "mfu_peak_shape": [B * T, D, cfg.mlp_hidden],
                   "compile_s": compile_s, "mfu": flops_per_token(cfg, T) * tok_s / peak, "peer": peer,
                   "speedup_vs_peer": (tok_s / peer["tokens_per_s"]) if peer else None, "nanogpt": nano,
                   "speedup_vs_nanogpt": (tok_s / nano["tokens_per_s"]) if nano else None,
                   "all_ms": {str(k): [1e3 * x for x in v] for k, v in times.items()}}
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
    return rows


if __name__ == "__main__":
    main()
