#!/usr/bin/env bash
# Install wireguard-go from Debian trixie into DIR (default /usr/local/bin), on any Debian with apt, unless
# DIR already holds one at least MIN_VERSION.
#
#   scripts/install-wireguard-go.sh [DIR]
#   scripts/install-wireguard-go.sh --check [DIR]   exit 1 when DIR has none that recent (installs nothing)
#
# Why trixie's: on the emulated WAN link of `bench tunnel` (1 Gbit/s, 20 ms) it carries 0.955-0.974 of the
# clear path's goodput, bookworm's v0.0.20220316 0.70-0.80 at 30-50% more CPU per bit (BENCHMARKS,
# "Encrypted links"). It is a Go program that needs only glibc >= 2.34 (bookworm 2.36, Ubuntu 24.04 2.39), so
# the binary alone is installed: Debian's trixie index is read into a temporary directory, the package
# downloaded and unpacked there, and the system's own apt sources, lists and packages are left as they are.
# Used by scripts/setup-env.sh and by every image in docker/ (a Debian build stage, the binary copied).
set -euo pipefail
MIN_VERSION=0.0.20230223
CHECK=0
if [ "${1:-}" = --check ]; then CHECK=1; shift; fi
DIR=${1:-/usr/local/bin}

version() { "$1" --version 2>/dev/null | sed -n 's/^wireguard-go v//p' | head -1; }
current=$(version "$DIR/wireguard-go" || true)
if [ -n "$current" ] && [ "$(printf '%s\n%s\n' "$MIN_VERSION" "$current" | sort -V | head -1)" = "$MIN_VERSION" ]; then
  exit 0
fi
[ "$CHECK" = 0 ] || exit 1

work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
mkdir -p "$work/lists/partial" "$work/cache/archives/partial"
echo "deb [signed-by=/usr/share/keyrings/debian-archive-keyring.gpg] http://deb.debian.org/debian trixie main" \
  > "$work/trixie.list"
apt=(apt-get -qq -o APT::Sandbox::User=root -o "Dir::Etc::SourceList=$work/trixie.list" -o Dir::Etc::SourceParts=/dev/null
     -o "Dir::State::Lists=$work/lists" -o "Dir::Cache=$work/cache")
"${apt[@]}" update
(cd "$work" && "${apt[@]}" download wireguard-go)
dpkg-deb -x "$work"/wireguard-go_*.deb "$work/root"
mkdir -p "$DIR"
install -m 0755 "$work/root/usr/bin/wireguard-go" "$DIR/wireguard-go"
installed=$(version "$DIR/wireguard-go")
if [ "$(printf '%s\n%s\n' "$MIN_VERSION" "$installed" | sort -V | head -1)" != "$MIN_VERSION" ]; then
  echo "error: trixie's wireguard-go is v$installed, older than v$MIN_VERSION" >&2
  exit 1
fi
echo "wireguard-go v$installed in $DIR"
