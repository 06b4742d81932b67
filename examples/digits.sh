#!/usr/bin/env bash
# End to end on the digits data set: export an MLP, rewrite it with 8 virtual nodes, train it,
# and print its test accuracy beside the original model trained at the same global batch.
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
vfgraph train "$work/mlp_v8" --data "$work/data/train.npz" --steps "$steps" --batch-size "$batch" -o "$work/mlp_v8_trained" --force --no-progress
mpiexec=$($py -c 'import os, sys; print(os.path.join(os.path.dirname(sys.executable), "mpiexec"))')
if [ -x "$mpiexec" ]; then
  "$mpiexec" -n 2 vfgraph train "$work/mlp_v8" --data "$work/data/train.npz" --steps "$steps" --batch-size "$batch" -o "$work/mlp_v8_2ranks" --force --no-progress
fi
vfgraph train "$work/mlp" --data "$work/data/train.npz" --steps "$steps" --batch-size "$batch" -o "$work/mlp_trained" --force --no-progress
acc_v=$($py "$here/evaluate.py" "$work/mlp_v8_trained" "$work/data/test.npz")
acc_o=$($py "$here/evaluate.py" "$work/mlp_trained" "$work/data/test.npz")
echo
echo "global batch $batch, $steps steps"
echo "  original model, 1 x $batch:           test accuracy $acc_o"
echo "  vfgraph, 8 virtual nodes x $((batch / 8)):    test accuracy $acc_v"
if [ -d "$work/mlp_v8_2ranks" ]; then
  acc_2=$($py "$here/evaluate.py" "$work/mlp_v8_2ranks" "$work/data/test.npz")
  echo "  vfgraph, 2 MPI ranks x 4 x $((batch / 8)):   test accuracy $acc_2"
fi
