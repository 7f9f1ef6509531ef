# The README's commands: `make run` serves the embedded default, `make test`
# runs the whole suite (what CI runs), `make test-fast` the tests that need no
# vLLM engine, no Ray cluster and no long run. Each sets up its own virtual
# environment (.venv) from nothing and reuses it while pyproject.toml is
# unchanged.
PYTHON ?= python3
VENV   ?= .venv
BIN     = $(VENV)/bin
STAMP   = $(VENV)/.installed
ARGS   ?=

.PHONY: run test test-fast demo bench venv proto clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e '.[cpu,test,train,trl,ray]'
	# PyPI's torchvision/torchaudio/torchcodec break `import transformers` beside the CPU torch.
	$(BIN)/python -m pip uninstall --quiet -y torchvision torchaudio torchcodec || true
	touch $(STAMP)

venv: $(STAMP)

run: $(STAMP)
	$(BIN)/rollout-service serve $(ARGS)

demo: $(STAMP)
	$(BIN)/rollout-service demo $(ARGS)

# The whole suite: the tests on vLLM engines and Ray, and beside them those on
# simulated engines (scripts/test_suite.sh); each prints its 15 slowest tests.
test: $(STAMP)
	scripts/test_suite.sh $(BIN)/python $(ARGS)

# The fast tier (markers applied by tests/conftest.py) on two pytest workers.
# pytest exits 5 when it collects no tests; that is not a failure here.
test-fast: $(STAMP)
	$(BIN)/python -m pytest -n 2 -m "not vllm and not ray and not slow" $(ARGS); rc=$$?; if [ $$rc -eq 5 ]; then rc=0; fi; exit $$rc

bench: $(STAMP)
	$(BIN)/python -m research.delivery_throughput $(ARGS)

proto: $(STAMP)
	$(BIN)/python scripts/gen_proto.py

clean:
	rm -rf $(VENV) build *.egg-info
