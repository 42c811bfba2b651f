#!/usr/bin/env bash
# Checks the layering rule of STYLE.md: core < model < ring < bridge < client < cli (client:
# the HTTP client side of kvasir bench and top, above the bridge only for its sbuf). A source file
# may include headers of its own layer or of a lower one, never of a higher one.
set -u
root=${1:-$(dirname "$0")/..}
rank() { case $1 in core) echo 0 ;; model) echo 1 ;; ring) echo 2 ;; bridge) echo 3 ;; client) echo 4 ;; cli) echo 5 ;; *) echo -1 ;; esac; }
bad=0
for f in "$root"/src/*/*.[ch]; do
    layer=$(basename "$(dirname "$f")")
    mine=$(rank "$layer")
    while IFS= read -r inc; do
        other=${inc%%/*}
        theirs=$(rank "$other")
        if [ "$theirs" -gt "$mine" ]; then
            echo "layering: $f includes $inc (layer $other is above $layer)"
            bad=1
        fi
    done < <(sed -n 's/^#include "\([a-z]*\/[^"]*\)".*/\1/p' "$f")
done
[ $bad -eq 0 ] && echo "layering: ok"
exit $bad
