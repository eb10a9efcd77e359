# Every target sets up what it needs on a fresh machine (Debian 12/13) and skips what is there.
# PYTHON=... picks the interpreter to install into (default: python3 on PATH).
PYTHON ?= python3
export PYTHON

.PHONY: build deps test demo bench clean

deps:
	bash scripts/install_deps.sh

build: deps
	bash scripts/build.sh

# The suite, then the GPU checks' --simdev mode (tests/gpu and a quick benchmark on the simulated
# device; about 25 s), its results in a temporary folder, kept when it fails.
test: build
	$(PYTHON) -m pytest tests
	out=$$(mktemp -d /tmp/dtorch-device-check.XXXXXX) && \
	  OUT=$$out bash scripts/device_check.sh --simdev && rm -rf "$$out"

demo: build
	$(PYTHON) examples/demo.py

bench: build
	$(PYTHON) benchmarks/run_all.py

clean:
	rm -rf build dtorch_ops/*.so dtorch_ops/include dtorch_ops/share *.egg-info .pytest_cache \
	  tests/simdev/build
