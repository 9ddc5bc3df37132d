#!/usr/bin/env bash
# Builds Firecracker v1.16.1 from third_party/firecracker/ and installs it (default
# /usr/local/bin/firecracker), for the microvm backend. Idempotent: does nothing when that
# version is installed.
#
# The build is for x86_64-unknown-linux-musl, the target Firecracker's own seccomp policy
# is written for (resources/seccomp/x86_64-unknown-linux-musl.json, compiled into the
# binary): a glibc build would carry an allow-everything filter. Takes 3-5 minutes.
#
#   deploy/firecracker.sh [DEST_DIR]
set -euo pipefail
here=$(cd "$(dirname "$0")/.." && pwd)
version=v1.16.1
dest=${1:-/usr/local/bin}
if [ -x "$dest/firecracker" ] && "$dest/firecracker" --version 2>/dev/null | grep -q "Firecracker $version"; then
  exit 0
fi
need=()
for p in libclang-dev libseccomp-dev pkg-config musl-tools linux-libc-dev; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || need+=("$p")
done
if ((${#need[@]})); then
  echo "==> apt-get install ${need[*]}"
  export DEBIAN_FRONTEND=noninteractive
  apt-get install -y -qq --no-install-recommends "${need[@]}" >/dev/null \
    || { apt-get update -qq && apt-get install -y -qq --no-install-recommends "${need[@]}" >/dev/null; }
fi
target=x86_64-unknown-linux-musl
if ! rustup target list --installed 2>/dev/null | grep -qx "$target"; then
  echo "==> rustup target add $target"
  rustup target add "$target"
fi
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
tar -xzf "$here/third_party/firecracker/firecracker-$version-src.tar.gz" -C "$work"
cd "$work/firecracker-$version"
# The release pins a toolchain by file; the host's stable one builds it.
rm -f rust-toolchain.toml
# musl-gcc sees no kernel headers of its own: give it (and bindgen) the host's uapi ones.
mkdir -p "$work/kh"
ln -s /usr/include/linux /usr/include/asm-generic "$work/kh/"
ln -s "/usr/include/$(gcc -dumpmachine)/asm" "$work/kh/asm"
echo "==> building Firecracker $version ($target), a few minutes"
CFLAGS_x86_64_unknown_linux_musl="-isystem $work/kh" \
BINDGEN_EXTRA_CLANG_ARGS_x86_64_unknown_linux_musl="-isystem $work/kh" \
  cargo build --quiet --release -p firecracker --target "$target"
install -D -m 0755 "target/$target/release/firecracker" "$dest/firecracker"
"$dest/firecracker" --version | head -1
