# gocomm: `make` sets everything up in place, `make test` runs every test.
#
# make            pinned Python env (.venv), code generators (.tools), generated code,
#                 bin/pgserver, the compiled client and the Python package in place
# make client     the compiled client only (g++ and the torch of CLIENT_PY; see README)
# make test       lint + Go tests + Python tests (GPU tests skip, saying why, without a GPU)
#                 + the wheel, installed apart from the checkout, running a 2-rank job
# make test-gpu   the GPU suite, on a machine with GPUs (see README; MPS=1 under MPS; K=expr
#                 selects tests as pytest -k; each failure is printed as it happens, and one
#                 GPU check runs at most GOCOMM_GPU_TEST_LIMIT seconds, 300 by default)
# make bench-gpu  gocomm against torch NCCL on the machine's GPUs (table, JSON, PNG)
# make bench      CPU benchmark: gocomm against gloo, 2 to 4 ranks
# make soak       ranks that disagree, SOAK_RUNS times on one world; a 10,000-connection flood
#                 of a sidecar's peer port, FLOOD_TRIALS times; the dead-peer faults SOAK_TRIALS
#                 times each (not part of make test)
# make wheel      dist/gocomm-<version>-<tags>.whl and the sdist, from what `make` built (README)

SHELL := /bin/bash
.SHELLFLAGS := -eu -o pipefail -c
.DEFAULT_GOAL := all

PYTHON_BOOT ?= python3
VENV        := .venv
PY          := $(VENV)/bin/python
# the one version: pgserver's -X main.version, gocomm.__version__ and the wheel's (VERSION)
VERSION     := $(shell cat VERSION)
# .venv/.stamp, a prerequisite of what needs the pinned venv's tools (protoc, nvcc). A build
# from the sdist (setup.py) sets FROM_PY to its own Python: no .venv then; the generated code
# ships in the sdist and nvcc/NVSHMEM come from that Python's NVIDIA wheels.
ifdef FROM_PY
PY         := $(FROM_PY)
VENV_STAMP :=
GEN_TOOLS  :=
PYTHON_BOOT := $(FROM_PY)
else
VENV_STAMP := $(VENV)/.stamp
GEN_TOOLS   = $(TOOLS)/protoc-gen-go $(TOOLS)/protoc-gen-go-grpc
endif
TOOLS       := $(CURDIR)/.tools/bin
GO          ?= go

PROTOC_GEN_GO_VERSION      := v1.36.12
PROTOC_GEN_GO_GRPC_VERSION := v1.6.2

PROTO_SRC := proto/gocomm/v1/pgserver.proto
GO_GEN    := proto/gocomm/v1/pgserver.pb.go proto/gocomm/v1/pgserver_grpc.pb.go
PY_GEN    := python/gocomm/v1/pgserver_pb2.py python/gocomm/v1/pgserver_pb2_grpc.py
GO_SRC    := $(shell find cmd config node pg gpu wire ring shm spin segment collectives sparse internal transport rpc kernels -name '*.go' -o -name '*.c' -o -name '*.h' 2>/dev/null)
SITE      := $(shell $(PYTHON_BOOT) -c 'import sys; print(f"python{sys.version_info[0]}.{sys.version_info[1]}")')

