"""Shared test fixtures: a small text corpus, a tiny training config, the docs' code examples."""

import pathlib
import random
import re

REPO = pathlib.Path(__file__).resolve().parent.parent

import jax
import jax.numpy as jnp

from jaxgpt.cache import KVCache
from jaxgpt.model import GPT
from jaxgpt.training.config import default_config

_WORDS = ("the king is dead long live the queen my lord what say you of this night and day to be or not "
          "that is the question whether tis nobler in the mind to suffer slings arrows").split()


def write_corpus(path, n_lines=400, seed=0):
    rnd = random.Random(seed)
    lines = []
    for i in range(n_lines):
        speaker = rnd.choice(["KING", "QUEEN", "LORD"])
        lines.append(f"{speaker}:\n" + " ".join(rnd.choice(_WORDS) for _ in range(rnd.randint(4, 12))) + "\n")
    path.write_text("\n".join(lines))
    return path


def tiny_config(tmp_path, **train):
    tmp_path.mkdir(parents=True, exist_ok=True)
    c = default_config()
    c.out_dir = str(tmp_path / "out")
    c.seed = 0
    c.data.corpus = "file"
    c.data.path = str(write_corpus(tmp_path / "corpus.txt"))
    c.data.cache_dir = str(tmp_path / "cache")
    c.model.block_size = 16
    c.model.n_layer = 2
    c.model.n_head = 2
    c.model.n_embd = 32
    c.train.batch_size = 8
    c.train.max_steps = 30
    c.train.warmup_steps = 5
    c.train.lr = 3e-3
    c.train.min_lr = 3e-4
    c.train.eval_interval = 10
    c.train.eval_steps = 2
    c.train.log_interval = 5
    c.train.checkpoint_interval = 10
    c.train.progress = False
    for k, v in train.items():
        c.train[k] = v
    return c


def varied_params(config, seed=0):
    """Parameters whose greedy continuations vary, in `config`'s layout. At init scale a tiny model's
    greedy decoding repeats one token, and a cache bug (a key at the wrong position, the newest key
    unseen) changes nothing visible; dense kernels x3 and position embeddings x5 give 9-11 distinct
    tokens in 12 greedy steps."""
    import jax

    from jaxgpt import init_params

    def scale(path, x):
        name = jax.tree_util.keystr(path)
        return x * 3.0 if "kernel" in name else x * 5.0 if "wpe" in name else x

    return jax.tree_util.tree_map_with_path(scale, init_params(config, jax.random.key(seed)))


# The model options that make a Llama-style block (each independent in GPTConfig); tests that check a
# property of the model run it for GPT-2 (no options) and for this.
LLAMA = dict(position="rope", norm="rmsnorm", mlp="swiglu", bias=False, tie_embeddings=False)
STYLES = {"gpt2": {}, "llama": LLAMA}


