#!/usr/bin/env bash
# One command from a fresh clone to a running OpenDsec with a demo sandbox:
# installs dependencies, builds, builds the root/base and root/py:3.11 images, starts
# `dsec up` and runs the seed example through the Python SDK.
set -euo pipefail
cd "$(dirname "$0")/.."
DATA_DIR=${DSEC_DATA_DIR:-/var/lib/dsec}
PROFILE=${PROFILE:-release}

if [ "$(id -u)" != 0 ]; then
  echo "error: run as root (sandboxes need namespaces, cgroups and mounts): $0 as root, or sudo $0" >&2
  exit 1
fi
echo "==> installing dependencies"
bash deploy/deps.sh
echo "==> building ($PROFILE)"
make build PROFILE="$PROFILE"
DSEC="$PWD/target/$PROFILE/dsec"
install -D -m 0755 "$DSEC" /usr/local/bin/dsec
install -D -m 0755 target/x86_64-unknown-linux-gnu/release/dsec-aether /usr/local/lib/dsec/dsec-aether
python3 -m pip install -q --disable-pip-version-check --root-user-action=ignore -e sdk/python 2>/dev/null \
  || python3 -m pip install -q --disable-pip-version-check --break-system-packages -e sdk/python

echo "==> starting OpenDsec"
dsec up --data-dir "$DATA_DIR"
# After `up`: a spec's `run` steps execute in sandboxes of the running node.
echo "==> building images (first time: about a minute, downloads Debian packages)"
dsec image build images/base.toml --if-missing --data-dir "$DATA_DIR"
dsec image build images/py-3.11.toml --if-missing --data-dir "$DATA_DIR"
dsec image build images/code-interpreter.toml --if-missing --data-dir "$DATA_DIR"

dsec status --data-dir "$DATA_DIR"
# The table above says which backends this host can run and, for the others, what they lack.
echo "note: backends: container (crun or runc), vm (QEMU; hardware KVM, else TCG emulation),"
echo "      microvm (Firecracker; needs hardware KVM and a firecracker binary on PATH)."
echo "      The seed example below uses the container backend."
echo "==> running the seed example (examples/seed.py)"
DSEC_CONFIG="$DATA_DIR/client.toml" python3 examples/seed.py
