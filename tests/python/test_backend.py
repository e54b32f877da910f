"""--backend: which communicator carries collectives on CUDA tensors (NCCL beside Gloo).

This machine kind has NCCL and the CUDA runtime but no GPU: `auto` must fall back to Gloo and
say nothing alarming; `nccl` must fail at once with a message that says why. On a machine with
a GPU the same tests check the NCCL path is taken instead. tests/gpu/run.sh runs the NCCL
collectives themselves."""
import os

from helpers import PY, py_env, run

PROBE = ("import elastic, sys; elastic.init(); "
         "print(f'rank {elastic.rank()} backend {elastic.backend()}', flush=True)")


def test_auto_is_the_default_and_falls_back_to_gloo_without_a_gpu(elastic_run, test_worker):
    rc, out = run([elastic_run, "-np", "2", PY, "-c", PROBE], env=py_env(), timeout=120)
    assert rc == 0, out
    backends = {line.split("backend ")[1].strip() for line in out.splitlines()
                if "backend " in line and "rank " in line}
    assert len(backends) == 1, out
    if os.path.exists("/dev/nvidia0"):
        assert backends == {"nccl"}, out
    else:
        assert backends == {"gloo"}, out
    # And the C++ worker's collectives run under the default.
    rc, out = run([elastic_run, "-np", "2", test_worker, "collectives"], timeout=120)
    assert rc == 0, out


def test_gloo_is_used_when_asked(elastic_run):
    rc, out = run([elastic_run, "-np", "2", "--backend", "gloo", PY, "-c", PROBE],
                  env=py_env(), timeout=120)
    assert rc == 0, out
    assert out.count("backend gloo") == 2, out


def test_nccl_without_a_gpu_fails_at_once_saying_why(elastic_run, test_worker):
    rc, out = run([elastic_run, "-np", "1", "--backend", "nccl", test_worker, "collectives"],
                  timeout=120)
    if os.path.exists("/dev/nvidia0"):  # a GPU machine: NCCL is taken
        assert rc == 0, out
        assert "backend: NCCL" in out, out
        return
    assert rc != 0, out
    assert "--backend nccl:" in out, out
    assert ("no CUDA device" in out or "CUDA driver" in out or "cannot load" in out
            or "no NCCL backend" in out), out


def test_a_cuda_tensor_under_gloo_is_a_clear_error(elastic_run):
    # torch here has no CUDA: the check is made on the device type before anything else, so a
    # tensor that claims to be on CUDA is enough. A meta-device stand-in is not: use the real
    # check on a fake object with torch's module name and a cuda device.
    code = r'''
import elastic
class Dev:
    type = "cuda"; index = 0
    def __str__(self): return "cuda:0"
class FakeCudaTensor:
    __module__ = "torch.fake"
    dtype = "torch.float32"
    device = Dev()
    def is_contiguous(self): return True
FakeCudaTensor.__module__ = "torch.fake"
elastic.init()
try:
    elastic.allreduce_(FakeCudaTensor())
except ValueError as e:
    print("ValueError:", e, flush=True)
'''
    rc, out = run([elastic_run, "-np", "1", "--backend", "gloo", PY, "-c", code],
                  env=py_env(), timeout=120)
    assert rc == 0, out
    assert "ValueError: allreduce_: the tensor is on cuda:0 but this worker's backend is gloo" \
        in out, out
    assert "--backend nccl" in out, out
