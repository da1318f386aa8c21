"""Property-based: command lines with at least one bad argument (a number out of range, nan, an
unknown choice, a malformed or missing file, an --out that cannot be written) exit 2 with one line
on stderr naming the option or the file, before any work, and leave no file behind.

Examples: 1,500 command lines with bad options + 500 of random words (docs/RELIABILITY.md).
"""

from __future__ import annotations

import contextlib
import io
import os
import tempfile
from pathlib import Path

from hypothesis import given
from hypothesis import strategies as st

from spectune.cli import main
from spectune.runtime.table import Row, write_table
from tests.fuzz import fuzz
from tests.tables import make_params, make_policy, make_profile, make_workload

WORK = Path(tempfile.mkdtemp(prefix="spectune-cli-fuzz-"))
PROFILE = WORK / "inputs" / "profile.yaml"
POLICY = WORK / "inputs" / "policy.yaml"
GARBAGE = WORK / "inputs" / "garbage.yaml"
GARBAGE_JSON = WORK / "inputs" / "garbage.json"


def _inputs() -> None:
    profile = make_profile(make_params((5.0, 0.02, 64.0, 0.05, 30.0), (0.05, 0.4, 0.002), (0.02, 0.0001)),
                           make_workload(3, 8, context_len=64))
    write_table(profile, PROFILE)
    policy = make_profile(profile.costs.model, profile.workload,
                          policy=make_policy([8, 16, 32], [Row((1, 4), 3, 12, tier=16), Row((5, 8), 2, 16, tier=32)],
                                             window=256.0, margin=0.01))
    write_table(policy, POLICY)
    GARBAGE.write_bytes(b"schema: spectune/1\n\xff\x00 [unclosed: {\n")
    GARBAGE_JSON.write_bytes(b'{"rows": [{"concurrency": -1}]')


_inputs()
INPUTS = sorted(p.name for p in (WORK / "inputs").iterdir())

bad_number = st.sampled_from(["-1", "0", "nan", "inf", "-inf", "abc", "", "1e999", "-0", "1,5", "0x10"])
bad_int = st.sampled_from(["-1", "0", "1.5", "nan", "x", "", "99999999999", "1e3"])
bad_seed = st.sampled_from(["-1", "4294967296", "x", "1.0"])
bad_acceptance = st.sampled_from(["curve:2", "curve:", "curve:0.5,0.9", "mixture:0.5*curve(0.8)", "public:x/y/z",
                                  "nonsense", "metrics:/nonexistent.prom", "missing.jsonl", f"metrics:{GARBAGE}",
                                  f"{GARBAGE_JSON}l"])
bad_file = st.sampled_from(["/nonexistent.yaml", str(GARBAGE), str(WORK / "inputs"), "/dev/null", str(GARBAGE_JSON)])

