"""Profiling (train.profile = "START:STOP", jaxgpt/training/profiling.py): the trace lands in the run folder,
holds the train step's program and exactly the window's steps, each annotated with its number."""

import glob
import gzip
import json
import os

import pytest

from jaxgpt.training import profiling
from tests.helpers import tiny_config


def _trace(folder):
    (xplane,) = glob.glob(os.path.join(folder, "plugins", "profile", "*", "*.xplane.pb"))
    (events,) = glob.glob(os.path.join(folder, "plugins", "profile", "*", "*.trace.json.gz"))
    with gzip.open(events) as f:
        return open(xplane, "rb").read(), json.load(f)["traceEvents"]


@pytest.mark.parametrize("steps_per_call", [1, 3])
def test_a_profiled_window_holds_the_train_step_and_only_its_steps(tmp_path, steps_per_call, capsys):
    from jaxgpt.training import train

    c = tiny_config(tmp_path, max_steps=7, eval_interval=7, checkpoint_interval=7, profile="2:4",
                    steps_per_call=steps_per_call)
    summary = train(c)
    assert summary["steps"] == 7
    folder = os.path.join(c.out_dir, "profile")
    xplane, events = _trace(folder)
    assert b"make_train_step.<locals>.train_step" in xplane  # the compiled step's ops, by their source
    steps = sorted(int(e["args"]["step_num"]) for e in events if e.get("name") == "train")
    # a call of several steps is cut at the window's ends (steps 0-1, 2-3, 4-6): one annotation per call
    assert steps == ([2, 3] if steps_per_call == 1 else [2])
    assert f"jaxgpt: profiling steps 2 to 3 into {folder}" in capsys.readouterr().out


@pytest.mark.parametrize("spec, match", [("3", "must be 'START:STOP'"), ("a:b", "must be 'START:STOP'"),
                                         ("4:4", "needs 0 <= START < STOP"), ("-1:2", "needs 0 <= START < STOP")])
def test_a_bad_window_is_refused_naming_the_key(spec, match):
    with pytest.raises(ValueError, match="config.train.profile: " + match):
        profiling.parse_window(spec)


def test_a_window_past_the_run_is_refused(tmp_path):
    from jaxgpt.training.config import validate_config

    c = tiny_config(tmp_path, max_steps=5, profile="5:7")
    with pytest.raises(ValueError, match=r"config.train.profile: START must be below train.max_steps \(5\)"):
        validate_config(c)
    assert profiling.parse_window("") is None and profiling.bounds("1:3") == (1, 3)
