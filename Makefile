# Forge's set-up and entry points. `make demo` and `make test` each work from a fresh clone
# with nothing but Python 3.11 and pip: they create .venv, install torch through the
# constraints file first, then the core and every first-party plugin (editable).

PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip --disable-pip-version-check
PACKAGES := core plugins/forge-moe plugins/forge-deepseek plugins/forge-optim-muon plugins/forge-wandb plugins/forge-prometheus plugins/forge-lm-eval plugins/forge-float8 plugins/forge-vlm
STAMP := $(VENV)/.forge-installed

.PHONY: setup demo test test-fast lint format clean bench dist

$(PY):
	$(PYTHON) -m venv $(VENV)

$(STAMP): $(PY) constraints.txt requirements-dev.txt $(addsuffix /pyproject.toml,$(PACKAGES))
	$(PIP) install -c constraints.txt torch==2.13.0
	$(PIP) install -c constraints.txt -r requirements-dev.txt
	$(PIP) install -c constraints.txt --no-build-isolation -e "core[hf,tensorboard,plot,s3]" \
		$(addprefix -e ,$(filter-out core,$(PACKAGES)))
	touch $(STAMP)

setup: $(STAMP)

# Forge's main job: train the embedded default model (Python's standard library as text, no
# download) for 200 steps on the CPU, into a new run directory each time.
demo: setup
	@run=runs/demo-$$(date +%Y%m%d-%H%M%S); \
	$(VENV)/bin/forge train --train.output_dir=$$run && \
	printf '%s\n' '' 'Next: activate the environment, then try the commands of the README'"'"'s "Using Forge":' \
		'  . .venv/bin/activate' "  forge generate $$run --prompt 'def ' --temperature 0.8" \
		"  forge plot $$run" '  forge train configs/debug.toml' '  forge list-plugins'

# The whole suite but the `bench` tier (about 28 minutes on 2 cores), after lint. The tiers are
# pytest markers (pyproject.toml); tests/conftest.py marks the slow tests by path.
test: setup lint
	$(PY) -m pytest -m "not bench"

# The fast tier: everything but the `slow` tests (rank launches, the forge command in a fresh
# interpreter, training runs of more than a few seconds) and `bench`, on two pytest-xdist workers:
# about 1.5 minutes on 2 cores (2.6 in one process). `make test` stays in one process: its rank
# launches already use both cores, and it was not measured on workers.
test-fast: setup
	$(PY) -m pytest -n 2 -m "not slow and not bench"

# ruff, then import-linter's contracts ([tool.importlinter] in pyproject.toml: the core imports no
# plugin, plugins import only forge_lm's public modules, the core's layers). The example plugin is
# not installed, so its source directory is put on the path for the analysis.
lint: setup
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .
	PYTHONPATH=examples/forge-example-plugin/src $(VENV)/bin/lint-imports

format: setup
	$(PY) -m ruff check --fix .
	$(PY) -m ruff format .

# A wheel and an sdist of the core and of every first-party plugin, into $(DIST) (emptied first):
# the files a user installs with pip install --find-links dist/ forge-moe. Each is built with the
# set-up's setuptools (no isolated build environment, so no download); tests/packaging checks them.
# `make dist DIST=elsewhere` builds elsewhere; an environment variable DIST is ignored on purpose.
DIST := dist

dist: setup
	rm -rf $(DIST)
	for package in $(PACKAGES); do $(PY) -m build --no-isolation --outdir $(DIST) $$package || exit 1; done

clean:
	rm -rf $(VENV) build dist .pytest_cache .ruff_cache

# The CPU benchmarks of benchmarks/README.md and the throughput regression check (under 15 minutes); refreshes
# benchmarks/results/*.json and benchmarks/RESULTS.md. Run it on an idle machine.
bench: setup
	$(PY) benchmarks/run_all.py
