"""BatchSampler and Prefetcher: windows, determinism, state round trip, process slices, prefetch state."""

import json
import threading
import time

import numpy as np
import pytest

from jaxgpt.data import BatchSampler, Prefetcher

N, B, T = 5000, 8, 16


@pytest.fixture
def tokens():
    return np.random.default_rng(0).integers(0, 60000, size=N).astype(np.uint16)


def test_windows_shapes_and_shift(tokens):
    s = BatchSampler(tokens, B, T, seed=1)
    x, y = s.next()
    assert x.shape == y.shape == (B, T) and x.dtype == y.dtype == np.int32
    np.testing.assert_array_equal(x[:, 1:], y[:, :-1])
    for row, start in zip(x, s.starts(0)):
        np.testing.assert_array_equal(row, tokens[start : start + T])
        assert 0 <= start <= N - T - 1
    assert s.step == 1


def test_batches_depend_on_seed_and_step_only(tokens):
    a, b, c = (BatchSampler(tokens, B, T, seed=s) for s in (3, 3, 4))
    xa = [a.next()[0] for _ in range(3)]
    xb = [b.next()[0] for _ in range(3)]
    xc = [c.next()[0] for _ in range(3)]
    for u, v, w in zip(xa, xb, xc):
        np.testing.assert_array_equal(u, v)
        assert not np.array_equal(u, w)
    assert not np.array_equal(xa[0], xa[1])
    np.testing.assert_array_equal(a.batch(1)[0], xa[1])  # batch(step) is pure: no state change
    assert a.step == 3


def test_state_round_trip_gives_the_next_batches(tokens):
    s = BatchSampler(tokens, B, T, seed=7)
    for _ in range(3):
        s.next()
    state = json.loads(json.dumps(s.state_dict()))
    expected = [s.next() for _ in range(2)]
    r = BatchSampler(tokens, B, T, seed=0)  # a fresh sampler, any seed: the state brings its own
    r.load_state_dict(state)
    for (x, y), (ex, ey) in zip((r.next() for _ in range(2)), expected):
        np.testing.assert_array_equal(x, ex)
        np.testing.assert_array_equal(y, ey)