# kernels/{sidecar,inprocess}/*.cu -> kernels/build/*.cubin, one name space (go:embed in
# kernels/kernels.go; the in-process ones are also copied next to the Python package): nvcc
# from the pinned PyPI packages, NVSHMEM's device library from the nvidia-nvshmem wheel torch
# depends on. kernels/ is on the include path for the headers both runtimes share (sync.cuh).
NVIDIA    := $(if $(FROM_PY),$(shell $(FROM_PY) -c 'import sysconfig; print(sysconfig.get_path("purelib"))'),$(VENV)/lib/$(SITE)/site-packages)/nvidia
NVCC      := $(NVIDIA)/cu13/bin/nvcc
NVSHMEM   := $(NVIDIA)/nvshmem
CUDA_ARCH ?= sm_90
KERNEL_SRC := $(wildcard kernels/sidecar/*.cu kernels/inprocess/*.cu)
KERNELS   := $(patsubst %.cu,kernels/build/%.cubin,$(notdir $(KERNEL_SRC)))
vpath %.cu kernels/sidecar kernels/inprocess

.PHONY: all venv tools gen kernels build client python test lint test-go test-py test-wheel wheel package test-gpu bench bench-gpu bench-moe bench-fsdp bench-links soak clean

all: build client python

## Python environment, pinned (python/requirements.lock)
venv: $(VENV)/.stamp
$(VENV)/.stamp: python/requirements.lock
	$(PYTHON_BOOT) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip==25.3
	$(PY) -m pip install -q -r python/requirements.lock
	$(PY) -m pip check
	touch $@

## protoc plugins for Go, pinned; protoc itself comes from grpcio-tools in the venv
tools: $(TOOLS)/protoc-gen-go $(TOOLS)/protoc-gen-go-grpc
$(TOOLS)/protoc-gen-go:
	GOBIN=$(TOOLS) $(GO) install google.golang.org/protobuf/cmd/protoc-gen-go@$(PROTOC_GEN_GO_VERSION)
$(TOOLS)/protoc-gen-go-grpc:
	GOBIN=$(TOOLS) $(GO) install google.golang.org/grpc/cmd/protoc-gen-go-grpc@$(PROTOC_GEN_GO_GRPC_VERSION)

## generated code (not committed)
gen: $(GO_GEN) $(PY_GEN)
$(GO_GEN): $(PROTO_SRC) $(VENV_STAMP) $(GEN_TOOLS)
	$(PY) -m grpc_tools.protoc -I proto \
	  --plugin=protoc-gen-go=$(TOOLS)/protoc-gen-go --plugin=protoc-gen-go-grpc=$(TOOLS)/protoc-gen-go-grpc \
	  --go_out=. --go_opt=module=github.com/gocomm/gocomm \
	  --go-grpc_out=. --go-grpc_opt=module=github.com/gocomm/gocomm \
	  $(PROTO_SRC)
$(PY_GEN): $(PROTO_SRC) $(VENV_STAMP)
	$(PY) -m grpc_tools.protoc -I proto --python_out=python --pyi_out=python --grpc_python_out=python $(PROTO_SRC)
	touch python/gocomm/v1/__init__.py

## CUDA kernels: relocatable device code, then a device link with NVSHMEM into one cubin.
## Objects go to build/_obj, which go:embed skips.
kernels: $(KERNELS)
kernels/build/%.cubin: %.cu $(wildcard kernels/*.cuh kernels/*/*.cuh) $(VENV_STAMP)
	mkdir -p kernels/build/_obj
	$(NVCC) -arch=$(CUDA_ARCH) -rdc=true -O3 -Ikernels -I$(NVSHMEM)/include -c $< -o kernels/build/_obj/$*.o
	$(NVCC) -arch=$(CUDA_ARCH) -dlink -cubin kernels/build/_obj/$*.o -L$(NVSHMEM)/lib -lnvshmem_device -o $@

