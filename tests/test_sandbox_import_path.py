"""Kernels import what the host found (issue 64): where replrl's dependencies come through PYTHONPATH (``pip install
--target DIR`` then ``PYTHONPATH=DIR``, a cluster module, a ``.pth`` of a GPU recipe), a kernel imports ipykernel,
pyzmq, jupyter_client and the seccomp binding from there, booted and forked, and sees nothing else of the host's
``sys.path``: not the checkout, not another PYTHONPATH directory.

The host here is an interpreter with no packages of its own (a virtualenv made without pip, no system site-packages);
the packages a kernel and its host import are copied (hard links where the file system allows) into a ``--target``
style directory with their metadata, exactly what ``pip install --target`` leaves. Real kernels, both boots.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from sandbox.limits import available, is_root

ROOT = Path(__file__).resolve().parent.parent

pytestmark = pytest.mark.skipif(not available("bwrap"), reason="the import path and the view: the bwrap level")

# what the host and a kernel import: every distribution that provides one of these modules is copied
IMPORTS = ("sandbox.kernel", "sandbox.pool", "sandbox.sync", "sandbox.zygote", "sandbox.report", "ipykernel.kernelapp",
           "ipykernel.ipkernel", "ipykernel.zmqshell", "ipykernel.debugger", "IPython.core.completer", "debugpy",
           "jedi", "comm", "jupyter_client.session", "zmq", "packaging.requirements")

HOST = textwrap.dedent("""
    import asyncio, json, os, sys
    import ipykernel
    from sandbox import Kernel, KernelStartError, Limits
    from sandbox.launch import python_paths
    try:
        from sandbox.launch import kernel_import_dirs
    except ImportError:  # before issue 64 (so that the kernels' own failure shows)
        kernel_import_dirs = list
    from sandbox.zygote import fork_server_usable

    other, checkout = sys.argv[1], sys.argv[2]
    PROBE = (f"import os, sys, json; print(json.dumps({{'other': os.path.exists({other!r}), "
             f"'checkout': os.path.exists({checkout + '/pyproject.toml'!r}), 'path': sys.path}}))")

    async def one(limits):
        try:
            async with Kernel(limits) as kernel:
                forked = getattr(kernel._proc, "_zygote", None) is not None
                two = await kernel.execute("1+1", mode="single")
                probe = await kernel.execute(PROBE)
                secret = await kernel.execute("import secretpkg")
                return {"forked": forked, "two": [two.status, two.output], "probe": json.loads(probe.output),
                        "secret": secret.error_name}
        except KernelStartError as err:
            return {"error": str(err)}

    booted = Limits(wall_s=10.0, uid_base=141000, fork_server=False)
    forked = Limits(wall_s=10.0, uid_base=142000)
    print(json.dumps({
        "ipykernel": ipykernel.__file__, "python_paths": python_paths(), "import_dirs": kernel_import_dirs(),
        "fork_server": fork_server_usable("bwrap", forked),
        "booted": asyncio.run(one(booted)), "forked": asyncio.run(one(forked)),
    }))
""")


def _top_names() -> list[str]:
    """Top-level names of the modules the host and a kernel import that come from site-packages (asked of a fresh
    interpreter, so this test process's own imports do not count)."""
    code = (f"import importlib, json, sys, sysconfig\nfor m in {IMPORTS!r}: importlib.import_module(m)\n"
            "import sandbox.launch as l; l.seccomp_available()\n"
            "site = sysconfig.get_paths()['purelib'], sysconfig.get_paths()['platlib']\n"
            "print(json.dumps(sorted({n.split('.')[0] for n, m in list(sys.modules.items())\n"
            "    if (getattr(m, '__file__', None) or '').startswith(site)})))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


def _link_or_copy(src: str, dst: str) -> None:
    try:
        os.link(src, dst)
    except OSError:
        shutil.copy2(src, dst)


def _target_dir(dest: Path) -> None:
    """What ``pip install --target dest`` leaves for the distributions of those modules: their files (by their
    RECORD's top-level entries) and their metadata."""
    import importlib.metadata

    owners = importlib.metadata.packages_distributions()
    names = {dist for top in _top_names() for dist in owners.get(top, [])}
    assert {"ipykernel", "pyzmq", "jupyter_client"} <= names, names
    dest.mkdir()
    for name in names:
        dist = importlib.metadata.distribution(name)
        for top in {f.parts[0] for f in dist.files or [] if f.parts and f.parts[0] not in ("..", "__pycache__")}:
            src = Path(dist.locate_file(top))
            if top.endswith(".pth") or not src.exists() or (dest / top).exists():
                continue
            if src.is_dir():
                shutil.copytree(src, dest / top, copy_function=_link_or_copy, symlinks=True,
                                ignore=shutil.ignore_patterns("__pycache__"))
            else:
                _link_or_copy(str(src), str(dest / top))


@pytest.fixture(scope="module")
def pythonpath_host(tmp_path_factory) -> dict:
    """Run HOST in an interpreter whose packages all come through PYTHONPATH; its JSON report."""
    base = tmp_path_factory.mktemp("pythonpath")
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(base / "venv")], check=True, timeout=120)
    _target_dir(base / "deps")
    other = base / "other"  # another PYTHONPATH entry: a package and a data file the kernel must not see
    (other / "secretpkg").mkdir(parents=True)
    (other / "secretpkg" / "__init__.py").write_text("ANSWER = 42\n")
    (other / "answers.jsonl").write_text('{"answer": 42}\n')
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "VIRTUAL_ENV"))}
    env["PYTHONPATH"] = os.pathsep.join([str(base / "deps"), str(other), str(ROOT)])  # a source checkout's run
    env["PYTHONNOUSERSITE"] = "1"
    out = subprocess.run([str(base / "venv" / "bin" / "python"), "-c", HOST, str(other), str(ROOT)],
                         capture_output=True, text=True, timeout=300, cwd=base, env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    report = json.loads(out.stdout.strip().splitlines()[-1])
    report["deps"], report["other"] = str(base / "deps"), str(other)
    return report


def test_the_host_imports_its_packages_through_pythonpath_alone(pythonpath_host):
    """The set-up is what it claims: ipykernel comes from the PYTHONPATH directory, which is none of the
    interpreter's own directories (today's view and import path come from those alone)."""
    r = pythonpath_host
    assert r["ipykernel"].startswith(r["deps"] + "/")
    assert not any(r["deps"].startswith(p.rstrip("/") + "/") or p == r["deps"] for p in r["python_paths"])
    assert r["deps"] in r["import_dirs"]
    assert r["other"] not in r["import_dirs"] and not any(str(ROOT).startswith(d) for d in r["import_dirs"])


@pytest.mark.parametrize("boot", ["booted", "forked"])
def test_a_kernel_imports_from_the_hosts_pythonpath_and_sees_nothing_else(pythonpath_host, boot):
    r = pythonpath_host
    if boot == "forked" and not (is_root() and r["fork_server"]):
        pytest.skip("the fork server serves the bwrap level on a root host")
    got = r[boot]
    assert "error" not in got, got.get("error")
    assert got["forked"] == (boot == "forked")
    assert got["two"] == ["ok", "2\n"]
    # user code sees the interpreter's own sys.path (no PYTHONPATH), and neither the other PYTHONPATH entry nor the
    # checkout is in its view
    assert r["deps"] not in got["probe"]["path"] and str(ROOT) not in got["probe"]["path"]
    assert got["probe"]["other"] is False and got["probe"]["checkout"] is False
    assert got["secret"] == "ModuleNotFoundError"
