"""Correctness of the GPU backend on a real GPU (the tests run its kernels only in Pallas' interpreter).

python bench/gpu_check.py [--out PATH]

On whatever GPU JAX finds, a small GPT (T = 200, not a multiple of the kernels' blocks; plain and
grouped-query heads) compares, each against the portable kernels on the same GPU:
- the gpu backend's Pallas flash attention: logits and the loss's gradients, float32 (matmuls at
  "highest" precision) and bfloat16;
- cuDNN's fused attention (bfloat16);
- the portable kernels on the GPU against the same on the host's CPU (float32);
- `Engine` against `generate` with the gpu backend: greedy tokens of ragged prompts, and the prompt
  logprobs against the full forward's log-softmax.
Prints one line per check with its largest difference and writes them all to one JSON file. Checks report,
they do not stop the run: the figures are what a session files.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import traceback

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import jaxgpt  # noqa: E402
from jaxgpt.training.step import cross_entropy  # noqa: E402

SHAPE = dict(vocab_size=512, block_size=256, n_layer=2, n_head=4, n_embd=128)


def loss_and_grads(cfg, params, x, y):
    def loss(p):
        logits = jaxgpt.GPT(cfg).apply({"params": p}, x)
        return cross_entropy(logits, y), logits

    (value, logits), grads = jax.jit(jax.value_and_grad(loss, has_aux=True))(params)
    return float(value), np.asarray(logits, np.float32), jax.tree.map(lambda g: np.asarray(g, np.float32), grads)


def rel(a, b) -> float:
    """Largest |a - b| over the largest |b|."""
    return float(np.max(np.abs(a - b)) / max(np.max(np.abs(b)), 1e-30))


def compare(name, cfg_a, cfg_b, device_a=None, device_b=None, precision=None) -> dict:
    params = jaxgpt.init_params(cfg_a.replace(dtype="float32"), jax.random.key(0))
    tokens = jax.random.randint(jax.random.key(1), (2, 201), 0, cfg_a.vocab_size)
    x, y = tokens[:, :-1], tokens[:, 1:]
    out = []
    for cfg, device in ((cfg_a, device_a), (cfg_b, device_b)):
        with jax.default_matmul_precision(precision or "default"), jax.default_device(device):
            p, xx, yy = jax.device_put((params, x, y), device)
            out.append(loss_and_grads(cfg, p, xx, yy))
    (la, ga_logits, ga), (lb, gb_logits, gb) = out
    grad_rel = max(jax.tree.leaves(jax.tree.map(rel, ga, gb)))
    row = {"check": name, "loss": [la, lb], "logits_rel": rel(ga_logits, gb_logits), "grads_rel_max": grad_rel}
    print(f"{name:58s} loss {la:.6f} / {lb:.6f}  logits rel {row['logits_rel']:.2e}  grads rel {grad_rel:.2e}",
          flush=True)
    return row


def engine_check(kernels: str) -> dict:
    cfg = jaxgpt.GPTConfig(**SHAPE, kernels=kernels)
    params = jaxgpt.init_params(cfg, jax.random.key(3))
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, cfg.vocab_size, n).tolist() for n in (5, 17, 40, 64)]
    engine = jaxgpt.Engine(params, cfg, slots=4, max_len=128, prefill_chunk=32)
    outs = engine.run([dict(prompt=p, max_tokens=16, temperature=0.0, prompt_logprobs=True) for p in prompts])
    decoder = jaxgpt.Decoder(params, cfg)
    equal, lp_err = 0, 0.0
    for p, out in zip(prompts, outs):
        ref = decoder.generate(np.asarray([p]), 16, jax.random.key(0), temperature=0.0)
        equal += int(out.token_ids == np.asarray(ref.tokens)[0, len(p):len(p) + 16].tolist())
        logits = jaxgpt.GPT(cfg).apply({"params": params}, jnp.asarray([p]))
        full = np.asarray(jax.nn.log_softmax(logits[0].astype(jnp.float32)), np.float64)
        want = np.array([full[i - 1, p[i]] for i in range(1, len(p))])
        got = np.array(out.prompt_logprobs[1:], np.float64)
        lp_err = max(lp_err, float(np.max(np.abs(got - want))))
    row = {"check": f"engine vs generate, kernels={kernels}", "greedy_equal": f"{equal}/{len(prompts)}",
           "prompt_logprob_max_abs": lp_err, "programs": engine.programs_compiled}
    print(f"{row['check']:58s} greedy equal {row['greedy_equal']}  prompt logprobs max |diff| {lp_err:.2e}",
          flush=True)
    return row


def main(argv=None) -> list:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="bench/results/gpu_check.json")
    args = p.parse_args(argv)
    gpu = jax.devices()[0]
    print(f"device: {gpu.device_kind} ({gpu.platform}), jax {jax.__version__}", flush=True)
    rows = [{"device": gpu.device_kind, "platform": gpu.platform, "jax": jax.__version__}]
    checks = []
    for kv in (None, 2):
        base = jaxgpt.GPTConfig(**SHAPE, n_kv_head=kv or SHAPE["n_head"], kernels="portable")
        tag = "GQA 4/2" if kv else "MHA"
        checks += [
            (f"pallas vs portable, float32, {tag}", base, base.replace(kernels="gpu"), None, None, "highest"),
            (f"pallas vs portable, bfloat16, {tag}", base.replace(dtype="bfloat16"),
             base.replace(dtype="bfloat16", kernels="gpu"), None, None, None),
            (f"cudnn vs portable, bfloat16, {tag}", base.replace(dtype="bfloat16"),
             base.replace(dtype="bfloat16", attention="cudnn"), None, None, None),
        ]
    base = jaxgpt.GPTConfig(**SHAPE, kernels="portable")
    checks.append(("portable on the GPU vs on the CPU, float32", base, base, gpu, jax.devices("cpu")[0], "highest"))
    for name, a, b, da, db, prec in checks:
        try:
            rows.append(compare(name, a, b, da, db, prec))
        except Exception as e:  # report and go on
            traceback.print_exc()
            rows.append({"check": name, "error": f"{type(e).__name__}: {str(e)[:800]}"})
    for kernels in ("gpu", "portable"):
        try:
            rows.append(engine_check(kernels))
        except Exception as e:
            traceback.print_exc()
            rows.append({"check": f"engine, kernels={kernels}", "error": f"{type(e).__name__}: {str(e)[:800]}"})
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(rows, f, indent=2)
    print(f"results: {args.out}")
    return rows


if __name__ == "__main__":
    main()
