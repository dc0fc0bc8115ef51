"""The step CLI's contract: last stdout line is JSON, exit 2 with one line for bad usage."""

from tests.conftest import run_step


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
