"""The ``zeroinf`` entry point: usage errors and how the package is found."""
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from zeroinf import cli

REPO = Path(__file__).resolve().parents[1]


def test_no_command_is_a_usage_error(capsys):
    assert cli.main([]) == 2
    out = capsys.readouterr()
    assert out.out == "" and "usage: zeroinf" in out.err and "train" in out.err


def test_unknown_command_names_it(capsys):
    assert cli.main(["trian"]) == 2
    err = capsys.readouterr().err
    assert "unknown command 'trian'" in err and "train" in err


def test_help_exits_0(capsys):
    assert cli.main(["--help"]) == 0
    assert "usage: zeroinf" in capsys.readouterr().out


def test_ctrl_c_while_a_command_is_imported_is_one_line_and_130(monkeypatch, capsys):
    """Ctrl-C while a subcommand's module loads (its ``import torch`` takes seconds) or in any
    wait the subcommand does not handle itself: one line, exit 130, no traceback."""
    def interrupted(name):
        raise KeyboardInterrupt

    monkeypatch.setattr(cli.importlib, "import_module", interrupted)
    assert cli.main(["report"]) == cli.EXIT_INTERRUPTED == 130
    out = capsys.readouterr()
    assert out.out == "" and out.err == "zeroinf: interrupted\n"


def test_a_slow_command_import_says_what_it_waits_for(monkeypatch, capsys):
    """A subcommand whose module takes longer than LOADING_NOTICE_S to import prints one line
    naming the wait; a fast one prints nothing before its own output."""
    real = cli.importlib.import_module

    def slow(name):
        time.sleep(0.5)
        return real(name)

    monkeypatch.setattr(cli, "LOADING_NOTICE_S", 0.05)
    monkeypatch.setattr(cli.importlib, "import_module", slow)
    with pytest.raises(SystemExit):
        cli.main(["estimate", "--help"])
    assert capsys.readouterr().err.count("zeroinf estimate: loading torch ...\n") == 1
    monkeypatch.setattr(cli, "LOADING_NOTICE_S", 5.0)
    monkeypatch.setattr(cli.importlib, "import_module", real)
    with pytest.raises(SystemExit):
        cli.main(["estimate", "--help"])
    assert "loading" not in capsys.readouterr().err


