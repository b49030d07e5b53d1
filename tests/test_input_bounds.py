"""Every file a user names is read through ``shared.files``: regular files only, a size cap
checked before reading, gzip decompressed under a cap, JSON and YAML nesting bounded, YAML
aliases bounded by what they expand to. Each case was a hang, gigabytes of memory or a
traceback (issue 32: M1, H1, H4/M2, T3-T6, and the 2 GiB profile, mapping and results files);
each now ends in one line and exit 2."""

from __future__ import annotations

import os
import signal
import zlib
from pathlib import Path

import pytest

from overlap_lab.cli.main import main
from overlap_lab.shared import files
from overlap_lab.shared.errors import ConfigError

SMALL = ["--out", "", "--layers", "2", "--ep", "8", "--batch", "4"]


@pytest.fixture(autouse=True)
def no_hang():
    """A case that blocks (a FIFO opened for reading) fails here instead of hanging the suite."""

    def stop(*_):
        raise TimeoutError("blocked for 60 s")

    old = signal.signal(signal.SIGALRM, stop)
    signal.alarm(60)
    yield
    signal.alarm(0)
    signal.signal(signal.SIGALRM, old)


def refused(capsys, argv: list[str], *fragments: str, fn=main) -> str:
    try:
        code = fn(argv)
    except SystemExit as e:
        code = e.code
    out, err = capsys.readouterr()
    assert code == 2 and "Traceback" not in err, (code, out, err)
    assert err.strip().count("\n") == 0, err
    for f in fragments:
        assert f in err, err
    return err


@pytest.fixture
def reads(monkeypatch) -> list[str]:
    """The files ``os.read`` reads from while the test runs, by resolved path: a file refused
    unread is not among them."""
    seen: list[str] = []
    real = os.read

    def counted(fd, n):
        try:
            seen.append(os.path.realpath(os.readlink(f"/proc/self/fd/{fd}")))
        except OSError:
            pass
        return real(fd, n)

    monkeypatch.setattr(os, "read", counted)
    return seen


def unread(reads: list[str], *paths) -> bool:
    return not {os.path.realpath(p) for p in paths} & set(reads)


# ---- what a file is --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "argv",
    [
        ["sim", *SMALL, "--model-file", "{f}.yaml"],
        ["sim", *SMALL, "--gpu-file", "{f}.yaml"],
        ["sim", *SMALL, "--profile", "{f}.json"],
        ["analyze", "{f}.json", "--out", ""],
        ["analyze", "t.json", "--map", "{f}.json", "--out", ""],
        ["validate", "--layers", "2", "{f}.json", "--schedule", "serial", "--out", ""],
        ["calibrate", "--layers", "2", "--from-trace", "{f}.json", "--out", "p.json"],
        ["sweep", "{f}.yaml", "--out", "s.csv", "--no-progress"],
        ["sim", *SMALL[2:], "--ranks", "explicit", "--imbalance", "file:{f}.csv"],
    ],
)
def test_a_fifo_as_an_input_is_refused_unopened_for_blocking(tmp_path, capsys, monkeypatch, argv):
    """H1: open() of a FIFO without a writer blocked forever."""
    monkeypatch.chdir(tmp_path)
    Path("t.json").write_text('{"traceEvents": []}')
    for suffix in (".yaml", ".json", ".csv"):
        os.mkfifo(f"f{suffix}")
    refused(capsys, [a.format(f="f") for a in argv], "f.", "FIFO, not a regular file")


def test_a_fifo_as_an_output_file_is_refused_before_the_work(tmp_path, capsys, monkeypatch):
    """H1: ``sweep --out`` read a FIFO (its header check) and blocked; ``calibrate --out`` and
    ``kernels --out`` would block writing it once the work was done."""
    monkeypatch.chdir(tmp_path)
    os.mkfifo("f.csv")
    os.mkfifo("f.json")
    Path("spec.yaml").write_text("base: {layers: 2}\ngrid: {batch: [16]}\n")
    refused(capsys, ["sweep", "spec.yaml", "--out", "f.csv", "--no-progress"], "FIFO")
    trace = Path("t.json")
    trace.write_text('{"traceEvents": []}')
    refused(capsys, ["calibrate", "--from-trace", str(trace), "--out", "f.json"], "FIFO")
    pytest.importorskip("torch")
    refused(
        capsys, ["kernels", "--device", "cpu", "--repeats", "1", "--out", "f.json"], "not a folder"
    )


@pytest.mark.parametrize("device", ["/dev/zero", "/dev/urandom", "/dev/full"])
def test_a_device_as_a_trace_is_refused_unread(capsys, reads, device):
    """M1: analyze, validate and calibrate --from-trace read a device whole: 4 GiB in seconds."""
    refused(capsys, ["analyze", device, "--out", ""], device, "device, not a regular file")
    refused(capsys, ["validate", "--layers", "2", device, "--out", ""], "not a regular file")
    assert unread(reads, device)


