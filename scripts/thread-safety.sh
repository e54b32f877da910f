#!/usr/bin/env bash
# The thread-safety build: every C++ source of the tree, compiled as CMake compiles it (the
# build's compile_commands.json), by clang++ with -Wthread-safety -Werror. Clang checks the
# annotations of common/thread_annotations.h: a member marked ELASTIC_GUARDED_BY(mu) touched
# without `mu` held, or a function marked ELASTIC_REQUIRES(mu) called without it, fails the
# build. -fsyntax-only: the analysis runs in clang's semantic pass, so no code is generated.
# It also fails on a std::mutex, std::lock_guard or std::unique_lock<std::mutex> declared
# outside tests/ (the analysis sees only common/mutex.h's Mutex), and first makes sure clang
# rejects a probe that breaks the rule (annotations compiled out would check nothing).
#
#   BUILD_DIR=build scripts/thread-safety.sh     # after cmake has configured BUILD_DIR
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$(pwd)
BUILD_DIR=${BUILD_DIR:-$ROOT/build}
export CLANG=${CLANG:-clang++}
command -v "$CLANG" >/dev/null || { echo "thread-safety: $CLANG not found (apt-get install clang)" >&2; exit 1; }
[ -f "$BUILD_DIR/compile_commands.json" ] ||
  { echo "thread-safety: $BUILD_DIR/compile_commands.json missing: configure $BUILD_DIR with cmake first" >&2; exit 1; }
exec python3 - "$BUILD_DIR/compile_commands.json" "$ROOT" "$BUILD_DIR" "${JOBS:-$(nproc)}" <<'PY'
import concurrent.futures, json, os, re, shlex, subprocess, sys

db, root, build, jobs = sys.argv[1], os.path.realpath(sys.argv[2]), os.path.realpath(sys.argv[3]), int(sys.argv[4])
clang = os.environ["CLANG"]
FLAGS = ["-fsyntax-only", "-Wthread-safety", "-Werror"]

def command(entry):
    """The entry's compile command with clang++ as the compiler, checking only."""
    args = entry.get("arguments") or shlex.split(entry["command"])
    out, skip = [clang], False
    for a in args[1:]:
        if skip:
            skip = False
        elif a in ("-o", "-MF", "-MT", "-MQ"):
            skip = True  # output and dependency files: nothing is written
        elif a not in ("-c", "-MD", "-MMD"):
            out.append(a)
    return out + FLAGS

sources = {}
for entry in json.load(open(db)):
    src = os.path.realpath(os.path.join(entry["directory"], entry["file"]))
    # Ours only: the generated protobuf sources live in the build folder.
    if src.startswith(root + "/") and not src.startswith(build + "/") and src.endswith(".cc"):
        sources.setdefault(src, entry)

def check(item):
    src, entry = item
    try:
        r = subprocess.run(command(entry), cwd=entry["directory"], capture_output=True, text=True,
                           timeout=600)
        return src, r.returncode, r.stdout + r.stderr
    except subprocess.TimeoutExpired:
        return src, 124, "clang++ ran past 600 s\n"

# A bare std::mutex or std::lock_guard outside tests/ would escape the analysis: none.
bare = re.compile(r"\bstd::(recursive_|shared_|timed_)?mutex\s+\w+\s*[;{(]|std::(lock_guard|scoped_lock)\b"
                  r"|std::unique_lock<std::mutex>\s+\w+\s*\(")
found = []
for src in sorted(set(sources) | {os.path.join(root, h) for h in subprocess.run(
        ["git", "-C", root, "ls-files", "*.h"], capture_output=True, text=True).stdout.split()}):
    rel = os.path.relpath(src, root)
    if rel.startswith("tests/") or rel == "common/mutex.h" or not os.path.exists(src):
        continue
    for n, line in enumerate(open(src, errors="replace"), 1):
        if bare.search(line):
            found.append(f"{rel}:{n}: {line.strip()}")
if found:
    print("thread-safety: a mutex the analysis cannot see (use common/mutex.h's Mutex and "
          "MutexLock):\n" + "\n".join(found), file=sys.stderr)
    sys.exit(1)

# First, that the check can fail: a member touched without its mutex must be rejected (were
# the annotations compiled out, every source would pass while checking nothing).
probe = """#include "common/mutex.h"
struct Probe { elastic::Mutex mu; int n ELASTIC_GUARDED_BY(mu) = 0; void Bump() { ++n; } };
"""
r = subprocess.run([clang, "-std=c++17", "-I", root, "-x", "c++", "-", *FLAGS], input=probe,
                   capture_output=True, text=True, timeout=120)
if r.returncode == 0 or "requires holding mutex" not in r.stderr:
    print("thread-safety: clang accepted a guarded member touched without its mutex: the "
          "annotations of common/thread_annotations.h are not checked\n" + r.stderr, file=sys.stderr)
    sys.exit(1)
print(f"thread-safety: {len(sources)} sources, {clang} {' '.join(FLAGS)}", flush=True)
failed = 0
with concurrent.futures.ThreadPoolExecutor(max_workers=max(1, jobs)) as pool:
    for src, rc, text in pool.map(check, sorted(sources.items())):
        if rc != 0:
            failed += 1
            print(f"== {os.path.relpath(src, root)}\n{text}", flush=True)
if failed:
    print(f"thread-safety: {failed} of {len(sources)} sources fail", file=sys.stderr)
    sys.exit(1)
print("thread-safety: every source passes")
PY
