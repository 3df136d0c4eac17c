"""The optional C accelerator of the dedup step (``dedup/_native.c``); everything else is in
pyproject.toml. ``optional=True``: where no C compiler is found, eosflow installs without it and
the dedup step runs its pure-Python path, which computes the same IDs and filters."""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension("dedup._native", ["dedup/_native.c"], optional=True, extra_compile_args=["-O3"])
    ]
)