# per command: (positional / required arguments that are valid, {option: bad values})
COMMANDS = {
    "tune": ([str(PROFILE), "--out", "out.yaml"], {
        "--latency-bound-ms": bad_number, "--capture-budget-mib": bad_number, "--capture-seconds": bad_number,
        "--trials": bad_int, "--seed": bad_seed, "--max-batch": st.sampled_from(["0", "100000", "-3", "x"]),
        "--smooth": st.sampled_from(["1", "-0.1", "nan", "2"]), "--context-len": st.sampled_from(["0", "99999999999"]),
        "--objective": st.sampled_from(["gjodput", ""]), "--acceptance": bad_acceptance}),
    "bench": ([f"--policy={POLICY}", "--out", "b.json", "--device", "cpu"], {
        "--concurrency": st.sampled_from(["0", "x", "-1", "", "1,,2"]), "--arms": st.sampled_from(["fixed:99", "bogus", ""]),
        "--prompts": bad_int, "--max-new-tokens": st.sampled_from(["0", "1000000", "x"]),
        "--prompt-len": st.sampled_from(["0", "100000", "-5"]), "--time-limit": bad_number, "--seed": bad_seed,
        "--dtype": st.sampled_from(["int4", ""]), "--acceptance": bad_acceptance}),
    "export": ([str(POLICY)], {"--format": st.sampled_from(["bogus", ""]), "--out": st.sampled_from([
        str(WORK / "inputs"), "/proc/spectune-cannot-write"])}),
    "profile": (["--no-progress", "--device", "cpu", "--out", "p.yaml"], {
        "--batch-sizes": st.sampled_from(["0-3", "4-2", "1,x", "1-5000", ""]), "--max-k": st.sampled_from(["0", "65", "x"]),
        "--context-len": st.sampled_from(["0", "-1", "99999999999"]), "--trials": st.sampled_from(["-1", "x"]),
        "--seed": bad_seed, "--dtype": st.sampled_from(["int4"]), "--target": st.sampled_from(["nonsense", ""]),
        "--drafter": st.sampled_from(["medusa", "eagle-0l", ""])}),
    "autotune": (["--no-progress", "--device", "cpu", "--out", "a.yaml"], {
        "--acceptance": bad_acceptance, "--max-k": st.sampled_from(["0", "65"]), "--batch-sizes": st.sampled_from(["0"])}),
}
FILE_COMMANDS = {"validate": [], "show": [], "export": ["--format", "vllm"], "report": ["--out", "r"],
                 "tune": ["--out", "out.yaml"], "bench": ["--out", "b.json"]}


@st.composite
def bad_command_line(draw):
    if draw(st.integers(0, 4)) == 0:  # a bad input file
        cmd = draw(st.sampled_from(sorted(FILE_COMMANDS)))
        path = draw(bad_file)
        return [cmd, *(["--policy", path] if cmd == "bench" else [path]), *FILE_COMMANDS[cmd]]
    cmd = draw(st.sampled_from(sorted(COMMANDS)))
    base, options = COMMANDS[cmd]
    chosen = draw(st.lists(st.sampled_from(sorted(options)), min_size=1, max_size=3, unique=True))
    argv = [cmd, *base]
    for opt in chosen:
        value = draw(options[opt])
        argv += [f"{opt}={value}"] if draw(st.booleans()) or value.startswith("-") else [opt, value]
    return argv


def run(argv: list[str], case: Path) -> tuple[int, str]:
    err = io.StringIO()
    old = os.getcwd()
    os.chdir(case)
    try:
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            rc = main(argv)
    finally:
        os.chdir(old)
    return rc, err.getvalue()


def assert_refused(argv: list[str], case: Path) -> None:
    rc, err = run(argv, case)
    lines = [ln for ln in err.splitlines() if not ln.startswith(("warning:", "WARNING:"))]
    assert rc == 2, (argv, rc, err)
    assert len(lines) == 1 and lines[0].startswith("spectune ") and "Traceback" not in err, (argv, err)
    assert sorted(p.name for p in (WORK / "inputs").iterdir()) == INPUTS
    assert not list(case.iterdir()), (argv, list(case.iterdir()))  # no output, no partial or temporary file


CASE = WORK / "case"
CASE.mkdir()


@fuzz(1500)
@given(argv=bad_command_line())
def test_bad_command_lines_are_one_line_exit_2_and_write_nothing(argv):
    assert_refused(argv, CASE)


words = st.lists(st.one_of(st.text(max_size=10), st.sampled_from(["--out", "-", "--", "=", "--format", "x.yaml"])),
                 max_size=5)


@fuzz(500)
@given(cmd=st.sampled_from(["validate", "show", "export", "report"]), rest=words)
def test_random_words_never_give_a_traceback(cmd, rest):
    argv = [cmd, *rest]
    try:
        rc, err = run(argv, CASE)
    except SystemExit as exc:  # --help (or an abbreviation of it) prints help and exits 0
        assert exc.code == 0
        return
    assert rc == 2 and "Traceback" not in err and err.count("\n") == 1, (argv, err)
    assert not list(CASE.iterdir())