def test_a_symlink_to_a_device_is_a_device(tmp_path, capsys, reads):
    (tmp_path / "z.json").symlink_to("/dev/zero")
    refused(capsys, ["analyze", str(tmp_path / "z.json"), "--out", ""], "device")
    assert unread(reads, "/dev/zero")


# ---- size ----------------------------------------------------------------------------------------


def _sparse(path: Path, size: int) -> Path:
    with open(path, "wb") as f:
        f.truncate(size)
    return path


@pytest.mark.parametrize("kind", ["profile", "map", "draw", "model", "routing", "trace"])
def test_a_2_gib_file_is_refused_by_its_size_before_a_byte_is_read(tmp_path, capsys, reads, kind):
    """A 2 GiB file given to --profile, --map or experiments --draw took 4.1 GB before "not
    JSON"; a 250 MB routing CSV passed its 256 MiB cap and reached 6 GB."""
    big = _sparse(tmp_path / ("pp_bubbles.json" if kind == "draw" else "big.json"), 2 << 30)
    if kind == "draw":
        from overlap_lab.experiments.runner import main as experiments

        argv = ["pp_bubbles", "--draw", "--out", str(tmp_path)]
        refused(capsys, argv, "larger than 16 MiB", fn=experiments)
    elif kind == "routing":
        csv = _sparse(tmp_path / "big.csv", 250 << 20)
        argv = ["sim", *SMALL, "--ranks", "explicit", "--imbalance", f"file:{csv}"]
        refused(capsys, argv, "routing file", "larger than 32 MiB")
    else:
        argv = {
            "profile": ["sim", *SMALL, "--profile", str(big)],
            "map": ["analyze", str(big), "--map", str(big), "--out", ""],
            "model": ["sim", *SMALL, "--model-file", str(tmp_path / "big.yaml")],
            "trace": ["analyze", str(big), "--out", ""],
        }[kind]
        if kind == "model":
            _sparse(tmp_path / "big.yaml", 2 << 30)
        refused(capsys, argv, "larger than")
    assert unread(reads, *tmp_path.iterdir())


def test_a_gzip_bomb_is_refused_at_its_cap_of_output(tmp_path, capsys):
    """A 1 GiB gzip bomb took 2.1 GB: it was decompressed whole, then parsed."""
    p = tmp_path / "bomb.json.gz"
    z = zlib.compressobj(1, zlib.DEFLATED, 31)
    zero = bytes(1 << 20)
    with open(p, "wb") as f:
        for _ in range((files.MAX_TRACE_BYTES >> 20) + 1):
            f.write(z.compress(zero))
        f.write(z.flush())
    assert p.stat().st_size < 1 << 20
    refused(capsys, ["analyze", str(p), "--out", ""], "decompresses to more than 128 MiB")


def test_gzip_reading_is_whole_and_capped(tmp_path):
    import gzip

    p = tmp_path / "t.json.gz"
    p.write_bytes(gzip.compress(b'{"a": 1}') + gzip.compress(b""))  # two members
    assert files.read_json(p, gunzip=True) == {"a": 1}
    p.write_bytes(gzip.compress(bytes(5000))[:-8])
    with pytest.raises(ConfigError, match="not a whole gzip file"):
        files.read_bytes(p, gunzip=True)
    p.write_bytes(gzip.compress(bytes(5000)))
    with pytest.raises(ConfigError, match="decompresses to more than"):
        files.read_bytes(p, cap=4096, gunzip=True)
    p.write_bytes(b"\x1f\x8bnot gzip")
    with pytest.raises(ConfigError, match="not a gzip file"):
        files.read_bytes(p, gunzip=True)


# ---- shape ---------------------------------------------------------------------------------------

#: Nine aliases of nine aliases, ten deep: 3.5e9 values from a 1.5 KB file
LOL = "[&a [x,x,x,x,x,x,x,x,x], " + ", ".join(
    f"&{b} [{', '.join([f'*{a}'] * 9)}]" for a, b in zip("abcdefghi", "bcdefghij")
) + "]"  # fmt: skip


@pytest.mark.parametrize(
    "option, text",
    [
        ("--model-file", f"name: {LOL}\nnum_layers: 61\n"),
        ("--gpu-file", f"name: h800\nnum_sms: 132\ndeepep_release: {LOL}\n"),
    ],
)
def test_a_yaml_alias_bomb_is_refused_when_read(tmp_path, capsys, option, text):
    """H4/M2: a 2 KB file passed the size cap and expanded when printed or converted."""
    p = tmp_path / "lol.yaml"
    p.write_text(text)
    assert len(text) < 2048
    refused(capsys, ["sim", *SMALL, option, str(p)], "aliases expanded")


@pytest.mark.parametrize(
    "spec",
    [
        f"base: {{layers: 2, kv-lens: {LOL}}}\ngrid: {{batch: [1]}}\n",
        f"cases:\n  - {{schedule: {LOL}}}\n",
    ],
)
def test_a_sweep_spec_alias_bomb_is_refused_when_read(tmp_path, capsys, spec):
    p = tmp_path / "spec.yaml"
    p.write_text(spec)
    argv = ["sweep", str(p), "--out", str(tmp_path / "s.csv"), "--no-progress"]
    refused(capsys, argv, "aliases expanded")


