"""Build settings of the compiled client, read from the Python that runs it (its torch, its
headers), written as make variables to csrc/build/config.mk (rewritten only when they change).

Fails, naming what is missing, when a piece of the build is absent: the C++ compiler, torch's
headers, CUDA's headers, Python's headers. Run by `make client` (see csrc/client.mk):

    python3 csrc/config.py csrc/build/config.mk [CXX]
"""

import json
import os
import shutil
import sys
import sysconfig

# what torch's CUDA stream headers include from CUDA's
_CUDA_HEADERS = ("cuda_runtime_api.h", os.path.join("crt", "host_defines.h"))


def fail(what: str) -> None:
    sys.exit(f"gocomm client build: {what}")


def loaded_libstdcxx() -> str:
    """The libstdc++ this Python runs torch with (from its memory map), or "". The client links
    it by path: a compiler whose own lib directory holds only libstdc++.a (a relocated GCC)
    would otherwise put a private copy of libstdc++ in the client, whose locale is never set
    up, so that formatting a number (an error's message) crashes the process."""
    try:
        with open("/proc/self/maps") as f:
            for line in f:
                path = line.split()[-1]
                if "/libstdc++.so" in path and os.path.exists(path):
                    return path
    except OSError:
        pass
    return ""


def main() -> None:
    out = sys.argv[1]
    cxx = sys.argv[2] if len(sys.argv) > 2 else "g++"
    if not shutil.which(cxx):
        fail(f"no C++ compiler: {cxx!r} is not on PATH (install g++, or pass CXX=...)")
    try:
        import torch
    except ImportError as e:
        fail(f"{sys.executable} cannot import torch ({e}); pass CLIENT_PY=<a python with torch>")
    tdir = os.path.dirname(torch.__file__)
    tinc = os.path.join(tdir, "include")
    if not os.path.exists(os.path.join(tinc, "torch", "csrc", "distributed", "c10d", "Backend.hpp")):
        fail(f"torch's C++ headers are missing under {tinc} (a torch wheel ships them)")
    tlib = os.path.join(tdir, "lib")
    cuda_inc = os.environ.get("CUDA_INCLUDE", "")
    if not cuda_inc:
        site = os.path.dirname(tdir)
        for cand in (
            os.path.join(site, "nvidia", "cu13", "include"),
            os.path.join(site, "nvidia", "cuda_runtime", "include"),
            "/usr/local/cuda/include",
        ):
            # the runtime wheel alone lacks crt/ (the compiler wheel brings it), which
            # cuda_runtime_api.h includes: a directory counts only with both
            if all(os.path.exists(os.path.join(cand, h)) for h in _CUDA_HEADERS):
                cuda_inc = cand
                break
    if not cuda_inc or not all(os.path.exists(os.path.join(cuda_inc, h)) for h in _CUDA_HEADERS):
        fail(
            "CUDA's headers (cuda_runtime_api.h and crt/host_defines.h) are missing: install the nvidia-cuda-runtime "
            "and nvidia-cuda-nvcc wheels torch pins (python/requirements.lock), or pass CUDA_INCLUDE=<dir> "
            "(torch's CUDA stream headers include them; /usr/local/cuda/include where a toolkit is installed)"
        )
    py_inc = sysconfig.get_paths()["include"]
    if not os.path.exists(os.path.join(py_inc, "Python.h")):
        fail(
            f"Python's headers (Python.h) are missing under {py_inc}: install python3-dev for {sys.version.split()[0]}"
        )
    record = {
        "torch": torch.__version__,
        "cxx11_abi": bool(torch._C._GLIBCXX_USE_CXX11_ABI),
        "cuda": torch.version.cuda,
    }
    lines = [
        f"CXX := {cxx}",
        f"TORCH_INC := {tinc}",
        f"TORCH_LIB := {tlib}",
        f"CUDA_INC := {cuda_inc}",
        f"PY_INC := {py_inc}",
        f"EXT_SUFFIX := {sysconfig.get_config_var('EXT_SUFFIX')}",
        f"ABI := {int(torch._C._GLIBCXX_USE_CXX11_ABI)}",
        f"STDCXX := {loaded_libstdcxx()}",
        f"BUILD_RECORD := {json.dumps(record, sort_keys=True)}",
    ]
    text = "\n".join(lines) + "\n"
    os.makedirs(os.path.dirname(out), exist_ok=True)
    try:
        with open(out) as f:
            if f.read() == text:
                return
    except OSError:
        pass
    with open(out, "w") as f:
        f.write(text)


if __name__ == "__main__":
    main()
