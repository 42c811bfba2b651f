#!/usr/bin/env bash
# Proves the build enforces the layering: each probe named up_* includes a header of a layer
# its own may not use and must fail to compile, naming that header; each own_* includes a
# header of its own layer and must compile. Usage: layering_probe.sh BUILD_DIR PROBE...
set -u
build=$1
shift
bad=0
for probe in "$@"; do
    out=$(cmake --build "$build" --target "probe_$probe" 2>&1)
    rc=$?
    case $probe in
    up_*)
        if [ $rc -eq 0 ]; then
            echo "layering_probe: $probe compiled, but its include crosses the layering"
            bad=1
        elif ! grep -q "No such file or directory" <<<"$out"; then
            echo "layering_probe: $probe failed for another reason:"
            echo "$out" | tail -5
            bad=1
        else
            echo "layering_probe: $probe refused as it should be"
        fi
        ;;
    own_*)
        if [ $rc -ne 0 ]; then
            echo "layering_probe: $probe did not compile:"
            echo "$out" | tail -5
            bad=1
        fi
        ;;
    esac
done
[ $bad -eq 0 ] && echo "layering_probe: ok ($# probes)"
exit $bad
