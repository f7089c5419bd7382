# Two commands for a newcomer: `make book` builds the site, `make test` runs everything CI runs.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
# A CPU build of torch; set TORCH_SPEC="" to keep the torch you have (on Colab it is preinstalled).
TORCH_SPEC ?= torch==2.13.0

.PHONY: install book test chromium exercises clean

install: $(STAMP)

$(STAMP): pyproject.toml requirements.txt
	$(PYTHON) -m venv $(VENV)
	@if [ -n "$(TORCH_SPEC)" ] && ! $(BIN)/python -c "import torch" 2>/dev/null; then \
		$(BIN)/pip install -q "$(TORCH_SPEC)"; fi
	$(BIN)/pip install -q -e ".[dev]"
	touch $(STAMP)

book: $(STAMP)
	$(BIN)/jupyter-book build . --warningiserror --keep-going
	@echo "The book is at $(abspath _build/html/index.html)"

chromium:
	@command -v chromium >/dev/null 2>&1 || { \
		SUDO=$$( [ "$$(id -u)" = 0 ] || echo sudo ); \
		$$SUDO apt-get update -q && $$SUDO apt-get install -y -q chromium; }

test: book chromium
	$(BIN)/python -m pytest tests book solutions --nbval-lax -q

exercises: $(STAMP)
	$(BIN)/infra-lab assign

clean:
	rm -rf _build
