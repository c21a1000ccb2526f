#!/usr/bin/env bash
# GPU readiness of cnrstore (issue 27), one command of at most 8 minutes: every CUDA test
# (pytest -m gpu) and the GPU benchmarks (benches/bench_gpu.py: fingerprint GB/s on a GPU
# table; put, stall and get of GPU-resident tables against torch.save / torch.load), all
# written to ONE JSON file.
#
#   benches/gpu_check.sh [OUT.json]
#
# OUT.json defaults to $OUT/gpu_check.json when $OUT is set (the device machine's folder
# that comes back), else /tmp/cnrstore-gpu-check/gpu_check.json. It assumes nothing of the
# machine: it finds a Python with torch ($PYTHON, .venv/bin/python, python3), reports what
# is missing (modules, compiler, GPU) and runs what can run without it. Python packages
# cnrstore needs and the machine lacks (the device image has no lmdb or zstandard) are
# installed from wheels in $CNR_WHEELS (default: .whl/ in the repository) when there are
# any; without them the tests and the put/get benchmarks are reported as not run and the
# fingerprint benchmark (torch and numpy only) still runs.
#
# Exit status: 0 when there is no GPU (it says so) or everything that ran passed; 1 when a
# test failed or a stage broke or timed out.
set -u
cd "$(dirname "$0")/.."
REPO=$(pwd)
OUTJSON=${1:-}
if [ -z "$OUTJSON" ]; then
  if [ -n "${OUT:-}" ]; then OUTJSON="$OUT/gpu_check.json"; else
    OUTJSON=/tmp/cnrstore-gpu-check/gpu_check.json; fi
