from setuptools import setup

# Metadata lives in pyproject.toml; this file only wires the cffi extension.
setup(cffi_modules=["csrc/build_ffi.py:ffibuilder"])
