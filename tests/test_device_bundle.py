"""tools/device_bundle.py without the network: the slimmed, uncompressed wheel pip installs, the size check, and
the refusal of a bad --limit-mib before any download."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
spec = importlib.util.spec_from_file_location("device_bundle", REPO / "tools" / "device_bundle.py")
device_bundle = importlib.util.module_from_spec(spec)
spec.loader.exec_module(device_bundle)

RECORD = "ray-2.60.0.dist-info/RECORD"


def fake_ray_wheel(directory: Path) -> Path:
    """A minimal valid wheel named like Ray's, with a jar and an RLlib module that the bundle drops."""
    files = {
        "ray/__init__.py": "VERSION = '2.60.0'\n",
        "ray/jars/ray_dist.jar": "not a jar",
        "ray/rllib/__init__.py": "",
        "ray-2.60.0.dist-info/METADATA": "Metadata-Version: 2.1\nName: ray\nVersion: 2.60.0\n",
        "ray-2.60.0.dist-info/WHEEL": "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
    }
    record = "".join(f"{name},,\n" for name in files) + f"{RECORD},,\n"
    wheel = directory / "ray-2.60.0-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w", zipfile.ZIP_DEFLATED) as zf:
        for name, text in {**files, RECORD: record}.items():
            zf.writestr(name, text)
    return wheel


def test_stored_wheel_drops_members_and_record_lines_and_pip_installs_it(tmp_path):
    (tmp_path / "in").mkdir()
    (tmp_path / "out").mkdir()
    wheel = fake_ray_wheel(tmp_path / "in")
    slim = device_bundle.stored_wheel(wheel, tmp_path / "out", device_bundle.DROPPED["ray"])

    assert slim.name == wheel.name
    with zipfile.ZipFile(slim) as zf:
        assert zf.namelist() == ["ray/__init__.py", "ray-2.60.0.dist-info/METADATA", "ray-2.60.0.dist-info/WHEEL",
                                 RECORD]
        assert {info.compress_type for info in zf.infolist()} == {zipfile.ZIP_STORED}
        assert zf.read(RECORD).decode() == ("ray/__init__.py,,\nray-2.60.0.dist-info/METADATA,,\n"
                                            "ray-2.60.0.dist-info/WHEEL,,\n" + f"{RECORD},,\n")
    site = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile",
                    "--target", str(site), str(slim)], check=True)
    assert (site / "ray" / "__init__.py").read_text() == "VERSION = '2.60.0'\n"
    assert not (site / "ray" / "jars").exists() and not (site / "ray" / "rllib").exists()


def wheel_requiring(directory: Path, name: str, requires: list[str]) -> Path:
    """A wheel whose METADATA holds only these Requires-Dist lines."""
    wheel = directory / f"{name}-1.0-py3-none-any.whl"
    metadata = f"Metadata-Version: 2.1\nName: {name}\nVersion: 1.0\n"
    metadata += "".join(f"Requires-Dist: {r}\n" for r in requires)
    with zipfile.ZipFile(wheel, "w") as zf:
        zf.writestr(f"{name}-1.0.dist-info/METADATA", metadata)
    return wheel


def test_requirements_problems_names_what_neither_bundle_image_nor_left_out_holds(tmp_path):
    ray = wheel_requiring(tmp_path, "ray", [
        "click>=7.0",  # in the image
        "jsonschema",  # bundled below
        'py-spy>=0.4.0; python_version >= "3.12" and extra == "default"',  # left out on purpose
        'fastapi>=0.133.0; extra == "serve"',  # an extra the project installs, not bundled
        'gymnasium==1.2.2; extra == "rllib"',  # an extra it does not
        'async-timeout; python_version < "3.11"',  # not on the lent machine's Python
    ])
    jsonschema = wheel_requiring(tmp_path, "jsonschema", ["rpds-py>=0.25"])
    assert device_bundle.requirements_problems([ray, jsonschema]) == [
        'ray needs fastapi>=0.133.0; extra == "serve": not bundled, not in FROM_IMAGE, not in LEFT_OUT',
        "jsonschema needs rpds-py>=0.25: not bundled, not in FROM_IMAGE, not in LEFT_OUT",
    ]
    fastapi, rpds = wheel_requiring(tmp_path, "fastapi", []), wheel_requiring(tmp_path, "rpds_py", [])
    assert device_bundle.requirements_problems([ray, jsonschema, fastapi, rpds]) == []


def test_distribution_names_the_wheel_as_dropped_does():
    assert device_bundle.distribution(Path("ray-2.60.0-cp312-cp312-manylinux2014_x86_64.whl")) == "ray"
    assert device_bundle.distribution(Path("rpds_py-2026.9.1-cp312-cp312-manylinux_2_17_x86_64.whl")) == "rpds-py"


def test_size_problem_at_and_over_the_limit():
    mib = device_bundle.MIB
    assert device_bundle.size_problem(58 * mib, 2 * mib, 60) is None
    assert device_bundle.size_problem(58 * mib, 2 * mib + 1, 60) == (
        "bundle 58.0 MiB + working tree 2.0 MiB = 60.0 MiB exceeds --limit-mib 60")


def test_a_limit_of_zero_is_refused_before_any_download(capsys, tmp_path):
    with pytest.raises(SystemExit) as exit_info:
        device_bundle.main(["--limit-mib", "0", "--out", str(tmp_path / "bundle")])
    assert exit_info.value.code == 2
    assert "--limit-mib must be > 0, got 0.0" in capsys.readouterr().err
    assert not (tmp_path / "bundle").exists()