@pytest.mark.parametrize("count", [2, 4, 8])
def test_process_slices_union_is_the_global_batch(tokens, count):
    full = BatchSampler(tokens, B, T, seed=5)
    parts = [BatchSampler(tokens, B, T, seed=5, process_index=i, process_count=count) for i in range(count)]
    for step in (0, 1, 17):
        gx, gy = full.batch(step)
        local = [p.batch(step) for p in parts]
        assert all(x.shape == (B // count, T) for x, _ in local)
        np.testing.assert_array_equal(np.concatenate([x for x, _ in local]), gx)
        np.testing.assert_array_equal(np.concatenate([y for _, y in local]), gy)


def test_resume_on_another_process_count(tokens):
    one = BatchSampler(tokens, B, T, seed=2)
    one.next()
    two = [BatchSampler(tokens, B, T, seed=2, process_index=i, process_count=2) for i in range(2)]
    for p in two:
        p.load_state_dict(one.state_dict())
    np.testing.assert_array_equal(np.concatenate([p.next()[0] for p in two]), one.next()[0])


def test_memmap_gives_the_same_batches(tokens, tmp_path):
    f = tmp_path / "t.bin"
    tokens.tofile(f)
    mm = np.memmap(f, dtype=np.uint16, mode="r")
    a, b = BatchSampler(tokens, B, T, seed=9), BatchSampler(mm, B, T, seed=9)
    assert b._file is not None  # mapped afresh per batch
    for _ in range(3):
        np.testing.assert_array_equal(a.next()[0], b.next()[0])
    c = BatchSampler(mm[100:], B, T, seed=9)  # a slice of a map is read as it is
    assert c._file is None
    np.testing.assert_array_equal(c.batch(0)[0][0], tokens[100:][c.starts(0)[0] :][:T])


def test_errors(tokens):
    with pytest.raises(ValueError, match="not divisible"):
        BatchSampler(tokens, 6, T, seed=0, process_count=4)
    with pytest.raises(ValueError, match="fewer than block_size \\+ 1"):
        BatchSampler(tokens[:T], B, T, seed=0)
    BatchSampler(tokens[: T + 1], B, T, seed=0).next()  # exactly enough
    with pytest.raises(ValueError, match="process_index"):
        BatchSampler(tokens, B, T, seed=0, process_index=2, process_count=2)
    with pytest.raises(ValueError, match="1-D"):
        BatchSampler(tokens.reshape(50, -1), B, T, seed=0)
    s = BatchSampler(tokens, B, T, seed=0)
    with pytest.raises(ValueError, match="block_size=16"):
        BatchSampler(tokens, B, 32, seed=0).load_state_dict(s.state_dict())


def test_prefetcher_yields_in_order_and_tracks_the_consumed_state(tokens):
    ref = BatchSampler(tokens, B, T, seed=11)
    s = BatchSampler(tokens, B, T, seed=11)
    with Prefetcher(s, size=3) as p:
        assert p.state_dict()["step"] == 0
        for i in range(4):
            x, y = next(p)
            rx, ry = ref.next()
            np.testing.assert_array_equal(x, rx)
            assert p.state_dict()["step"] == i + 1
        saved = p.state_dict()
        deadline = time.monotonic() + 10  # the producer thread may not have been scheduled yet
        while s.step <= saved["step"] and time.monotonic() < deadline:
            time.sleep(0.01)
        assert s.step > saved["step"]  # the sampler itself ran ahead
    r = BatchSampler(tokens, B, T, seed=0)
    r.load_state_dict(saved)
    np.testing.assert_array_equal(r.next()[0], ref.next()[0])


def test_prefetcher_sources_errors_and_close():
    assert list(Prefetcher(iter(range(5)))) == [0, 1, 2, 3, 4]
    counter = iter(range(100))
    p = Prefetcher(lambda: next(counter) * 10, transform=lambda v: v + 1)
    assert [next(p) for _ in range(3)] == [1, 11, 21]
    p.close()
    assert not p._thread.is_alive()
    with pytest.raises(StopIteration):
        next(p)

    def broken():
        yield 1
        raise KeyError("boom")

    p = Prefetcher(broken())
    assert next(p) == 1
    with pytest.raises(KeyError, match="boom"):
        next(p)
    with pytest.raises(ValueError):
        Prefetcher(range(3), size=0)
    assert threading.active_count() < 20


# --- document-aligned windows (DocumentSampler, data.align="document") ---

SEP = 7  # the separator (end-of-text) id of these tests' corpora


def _documents(n_docs=300, seed=0, eot_first=True):
    """Tokens of n_docs documents of 1..40 tokens (ids 10..99, never SEP), each after a SEP (llm.c's layout),
    or each closed by one (jaxgpt's text bins) with `eot_first=False`."""
    rng = np.random.default_rng(seed)
    docs = [rng.integers(10, 100, size=rng.integers(1, 41)) for _ in range(n_docs)]
    parts = [p for d in docs for p in (([SEP], d) if eot_first else (d, [SEP]))]
    return np.concatenate(parts).astype(np.uint16)


@pytest.mark.parametrize("eot_first", [True, False], ids=["eot-before", "eot-after"])
def test_document_starts_are_the_separators_and_the_first_token(tmp_path, eot_first, monkeypatch):
    from jaxgpt.data import sampler as sampler_lib
    from jaxgpt.data import document_starts

    toks = _documents(eot_first=eot_first)
    want = np.flatnonzero(toks == SEP)
    want = want if toks[0] == SEP else np.concatenate([[0], want])
    monkeypatch.setattr(sampler_lib, "_STARTS_CHUNK", 97)  # many chunks, separators on their edges too
    path = tmp_path / "toks.bin"
    toks.tofile(path)
    mm = np.memmap(path, dtype=np.uint16, mode="r")
    got = document_starts(mm, SEP, cache=tmp_path / "starts.npy")
    assert got.dtype == np.int64
    np.testing.assert_array_equal(got, want)
    # cached: read back memory-mapped; another separator or length is computed afresh
    again = document_starts(mm, SEP, cache=tmp_path / "starts.npy")
    assert isinstance(again, np.memmap)
    np.testing.assert_array_equal(again, want)
    np.testing.assert_array_equal(document_starts(mm[:-5], SEP, cache=tmp_path / "starts.npy"),
                                  want[want < len(toks) - 5])
    other = document_starts(mm, 11, cache=tmp_path / "starts.npy")
    np.testing.assert_array_equal(other, np.concatenate([[0] if toks[0] != 11 else [], np.flatnonzero(toks == 11)]))
    # data prepared again with the same length and separator: another fingerprint (key) is computed afresh
    document_starts(mm, SEP, cache=tmp_path / "starts.npy", key="first")
    shuffled = np.random.default_rng(3).permutation(toks)
    shuffled.tofile(tmp_path / "toks2.bin")
    mm2 = np.memmap(tmp_path / "toks2.bin", dtype=np.uint16, mode="r")
    want2 = np.flatnonzero(shuffled == SEP)
    want2 = want2 if shuffled[0] == SEP else np.concatenate([[0], want2])
    np.testing.assert_array_equal(document_starts(mm2, SEP, cache=tmp_path / "starts.npy", key="second"), want2)


@pytest.mark.parametrize("eot_first", [True, False], ids=["eot-before", "eot-after"])
def test_document_windows_start_at_document_starts_for_every_seed_and_step(eot_first):
    from jaxgpt.data import DocumentSampler

    toks = _documents(eot_first=eot_first)
    starts = set(np.flatnonzero(toks == SEP).tolist()) | {0}
    drawn = set()
    for seed in range(4):
        s = DocumentSampler(toks, SEP, B, T, seed=seed)
        for step in range(0, 200, 7):
            x, y, seg = s.batch(step)
            at = s.starts(step)
            drawn |= set(at.tolist())
            assert set(at.tolist()) <= starts and (at <= len(toks) - T - 1).all()
            for row, a in zip(x, at):
                np.testing.assert_array_equal(row, toks[a : a + T])
            np.testing.assert_array_equal(x[:, 1:], y[:, :-1])
            # a window begins with its document's end-of-text token (or the array's first token) ...
            assert ((x[:, 0] == SEP) | (at == 0)).all()
            # ... and document ids count the separators: a new id exactly where one is
            assert seg.dtype == np.int32 and (np.diff(seg, axis=1) == (x[:, 1:] == SEP)).all()
            assert ((seg[:, 0] == 1) == (x[:, 0] == SEP)).all()
    assert len(drawn) > len(starts) // 2  # uniform over documents, not stuck on a few


def test_document_windows_resume_exactly_on_any_process_count():
    from jaxgpt.data import DocumentSampler

    toks = _documents()
    run = DocumentSampler(toks, SEP, B, T, seed=3)
    want = [run.next() for _ in range(6)]
    first = DocumentSampler(toks, SEP, B, T, seed=3)
    for _ in range(2):
        first.next()
    state = json.loads(json.dumps(first.state_dict()))
    for count in (1, 2, 4):
        parts = [DocumentSampler(toks, SEP, B, T, seed=0, process_index=i, process_count=count) for i in range(count)]
        for p in parts:
            p.load_state_dict(state)
        for step in range(2, 6):
            got = [p.next() for p in parts]
            for k in range(3):
                np.testing.assert_array_equal(np.concatenate([g[k] for g in got]), want[step][k])


def test_document_sampler_refusals_and_options():
    from jaxgpt.data import DocumentSampler

    toks = _documents()
    plain = DocumentSampler(toks, SEP, B, T, seed=1, segments=False)
    assert len(plain.batch(0)) == 2
    with pytest.raises(ValueError, match=r"1 document\(s\) start a whole window"):
        DocumentSampler(np.full(100, 12, np.uint16), SEP, B, T, seed=1)
    with pytest.raises(ValueError, match="align='document' but this sampler has align='random'"):
        BatchSampler(toks, B, T, seed=1).load_state_dict(plain.state_dict())
    with pytest.raises(ValueError, match="align='random' but this sampler has align='document'"):
        plain.load_state_dict(BatchSampler(toks, B, T, seed=1).state_dict())
    with pytest.raises(ValueError, match="separator=8"):
        plain.load_state_dict({**plain.state_dict(), "separator": 8})
    # every window covers its document's first T + 1 tokens: a long document's rest is never seen
    long_doc = np.concatenate([[SEP], np.full(50, 20), [SEP], np.full(30, 21)]).astype(np.uint16)
    assert DocumentSampler(long_doc, SEP, 2, T, seed=0).coverage() == pytest.approx(2 * (T + 1) / len(long_doc))
