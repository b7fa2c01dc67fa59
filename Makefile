# dormouse — the front door. `make test` installs what is missing (Debian
SHELL := /bin/bash
# packages, as root), configures, builds and runs every test.

BUILD ?= build
TEST_BUILD ?= build-test
ASAN_BUILD ?= build-asan
# make test builds without the CUDA kernels (they cannot run without a GPU, and nvcc takes minutes);
# TEST_CUDA=AUTO builds them where nvcc is, and runs the op suite on the GPU where there is one
TEST_CUDA ?= OFF
JOBS ?= $(shell nproc)
CMAKE_FLAGS ?=

DEB_PACKAGES = gcc make cmake pkg-config liblua5.4-dev lua-lpeg-dev libzstd-dev lua-busted \
               libreadline-dev libopenblas-dev bible-kjv clang libclang-rt-14-dev
# what the tests need besides: a headless browser renders the run report (tests/lua/report_spec.lua);
# bubblewrap, python3 and lua5.4 are the code verifiers' sandbox and its languages (tests/lua/sandbox_spec.lua);
# openmpi-bin starts the data-parallel jobs of CPU ranks (tests/lua/dist_spec.lua), zstd checks packed corpora
TEST_PACKAGES = chromium bubblewrap python3-minimal lua5.4 openmpi-bin zstd

# The sanitizer build: clang, AddressSanitizer and UBSan over the C core (no CUDA: the
# sanitizers cannot see into kernels, and it runs where there is no GPU driver), with the
# libFuzzer targets of tests/fuzz, each a test of FUZZ_TEST_SECONDS.
SAN_FLAGS = -DDM_SANITIZE=ON -DDM_FUZZ=ON -DDM_CUDA=OFF
FUZZ_TEST_SECONDS ?= 10
FUZZ_SECONDS ?= 600

PREFIX ?= /usr/local

.PHONY: all deps deps-test build build-test build-asan test test-asan fuzz demo install clean

all: build

# Install only what is absent of the packages $(1); apt-get update runs only when something is.
install_missing = missing=""; for p in $(1); do \
	  dpkg-query -W -f='$${Status}' $$p 2>/dev/null | grep -q "install ok installed" || missing="$$missing $$p"; \
	done; \
	if [ -n "$$missing" ]; then \
	  echo "installing:$$missing"; \
	  if [ "$$(id -u)" != 0 ]; then echo "run as root (or install:$$missing)"; exit 1; fi; \
	  DEBIAN_FRONTEND=noninteractive apt-get update -qq && \
	  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends $$missing; \
	fi

deps:
	@$(call install_missing,$(DEB_PACKAGES))

deps-test: deps
	@$(call install_missing,$(TEST_PACKAGES))

# Without a visible GPU the CUDA kernels (when nvcc is there) are built for one
# architecture only, as in CI: they are compiled and checked, and the build stays short.
ifeq ($(origin DM_CUDA_ARCHS), undefined)
  ifneq ($(shell nvidia-smi -L >/dev/null 2>&1 && echo gpu),gpu)
    ARCH_FLAG = -DDM_CUDA_ARCHS=90a-real
  endif
else
  ARCH_FLAG = -DDM_CUDA_ARCHS="$(DM_CUDA_ARCHS)"
endif

# build/meta/ops.lua: the editor lines of the functions the ops' descriptors give them (.luarc.json)
build: deps
	cmake -S . -B $(BUILD) -DCMAKE_BUILD_TYPE=RelWithDebInfo $(ARCH_FLAG) $(CMAKE_FLAGS) >/dev/null
	cmake --build $(BUILD) -j$(JOBS)
	DORMOUSE_HOME=$(CURDIR) $(BUILD)/dormouse meta $(BUILD)/meta/ops.lua

# the suite's own build: the plain build without the CUDA kernels unless TEST_CUDA says otherwise
build-test: deps
	cmake -S . -B $(TEST_BUILD) -DCMAKE_BUILD_TYPE=RelWithDebInfo -DDM_CUDA=$(TEST_CUDA) $(ARCH_FLAG) $(CMAKE_FLAGS) >/dev/null
	cmake --build $(TEST_BUILD) -j$(JOBS)

