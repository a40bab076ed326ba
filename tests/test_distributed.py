"""Scale-out: FSDP over the device mesh, and training on two processes through jax.distributed.

The two-process tests start two `jaxgpt-train` processes on localhost (tests/dist_worker.py), each
with two fake CPU devices and gloo collectives, and compare them with this process's four devices.
"""

import json
import os
import socket
import subprocess
import sys
import time

import jax
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from jaxgpt import GPTConfig, init_params
from jaxgpt.checkpoint import Checkpointer, existing_steps
from jaxgpt.training.config import default_config, validate_config
from jaxgpt.distributed import initialize, wanted
from jaxgpt.training import create_train_state, make_optimizer, train
from jaxgpt.training.parallel import fsdp_spec
from tests.helpers import assert_same_training, tiny_config
from tests.xla_flags import with_devices

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WORKER = os.path.join("tests", "dist_worker.py")
HEARTBEAT_S = 10
TOL = 1e-6  # parameters and optimizer state: absolute; losses (about 3.5): relative, a few float32 ulps


# ---------------------------------------------------------------------------------------------------
# helpers


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _flat(config) -> dict:
    """A config's values as {"section.key": value}, leaving out unset (None) ones."""
    out = {}
    for k, v in config.to_dict().items():
        for kk, vv in (v.items() if isinstance(v, dict) else [(None, v)]):
            if vv is not None:
                out[k if kk is None else f"{k}.{kk}"] = vv
    return out


def _run_two(tmp_path, config, timeout=240, fail_at=None, heartbeat_s=HEARTBEAT_S):
    """Run `config` as two processes; returns ([returncode, ...], [output, ...], [exit time, ...]).

    A process that exits with an error is given heartbeat_s + 30 s for the other to stop by itself
    (JAX's coordination service takes it down); then, as on the overall timeout, whatever is left is
    killed by PID.
    """
    tmp_path.mkdir(parents=True, exist_ok=True)
    cfg_json = tmp_path / "worker_config.json"
    cfg_json.write_text(json.dumps(_flat(config)))
    env = dict(os.environ, JAXGPT_TEST_CONFIG=str(cfg_json), JAX_PLATFORMS="cpu",
               XLA_FLAGS=with_devices(2), PYTHONUNBUFFERED="1")
    env.pop("JAXGPT_TEST_FAIL_AT", None)
    if fail_at:
        env["JAXGPT_TEST_FAIL_AT"] = fail_at
    port = _free_port()
    procs, logs = [], []
    t0 = time.time()
    try:
        for i in range(2):
            log = open(tmp_path / f"worker{i}.log", "w+")
            logs.append(log)
            cmd = [sys.executable, WORKER, f"--config={WORKER}",
                   f"--config.distributed.coordinator_address=127.0.0.1:{port}",
                   "--config.distributed.num_processes=2", f"--config.distributed.process_id={i}",
                   f"--config.distributed.heartbeat_timeout_s={heartbeat_s}",
                   "--config.distributed.initialization_timeout_s=60"]
            procs.append(subprocess.Popen(cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT))
        ended = [None, None]
        deadline = t0 + timeout
        while None in ended and time.time() < deadline:
            for i, p in enumerate(procs):
                if ended[i] is None and p.poll() is not None:
                    ended[i] = time.time() - t0
                    if p.returncode != 0:
                        deadline = min(deadline, time.time() + heartbeat_s + 30)
            time.sleep(0.1)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()  # by PID: only the processes this test started
            p.wait()
    outputs = []
    for log in logs:
        log.seek(0)
        outputs.append(log.read())
        log.close()
    return [p.returncode for p in procs], outputs, ended


def _losses(out_dir) -> dict:
    with open(os.path.join(out_dir, "metrics.jsonl")) as f:
        return {r["step"]: r["loss"] for r in map(json.loads, f) if "loss" in r}


def _restore(out_dir, step):
    """A run's checkpoint `step` on this process's first device: (state, meta)."""
    from jaxgpt.checkpoint import abstract_like

    ck = Checkpointer(out_dir, read_only=True)
    try:
        meta = ck.restore_meta(step)
        cfg = GPTConfig.from_dict(meta["model"])
        from ml_collections import config_dict
        tcfg = config_dict.ConfigDict(meta["config"]["train"])
        opt = make_optimizer(tcfg)
        template = jax.eval_shape(lambda: create_train_state(init_params(cfg, jax.random.key(0)), opt,
                                                             jax.random.key(1)))
        state, meta = ck.restore(abstract_like(template), step)
    finally:
        ck.close()
    return state, meta


def _loss_diff(a: dict, b: dict, steps) -> float:
    """Largest relative difference of two runs' losses at `steps`."""
    return max(abs(a[k] - b[k]) / max(1.0, abs(b[k])) for k in steps)


