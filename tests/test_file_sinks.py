"""File sinks never lose a row: appending by default, widening a resumed CSV header, absolute paths, close() on a
full disk, one writer per file, strict JSON Lines; and the integrations package's layout (the sink protocol in its
own module, an ``__init__`` that only re-exports)."""

from __future__ import annotations

import ast
import csv
import json
import math
import os
import threading
from pathlib import Path

import pytest
import torch
from torch import nn

import torch_gradstats as tg
from torch_gradstats.integrations import CSVSink, JSONLSink

SINKS = [CSVSink, JSONLSink]
INTEGRATIONS = Path(tg.__file__).parent / "integrations"


def _reports() -> tuple[tg.GradReport, tg.GradReport, tg.GradReport]:
    """A plain report, a clipped one (two more keys: clip_coef, clipped_norm) and one with a NaN and an inf."""
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 2))
    m(torch.randn(5, 3)).sum().backward()
    plain = tg.grad_stats(m.named_parameters()).report()
    clipped = tg.clip_grad_norm_(m.named_parameters(), max_norm=0.1).report()
    m[2].weight.grad[0, 0] = math.nan
    m[2].bias.grad[0] = math.inf
    bad = tg.grad_stats(m.named_parameters()).report()
    return plain, clipped, bad


def _csv_rows(path: Path) -> tuple[list[str], list[dict[str, str]]]:
    with open(path, newline="") as f:
        reader = csv.DictReader(f)
        rows = list(reader)
    return list(reader.fieldnames or []), rows


def _strict(line: str) -> dict:
    def refuse(token: str) -> None:
        raise ValueError(f"not strict JSON: {token}")

    return json.loads(line, parse_constant=refuse)


def _open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


# --- appending ----------------------------------------------------------------------------------------------------


def test_csv_appends_to_an_existing_file_by_default(tmp_path: Path) -> None:
    plain, _, bad = _reports()
    path = tmp_path / "grads.csv"
    with CSVSink(path) as sink:
        sink.log(plain, 0)
        sink.log(plain, 1)
    with CSVSink(path) as sink:  # a resumed run, same path
        sink.log(bad, 2)
    _, rows = _csv_rows(path)
    assert [r["step"] for r in rows] == ["0", "1", "2"]
    assert path.read_text().count("step,") == 1  # one header
    assert float(rows[0]["total_norm"]) == plain.total_norm and rows[2]["total_norm"] == "nan"


def test_jsonl_appends_and_continues_the_key_order(tmp_path: Path) -> None:
    plain, clipped, _ = _reports()
    path = tmp_path / "grads.jsonl"
    with JSONLSink(path, mode="a") as sink:
        sink.log(clipped, 0)  # clip_coef and clipped_norm known from here
    with JSONLSink(path) as sink:
        sink.log(plain, 1)
    lines = [_strict(line) for line in path.read_text().splitlines()]
    assert [r["step"] for r in lines] == [0, 1]
    assert list(lines[1]) == list(lines[0])  # the resumed sink writes the keys of the lines before it, in order
    assert lines[1]["clip_coef"] is None and lines[0]["clip_coef"] == clipped.clip_coef


def test_csv_append_widens_the_header_and_keeps_every_row(tmp_path: Path) -> None:
    plain, clipped, _ = _reports()
    path = tmp_path / "grads.csv"
    with CSVSink(path) as sink:
        sink.log(plain, 0)
        sink.log(plain, 1)
    before = path.read_text().splitlines()
    with CSVSink(path) as sink:
        sink.log(clipped, 2)  # two columns the file's header lacks
    after = path.read_text().splitlines()
    header, rows = _csv_rows(path)
    assert header == before[0].split(",") + ["clip_coef", "clipped_norm"]
    assert after[1:3] == [line + ",," for line in before[1:]]  # earlier rows, digit for digit, two empty cells
    assert [r["step"] for r in rows] == ["0", "1", "2"] and rows[0]["clip_coef"] == ""
    assert float(rows[2]["clip_coef"]) == clipped.clip_coef
    assert not list(tmp_path.glob("*.tmp"))


