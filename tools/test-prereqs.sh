#!/usr/bin/env bash
# What some checks of `make test` need beyond the build: the aarch64 cross compiler and qemu (the NEON kernel
# body compiled and run) and ninja. Installed with apt-get where this runs as root on Debian/Ubuntu (as CI
# does); elsewhere one notice says which checks will be skipped. Never fails: the tests decide.
set -uo pipefail
missing=()
command -v aarch64-linux-gnu-gcc >/dev/null || missing+=(gcc-aarch64-linux-gnu)
command -v aarch64-linux-gnu-g++ >/dev/null || missing+=(g++-aarch64-linux-gnu)
command -v qemu-aarch64 >/dev/null || missing+=(qemu-user)
command -v ninja >/dev/null || missing+=(ninja-build)
((${#missing[@]})) || exit 0
if [[ $(id -u) -eq 0 ]] && command -v apt-get >/dev/null; then
    echo "installing ${missing[*]} (for the aarch64 and build checks)"
    if apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
            "${missing[@]}" >/dev/null; then
        exit 0
    fi
    echo "note: apt-get could not install ${missing[*]}" >&2
fi
echo "note: ${missing[*]} not installed (needs root and apt-get): the aarch64 checks will be skipped" \
     "(a skip fails the run only where CI is set)" >&2
exit 0
