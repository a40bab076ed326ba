"""Document masking: a window packed with several documents, given their segment ids, computes each document
as if it stood alone (logits, portable and cpu backends, GPT-2 and Llama styles, unrolled and scanned);
causality holds inside it; the accelerator kernels' segment ids (interpreted) equal the reference's mask."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxgpt import GPT, GPTConfig, init_params
from jaxgpt.attention import (causal_mask, dot_product_attention, einsum_attention, register_attention,
                              segment_positions)
from jaxgpt.backends import cpu as cpu_backend
from jaxgpt.backends import gpu_attention, resolve, tpu_attention
from jaxgpt.registry import ATTENTION
from tests.helpers import STYLES

LENGTHS = (5, 7, 1, 3)  # four documents in a window of 16 (one a single token)


def _packed(lengths, vocab, seed=0):
    """Tokens of each document [1, n_i], the window that packs them [1, sum n_i] and its segment ids."""
    keys = jax.random.split(jax.random.key(seed), len(lengths))
    docs = [jax.random.randint(k, (1, n), 0, vocab) for k, n in zip(keys, lengths)]
    segments = jnp.concatenate([jnp.full((1, n), i, jnp.int32) for i, n in enumerate(lengths)], axis=1)
    return docs, jnp.concatenate(docs, axis=1), segments


def _model(kernels, style, **over):
    shape = dict(vocab_size=48, block_size=16, n_layer=2, n_head=4, n_kv_head=2, n_embd=32)
    cfg = GPTConfig(kernels=kernels, **{**shape, **STYLES[style], **over})
    # weights x3: at init scale every position's logits are nearly equal, and a leak would hide
    params = jax.tree.map(lambda x: 3 * x, init_params(cfg.replace(scan_layers=False), jax.random.key(0)))
    if cfg.scan_layers:
        from jaxgpt.model import convert_layers
        params = convert_layers(params, cfg)
    return GPT(cfg), params


@pytest.mark.parametrize("scan", [False, True], ids=["unrolled", "scan"])
@pytest.mark.parametrize("style", sorted(STYLES))
@pytest.mark.parametrize("kernels", ["portable", "cpu"])
def test_a_packed_window_computes_each_document_as_if_alone(kernels, style, scan):
    model, params = _model(kernels, style, scan_layers=scan)
    docs, window, segments = _packed(LENGTHS, 48)
    apply = jax.jit(lambda t, s: model.apply({"params": params}, t, segment_ids=s))
    got = apply(window, segments)
    alone = jnp.concatenate([jax.jit(lambda t: model.apply({"params": params}, t))(d) for d in docs], axis=1)
    np.testing.assert_allclose(got, alone, atol=2e-5, rtol=1e-5)
    # without the segment ids later documents see earlier ones: the test can tell the difference
    assert float(jnp.abs(model.apply({"params": params}, window) - alone).max()) > 1e-2


@pytest.mark.parametrize("kernels", ["portable", "cpu"])
def test_document_masked_logits_stay_causal(kernels):
    # changing any token changes no logit before it, and no logit of another document
    model, params = _model(kernels, "gpt2")
    _, window, segments = _packed(LENGTHS, 48, seed=1)
    apply = jax.jit(lambda t: model.apply({"params": params}, t, segment_ids=segments))
    base = apply(window)
    for t in (0, 4, 5, 11, 12, 15):
        changed = apply(window.at[0, t].set((window[0, t] + 1) % 48))
        moved = np.abs(np.asarray(changed - base)).max(axis=-1)[0] > 1e-6
        same_doc = np.asarray(segments[0] == segments[0, t])
        assert moved[t]
        assert not moved[:t].any(), f"a change at {t} reached earlier positions"
        assert not (moved & ~same_doc).any(), f"a change at {t} reached another document"


def test_segment_positions_restart_at_each_document():
    seg = jnp.array([[0, 0, 0, 1, 1, 2, 3, 3], [5, 5, 5, 5, 5, 5, 5, 5]])
    np.testing.assert_array_equal(segment_positions(seg), [[0, 1, 2, 0, 1, 0, 0, 1], list(range(8))])


def _attention_inputs(b=2, t=40, n=4, k=2, h=16, dtype=jnp.float32):
    keys = jax.random.split(jax.random.key(3), 4)
    q = jax.random.normal(keys[0], (b, t, n, h), dtype)
    kk, v = (jax.random.normal(key, (b, k, t, h), dtype) for key in keys[1:3])
    # random contiguous documents per row: a new one where a coin says so
    seg = jnp.cumsum(jax.random.bernoulli(keys[3], 0.15, (b, t)), axis=1).astype(jnp.int32)
    return q, kk, v, seg


def _masked_reference(q, k, v, seg):
    """Each query against its visible keys, one query at a time in numpy: the rule, spelled out."""
    q, k, v, seg = (np.asarray(a, np.float64) for a in (q, k, v, seg))
    b, t, n, h = q.shape
    g = n // k.shape[1]
    out = np.zeros_like(q)
    for r in range(b):
        for i in range(t):
            keys = [j for j in range(i + 1) if seg[r, j] == seg[r, i]]
            for head in range(n):
                s = np.array([q[r, i, head] @ k[r, head // g, j] for j in keys]) / np.sqrt(h)
                w = np.exp(s - s.max())
                out[r, i, head] = (w / w.sum()) @ v[r, head // g, keys]
    return out


@pytest.mark.parametrize("fn", [einsum_attention, dot_product_attention,
                                functools.partial(cpu_backend.dot_product_attention, native_attention=True)],
                         ids=["einsum", "dot_product", "cpu"])
def test_document_masked_attention_sees_only_earlier_keys_of_its_document(fn):
    q, k, v, seg = _attention_inputs()
    got = jax.jit(lambda *a: fn(*a, segment_ids_BxT=seg))(q, k, v)
    np.testing.assert_allclose(got, _masked_reference(q, k, v, seg), atol=2e-5)


def test_the_cpu_blocked_form_masks_documents_across_its_blocks():
    q, k, v, seg = _attention_inputs(b=1, t=80)  # blocks of 16: documents span block edges
    got = cpu_backend.blocked_causal_attention(q, k, v, block=16, segment_ids_BxT=seg)
    np.testing.assert_allclose(got, _masked_reference(q, k, v, seg), atol=2e-5)


def test_causal_mask_with_segments_is_the_and_of_both_rules():
    seg = jnp.array([[0, 0, 1, 1, 1]])
    mask = np.asarray(causal_mask(jnp.arange(5)[None], None, 5, seg))[0, 0]
    want = np.tril(np.ones((5, 5), bool)) & (np.asarray(seg[0])[:, None] == np.asarray(seg[0])[None, :])
    np.testing.assert_array_equal(mask, want)


def _kernel_against_reference(kernel):
    """A [B, T, N, H] / [B, T, K, H] kernel with segment ids against the einsum reference: values and grads."""
    q, k, v, seg = _attention_inputs(b=1, t=100)
    weights = jax.random.normal(jax.random.key(9), q.shape)

    def value_and_grads(attn):
        def run(q, k, v):
            out, vjp = jax.vjp(attn, q, k, v)
            return out, vjp(weights)
        return jax.jit(run)(q, k, v)

    got = value_and_grads(lambda q, k, v: kernel(q, k.swapaxes(1, 2), v.swapaxes(1, 2), segment_ids=seg))
    want = value_and_grads(lambda q, k, v: einsum_attention(q, k, v, segment_ids_BxT=seg))
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_allclose(g, w, atol=4e-5, rtol=4e-5)


def test_splash_segment_ids_mask_documents():
    _kernel_against_reference(functools.partial(tpu_attention.splash_attention, interpret=True))


def test_pallas_gpu_segment_ids_mask_documents():
    _kernel_against_reference(functools.partial(gpu_attention.pallas_attention, interpret=True))


@pytest.mark.parametrize("name", ["tpu", "gpu"])
def test_the_accelerator_backends_run_a_packed_window_like_the_portable_one(name):
    model, params = _model("portable", "gpt2", n_layer=1)
    _, window, segments = _packed(LENGTHS, 48)
    want = model.apply({"params": params}, window, segment_ids=segments)
    got = jax.jit(lambda p: GPT(model.config, resolve(name)).apply({"params": p}, window, segment_ids=segments))
    np.testing.assert_allclose(got(params), want, atol=2e-5)


def test_an_attention_without_the_segment_keyword_is_refused_in_one_line():
    @register_attention("test_no_segments")
    def plain(q, k, v, q_positions=None, kv_lengths=None):
        return einsum_attention(q, k, v, q_positions, kv_lengths)

    try:
        model, params = _model("portable", "gpt2", attention="test_no_segments")
        _, window, segments = _packed(LENGTHS, 48)
        model.apply({"params": params}, window)  # without segments it runs
        with pytest.raises(ValueError, match="'test_no_segments' takes no segment_ids_BxT"):
            model.apply({"params": params}, window, segment_ids=segments)
    finally:
        ATTENTION.unregister("test_no_segments")


def test_segment_ids_with_a_cache_are_refused():
    from jaxgpt import KVCache

    model, params = _model("portable", "gpt2")
    _, window, segments = _packed(LENGTHS, 48)
    cache = KVCache.create(model.config, 1, 16)
    with pytest.raises(ValueError, match="without a cache"):
        model.apply({"params": params}, window, cache, segment_ids=segments)


def test_a_step_over_one_document_per_row_is_the_plain_step():
    # segment ids that put each row in one document change nothing: the masked path is the causal one
    from jaxgpt.training.config import default_config
    from jaxgpt.training.step import init_train_state, make_optimizer, make_train_step

    model, _ = _model("portable", "gpt2")
    optimizer = make_optimizer(default_config().train, model.config)
    state = init_train_state(model.config, optimizer, seed=0)
    tokens = jax.random.randint(jax.random.key(4), (4, 17), 0, 48)
    x, y = tokens[:, :-1], tokens[:, 1:]
    step = jax.jit(make_train_step(model.config, optimizer, grad_accum=2))
    (plain, m_plain), (masked, m_masked) = step(state, x, y), step(state, x, y, jnp.zeros_like(x))
    np.testing.assert_allclose(m_masked["loss"], m_plain["loss"], rtol=1e-6)
    for a, b in zip(jax.tree.leaves(masked.params), jax.tree.leaves(plain.params)):
        np.testing.assert_allclose(a, b, atol=1e-6)
    # and two documents per row do change it
    two = (jnp.arange(16) >= 8).astype(jnp.int32)[None].repeat(4, 0)
    assert abs(float(step(state, x, y, two)[1]["loss"]) - float(m_plain["loss"])) > 1e-4


def _document_folder(tmp_path, n_docs=40):
    from tests.helpers import write_corpus

    folder = tmp_path / "docs"
    folder.mkdir(parents=True)
    for i in range(n_docs):
        write_corpus(folder / f"doc{i:03d}.txt", n_lines=2 + i % 5, seed=i)
    return folder


def _document_config(tmp_path, **train_kw):
    from tests.helpers import tiny_config

    c = tiny_config(tmp_path, **train_kw)
    c.data.path = str(_document_folder(tmp_path))
    c.data.tokenizer, c.data.vocab_size = "bpe", 300
    c.data.align = "document"
    return c


def _losses(out_dir):
    import json
    import os

    with open(os.path.join(out_dir, "metrics.jsonl")) as f:
        return {r["step"]: r["loss"] for r in map(json.loads, f) if "loss" in r}


def test_training_on_document_windows_learns_and_resumes_exactly(tmp_path, capsys, monkeypatch):
    # the real loop: pmap over 4 devices, 5 steps a call; then 10 steps and a resume on a mesh
    from jaxgpt import checkpoint as ckpt_lib
    from jaxgpt.training import train
    from jaxgpt.training.parallel import PmapRunner

    fed = []  # what the loop hands the runner: x, y and the document ids, [K, b, T] each
    steps, evals = PmapRunner.steps, PmapRunner.eval
    monkeypatch.setattr(PmapRunner, "steps", lambda self, state, *b: fed.append(b) or steps(self, state, *b))
    monkeypatch.setattr(PmapRunner, "eval", lambda self, state, *b: fed.append(b) or evals(self, state, *b))
    full = _document_config(tmp_path / "a", max_steps=20, decay_steps=20, log_interval=1, steps_per_call=5)
    train(full)
    assert "data.align=document: windows start at" in capsys.readouterr().out
    assert fed and all(len(b) == 3 and b[2] is not None and b[2].shape == b[0].shape for b in fed)
    a = _losses(full.out_dir)
    assert sorted(a) == list(range(1, 21)) and a[20] < a[1] - 0.5
    meta = ckpt_lib.Checkpointer(full.out_dir, read_only=True).restore_meta(20)
    assert meta["sampler"]["align"] == "document"
    from jaxgpt.data import tokenizer_from_dict
    assert meta["sampler"]["separator"] == tokenizer_from_dict(meta["tokenizer"]).eos_id is not None
    half = _document_config(tmp_path / "b", max_steps=10, decay_steps=20, log_interval=1, checkpoint_interval=5)
    train(half)
    half.train.max_steps, half.train.parallel, half.init_from = 20, "mesh", "resume"
    train(half)
    b = _losses(half.out_dir)
    np.testing.assert_allclose([b[k] for k in range(1, 21)], [a[k] for k in range(1, 21)], rtol=2e-5)


@pytest.mark.parametrize("tokenizer", ["char", "byte", "loaded"])
def test_document_alignment_without_an_end_of_text_token_is_refused_in_one_line(tmp_path, tokenizer):
    # char and byte: by the config check, before any data is prepared; any other tokenizer without one
    # (here a bpe whose end-of-text token is gone) where the loop builds the sampler
    from jaxgpt.training import loop, train
    from jaxgpt.training.config import validate_config

    c = _document_config(tmp_path, max_steps=2)
    c.data.tokenizer, c.data.vocab_size = (tokenizer, None) if tokenizer != "loaded" else ("bpe", 300)
    said = r"config.data.align: 'document' needs a tokenizer with an end-of-text token .* has none"
    if tokenizer != "loaded":
        with pytest.raises(ValueError, match=said + " \\(use 'bpe' or 'gpt2', or data.align='random'\\)$"):
            validate_config(c)
        return
    no_end = type("NoEnd", (), {"eos_id": None})()
    with pytest.raises(ValueError, match=said):
        loop.separator_id(c, no_end)
