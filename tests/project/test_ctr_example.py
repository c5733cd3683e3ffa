"""The CTR example (examples/train_ctr.py, train_ctr_ps.py): DeepFM with sparse tables learns
clicks on power-law ids, synchronously and with Geo-SGD, and the Paddle parameter-server script
form (one server, two trainers of four devices, through fleetjax-run) trains exactly as the
functional form on eight devices."""

import os
import pathlib
import re
import subprocess
import sys

import pytest
from launching import free_port

EXAMPLES = pathlib.Path(__file__).parents[2] / "examples"
SUMMARY = re.compile(r"loss (?P<first>[\d.]+) -> (?P<last>[\d.]+) \| auc (?P<auc>[\d.]+)")
ENV = {**os.environ, "XLA_FLAGS": "", "JAX_PLATFORMS": "cpu"}
SHORT = ["--steps", "60", "--batch-size", "256", "--ids-per-slot", "1024"]


def summary(text: str) -> dict[str, float]:
    found = SUMMARY.search(text)
    assert found, text
    return {name: float(value) for name, value in found.groupdict().items()}


def run(*args: str) -> dict[str, float]:
    out = subprocess.run(
        [sys.executable, str(EXAMPLES / "train_ctr.py"), *args],
        env=ENV,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr
    return summary(out.stdout)


@pytest.mark.slow
@pytest.mark.parametrize("flags", [[], ["--geo", "5"]], ids=["sync", "geo"])
def test_deepfm_learns_clicks_on_power_law_ids(flags):
    result = run(*SHORT, *flags)
    assert result["last"] < 0.8 * result["first"]
    assert result["auc"] > 0.6  # the hidden model's clicks: 0.5 is chance


@pytest.mark.slow
def test_the_parameter_server_script_trains_as_the_functional_form(tmp_path):
    functional = run(*SHORT)
    launched = subprocess.run(
        [
            sys.executable, "-m", "fleetjax.launch", "--server_num", "1", "--trainer_num", "2",
            "--cpu_devices_per_proc", "4", "--start_port", str(free_port()),
            "--log_dir", str(tmp_path / "log"), str(EXAMPLES / "train_ctr_ps.py"), *SHORT,
        ],
        env=ENV,
        capture_output=True,
        text=True,
        timeout=300,
        cwd=EXAMPLES,
    )  # fmt: skip
    assert launched.returncode == 0, launched.stderr
    ps = summary(launched.stdout)
    assert ps["first"] == pytest.approx(functional["first"], rel=1e-5)
    assert ps["last"] == pytest.approx(functional["last"], rel=1e-4)
    assert ps["auc"] == pytest.approx(functional["auc"], abs=1e-3)
    assert (
        "this server has nothing to serve and ends"
        in (tmp_path / "log" / "serverlog.0").read_text()
    )
