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
