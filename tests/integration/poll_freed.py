#!/usr/bin/env python3
"""poll_freed.py URL T0_FILE READY_FILE - how long after T0 the server's KV was all free.

Reads URL/metrics every 10 ms in this one process (a shell loop forking date, curl and awk
took hundreds of ms a round on a loaded machine, so one slow round could put a failure on a
server that had freed everything in time). Creates READY_FILE once it polls. Once T0_FILE
exists (bash's `mono_now` after the last client died: seconds of CLOCK_BOOTTIME, the clock
of /proc/uptime), it waits for the first read that started after T0 and shows
kvasir:kv_blocks_used 0 and kvasir:num_requests_running 0, and prints the milliseconds from
T0 to the end of that read (an upper bound on when the KV was freed). Gives up 10 s after
T0 and prints "never USED RUNNING" with the last values read.
"""
import os
import sys
import time
import urllib.request


def now():
    return time.clock_gettime(time.CLOCK_BOOTTIME)


def read(url):
    vals = {}
    with urllib.request.urlopen(url + "/metrics", timeout=5) as r:
        for line in r.read().decode().splitlines():
            name, _, v = line.partition(" ")
            name = name.split("{", 1)[0]  # the only label of these is model_name
            if name in ("kvasir:kv_blocks_used", "kvasir:num_requests_running"):
                vals[name] = v.strip()
    return vals.get("kvasir:kv_blocks_used"), vals.get("kvasir:num_requests_running")


def main():
    url, t0_file, ready = sys.argv[1:4]
    open(ready, "w").close()
    t0 = None
    start = now()
    while True:
        if t0 is None and os.path.exists(t0_file):
            with open(t0_file) as f:
                t0 = float(f.read().strip() or "nan")
        a = now()
        used, running = read(url)
        b = now()
        if t0 is not None and a >= t0 and used == "0" and running == "0":
            print("%d" % round((b - t0) * 1000))
            return
        if (t0 is not None and b > t0 + 10) or b > start + 300:
            print("never %s %s" % (used, running))
            return
        time.sleep(0.01)


main()
