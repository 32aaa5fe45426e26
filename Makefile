# gpufleet.reclaim developer entry points.  `make demo` and `make test` are the README's commands.
SHELL := /bin/bash
.SHELLFLAGS := -eu -o pipefail -c
ROOT := $(abspath .)
VENV ?= $(ROOT)/.venv
PY := $(VENV)/bin/python
BIN := $(VENV)/bin
# ansible-test needs the collection under ansible_collections/<ns>/<name>: we copy it there.
COLL_ROOT := $(ROOT)/build/collections
COLL := $(COLL_ROOT)/ansible_collections/gpufleet/reclaim
SIM_BUILD := $(ROOT)/tests/sim/build
# The publishing tools (galaxy-importer, antsibull-docs) pin their own ansible-lint: a venv of their own.
GALAXY_VENV := $(ROOT)/build/galaxy-venv
# Grafana's dashboard types and tsc, from the npm registry at the versions tests/grafana/package.json pins.
GRAFANA_NPM := $(ROOT)/build/grafana-schema
CC ?= gcc
CFLAGS ?= -O2 -Wall -Wextra -Werror=implicit-function-declaration

.PHONY: all venv galaxy-venv sim collection test sim-test sanity units integration fleet-test floor lint changelog-lint \
	galaxy-import docs-lint dashboard-schema demo bench mutants clean

all: test

$(VENV)/.stamp: tests/requirements-dev.txt
	[ -x $(PY) ] || python3 -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -r tests/requirements-dev.txt
	touch $@

venv: $(VENV)/.stamp

$(GALAXY_VENV)/.stamp: tests/galaxy/requirements.txt
	[ -x $(GALAXY_VENV)/bin/python ] || python3 -m venv $(GALAXY_VENV)
	$(GALAXY_VENV)/bin/pip install -q --upgrade pip
	$(GALAXY_VENV)/bin/pip install -q -r tests/galaxy/requirements.txt
	touch $@

galaxy-venv: $(GALAXY_VENV)/.stamp

sim: $(SIM_BUILD)/libnvidia-ml.so.1 $(SIM_BUILD)/r470/libnvidia-ml.so.1 $(SIM_BUILD)/gpusim-workload

$(SIM_BUILD)/libnvidia-ml.so.1: tests/sim/nvml_shim.c
	mkdir -p $(SIM_BUILD)
	$(CC) $(CFLAGS) -shared -fPIC -Wl,-soname,libnvidia-ml.so.1 -o $@ $< -lm

# The same shim as an old (R470) driver: no *_v3 process lists and no MemoryInfo_v2 symbols.
$(SIM_BUILD)/r470/libnvidia-ml.so.1: tests/sim/nvml_shim.c
	mkdir -p $(SIM_BUILD)/r470
	$(CC) $(CFLAGS) -DSIM_R470 -shared -fPIC -Wl,-soname,libnvidia-ml.so.1 -o $@ $< -lm

$(SIM_BUILD)/gpusim-workload: tests/sim/workload.c
	mkdir -p $(SIM_BUILD)
	$(CC) $(CFLAGS) -o $@ $<

# Copy the tracked (and untracked, not ignored) files into the scratch collection tree.
collection: sim
	rm -rf $(COLL) && mkdir -p $(COLL)
	git ls-files -z --cached --others --exclude-standard | while IFS= read -r -d '' f; do \
	  [ -e "$$f" ] && { mkdir -p "$(COLL)/$$(dirname "$$f")"; cp -p "$$f" "$(COLL)/$$f"; } || true; done
	cd $(COLL) && git init -q && git add -A >/dev/null
	# build outputs are git-ignored (so sanity skips them) but the simulator needs them at run time
	cp -a $(SIM_BUILD) $(COLL)/tests/sim/build

test: venv sim sim-test sanity units integration fleet-test floor lint changelog-lint galaxy-import docs-lint dashboard-schema
	@echo "make test: all suites passed"

sim-test: venv sim
	$(PY) -m pytest -q -rs -p no:cacheprovider tests/sim/tests

sanity: venv collection
	$(PY) .ci/offline_get_pip.py
	cd $(COLL) && PATH=$(BIN):$$PATH $(BIN)/ansible-test sanity --local --python 3.11 --color no

