#!/usr/bin/env python3
"""The part of Drone's exec runner that starts, logs and cancels one step, as the real runner
(drone-runner-exec) does it:

  drone_runner.py WORKSPACE SCRIPT ENV_JSON

- the step is `/bin/sh -e SCRIPT`, started from WORKSPACE with exactly the environment in
  ENV_JSON (the runner builds it; the step never sees the runner's own);
- its stdout and stderr are one pipe, which the runner copies into the build log (our stdout);
- SIGINT or SIGTERM to the runner cancels the build: SIGKILL to the step shell's pid alone, no
  wait for it or its children, the log pipe's reading end closed, the workspace removed at once,
  and the runner exits;
- a step that ends by itself is waited for (with its log read to the end: every process that
  holds the pipe), then the workspace is removed and the runner exits with the step's status.

It prints `runner PID shell PID` on stderr once the step shell runs. Killing this process
(SIGKILL) is the runner's own death: nobody kills the step shell then.
"""
import json
import os
import shutil
import signal
import subprocess
import sys


class Cancelled(Exception):
    pass


def cancel(signum, frame):
    raise Cancelled(signum)


def main():
    workspace, script, env_json = sys.argv[1:4]
    env = json.loads(env_json)
    signal.signal(signal.SIGINT, cancel)
    signal.signal(signal.SIGTERM, cancel)
    step = subprocess.Popen(
        ["/bin/sh", "-e", script],
        cwd=workspace,
        env=env,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    print(f"runner {os.getpid()} shell {step.pid}", file=sys.stderr, flush=True)
    log = sys.stdout.buffer
    try:
        for line in step.stdout:
            log.write(line)
            log.flush()
        code = step.wait()
    except Cancelled as why:
        step.kill()
        step.stdout.close()
        shutil.rmtree(workspace, ignore_errors=True)
        print(f"runner: cancelled by signal {why.args[0]}", file=sys.stderr, flush=True)
        sys.exit(1)
    shutil.rmtree(workspace, ignore_errors=True)
    print(f"runner: step exited {code}", file=sys.stderr, flush=True)
    sys.exit(0 if code == 0 else 1)


if __name__ == "__main__":
    main()
