"""A worker reads its environment in one file (worker_agent/worker_options.cc): no other source
of a worker reads an ELASTIC_* variable, the README's table names every variable that file
reads, and a bad value stops the worker with a message that names it (issue 28)."""
import sys
import os
import pathlib
import re

import pytest

from helpers import run

ROOT = pathlib.Path(__file__).resolve().parents[2]
READS = re.compile(r'(?:getenv|Env|EnvFlag)\("(ELASTIC_[A-Z0-9_]+)"')


def sources(*folders):
    for folder in folders:
        for path in sorted((ROOT / folder).rglob("*")):
            if path.suffix in (".cc", ".h"):
                yield path.relative_to(ROOT).as_posix(), path.read_text()


def test_only_worker_options_reads_the_workers_environment():
    readers = {}
    for name, text in sources("worker_agent", "state", "rendezvous", "common", "python/src"):
        found = set(READS.findall(text))
        if found and name != "worker_agent/worker_options.cc":
            readers[name] = found
    assert readers == {}, readers
    # The driver's own reads are in its main.
    driver = {n: set(READS.findall(t)) for n, t in sources("driver") if READS.findall(t)}
    assert list(driver) == ["driver/main.cc"], driver


def test_the_readme_table_lists_every_worker_variable():
    text = (ROOT / "worker_agent/worker_options.cc").read_text()
    listed = set(re.findall(r'"(ELASTIC_[A-Z0-9_]+)"',
                            text[text.index("kWorkerVariables[]"):text.index("kWorkerVariableCount")]))
    read = set(READS.findall(text)) | set(re.findall(r'Reader::\w+\("(ELASTIC_[A-Z0-9_]+)"', text))
    read |= set(re.findall(r'\{"(ELASTIC_[A-Z0-9_]+)", &o\.', text))
    assert read and read <= listed, read - listed
    readme = (ROOT / "README.md").read_text()
    table = readme[readme.index("| variable | what |"):]
    table = table[:table.index("\n\n")]
    missing = [v for v in sorted(listed) if f"`{v}`" not in table]
    assert not missing, missing


@pytest.mark.parametrize("variable,value,says", [
    ("ELASTIC_SHM_REUSE", "yes", "give 0 or 1"),
    ("ELASTIC_SHM_SLOT_BYTES", "12abc", "4096 to 268435456"),
    ("ELASTIC_STACK_SIGNAL", "99", "a signal number from 0 to 64"),
    ("ELASTIC_TEST_HOOKS", "after_save@*@*@*=explode", "POINT@SLOT@ROUND@VERSION="),
])
def test_a_bad_value_stops_the_worker_naming_it(elastic_run, example, variable, value, says):
    env = dict(os.environ, **{variable: value})
    rc, out = run([elastic_run, "-np", "1", example, "--epochs", "1"],
                  env=env, timeout=60)
    assert rc != 0, out
    assert f"{variable}='{value}' is not valid" in out and says in out, out


CATCHES_THE_END = """
import elastic

try:
    elastic.init()
except SystemExit as e:
    print(f"the program caught SystemExit({e.code})", flush=True)
    raise
print("not reached", flush=True)
"""


def test_a_python_worker_that_cannot_start_gets_systemexit_not_the_end_of_its_process(
        elastic_run, tmp_path):
    """The library never ends its host process: where a worker must end (here a bad value of
    its environment), the Python program gets SystemExit with the code, which it may catch
    (and whose finally blocks and atexit handlers run), after the message that names it."""
    script = tmp_path / "catches.py"
    script.write_text(CATCHES_THE_END)
    env = dict(os.environ, ELASTIC_SHM_REUSE="yes")
    extra = os.environ.get("ELASTIC_PYTHONPATH")  # a build tree instead of the install
    if extra:
        env["PYTHONPATH"] = extra
    rc, out = run([elastic_run, "-np", "1", sys.executable, str(script)], env=env,
                  timeout=60)
    assert rc == 2, out
    assert "ELASTIC_SHM_REUSE='yes' is not valid" in out, out
    assert "the program caught SystemExit(2)" in out, out
    assert "not reached" not in out, out
