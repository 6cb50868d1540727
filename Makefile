# Two entry points, both doing all set-up on a fresh machine (Python 3.11 + git):
#   make demo   -> set up .venv and run the main job (a recipe on the embedded Dask cluster)
#   make test   -> set up .venv and run lint + the whole test suite (what CI runs)
PYTHON ?= python3.11
VENV   ?= .venv
# The CPU wheel of torch 2.13.0 lies on disk on our machines; elsewhere this pulls the PyPI build.
TORCH  ?= torch==2.13.0
BIN    := $(VENV)/bin

.PHONY: setup demo test lint format clean

setup: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet "$(TORCH)"
	$(BIN)/pip install --quiet -e ".[dev]"
	$(BIN)/python -m ipykernel install --sys-prefix --name python3 >/dev/null
	touch $@

demo: setup
	$(BIN)/rlnb run recipes/ppo_cartpole.yaml

test: setup lint
	$(BIN)/python -m pytest -q -p no:cacheprovider tests

lint: setup
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

format: setup
	$(BIN)/ruff check --fix .
	$(BIN)/ruff format .

clean:
	rm -rf $(VENV) build *.egg-info
