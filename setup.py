"""Maps the top-level component folders onto one distribution: `delta/` is `deltamesh.delta`, and so on.

Metadata lives in pyproject.toml; only the package layout needs code, because setuptools cannot
discover subpackages of a folder mapped under a different dotted prefix on its own. So does the
codec's one C extension, `deltamesh.delta._kernels` (delta/kernels.py says why it exists): any C
compiler and the Python headers build it. It is optional to the build: a gateway, which never
decodes a delta, installs on a host without a compiler; where a delta is applied, the codec then
says what is missing.
"""

from setuptools import Extension, find_packages, setup

COMPONENTS = ("delta", "gateway", "trainer", "mesh")

packages = ["deltamesh"]
package_dir = {"deltamesh": "deltamesh"}
for part in COMPONENTS:
    package_dir[f"deltamesh.{part}"] = part
    packages.append(f"deltamesh.{part}")
    packages += [f"deltamesh.{part}.{sub}" for sub in find_packages(part)]

kernels = Extension("deltamesh.delta._kernels", sources=["delta/_kernels.c"], extra_compile_args=["-O3"], optional=True)

# The web console's page, script and style sheet (mesh/console/static/) ship inside the package.
package_data = {"deltamesh.mesh.console": ["static/*.html", "static/*.js", "static/*.css"]}

setup(packages=packages, package_dir=package_dir, package_data=package_data, ext_modules=[kernels])