# ---------------------------------------------------------------------------------------------------
# configuration


def test_distributed_config_validation_and_auto_mode(monkeypatch):
    c = default_config()
    for var in ("JAX_COORDINATOR_ADDRESS", "SLURM_JOB_ID", "OMPI_MCA_orte_hnp_uri"):
        monkeypatch.delenv(var, raising=False)
    assert not wanted(c.distributed)  # nothing set, no cluster here: one process
    c.distributed.num_processes = 2
    assert wanted(c.distributed)
    c.distributed.enabled = False
    assert not wanted(c.distributed)
    for key, value, match in [("coordinator_address", "10.0.0.1", "HOST:PORT"), ("process_id", 2, "process_id"),
                              ("num_processes", 0, "num_processes"), ("heartbeat_timeout_s", 0, "heartbeat")]:
        c = default_config()
        c.distributed.num_processes = 2
        c.distributed[key] = value
        with pytest.raises(ValueError, match=match):
            validate_config(c)
    # asked for after JAX has started (as in this test process): a clear error, not JAX's own
    c = default_config()
    c.distributed.coordinator_address, c.distributed.num_processes, c.distributed.process_id = "127.0.0.1:1", 2, 0
    jax.devices()
    with pytest.raises(RuntimeError, match="before any other JAX call"):
        initialize(c)
    c = default_config()
    c.train.fsdp = True
    with pytest.raises(ValueError, match="train.fsdp"):
        validate_config(c)  # pmap cannot shard the state
    c.train.parallel = "mesh"
    validate_config(c)


# ---------------------------------------------------------------------------------------------------
# One-process reference runs on this process's four devices, shared by the tests below.

# mode -> (train.parallel, train.fsdp, train.mesh); "mesh-dcn": the dcn axis across the two processes, the
# state sharded over each process's own devices
MODES = {"pmap": ("pmap", False, ""), "mesh": ("mesh", False, ""), "mesh-fsdp": ("mesh", True, ""),
         "mesh-dcn": ("mesh", False, "dcn=2,fsdp=-1"), "pmap-shards": ("pmap", False, "")}


def _config(root, mode, out, **train_kw):
    parallel, fsdp, mesh = MODES[mode]
    kw = dict(max_steps=5, decay_steps=10, warmup_steps=2, log_interval=1, eval_interval=100, eval_steps=1,
              checkpoint_interval=3, peak_flops=1e9, parallel=parallel, fsdp=fsdp, mesh=mesh)
    kw.update(train_kw)
    c = tiny_config(root, **kw)
    c.model.n_layer = 1
    c.out_dir = str(root / out)
    if mode.endswith("-shards"):  # llm.c's shards: each process reads its own rows of the global batch
        c.data.corpus, c.data.path, c.data.tokenizer = "shards", str(_shards(root / "shards")), "byte"
    return c


def _shards(folder):
    """Three tiny llm.c shards (a writer from the format's description: 256 int32 of header, uint16 ids)."""
    if not folder.exists():
        rng = np.random.default_rng(0)
        folder.mkdir()
        for name in ("t_val_000000.bin", "t_train_000001.bin", "t_train_000002.bin"):
            ids = rng.integers(0, 256, size=500)
            header = np.zeros(256, dtype="<i4")
            header[:3] = 20240520, 1, ids.size
            (folder / name).write_bytes(header.tobytes() + ids.astype("<u2").tobytes())
    return folder


@pytest.fixture(scope="module")
def one_process(tmp_path_factory):
    """mode -> (config, summary) of a 5-step run here, with checkpoints at steps 3 and 5."""
    root = tmp_path_factory.mktemp("dist")
    runs = {}

    def get(mode):
        if mode not in runs:
            c = _config(root, mode, f"one-{mode}")
            runs[mode] = (c, train(c))
        return runs[mode]

    get.root = root
    return get


# ---------------------------------------------------------------------------------------------------
# FSDP


def test_fsdp_spec():
    assert fsdp_spec((50, 32), 4) == P(None, "fsdp") and fsdp_spec((128, 32), 4) == P("fsdp")
    assert fsdp_spec((32, 128), 4) == P(None, "fsdp") and fsdp_spec((12, 12), 4, "data") == P("data")
    assert fsdp_spec((3, 5), 4) == P() and fsdp_spec((), 4) == P() and fsdp_spec((8,), 1) == P()


