"""Builds flare's PyTorch extension, flare._C: the binding file csrc/flare_ops.cpp linked against the
static libflare that CMake builds (the kernels are compiled there, not here).

    FLARE_LIB=/path/to/libflare.a python3 setup.py build_ext --inplace

tools/python-check builds libflare and then runs this (see README.md, section "Python").
"""

import os
from pathlib import Path

from setuptools import setup
from torch.utils.cpp_extension import BuildExtension, CUDAExtension

here = Path(__file__).resolve().parent
root = here.parent
lib = Path(os.environ.get("FLARE_LIB", root / "build-python" / "libflare.a"))
if not lib.is_file():
    raise SystemExit(f"setup.py: {lib} not found: build libflare first (tools/python-check does) or set FLARE_LIB")

setup(
    name="flare",
    version="0.1.0",
    packages=["flare"],
    ext_modules=[
        CUDAExtension(
            "flare._C",
            ["flare/csrc/flare_ops.cpp"],
            include_dirs=[str(root / "include")],
            extra_objects=[str(lib)],
            extra_compile_args={"cxx": ["-std=c++20", "-O2"]},
        )
    ],
    cmdclass={"build_ext": BuildExtension},
)
