# Sourced by the GPU scripts (run them from the repository root on a CUDA machine). Sets the environment for the
# in-place build of lss._C for the visible GPU (TORCH_CUDA_ARCH_LIST overrides it) and the output folder $OUT
# (default runs/gpu). If LSS_WHEELS names a folder of wheels, they are installed from it offline into
# $LSS_SITE (default /tmp/lss-site), for a machine without a package index.
export PYTHONUNBUFFERED=1 MAX_JOBS=${MAX_JOBS:-$(nproc)} FORCE_CUDA=1
OUT=${OUT:-runs/gpu}
mkdir -p "$OUT"
LSS_SITE=${LSS_SITE:-/tmp/lss-site}
if [ -n "${LSS_WHEELS:-}" ]; then
  if [ ! -d "$LSS_SITE" ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --target "$LSS_SITE" "$LSS_WHEELS"/*.whl || exit 1
  fi
  export PYTHONPATH=$LSS_SITE
fi
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
build_ops() {  # the in-place build of lss._C unless it is there; prints its seconds, the log in $OUT/build.log
  local t0=$SECONDS
  ls lss/_C*.so > /dev/null 2>&1 || python3 setup.py build_ext --inplace > "$OUT/build.log" 2>&1 \
    || { tail -n 30 "$OUT/build.log"; return 1; }
  echo "build $((SECONDS - t0)) s"
}