## pgserver; a stripped copy sits next to the Python package, where the shim (and the wheel)
## looks for it, with the in-process cubins and build.json: what this build is (the version,
## the kernels' GPU architecture, the torch the package was built against), for `gocomm info`,
## `gocomm doctor` and the wheel's metadata.
build: bin/pgserver
bin/pgserver: $(GO_GEN) $(GO_SRC) $(KERNELS) go.mod go.sum VERSION
	$(GO) build -trimpath -ldflags "-X main.version=$(VERSION)" -o $@ ./cmd/pgserver
	mkdir -p python/gocomm/bin && strip -o python/gocomm/bin/pgserver.tmp $@ && mv -f python/gocomm/bin/pgserver.tmp python/gocomm/bin/pgserver
	cp kernels/build/moe.cubin python/gocomm/bin/moe.cubin
	cp kernels/build/allreduce.cubin python/gocomm/bin/allreduce.cubin
	cp kernels/build/a2av_ipc.cubin python/gocomm/bin/a2av_ipc.cubin
	printf '{"version": "%s", "cuda_arch": "%s", "torch": "%s", "nvcc": "%s"}\n' "$(VERSION)" "$(CUDA_ARCH)" \
	  "$$($(PY) -c 'import importlib.metadata as m; print(m.version("torch"))')" \
	  "$$($(NVCC) --version | sed -n 's/.*release \([0-9.]*\).*/\1/p')" > python/gocomm/bin/build.json

## the compiled client (csrc/): built with the torch of CLIENT_PY (default: the venv's). On a
## machine without the venv: make client CLIENT_PY=python3 (csrc/config.py names what is missing).
CLIENT_PY ?= $(PY)
CXX       ?= g++
CLIENT_JOBS ?= 2
client: $(if $(filter $(PY),$(CLIENT_PY)),$(VENV_STAMP))
	$(CLIENT_PY) csrc/config.py csrc/build/config.mk $(CXX)
	$(MAKE) --no-print-directory -j$(CLIENT_JOBS) -f csrc/client.mk

## the Python package, importable from the venv without a copy (like an editable install)
python: $(PY_GEN) $(VENV)/.stamp
	echo "$(CURDIR)/python" > $(VENV)/lib/$(SITE)/site-packages/gocomm-inplace.pth

## what the wheel carries next to the Python package; setup.py runs this for a build from
## the sdist (FROM_PY=its Python): pgserver and the kernels, and the compiled client where
## the tree has its sources (csrc/).
package: build $(if $(wildcard csrc/client.mk),client)

## the wheel and the sdist (pyproject.toml and setup.py at the root: the packaging project is
## the whole checkout, so the sdist carries the Go and CUDA sources it builds from). No build
## isolation: the build reads the torch it pins from this environment and needs no network.
WHEEL_PY ?= $(PY)
wheel: all
	rm -rf dist .cache/wheel-build
	$(WHEEL_PY) -m pip wheel -q --no-index --no-build-isolation --no-deps -w dist .
	$(WHEEL_PY) -c 'from setuptools import build_meta as b; b.build_sdist("dist")' >/dev/null
	@ls -l dist

## checks
test: all lint test-go test-py test-wheel

# the wheel installed apart from the checkout runs a 2-rank CPU job, and the sdist builds the
# same wheel (python/tests/wheel_check.py)
test-wheel: wheel
	$(PY) python/tests/wheel_check.py --sdist dist/gocomm-$(VERSION).tar.gz dist/gocomm-$(VERSION)-*.whl

lint: gen
	@out=$$(gofmt -l cmd config node pg gpu wire ring shm spin segment collectives sparse internal transport rpc kernels 2>/dev/null); \
	  if [ -n "$$out" ]; then echo "gofmt: files need formatting:"; echo "$$out"; exit 1; fi
	$(GO) vet ./...
	cp go.mod /tmp/gocomm-go.mod.$$$$ && cp go.sum /tmp/gocomm-go.sum.$$$$ && $(GO) mod tidy && \
	  if ! diff -q go.mod /tmp/gocomm-go.mod.$$$$ >/dev/null || ! diff -q go.sum /tmp/gocomm-go.sum.$$$$ >/dev/null; then \
	    echo "go mod tidy changed go.mod/go.sum: commit the tidy result"; exit 1; fi
	$(VENV)/bin/ruff check python setup.py
	$(VENV)/bin/ruff format --check python setup.py
	$(VENV)/bin/ruff check --config python/pyproject.toml csrc/config.py
	$(VENV)/bin/ruff format --check --config python/pyproject.toml csrc/config.py

