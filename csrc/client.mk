# The compiled client: csrc/client/*.cc -> python/gocomm/lib/libgocomm_client.so (no Python in
# it), csrc/python/module.cc -> python/gocomm/_C<EXT_SUFFIX> (the pybind11 bindings, against
# torch's bundled pybind11). Included settings come from csrc/config.py (make client does both).
include csrc/build/config.mk

OBJ     := csrc/build/obj
CORE    := $(patsubst csrc/client/%.cc,$(OBJ)/%.o,$(wildcard csrc/client/*.cc))
LIB     := python/gocomm/lib/libgocomm_client.so
MODULE  := python/gocomm/_C$(EXT_SUFFIX)
RECORD  := python/gocomm/lib/build.json
CXXFLAGS := -std=c++17 -O2 -fPIC -Wall -Wextra -D_GLIBCXX_USE_CXX11_ABI=$(ABI) \
  -isystem $(TORCH_INC) -isystem $(TORCH_INC)/torch/csrc/api/include -isystem $(CUDA_INC) -Icsrc/client
# torch's libraries: beside an installed gocomm (site-packages/torch/lib, for the wheel), then
# where this build found them
LIBS    := -L$(TORCH_LIB) -Wl,-rpath,'$$ORIGIN/../../torch/lib' -Wl,-rpath,'$$ORIGIN/../torch/lib' -Wl,-rpath,$(TORCH_LIB) -lc10 -ltorch_cpu -ltorch -lc10_cuda

all: $(LIB) $(MODULE) $(RECORD)

$(OBJ)/%.o: csrc/client/%.cc $(wildcard csrc/client/*.h) csrc/build/config.mk
	@mkdir -p $(OBJ)
	$(CXX) $(CXXFLAGS) -c $< -o $@

$(OBJ)/module.o: csrc/python/module.cc $(wildcard csrc/client/*.h) csrc/build/config.mk
	@mkdir -p $(OBJ)
	$(CXX) $(CXXFLAGS) -isystem $(PY_INC) -c $< -o $@

# STDCXX: the libstdc++ the Python runs torch with, linked by path (csrc/config.py), and a
# client that defines libstdc++'s own functions anyway (a private copy) is refused; NM, the
# compiler's own nm, must be there for that check (it is never skipped)
NM ?= $(shell $(CXX) -print-prog-name=nm)
$(LIB): $(CORE)
	@mkdir -p $(dir $@)
	$(CXX) -shared -o $@.tmp $(CORE) $(LIBS) $(STDCXX) -ldl -lpthread
	@command -v $(NM) >/dev/null || { echo "gocomm client build: no nm ('$(NM)') to check the client's symbols with:" \
	  "install binutils, or set NM" >&2; rm -f $@.tmp; exit 1; }
	@if $(NM) -D --defined-only $@.tmp | grep -q ' _ZNSo9_M_insertI'; then \
	  echo "gocomm client build: $(CXX) put a private copy of libstdc++ in $@ (its lib directory has libstdc++.a only?):" \
	    "it would crash formatting numbers; build with a g++ that links libstdc++.so (CXX=/usr/bin/g++)" >&2; \
	  rm -f $@.tmp; exit 1; fi
	mv -f $@.tmp $@

$(MODULE): $(OBJ)/module.o $(LIB)
	$(CXX) -shared -o $@.tmp $(OBJ)/module.o -Lpython/gocomm/lib -lgocomm_client -Wl,-rpath,'$$ORIGIN/lib' \
	  $(LIBS) -ltorch_python $(STDCXX) && mv -f $@.tmp $@

# what the extension was built for: the import-time check compares it with the running torch
$(RECORD): csrc/build/config.mk
	@mkdir -p $(dir $@)
	echo '$(BUILD_RECORD)' > $@
