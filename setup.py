"""Maps the top-level component folders onto one distribution: `delta/` is `deltamesh.delta`, and so on.

Metadata lives in pyproject.toml; only the package layout needs code, because setuptools cannot
discover subpackages of a folder mapped under a different dotted prefix on its own.
"""

from setuptools import find_packages, setup

COMPONENTS = ("delta", "gateway", "trainer", "mesh")

packages = ["deltamesh"]
package_dir = {"deltamesh": "deltamesh"}
for part in COMPONENTS:
    package_dir[f"deltamesh.{part}"] = part
    packages.append(f"deltamesh.{part}")
    packages += [f"deltamesh.{part}.{sub}" for sub in find_packages(part)]

setup(packages=packages, package_dir=package_dir)
