"""The native CPU kernels' library in $JAXGPT_CACHE/kernels: checked against its record before it is loaded."""

import os
import subprocess
import sys

import pytest

from jaxgpt.backends import native


def test_a_native_library_cut_short_is_built_again_with_one_warning_instead_of_crashing(tmp_path):
    """A .so cut short (a full disk, an interrupted copy) killed every later process with SIGBUS on load;
    now it is checked against the size and SHA-256 recorded beside it, and built again."""
    if not native.available():
        pytest.skip(f"the native kernel cannot be built here: {native._state.get('why')}")
    good = native._build()  # this session's library, in the default cache
    kernels_dir = tmp_path / "kernels"
    kernels_dir.mkdir()
    cut = kernels_dir / os.path.basename(good)
    with open(good, "rb") as f:
        cut.write_bytes(f.read()[: os.path.getsize(good) // 2])
    if os.path.exists(good + ".json"):
        (kernels_dir / (cut.name + ".json")).write_bytes(open(good + ".json", "rb").read())
    env = {**os.environ, "JAXGPT_CACHE": str(tmp_path)}
    # the rebuild at -O0: what is tested is that the cut library is found out, rebuilt and loaded (an -O3
    # build takes ~10 s of the suite's time)
    code = ("import subprocess\n_run = subprocess.run\n"
            "subprocess.run = lambda cmd, *a, **k: _run(['-O0' if c == '-O3' else c for c in cmd], *a, **k)\n"
            "from jaxgpt.backends import native\nprint(native.available())\n")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, (out.returncode, out.stderr[-2000:])  # not -7 (SIGBUS)
    assert out.stdout.split() == ["True"]
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and "is not the one built" in lines[0] and "cut short" in lines[0], out.stderr
    assert native._damage(str(cut)) is None  # rebuilt whole, and recorded


def test_a_native_library_that_differs_from_its_record_is_not_trusted(tmp_path):
    lib = tmp_path / "jaxgpt-x.so"
    lib.write_bytes(b"\x7fELF" + bytes(100))
    assert "no readable record" in native._damage(str(lib))
    with open(native._record_path(str(lib)), "w") as f:
        f.write('{"size": 104, "sha256": "%s"}' % native._digest(str(lib))["sha256"])
    assert native._damage(str(lib)) is None
    lib.write_bytes(b"\x7fELF" + bytes(99) + b"\x01")  # same size, one byte changed
    assert "SHA-256" in native._damage(str(lib))
    lib.write_bytes(b"\x7fELF")
    assert "4 bytes, 104 were built" in native._damage(str(lib))
