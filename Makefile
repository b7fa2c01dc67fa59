# dormouse — the front door. `make test` installs what is missing (Debian
SHELL := /bin/bash
# packages, as root), configures, builds and runs every test.

BUILD ?= build
ASAN_BUILD ?= build-asan
JOBS ?= $(shell nproc)
CMAKE_FLAGS ?=

DEB_PACKAGES = gcc make cmake pkg-config liblua5.4-dev lua-lpeg-dev libzstd-dev lua-busted \
               libreadline-dev libopenblas-dev bible-kjv

.PHONY: all deps build test test-asan demo clean

all: build

# Install only what is absent; apt-get update runs only when something is.
deps:
	@missing=""; for p in $(DEB_PACKAGES); do \
	  dpkg-query -W -f='$${Status}' $$p 2>/dev/null | grep -q "install ok installed" || missing="$$missing $$p"; \
	done; \
	if [ -n "$$missing" ]; then \
	  echo "installing:$$missing"; \
	  if [ "$$(id -u)" != 0 ]; then echo "run as root (or install:$$missing)"; exit 1; fi; \
	  DEBIAN_FRONTEND=noninteractive apt-get update -qq && \
	  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends $$missing; \
	fi

# Without a visible GPU the CUDA kernels (when nvcc is there) are built for one
# architecture only, as in CI: they are compiled and checked, and the build stays short.
ifeq ($(origin DM_CUDA_ARCHS), undefined)
  ifneq ($(shell nvidia-smi -L >/dev/null 2>&1 && echo gpu),gpu)
    ARCH_FLAG = -DDM_CUDA_ARCHS=90a-real
  endif
else
  ARCH_FLAG = -DDM_CUDA_ARCHS="$(DM_CUDA_ARCHS)"
endif

build: deps
	cmake -S . -B $(BUILD) -DCMAKE_BUILD_TYPE=RelWithDebInfo $(ARCH_FLAG) $(CMAKE_FLAGS) >/dev/null
	cmake --build $(BUILD) -j$(JOBS)

# ctest's summary, then the same counts as one closing line.
test: build
	@cd $(BUILD) && ctest --output-on-failure -j$(JOBS) 2>&1 | tee ctest.log; status=$${PIPESTATUS[0]}; \
	grep -h "GPU tests skipped" Testing/Temporary/LastTest.log 2>/dev/null | head -1; \
	sed -n 's/.* tests passed, \([0-9]*\) tests failed out of \([0-9]*\).*/\2 \1/p' ctest.log | \
	  awk '{ printf "%d passed, %d failed\n", $$1 - $$2, $$2 }'; exit $$status

# Train the demo preset on the embedded corpus (on the GPU when there is one):
# progress, eval lines, the held-out BPB beside the order-3 n-gram baseline,
# a sample and the report's path.
demo: build
	$(BUILD)/dormouse run experiments/demo.lua --overwrite

test-asan:
	$(MAKE) test BUILD=$(ASAN_BUILD) CMAKE_FLAGS="-DDM_SANITIZE=ON $(CMAKE_FLAGS)"

clean:
	rm -rf $(BUILD) $(ASAN_BUILD)
