#!/usr/bin/env bash
# vfgraph on a system MPI instead of the PyPI MPICH wheel: Debian's Open MPI.
#
# Installs Open MPI from Debian (needs root), makes a separate virtual environment with mpi4py
# compiled against it, builds vfgraph's ops with its compiler wrapper (VFGRAPH_MPICXX) into a
# separate cache, and runs the op tests and the multi-rank training tests under its mpiexec.
#
#     bash tools/check_system_mpi.sh [pytest args...]
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$(pwd)
VENV=${VFGRAPH_OPENMPI_VENV:-$ROOT/.venv-openmpi}

if ! command -v mpicxx.openmpi >/dev/null; then
  if [ "$(id -u)" != 0 ]; then
    echo "check_system_mpi: Open MPI is not installed; run as root or: apt-get install libopenmpi-dev openmpi-bin" >&2
    exit 2
  fi
  apt-get update -q >/dev/null
  DEBIAN_FRONTEND=noninteractive apt-get install -y -q libopenmpi-dev openmpi-bin >/dev/null
fi

if [ ! -x "$VENV/bin/python" ]; then
  python3 -m venv "$VENV"
  "$VENV/bin/pip" install -q --upgrade pip
  # vfgraph and the test tools, but not the mpich wheel: mpi4py is compiled against Open MPI
  "$VENV/bin/pip" install -q -e . pytest hypothesis scikit-learn
  MPICC=mpicc.openmpi "$VENV/bin/pip" install -q --no-binary mpi4py --no-cache-dir mpi4py
fi
ln -sf "$(command -v mpiexec.openmpi)" "$VENV/bin/mpiexec"  # the tests launch the mpiexec beside python

export VFGRAPH_MPICXX=$(command -v mpicxx.openmpi)
export VFGRAPH_CACHE_DIR=${VFGRAPH_CACHE_DIR:-$HOME/.cache/vfgraph-openmpi}
# Open MPI refuses root without these, and more ranks than cores without oversubscription
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMPI_MCA_rmaps_base_oversubscribe=1
"$VENV/bin/python" -c "from mpi4py import MPI; print('mpi4py on', MPI.Get_library_version().splitlines()[0])"
"$VENV/bin/python" -m vfgraph.cli build-ops --force
exec "$VENV/bin/python" -m pytest -q -p no:cacheprovider tests/ops tests/runtime/test_mpi_train.py "$@"
