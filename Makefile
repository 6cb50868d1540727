# Two entry points, both doing all set-up on a fresh machine (Python 3.11 + git + make):
#   make demo   -> set up .venv and run the main job (recipes/ppo_cartpole.yaml on the embedded Dask cluster)
#   make test   -> set up .venv and run lint, the docs build, the tests and the notebooks (what CI runs)
PYTHON ?= python3.11
VENV   ?= .venv
# The CPU wheel of torch 2.13.0 lies on disk on our machines; elsewhere this pulls the PyPI build.
TORCH  ?= torch==2.13.0
BIN    := $(VENV)/bin

.PHONY: setup demo test lint docs format bench clean

setup: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet "$(TORCH)"
	$(BIN)/pip install --quiet -e ".[dev]"
	$(BIN)/python -m ipykernel install --sys-prefix --name python3 >/dev/null
	touch $@

demo: setup
	$(BIN)/rlnb run recipes/ppo_cartpole.yaml

test: setup lint docs
	$(BIN)/python -m pytest -q -p no:cacheprovider --nbmake --nbmake-timeout=300 tests notebooks

lint: setup
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

docs: setup
	$(BIN)/python -m rlnb.docs docs/reference >/dev/null
	$(BIN)/mkdocs build --strict --quiet

format: setup
	$(BIN)/ruff check --fix .
	$(BIN)/ruff format .

bench: setup
	$(BIN)/pip install --quiet -e ".[bench]"
	$(BIN)/python bench/runtime.py
	$(BIN)/python bench/ppo_vs_sb3.py
	$(BIN)/python bench/grpo_vs_trl.py

clean:
	rm -rf $(VENV) build *.egg-info docs/reference
