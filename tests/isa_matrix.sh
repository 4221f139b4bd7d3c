#!/usr/bin/env bash
# The suite (or the tests given) under the instruction sets XLA can target on x86-64 (not part of the
# default run): XLA_FLAGS=--xla_cpu_max_isa=... makes XLA emit other kernels -- other vector
# widths, other summation orders -- as another CPU would. Tests that print "BOUND <name>: measured
# <m> <= bound <b>" report their figures; the table lists them per ISA.
#
#   tests/isa_matrix.sh [pytest args...]      (default: the whole suite)
#   ISAS="AVX2 SSE4_2" tests/isa_matrix.sh     (some of the ISAs: default AVX2 SSE4_2)
#
# SSE4_2 is below what JAX's wheels need (AVX), so it stands for no CPU JAX supports: there XLA's
# CPU JIT cannot resolve __truncsfhf2 (float32 -> float16 without F16C) and every fp16 program
# fails to compile ("Failed to materialize symbols: ... convert_fusion"; jax 0.10.2: 7 tests).
#
# Subprocess tests (several processes) run their workers with the ISA flag too: the helpers pass
# XLA_FLAGS through, dropping only a device-count flag.
set -u
cd "$(dirname "$0")/.."
tests=("$@")
if [ ${#tests[@]} -eq 0 ]; then
  tests=(tests)
fi
out=$(mktemp -d)
isas=${ISAS:-default AVX2 SSE4_2}
for isa in $isas; do
  if [ "$isa" = default ]; then flags=""; else flags="--xla_cpu_max_isa=$isa"; fi
  XLA_FLAGS="$flags" python -m pytest -q -rP -p no:cacheprovider "${tests[@]}" > "$out/$isa.log" 2>&1
  echo "$isa: $(grep -E "(passed|failed|error).* in [0-9.]+s" "$out/$isa.log" | tail -1)"
done
echo
echo "| ISA | bound | measured | limit |"
echo "|---|---|---|---|"
for isa in $isas; do
  grep -h "^BOUND " "$out/$isa.log" | sort -u | \
    sed -E "s/^BOUND ([^:]*): measured ([^ ]*) <= bound ([^ ]*).*/| $isa | \1 | \2 | \3 |/"
done
grep -h "^FAILED" "$out"/*.log | sort | uniq -c
echo "logs: $out"
