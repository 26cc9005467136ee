"""triton_scaler is typed (PEP 561: ``py.typed``): a user's type checker reads its annotations,
so they must be right where torch's are. ``tests/_typed_user_code.py`` (user code over the
public API, with ``assert_type`` on what each call returns) is checked with ``mypy --strict``
against the package installed as a user installs it, outside the source tree."""

import os
import shutil
import subprocess
import sys
from importlib import metadata
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _install(target: Path, tmp_path: Path) -> None:
    """The project built and installed into ``target`` without network, from a copy of its
    sources (the build writes next to them)."""
    src = tmp_path / "src"
    src.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, src / name)
    skip = shutil.ignore_patterns("__pycache__", "kernels")  # triton_scaler/kernels: a link
    shutil.copytree(ROOT / "triton_scaler", src / "triton_scaler", ignore=skip)
    shutil.copytree(ROOT / "kernels", src / "kernels", ignore=shutil.ignore_patterns("__pycache__"))
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-index",
                    "--no-build-isolation", "--disable-pip-version-check", "--target",
                    str(target), str(src)], check=True, timeout=300)


def _installed(distribution: str) -> bool:
    try:
        metadata.version(distribution)
    except metadata.PackageNotFoundError:
        return False
    return True


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    """The package installed as a user installs it, in a folder of its own."""
    pytest.importorskip("mypy", reason="mypy checks the annotations (pip install -e '.[test]')")
    try:  # the version only: importing setuptools would patch distutils for every test
        setuptools = metadata.version("setuptools")
    except metadata.PackageNotFoundError:
        pytest.skip("the build needs setuptools")
    version = tuple(int(part) for part in setuptools.split(".")[:2] if part.isdigit())
    if version < (64,):  # pyproject.toml's build requirement
        pytest.skip(f"the build needs setuptools >= 64; found {setuptools}")
    if version < (70, 1) and not _installed("wheel"):  # bdist_wheel: setuptools' own since 70.1
        pytest.skip(f"the build needs setuptools >= 70.1 or the wheel package (a new venv's "
                    f"setuptools {setuptools} has no bdist_wheel): pip install wheel")
    target = tmp_path_factory.mktemp("site")
    _install(target, tmp_path_factory.mktemp("build"))
    assert (target / "triton_scaler" / "py.typed").is_file(), "py.typed is not installed"
    return target


def _mypy(args: list[str], cwd: Path, env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "mypy", "--cache-dir", str(cwd / ".mypy"),
                           *args], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=600)


@pytest.mark.exhaustive  # a script's whole run: the long tier
def test_public_api_type_checks_as_installed(site, tmp_path):
    env = {**os.environ, "PYTHONPATH": str(site)}
    result = _mypy(["--strict", "--untyped-calls-exclude", "torch",
                    str(ROOT / "tests" / "_typed_user_code.py")], tmp_path, env)
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.exhaustive  # a script's whole run: the long tier
def test_the_package_type_checks_as_installed(site):
    """Its own code agrees with its annotations and torch's (pyproject.toml's ``[tool.mypy]``:
    the bodies of unannotated functions too): a wrong annotation, a None not handled, a
    mixin using what its class does not have, are found here."""
    result = _mypy(["--config-file", str(ROOT / "pyproject.toml"), "triton_scaler"], site,
                   dict(os.environ))
    assert result.returncode == 0, result.stdout + result.stderr
