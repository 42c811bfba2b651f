#!/usr/bin/env bash
# The prefix cache changes no token (DESIGN.md 12): 12 sequences whose prompts share
# prefixes of different lengths (a long shared "system prompt" of more blocks than one MAP
# record names, shorter shared openings, and
# turns that repeat an earlier prompt and continue it), 6 greedy and 6 sampled with seeds,
# give exactly the same tokens through the single-process engine, a 3-stage ring in flight
# with the prefix cache, and the same ring with --no-prefix-cache. The plan has 4 sequence
# slots, so most sequences start while others run and map blocks they wrote (in flight);
# the run must report reused tokens, and fewer tokens computed than without the cache. On
# stories260K and on a deepseek2 model (a cache of latent attention's rows).
set -euo pipefail
source "$(dirname "$0")/lib.bash"

stories=$(need_shared models/stories260K.gguf)

sys="Once upon a time there was a little girl who loved to play in the park with her dog and"
sys="$sys her cat. Every day she went to the park and played with her friends in the sun"
words=(One day she saw a big red ball under the tree near the pond and she wanted to play)
for i in $(seq 0 11); do
    n=$(( (i * 5) % 17 + 1 ))
    case $((i % 3)) in
    0) text="$sys. ${words[*]:0:$n}" ;;              # the long shared prefix
    1) text="${words[*]:0:$((n + 4))} and then" ;;   # shorter shared openings
    2) text="$sys. ${words[*]:0:8} ${words[*]:0:$n}" ;; # an earlier turn, continued
    esac
    if [ $((i % 2)) = 0 ]; then
        echo "{\"prompt\": \"$text\", \"temperature\": 0, \"max_tokens\": $((12 + i))}"
    else
        echo "{\"prompt\": \"$text\", \"temperature\": 0.9, \"top_k\": 40, \"top_p\": 0.95, \"seed\": $((1000 + i)), \"max_tokens\": $((12 + i))}"
    fi
done >"$TMP/prompts.jsonl"

check_model() { # check_model MODEL TAG
    local mode flag line hits nohits comp nocomp
    timeout 120 "$KVASIR" run -m "$1" --prompts "$TMP/prompts.jsonl" --json --ignore-eos \
        -t 1 >"$TMP/$2.ref.jsonl" 2>"$TMP/$2.ref.log" ||
        { cat "$TMP/$2.ref.log"; fail "$2: single-process run"; }
    [ "$(wc -l <"$TMP/$2.ref.jsonl")" = 12 ] || fail "$2: expected 12 reference lines"

    start_ring "$1" 3 3 "ring-$2" --max-seqs 4 --kv-block 8
    for mode in cache nocache; do
        flag=""
        [ $mode = nocache ] && flag=--no-prefix-cache
        # shellcheck disable=SC2086
        timeout 120 "$KVASIR" run --plan "$RING_PLAN" --prompts "$TMP/prompts.jsonl" --json \
            --ignore-eos $flag >"$TMP/$2.$mode.jsonl" 2>"$TMP/$2.$mode.log" ||
            { cat "$TMP/$2.$mode.log"; fail "$2: ring run ($mode)"; }
        if ! cmp -s "$TMP/$2.ref.jsonl" "$TMP/$2.$mode.jsonl"; then
            diff "$TMP/$2.ref.jsonl" "$TMP/$2.$mode.jsonl" | head -20
            fail "$2: 3-stage ring ($mode) differs from the single process"
        fi
        line=$(grep "prefix cache:" "$TMP/$2.$mode.log") || fail "$2: $mode: no prefix cache line"
        echo "ok: $2, 3 stages in flight, $mode: 12/12 sequences identical; $line"
    done
    hits=$(grep -o 'cache: [0-9]*' "$TMP/$2.cache.log" | grep -o '[0-9]*$')
    nohits=$(grep -o 'cache: [0-9]*' "$TMP/$2.nocache.log" | grep -o '[0-9]*$')
    comp=$(grep -o '[0-9]* computed' "$TMP/$2.cache.log" | grep -o '^[0-9]*')
    nocomp=$(grep -o '[0-9]* computed' "$TMP/$2.nocache.log" | grep -o '^[0-9]*')
    [ "$hits" -gt 0 ] || fail "$2: the prefix cache reused no token"
    [ "$nohits" = 0 ] || fail "$2: --no-prefix-cache reused $nohits tokens"
    [ "$comp" -lt "$nocomp" ] ||
        fail "$2: with the cache $comp prompt tokens computed, without $nocomp"
    stop_ring
}

check_model "$stories" stories
# deepseek2 (issue 35): the cache holds latents (model/mla.h), mapped and reused the same way.
"$KVASIR" synth --arch deepseek2 --shape tiny --q-lora 32 --type q8_0 --seed 5 \
    --logit-scale 4 -o "$TMP/ds.gguf" >/dev/null 2>&1 || fail "synth deepseek2"
check_model "$TMP/ds.gguf" deepseek2
echo "PASS"
