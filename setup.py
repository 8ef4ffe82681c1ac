"""The gocomm wheel and sdist: what pyproject.toml's static table cannot say.

- What goes in: the Python package (python/gocomm) and what `make` put next to it: bin/pgserver
  (stripped), bin/*.cubin (the in-process kernels; their GPU architecture is in bin/build.json
  and the wheel's metadata), bin/build.json, and the compiled client (_C*.so, lib/*.so) where
  it is built. A build from the sdist, which carries sources only, first runs `make package`
  with this Python (FROM_PY), after checking that what that needs is here (Go, g++, strip, the
  pinned NVIDIA compiler wheels) and naming what is not.
- Dependencies: torch pinned to the building environment's torch, the one the compiled client
  was built against (so wheels are built without build isolation); grpcio and protobuf no
  older than the generated code needs.
- Tags: manylinux_2_<N>_<arch>, N the newest glibc symbol version the binaries ask for and no
  lower than 34, arch pgserver's; cpXY-cpXY where the compiled client (_C) is in the package
  (it is built for one Python), else py3-none.
"""

from __future__ import annotations

import glob
import importlib.metadata
import json
import os
import re
import shutil
import subprocess
import sys
import sysconfig

from setuptools import Distribution, setup

try:
    from setuptools.command.bdist_wheel import bdist_wheel
except ImportError:  # setuptools older than 70.1: the wheel package's
    from wheel.bdist_wheel import bdist_wheel
from setuptools.command.build_py import build_py

ROOT = os.path.dirname(os.path.abspath(__file__))
PKG = os.path.join(ROOT, "python", "gocomm")
BIN = os.path.join(PKG, "bin")
GLIBC_FLOOR = 34  # manylinux_2_34: pgserver's cgo runtime asks for GLIBC_2.34
ELF_ARCH = {0x3E: "x86_64", 0xB7: "aarch64"}


class BuildError(SystemExit):
    pass


def _lock_pins(*names: str) -> list[str]:
    """The pins of names in python/requirements.lock (the versions make and CI build with)."""
    pins = {}
    with open(os.path.join(ROOT, "python", "requirements.lock")) as f:
        for line in f:
            m = re.match(r"^([A-Za-z0-9_.-]+)==(\S+)", line)
            if m:
                pins[m.group(1).lower()] = line.strip()
    return [pins.get(n, n) for n in names]


def _missing_for_source_build() -> list[str]:
    """What `make package` needs that this machine lacks, each with how to get it."""
    missing = []
    for tool, how in (
        ("go", "Go 1.26 (go.mod), https://go.dev/dl"),
        ("g++", "g++ (nvcc's host compiler and the compiled client's)"),
        ("make", "make"),
        ("strip", "strip (binutils)"),
    ):
        if shutil.which(tool) is None:
            missing.append(f"{tool}: install {how}")
    nvidia = os.path.join(sysconfig.get_path("purelib"), "nvidia")
    if not os.access(os.path.join(nvidia, "cu13", "bin", "nvcc"), os.X_OK):
        pins = _lock_pins(
            "nvidia-cuda-nvcc", "nvidia-cuda-crt", "nvidia-nvvm", "nvidia-cuda-cccl"
        )
        missing.append(f"nvcc in {nvidia}/cu13/bin: pip install {' '.join(pins)}")
    if not os.path.exists(
        os.path.join(nvidia, "nvshmem", "lib", "libnvshmem_device.a")
    ):
        missing.append(
            f"NVSHMEM's device library in {nvidia}/nvshmem/lib: pip install {_lock_pins('nvidia-nvshmem-cu13')[0]}"
        )
    return missing


def _torch_version() -> str:
    try:
        return importlib.metadata.version("torch")
    except importlib.metadata.PackageNotFoundError:
        raise BuildError(
            "gocomm's build pins torch to the version it is built against, and this Python has no torch: "
            "build in the environment that has the torch the wheel is for, without build isolation "
            "(pip wheel --no-build-isolation --no-deps .)"
        ) from None


def _extensions() -> list[str]:
    """The compiled client's files in the package (none before it is built)."""
    found = glob.glob(os.path.join(PKG, "_C*.so")) + glob.glob(
        os.path.join(PKG, "lib", "*.so*")
    )
    suffix = sysconfig.get_config_var("EXT_SUFFIX")
    for f in glob.glob(os.path.join(PKG, "_C*.so")):
        if not f.endswith(suffix):
            raise BuildError(
                f"{f} is built for another Python than this one ({sys.executable}, {suffix}): "
                "rebuild the client with this Python (make FROM_PY=... package) or remove it"
            )
    return found


def _ensure_binaries() -> None:
    if os.path.exists(os.path.join(BIN, "pgserver")):
        return
    # an sdist (or a checkout where make has not run): build what the wheel carries
    missing = _missing_for_source_build()
    if missing:
        raise BuildError(
            "gocomm: building pgserver and the kernels from source needs:\n  "
            + "\n  ".join(missing)
        )
    subprocess.check_call(["make", "-C", ROOT, "package", f"FROM_PY={sys.executable}"])


