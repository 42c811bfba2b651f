#!/usr/bin/env python3
"""estimate_floor.py FILE - how good could admission's estimates be? (issue 15, point 4)

    rm -f /tmp/futures.txt
    KVR_SIM_FUTURES=/tmp/futures.txt build/test_sched   # ~1 min of CPU: forks a lot
    bench/estimate_floor.py /tmp/futures.txt

test_sched's fake ring (the estimates sweep: 0.2x to 1.2x capacity, 2 s / 6 s budgets) forks
itself at every admission of a measured request and follows that request through 16 futures
that differ only in what happens after it was admitted: the arrivals to come, their prompts,
the stage times' jitter. Everything the scheduler knew at admission is the same in all 16.

Per level this prints, over every request and future:
  - admission's own estimate: p90 of |estimate / actual - 1|, first token and whole answer;
  - the floor: the same p90 for the best estimate any estimator knowing the whole state at
    admission could have made, one number per request (the one that minimises the p90 of
    its own 16 errors); what is left is caused by the future alone;
  - the spread: the median over requests of (slowest future / fastest future).
Point 4 asks for p90 <= 0.25: where the floor is above it, no estimate made at admission
can meet it under this scheduling policy.
"""
import collections
import sys


def p90(xs):
    xs = sorted(xs)
    return xs[max(0, -(-9 * len(xs) // 10) - 1)]


def best_constant(outcomes):
    """The estimate that minimises the p90 of |e / a - 1| over one request's futures."""
    cands = set(outcomes)
    for i, a in enumerate(outcomes):
        for b in outcomes[i:]:
            cands.add((a + b) / 2)
            cands.add(2 * a * b / (a + b))  # equal relative error on both sides
    return min(cands, key=lambda e: p90([abs(e / a - 1) for a in outcomes]))


def main():
    reqs = collections.OrderedDict()  # (mix, rate, id) -> [(first, whole, est_first, est_whole)]
    for line in open(sys.argv[1]):
        mix, rate, rid, _prompt, _future, first, whole, ef, ew = line.split()
        reqs.setdefault((int(mix), float(rate), int(rid)), []).append(
            (float(first), float(whole), float(ef), float(ew)))
    levels = collections.OrderedDict()
    for (mix, rate, _), futures in reqs.items():
        levels.setdefault((mix, rate), []).append(futures)
    print("prompts   rate   reqs | estimate p90: first whole | floor p90: first whole | "
          "spread: first whole")
    for (mix, rate), rs in levels.items():
        est_f, est_w, fl_f, fl_w, sp_f, sp_w = [], [], [], [], [], []
        for futures in rs:
            first = [f[0] for f in futures]
            whole = [f[1] for f in futures]
            est_f += [abs(f[2] / f[0] - 1) for f in futures]
            est_w += [abs(f[3] / f[1] - 1) for f in futures]
            bf, bw = best_constant(first), best_constant(whole)
            fl_f += [abs(bf / a - 1) for a in first]
            fl_w += [abs(bw / a - 1) for a in whole]
            sp_f.append(max(first) / min(first))
            sp_w.append(max(whole) / min(whole))
        sp_f.sort()
        sp_w.sort()
        print("32-%-4d %6.2f %6d |        %5.2f %5.2f |     %5.2f %5.2f |    %5.2f %5.2f" % (
            mix, rate, len(rs), p90(est_f), p90(est_w), p90(fl_f), p90(fl_w),
            sp_f[len(sp_f) // 2], sp_w[len(sp_w) // 2]))


main()
