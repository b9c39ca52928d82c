"""README is the front door: short, its two commands the ones CI and run_all.sh run, its links alive.
The manual (docs/, built by mkdocs --strict in CI) names only files of the tree that exist."""
import glob
import os
import re

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MAX_LINES = 300


def _read(*path: str) -> str:
    with open(os.path.join(ROOT, *path), encoding="utf-8") as fh:
        return fh.read()


def _quick_start_commands(readme: str) -> list[str]:
    """The commands of the first code block under '## Quick start', comments dropped."""
    section = readme.split("## Quick start", 1)[1]
    block = section.split("```bash", 1)[1].split("```", 1)[0]
    return [line.split("#", 1)[0].strip() for line in block.splitlines() if line.split("#", 1)[0].strip()]


def test_readme_is_short():
    lines = _read("README.md").count("\n")
    assert lines <= MAX_LINES, f"README.md has {lines} lines: the manual's pages (docs/) take the rest"


def test_the_two_commands_are_what_ci_runs():
    assert _quick_start_commands(_read("README.md")) == ["./run_all.sh", "./run_all.sh --tests"]
    ci = [line for line in _read(".ci", "run").splitlines() if line.strip() and not line.lstrip().startswith("#")]
    assert ci[-1].strip() == "./run_all.sh --tests", "CI's last step is the README's test command"
    run_all = _read("run_all.sh")
    assert '"${1:-}" == "--tests"' in run_all, "run_all.sh takes --tests"
    assert "test/mnist.py" in run_all, "./run_all.sh runs the example the README names"
    assert "mkdocs build --strict" in run_all, "the tests build the manual strictly"


def test_readme_links_lead_somewhere():
    readme = _read("README.md")
    for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", readme):
        if "://" in target:
            continue
        assert os.path.exists(os.path.join(ROOT, target)), f"README.md links to {target}, which is not there"


# a path of the tree in the text: gpu_client/rank/runner.py, test/test_e2e.py, bench/README.md, ...
PATH_IN_TEXT = re.compile(r"(?<![\w/.~-])((?:gpu_client|zwdx|test|bench|ui)/[\w./-]+\.(?:py|sh|md|json|jsx?|toml|yml))\b")


def test_docs_name_files_that_exist():
    pages = ["README.md"] + sorted(os.path.relpath(p, ROOT) for p in glob.glob(os.path.join(ROOT, "docs", "**", "*.md"),
                                                                              recursive=True))
    missing = sorted({f"{page}: {path}" for page in pages for path in PATH_IN_TEXT.findall(_read(page))
                      if not os.path.exists(os.path.join(ROOT, path))})
    assert not missing, "the docs name files that are not in the tree (moved? renamed?):\n" + "\n".join(missing)


def test_architecture_names_every_import_contract():
    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10 (pyproject: >=3.10): tomli, which pytest itself needs there
        import tomli as tomllib
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as fh:
        contracts = tomllib.load(fh)["tool"]["importlinter"]["contracts"]
    page = _read("docs", "architecture.md").split("## Import layers", 1)[-1]
    missing = [c["id"] for c in contracts if f"({c['id']})" not in page]
    assert not missing, f"docs/architecture.md's Import layers section does not draw the contracts {missing}"
