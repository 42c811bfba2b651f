#!/usr/bin/env bash
# Installs the Debian packages Kvasir needs, only those missing, so each of the README's two
# commands works alone on a fresh Debian 12.
#
#   scripts/deps.sh build   compiler, CMake, Ninja and the four libraries (serve.sh)
#   scripts/deps.sh test    the build set plus what the tests drive: python3-jinja2 (chat
#                           templates against jinja2), Node.js and npm (the OpenAI SDK
#                           test and the console's browser test), chromium (the browser
#                           test drives it headless), openssl, iproute2, systemd,
#                           docker-compose, PyYAML and python3-jsonschema (deploy files),
#                           clang-format (style check)
set -euo pipefail
build_pkgs=(build-essential cmake ninja-build pkg-config libjansson-dev libsodium-dev
            libmicrohttpd-dev libcmocka-dev)
test_pkgs=(clang-format python3 python3-jinja2 python3-yaml python3-jsonschema nodejs
           iproute2 ca-certificates openssl curl systemd docker-compose chromium)
case ${1:-build} in
build) pkgs=("${build_pkgs[@]}") ;;
test) pkgs=("${build_pkgs[@]}" "${test_pkgs[@]}") ;;
*) echo "deps.sh: build or test, not '$1'" >&2; exit 2 ;;
esac
missing=()
for p in "${pkgs[@]}"; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
# npm: Debian's package goes with Debian's Node.js; a Node.js from elsewhere bundles its own
# npm and conflicts with it, so only where no npm is on the PATH.
if [ "${1:-build}" = test ] && ! command -v npm >/dev/null; then
    missing+=(npm)
fi
# A node found on the PATH (installed another way) also serves.
if command -v node >/dev/null; then
    missing=("${missing[@]/nodejs}")
fi
read -r -a missing <<<"${missing[*]}"
[ ${#missing[@]} -eq 0 ] && exit 0
SUDO=""
[ "$(id -u)" -eq 0 ] || SUDO=sudo
echo "deps: installing ${missing[*]}"
$SUDO apt-get update -q
$SUDO env DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends "${missing[@]}"
