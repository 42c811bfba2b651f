#!/usr/bin/env python3
"""kill_mid_stream.py KILL_AT PID FILE... - SIGKILL PID mid-stream, on an observed event.

Each FILE is a streamed completion's server-sent events as its client receives them (curl
-N -o FILE). Once every stream has delivered KILL_AT token events, PID gets SIGKILL; the
files are read every 10 ms by this one process, so the kill lands within a few tokens of
the mark even on a loaded machine (a shell loop forking greps lagged by 50-100 tokens at
load 16). Fails (exit status 1, a message on stderr) when a stream has ended before the
kill, at the mark or just after it (the run would prove nothing), or when the mark is not
reached within 300 s (curl's own limit in the tests). Prints the kill's time
(time.time(), the clock of the bridge's log) and each stream's token count then.
With KILL_READY=PATH in the environment it creates PATH once it watches, so a caller can
start the streams only then (python's start-up outlasted a whole 150-token stream on a
loaded machine).
"""
import os
import signal
import sys
import time


def main():
    kill_at, pid, files = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3:]
    seen = [b""] * len(files)

    def look():  # [(token events so far, ended)] of each stream
        for i, f in enumerate(files):
            try:
                with open(f, "rb") as fh:
                    fh.seek(len(seen[i]))
                    seen[i] += fh.read()
            except FileNotFoundError:
                pass
        return [(d.count(b"\ndata: {") + d.startswith(b"data: {"), b"data: [DONE]" in d)
                for d in seen]

    deadline = time.monotonic() + 300
    if os.environ.get("KILL_READY"):
        open(os.environ["KILL_READY"], "w").close()
    while True:
        st = look()
        if any(end for _, end in st):
            sys.exit("a stream ended before each had %d tokens: %s" % (kill_at, st))
        if all(n >= kill_at for n, _ in st):
            break
        if time.monotonic() > deadline:
            sys.exit("the streams did not deliver %d tokens each within 300 s: %s" % (kill_at, st))
        time.sleep(0.01)
    t = time.time()
    os.kill(pid, signal.SIGKILL)
    st = look()
    if any(end for _, end in st):
        sys.exit("a stream had ended at the kill, so the run proves nothing: %s" % st)
    print("%.6f %s" % (t, " ".join(str(n) for n, _ in st)))


main()
