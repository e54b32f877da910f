"""What the soak's jobs train, and how each says that the model is the fault-free one.

CppWorkload: examples/logistic_regression (the C++ API); its gradients are exact fixed-point
sums, so the final model's hash must equal the fault-free run's, bit for bit.
PythonWorkload: examples/train_digits.py, PyTorch with DataLoader(num_workers=2), TorchState,
ElasticSampler and DistributedOptimizer. Its gradients are float32 sums, which another world
size adds in another order: the final weights must be within 1e-4 of the fault-free run's
(runs at 2-4 workers differ by < 1e-6; a lost or repeated batch moves them by ~1e-2).
Both write a ledger (tests/python/ledger.py) of every step's sample indices per rank.
"""
import sys
import pathlib
import re

import ledger

ROOT = pathlib.Path(__file__).resolve().parents[2]
PY = sys.executable  # the environment of scripts/setup-deps.sh (scripts/soak.sh runs it)


class CppWorkload:
    name = "cpp"
    samples = 4096
    commit_every = 4
    min_np, max_np = 2, 6

    def __init__(self, build, epochs, step_ms):
        self.example = str(build / "examples" / "logistic_regression")
        self.epochs = epochs
        self.args = ["--samples", str(self.samples), "--epochs", str(epochs), "--step-ms",
                     str(step_ms), "--commit-every", str(self.commit_every)]

    def command(self, folder):
        return [self.example] + self.args + ["--ledger", str(folder / "ledger")]

    def baseline_command(self, folder):
        return [self.example] + self.args

    def baseline(self, out, folder):
        return ledger.final_hash(out)

    def model_problems(self, out, folder, want):
        got = ledger.final_hash(out)
        return [] if got == want else [f"final model hash {got}, fault-free {want}"]

    def epoch_done(self, text, epoch):
        """Rank 0 said it finished `epoch` or a later one (a rollback can skip a line)."""
        return any(int(m) >= epoch for m in re.findall(r"epoch (\d+) done", text)) or \
            "final: " in text


class PythonWorkload:
    name = "python"
    samples = 1500  # the training split of scikit-learn's digits
    commit_every = 5
    min_np, max_np = 2, 4
    tolerance = 1e-4

    def __init__(self, build, epochs, step_ms):
        self.epochs = epochs
        self.script = str(ROOT / "examples" / "train_digits.py")
        self.args = ["--epochs", str(epochs), "--step-ms", str(step_ms), "--commit-every",
                     str(self.commit_every), "--loader-workers", "2"]

    def command(self, folder):
        return [PY, self.script] + self.args + ["--ledger", str(folder / "ledger"),
                                                "--save", str(folder / "model.pt")]

    def baseline_command(self, folder):
        return [PY, self.script] + self.args + ["--save", str(folder / "fault-free.pt")]

    def baseline(self, out, folder):
        path = folder / "fault-free.pt"
        return str(path) if path.exists() and "final: " in out else None

    def model_problems(self, out, folder, want):
        import torch
        path = folder / "model.pt"
        if not path.exists():
            return ["rank 0 saved no final model"]
        a, b = torch.load(str(path)), torch.load(want)
        if a.keys() != b.keys():
            return [f"the final model has tensors {sorted(a)}, the fault-free one {sorted(b)}"]
        diff = max((a[k] - b[k]).abs().max().item() for k in a)
        if diff >= self.tolerance:
            return [f"final weights differ from the fault-free run's by {diff:.3g} "
                    f"(tolerance {self.tolerance})"]
        return []

    def epoch_done(self, text, epoch):
        """Rank 0 said it finished `epoch` or a later one (a rollback can skip a line)."""
        return any(int(m) >= epoch for m in re.findall(r"epoch (\d+) done:", text)) or \
            "final: " in text
