# Two commands on a fresh machine: `make demo` and `make test`. Everything lands in .venv.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
PYTEST_ARGS ?=

.PHONY: setup demo test test-all test-repeat bench lint clean

setup: $(STAMP)

$(STAMP): pyproject.toml requirements/cpu.lock
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --disable-pip-version-check --no-deps -r requirements/cpu.lock
	$(BIN)/pip install -q --disable-pip-version-check --no-deps torchrec==1.8.0
	$(BIN)/pip install -q --disable-pip-version-check --no-deps --no-build-isolation -e .
	$(BIN)/python -c "import torch, torchrec, aetcd, elastic_rm; from torchrec.distributed.model_parallel import DistributedModelParallel"
	touch $(STAMP)

demo: setup
	$(BIN)/erm demo

test: setup
	$(BIN)/python -m pytest -q -rs $(PYTEST_ARGS)

# everything, the 30-minute soak included (ERM_SOAK=0 leaves it out; ERM_SOAK_MINUTES shortens it)
test-all: setup
	ERM_SOAK=$${ERM_SOAK:-1} $(BIN)/python -m pytest -q -rs -m "" $(PYTEST_ARGS)

# The suite N times, each on a fresh clone of HEAD (docs/contributing.md): HOG=K beside `stress-ng --cpu K`,
# RANDOM=1 in a random order (each run's seed printed; SEED=S replays one), RESULTS=name also writes
# benchmarks/results/name.json; REPEAT_ARGS passes more options (python -m benchmarks.repeat --help).
N ?= 1
HOG ?= 0
RANDOM ?= 0
SEED ?=
RESULTS ?=
REPEAT_ARGS ?=

test-repeat: setup
	$(BIN)/python -m benchmarks.repeat --runs $(N) --hog $(HOG) $(if $(filter 1,$(RANDOM)),--random) \
		$(if $(SEED),--seed $(SEED)) $(if $(RESULTS),--results $(RESULTS)) $(if $(filter 1,$(APPEND)),--append) \
		$(if $(PYTEST_ARGS),--pytest-args="$(PYTEST_ARGS)") $(REPEAT_ARGS)

BENCHMARKS ?= rendezvous agent_overhead reshard planner recovery lease keepalive scale
# Every benchmark run is bounded: one still running after BENCH_TIMEOUT seconds gets SIGABRT, on which
# Python's faulthandler prints every thread's stack (its process group gets it too), then SIGKILL.
BENCH_TIMEOUT ?= 7200
BOUNDED = PYTHONFAULTHANDLER=1 timeout --signal=ABRT --kill-after=60 $(BENCH_TIMEOUT)

bench: setup
	$(BIN)/pip install -q --disable-pip-version-check python-etcd==0.4.5 urllib3==2.8.0 dnspython==2.9.2
	for b in $(BENCHMARKS); do $(BOUNDED) $(BIN)/python -m benchmarks.$$b || exit 1; done
	case " $(BENCHMARKS) " in *" recovery "*) $(BOUNDED) $(BIN)/python -m benchmarks.recovery --part b || exit 1;; esac
	@echo "figures quoted in README.md and docs/ that the new results change (rewrite: python -m benchmarks.figures --update):"
	-$(BIN)/python -m benchmarks.figures

lint: setup
	$(BIN)/ruff check elastic_rm launcher tests benchmarks examples
	$(BIN)/ruff format --check elastic_rm launcher tests benchmarks examples

clean:
	rm -rf $(VENV) build *.egg-info