# the oldest manylinux glibc whose policy (auditwheel's) allows libstdc++'s GLIBCXX_3.4.N, for
# the compiled client: 3.4.29 is gcc 11 (manylinux_2_34), 3.4.30 gcc 12 (manylinux_2_35)
GLIBCXX_TO_GLIBC = {29: 34, 30: 35}


def _glibc_needed(path: str) -> int:
    """The oldest glibc (2.N) whose manylinux policy takes path's versioned symbols: the
    newest GLIBC_2.N it asks for, and what its GLIBCXX_3.4.M needs (0: none)."""
    with open(path, "rb") as f:
        data = f.read()
    glibc = max((int(m) for m in re.findall(rb"GLIBC_2\.(\d+)", data)), default=0)
    cxx = max((int(m) for m in re.findall(rb"GLIBCXX_3\.4\.(\d+)", data)), default=0)
    if cxx > max(GLIBCXX_TO_GLIBC):
        raise BuildError(
            f"{path} needs GLIBCXX_3.4.{cxx}, newer than any manylinux policy this build knows: "
            "build it with an older g++ (gcc 12 or older)"
        )
    return max(
        glibc,
        min((g for c, g in GLIBCXX_TO_GLIBC.items() if c >= cxx), default=0)
        if cxx
        else 0,
    )


def _platform() -> str:
    exe = os.path.join(BIN, "pgserver")
    with open(exe, "rb") as f:
        head = f.read(20)
    if head[:4] != b"\x7fELF":
        raise BuildError(f"{exe} is not an ELF binary")
    arch = ELF_ARCH.get(int.from_bytes(head[18:20], "little"))
    if arch is None:
        raise BuildError(f"{exe}: unknown ELF machine {head[18:20].hex()}")
    glibc = max(
        [GLIBC_FLOOR, _glibc_needed(exe)] + [_glibc_needed(f) for f in _extensions()]
    )
    return f"manylinux_2_{glibc}_{arch}"


def _build_info() -> dict:
    """bin/build.json as make wrote it, with the torch and Python this wheel is for."""
    with open(os.path.join(BIN, "build.json")) as f:
        info = json.load(f)
    info["torch"] = _torch_version()
    info["python"] = (
        f"{sys.version_info[0]}.{sys.version_info[1]}" if _extensions() else "any"
    )
    info["compiled_client"] = bool(_extensions())
    return info


class BuildPy(build_py):
    """Writes VERSION and build.json into
    the built package (the installed package reads its version from there)."""

    def run(self):
        super().run()
        out = os.path.join(self.build_lib, "gocomm")
        with open(os.path.join(ROOT, "VERSION")) as f:
            version = f.read().strip()
        with open(os.path.join(out, "VERSION"), "w") as f:
            f.write(version + "\n")
        with open(os.path.join(out, "bin", "build.json"), "w") as f:
            json.dump(_build_info(), f)
            f.write("\n")
        os.chmod(os.path.join(out, "bin", "pgserver"), 0o755)


class BinaryDistribution(Distribution):
    """Carries binaries: the package goes to platlib (the wheel's root), not purelib."""

    def has_ext_modules(self):
        return True


class BdistWheel(bdist_wheel):
    """Platform wheel: honest manylinux tag, cpXY-cpXY where the compiled client is in it."""

    def get_tag(self):
        if _extensions():
            py = f"cp{sys.version_info[0]}{sys.version_info[1]}"
            return py, py, _platform()
        return "py3", "none", _platform()


def _dependencies() -> list[str]:
    torch = _torch_version().split("+")[0]
    # the generated code's floors: protobuf gencode 7.35.1 (same major at run time), grpc 1.84
    return [f"torch=={torch}", "grpcio>=1.84.0", "protobuf>=7.35.1,<8"]


def _description() -> str:
    with open(os.path.join(BIN, "build.json")) as f:
        arch = json.load(f)["cuda_arch"]
    return f"A PyTorch process-group backend served by a Go sidecar (pgserver); CUDA kernels built for {arch}"


_ensure_binaries()
setup(
    description=_description(),
    package_dir={"": "python"},
    packages=["gocomm", "gocomm.bench", "gocomm.v1"],
    package_data={
        "gocomm": [
            "bin/pgserver",
            "bin/*.cubin",
            "bin/build.json",
            "_C*.so",
            "lib/*.so*",
            "lib/build.json",
        ],
        "gocomm.v1": ["*.pyi"],
    },
    install_requires=_dependencies(),
    cmdclass={"build_py": BuildPy, "bdist_wheel": BdistWheel},
    distclass=BinaryDistribution,
    options={"build": {"build_base": os.path.join(".cache", "wheel-build")}},
    zip_safe=False,
)
