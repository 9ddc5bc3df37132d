#!/usr/bin/env bash
# Installs what OpenDsec needs on a Debian/Ubuntu host: OCI runtimes, the image builder,
# kernel tools, a Prometheus server (the metrics tests scrape with it), Chromium (the web
# console test drives it headless), and the Python
# packages the SDK and the tests use. Idempotent.
set -euo pipefail
pkgs=(crun runc mmdebstrap debootstrap busybox-static nftables iproute2 procps psmisc e2fsprogs util-linux tar xz-utils kmod qemu-system-x86 make gcc libc6-dev python3-pip docker-registry skopeo apache2-utils zstd openssl prometheus chromium)
missing=()
for p in "${pkgs[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if ((${#missing[@]})); then
  echo "==> apt-get install ${missing[*]}"
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi
# QEMU 10 forks a running VM with a stall of a few ms (a live `mapped-ram` capture); the
# edge uses what it finds, so an older QEMU still works, with a longer stall. Debian 12
# has 7.2: QEMU 10 comes from bookworm-backports, only those four packages (with their
# Recommends, backports would also bring systemd and mesa).
. /etc/os-release 2>/dev/null || true
qemu_major=$(qemu-system-x86_64 --version 2>/dev/null | sed -n 's/^QEMU emulator version \([0-9]*\).*/\1/p')
if [ "${VERSION_CODENAME:-}" = bookworm ] && ((${qemu_major:-0} < 10)); then
  echo "==> QEMU 10 from bookworm-backports"
  if ! grep -rqs bookworm-backports /etc/apt/sources.list /etc/apt/sources.list.d/; then
    printf 'Types: deb\nURIs: http://deb.debian.org/debian\nSuites: bookworm-backports\nComponents: main\nSigned-By: /usr/share/keyrings/debian-archive-keyring.gpg\n' \
      > /etc/apt/sources.list.d/dsec-bookworm-backports.sources
  fi
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  apt-get install -y -qq --no-install-recommends qemu-system-x86/bookworm-backports \
    qemu-system-common/bookworm-backports qemu-system-data/bookworm-backports \
    seabios/bookworm-backports >/dev/null \
    || echo "warning: QEMU 10 could not be installed; VM forks stop the source for longer" >&2
fi
# virtiofsd, for volumes in vm sandboxes (one daemon per mounted volume) and for the
# nested-KVM test harness (it shares the host's root with its outer VM): QEMU 7.2 shipped
# it, QEMU 10 does not, and Debian 12 has no package of its own, so on Debian 12 it is
# taken from 7.2's qemu-system-common.
if [ "${VERSION_CODENAME:-}" = bookworm ] && ! [ -x /usr/lib/qemu/virtiofsd ] \
  && ! [ -x /usr/libexec/virtiofsd ] && ! [ -x /usr/local/libexec/virtiofsd ]; then
  echo "==> virtiofsd from QEMU 7.2's qemu-system-common"
  vt=$(mktemp -d)
  if (cd "$vt" && apt-get download -q qemu-system-common/bookworm >/dev/null 2>&1 \
    && dpkg -x qemu-system-common_*.deb x); then
    install -D -m 0755 "$vt/x/usr/lib/qemu/virtiofsd" /usr/local/libexec/virtiofsd
  else
    echo "warning: virtiofsd could not be fetched; vm sandboxes cannot mount volumes and the nested-KVM tests cannot run" >&2
  fi
  rm -rf "$vt"
elif [ "${VERSION_CODENAME:-}" != bookworm ] && ! [ -x /usr/libexec/virtiofsd ] \
  && ! [ -x /usr/lib/qemu/virtiofsd ] && ! [ -x /usr/local/libexec/virtiofsd ]; then
  # Debian 13 and recent Ubuntu package it on its own.
  echo "==> apt-get install virtiofsd"
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends virtiofsd >/dev/null \
    || echo "warning: virtiofsd could not be installed; vm sandboxes cannot mount volumes" >&2
fi
# Go (>= 1.22), for the Go client's tests (sdk/go). A Go already on the machine is used;
# otherwise Debian's: on Debian 12 1.23 from bookworm-backports (its golang-go is 1.19).
if ! command -v go >/dev/null && ! [ -x /usr/local/go/bin/go ] && ! [ -x /usr/lib/go-1.23/bin/go ]; then
  echo "==> Go 1.23 from Debian"
  export DEBIAN_FRONTEND=noninteractive
  apt-get install -y -qq --no-install-recommends golang-1.23-go >/dev/null \
    || apt-get install -y -qq --no-install-recommends golang-1.23-go/bookworm-backports >/dev/null \
    || echo "warning: Go could not be installed; the Go client's tests cannot run" >&2
fi
if ! command -v cargo >/dev/null; then
  echo "error: Rust (cargo >= 1.90) is needed to build OpenDsec; install it with rustup (https://rustup.rs)" >&2
  exit 1
fi
python3 -m pip install -q --disable-pip-version-check --root-user-action=ignore aiohttp httpx pytest pytest-asyncio e2b==2.63.0 e2b-code-interpreter==2.11.5 grpcio==1.76.0 grpcio-tools==1.76.0 2>/dev/null \
  || python3 -m pip install -q --disable-pip-version-check --break-system-packages aiohttp httpx pytest pytest-asyncio e2b==2.63.0 e2b-code-interpreter==2.11.5 grpcio==1.76.0 grpcio-tools==1.76.0
# The gateway's JavaScript tests run the e2b npm package, which wants Node >= 20.18.
if ! command -v npm >/dev/null; then
  echo "==> apt-get install nodejs npm"
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends nodejs npm >/dev/null || true
fi
node_major=$(node -p 'process.versions.node.split(".")[0]' 2>/dev/null || echo 0)
if ((node_major < 20)); then
  echo "warning: Node >= 20.18 is needed for tests/e2e/test_e2b_js.py (found: $(node --version 2>/dev/null || echo none))" >&2
fi
# Firecracker, for the microvm backend, where the host has hardware KVM (a build of a few
# minutes; deploy/firecracker.sh does it on any host, e.g. for the nested-KVM tests).
if [ -c /dev/kvm ] && grep -qwE 'vmx|svm' /proc/cpuinfo && ! command -v firecracker >/dev/null; then
  bash "$(dirname "$0")/firecracker.sh" || echo "warning: Firecracker could not be built; the microvm backend stays unavailable" >&2
fi
