"""The examples as users run them: examples/train_digits.py checkpoints, resumes (also from a
checkpoint that has nothing left to train) and writes a log-friendly progress bar."""

import os
import subprocess
import sys

import pytest

pytest.importorskip("sklearn")
EXAMPLES = os.path.join(os.path.dirname(__file__), os.pardir, "examples")


def train_digits(*args):
    p = subprocess.run([sys.executable, "train_digits.py", *args], cwd=EXAMPLES, capture_output=True, text=True,
                       timeout=300)
    assert p.returncode == 0, p.stdout + p.stderr
    return p


def test_train_digits_checkpoints_resumes_and_evaluates_a_finished_checkpoint(tmp_path):
    ckpt = str(tmp_path / "ckpt")
    first = train_digits("--epochs", "2", "--checkpoint", ckpt, "--stop-after", "1")
    assert "stopped after epoch 1" in first.stdout
    second = train_digits("--epochs", "2", "--checkpoint", ckpt, "--resume", ckpt)
    assert "resumed from" in second.stdout and "median step" in second.stdout and "(batch 64)" in second.stdout
    # The checkpoint now holds both epochs: resuming again trains nothing and only evaluates.
    third = train_digits("--epochs", "2", "--resume", ckpt)
    assert "has finished all 2 epochs: evaluating only" in third.stdout
    accuracy = [[ln for ln in p.stdout.splitlines() if ln.startswith("test accuracy: ")] for p in (second, third)]
    assert len(accuracy[1]) == 1 and accuracy[0] == accuracy[1]  # the same weights
    assert "arena:" not in third.stdout  # nothing was compiled, so there is no arena to report


def test_progress_bar_writes_only_final_lines_when_stderr_is_not_a_terminal():
    p = train_digits("--epochs", "2")
    assert "\r" not in p.stderr
    lines = [ln for ln in p.stderr.splitlines() if ln.startswith("epoch")]
    assert [ln.split()[0:2] for ln in lines] == [["epoch", "1/2"], ["epoch", "2/2"]]
    assert all("23/23" in ln for ln in lines), lines