def test_csv_resumed_with_fewer_columns_leaves_their_cells_empty(tmp_path: Path) -> None:
    plain, clipped, _ = _reports()
    path = tmp_path / "grads.csv"
    with CSVSink(path) as sink:
        sink.log(clipped, 0)
    with CSVSink(path) as sink:
        sink.log(plain, 1)
    header, rows = _csv_rows(path)
    assert header == ["step", *clipped.to_dict()] and len(rows) == 2  # the header stays
    assert rows[1]["clip_coef"] == "" and float(rows[1]["total_norm"]) == plain.total_norm


def test_csv_row_cut_short_by_a_crash_stays_its_own_row(tmp_path: Path) -> None:
    plain, _, _ = _reports()
    path = tmp_path / "grads.csv"
    path.write_text("step,total_norm\r\n0,1.5\r\n1,2.5", newline="")  # the last row has no line end
    with CSVSink(path, per_param=False) as sink:
        sink.log(plain, 2)
    _, rows = _csv_rows(path)
    assert [(r["step"], r["total_norm"]) for r in rows] == [("0", "1.5"), ("1", "2.5"), ("2", repr(plain.total_norm))]


def test_csv_row_cut_inside_a_quoted_cell_swallows_no_later_row(tmp_path: Path) -> None:
    # A parameter whose name needs quoting in CSV: a comma, a quote and a newline (and a letter outside ASCII).
    odd = 'enc,"ü"\nx'
    model = nn.ModuleDict({odd: nn.Linear(2, 1, bias=False)})
    model[odd](torch.ones(1, 2)).sum().backward()
    model[odd].weight.grad[0, 0] = math.nan  # first_nonfinite: the name, in a quoted cell of every row
    report = tg.grad_stats(model.named_parameters()).report()
    whole = tmp_path / "whole.csv"
    with CSVSink(whole) as sink:
        sink.log(report, 0)
        sink.log(report, 1)
    text = whole.read_text(encoding="utf-8")
    last_row = text.rindex("\n1,") + 1
    for cut in range(last_row + 1, len(text)):  # the crash cuts the last row anywhere
        path = tmp_path / f"cut{cut}.csv"
        path.write_text(text[:cut], encoding="utf-8", newline="")
        with CSVSink(path) as sink:
            sink.log(report, 2)
            sink.log(report, 3)
        header, rows = _csv_rows(path)
        assert header[-1] == f"norm/{odd}.weight"
        assert [r["step"] for r in rows] == ["0", "1", "2", "3"], cut
        for r in rows[:1] + rows[2:]:
            assert r["first_nonfinite"] == f"{odd}.weight" and r[f"norm/{odd}.weight"] == "nan", cut


@pytest.mark.parametrize("cls", SINKS)
def test_an_empty_existing_file_gets_a_header(tmp_path: Path, cls: type) -> None:
    plain, _, _ = _reports()
    path = tmp_path / "empty"
    path.write_text("")
    with cls(path, mode="a") as sink:
        sink.log(plain, 0)
    if cls is CSVSink:
        header, rows = _csv_rows(path)
        assert header == ["step", *plain.to_dict()] and [r["step"] for r in rows] == ["0"]
    else:
        assert _strict(path.read_text())["step"] == 0


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="needs named pipes")
def test_a_pipe_is_written_and_never_read_for_a_header(tmp_path: Path) -> None:
    """A path that is not a regular file (a named pipe here) is only written: reading a header from it would block
    until another writer came, or read what the other end was never meant to give back. New columns (clipping
    starts) write the wider header again, as a line of its own."""
    plain, clipped, _ = _reports()
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    received: list[str] = []
    errors: list[BaseException] = []

    def read() -> None:
        with open(fifo, newline="") as f:
            received.append(f.read())

    def write() -> None:
        try:
            with CSVSink(fifo, mode="a", per_param=False) as sink:
                sink.log(plain, 0)
                sink.log(clipped, 1)
        except (OSError, ValueError) as exc:  # reported by the test thread
            errors.append(exc)

    threads = [threading.Thread(target=read, daemon=True), threading.Thread(target=write, daemon=True)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=20)
    stuck = any(t.is_alive() for t in threads)
    if stuck:  # unblock whoever waits in open() on the pipe
        for flags in (os.O_WRONLY | os.O_NONBLOCK, os.O_RDONLY | os.O_NONBLOCK):
            try:
                os.close(os.open(fifo, flags))
            except OSError:
                pass
    assert not stuck, "the sink blocked on the pipe"
    assert not errors, errors
    lines = received[0].splitlines()
    assert len(lines) == 4 and lines[0].startswith("step,") and lines[1].startswith("0,")
    assert lines[2].startswith(lines[0] + ",") and "clip_coef" in lines[2] and lines[3].startswith("1,")


