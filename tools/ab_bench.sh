#!/usr/bin/env bash
# A/B the small-size bench on the device in one call: every tree named in $AB_TREES (folders holding
# an exported epgen tree, e.g. `git archive COMMIT | tar -x -C .ab/COMMIT`, carried with the call)
# and the working tree ("." = this checkout), each installed into its own --target folder, run in
# turn for $AB_ROUNDS rounds (alternating, so drift over the call hits every tree alike):
# epgen bench W=1 and virtual W (each of $AB_WORLDS, default "1 2") at $AB_TOKENS tokens, uniform,
# 50 queued replays a point.
# One line per (round, tree, W, tokens, op) at the end: queued median and stdev, host-launched median, us.
set -o pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
trees="${AB_TREES:-} ."
for t in $trees; do
  tag=$(echo "$t" | tr '/.' '__')
  python -m pip install -q --no-deps --no-build-isolation --target "/tmp/ab/$tag" "$t" >"$OUT/install$tag.log" 2>&1 \
    || { cat "$OUT/install$tag.log"; exit 1; }
done
for r in $(seq 1 "${AB_ROUNDS:-2}"); do
  for t in $trees; do
    tag=$(echo "$t" | tr '/.' '__')
    for w in ${AB_WORLDS:-1 2}; do
      (cd /tmp && PYTHONPATH="/tmp/ab/$tag" timeout 300 python -m epgen bench --world-size $w $([ $w -gt 1 ] && echo --virtual) \
        --tokens ${AB_TOKENS:-1 128 4096} --routing uniform --iters 50 -o "$OUT/ab-r$r$tag-w$w") >/dev/null 2>>"$OUT/ab.err"
      python - "$OUT/ab-r$r$tag-w$w.csv" "$r" "$t" "$w" <<'PY'
import csv, sys
path, r, t, w = sys.argv[1:]
for row in csv.DictReader(open(path)):
    if row["rank"] == "0":
        print(f"ab round {r} tree {t:>12} W={w} T={row['tokens']:>5} {row['op']:<8} queued {row['time_us']:>8} "
              f"sd {row['stdev_us']:>6} host {row['host_launched_us']:>8}")
PY
    done
  done
done | tee "$OUT/ab.txt"
