#!/usr/bin/env bash
# The float-sensitive tests under the instruction sets XLA can target on x86-64 (not part of the
# default run): XLA_FLAGS=--xla_cpu_max_isa=... makes XLA emit other kernels -- other vector
# widths, other summation orders -- as another CPU would. Tests that print "BOUND <name>: measured
# <m> <= bound <b>" report their figures; the table lists them per ISA.
#
#   tests/isa_matrix.sh [pytest args...]      (default: the float-sensitive test files)
#
# Subprocess tests (several processes) run their workers with the ISA flag too: the helpers pass
# XLA_FLAGS through, dropping only a device-count flag.
set -u
cd "$(dirname "$0")/.."
tests=("$@")
if [ ${#tests[@]} -eq 0 ]; then
  tests=(tests/test_engine.py tests/test_units.py tests/test_offload.py tests/test_param_offload.py
         tests/test_delayed_update.py tests/test_activation_offload.py tests/test_nvme.py
         tests/test_zeropp.py tests/test_optim.py tests/test_precision.py tests/test_multiprocess.py
         tests/test_collective_order.py)
fi
out=$(mktemp -d)
for isa in default AVX2 SSE4_2; do
  if [ "$isa" = default ]; then flags=""; else flags="--xla_cpu_max_isa=$isa"; fi
  XLA_FLAGS="$flags" python -m pytest -q -rP -p no:cacheprovider "${tests[@]}" > "$out/$isa.log" 2>&1
  echo "$isa: $(tail -1 "$out/$isa.log")"
done
echo
echo "| ISA | bound | measured | limit |"
echo "|---|---|---|---|"
for isa in default AVX2 SSE4_2; do
  grep -h "^BOUND " "$out/$isa.log" | sort -u | \
    sed -E "s/^BOUND ([^:]*): measured ([^ ]*) <= bound ([^ ]*).*/| $isa | \1 | \2 | \3 |/"
done
grep -h "^FAILED" "$out"/*.log | sort | uniq -c
echo "logs: $out"
