# OpenDsec build and test entry points. `make test` is the whole test suite (CI runs it).
PROFILE ?= debug
CARGO ?= cargo
AETHER_TARGET := x86_64-unknown-linux-gnu
AETHER := target/$(AETHER_TARGET)/release/dsec-aether
CARGO_PROFILE_FLAG := $(if $(filter release,$(PROFILE)),--release,)

.PHONY: build aether dsec test test-rust test-e2e lint images bench bench-runtime bench-cluster bench-network bench-vm bench-gateway bench-tenant bench-guest clean-test

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

test-rust:
	$(CARGO) test --workspace

test-e2e: build
	DSEC_BIN=$(CURDIR)/target/$(PROFILE)/dsec DSEC_AETHER=$(CURDIR)/$(AETHER) \
		python3 -m pytest -q tests/e2e

test: lint test-rust test-e2e

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

bench-network: build
	DSEC_BIN=$(CURDIR)/target/$(PROFILE)/dsec DSEC_AETHER=$(CURDIR)/$(AETHER) python3 bench/network.py $(BENCH_ARGS)

bench-tenant: build
	DSEC_BIN=$(CURDIR)/target/$(PROFILE)/dsec DSEC_AETHER=$(CURDIR)/$(AETHER) python3 bench/tenant_pressure.py $(BENCH_ARGS)

bench-guest: build
	DSEC_BIN=$(CURDIR)/target/$(PROFILE)/dsec DSEC_AETHER=$(CURDIR)/$(AETHER) python3 bench/guest_flood.py $(BENCH_ARGS)

clean-test:
	-target/$(PROFILE)/dsec down --data-dir $${DSEC_TEST_DIR:-/var/tmp/dsec-test}
