"""Maps the source folders to one namespace: core/ -> portside, backends/ -> portside.backends."""
from setuptools import find_packages, setup

packages = ["portside", "portside.backends"]
packages += [f"portside.{p}" for p in find_packages("core")]
packages += [f"portside.backends.{p}" for p in find_packages("backends")]

setup(
    packages=packages,
    package_dir={"portside": "core", "portside.backends": "backends"},
    package_data={"portside": ["py.typed"], "portside.backends.cpu": ["csrc/*.c", "csrc/*.cpp", "csrc/*.h"]},
)
