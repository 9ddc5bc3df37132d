# OpenDsec build and test entry points. `make test` is the whole test suite (CI runs it).
PROFILE ?= debug
CARGO ?= cargo
AETHER_TARGET := x86_64-unknown-linux-gnu
AETHER := target/$(AETHER_TARGET)/release/dsec-aether
DSEC_TEST_DIR ?= /var/tmp/dsec-test
CARGO_PROFILE_FLAG := $(if $(filter release,$(PROFILE)),--release,)

.PHONY: build aether dsec test test-rust test-e2e test-deploy test-nested lint images bench bench-runtime bench-cluster bench-network bench-vm bench-gateway bench-tenant bench-guest bench-observe bench-vm-nested bench-burst bench-functions bench-vm-pool bench-headers clean-test

build: dsec aether

dsec:
	$(CARGO) build $(CARGO_PROFILE_FLAG) -p dsec-cli

# dsec-aether runs inside every sandbox, whatever libc the image has: link it statically.
# --target keeps the static flag off build scripts and proc macros.
aether:
	RUSTFLAGS="-C target-feature=+crt-static" $(CARGO) build --release -p dsec-aether --target $(AETHER_TARGET)

lint:
	$(CARGO) fmt --all -- --check
	$(CARGO) clippy --workspace --all-targets -- -D warnings
	CARGO=$(CARGO) sh .ci/layering
	cd sdk/go && test -z "$$(gofmt -l .)" || { gofmt -l . >&2; exit 1; }
	cd sdk/go && go vet ./...

test-rust:
	$(CARGO) test --workspace

test-e2e: build
	DSEC_BIN=$(CURDIR)/target/$(PROFILE)/dsec DSEC_AETHER=$(CURDIR)/$(AETHER) \
		python3 -m pytest -q tests/e2e

# The Helm chart and the plain manifests (deploy/helm, deploy/k8s): rendered by a helm built
# from deploy/helm/test/go.mod, every object decoded strictly; no cluster needed.
test-deploy:
	cd deploy/helm/test && go test -count=1 ./...

# The microvm backend (Firecracker) and the vm backend on KVM, run one level down: inside
# an outer QEMU VM under TCG with -cpu max, where kvm_amd loads (tests/nested/outer.py).
# It uses the images test-e2e built in $(DSEC_TEST_DIR).
NESTED_TESTS ?= tests/e2e/test_microvm.py tests/e2e/test_backends.py -k microvm
test-nested: build
	@command -v firecracker >/dev/null || test -x /usr/local/bin/firecracker \
		|| { echo "test-nested: no Firecracker; run deploy/firecracker.sh first" >&2; exit 1; }
	python3 tests/nested/outer.py --share $(DSEC_TEST_DIR)/images:/var/tmp/dsec-nested/images -- \
		env DSEC_TEST_DIR=/var/tmp/dsec-nested DSEC_BIN=$(CURDIR)/target/$(PROFILE)/dsec \
		DSEC_AETHER=$(CURDIR)/$(AETHER) python3 -m pytest -q -p no:cacheprovider $(NESTED_TESTS)

# In `make test` (CI): the seed example with a fork of 4 keeping memory, about 3 minutes.
NESTED_CI_TESTS := tests/e2e/test_microvm.py::test_microvm_runs_the_seed_example_and_forks_with_memory

test: lint test-rust test-e2e test-deploy
	$(MAKE) test-nested NESTED_TESTS=$(NESTED_CI_TESTS)

bench: build
	DSEC_BIN=$(CURDIR)/target/$(PROFILE)/dsec DSEC_AETHER=$(CURDIR)/$(AETHER) python3 bench/create_latency.py $(BENCH_ARGS)

bench-runtime: build
	DSEC_BIN=$(CURDIR)/target/$(PROFILE)/dsec DSEC_AETHER=$(CURDIR)/$(AETHER) python3 bench/runtime_latency.py $(BENCH_ARGS)

bench-cluster: build
	DSEC_BIN=$(CURDIR)/target/$(PROFILE)/dsec DSEC_AETHER=$(CURDIR)/$(AETHER) python3 bench/cluster_path.py $(BENCH_ARGS)

bench-gateway: build
	DSEC_BIN=$(CURDIR)/target/$(PROFILE)/dsec DSEC_AETHER=$(CURDIR)/$(AETHER) python3 bench/gateway_latency.py $(BENCH_ARGS)

bench-vm: build
	DSEC_BIN=$(CURDIR)/target/$(PROFILE)/dsec DSEC_AETHER=$(CURDIR)/$(AETHER) python3 bench/vm_lifecycle.py $(BENCH_ARGS)

# bench-vm inside the nested-KVM harness: the microvm backend (next to a raw Firecracker
# boot of the same kernel and disk) and vm on KVM, labelled "nested under TCG".
NESTED_BENCH_ARGS ?= --repeat 2 --counts 1,8
bench-vm-nested: build
	python3 tests/nested/outer.py --share $(DSEC_TEST_DIR)/images:/var/tmp/dsec-bench/images \
		--out $(CURDIR)/bench/results -- env DSEC_BIN=$(CURDIR)/target/$(PROFILE)/dsec \
		DSEC_AETHER=$(CURDIR)/$(AETHER) python3 bench/vm_lifecycle.py $(NESTED_BENCH_ARGS)

bench-burst: build
	DSEC_BIN=$(CURDIR)/target/$(PROFILE)/dsec DSEC_AETHER=$(CURDIR)/$(AETHER) python3 bench/burst.py $(BENCH_ARGS)

bench-functions: build
	DSEC_BIN=$(CURDIR)/target/$(PROFILE)/dsec DSEC_AETHER=$(CURDIR)/$(AETHER) python3 bench/functions.py $(BENCH_ARGS)

bench-vm-pool: build
	DSEC_BIN=$(CURDIR)/target/$(PROFILE)/dsec DSEC_AETHER=$(CURDIR)/$(AETHER) python3 bench/vm_pool.py $(BENCH_ARGS)

bench-network: build
	DSEC_BIN=$(CURDIR)/target/$(PROFILE)/dsec DSEC_AETHER=$(CURDIR)/$(AETHER) python3 bench/network.py $(BENCH_ARGS)

bench-headers: build
	DSEC_BIN=$(CURDIR)/target/$(PROFILE)/dsec DSEC_AETHER=$(CURDIR)/$(AETHER) python3 bench/egress_headers.py $(BENCH_ARGS)

bench-tenant: build
	DSEC_BIN=$(CURDIR)/target/$(PROFILE)/dsec DSEC_AETHER=$(CURDIR)/$(AETHER) python3 bench/tenant_pressure.py $(BENCH_ARGS)

bench-guest: build
	DSEC_BIN=$(CURDIR)/target/$(PROFILE)/dsec DSEC_AETHER=$(CURDIR)/$(AETHER) python3 bench/guest_flood.py $(BENCH_ARGS)

bench-observe: build
	DSEC_BIN=$(CURDIR)/target/$(PROFILE)/dsec DSEC_AETHER=$(CURDIR)/$(AETHER) python3 bench/observe.py $(BENCH_ARGS)

clean-test:
	-target/$(PROFILE)/dsec down --data-dir $${DSEC_TEST_DIR:-/var/tmp/dsec-test}
