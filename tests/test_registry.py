"""Registries that refuse mistakes: names must be non-empty strings, a taken name needs replace=True, and a
replaced built-in attention runs as written on every backend (none keeps its own kernel for the old one)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxgpt import GPT, GPTConfig, register_attention, register_block, resolve
from jaxgpt.attention import einsum_attention
from jaxgpt.backends import PORTABLE
from jaxgpt.registry import ATTENTION, BLOCKS, Registry
from tests.helpers import cached_logits, varied_params

BACKENDS = [PORTABLE, resolve("cpu")]


def _tiny(**kw):
    return GPTConfig(vocab_size=50, block_size=16, n_layer=2, n_head=2, n_embd=32, **kw)


@pytest.fixture
def restore_builtins():
    """Put jaxgpt's own parts back however the test ends, so no other test sees a replacement."""
    yield
    for registry in (ATTENTION, BLOCKS):
        for name in registry.builtin_names():
            registry.register(name, replace=True)(registry.builtin(name))
            assert not registry.replaced(name)


@pytest.mark.parametrize("name", [3, None, b"dot", ("a",), "", "  "])
def test_a_name_that_is_not_a_nonempty_string_is_refused_when_registered(name):
    before = (ATTENTION.names(), BLOCKS.names())
    for register in (register_attention, register_block):
        with pytest.raises(ValueError, match="must be a non-empty string, got") as err:
            register(name)
        assert repr(name) in str(err.value)
    assert (ATTENTION.names(), BLOCKS.names()) == before
    assert _tiny().attention == "dot_product"  # later configs still validate (names() still sorts)


@pytest.mark.parametrize("registry, name", [(ATTENTION, "dot_product"), (ATTENTION, "einsum"),
                                            (ATTENTION, "cudnn"), (BLOCKS, "gpt2"), (BLOCKS, "parallel")])
def test_a_builtin_name_is_replaced_only_with_replace_true(registry, name, restore_builtins):
    original = registry.get(name)

    def impostor(*args, **kwargs):
        raise AssertionError("never called")

    with pytest.raises(ValueError, match=f"{name!r} is already registered.*jaxgpt's built-in.*pass replace=True"):
        registry.register(name)(impostor)
    assert registry.get(name) is original and not registry.replaced(name)
    registry.register(name, replace=True)(impostor)
    assert registry.get(name) is impostor and registry.replaced(name)


def test_the_public_decorators_refuse_builtin_names_without_replace():
    with pytest.raises(ValueError, match="pass replace=True"):
        register_attention("dot_product")(einsum_attention)
    with pytest.raises(ValueError, match="pass replace=True"):
        register_block("gpt2")(BLOCKS.get("parallel"))
    assert ATTENTION.get("dot_product").__name__ == "dot_product_attention" and not ATTENTION.replaced("dot_product")


def _define():
    def part(x):
        return x

    return part


def test_a_user_name_is_taken_once_but_its_own_definition_may_run_again():
    """A second, different part under a user's name is refused; the same definition run again (a notebook
    cell re-run, a reloaded module) replaces the first."""
    reg = Registry("part")
    first = reg.register("mine")(_define())
    again = reg.register("mine")(_define())  # another function object, the same definition
    assert again is not first and reg.get("mine") is again
    with pytest.raises(ValueError, match="'mine' is already registered.*pass replace=True"):
        reg.register("mine")(lambda x: x)
    reg.register("anon")(lambda x: x)
    with pytest.raises(ValueError, match="pass replace=True"):  # a lambda names no definition
        reg.register("anon")(lambda x: x)
    other = reg.register("mine", replace=True)(str)
    assert reg.get("mine") is other and not reg.replaced("mine")  # not a built-in: nothing to stand down


def test_a_replaced_dot_product_runs_as_written_on_every_backend(restore_builtins):
    cfg = _tiny()
    params = varied_params(cfg)
    tokens = jax.random.randint(jax.random.key(7), (2, 12), 0, cfg.vocab_size)
    original = GPT(cfg, PORTABLE).apply({"params": params}, tokens)

    @register_attention("dot_product", replace=True)
    def sharper(q, k, v, q_positions, kv_lengths):  # scores scaled by 2 / sqrt(H)
        return einsum_attention(2.0 * q, k, v, q_positions, kv_lengths)

    for b in BACKENDS:  # every backend hands out the replacement, not its own kernel for the built-in
        assert b.attention("dot_product") is sharper, b.name
    full = {b.name: GPT(cfg, b).apply({"params": params}, tokens) for b in BACKENDS}
    assert float(jnp.abs(full["portable"] - original).max()) > 1e-2, "the replacement did not run"
    np.testing.assert_allclose(full["cpu"], full["portable"], atol=1e-5)
    for b in BACKENDS:
        np.testing.assert_allclose(cached_logits(cfg, b, params, tokens), full[b.name][:, 5:], atol=1e-4)


def test_a_replaced_builtin_block_is_the_one_the_model_builds(restore_builtins):
    calls = []
    base = BLOCKS.builtin("gpt2")

    @register_block("gpt2", replace=True)
    class Counted(base):
        def __call__(self, *args, **kwargs):
            calls.append(1)
            return super().__call__(*args, **kwargs)

    cfg = _tiny()
    GPT(cfg, PORTABLE).init(jax.random.key(0), jnp.zeros((1, 4), jnp.int32))
    assert len(calls) == cfg.n_layer
