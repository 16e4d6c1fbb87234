"""Build of sparse_attn._C.

The CPU kernels and every op schema are always built. The CUDA kernels are added when a CUDA
toolkit is found and torch is a CUDA build, or when SPARSE_ATTN_FORCE_CUDA=1; whether a GPU is
present never matters. SPARSE_ATTN_SKIP_CUDA=1 forces a CPU-only build.
"""

import glob
import os

from setuptools import setup

ROOT = os.path.dirname(os.path.abspath(__file__))


def nvcc_flags():
    """The nvcc flags shared with tools/check_cuda_compile.py (csrc/nvcc_flags.txt)."""
    with open(os.path.join(ROOT, "csrc", "nvcc_flags.txt")) as f:
        return [w for line in f if not line.lstrip().startswith("#") for w in line.split()]


def _cuda_wanted(torch, cuda_home):
    if os.environ.get("SPARSE_ATTN_SKIP_CUDA", "0") == "1":
        return False
    if os.environ.get("SPARSE_ATTN_FORCE_CUDA", "0") == "1":
        if torch.version.cuda is None:
            raise RuntimeError("SPARSE_ATTN_FORCE_CUDA=1 needs a CUDA build of torch")
        return True
    return cuda_home is not None and torch.version.cuda is not None


def _default_max_jobs():
    # nvcc on a flash kernel peaks near 2 GiB; keep a margin on small machines.
    try:
        mem_gib = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    except (ValueError, OSError):
        mem_gib = 8
    return max(1, min(os.cpu_count() or 1, int(mem_gib // 3)))


def _cuda_library_include_dirs(cuda_home):
    """Headers of cuBLAS/cuSPARSE/cuSOLVER (needed by torch's CUDA headers and the dense path)
    when the toolkit lacks them: the nvidia-* wheels that a CUDA build of torch depends on."""
    if cuda_home and os.path.exists(os.path.join(cuda_home, "include", "cublas_v2.h")):
        return []
    import importlib.util

    spec = importlib.util.find_spec("nvidia")
    roots = list(spec.submodule_search_locations) if spec and spec.submodule_search_locations else []
    dirs = []
    for root in roots:
        for header in glob.glob(os.path.join(root, "*", "include", "cu*.h")):
            inc = os.path.dirname(header)
            if inc not in dirs:
                dirs.append(inc)
    return dirs


def _extensions():
    import torch
    from torch.utils.cpp_extension import CUDA_HOME, CppExtension, CUDAExtension

    os.environ.setdefault("MAX_JOBS", str(_default_max_jobs()))
    include_dirs = [os.path.join(ROOT, "csrc", "include"), os.path.join(ROOT, "csrc", "api")]
    cxx = ["-O3", "-std=c++20", "-fopenmp", "-DNDEBUG"]
    sources = sorted(
        glob.glob("csrc/api/*.cpp", root_dir=ROOT)
        + glob.glob("csrc/cpu/*.cpp", root_dir=ROOT)
        + glob.glob("csrc/plan/*.cpp", root_dir=ROOT)
    )
    if not _cuda_wanted(torch, CUDA_HOME):
        sources = [s for s in sources if not s.endswith("_cuda.cpp")]
        return [
            CppExtension(
                "sparse_attn._C",
                sources,
                include_dirs=include_dirs,
                extra_compile_args={"cxx": cxx},
                extra_link_args=["-fopenmp"],
            )
        ]
    os.environ.setdefault("TORCH_CUDA_ARCH_LIST", "8.0;9.0a")
    nvcc = nvcc_flags() + ["--threads", os.environ.get("NVCC_THREADS", "2")]
    if "9.0a" in os.environ["TORCH_CUDA_ARCH_LIST"].replace(" ", ";").split(";"):
        nvcc.append("-DSPARSE_ATTN_SM90A")  # the build holds the Hopper kernels (csrc/cuda/sm90_host.cu)
    sources += sorted(
        glob.glob("csrc/instantiations/*.cu", root_dir=ROOT)
        + glob.glob("csrc/cuda/*.cu", root_dir=ROOT)
    )
    return [
        CUDAExtension(
            "sparse_attn._C",
            sources,
            include_dirs=include_dirs + _cuda_library_include_dirs(CUDA_HOME),
            extra_compile_args={"cxx": cxx + ["-DSPARSE_ATTN_WITH_CUDA"], "nvcc": nvcc},
            # cuBLAS symbols resolve through libtorch_cuda, which links it: no -lcublas, so the
            # build needs no cuBLAS library of its own (the pip wheels ship no unversioned .so).
            extra_link_args=["-fopenmp"],
        )
    ]


def _build_ext():
    from torch.utils.cpp_extension import BuildExtension

    return BuildExtension.with_options(use_ninja=True)


setup(ext_modules=_extensions(), cmdclass={"build_ext": _build_ext()})
