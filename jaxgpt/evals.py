"""Multiple-choice evaluation (HellaSwag and the like): each choice scored by the model's loss over its
tokens after the context, the item right when its gold choice has the least loss.

Task files are local JSON Lines, one item a line, in HellaSwag's own form (`ctx`, `endings`, `label`; its
other fields ignored unless the style reads them) or a generic one (`context`, `choices`, `label`, each
choice appended to the context exactly as written). Two scorings, so that a run compares with either
published column:

- "llmc" (the default), llm.c's: the context, then " " + ending (HellaSwag) or the choice (generic), each
  tokenized on its own; acc: the least summed loss over the continuation's tokens; acc_norm: the least mean
  loss per continuation token.
- "lm_eval", lm-evaluation-harness's: HellaSwag's text preprocessed as its hellaswag task does (the
  activity label before the context, WikiHow's bracketed markup dropped), the pair tokenized whole and
  split where the context's tokens end; acc_norm: the least summed loss per character of the choice
  (lm-eval's `acc_norm`, which its docs call byte-length normalisation: the same on ASCII text).

llm.c's own evaluation file (`hellaswag_val.bin`, written by its dev/data/hellaswag.py) is read too: its
items are GPT-2 token ids already (the context's, and each ending's with its leading space), scored as
they are in style "llmc" (`read_llmc_bin`).

Scoring is batched: every (item, choice) row padded to one of a few lengths (powers of two up to the
model's window), a fixed number of rows a call, one jitted forward per shape; the rows are split over
the devices of a mesh (data parallel; by default all of JAX's devices). A context longer than the window
is cut from the left.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import os
import re
import time
from typing import Any, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from jaxgpt.config import GPTConfig

STYLES = ("llmc", "lm_eval")


@dataclasses.dataclass(frozen=True)
class Item:
    """One question: the context, each choice's continuation text as appended to it, the gold index, and
    the per-choice lengths that lm-eval's acc_norm divides by (None: llm.c's mean per token). An item of
    token ids (llm.c's .bin file) has `ids`, (context ids, (each continuation's ids, ...)), its texts empty."""
    context: str
    continuations: tuple[str, ...]
    label: int
    norm_lengths: Optional[tuple[float, ...]] = None
    ids: Optional[tuple[tuple[int, ...], tuple[tuple[int, ...], ...]]] = None


def lm_eval_preprocess(text: str) -> str:
    """HellaSwag's text as lm-eval's hellaswag task cleans it: stripped, WikiHow's " [title]" made a sentence
    break, other bracketed markup ("[header]", "[step]") dropped, doubled spaces halved once."""
    text = text.strip().replace(" [title]", ". ")
    text = re.sub(r"\[[^\]]*?\]", "", text)  # (the shortest bracketed span, as a non-greedy match takes)
    return text.replace("  ", " ")


def _hellaswag_item(row: dict, style: str) -> Item:
    endings = [str(e) for e in row["endings"]]
    if style == "llmc":
        return Item(str(row["ctx"]), tuple(" " + e for e in endings), int(row["label"]))
    if all(k in row for k in ("activity_label", "ctx_a", "ctx_b")):
        query = f"{row['activity_label']}: {row['ctx_a']} {str(row['ctx_b']).capitalize()}"
    else:  # (a file without HellaSwag's parts: its ctx alone)
        query = str(row["ctx"])
    choices = [lm_eval_preprocess(e) for e in endings]
    return Item(lm_eval_preprocess(query), tuple(" " + c for c in choices), int(row["label"]),
                tuple(float(len(c)) for c in choices))


def _generic_item(row: dict, style: str) -> Item:
    choices = tuple(str(c) for c in row["choices"])
    norm = tuple(float(len(c)) for c in choices) if style == "lm_eval" else None
    return Item(str(row["context"]), choices, int(row["label"]), norm)


def parse_item(row: Any, style: str = "llmc") -> Item:
    """An Item from one decoded JSON line (HellaSwag's form or the generic one); ValueError saying why not."""
    if style not in STYLES:
        raise ValueError(f"style must be one of {STYLES}, got {style!r}")
    if not isinstance(row, dict):
        raise ValueError(f"an item must be a JSON object, got {type(row).__name__}")
    if "endings" in row and "ctx" in row:
        item, n = _hellaswag_item(row, style), len(row["endings"])
    elif "choices" in row and "context" in row:
        item, n = _generic_item(row, style), len(row["choices"])
    else:
        raise ValueError(f"an item needs 'ctx' and 'endings' (HellaSwag) or 'context' and 'choices', has "
                         f"{sorted(row)}")
    if n < 2 or not 0 <= item.label < n:
        raise ValueError(f"label {item.label} is not one of the item's {n} choices (0..{n - 1}; at least 2)")
    return item


LLMC_EVAL_MAGIC, LLMC_EVAL_VERSION, LLMC_DELIMITER = 20240522, 1, 2 ** 16 - 1


def _llmc_record(rec: np.ndarray) -> Item:
    """The Item of one .bin record's uint16 fields: delimiter, its size in bytes, example index, label,
    number of completions, then the context's length and ids, then each completion's length and ids."""
    label, n = int(rec[3]), int(rec[4])
    fields, pos = [], 5
    for _ in range(n + 1):
        if pos >= len(rec) or pos + 1 + int(rec[pos]) > len(rec):
            raise ValueError("its token lists run past the record's size")
        length = int(rec[pos])
        fields.append(tuple(int(t) for t in rec[pos + 1:pos + 1 + length]))
        pos += 1 + length
    if pos != len(rec):
        raise ValueError(f"its token lists fill {2 * pos} of its {2 * len(rec)} bytes")
    if n < 2 or not 0 <= label < n:
        raise ValueError(f"label {label} is not one of its {n} completions (0..{n - 1}; at least 2)")
    return Item("", ("",) * n, label, None, (fields[0], tuple(fields[1:])))


def read_llmc_bin(path: str, limit: Optional[int] = None) -> list[Item]:
    """The first `limit` (None: all) items of llm.c's multiple-choice file (hellaswag_val.bin): a header of
    256 int32 (magic 20240522, version 1, number of examples, longest example in bytes, ...), then each
    example a record of uint16 (`_llmc_record`). ValueError naming the file (and example) otherwise."""
    raw = open(path, "rb").read()
    header = np.frombuffer(raw[:1024], "<i4") if len(raw) >= 1024 else np.zeros(3, np.int32)
    if header[0] != LLMC_EVAL_MAGIC or header[1] != LLMC_EVAL_VERSION:
        raise ValueError(f"{path} is no llm.c evaluation file (magic {LLMC_EVAL_MAGIC}, version "
                         f"{LLMC_EVAL_VERSION}): its header starts {header[:2].tolist()}")
    data = np.frombuffer(raw[1024:len(raw) - len(raw) % 2], "<u2")
    count = int(header[2]) if limit is None else min(int(header[2]), limit)
    items, at = [], 0
    for k in range(count):
        if at + 5 > len(data) or data[at] != LLMC_DELIMITER or data[at + 1] % 2 or data[at + 1] < 10:
            raise ValueError(f"{path} example {k}: no record starts at byte {1024 + 2 * at} (the file holds fewer "
                             f"than its header's {header[2]} examples, or is damaged)")
        rec = data[at:at + int(data[at + 1]) // 2]
        try:
            items.append(_llmc_record(rec))
        except ValueError as e:
            raise ValueError(f"{path} example {k}: {e}") from None
        at += len(rec)
    if not items:
        raise ValueError(f"task file {path} holds no items")
    return items


def check_vocab(tasks: dict, vocab_size: int) -> None:
    """ValueError naming the task of an item of token ids (llm.c's .bin) with an id past `vocab_size`: a
    model that is not GPT-2's vocabulary cannot score it (checked before a run starts, not at its first eval)."""
    for name, items in tasks.items():
        for k, item in enumerate(items):
            if item.ids is not None:
                top = max(max(item.ids[0], default=0), *(max(c, default=0) for c in item.ids[1]))
                if top >= vocab_size:
                    raise ValueError(f"task {name} item {k} has token id {top}, past the model's vocabulary "
                                     f"({vocab_size} ids); llm.c's .bin files hold GPT-2 token ids")


def read_task(path: str, style: str = "llmc", limit: Optional[int] = None) -> list[Item]:
    """The first `limit` (None: all) items of a JSON Lines task file (or of llm.c's .bin file); ValueError
    naming the file and line of one that does not parse."""
    path = os.path.expanduser(path)
    if not os.path.isfile(path):
        raise ValueError(f"task file {path} does not exist; give local JSON Lines files (HellaSwag's form or "
                         '{"context", "choices", "label"}) or llm.c\'s hellaswag_val.bin')
    if path.endswith(".bin"):
        if style != "llmc":
            raise ValueError(f"{path}: llm.c's .bin file holds GPT-2 token ids, scored in style llmc only, not {style}")
        return read_llmc_bin(path, limit)
    items = []
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if limit is not None and len(items) >= limit:
                break
            if not line.strip():
                continue
            try:
                items.append(parse_item(json.loads(line), style))
            except (ValueError, KeyError, TypeError) as e:
                raise ValueError(f"{path} line {n}: {e}") from None
    if not items:
        raise ValueError(f"task file {path} holds no items")
    return items


def task_name(path: str) -> str:
    """The name a task's scores go under: its file's stem (hellaswag_val.jsonl -> hellaswag_val)."""
    base = os.path.basename(path)
    return base[:-len(".jsonl")] if base.endswith(".jsonl") else os.path.splitext(base)[0]


def encode_pair(tokenizer, context: str, continuation: str, style: str) -> tuple[list[int], list[int]]:
    """(context ids, continuation ids). llmc: each encoded on its own. lm_eval: trailing spaces of the
    context moved to the continuation, the whole encoded and split after the context's own ids."""
    if style == "llmc":
        return tokenizer.encode(context), tokenizer.encode(continuation)
    stripped = context.rstrip()
    context, continuation = stripped, context[len(stripped):] + continuation
    ctx = tokenizer.encode(context)
    return ctx, tokenizer.encode(context + continuation)[len(ctx):]


def encode_items(items: Sequence[Item], tokenizer, style: str) -> list[list[tuple[list[int], list[int]]]]:
    """Per item, per choice: (context ids, continuation ids). An empty context becomes the end-of-text token."""
    out = []
    for i, item in enumerate(items):
        pairs = []
        for c, cont in enumerate(item.continuations):
            if item.ids is not None:  # token ids already (llm.c's .bin)
                ctx, ids = item.ids[0], item.ids[1][c]
            elif item.context:
                ctx, ids = encode_pair(tokenizer, item.context, cont, style)
            else:
                ctx, ids = [], tokenizer.encode(cont)
            if not ctx:
                if tokenizer.eos_id is None:
                    raise ValueError(f"item {i} has an empty context and the tokenizer no end-of-text token to "
                                     "stand for it; give the item a context")
                ctx = [tokenizer.eos_id]
            if not ids:
                raise ValueError(f"item {i}: choice {c} ({cont!r}) has no tokens")
            pairs.append((list(ctx), list(ids)))
        out.append(pairs)
    return out


def _row_losses(model, variables, x_RxL, y_RxL, m_RxL):
    """Each row's summed next-token loss over its masked positions (float32): [R]."""
    logits_RxLxV = model.apply(variables, x_RxL).astype(jnp.float32)
    nll_RxL = optax.softmax_cross_entropy_with_integer_labels(logits_RxLxV, y_RxL)
    return jnp.sum(nll_RxL * m_RxL, axis=1)


def _bucket(n: int, window: int, smallest: int = 16) -> int:
    """The padded length of a batch whose longest row has `n` inputs: a power of two, at most the window."""
    return min(window, max(smallest, 1 << (n - 1).bit_length()))


class Scorer:
    """Summed continuation losses of (context, continuation) token pairs under one model, batched.

    `variables` are what the model applies ({"params": ...}, LoRA's with "lora"), placed as the caller keeps
    them (replicated, or sharded over `mesh`); the rows of a batch go over `mesh`'s `axes` (default: a 1-D
    mesh of every device, the variables replicated onto it). `rows` per call, rounded up to a multiple of the
    devices that split them."""

    def __init__(self, variables, config: GPTConfig, *, backend=None, mesh: Optional[Mesh] = None,
                 axes: Sequence[str] = ("rows",), rows: int = 32):
        from jaxgpt.model import GPT

        if mesh is None:
            mesh = Mesh(np.array(jax.devices()), ("rows",))
            variables = jax.device_put(variables, NamedSharding(mesh, P()))
        self.variables, self.config, self.mesh = variables, config, mesh
        split = math.prod(mesh.shape[a] for a in axes)
        self.rows = -(-max(1, rows) // split) * split
        self.batch_sharding = NamedSharding(mesh, P(tuple(axes)))
        model = GPT(config, backend)
        self._fn = jax.jit(functools.partial(_row_losses, model), out_shardings=NamedSharding(mesh, P()))

    def score(self, pairs: Sequence[tuple[Sequence[int], Sequence[int]]]) -> tuple[np.ndarray, np.ndarray]:
        """(summed loss [N], tokens scored [N]) of each pair's continuation given its context, the pair
        cut from the left to the model's window (its continuation must fit in it)."""
        window = self.config.block_size
        seqs, conts = [], []
        for i, (ctx, cont) in enumerate(pairs):
            if len(cont) > window:
                raise ValueError(f"a continuation of {len(cont)} tokens does not fit the model's window "
                                 f"(block_size {window}); pair {i}")
            seqs.append((list(ctx) + list(cont))[-(window + 1):])  # T inputs and the last target
            conts.append(len(cont))
        order = sorted(range(len(seqs)), key=lambda i: -len(seqs[i]))  # similar lengths share a batch
        sums, counts = np.zeros(len(seqs)), np.array(conts, np.int64)
        for start in range(0, len(order), self.rows):
            idx = order[start:start + self.rows]
            length = _bucket(len(seqs[idx[0]]) - 1, window)
            x, y, m = (np.zeros((self.rows, length), dt) for dt in (np.int32, np.int32, np.float32))
            for r, i in enumerate(idx):
                s = seqs[i]
                x[r, :len(s) - 1], y[r, :len(s) - 1] = s[:-1], s[1:]
                m[r, len(s) - 1 - conts[i]:len(s) - 1] = 1.0
            put = functools.partial(jax.device_put, device=self.batch_sharding)
            out = self._fn(self.variables, put(x), put(y), put(m))
            sums[idx] = np.asarray(out.addressable_data(0), np.float64)[:len(idx)]
        return sums, counts


def item_losses(scorer: Scorer, tokenizer, items: Sequence[Item], style: str = "llmc",
                encoded: Optional[list] = None) -> list[tuple]:
    """Per item (summed losses [choices], tokens [choices]), all items' rows scored together; `encoded`:
    encode_items' result when the caller keeps it (the training loop encodes its tasks once)."""
    encoded = encode_items(items, tokenizer, style) if encoded is None else encoded
    sums, counts = scorer.score([pair for pairs in encoded for pair in pairs])
    out, at = [], 0
    for pairs in encoded:
        out.append((sums[at:at + len(pairs)], counts[at:at + len(pairs)]))
        at += len(pairs)
    return out


def accuracy(items: Sequence[Item], losses: Sequence[tuple]) -> dict:
    """{"acc", "acc_norm", "n"} from per-item (summed losses, token counts): acc by the least summed loss,
    acc_norm by the least loss per token (llmc) or per character of the choice (lm_eval's lengths)."""
    acc = norm = 0
    for item, (sums, counts) in zip(items, losses):
        per = np.asarray(item.norm_lengths if item.norm_lengths is not None else counts, np.float64)
        acc += int(np.argmin(sums)) == item.label  # (ties: the first, as lm-eval's and llm.c's argmax/argmin)
        norm += int(np.argmin(sums / per)) == item.label
    n = len(items)
    return {"acc": acc / n, "acc_norm": norm / n, "n": n}


def evaluate(scorer: Scorer, tokenizer, tasks: dict, style: str = "llmc", encoded: Optional[dict] = None) -> dict:
    """{task: {"acc", "acc_norm", "n", "seconds"}} for {task: [Item]} (`encoded`: {task: encode_items(...)})."""
    out = {}
    for name, items in tasks.items():
        t0 = time.perf_counter()
        pairs = None if encoded is None else encoded[name]
        scores = accuracy(items, item_losses(scorer, tokenizer, items, style, pairs))
        out[name] = {**scores, "seconds": time.perf_counter() - t0}
    return out


def parse_task_list(tasks) -> list[str]:
    """Task files from a comma-separated string or a list ([] for None or "")."""
    if tasks is None:
        return []
    if isinstance(tasks, str):
        tasks = tasks.split(",")
    if not isinstance(tasks, (list, tuple)) or not all(isinstance(t, str) for t in tasks):
        raise ValueError(f"tasks must be a comma-separated string or a list of task files, got {tasks!r}")
    paths = [t.strip() for t in tasks if t.strip()]
    names = [task_name(p) for p in paths]
    dup = sorted({n for n in names if names.count(n) > 1})
    if dup:
        raise ValueError(f"two task files share the name {dup[0]!r} (scores go under the file's stem); rename one")
    return paths


def read_tasks(paths: Sequence[str], style: str = "llmc", limit: Optional[int] = None) -> dict:
    """{task name: [Item]} of task files, the first `limit` items of each."""
    return {task_name(p): read_task(p, style, limit) for p in paths}
