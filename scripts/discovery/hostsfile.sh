#!/bin/sh
# Host discovery from a file that an operator (or another program) edits: prints it. Lines are
# `host` or `host:slots`; blank lines and # comments are allowed. A missing file is an error
# (elastic-run keeps the last good host set and says so).
#
#   elastic-run --min-np 2 --host-discovery-script 'scripts/discovery/hostsfile.sh hosts.txt' ...
set -eu
if [ $# -ne 1 ]; then echo "usage: hostsfile.sh FILE" >&2; exit 2; fi
if [ ! -r "$1" ]; then echo "hostsfile.sh: cannot read $1" >&2; exit 1; fi
cat "$1"