build-asan: deps
	CC=clang cmake -S . -B $(ASAN_BUILD) -DCMAKE_BUILD_TYPE=RelWithDebInfo $(SAN_FLAGS) \
	  -DDM_FUZZ_SECONDS=$(FUZZ_TEST_SECONDS) $(CMAKE_FLAGS) >/dev/null
	cmake --build $(ASAN_BUILD) -j$(JOBS)

# One ctest run in the folder $(1): its summary, its counts appended to $(2); $(3): more ctest flags.
run_ctest = cd $(1) && ctest --output-on-failure -j$(JOBS) $(3) 2>&1 | tee ctest.log; status=$${PIPESTATUS[0]}; \
	grep -h "GPU tests skipped" Testing/Temporary/LastTest.log 2>/dev/null | head -1; \
	sed -n 's/.* tests passed, \([0-9]*\) tests failed out of \([0-9]*\).*/\2 \1/p' ctest.log >> $(2); \
	exit $$status

# The suite (C units, the op oracle suite, Busted specs), then the same under the
# sanitizers with the fuzz targets, less the specs that mostly train models (CMakeLists.txt,
# DM_TRAINING_SPECS: make test-asan runs them too); both ctest summaries, then the counts as one line.
test: deps-test build-test build-asan
	@counts=$$(mktemp); status=0; \
	echo "== the suite ($(TEST_BUILD))"; ( $(call run_ctest,$(TEST_BUILD),$$counts) ) || status=1; \
	echo "== under AddressSanitizer and UBSan, with the fuzz targets ($(ASAN_BUILD)); the specs that" \
	     "train models run in the suite above (make test-asan: under the sanitizers too)"; \
	( $(call run_ctest,$(ASAN_BUILD),$$counts,-LE trains) ) || status=1; \
	awk '{ t += $$1; f += $$2 } END { printf "%d passed, %d failed\n", t - f, f }' $$counts; \
	rm -f $$counts; exit $$status

# Train the demo preset on the embedded corpus (on the GPU when there is one):
# progress, eval lines, the held-out BPB beside the order-3 n-gram baseline,
# a sample and the report's path.
demo: build
	$(BUILD)/dormouse run experiments/demo.lua --overwrite

# dormouse on PATH: $(PREFIX)/bin/dormouse, the library, models, experiments and tasks in
# $(PREFIX)/share/dormouse, where the binary finds them (no DORMOUSE_HOME needed)
install: build
	cmake --install $(BUILD) --prefix $(PREFIX)

# The sanitizer suite alone.
test-asan: build-asan
	@counts=$$(mktemp); ( $(call run_ctest,$(ASAN_BUILD),$$counts) ); status=$$?; \
	awk '{ printf "%d passed, %d failed\n", $$1 - $$2, $$2 }' $$counts; rm -f $$counts; exit $$status

# Each fuzz target for FUZZ_SECONDS (two at a time), its new inputs kept in $(ASAN_BUILD)/fuzz/TARGET;
# a crash leaves its input as $(ASAN_BUILD)/fuzz/TARGET-crash-* and fails the run.
fuzz: build-asan
	@status=0; for pair in "safetensors corpus" "meta config"; do \
	  for t in $$pair; do \
	    ( cd $(ASAN_BUILD) && ./fuzz_$$t -max_total_time=$(FUZZ_SECONDS) -timeout=10 -rss_limit_mb=2048 \
	        -max_len=65536 -print_final_stats=1 -artifact_prefix=fuzz/$$t- fuzz/$$t ../tests/fuzz/seeds/$$t \
	        > fuzz/$$t.log 2>&1 ) & \
	  done; wait; \
	done; \
	for t in safetensors corpus meta config; do \
	  log=$(ASAN_BUILD)/fuzz/$$t.log; \
	  runs=$$(sed -n 's/^stat::number_of_executed_units: *//p' $$log); secs=$$(sed -n 's/^stat::average_exec_per_sec: *//p' $$log); \
	  crashes=$$(ls $(ASAN_BUILD)/fuzz/$$t-* 2>/dev/null | wc -l); corpus=$$(ls $(ASAN_BUILD)/fuzz/$$t | wc -l); \
	  printf "fuzz %-12s %10s runs  %6s exec/s  corpus %5d inputs  %d crashes\n" $$t "$$runs" "$$secs" $$corpus $$crashes; \
	  [ $$crashes -eq 0 ] || status=1; \
	done; exit $$status

clean:
	rm -rf $(BUILD) $(TEST_BUILD) $(ASAN_BUILD)