# ansible-test passes -r a to pytest (each context's summary names its skips); skip_summary.py adds the total.
# `make units TEST=tests/unit/path/test_x.py::test_name` runs that one test (or file) with pytest in the same tree.
TEST ?=
units: venv collection
ifneq ($(strip $(TEST)),)
	cd $(COLL) && PATH=$(BIN):$$PATH PYTHONPATH=$(COLL_ROOT) $(PY) -m pytest -q -rs -p no:cacheprovider $(TEST)
else
	cd $(COLL) && rc=0 && { PATH=$(BIN):$$PATH $(BIN)/ansible-test units --local --python 3.11 --color no || rc=$$?; } && \
	  { $(PY) $(ROOT)/.ci/skip_summary.py units tests/output/junit/*-units.xml || true; } && exit $$rc
endif

integration: venv collection
	cd $(COLL) && PATH=$(BIN):$$PATH $(BIN)/ansible-test integration --local --python 3.11 --color no --allow-destructive

fleet-test: venv sim
	PATH=$(BIN):$$PATH $(PY) -m pytest -q -rs -p no:cacheprovider tests/fleet/tests

# The oldest claimed versions: ansible-core 2.17 on the controller, Python 3.8 on the nodes (own venvs).
floor: venv collection
	GPUFLEET_TEST_PYTHON=$(PY) bash tests/floor/run

# ansible-lint resolves gpufleet.reclaim.* through the scratch collection tree.
lint: venv collection
	ANSIBLE_COLLECTIONS_PATH=$(COLL_ROOT) PATH=$(BIN):$$PATH $(BIN)/ansible-lint --offline

changelog-lint: venv
	$(BIN)/antsibull-changelog lint

# Build the tarball as a release would, check what it ships, import it with galaxy-importer
# (ansible-test off, ansible-doc and ansible-lint on): no error, no warning (tests/galaxy/check).
galaxy-import: galaxy-venv collection
	$(GALAXY_VENV)/bin/python tests/galaxy/check --tree $(COLL) --venv $(GALAXY_VENV) --out $(ROOT)/build/galaxy

# The plugin, module and role documentation as docs.ansible.com's tooling renders it.
docs-lint: galaxy-venv collection
	cd $(COLL) && ANSIBLE_COLLECTIONS_PATH=$(COLL_ROOT) PATH=$(GALAXY_VENV)/bin:$$PATH \
	  $(GALAXY_VENV)/bin/antsibull-docs lint-collection-docs --plugin-docs .

$(GRAFANA_NPM)/.stamp: tests/grafana/package.json
	rm -rf $(GRAFANA_NPM) && mkdir -p $(GRAFANA_NPM) && cp tests/grafana/package.json $(GRAFANA_NPM)/
	cd $(GRAFANA_NPM) && npm install --no-audit --no-fund --ignore-scripts --loglevel=error
	touch $@

# extras/grafana/gpufleet-dashboard.json type-checked by tsc against @grafana/schema's Dashboard; planted typos fail.
dashboard-schema: venv $(GRAFANA_NPM)/.stamp
	GPUFLEET_GRAFANA_NPM=$(GRAFANA_NPM) $(PY) -m pytest -q -rs -p no:cacheprovider tests/grafana

demo: venv
	PATH=$(BIN):$$PATH $(PY) tests/demo/run

bench: venv sim
	mkdir -p build/bench && PATH=$(BIN):$$PATH $(PY) benchmarks/run --json build/bench/last.json

# Mutation testing of the safety-critical core (docs/testing.md): not part of `make test` (minutes per module).
# MODULE=identity (or several, space-separated) runs those only; JOBS mutants at once (default 1).
MUTANTS_STAMP := $(VENV)/.mutants-stamp
$(MUTANTS_STAMP): tests/mutants/requirements.txt $(VENV)/.stamp
	$(BIN)/pip install -q -r tests/mutants/requirements.txt
	touch $@

mutants: venv collection $(MUTANTS_STAMP)
	$(PY) tests/mutants/run --tree $(COLL) --mutmut $(BIN)/mutmut --jobs $(or $(JOBS),1) \
	  $(foreach m,$(MODULE),--module $(m))

clean:
	rm -rf build $(SIM_BUILD) tests/output
