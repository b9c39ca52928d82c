"""README is the front door: short, its two commands the ones CI and run_all.sh run, its links alive."""
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
