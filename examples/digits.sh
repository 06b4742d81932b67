#!/usr/bin/env bash
# End to end on the digits data set: export an MLP, rewrite it with 8 virtual nodes, train it,
# and print its validation accuracy (vfgraph train --eval-data, on the held-out test split)
# beside the original model trained at the same global batch.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
py=${PYTHON:-python}
work=${1:-$(mktemp -d)}
steps=${STEPS:-300}
batch=${BATCH:-128}
mkdir -p "$work"
$py "$here/export.py" digits-data "$work/data"
$py "$here/export.py" digits-mlp "$work/mlp" --optimizer momentum --lr 0.05
vfgraph rewrite "$work/mlp" --vnodes 8 --vnode-batch $((batch / 8)) -o "$work/mlp_v8" --force
vfgraph inspect "$work/mlp_v8" | head -20
common=(--data "$work/data/train.npz" --eval-data "$work/data/test.npz" --eval-every 100 --steps "$steps"
        --batch-size "$batch" --force --no-progress)

accuracy() {  # the validation accuracy of a closing line of vfgraph train
  sed -n 's/.*; validation loss [0-9.]*, accuracy \([0-9.]*\);.*/\1/p' <<<"$1"
}

line_v=$(vfgraph train "$work/mlp_v8" "${common[@]}" -o "$work/mlp_v8_trained" --logdir "$work/logs/v8")
echo "$line_v"
mpiexec=$($py -c 'import os, sys; print(os.path.join(os.path.dirname(sys.executable), "mpiexec"))')
line_2=""
if [ -x "$mpiexec" ]; then
  line_2=$("$mpiexec" -n 2 vfgraph train "$work/mlp_v8" "${common[@]}" -o "$work/mlp_v8_2ranks" --logdir "$work/logs/v8_2ranks")
  echo "$line_2"
fi
line_o=$(vfgraph train "$work/mlp" "${common[@]}" -o "$work/mlp_trained" --logdir "$work/logs/original")
echo "$line_o"
echo
echo "global batch $batch, $steps steps; validation on $work/data/test.npz"
echo "  original model, 1 x $batch:           validation accuracy $(accuracy "$line_o")"
echo "  vfgraph, 8 virtual nodes x $((batch / 8)):    validation accuracy $(accuracy "$line_v")"
if [ -n "$line_2" ]; then
  echo "  vfgraph, 2 MPI ranks x 4 x $((batch / 8)):   validation accuracy $(accuracy "$line_2")"
fi
echo "curves: tensorboard --logdir $work/logs"
