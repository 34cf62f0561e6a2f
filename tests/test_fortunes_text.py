"""The fortunes text the granitemoe and mixtral families train on keeps its held-out parts out of training.

examples/texts/fortunes/ is written by scripts/fortunes.py: train.txt.xz for training, calibration.txt
and test.txt for allocmoe's --calib-text and --text. The held-out parts must read as allocmoe texts and
share no fortune with the train part, or the families' evaluation would score text they learnt.
"""

from __future__ import annotations

import lzma
from pathlib import Path

import pytest

from allocmoe import read_text

TEXTS = Path(__file__).resolve().parents[1] / "examples" / "texts" / "fortunes"


def paragraphs(text: str) -> set[str]:
    """Its blank-line-separated paragraphs of 60 characters or more (short ones, an attribution or a
    one-liner, may recur in different fortunes), whitespace normalised."""
    return {" ".join(p.split()) for p in text.split("\n\n") if len(" ".join(p.split())) >= 60}


@pytest.mark.parametrize("part", ["calibration", "test"])
def test_held_out_part_reads_as_text_and_is_not_in_train(part):
    text, name = read_text(TEXTS / f"{part}.txt", "test")
    assert name.endswith(f"{part}.txt") and len(text) > 100_000
    train = paragraphs(lzma.open(TEXTS / "train.txt.xz", "rt", encoding="utf-8").read())
    held_out = paragraphs(text)
    assert len(held_out) > 300 and not held_out & train


def test_the_held_out_parts_are_disjoint():
    calibration = paragraphs((TEXTS / "calibration.txt").read_text(encoding="utf-8"))
    assert not calibration & paragraphs((TEXTS / "test.txt").read_text(encoding="utf-8"))
