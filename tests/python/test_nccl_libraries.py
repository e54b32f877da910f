"""Which NCCL and CUDA runtime the NCCL backend loads (worker_agent/nccl_api.h, LoadNcclApi):
the one torch already loaded in the process, else PyPI's wheels of the environment, else the
system's; an explicit ELASTIC_NCCL_LIBRARY first. Real libraries from the wheels torch brings
(nvidia-nccl-cu13, nvidia-cuda-runtime): loading them and asking NCCL its version needs no GPU."""
import os
import subprocess
import sys

import pytest


def child(code, env=None):
    p = subprocess.run([sys.executable, "-c", code], env=env, stdout=subprocess.PIPE,
                       stderr=subprocess.STDOUT, text=True, timeout=120)
    assert p.returncode == 0, p.stdout
    return p.stdout


def wheel_nccl():
    import importlib.util
    spec = importlib.util.find_spec("nvidia")
    roots = list(spec.submodule_search_locations) if spec else []
    found = [os.path.join(r, "nccl", "lib", "libnccl.so.2") for r in roots]
    found = [p for p in found if os.path.exists(p)]
    if not found:
        pytest.skip("no nvidia-nccl wheel in this environment (scripts/setup-deps.sh installs one)")
    return found[0]


def test_the_nccl_torch_loaded_is_the_one_used(tmp_path):
    wheel = wheel_nccl()
    out = child("import torch, elastic\n"
                "maps = open('/proc/self/maps').read()\n"
                "print('torch-loaded', sorted({l.split()[-1] for l in maps.splitlines() "
                "if 'libnccl' in l}))\n"
                "print('torch-version', '.'.join(map(str, torch.cuda.nccl.version())))\n"
                "print('chosen', elastic._C._nccl_libraries())\n")
    lines = dict(l.split(" ", 1) for l in out.splitlines() if " " in l)
    torch_loaded = eval(lines["torch-loaded"])
    assert torch_loaded, out
    chosen = lines["chosen"]
    assert f"from {os.path.realpath(torch_loaded[0])}" in chosen or \
        f"from {torch_loaded[0]}" in chosen, out
    assert "already loaded in this process" in chosen, out
    assert f"NCCL {lines['torch-version']} " in chosen, out
    assert os.path.samefile(torch_loaded[0], wheel)


def test_without_torch_the_environments_wheel_is_used():
    wheel = wheel_nccl()
    out = child("import sys, elastic\n"
                "assert 'torch' not in sys.modules\n"
                "print(elastic._C._nccl_libraries())\n")
    assert f"from {wheel} (PyPI's wheel" in out, out
    assert "CUDA runtime from " in out and "libcudart.so." in out, out


def test_an_explicit_library_comes_first(tmp_path):
    wheel = wheel_nccl()
    # A copy elsewhere: the given path, not the wheel's, must be the one loaded.
    copy = tmp_path / "libnccl.so.2"
    copy.write_bytes(open(wheel, "rb").read())
    out = child("import elastic\n"
                f"print(elastic._C._nccl_libraries(nccl={str(copy)!r}))\n")
    assert f"from {copy} (given by ELASTIC_{{NCCL,CUDART}}_LIBRARY)" in out, out


def test_an_explicit_path_that_does_not_load_falls_through_to_the_next():
    wheel = wheel_nccl()
    out = child("import elastic\n"
                "print(elastic._C._nccl_libraries(nccl='/nonexistent/libnccl.so.2'))\n")
    assert f"from {wheel} (PyPI's wheel" in out, out
