import os
import shutil

from setuptools import setup
from setuptools.command.build_py import build_py

# Sources compiled at run time: the segment runtime (cpu_layout/codegen/program.py
# builds it on first use) and the generated kernels' preamble (codegen/cpp_kernels.py);
# an installed (non-editable) package finds them in cpu_layout/csrc/.
RUNTIME_HEADERS = ("cl_api.h", "cl_wrapper.h", "segment_vm.cpp", "cl_kernels.h")


class BuildPyWithHeaders(build_py):
    def run(self):
        super().run()
        dst = os.path.join(self.build_lib, "cpu_layout", "csrc")
        os.makedirs(dst, exist_ok=True)
        for name in RUNTIME_HEADERS:
            shutil.copy(os.path.join(os.path.dirname(os.path.abspath(__file__)), "csrc", name), dst)


# Metadata lives in pyproject.toml; this file wires the cffi extension and the headers.
setup(cffi_modules=["csrc/build_ffi.py:ffibuilder"], cmdclass={"build_py": BuildPyWithHeaders})