def test_a_device_is_never_replaced_by_a_file(tmp_path: Path) -> None:
    """A character device (a private copy of /dev/null's) taking a row with new columns stays a device."""
    import stat

    plain, clipped, _ = _reports()
    dev = tmp_path / "null"
    try:
        os.mknod(dev, 0o666 | stat.S_IFCHR, os.makedev(1, 3))
    except (PermissionError, OSError, AttributeError):
        pytest.skip("cannot make a device node here")
    with CSVSink(dev, per_param=False) as sink:
        sink.log(plain, 0)
        sink.log(clipped, 1)
    assert stat.S_ISCHR(os.stat(dev).st_mode)
    assert sorted(os.listdir(tmp_path)) == ["null"]


def test_sinks_widening_one_after_the_other_each_keep_their_file(tmp_path: Path) -> None:
    """A widening frees the replaced file's inode, whose number the file system may give to the next file made
    (the other sink's rewritten copy): each sink holds only its own file's."""
    plain, clipped, _ = _reports()
    with CSVSink(tmp_path / "a.csv", per_param=False) as a, CSVSink(tmp_path / "b.csv") as b:
        for step, report in enumerate((plain, plain, clipped, plain)):
            a.log(report, step)
            b.log(report, step)
        JSONLSink(tmp_path / "c.jsonl").close()  # a file made after the widenings is free too
    for name in ("a.csv", "b.csv"):
        header, rows = _csv_rows(tmp_path / name)
        assert "clip_coef" in header and [r["step"] for r in rows] == ["0", "1", "2", "3"], name


def test_widening_writes_no_file_but_its_own(tmp_path: Path) -> None:
    """The rewritten copy takes a fresh name: a file named like a fixed temporary name (here another sink's) is left
    as it is."""
    plain, clipped, _ = _reports()
    with CSVSink(tmp_path / "x.csv", per_param=False) as sink, JSONLSink(tmp_path / "x.csv.tmp") as other:
        for step, report in enumerate((plain, clipped)):
            sink.log(report, step)
            other.log(report, step)
    header, rows = _csv_rows(tmp_path / "x.csv")
    assert "clip_coef" in header and [r["step"] for r in rows] == ["0", "1"]
    assert [_strict(line)["step"] for line in (tmp_path / "x.csv.tmp").read_text().splitlines()] == [0, 1]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["x.csv", "x.csv.tmp"]


