"""``servesim compare`` survives interruption like a sweep: SIGTERM midway, ``--resume``, the same tables."""

from __future__ import annotations

from test_sweep_resume import recorded_points, run_cli_here, scenario, start_cli_at, stop_midway  # noqa: F401

COMPARE = ["--candidate-set", "scheduler.type=continuous", "--seeds", "4", "--workers", "1", "--quiet"]


def test_sigterm_mid_compare_then_resume_gives_the_uninterrupted_tables(scenario, tmp_path):  # noqa: F811
    ref = tmp_path / "ref"
    ref_stdout = run_cli_here(["compare", str(scenario), str(scenario), *COMPARE, "--out", str(ref)])
    out = tmp_path / "cut"
    proc = start_cli_at(["compare", str(scenario), str(scenario), *COMPARE, "--out", str(out)])
    err, _ = stop_midway(proc, out, 3, filename="runs.jsonl")
    assert proc.returncode == 130, err
    done = len(recorded_points(out, "runs.jsonl"))
    assert 3 <= done < 8
    assert err.strip().splitlines()[-1].startswith(f"servesim compare: interrupted: {done} of 8 runs finished, "
                                                   f"recorded in {out / 'runs.jsonl'}; the same command with --resume")
    assert not (out / "compare.json").exists()
    stdout = run_cli_here(["compare", str(scenario), str(scenario), *COMPARE, "--out", str(out), "--resume"])
    assert stdout.splitlines()[0] == f"resumed: {done} runs from runs.jsonl"
    for name in ("compare.csv", "compare_seeds.csv", "compare.json"):
        assert (out / name).read_bytes() == (ref / name).read_bytes(), name
    assert stdout.splitlines()[1:-1] == ref_stdout.splitlines()[:-1]  # the same table, but for the folder
