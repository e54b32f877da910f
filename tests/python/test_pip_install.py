"""The third way in (README): `pip install <clone>` in a new virtual environment alone gives
`elastic-run` on PATH and `import elastic`, with no PYTHONPATH and no other step. The clone is
built by pip through scikit-build-core (pyproject.toml) as a user's pip builds it; the job
then trains under a SIGKILL of a worker and ends with the fault-free model, every sample once."""
import os
import pathlib
import signal
import subprocess
import sys
import time

import ledger
from helpers import Job, events, run, worker_pid

ROOT = pathlib.Path(__file__).resolve().parents[2]
WORKER = str(ROOT / "tests" / "python" / "workers" / "train_state.py")


def user_env(venv):
    """A shell of a user who activated the new environment: its bin first on PATH, nothing of
    the test's own environment (no PYTHONPATH, no VIRTUAL_ENV of the build's)."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("PYTHONPATH", "VIRTUAL_ENV", "PYTHONHOME")}
    env["PATH"] = f"{venv}/bin:" + env.get("PATH", "")
    env["VIRTUAL_ENV"] = str(venv)
    return env


def test_pip_install_of_the_clone_gives_elastic_run_and_the_package(tmp_path):
    venv = tmp_path / "venv"
    # A new environment from the interpreter behind this one, with nothing in it.
    base = getattr(sys, "_base_executable", sys.executable)
    subprocess.run([base, "-m", "venv", str(venv)], check=True, timeout=120)
    env = user_env(venv)
    p = subprocess.run([str(venv / "bin" / "pip"), "install", "-q", str(ROOT)], env=env,
                       cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                       text=True, timeout=1800)
    assert p.returncode == 0, p.stdout[-20000:]

    # elastic-run is on the environment's PATH; the package imports from site-packages.
    assert (venv / "bin" / "elastic-run").exists()
    rc, out = run(["elastic-run", "--version"], env=env, timeout=30)
    assert rc == 0 and "elastic-run" in out, out
    p = subprocess.run(["python", "-c", "import elastic, sys; print(elastic.__file__)"],
                       env=env, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                       text=True, timeout=60)
    assert p.returncode == 0, p.stdout
    assert p.stdout.strip().startswith(str(venv / "lib")), p.stdout

    # The fault-free model, then the same job with a worker killed by SIGKILL mid-training.
    rc, out = run(["elastic-run", "-np", "2", "python", WORKER, "4", str(tmp_path / "ff")],
                  env=env, timeout=180)
    assert rc == 0, out
    want = out.split("final weights ")[1].split()[0]
    log, book = str(tmp_path / "events.jsonl"), str(tmp_path / "ledger")
    # Elastic (--min-np 1): the survivor goes on, and a new process for the killed slot joins
    # it (--host-failure-limit 0: this machine is not blacklisted for the kill).
    job = Job(["elastic-run", "-np", "2", "--min-np", "1", "--host-failure-limit", "0",
               "--event-log", log, "python", WORKER, "4", book], env=env)
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and len(ledger.read(book)) < 30:
            time.sleep(0.05)
        os.kill(worker_pid(log, "localhost:1"), signal.SIGKILL)
        assert job.wait(timeout=180) == 0, job.text()
    finally:
        job.kill()
    assert f"final weights {want}" in job.text(), job.text()
    sizes = [len(e["members"]) for e in events(log) if e["event"] == "round_formed"]
    assert sizes[0] == 2 and 1 in sizes, sizes  # re-formed without the killed worker
    problems = ledger.check(book, 512, 4, max_rollback=4)
    assert not problems, "\n".join(problems)