test-go: gen kernels
	$(GO) test -count=1 ./...

test-py: all
	$(PY) -m pytest -q python/tests

# On a GPU machine (Go is not needed there: build here, then copy the checkout with
# python/gocomm/bin and python/gocomm/v1). GPU_ENV keeps NVLink multicast off, as the shared
# machines this project is tested on require; MPS=1 runs under the CUDA MPS daemon, through
# the launcher jobs use (`pgserver launch --mps`: a daemon that answers on
# CUDA_MPS_PIPE_DIRECTORY or NVIDIA's default pipe is used, else one is started in
# /tmp/gocomm-mps-<uid> and stopped after).
GPU_ENV ?= NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
GPU_PY  ?= python3
MPS     ?= 0
TRANSPORT ?= auto
MPS_RUN = $(if $(filter 1,$(MPS)),python/gocomm/bin/pgserver launch --mps --run --)
test-gpu:
	$(MPS_RUN) env $(GPU_ENV) GOCOMM_TEST_FAIL_NOW=1 PYTHONPATH=python $(GPU_PY) -m pytest -v -rA -m gpu $(if $(K),-k "$(K)") python/tests

bench-gpu:
	$(MPS_RUN) env $(GPU_ENV) PYTHONPATH=python $(GPU_PY) -m gocomm.bench.gpu --json bench_gpu.json --png bench_gpu.png --perf docs/perf.md

# MoE all-to-all (issue 4's shapes): gocomm's ranks under MPS when MPS=1, torch's baselines
# in their own processes without it; TRANSPORT=auto|nccl|nvshmem picks gocomm's sparse path.
bench-moe:
	$(MPS_RUN) env $(GPU_ENV) PYTHONPATH=python $(GPU_PY) -m gocomm.bench.moe --transport $(TRANSPORT) --json bench_moe.json --png bench_moe.png --perf docs/perf.md

# The link ceiling: every GPU pushing to every other at once, copy engines and SM stores (what
# MoE prefill is read against; run it in the same lease as bench-moe).
bench-links:
	$(GPU_ENV) PYTHONPATH=python $(GPU_PY) -m gocomm.bench.links --perf docs/perf.md

# An FSDP2 (fully_shard) training step of a ~1B-parameter transformer, gocomm against NCCL in
# the same job: step time and the losses of 20 steps (exit 1 if they differ).
bench-fsdp:
	$(MPS_RUN) env $(GPU_ENV) PYTHONPATH=python $(GPU_PY) -m gocomm.bench.fsdp --json bench_fsdp.json --perf docs/perf.md

bench: all
	$(PY) -m gocomm.bench.cpu --world 2,3,4 --perf docs/perf.md

# 3 ranks call different collectives (all_reduce vs all_gather) on a fresh group per run;
# fails unless every rank of every run gets an error naming the mismatch and both calls.
SOAK_RUNS ?= 1000
# 10,000 unauthenticated connections to one sidecar while its group works (soak_flood.py).
FLOOD_TRIALS ?= 20
# Then every dead-peer fault (python/tests/faults.py: a rank, a sidecar killed, a sidecar
# stopped, a host unreachable, the Store's host killed) at 4 KiB, 1 MiB and 64 MiB, SOAK_TRIALS
# times each: every survivor must raise within the dead-peer limit, naming the dead rank.
SOAK_TRIALS ?= 20
soak: all
	$(PY) python/tests/soak_disagree.py --runs $(SOAK_RUNS)
	$(PY) python/tests/soak_flood.py --trials $(FLOOD_TRIALS)
	$(PY) python/tests/soak_dead_peers.py --trials $(SOAK_TRIALS)

clean:
	rm -rf bin python/gocomm/bin python/gocomm/v1 csrc/build python/gocomm/lib python/gocomm/_C*.so $(GO_GEN) kernels/build/_obj $(KERNELS) dist .cache/wheel-build