def assert_same_training(got, want, atol: float, what: str = "", min_share: float = 0.8) -> None:
    """Two TrainStates after the same AdamW steps, computed in orders that round differently (pmap, a
    mesh or one device; micro-batches; the chunked loss; remat), hold the same gradients and parameters.

    Adam's step lr * m / (sqrt(v) + eps) divides by the gradient's own scale: where a gradient is zero up to
    rounding, a rounding difference moves the parameter by up to lr. So the gradients are compared through
    Adam's first moments m (their running average: a rounding difference stays one) to 1e-5 of each
    tensor's largest, which also catches a gradient off by a factor (Adam's step would not); and the
    parameters within `atol` where the gradient's RMS sqrt(v) is at least 1e-3 of its tensor's largest,
    which must be `min_share` of all the parameters (the comparison is not empty)."""
    import jax
    import numpy as np
    import optax

    def adam(state):
        is_adam = lambda s: isinstance(s, optax.ScaleByAdamState)  # noqa: E731
        found = [s for s in jax.tree.leaves(state.opt_state, is_leaf=is_adam) if is_adam(s)]
        assert len(found) == 1, f"{what}: expected one AdamW state, found {len(found)}"
        return found[0]

    (a_got, a_want), leaves = (adam(got), adam(want)), jax.tree.leaves
    assert jax.tree.structure(got.params) == jax.tree.structure(want.params), what
    compared = total = 0
    for (path, p), q, m, n, v in zip(jax.tree_util.tree_leaves_with_path(got.params), leaves(want.params),
                                     leaves(a_got.mu), leaves(a_want.mu), leaves(a_want.nu)):
        name = f"{what} {jax.tree_util.keystr(path)}"
        m, n, v = (np.asarray(x, np.float64) for x in (m, n, v))
        np.testing.assert_allclose(m, n, rtol=0, atol=1e-5 * np.abs(n).max(), err_msg=f"{name}: gradients")
        rms = np.sqrt(v)
        steady = rms >= 1e-3 * rms.max()
        np.testing.assert_allclose(np.asarray(p)[steady], np.asarray(q)[steady], rtol=0, atol=atol,
                                   err_msg=f"{name}: parameters where the gradient is not tiny")
        compared, total = compared + int(steady.sum()), total + steady.size
    assert compared >= min_share * total, f"{what}: only {compared} of {total} parameters have gradients to compare"


def doc_example(doc: str, paragraph: str) -> str:
    """The first python code block after the paragraph starting `paragraph` in `doc` (a path from the repo
    root: "README.md", "docs/extending.md"), so the examples people read are the ones the tests run."""
    text = (REPO / doc).read_text()
    start = text.index(paragraph)
    return re.search(r"```python\n(.*?)```", text[start:], re.S).group(1)


def cached_logits(cfg, backend, params, tokens, prompt=5):
    """Logits of the positions after `prompt`, computed by a prefill and one-token cached steps."""
    model = GPT(cfg, backend)
    apply = jax.jit(lambda p, x, c: model.apply({"params": p}, x, c))  # one program per token count
    cache = KVCache.create(cfg, tokens.shape[0], tokens.shape[1], layout=backend.cache_layout)
    _, cache = apply(params, tokens[:, :prompt], cache)
    out = []
    for i in range(prompt, tokens.shape[1]):
        logits, cache = apply(params, tokens[:, i:i + 1], cache)
        out.append(logits[:, 0])
    return jnp.stack(out, axis=1)


def whole_buffer_copies(hlo: str, shapes) -> list:
    """Lines of compiled HLO that copy a buffer of one of `shapes` (e.g. "s8[6,16,8]")."""
    return [line.strip() for line in hlo.splitlines()
            if re.search(r"\bcopy(-start)?\(", line) and any(s + "{" in line.split("=", 1)[-1].split("(")[0]
                                                          for s in shapes)]


def run_for_marches(script: str, tmp_path, inputs: dict, marches=("native", "x86-64-v3")) -> dict:
    """`script` (python -c: argv[1] an .npz of `inputs`, argv[2] the .npz it writes) run once per build of the
    native kernels, each in its own process with JAXGPT_NATIVE_MARCH set to the -march ("native": this CPU's
    own build); {march: its outputs}."""
    import os
    import subprocess
    import sys

    import numpy as np

    np.savez(tmp_path / "in.npz", **inputs)
    results = {}
    for march in marches:
        env = {k: v for k, v in os.environ.items() if k != "JAXGPT_NATIVE_MARCH"}
        env.update(JAX_PLATFORMS="cpu", **({} if march == "native" else {"JAXGPT_NATIVE_MARCH": march}))
        args = [sys.executable, "-c", script, str(tmp_path / "in.npz"), str(tmp_path / f"{march}.npz")]
        done = subprocess.run(args, env=env, capture_output=True, text=True, timeout=600)
        assert done.returncode == 0, done.stderr[-2000:]
        results[march] = np.load(tmp_path / f"{march}.npz")
    return results
