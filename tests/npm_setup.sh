#!/usr/bin/env bash
# CTest fixture "npm": before any test that reads node_modules, install every test folder's
# pinned npm packages (`npm ci` where node_modules does not hold what package-lock.json pins).
# One test installs them all because tests run two at a time: two `npm ci` in one folder, or a
# test reading a folder while another installs it, fail at random. Without Node.js or npm this
# only says so (the tests that need them skip); under CI (CI=true) it fails.
set -u
root=${1:-$(dirname "$0")/..}
lack() {
    [ "${CI:-}" = true ] && { echo "npm_setup: $* (required under CI)" >&2; exit 1; }
    echo "npm_setup: SKIP: $*"
    exit 0
}
command -v node >/dev/null || lack "node is not installed"
status=0
while IFS= read -r lock; do
    dir=$(dirname "$lock")
    # Every top-level package the lock pins, at its pinned version, or the folder is stale.
    stale=$(node -e '
        const fs = require("fs"), path = require("path"), dir = process.argv[1];
        const lock = JSON.parse(fs.readFileSync(path.join(dir, "package-lock.json"), "utf8"));
        for (const [k, v] of Object.entries(lock.packages || {})) {
            if (!k.startsWith("node_modules/") || !v.version) continue;
            let have = "";
            try { have = JSON.parse(fs.readFileSync(path.join(dir, k, "package.json"), "utf8")).version; }
            catch (e) {}
            if (have !== v.version && !v.optional) { console.log(k); break; }
        }' "$dir")
    if [ -z "$stale" ]; then
        echo "npm_setup: ${dir#"$root"/} is installed"
        continue
    fi
    command -v npm >/dev/null || lack "npm is not installed (needed in $dir)"
    echo "npm_setup: npm ci in ${dir#"$root"/} ($stale is missing or differs)"
    log=$(mktemp)
    if ! (cd "$dir" && timeout 300 npm ci --no-audit --no-fund >"$log" 2>&1); then
        tail -20 "$log"
        [ "${CI:-}" = true ] && status=1
        echo "npm_setup: npm ci failed in $dir (no registry?)"
    fi
    rm -f "$log"
done < <(find "$root/tests" -name package-lock.json -not -path '*/node_modules/*' | sort)
exit $status