def test_import_from_the_folder_that_holds_a_clone(tmp_path):
    """A folder named zeroinf/ in the working directory (the clone itself, seen from its parent)
    is not taken for the package: the installed zeroinf is imported."""
    import importlib.metadata
    import json
    # every record of the name: the clone's own zeroinf.egg-info (no direct_url.json) may come first
    urls = [json.loads(d.read_text("direct_url.json") or "{}").get("url")
            for d in importlib.metadata.distributions(name="zeroinf")]
    if REPO.as_uri() not in urls:
        pytest.skip(f"zeroinf is not installed from this repository in this interpreter (installed: {urls})")
    (tmp_path / "zeroinf").mkdir()
    (tmp_path / "zeroinf" / "README.md").write_text("a clone's root holds no __init__.py\n")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    probe = "import zeroinf, sys; print(zeroinf.__file__); zeroinf.initialize"
    r = subprocess.run([sys.executable, "-c", probe], cwd=tmp_path, env=env, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    found = Path(r.stdout.strip())
    assert found.name == "__init__.py" and found.parent.name == "zeroinf"
    assert found.parent != tmp_path / "zeroinf"


_SAVE = """
import torch, zeroinf
from torch import nn
torch.manual_seed(0)
m = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 2))
cfg = {"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
       "zero_optimization": {"stage": 3}}
engine, _, _, _ = zeroinf.initialize(model=m, config=cfg)
loss = engine(torch.randn(2, 8)).pow(2).mean()
engine.backward(loss)
engine.step()
engine.save_checkpoint("ckpt", tag="step100")
with zeroinf.gathered_parameters(engine.module.parameters()):
    torch.save({k: v.detach().clone() for k, v in engine.module.state_dict().items()}, "expected.pt")
"""


def test_readme_consolidate_runs_in_a_fresh_process(tmp_path):
    """The README's consolidate line, ``zeroinf.checkpoint.consolidate(...)`` after a bare
    ``import zeroinf``, in a process of its own, gives the trained weights."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))
    for code in (_SAVE, 'import zeroinf\nzeroinf.checkpoint.consolidate("ckpt", "step100", "model_fp32.pt")\n'):
        r = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True)
        assert r.returncode == 0, r.stderr
    got = torch.load(tmp_path / "model_fp32.pt")
    want = torch.load(tmp_path / "expected.pt")
    assert sorted(got) == sorted(want)
    for k in want:
        torch.testing.assert_close(got[k], want[k].float(), rtol=0, atol=0)


def _imports(path: Path, package: str):
    """Every module name ``path`` imports (relative imports resolved against ``package``), at any depth."""
    import ast

    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            yield from (a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(parts + ([base] if base else []))
            yield base
            yield from (f"{base}.{a.name}" for a in node.names)


def test_the_library_imports_no_command_line_app():
    """zeroinf/cli/ holds the apps (and zeroinf/__main__.py runs them); the library under zeroinf/
    (runtime, io, optim, ops, the memory model, checkpoint) never imports them, so it works without
    their dependencies."""
    root = REPO / "zeroinf"
    library = [p for p in root.rglob("*.py") if (root / "cli") not in p.parents and p != root / "__main__.py"]
    assert len(library) > 20 and root / "estimate.py" in library and root / "placement.py" in library
    offenders = []
    for path in library:
        rel = path.relative_to(REPO).with_suffix("")
        package = ".".join(rel.parts[:-1])
        offenders += [f"{rel}: {name}" for name in _imports(path, package)
                      if name == "zeroinf.cli" or name.startswith("zeroinf.cli.")]
    assert offenders == []


def test_the_import_walk_sees_an_app_import(tmp_path):
    """The check above resolves relative imports: ``from ..cli import x`` in zeroinf/io/ is found."""
    probe = tmp_path / "probe.py"
    probe.write_text("from ..cli import plan\nimport zeroinf.cli.train\n")
    assert {"zeroinf.cli", "zeroinf.cli.plan", "zeroinf.cli.train"} <= set(_imports(probe, "zeroinf.io"))


def test_every_command_is_an_app_under_cli():
    import importlib

    assert set(cli.COMMANDS) == {"train", "report", "estimate", "plan", "tune-io"}
    for name, (module, _help) in cli.COMMANDS.items():
        assert module.startswith("zeroinf.cli."), name
        mod = importlib.import_module(module)
        assert callable(mod.add_arguments) and callable(mod.main), module


def test_python_dash_m_zeroinf_runs_the_dispatcher():
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))
    r = subprocess.run([sys.executable, "-m", "zeroinf", "--help"], env=env, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("usage: zeroinf") and "tune-io" in r.stdout


def test_every_file_the_readme_and_docs_link_to_is_in_the_repository():
    import re
    missing = []
    for md in [REPO / "README.md", *sorted((REPO / "docs").glob("*.md")), REPO / "bench" / "README.md"]:
        for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", md.read_text()):
            if "://" not in target and not target.startswith("mailto:") and not (md.parent / target).exists():
                missing.append(f"{md.relative_to(REPO)}: {target}")
    assert not missing


def test_zeroinf_warnings_print_as_their_own_line_in_the_command(monkeypatch):
    """A command's zeroinf warning is its one line on stderr, not Python's "file:line:
    UserWarning: ..." and the library source line; another library's keeps Python's format."""
    import warnings

    monkeypatch.setattr(warnings, "formatwarning", warnings.formatwarning)  # restored after the test
    monkeypatch.setattr(cli, "COMMANDS", {"warn": ("zeroinf_cli_warn_probe", "probe")})
    mod = type(sys)("zeroinf_cli_warn_probe")
    mod.add_arguments = lambda parser: None
    mod.main = lambda args: 0
    monkeypatch.setitem(sys.modules, "zeroinf_cli_warn_probe", mod)
    assert cli.main(["warn"]) == 0
    ours = warnings.formatwarning(UserWarning("zeroinf: one line for the user"), UserWarning, "/lib/x.py", 3, "src")
    theirs = warnings.formatwarning(DeprecationWarning("old"), DeprecationWarning, "/lib/y.py", 7, "src")
    assert ours == "zeroinf: one line for the user\n"
    assert theirs.startswith("/lib/y.py:7: DeprecationWarning: old")
