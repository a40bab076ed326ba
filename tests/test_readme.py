"""The README's tour runs as written: its Python sampling and engine examples, one after the other."""

import jax
import jax.numpy as jnp

from tests.helpers import doc_example


def test_the_readme_tour_samples_and_serves_requests_as_written():
    ns = {}
    exec(doc_example("README.md", "Or from Python"), ns)
    cfg, params = ns["cfg"], ns["params"]
    assert ns["out"].tokens.shape == (2, 16) and ns["logits"].shape == (2, 16, cfg.vocab_size)
    exec(doc_example("README.md", "`jaxgpt.Engine` serves requests"), ns)
    outs = ns["outs"]
    assert [len(o.tokens) for o in outs] == [8, 8]
    # the greedy request alone through generate: the README's claim that the two agree
    import jaxgpt

    alone = jaxgpt.generate(params, cfg, jnp.asarray([[1, 2, 3]], jnp.int32), 8, jax.random.key(0), temperature=0)
    assert [int(t) for t in alone.tokens[0, 3:]] == [t.id for t in outs[0].tokens]
