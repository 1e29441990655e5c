#!/usr/bin/env python3
"""The part of Drone's exec runner that clones, starts, logs and cancels one step, as the real
runner (drone-runner-exec 9decf29) does it (docs/operations.md; each behaviour's source line is
in tests/integration/drone.rs, `RUNNER_PARITY`):

  drone_runner.py ROOT REPO STEP SCRIPT_TEXT ENV_JSON [STEP_ENV_JSON]

- it leads a session of its own (the real runner is a session leader under systemd): the step
  shell's process group and session are the runner's;
- the workspace is `ROOT/drone-<16 random chars>` (0755, as MkdirAll(root, 0777) makes it under
  umask 022) with `home/drone`, `drone/src` and `opt` (each 0700, their parents too), the
  `.netrc` exec mode always writes (0600, `machine  login  password `), the clone script
  `opt/clone` and the step's `opt/STEP` (0700); a clone of REPO into `drone/src` first (a real
  `git clone`);
- the step is `/bin/sh -e opt/STEP`, started from `drone/src` with exactly the environment in
  ENV_JSON (the runner builds it; the step never sees the runner's own), plus what the runner
  sets from the workspace (HOME, HOMEPATH, USERPROFILE = `home/drone`; DRONE_HOME,
  DRONE_WORKSPACE = `drone/src`), then the step's `environment:` (STEP_ENV_JSON); stdin
  /dev/null;
- its stdout and stderr are one pipe, which the runner copies into the build log (our stdout);
- exec mode (RUNNER_MODE unset or `exec`): SIGINT or SIGTERM cancels the build: SIGKILL to the
  step shell's pid alone, no wait for it or its children; `received signal, terminating
  process` on stderr; the workspace removed at once (sequentially, as Destroy runs after the
  step returns), without waiting for anything; the log read on meanwhile, until EOF or until
  the runner exits right after the removal; exit 0. A second SIGINT or SIGTERM while it stops
  kills the runner by that signal (its handler is gone), the workspace left if its removal had
  not finished;
- daemon mode (RUNNER_MODE=daemon): the cancel arrives over RPC (here: the same signals, and
  `cancel received` on stderr); the step shell is SIGKILLed and the workspace removed as above, but the daemon never exits and
  its log writer never errors: the step's output is read until EOF, every line logged; then
  the stand-in exits 0 (the daemon would go on to its next build);
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
import shutil
import signal
import subprocess
import sys
import threading


class Cancelled(Exception):
    pass


def cancel(signum, frame):
    # Like the runner's signal package: after the first signal its handler is gone, and a
    # second one kills the runner by its default action.
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    raise Cancelled(signum)


def workspace(root):
    os.umask(0o022)
    os.makedirs(root, mode=0o777, exist_ok=True)
    base = os.path.join(root, "drone-" + secrets.token_hex(8))
    os.makedirs(base, mode=0o777)
    for sub in ("home/drone", "drone/src", "opt"):
        path = base
        for part in sub.split("/"):
            path = os.path.join(path, part)
            if not os.path.isdir(path):
                os.mkdir(path, 0o700)
    netrc = os.path.join(base, "home/drone/.netrc")
    fd = os.open(netrc, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    os.write(fd, b"machine  login  password ")
    os.close(fd)
    return base


def write_script(path, text):
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o700)
    os.write(fd, text.encode())
    os.close(fd)


def main():
    root, repo, step_name, script_text, env_json = sys.argv[1:6]
    step_env = json.loads(sys.argv[6]) if len(sys.argv) > 6 else {}
    env = json.loads(env_json)
    daemon = os.environ.get("RUNNER_MODE", "exec") == "daemon"
    try:
        os.setsid()
    except OSError:
        pass
    base = workspace(root)
    home = os.path.join(base, "home/drone")
    src = os.path.join(base, "drone/src")
    env.update(
        {
            "HOME": home,
            "HOMEPATH": home,
            "USERPROFILE": home,
            "DRONE_HOME": src,
            "DRONE_WORKSPACE": src,
        }
    )
    env.update(step_env)
    # The clone step: a step of its own, before the pipeline's.
    clone = os.path.join(base, "opt/clone")
    write_script(clone, f"\nset -e\n\ngit clone -q {repo} .\n")
    subprocess.run(
        ["git", "clone", "-q", repo, src],
        check=True,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        env={"PATH": os.environ.get("PATH", ""), "HOME": home},
    )
    script = os.path.join(base, "opt", step_name)
    write_script(script, script_text)
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

    def copy_log():
        while True:
            chunk = os.read(out, 65536)
            if not chunk:
                return
            try:
                log.write(chunk)
                log.flush()
            except BrokenPipeError:
                if not daemon:
                    return

    try:
        copy_log()
        code = step.wait()
    except Cancelled:
        step.kill()
        if daemon:
            print("cancel received", file=sys.stderr, flush=True)
        else:
            print("received signal, terminating process", file=sys.stderr, flush=True)
        reader = threading.Thread(target=copy_log, daemon=True)
        reader.start()
        # Destroy: the whole workspace, whatever still runs in it.
        shutil.rmtree(base, ignore_errors=True)
        if daemon:
            reader.join()
        else:
            # The exec runner exits right after: the log is cut there.
            sys.stdout.flush()
        os._exit(0)
    shutil.rmtree(base, ignore_errors=True)
    sys.exit(0 if code == 0 else 1)


if __name__ == "__main__":
    main()
