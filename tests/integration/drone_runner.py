#!/usr/bin/env python3
"""The part of Drone's exec runner that clones, starts, logs and cancels one step, as the real
runner (drone-runner-exec, `exec` mode) does it (../shared/design/drone-exec.md):

  drone_runner.py ROOT REPO STEP SCRIPT_TEXT ENV_JSON

- it leads a session of its own (the real runner is a session leader under systemd): the step
  shell's process group and session are the runner's;
- the workspace is `ROOT/drone-<16 random chars>/{home/drone, drone/src, opt/STEP}`, every
  directory mode 0700, `home/drone/.netrc` beside; a clone step of its own clones REPO into
  `drone/src` first (a real `git clone`), and the step's script goes to `opt/STEP`;
- the step is `/bin/sh -e opt/STEP`, started from `drone/src` with exactly the environment in
  ENV_JSON (the runner builds it; the step never sees the runner's own), stdin /dev/null;
- its stdout and stderr are one pipe, which the runner copies into the build log (our stdout);
- SIGINT or SIGTERM to the runner cancels the build: SIGKILL to the step shell's pid alone, no
  wait for it or its children; the workspace removed 13-45 ms after the signal without waiting
  for anything; the log read on until EOF or until the runner exits, RUNNER_READ_ON_MS after
  the signal (100 by default, as measured: 14-193 ms; 0 is daemon mode, which stops reading at
  once); `received signal, terminating process` on stderr; exit 0;
- a step that ends by itself is waited for (with its log read to the end: every process that
  holds the pipe), then the workspace is removed and the runner exits 0, or 1 on a failed step
  (never printing the step's code).

It prints `runner PID shell PID workspace DIR` on stderr once the step shell runs. Killing this
process (SIGKILL) is the runner's own death: nobody kills the step shell then, and nobody
removes the workspace.
"""
import json
import os
import secrets
import select
import shutil
import signal
import subprocess
import sys
import threading
import time


class Cancelled(Exception):
    pass


def cancel(signum, frame):
    raise Cancelled(signum)


def workspace(root, step):
    base = os.path.join(root, "drone-" + secrets.token_hex(8))
    for sub in ("home/drone", "drone/src", "opt"):
        os.makedirs(os.path.join(base, sub), mode=0o700, exist_ok=True)
    for sub in ("", "home", "home/drone", "drone", "drone/src", "opt"):
        os.chmod(os.path.join(base, sub), 0o700)
    with open(os.path.join(base, "home/drone/.netrc"), "w") as netrc:
        netrc.write("")
    return base


def main():
    root, repo, step_name, script_text, env_json = sys.argv[1:6]
    env = json.loads(env_json)
    read_on = int(os.environ.get("RUNNER_READ_ON_MS", "100")) / 1000.0
    try:
        os.setsid()
    except OSError:
        pass
    base = workspace(root, step_name)
    src = os.path.join(base, "drone/src")
    # The clone step: a step of its own, before the pipeline's.
    subprocess.run(
        ["git", "clone", "-q", repo, src],
        check=True,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        env={"PATH": os.environ.get("PATH", ""), "HOME": os.path.join(base, "home/drone")},
    )
    script = os.path.join(base, "opt", step_name)
    with open(script, "w") as f:
        f.write(script_text)
    env["DRONE_WORKSPACE"] = src
    env["CI_WORKSPACE"] = src
    env["PWD"] = src
    signal.signal(signal.SIGINT, cancel)
    signal.signal(signal.SIGTERM, cancel)
    step = subprocess.Popen(
        ["/bin/sh", "-e", script],
        cwd=src,
        env=env,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    print(f"runner {os.getpid()} shell {step.pid} workspace {src}", file=sys.stderr, flush=True)
    log = sys.stdout.buffer
    out = step.stdout.fileno()
    try:
        while True:
            chunk = os.read(out, 65536)
            if not chunk:
                break
            log.write(chunk)
            log.flush()
        code = step.wait()
    except Cancelled:
        step.kill()
        # The workspace goes 13-45 ms after the signal, whatever is still running in it.
        remove = threading.Timer(0.02, shutil.rmtree, args=(base,), kwargs={"ignore_errors": True})
        remove.start()
        print("received signal, terminating process", file=sys.stderr, flush=True)
        end = time.monotonic() + read_on
        while True:
            left = end - time.monotonic()
            if left <= 0:
                break
            ready, _, _ = select.select([out], [], [], left)
            if not ready:
                break
            chunk = os.read(out, 65536)
            if not chunk:
                break
            try:
                log.write(chunk)
                log.flush()
            except BrokenPipeError:
                break
        time.sleep(0.05)
        # The removal is under way, not waited for by the cancel; the process ends only once it
        # is done (os._exit would cut it short on a busy machine, leaving half a workspace).
        remove.join()
        os._exit(0)
    shutil.rmtree(base, ignore_errors=True)
    sys.exit(0 if code == 0 else 1)


if __name__ == "__main__":
    main()
