#!/usr/bin/env bash
# The complete suite (`make test`) as two pytest processes side by side, one
# core each on a 2-core machine: the tests on real vLLM engines and on Ray in
# the foreground (one after another, so that each fleet starts once:
# tests/conftest.py), the tests on simulated engines in the background, whose
# report follows the first's. Extra arguments go to both. pytest exits 5 when
# it collects no tests; that is not a failure here.
#
#   scripts/test_suite.sh PYTHON [pytest arguments]
set -u
py=${1:?usage: scripts/test_suite.sh PYTHON [pytest arguments]}
shift
log=$(mktemp -t rollout-sim-tests.XXXXXX)
"$py" -m pytest -m "not vllm and not ray" --durations=15 "$@" >"$log" 2>&1 &
sim=$!
trap 'kill "$sim" 2>/dev/null; wait "$sim" 2>/dev/null; exit 130' INT TERM
echo "The tests on simulated engines run beside these; their report follows ($log)."
"$py" -m pytest -m "vllm or ray" --durations=15 "$@"
engines_rc=$?
if kill -0 "$sim" 2>/dev/null; then
  echo "Waiting for the tests on simulated engines ($log)..."
fi
wait "$sim"
sim_rc=$?
trap - INT TERM
echo
echo "================ the tests on simulated engines ================"
cat "$log"
rm -f "$log"
rc=0
for r in $engines_rc $sim_rc; do
  if [ "$r" -ne 0 ] && [ "$r" -ne 5 ] && [ "$rc" -eq 0 ]; then rc=$r; fi
done
echo "vLLM and Ray tests: exit $engines_rc; tests on simulated engines: exit $sim_rc"
exit $rc