fi
mkdir -p "$(dirname "$OUTJSON")"
WORK=$(mktemp -d /tmp/cnrstore-gpu-check.XXXXXX)
trap 'rm -rf "$WORK"' EXIT
START=$(date +%s)
TESTS_TIMEOUT=${CNR_GPU_TESTS_TIMEOUT:-270}
BENCH_TIMEOUT=${CNR_GPU_BENCH_TIMEOUT:-150}
if command -v timeout >/dev/null 2>&1; then TO=(timeout --kill-after=10); else TO=(); fi
limit() { if [ ${#TO[@]} -gt 0 ]; then "${TO[@]}" "$@"; else shift; "$@"; fi; }

PY=""
for cand in "${PYTHON:-}" .venv/bin/python python3 python; do
  [ -n "$cand" ] || continue
  if command -v "$cand" >/dev/null 2>&1 && "$cand" -c \
      "import importlib.util as u, sys; sys.exit(u.find_spec('torch') is None)" 2>/dev/null; then
    PY=$cand; break
  fi
done
if [ -z "$PY" ]; then
  printf '{"gpu": null, "ok": false, "reason": "no Python with torch found (tried $PYTHON, .venv/bin/python, python3, python)"}\n' >"$OUTJSON"
  echo "gpu_check: no Python with torch found; wrote $OUTJSON"
  exit 1
fi

export PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}"
WHEELS=${CNR_WHEELS:-$REPO/.whl}
probe() {  # what this machine has, as JSON on stdout
  "$PY" - <<'EOF'
import importlib, json, platform, shutil, subprocess, sys
out = {"python": sys.version.split()[0], "executable": sys.executable,
       "machine": platform.machine()}
mods = ["numpy", "torch", "xxhash", "lmdb", "zstandard", "msgpack", "pytest", "hypothesis"]
out["missing_modules"] = [m for m in mods if importlib.util.find_spec(m) is None]
import torch
out["torch"] = torch.__version__
out["cuda_built"] = torch.version.cuda
out["gpu"] = bool(torch.cuda.is_available())
if out["gpu"]:
    out["device"] = torch.cuda.get_device_name(0)
    out["device_count"] = torch.cuda.device_count()
smi = shutil.which("nvidia-smi")
if smi:
    try:
        r = subprocess.run([smi, "--query-gpu=name,driver_version,memory.total",
                            "--format=csv,noheader"], capture_output=True, text=True,
                           timeout=30)
        out["nvidia_smi"] = r.stdout.strip() or r.stderr.strip()
    except (OSError, subprocess.SubprocessError) as exc:
        out["nvidia_smi"] = f"failed: {exc}"
else:
    out["nvidia_smi"] = None
out["cc"] = shutil.which("cc") or shutil.which("gcc")
from cnrstore.codec import native
native.kernel(wait=True)
out["native_kernel"] = native.status()
print(json.dumps(out))
EOF
}

PROBE=$(probe 2>"$WORK/probe.err") || {
  printf '{"gpu": null, "ok": false, "reason": "probe failed", "stderr": %s}\n' \
    "$("$PY" -c 'import json,sys; print(json.dumps(sys.stdin.read()[-4000:]))' <"$WORK/probe.err")" >"$OUTJSON"
  echo "gpu_check: the probe failed; wrote $OUTJSON"; exit 1; }
echo "$PROBE" >"$WORK/probe.json"

if [ "$("$PY" -c 'import json,sys; print(json.load(sys.stdin)["gpu"])' <"$WORK/probe.json")" != "True" ]; then
  "$PY" - "$WORK/probe.json" "$OUTJSON" <<'EOF'
import json, sys
probe = json.load(open(sys.argv[1]))
doc = {"gpu": False, "ok": True, "reason": "no CUDA device visible to torch "
       f"{probe['torch']} (CUDA build: {probe['cuda_built']}); nothing was run",
       "probe": probe}
json.dump(doc, open(sys.argv[2], "w"), indent=1)
EOF
  echo "gpu_check: no GPU here (torch.cuda.is_available() is False): nothing to run; wrote $OUTJSON"
  exit 0
fi

# Packages cnrstore needs that are missing: from carried wheels, when there are some.
MISSING=$("$PY" -c 'import json,sys; print(" ".join(json.load(sys.stdin)["missing_modules"]))' <"$WORK/probe.json")
if [ -n "$MISSING" ] && ls "$WHEELS"/*.whl >/dev/null 2>&1; then
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target "$WORK/site" "$WHEELS"/*.whl >"$WORK/pip.log" 2>&1 \
    && export PYTHONPATH="$PYTHONPATH:$WORK/site"
  PROBE=$(probe 2>>"$WORK/probe.err") && echo "$PROBE" >"$WORK/probe.json"
  MISSING=$("$PY" -c 'import json,sys; print(" ".join(json.load(sys.stdin)["missing_modules"]))' <"$WORK/probe.json")
fi
NEEDED=""
for m in $MISSING; do
  case $m in xxhash|lmdb|zstandard|msgpack|pytest|hypothesis|numpy) NEEDED="$NEEDED $m";; esac
done

TESTS_RC=skipped
if [ -z "$NEEDED" ]; then
  echo "gpu_check: pytest -m gpu (at most ${TESTS_TIMEOUT}s)"
  limit "$TESTS_TIMEOUT" "$PY" -m pytest -q -p no:cacheprovider -m gpu \
    --junitxml="$WORK/junit.xml" tests >"$WORK/tests.log" 2>&1
  TESTS_RC=$?
fi

BENCH_ARGS=(--json "$WORK/bench.json" --workdir "$WORK")
case " $NEEDED " in *" lmdb "*|*" zstandard "*|*" msgpack "*|*" xxhash "*) BENCH_ARGS+=(--skip-puts);; esac
BENCH_RC=skipped
case " $NEEDED " in *" numpy "*) ;; *)
  echo "gpu_check: benches/bench_gpu.py (at most ${BENCH_TIMEOUT}s)"
  limit "$BENCH_TIMEOUT" "$PY" benches/bench_gpu.py "${BENCH_ARGS[@]}" ${CNR_GPU_BENCH_ARGS:-} \
    >"$WORK/bench.log" 2>&1
  BENCH_RC=$?;;
esac

"$PY" - "$WORK" "$OUTJSON" "$TESTS_RC" "$BENCH_RC" "$NEEDED" "$START" <<'EOF'
import json, os, sys, time
import xml.etree.ElementTree as ET
work, out, tests_rc, bench_rc, needed, start = sys.argv[1:7]
def tail(name, n=6000):
    p = os.path.join(work, name)
    return open(p, errors="replace").read()[-n:] if os.path.exists(p) else ""
doc = {"gpu": True, "probe": json.load(open(os.path.join(work, "probe.json")))}
missing = needed.split()
tests = {"rc": None if tests_rc == "skipped" else int(tests_rc)}
if tests_rc == "skipped":
    tests["not_run"] = f"missing Python packages: {', '.join(missing)} (put their wheels in " \
                       "$CNR_WHEELS or .whl/, see docs/design/put-speed.md)"
elif os.path.exists(os.path.join(work, "junit.xml")):
    suite = ET.parse(os.path.join(work, "junit.xml")).getroot()
    suite = suite if suite.tag == "testsuite" else suite[0]
    tests.update({k: int(suite.get(k, 0)) for k in ("tests", "failures", "errors", "skipped")})
    tests["failed"] = [f"{c.get('classname')}::{c.get('name')}" for c in suite.iter("testcase")
                       if c.find("failure") is not None or c.find("error") is not None]
    tests["skipped_tests"] = [f"{c.get('classname')}::{c.get('name')}: "
                              f"{c.find('skipped').get('message', '')}"
                              for c in suite.iter("testcase") if c.find("skipped") is not None]
tests["log_tail"] = tail("tests.log")
if tests["rc"] in (124, 137):
    tests["timed_out"] = True
doc["tests"] = tests
bench = {"rc": None if bench_rc == "skipped" else int(bench_rc)}
if os.path.exists(os.path.join(work, "bench.json")):
    bench.update(json.load(open(os.path.join(work, "bench.json"))))
if missing and bench_rc != "skipped":
    bench["puts_not_run"] = f"missing: {', '.join(missing)}" if any(
        m in missing for m in ("lmdb", "zstandard", "msgpack", "xxhash")) else None
bench["log_tail"] = tail("bench.log")
doc["bench"] = bench
doc["seconds"] = time.time() - float(start)
# On a GPU, a CUDA test that skips is one that did not run: not a pass.
tests["all_ran"] = tests.get("skipped", 0) == 0 and tests.get("tests", 0) > 0
doc["ok"] = (tests["rc"] == 0 and tests["all_ran"] and bench["rc"] == 0
             and bench.get("gpu", True) is not False and not missing)
json.dump(doc, open(out, "w"), indent=1)
print(f"gpu_check: tests rc={tests['rc']} {tests.get('tests', '-')} run, "
      f"{tests.get('failures', '-')} failed; bench rc={bench['rc']}; "
      f"fingerprint {bench.get('fingerprint', {}).get('fingerprint_gbs', '-')} GB/s; "
      f"missing: {missing or 'nothing'}; {doc['seconds']:.0f} s; wrote {out}")
sys.exit(0 if doc["ok"] else 1)
EOF
