"""Every example in README.md and docs/*.md runs as written, and every relative link resolves.

The ```python blocks of one markdown file, concatenated in order, run as one script in a fresh subprocess from an
empty directory (a tutorial may build on its earlier blocks), on the CPU, with the package under test first on the
path. Each block keeps its line numbers from the markdown file, so a traceback's ``blocks.py``, line N is line N of
the page. A block fenced ```python no-run (it needs a GPU, a service or several processes) is only compiled.
"""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# Outside the repository (the wheel check copies tests/ alone) there are no pages, and nothing to check.
PAGES = sorted(p for p in [ROOT / "README.md", *(ROOT / "docs").glob("*.md")] if p.is_file())
#: Optional packages (the integrations and demo extras): a page that imports one that is missing is skipped.
OPTIONAL = {
    "lightning",
    "pytorch_lightning",
    "transformers",
    "accelerate",
    "tensorboard",
    "wandb",
    "matplotlib",
    "tqdm",
}
TIMEOUT_S = 240  # a page's examples take well under 30 s alone; this leaves room on a loaded machine

FENCE = re.compile(r"^(?P<indent>[ \t]*)(?P<ticks>`{3,}|~{3,})(?P<info>.*)$")


def fences(lines: list[str]) -> list[tuple[int, int, str, str]]:
    """(opening line index, closing line index, indent, info string) of every fenced block, in order."""
    found = []
    i = 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if m is None or (m["ticks"][0] == "`" and "`" in m["info"]):  # no fence, or inline code (CommonMark)
            i += 1
            continue
        ticks = m["ticks"]
        end = i + 1  # the closing fence: only fence characters, at least as many (or the end of the page)
        while end < len(lines) and not (lines[end].strip().startswith(ticks) and not lines[end].strip(ticks[0] + " ")):
            end += 1
        found.append((i, end, m["indent"], m["info"].strip()))
        i = end + 1
    return found


def code_blocks(text: str) -> list[tuple[int, str, str]]:
    """(line number of the first line of code, info string, code) of every fenced block of ``text``, in order."""
    lines = text.splitlines()
    blocks = []
    for start, end, indent, info in fences(lines):
        body = [line[len(indent) :] if line.startswith(indent) else line.lstrip() for line in lines[start + 1 : end]]
        blocks.append((start + 2, info, "\n".join(body)))
    return blocks


def python_blocks(page: Path) -> tuple[list[tuple[int, str]], list[tuple[int, str]]]:
    """The page's runnable and no-run python blocks as (first line number, code)."""
    run, no_run = [], []
    for line, info, code in code_blocks(page.read_text(encoding="utf-8")):
        words = info.split()
        if not words or words[0] not in ("python", "py"):
            continue
        (no_run if "no-run" in words[1:] else run).append((line, code))
    return run, no_run


def script_of(blocks: list[tuple[int, str]]) -> str:
    """The blocks as one script, each at its own line numbers (blank lines in between)."""
    out: list[str] = []
    for line, code in blocks:
        out.extend([""] * (line - 1 - len(out)))
        out.extend(code.splitlines())
    return "\n".join(out) + "\n"


def page_id(page: Path) -> str:
    return page.relative_to(ROOT).as_posix()


def test_pages_found() -> None:
    if not (ROOT / "pyproject.toml").is_file() or not (ROOT / "torch_gradstats").is_dir():
        pytest.skip("not in a checkout of the repository: the documentation is not here")
    names = [page_id(p) for p in PAGES]
    assert "README.md" in names and "docs/design.md" in names, names


def optional_imports(code: str) -> set[str]:
    """The optional packages that ``code`` imports."""
    found = set()
    for module in re.findall(r"^\s*(?:from|import)\s+([\w.]+)", code, re.MULTILINE):
        top = "tensorboard" if module.startswith("torch.utils.tensorboard") else module.split(".")[0]
        if top in OPTIONAL:
            found.add(top)
    return found


def test_fence_parser() -> None:
    text = "a\n```python\nx = 1\n```\n- item\n  ```python no-run\n  y = 2\n  ```\n```bash\nls\n```\n"
    assert code_blocks(text) == [(3, "python", "x = 1"), (7, "python no-run", "y = 2"), (10, "bash", "ls")]
    assert code_blocks("```` ```python ```` is inline code\n```python\nz = 3\n```\n") == [(3, "python", "z = 3")]
    assert script_of([(3, "x = 1"), (7, "y = 2")]) == "\n\nx = 1\n\n\n\ny = 2\n"


def test_optional_imports() -> None:
    code = "import torch\nfrom torch.utils.tensorboard import SummaryWriter\n    import other\nimport wandb.sdk\n"
    assert optional_imports(code) == {"tensorboard", "wandb"}
    assert optional_imports("import torch\nimport os.path\nfrom torch_gradstats.integrations import log_to\n") == set()


