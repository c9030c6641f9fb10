"""The package list, found: autofuse's own packages, and problems/ and variants/ under the
names pyproject.toml's package-dir maps them to (autofuse.problems, autofuse.variants.<problem>).
setuptools' packages.find in pyproject.toml cannot add that prefix; everything else is there."""

from setuptools import find_packages, setup

setup(packages=[*find_packages(include=["autofuse", "autofuse.*"]),
                *(f"autofuse.{name}" for name in find_packages(include=["problems", "variants", "variants.*"]))])
