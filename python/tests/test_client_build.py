"""The import-time check of the compiled client (gocomm/_client.py): an extension built for
another torch (version, C++ ABI, CUDA variant, as the build recorded them in lib/build.json)
or not built at all is refused at `import gocomm`, with the command that rebuilds it."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest

PKG = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "gocomm")


def _copy_package(tmp_path) -> str:
    """A copy of the built package (its extension and build record included, not pgserver)."""
    dst = tmp_path / "gocomm"
    shutil.copytree(PKG, dst, ignore=shutil.ignore_patterns("bin", "__pycache__"))
    return str(dst)


def _import(path: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=os.path.dirname(path))
    return subprocess.run([sys.executable, "-c", "import gocomm"], env=env, capture_output=True, text=True, timeout=120)


def test_the_built_client_matches_this_torch():
    from gocomm import _client

    _client.check()  # what `make` built in this checkout loads here


@pytest.mark.parametrize("field", ["torch", "cxx11_abi", "cuda"])
def test_each_recorded_field_is_checked(tmp_path, field):
    from gocomm import _client

    built = _client.running()
    built[field] = (not built[field]) if field == "cxx11_abi" else "0.0+elsewhere"
    record = tmp_path / "build.json"
    record.write_text(json.dumps(built))
    with pytest.raises(ImportError, match=rf"built for another torch \({field} .*make client"):
        _client.check(str(record))


def test_a_mismatched_build_is_refused_at_import(tmp_path):
    pkg = _copy_package(tmp_path)
    record = os.path.join(pkg, "lib", "build.json")
    with open(record) as f:
        built = json.load(f)
    built["torch"] = "1.0.0+elsewhere"
    with open(record, "w") as f:
        json.dump(built, f)
    r = _import(pkg)
    assert r.returncode != 0, r.stdout
    assert "ImportError" in r.stderr and "built for another torch" in r.stderr, r.stderr
    assert "1.0.0+elsewhere" in r.stderr and "make client" in r.stderr, r.stderr


def test_an_unbuilt_client_is_refused_at_import(tmp_path):
    pkg = _copy_package(tmp_path)
    os.remove(os.path.join(pkg, "lib", "build.json"))
    r = _import(pkg)
    assert r.returncode != 0
    assert "not built" in r.stderr and "make client" in r.stderr, r.stderr


CONFIG = os.path.join(os.path.dirname(PKG), os.pardir, "csrc", "config.py")


def _config(tmp_path, *args, python=sys.executable, env=None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [python, CONFIG, str(tmp_path / "config.mk"), *args],
        env=dict(os.environ, **(env or {})),
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_the_build_names_a_missing_compiler(tmp_path):
    r = _config(tmp_path, "no-such-g++")
    assert r.returncode != 0 and "no C++ compiler" in r.stderr and "no-such-g++" in r.stderr, r.stderr


def test_the_build_names_missing_cuda_headers(tmp_path):
    r = _config(tmp_path, "g++", env={"CUDA_INCLUDE": str(tmp_path / "nowhere")})
    assert r.returncode != 0 and "CUDA's headers" in r.stderr, r.stderr


def test_the_build_names_a_python_without_torch(tmp_path):
    bare = shutil.which("python3", path="/usr/bin:/bin")
    if bare is None or subprocess.run([bare, "-c", "import torch"], capture_output=True).returncode == 0:
        pytest.skip("no python3 without torch on this machine to build with")
    r = _config(tmp_path, "g++", python=bare)
    assert r.returncode != 0 and "cannot import torch" in r.stderr and "CLIENT_PY" in r.stderr, r.stderr


def test_the_build_settings_are_written(tmp_path):
    r = _config(tmp_path, "g++")
    assert r.returncode == 0, r.stderr
    text = (tmp_path / "config.mk").read_text()
    for var in ("TORCH_INC", "CUDA_INC", "PY_INC", "EXT_SUFFIX", "ABI", "BUILD_RECORD"):
        assert f"{var} := " in text, text
    # the libstdc++ torch runs with, linked by path (a relocated g++ would embed libstdc++.a)
    stdcxx = next(line.split(" := ", 1)[1] for line in text.splitlines() if line.startswith("STDCXX := "))
    assert "libstdc++.so" in stdcxx and os.path.exists(stdcxx), text