def run_page(page: Path, tmp_path: Path) -> subprocess.CompletedProcess[str] | None:
    """Compile the page's no-run blocks, then run its python blocks as one script from an empty directory.

    None if the page has no runnable block. A no-run block with a syntax error raises SyntaxError (page and line).
    """
    run, no_run = python_blocks(page)
    for line, code in no_run:
        compile("\n" * (line - 1) + code, str(page), "exec")
    if not run:
        return None
    imported = optional_imports("\n".join(code for _, code in run))
    missing = sorted(m for m in imported if importlib.util.find_spec(m) is None)
    if missing:
        pytest.skip(f"the examples need {', '.join(missing)} (pip install torch_gradstats[integrations,demo])")
    script = tmp_path / "script" / "blocks.py"
    script.parent.mkdir()
    script.write_text(script_of(run), encoding="utf-8")
    work = tmp_path / "work"
    work.mkdir()
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), *filter(None, [env.get("PYTHONPATH")])])
    env.update(WANDB_MODE="disabled", WANDB_SILENT="true", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    env.update(MPLBACKEND="Agg", TOKENIZERS_PARALLELISM="false")
    return subprocess.run(
        [sys.executable, str(script)],
        check=False,
        cwd=work,
        env=env,
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S,
    )


@pytest.mark.slow
@pytest.mark.parametrize("page", PAGES, ids=page_id)
def test_examples_run(page: Path, tmp_path: Path) -> None:
    proc = run_page(page, tmp_path)
    if proc is not None and proc.returncode != 0:
        pytest.fail(
            f"the python blocks of {page_id(page)} exited with {proc.returncode} (line N of blocks.py is line N of "
            f"the page):\n{proc.stdout[-4000:]}\n{proc.stderr[-8000:]}",
            pytrace=False,
        )


def test_run_page_catches_failures(tmp_path: Path) -> None:
    page = tmp_path / "page.md"
    page.write_text(
        "# A page\n```python\nimport os\nprint(sorted(os.listdir()))\n```\ntext\n"
        "```python no-run\nimport a_package_that_is_not_installed\n```\n"
        "```python\nimport torch_gradstats\nprint(torch_gradstats.__file__)\nraise ValueError('bad example')\n```\n",
        encoding="utf-8",
    )
    proc = run_page(page, tmp_path)
    assert proc is not None and proc.returncode == 1
    assert proc.stdout.splitlines()[0] == "[]", proc.stdout  # run from an empty directory
    if (ROOT / "torch_gradstats").is_dir():  # in a checkout: the package under test, not an installed one
        assert proc.stdout.splitlines()[1] == str(ROOT / "torch_gradstats" / "__init__.py")
    assert 'blocks.py", line 13' in proc.stderr and "ValueError: bad example" in proc.stderr, proc.stderr

    page.write_text("```python no-run\ntorch.ones(1).to('cuda')\n```\n```python no-run\nif x\n```\n")
    with pytest.raises(SyntaxError) as err:
        run_page(page, tmp_path / "again")
    assert err.value.lineno == 5


LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")


def without_code_blocks(text: str) -> str:
    lines = text.splitlines()
    for start, end, _, _ in fences(lines):
        lines[start : end + 1] = [""] * (min(end, len(lines) - 1) + 1 - start)
    return "\n".join(lines)


def anchors(text: str) -> set[str]:
    """The anchors GitHub gives the headings of a page: lower case, punctuation dropped, spaces as hyphens."""
    seen: dict[str, int] = {}
    out = set()
    for heading in re.findall(r"^#+\s+(.*?)\s*$", without_code_blocks(text), re.MULTILINE):
        slug = re.sub(r"[^\w\- ]", "", heading.lower()).replace(" ", "-")
        out.add(slug if slug not in seen else f"{slug}-{seen[slug]}")
        seen[slug] = seen.get(slug, 0) + 1
    return out


def test_anchor_slugs() -> None:
    text = "# A `b.c_d` (e)\n## Per-step: x, y\n## Per-step: x, y\n```\n# not a heading\n```\n"
    assert anchors(text) == {"a-bc_d-e", "per-step-x-y", "per-step-x-y-1"}


@pytest.mark.parametrize("page", PAGES, ids=page_id)
def test_relative_links_resolve(page: Path) -> None:
    broken = []
    for target in LINK.findall(without_code_blocks(page.read_text(encoding="utf-8"))):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target):
            continue  # a URL (http:, mailto:)
        path, _, anchor = target.partition("#")
        dest = page.parent / path if path else page
        missing_heading = (
            dest.is_file()
            and dest.suffix == ".md"
            and anchor
            and anchor not in anchors(dest.read_text(encoding="utf-8"))
        )
        if not dest.exists() or missing_heading:
            broken.append(target)
    assert not broken, f"{page_id(page)} links to files or headings that do not exist: {broken}"
