#!/usr/bin/env python3
"""Host discovery for Kubernetes: prints `pod:slots` for every Ready, running pod that a label
selector picks, so that elastic-run follows the pods as they come and go.

    elastic-run --min-np 2 --max-np 16 \\
      --host-discovery-script 'scripts/discovery/kubernetes.py -l app=trainer --slots 1' \\
      --launcher-template 'kubectl exec -i {host} -- sh -c {command}' \\
      --driver-address "$(hostname -i)" python3 train.py

Slots: the pod's `elastic-run/slots` annotation, else --slots (1). Pods being deleted, not
Running, or whose Ready condition is not True are left out. Runs `kubectl get pods -l SELECTOR
-o json` (with -n NAMESPACE when given); kubectl must be on PATH and configured.
"""
import argparse
import json
import subprocess
import sys


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("-l", "--selector", required=True, help="label selector, e.g. app=trainer")
    ap.add_argument("-n", "--namespace", help="namespace (default: kubectl's)")
    ap.add_argument("--slots", type=int, default=1, help="slots of a pod without annotation")
    ap.add_argument("--kubectl", default="kubectl")
    a = ap.parse_args()
    cmd = [a.kubectl, "get", "pods", "-l", a.selector, "-o", "json"]
    if a.namespace:
        cmd += ["-n", a.namespace]
    try:
        p = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                           timeout=30)
    except FileNotFoundError:
        sys.exit(f"kubernetes.py: {a.kubectl} is not on PATH")
    except subprocess.TimeoutExpired:
        sys.exit("kubernetes.py: kubectl did not answer within 30 s")
    if p.returncode != 0:
        sys.exit(f"kubernetes.py: kubectl failed ({p.returncode}): {p.stderr.strip()}")
    try:
        pods = json.loads(p.stdout)["items"]
    except (ValueError, KeyError) as e:
        sys.exit(f"kubernetes.py: kubectl's output is not a pod list ({e})")
    for pod in pods:
        meta, status = pod.get("metadata", {}), pod.get("status", {})
        if meta.get("deletionTimestamp") or status.get("phase") != "Running":
            continue
        ready = any(c.get("type") == "Ready" and c.get("status") == "True"
                    for c in status.get("conditions", []))
        if not ready:
            continue
        slots = meta.get("annotations", {}).get("elastic-run/slots", a.slots)
        try:
            slots = int(slots)
        except ValueError:
            print(f"kubernetes.py: pod {meta.get('name')}: annotation elastic-run/slots is "
                  f"not a number: {slots!r}", file=sys.stderr)
            continue
        print(f"{meta['name']}:{slots}")


if __name__ == "__main__":
    main()
