"""The step CLI's contract: last stdout line is JSON, exit 2 with one line for bad usage."""

from tests.helpers.step_cli import run_step


def test_unknown_step_exit_2():
    rc, s, err = run_step("nope")
    assert rc == 2 and s == {"ok": False, "step": "nope", "error": s["error"]} and "unknown step" in err


def test_usage_error_is_one_line():
    rc, s, err = run_step("preprocess", "--dataset", "gsm8k")
    assert rc == 2 and not s["ok"] and "--input" in s["error"] and "Traceback" not in err
    assert len(err.strip().splitlines()) == 1


def test_help_lists_steps():
    rc, s, err = run_step("--help")
    assert rc == 0 and "preprocess" in err and "render-rayjob" in err


def test_anything_unexpected_is_exit_1_one_line_and_a_json_summary(monkeypatch, capsys):
    """The README's promise: an error that is not bad input (here a fault injected into a real step's run) exits 1
    with one line on stderr and the JSON summary last on stdout; the traceback only with PIPELINE_DEBUG."""
    import importlib
    import json

    from pipeline_steps import cli

    module = importlib.import_module(cli.STEPS["preprocess"][0])

    def broken(args):
        raise RuntimeError("disk controller on fire\nsecond line")

    monkeypatch.setattr(module, "run", broken)
    argv = ["preprocess", "--dataset", "gsm8k", "--input", "/x", "--output", "/y"]
    monkeypatch.delenv("PIPELINE_DEBUG", raising=False)
    assert cli.main(argv) == 1
    out, err = capsys.readouterr()
    assert json.loads(out.strip().splitlines()[-1]) == {
        "ok": False,
        "step": "preprocess",
        "error": "RuntimeError: disk controller on fire",
    }
    lines = [x for x in err.splitlines() if "unexpected error" in x or "Traceback" in x]
    assert lines == [
        "unexpected error in step 'preprocess': RuntimeError: disk controller on fire "
        "(set PIPELINE_DEBUG=1 for the traceback)"
    ], err
    monkeypatch.setenv("PIPELINE_DEBUG", "1")
    assert cli.main(argv) == 1
    assert "Traceback" in capsys.readouterr().err
