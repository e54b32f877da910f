"""What the sources cite exists: a comment that sends the reader to docs/…, or to another file
of the repository, names a file the repository has, and none cites a design document it does
not have ("DESIGN §N"; issue 28, "one name per thing")."""
import pathlib
import re
import subprocess

ROOT = pathlib.Path(__file__).resolve().parents[2]
SUFFIXES = {".cc", ".h", ".py", ".proto", ".sh", ".txt", ".cmake", ".in"}
# A path a comment cites: docs/x.md, or a source of one of the modules.
FOLDERS = ("docs|common|rendezvous|discovery|state|worker_agent|driver|python|bench|tests|scripts|"
           "examples|proto")
CITED = re.compile(r"(?<![\w/.-])((?:" + FOLDERS +
                   r")/[A-Za-z0-9_./-]+\.(?:md|cc|h|py|sh|proto))\b")


def tracked():
    out = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True)
    for name in out.stdout.splitlines():
        path = ROOT / name
        # This file names what it looks for.
        if path.suffix in SUFFIXES and path.is_file() and path != pathlib.Path(__file__).resolve():
            yield name, path.read_text(errors="replace")


def test_no_source_cites_a_document_the_repository_lacks():
    bad = [f"{name}:{n}" for name, text in tracked()
           for n, line in enumerate(text.splitlines(), 1)
           if re.search(r"DESIGN(\.md| §)|STYLE\.md", line)]
    assert bad == [], bad


def comments(text):
    """The comment lines of a source (// or #, not a preprocessor line), and docstrings' lines."""
    for line in text.splitlines():
        stripped = line.strip()
        if stripped.startswith("//") or (stripped.startswith("#") and not re.match(
                r"#\s*(include|define|if|endif|else|pragma|undef|elif)\b", stripped)):
            yield stripped
        elif "//" in line:
            yield line[line.index("//"):]


def test_every_file_a_comment_cites_exists():
    missing = []
    for name, text in tracked():
        for line in comments(text):
            for cited in CITED.findall(line):
                if not cited.endswith(".pb.h") and not (ROOT / cited).exists():
                    missing.append(f"{name}: {cited}")
    assert missing == [], "\n".join(sorted(set(missing)))
