#!/usr/bin/env bash
# Checks the layering rule of STYLE.md by reading the includes (the build enforces the same
# with per-layer include roots; tests/layering_probe.sh proves that): a source file may
# include headers of its own layer or of the layers below it, never others.
#   core < jinja < bridge,  core < model < ring < bridge,  core < client,  all < cli
set -u
root=${1:-$(dirname "$0")/..}
allowed() { # allowed LAYER: the layers its sources may include
    case $1 in
    core) echo "core" ;;
    jinja) echo "core jinja" ;;
    model) echo "core model" ;;
    ring) echo "core model ring" ;;
    bridge) echo "core jinja model ring bridge" ;;
    client) echo "core client" ;;
    cli) echo "core jinja model ring bridge client cli" ;;
    *) echo "" ;;
    esac
}
bad=0
while IFS= read -r f; do
    layer=${f#"$root"/src/}
    layer=${layer%%/*}
    ok=" $(allowed "$layer") "
    while IFS= read -r inc; do
        other=${inc%%/*}
        if [[ $ok != *" $other "* ]]; then
            echo "layering: $f includes $inc (layer $layer may not use $other)"
            bad=1
        fi
    done < <(sed -n 's/^#include "\([a-z]*\/[^"]*\)".*/\1/p' "$f")
done < <(find "$root/src" -name '*.[ch]' -o -name '*.inc')
[ $bad -eq 0 ] && echo "layering: ok"
exit $bad