def test_shared_aliases_are_counted_by_what_they_expand_to():
    a = [1] * 10
    b = [a] * 10
    files.check_shape({"b": b}, "x", max_values=200)  # 1 + 1 + 10 * (1 + 10) = 112
    with pytest.raises(ConfigError, match="more than 100 values"):
        files.check_shape({"b": b}, "x", max_values=100)
    loop: list = []
    loop.append(loop)
    with pytest.raises(ConfigError, match="contains itself"):
        files.check_shape({"k": loop}, "x")


def test_a_yaml_file_that_contains_itself_is_refused(tmp_path):
    p = tmp_path / "m.yaml"
    p.write_text("name: &a [1, *a]\n")
    with pytest.raises(ConfigError, match="contains itself"):
        files.read_mapping(p)


@pytest.mark.parametrize("depth", [101, 5000, 200_000])
def test_deep_nesting_is_refused_in_one_line(tmp_path, capsys, depth):
    """T3 (--profile, experiments --profile) and T5 (a sweep spec): RecursionError tracebacks."""
    deep = tmp_path / "deep.json"
    deep.write_text("[" * depth + "]" * depth)
    refused(capsys, ["sim", *SMALL, "--profile", str(deep)], "nested")
    from overlap_lab.experiments.runner import main as experiments

    argv = ["deepep_tables", "--profile", str(deep), "--out", str(tmp_path / "eo")]
    refused(capsys, argv, "nested", fn=experiments)
    spec = tmp_path / "deep.yaml"
    spec.write_text("grid: " + "[" * depth + "]" * depth + "\n")
    refused(capsys, ["sweep", str(spec), "--out", str(tmp_path / "s.csv"), "--no-progress"])


def test_nesting_within_the_bound_is_read():
    files.check_shape([[[]]] * 3, "x")
    v: list = []
    for _ in range(files.MAX_DEPTH - 1):
        v = [v]
    files.check_shape(v, "x")
    with pytest.raises(ConfigError, match="nested more than 100 deep"):
        files.check_shape([v], "x")


# ---- CSV fields ------------------------------------------------------------------------------------


def test_a_routing_csv_field_over_128_kib_is_one_line(tmp_path, capsys):
    """T4: _csv.Error: field larger than field limit (131072)."""
    p = tmp_path / "long.csv"
    p.write_text("1" * 140_000 + "\n")
    argv = ["sim", *SMALL, "--ranks", "explicit", "--imbalance", f"file:{p}"]
    refused(capsys, argv, "routing file", "not a CSV of numbers")


def test_a_sweep_out_with_a_long_first_line_is_one_line(tmp_path, capsys):
    """T6: the header check of an existing --out raised _csv.Error."""
    spec = tmp_path / "spec.yaml"
    spec.write_text("base: {layers: 2}\ngrid: {batch: [16]}\n")
    _sparse(tmp_path / "big.csv", 17 << 20)
    argv = ["sweep", str(spec), "--out", str(tmp_path / "big.csv"), "--no-progress"]
    refused(capsys, argv, "not this sweep's results file")


# ---- sizes of the work ---------------------------------------------------------------------------


def test_the_sensitivity_design_has_an_upper_bound(capsys, monkeypatch):
    """H2: lhs=100000 ran past a minute, lhs=1e8 reached 18 GB."""
    from overlap_lab import sensitivity

    with pytest.raises(ConfigError, match=r"lhs must be in 0\.\.1000"):
        sensitivity.Design(lhs=sensitivity.MAX_LHS + 1)
    assert len(sensitivity.Design(oat=False, lhs=sensitivity.MAX_LHS).points()) == 1000
    monkeypatch.setattr("overlap_lab.sim.engine.Engine.run", lambda *a: pytest.fail("simulated"))
    argv = ["compare", "--out", "", "--json", "--layers", "2", "--schedules", "serial,tbo",
            "--sensitivity=lhs=100000"]  # fmt: skip
    refused(capsys, argv, "lhs must be in 0..1000")


def test_kernels_cpu_dry_run_is_bounded(capsys):
    """H3: the dry run at the documented maxima (--repeats 10000 --warmup 1000) ran past two
    minutes."""
    pytest.importorskip("torch")
    from overlap_lab.measure import KERNELS_CPU_REPEATS as CPU_REPEATS
    from overlap_lab.measure import KERNELS_CPU_WARMUP as CPU_WARMUP

    argv = ["kernels", "--device", "cpu", "--repeats", "10000", "--warmup", "1000"]
    refused(capsys, argv, f"--repeats at most {CPU_REPEATS}", f"--warmup at most {CPU_WARMUP}")
    argv = ["kernels", "--device", "cpu", "--repeats", str(CPU_REPEATS + 1), "--warmup", "0"]
    refused(capsys, argv, "dry run")
