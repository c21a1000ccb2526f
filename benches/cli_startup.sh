#!/bin/bash
# Start-up time of the `cnrstore` command (runs: benches/results/cli_startup.md).
# usage: benches/cli_startup.sh STORE [PYTHON]   -- median of 7 wall-clock runs, in ms.
# Run it from outside the source tree (cwd comes first on sys.path for `python -m`), with
# PYTHONPATH naming the tree to measure if it is not the installed one.
set -euo pipefail
S=${1:?usage: cli_startup.sh STORE [PYTHON]}
PY=${2:-python}
med() { sort -n | awk '{a[NR]=$1} END {print a[int((NR+1)/2)]}'; }
t() {
    for _ in 1 2 3 4 5 6 7; do
        s=$(date +%s%N); "$@" >/dev/null 2>&1; e=$(date +%s%N)
        echo $(( (e - s) / 1000000 ))
    done | med
}
echo "python -c pass:            $(t "$PY" -c pass) ms"
echo "python -c 'import torch':  $(t "$PY" -c 'import torch') ms"
echo "cnrstore --help:           $(t "$PY" -m cnrstore --help) ms"
echo "cnrstore ls:               $(t "$PY" -m cnrstore ls "$S") ms"
echo "cnrstore show:             $(t "$PY" -m cnrstore show "$S" "$("$PY" -m cnrstore ls "$S" --json | "$PY" -c 'import json,sys; print(json.load(sys.stdin)[-1]["step"])')") ms"
echo "cnrstore verify --shallow: $(t "$PY" -m cnrstore verify "$S" --shallow) ms"
