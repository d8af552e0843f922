# cohort: `make demo` and `make test` each set up, build and run on a fresh Debian machine.
BUILD ?= build
JOBS ?= $(shell nproc)
CMAKE_FLAGS ?=
# The virtual environment scripts/setup.sh fills with PyPI's torch 2.11 (LibTorch and the Python peer).
export COHORT_VENV ?= $(CURDIR)/.venv

.PHONY: all setup configure build build-demo test test-unit demo bench clean install

all: build

setup:
	@bash scripts/setup.sh

$(BUILD)/build.ninja:
	cmake -S . -B $(BUILD) -G Ninja -DCOHORT_PYTHON=$(COHORT_VENV)/bin/python $(CMAKE_FLAGS)

configure: $(BUILD)/build.ninja

build: setup configure
	cmake --build $(BUILD) -j $(JOBS)

# The binary the demo runs and the shared library `make install` installs, nothing else (tests,
# fuzz targets and benchmarks are built by `make test` and `make bench`). The library is named by
# its file: under Ninja the name `cohort` is the binary's output (cohort_cli's OUTPUT_NAME), so
# `--target cohort` would build the binary and not libcohort.so.
build-demo: setup configure
	cmake --build $(BUILD) -j $(JOBS) --target cohort_cli libcohort.so

# Every test that runs without a GPU: the unit tests two at a time, then the multi-process and
# slow ones two at a time too (one at a time they kept 0.95 of two cores busy, waiting on process
# starts and sockets; docs/BENCHMARKS.md, "CI time"). The gpu and multigpu labels run on a GPU
# machine, through scripts/gpu-check.sh.
test: build
	cd $(BUILD) && ctest --output-on-failure --timeout 900 -L unit -j 2
	cd $(BUILD) && ctest --output-on-failure --timeout 900 -LE 'unit|gpu|multigpu' -j 2

test-unit: build
	cd $(BUILD) && ctest --output-on-failure -L unit

# The main job.
demo: build-demo
	bash scripts/demo.sh $(BUILD)

bench: build
	bash bench/run_all.sh $(BUILD)

# Headers, libcohort, the cohort binary and the CMake package under PREFIX (default /usr/local);
# build-demo builds the two targets it installs.
PREFIX ?= /usr/local
install: build-demo
	cmake --install $(BUILD) --prefix $(PREFIX)

clean:
	rm -rf $(BUILD)