def test_fsdp_shards_params_and_equals_replicated_training(one_process):
    assert jax.device_count() == 4
    c_rep, s_rep = one_process("mesh")
    c_fsdp, s_fsdp = one_process("mesh-fsdp")
    # the state train() ends with is sharded: every parameter and Adam moment here has a dimension
    # divisible by 4, and each device holds a quarter of it; scalars (step, count, rng) are replicated
    state = s_fsdp["state"]
    for tree in (state.params, state.opt_state):
        for x in jax.tree_util.tree_leaves(tree):
            if x.ndim:
                assert "fsdp" in x.sharding.spec, (x.shape, x.sharding)  # (train.fsdp: the mesh 'fsdp=-1')
                assert x.addressable_shards[0].data.size * 4 == x.size
    assert state.params["h_0"]["mlp"]["c_fc"]["kernel"].sharding.spec == P(None, "fsdp")  # (32, 128)
    assert state.step.sharding.spec == P() and state.rng.sharding.spec == P()
    assert all(x.sharding.is_fully_replicated for x in jax.tree_util.tree_leaves(s_rep["state"]))
    # and trains as the replicated run does: losses of the first 3 steps, state after 3 steps
    rep, fsdp = _losses(c_rep.out_dir), _losses(c_fsdp.out_dir)
    loss_diff = _loss_diff(fsdp, rep, (1, 2, 3))
    print(f"fsdp vs replicated after 3 steps: max rel. loss diff {loss_diff:.2e}")
    assert loss_diff <= TOL
    assert_same_training(_restore(c_fsdp.out_dir, 3)[0], _restore(c_rep.out_dir, 3)[0], TOL, "fsdp")


# ---------------------------------------------------------------------------------------------------
# two processes


@pytest.mark.slow
# ("mesh": "mesh-dcn" is its data axis; "pmap-shards": llm.c's shards, each process reading its own rows)
@pytest.mark.parametrize("mode", ["pmap", "mesh-fsdp", "mesh-dcn", "pmap-shards"])
def test_two_processes_match_one_process_and_resume_here(one_process, mode):
    root = one_process.root
    c = _config(root, mode, f"two-{mode}", max_steps=3)
    rcs, outs, _ = _run_two(root / f"workers-{mode}", c)
    assert rcs == [0, 0], f"process 0:\n{outs[0][-3000:]}\nprocess 1:\n{outs[1][-3000:]}"
    assert "on 2 processes" in outs[0] and "jaxgpt-train: done at step 3" in outs[0]
    # only process 0 prints ...
    assert "jaxgpt:" not in outs[1] and "jaxgpt-train" not in outs[1] and "step      1 |" not in outs[1]
    with open(os.path.join(c.out_dir, "metrics.jsonl")) as f:
        records = [json.loads(line) for line in f]
    assert [r["step"] for r in records] == [1, 2, 3, 3]  # ... and writes metrics: 3 steps and 1 eval, once
    assert existing_steps(c.out_dir) == [3]

    ref, _ = one_process(mode)
    two, one = _losses(c.out_dir), _losses(ref.out_dir)
    assert sorted(two) == [1, 2, 3]
    loss_diff = _loss_diff(two, one, (1, 2, 3))
    state_two, meta = _restore(c.out_dir, 3)
    state_one, _ = _restore(ref.out_dir, 3)
    assert int(state_two.step) == 3 and meta["sampler"]["step"] == 3
    print(f"{mode}: two processes vs one: max rel. loss diff {loss_diff:.2e}")
    assert loss_diff <= TOL
    assert_same_training(state_two, state_one, TOL, mode)

    # the two-process checkpoint restores on this one process and continues as the one-process run did
    c.init_from = "resume"
    c.train.max_steps = 5
    s = train(c)
    assert s["start_step"] == 3 and s["steps"] == 5
    resumed = _losses(c.out_dir)
    assert sorted(resumed) == [1, 2, 3, 4, 5]
    assert _loss_diff(resumed, one, (4, 5)) <= TOL


@pytest.mark.slow
def test_a_failing_process_takes_the_other_down(tmp_path):
    c = _config(tmp_path, "mesh", "two", max_steps=1000, checkpoint_interval=1000)
    heartbeat_s = 5  # (the test waits for it to run out)
    rcs, outs, ended = _run_two(tmp_path, c, fail_at="1:1", heartbeat_s=heartbeat_s)
    assert rcs[1] not in (0, None) and "injected failure in process 1 at step 1" in outs[1], outs[1][-3000:]
    assert "exiting now so that the other processes stop too" in outs[1]
    # process 0 stops by itself (this test did not kill it) soon after process 1's heartbeats stop
    assert rcs[0] not in (0, None, -9) and ended[0] is not None, outs[0][-3000:]
    assert ended[0] - ended[1] <= heartbeat_s + 25, ended
    assert "unhealthy" in outs[0] or "another task died" in outs[0], outs[0][-3000:]
