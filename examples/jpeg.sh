#!/usr/bin/env bash
# An image pipeline from JPEG-in-TFRecord: digits as JPEG files in TFRecord shards, decoded,
# cropped and jittered per example by examples/jpeg_input.py (vfgraph train --input-fn) while a
# small CNN with 8 virtual nodes trains on 2 MPI ranks; validated on centre crops.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
py=${PYTHON:-python}
work=${1:-$(mktemp -d)}
steps=${STEPS:-150}
mkdir -p "$work"
$py "$here/jpeg_pipeline.py" data "$work/data"
$py "$here/jpeg_pipeline.py" model "$work/cnn"
vfgraph rewrite "$work/cnn" --vnodes 8 --vnode-batch 8 -o "$work/cnn_v8" --force
mpiexec=$($py -c 'import os, sys; print(os.path.join(os.path.dirname(sys.executable), "mpiexec"))')
launch=()
if [ -x "$mpiexec" ]; then launch=("$mpiexec" -n 2); fi
"${launch[@]}" vfgraph train "$work/cnn_v8" --data "$work/data/train-*.tfrecord" \
  --input-fn "$here/jpeg_input.py:decode" --eval-data "$work/data/test.npz" --eval-every 50 \
  --steps "$steps" --batch-size 64 -o "$work/cnn_trained" --logdir "$work/logs" --force --no-progress
echo "curves: tensorboard --logdir $work/logs"
