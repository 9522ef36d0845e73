#!/usr/bin/env bash
# What `make test` needs from the system besides Python packages: Debian's chromium (the cache
# page test drives it; no browser is downloaded by a test tool) and PostgreSQL's server binaries
# (the store tests start a throwaway cluster). Installed with apt when missing; already there,
# nothing happens.
set -euo pipefail
missing=()
command -v chromium >/dev/null || missing+=(chromium)
ls /usr/lib/postgresql/*/bin/initdb >/dev/null 2>&1 || missing+=(postgresql)
[ ${#missing[@]} -eq 0 ] && exit 0
echo "installing ${missing[*]} with apt-get (the tests need them)" >&2
if [ "$(id -u)" -eq 0 ]; then
    sudo=()
elif command -v sudo >/dev/null; then
    sudo=(sudo)
else
    echo "error: ${missing[*]} missing and not root: install them (Debian: apt-get install" \
        "${missing[*]})" >&2
    exit 1
fi
"${sudo[@]}" apt-get update -qq
"${sudo[@]}" env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}" >/dev/null