@pytest.mark.parametrize("how", ["cannot-write-beside", "rotated"])
def test_a_file_that_cannot_be_rewritten_gets_the_wider_header_as_a_line(
        tmp_path: Path, how: str, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """No row is lost when the widening cannot rewrite the file: a directory where no file can be made (root ignores
    permissions, so the refusal is simulated), or a file moved away under the sink (log rotation), whose new file at
    the path is left alone."""
    import tempfile

    plain, clipped, _ = _reports()
    path = tmp_path / "x.csv"
    with CSVSink(path, per_param=False) as sink:
        sink.log(plain, 0)
        if how == "rotated":
            os.rename(path, tmp_path / "x.csv.1")
            path.write_text("someone else's\n")
        else:
            def refuse(*args: object, **kwargs: object) -> None:
                raise PermissionError(13, "Permission denied")

            monkeypatch.setattr(tempfile, "mkstemp", refuse)
        with caplog.at_level("WARNING", logger="torch_gradstats"):
            sink.log(clipped, 1)
        sink.log(plain, 2)
    written = tmp_path / ("x.csv.1" if how == "rotated" else "x.csv")
    lines = written.read_text().splitlines()
    assert [line.split(",")[0] for line in lines] == ["step", "0", "step", "1", "2"]
    assert "clip_coef" in lines[2] and lines[2].startswith(lines[0] + ",")
    assert any("could not rewrite" in r.getMessage() for r in caplog.records)
    if how == "rotated":
        assert path.read_text() == "someone else's\n"


@pytest.mark.skipif(not hasattr(os, "symlink"), reason="needs symbolic links")
def test_widening_through_a_symbolic_link_rewrites_the_file_it_names(tmp_path: Path) -> None:
    plain, clipped, _ = _reports()
    target, link = tmp_path / "target.csv", tmp_path / "link.csv"
    target.touch()
    os.symlink(target, link)
    with CSVSink(link, per_param=False) as sink:
        sink.log(plain, 0)
        sink.log(clipped, 1)  # new columns: the file is rewritten
        sink.log(plain, 2)
    assert link.is_symlink()
    header, rows = _csv_rows(target)
    assert "clip_coef" in header and [r["step"] for r in rows] == ["0", "1", "2"]




@pytest.mark.parametrize("cls", SINKS)
def test_mode_w_overwrites(tmp_path: Path, cls: type) -> None:
    plain, _, _ = _reports()
    path = tmp_path / "f"
    for step in (0, 1):
        with cls(path, mode="w") as sink:
            sink.log(plain, step)
    lines = path.read_text().splitlines()
    assert len(lines) == (2 if cls is CSVSink else 1)  # a header and one row, or one line
    assert lines[-1].startswith(("1,", '{"step": 1,'))


@pytest.mark.parametrize("cls", SINKS)
def test_bad_mode_is_refused_before_the_file_is_touched(tmp_path: Path, cls: type) -> None:
    path = tmp_path / "keep"
    path.write_text("precious\n")
    for mode in ("r", "x", "a+", 1):
        with pytest.raises(ValueError, match=f"{cls.__name__}: mode must be 'a' .* or 'w'"):
            cls(path, mode=mode)
    assert path.read_text() == "precious\n"


def test_appending_to_a_file_that_is_no_csv_names_it_and_keeps_it(tmp_path: Path) -> None:
    path = tmp_path / "model.bin"
    path.write_bytes(b"\x80\x81\xfe\xff" * 8)
    with pytest.raises(ValueError, match=f"CSVSink: cannot append to {path}: its first line is no CSV header"):
        CSVSink(path)
    assert path.read_bytes() == b"\x80\x81\xfe\xff" * 8
    CSVSink(path, mode="w").close()  # the path was not kept by the refused sink


@pytest.mark.parametrize("content", ['{"step": 0, "total_norm": 1.5}\n', "epoch,loss\n0,1.5\n"], ids=["jsonl", "csv"])
def test_appending_to_a_file_no_csv_sink_wrote_names_it_and_keeps_it(tmp_path: Path, content: str) -> None:
    plain, _, _ = _reports()
    path = tmp_path / "other"
    path.write_text(content)
    with pytest.raises(ValueError, match=f"CSVSink: cannot append to {path}: its first line .* is no header this sink "
                                         "wrote .*start with 'step'"):
        CSVSink(path)
    assert path.read_text() == content  # not rewritten as cells of a wider header
    with CSVSink(path, mode="w") as sink:
        sink.log(plain, 0)


# --- the path -----------------------------------------------------------------------------------------------------


def test_relative_path_is_made_absolute_when_the_sink_is_made(tmp_path: Path,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    plain, clipped, _ = _reports()
    (tmp_path / "run").mkdir()
    (tmp_path / "elsewhere").mkdir()
    monkeypatch.chdir(tmp_path / "run")
    csv_sink, jsonl_sink = CSVSink("grads.csv"), JSONLSink("grads.jsonl")
    assert csv_sink.path == str(tmp_path / "run" / "grads.csv")
    assert jsonl_sink.path == str(tmp_path / "run" / "grads.jsonl")
    csv_sink.log(plain, 0)
    monkeypatch.chdir(tmp_path / "elsewhere")
    csv_sink.log(clipped, 1)  # new columns: the file is rewritten, where it was made
    csv_sink.close()
    jsonl_sink.close()
    header, rows = _csv_rows(tmp_path / "run" / "grads.csv")
    assert [r["step"] for r in rows] == ["0", "1"] and "clipped_norm" in header
    assert not os.listdir(tmp_path / "elsewhere")


# --- close --------------------------------------------------------------------------------------------------------


@pytest.mark.skipif(not os.path.exists("/dev/full") or not os.path.isdir("/proc/self/fd"),
                    reason="needs Linux's /dev/full (every write fails: no space left on device)")
@pytest.mark.parametrize("cls", SINKS)
def test_close_on_a_full_disk_releases_the_file_and_raises_once(cls: type) -> None:
    plain, _, _ = _reports()
    before = _open_fds()
    sink = cls("/dev/full", flush_every=100)  # the row stays in the buffer until close
    sink.log(plain, 0)
    assert _open_fds() == before + 1
    with pytest.raises(OSError, match="No space left on device"):
        sink.close()
    assert _open_fds() == before  # the descriptor is released all the same
    sink.close()  # a second close does nothing
    with pytest.raises(ValueError, match="is closed"):
        sink.log(plain, 1)
    cls("/dev/full").close()  # and the path is free again


# --- one writer per file --------------------------------------------------------------------------------------------


def test_a_second_sink_on_an_open_sinks_file_is_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    plain, clipped, _ = _reports()
    path = tmp_path / "grads.csv"
    first = CSVSink(path)
    first.log(plain, 0)
    monkeypatch.chdir(tmp_path)
    for other in (lambda: CSVSink(path), lambda: CSVSink("grads.csv", mode="w"),
                  lambda: JSONLSink(tmp_path / "." / "grads.csv")):
        with pytest.raises(ValueError, match=f"{path} is already written by an open CSVSink"):
            other()
    first.log(clipped, 1)  # widening still works: nobody else wrote
    first.close()
    with CSVSink(path) as second:  # closing the first frees the path
        second.log(plain, 2)
    _, rows = _csv_rows(path)
    assert [r["step"] for r in rows] == ["0", "1", "2"]


@pytest.mark.parametrize("make_link", ["symlink", "link"], ids=["symbolic", "hard"])
def test_a_link_to_an_open_sinks_file_is_refused(tmp_path: Path, make_link: str) -> None:
    if not hasattr(os, make_link):
        pytest.skip(f"needs os.{make_link}")
    target = tmp_path / "grads.jsonl"
    with JSONLSink(target):
        getattr(os, make_link)(target, tmp_path / "link.jsonl")
        with pytest.raises(ValueError, match="link.jsonl is already written by an open JSONLSink"):
            JSONLSink(tmp_path / "link.jsonl")
    JSONLSink(tmp_path / "link.jsonl").close()  # freed with the first sink


def test_a_refused_sink_leaves_the_first_one_writing(tmp_path: Path) -> None:
    plain, _, _ = _reports()
    path = tmp_path / "g.jsonl"
    with JSONLSink(path) as first:
        with pytest.raises(ValueError):
            JSONLSink(path)
        first.log(plain, 0)
        with pytest.raises(ValueError):  # the refused sink did not free the path either
            JSONLSink(path)
    assert _strict(path.read_text())["step"] == 0


# --- strict JSON Lines ----------------------------------------------------------------------------------------------


def test_jsonl_is_strict_json_with_null_for_non_finite_numbers(tmp_path: Path) -> None:
    plain, _, bad = _reports()
    path = tmp_path / "grads.jsonl"
    with JSONLSink(path, prefix="grad/") as sink:
        sink.log(plain, 0)
        sink.log(bad, 1)
    rows = [_strict(line) for line in path.read_text().splitlines()]  # raises on NaN / Infinity tokens
    assert rows[1]["grad/total_norm"] is None and rows[1]["grad/norm/2.bias"] is None  # NaN and inf: both null
    assert rows[1]["grad/nan_count"] == 1 and rows[1]["grad/inf_count"] == 1  # the counts say which was which
    assert rows[1]["grad/norm/0.weight"] == bad.norms["0.weight"]  # finite numbers unchanged
    assert rows[0]["grad/total_norm"] == plain.total_norm


# --- the integrations package ---------------------------------------------------------------------------------------


def test_integrations_init_only_re_exports() -> None:
    tree = ast.parse((INTEGRATIONS / "__init__.py").read_text())
    body = tree.body[1:] if isinstance(tree.body[0], ast.Expr) else tree.body  # the docstring
    for node in body:
        is_all = isinstance(node, ast.Assign) and [getattr(t, "id", None) for t in node.targets] == ["__all__"]
        assert isinstance(node, (ast.Import, ast.ImportFrom)) or is_all, (
            f"integrations/__init__.py line {node.lineno} is neither an import nor __all__")


def test_no_integrations_module_imports_from_its_package_init() -> None:
    defined_in_modules = {p.stem for p in INTEGRATIONS.glob("*.py")}
    for path in INTEGRATIONS.glob("*.py"):
        if path.name == "__init__.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.ImportFrom):
                continue
            package = (node.level == 1 and not node.module) or node.module == "torch_gradstats.integrations"
            if package:
                names = [a.name for a in node.names if a.name not in defined_in_modules]
                assert not names, f"{path.name} line {node.lineno} imports {names} from the integrations package"


@pytest.mark.slow
@pytest.mark.skipif(os.name != "posix", reason="flock: POSIX systems")
def test_a_file_another_process_writes_is_refused_untouched(tmp_path: Path) -> None:
    import subprocess
    import sys

    plain, _, _ = _reports()
    paths = {cls: tmp_path / f"shared.{cls.__name__}" for cls in SINKS}
    child = subprocess.Popen(  # another rank, given the same paths
        [sys.executable, "-c", (
            "import sys\n"
            "from torch_gradstats.integrations import CSVSink, JSONLSink\n"
            f"sinks = [CSVSink({str(paths[CSVSink])!r}), JSONLSink({str(paths[JSONLSink])!r})]\n"
            "print('ready', flush=True)\n"
            "sys.stdin.read()\n"
            "for s in sinks: s.close()\n"
        )], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout is not None and child.stdout.readline() == "ready\n"
        for cls, path in paths.items():
            path.write_text("kept\n")  # what the other process wrote
            for mode in ("a", "w"):
                with pytest.raises(ValueError, match=f"{cls.__name__}: {path} is already written by a sink of another "
                                                     "process"):
                    cls(path, mode=mode)
            assert path.read_text() == "kept\n"
    finally:
        child.communicate("", timeout=60)
    assert child.returncode == 0
    for cls, path in paths.items():  # closed there: free here
        with cls(path, mode="w") as sink:
            sink.log(plain, 0)


@pytest.mark.skipif(not hasattr(os, "fork"), reason="fork: POSIX systems")
@pytest.mark.parametrize("cls", SINKS)
def test_a_forked_child_neither_keeps_the_file_locked_nor_writes_to_it(tmp_path: Path, cls: type) -> None:
    plain, _, _ = _reports()
    path = tmp_path / "g"
    sink = cls(path, flush_every=10)
    sink.log(plain, 0)  # still in the sink's buffer, which the child copies
    ready, go = os.pipe()
    started, up = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child (a DataLoader worker, say)
        code = 3
        try:
            try:
                sink.log(plain, 1)
                code = 1
            except ValueError as exc:
                code = 0 if "was opened by the process this one was forked from" in str(exc) else 2
            sink.close()  # its copy of the buffer goes nowhere
            os.write(up, b"x")
            os.read(ready, 1)  # alive, with its copies of the descriptors, until the parent has reopened the file
        finally:
            os._exit(code)
    try:
        os.read(started, 1)
        sink.close()
        with cls(path) as again:  # not refused as "written by another process"
            again.log(plain, 2)
    finally:
        os.write(go, b"x")
        _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    lines = path.read_text().splitlines()
    steps = [r["step"] for r in _csv_rows(path)[1]] if cls is CSVSink else [json.loads(x)["step"] for x in lines]
    assert steps == (["0", "2"] if cls is CSVSink else [0, 2])  # the child wrote no copy of step 0
