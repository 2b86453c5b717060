# Sourced by the GPU scripts: installs the wheels the GPU machine lacks (.whl/, made by
# ../shared/tools/device_wheels.sh) and sets the environment for the in-place sm_90 build of lss._C that each script
# runs (or skips when lss/_C*.so is already there).
export PYTHONUNBUFFERED=1 TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-9.0} MAX_JOBS=${MAX_JOBS:-16} FORCE_CUDA=1
OUT=${OUT:-/tmp/lss-gpu}
mkdir -p "$OUT"
if [ -d .whl ] && [ ! -d /tmp/lss-site ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/lss-site .whl/*.whl || exit 1
fi
[ -d /tmp/lss-site ] && export PYTHONPATH=/tmp/lss-site
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
build_ops() {  # the in-place build of lss._C unless it is there; prints its seconds, the log in $OUT/build.log
  local t0=$SECONDS
  ls lss/_C*.so > /dev/null 2>&1 || python3 setup.py build_ext --inplace > "$OUT/build.log" 2>&1 \
    || { tail -n 30 "$OUT/build.log"; return 1; }
  echo "build $((SECONDS - t0)) s"
}
