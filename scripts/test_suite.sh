#!/usr/bin/env bash
# The complete suite (`make test`) as two pytest processes side by side, one
# core each on a 2-core machine: the tests on the shared vLLM fleets and on
# Ray in the foreground (one after another, so that each fleet starts once:
# tests/conftest.py); in the background the tests on simulated engines and
# those that start vLLM engines of their own (marker own_vllm), whose report
# follows the first's. Extra arguments go to both. pytest exits 5 when it
# collects no tests; that is not a failure here.
#
#   scripts/test_suite.sh PYTHON [pytest arguments]
set -u
py=${1:?usage: scripts/test_suite.sh PYTHON [pytest arguments]}
shift
log=$(mktemp -t rollout-sim-tests.XXXXXX)
"$py" -m pytest -m "(not vllm and not ray) or own_vllm" --durations=15 "$@" >"$log" 2>&1 &
sim=$!
trap 'kill "$sim" 2>/dev/null; wait "$sim" 2>/dev/null; exit 130' INT TERM
echo "The tests on simulated engines and on vLLM engines of their own run beside these; their report follows ($log)."
"$py" -m pytest -m "(vllm or ray) and not own_vllm" --durations=15 "$@"
engines_rc=$?
if kill -0 "$sim" 2>/dev/null; then
  echo "Waiting for the tests beside them ($log)..."
fi
wait "$sim"
sim_rc=$?
trap - INT TERM
echo
echo "======== the tests on simulated engines and on vLLM engines of their own ========"
cat "$log"
rm -f "$log"
rc=0
for r in $engines_rc $sim_rc; do
  if [ "$r" -ne 0 ] && [ "$r" -ne 5 ] && [ "$rc" -eq 0 ]; then rc=$r; fi
done
echo "tests on vLLM fleets and Ray: exit $engines_rc; on simulated engines and engines of their own: exit $sim_rc"
exit $rc
