"""Builds the `lss._C` extension from csrc/ops.

CPU kernels are always built. CUDA kernels are built when a CUDA toolkit is found (CUDA_HOME, or the toolkit
behind the `nvcc` on PATH, resolved through symlinks and wrapper scripts) or when FORCE_CUDA=1; FORCE_CUDA=0
disables them. Architectures come from TORCH_CUDA_ARCH_LIST, else the visible GPU, else "9.0".
"""
import glob
import os
import re
import shutil
import sys

from setuptools import setup

ROOT = os.path.dirname(os.path.abspath(__file__))


def _log(msg):
    print(f"[lss build] {msg}", file=sys.stderr, flush=True)


def _toolkit_root_of(nvcc_path):
    """Return the toolkit root for an nvcc executable, following symlinks and one-line wrapper scripts."""
    real = os.path.realpath(nvcc_path)
    root = os.path.dirname(os.path.dirname(real))
    if os.path.exists(os.path.join(root, "include", "cuda_runtime.h")):
        return root
    try:
        with open(real, "rb") as f:
            head = f.read(4096)
    except OSError:
        return None
    if not head.startswith(b"#!"):
        return None
    # A wrapper such as `exec /usr/local/cuda-13.0/bin/nvcc "$@"`: follow the absolute path it execs.
    for target in re.findall(rb"(/[^\s\"']+/bin/nvcc)\b", head):
        target = target.decode()
        if os.path.realpath(target) != real and os.path.exists(target):
            return _toolkit_root_of(target)
    return None


def find_cuda_home():
    env = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH")
    if env and os.path.exists(os.path.join(env, "bin", "nvcc")):
        return env
    nvcc = shutil.which("nvcc")
    if nvcc:
        root = _toolkit_root_of(nvcc)
        if root:
            return root
    for cand in sorted(glob.glob("/usr/local/cuda*"), reverse=True):
        if os.path.exists(os.path.join(cand, "bin", "nvcc")) and os.path.exists(
            os.path.join(cand, "include", "cuda_runtime.h")
        ):
            return cand
    return None


def decide_cuda():
    force = os.environ.get("FORCE_CUDA")
    cuda_home = find_cuda_home()
    if force == "0":
        return False, cuda_home, "FORCE_CUDA=0"
    if cuda_home is None:
        if force == "1":
            raise SystemExit("FORCE_CUDA=1 but no CUDA toolkit was found: set CUDA_HOME to the toolkit root "
                             "(the folder whose bin/ holds the real nvcc).")
        return False, None, "no CUDA toolkit found (set CUDA_HOME or put nvcc on PATH to build CUDA kernels)"
    return True, cuda_home, f"CUDA toolkit at {cuda_home}" + (" (FORCE_CUDA=1)" if force == "1" else "")


def arch_list():
    archs = os.environ.get("TORCH_CUDA_ARCH_LIST")
    if archs:
        return archs
    try:
        import torch

        if torch.cuda.is_available():
            major, minor = torch.cuda.get_device_capability()
            return f"{major}.{minor}"
    except Exception:
        pass
    return "9.0"


def extensions():
    with_cuda, cuda_home, why = decide_cuda()
    if cuda_home:
        # torch reads CUDA_HOME when cpp_extension is imported: set it first so the wrapper nvcc is not mistaken
        # for the toolkit.
        os.environ["CUDA_HOME"] = cuda_home
    if with_cuda:
        os.environ["TORCH_CUDA_ARCH_LIST"] = arch_list()
    from torch.utils.cpp_extension import CppExtension, CUDAExtension

    sources = sorted(glob.glob(os.path.join("csrc", "ops", "*.cpp")))
    sources += sorted(glob.glob(os.path.join("csrc", "ops", "cpu", "*.cpp")))
    cxx_flags = ["-O3"]  # torch adds the C++ standard it needs (C++17 or C++20)
    define_macros = []
    if with_cuda:
        cu = sorted(glob.glob(os.path.join("csrc", "ops", "cuda", "*.cu")))
        archs = os.environ["TORCH_CUDA_ARCH_LIST"]
        extra_includes = wheel_cuda_includes(cuda_home)
        _log(f"building CPU + CUDA kernels: {why}; TORCH_CUDA_ARCH_LIST={archs}; {len(sources)} C++ + {len(cu)} CUDA sources"
             + (f"; CUDA library headers from {extra_includes[0]}" if extra_includes else ""))
        define_macros += [("LSS_WITH_CUDA", None), ("LSS_CUDA_ARCHS", f'"{archs}"')]
        return [
            CUDAExtension(
                "lss._C",
                sources + cu,
                include_dirs=[os.path.join(ROOT, "csrc")] + extra_includes,
                define_macros=define_macros,
                extra_compile_args={
                    "cxx": cxx_flags,
                    "nvcc": ["-O3", "-lineinfo", "--expt-relaxed-constexpr"],
                },
            )
        ]
    _log(f"building CPU kernels only: {why}; {len(sources)} C++ sources")
    return [
        CppExtension(
            "lss._C",
            sources,
            include_dirs=[os.path.join(ROOT, "csrc")],
            define_macros=define_macros,
            extra_compile_args={"cxx": cxx_flags},
        )
    ]


def wheel_cuda_includes(cuda_home):
    """CUDA library headers (cusparse.h, cublas_v2.h, ...) that torch's CUDA headers include: a minimal toolkit may
    lack them, while the nvidia-* wheels that come with a CUDA build of torch ship them."""
    if os.path.exists(os.path.join(cuda_home, "include", "cusparse.h")):
        return []
    import site

    roots = site.getsitepackages() + [site.getusersitepackages()]
    found = []
    for root in roots:
        for header in sorted(glob.glob(os.path.join(root, "nvidia", "*", "include", "cusparse.h"))):
            found.append(os.path.dirname(header))
    return found[:1]


def build_ext_cls():
    from torch.utils.cpp_extension import BuildExtension

    return BuildExtension.with_options(use_ninja=shutil.which("ninja") is not None or _has_ninja_module())


def _has_ninja_module():
    try:
        import ninja  # noqa: F401

        return True
    except ImportError:
        return False


setup(ext_modules=extensions(), cmdclass={"build_ext": build_ext_cls()})
