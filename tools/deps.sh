#!/bin/sh
# Installs the Debian packages the build and the tests need, and nothing when
# they are all present (the check costs a few dpkg-query calls, so every make
# target can afford to run it).
set -eu
pkgs="gcc g++ make clang libclang-rt-14-dev pkg-config
      liburing-dev libnuma-dev libprotobuf-c-dev protobuf-c-compiler
      libcmocka-dev libinih-dev libsystemd-dev libisal-dev libxxhash-dev libsimde-dev
      systemd fio libmicrohttpd-dev prometheus curl
      libhiredis-dev redis-server redis-tools
      python3-numpy python3-torch python3-pytest"
missing=
for p in $pkgs; do
	dpkg-query -W -f='${Status}\n' "$p" 2>/dev/null | grep -q '^install ok installed' ||
		missing="$missing $p"
done
[ -z "$missing" ] && exit 0
echo "deps: installing$missing" >&2
sudo=
[ "$(id -u)" = 0 ] || sudo=sudo
export DEBIAN_FRONTEND=noninteractive
$sudo apt-get update -qq
# shellcheck disable=SC2086
$sudo apt-get install -y -qq --no-install-recommends $missing >/dev/null
