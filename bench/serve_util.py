"""bench/serve_util.py - shared by the Python serving benchmarks (burst.py, stage_loss.py,
telemetry_cost.py): the default model and `kvasir serve` started and stopped."""
import os
import re
import signal
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT_MODEL = os.path.join(ROOT, "models", "tinyllama-1.1b-q4_0.gguf")


def ensure_model(kvasir, path, shape="tinyllama-1.1b", wtype="q4_0"):
    """Synthesises the model at `path` (the README's default: TinyLlama-1.1B shape, Q4_0,
    random weights) when it is missing."""
    if not os.path.exists(path):
        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
        subprocess.run([kvasir, "synth", "--shape", shape, "--type", wtype, "-o", path],
                       check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def start_server(kvasir, serve_args, log_path, env=None, who="bench"):
    """Starts `kvasir serve --port 0 SERVE_ARGS...` with its output in log_path; returns
    (process, URL) once it says it is ready, or exits with its log after 120 s."""
    proc = subprocess.Popen([kvasir, "serve", "--port", "0"] + serve_args,
                            stdout=open(log_path, "w"), stderr=subprocess.STDOUT, env=env)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        with open(log_path) as f:
            m = re.search(r"^kvasir: ready on (http://\S+)$", f.read(), re.M)
        if m:
            return proc, m.group(1)
        if proc.poll() is not None:
            break
        time.sleep(0.2)
    proc.kill()
    sys.exit("%s: the server did not start:\n%s" % (who, open(log_path).read()))


def stop_server(proc):
    """SIGTERM (serve stops its ring in order), SIGKILL after 30 s."""
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
