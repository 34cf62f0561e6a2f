"""One name per idea across the CLI, Python and the configs (issue 36): `calib_tokens`, `eval_tokens`,
`windows_per_pass` (profile/eval batch) and bench's `sequences`, with the old names still taken as
deprecated aliases that warn and name the new one."""

import re

import pytest

from allocmoe import AllocMoeError
from allocmoe.calibrate.distinct import DistinctConfig
from allocmoe.calibrate.methods import AllocateConfig
from allocmoe.calibrate.profile import ProfileConfig
from allocmoe.cli import build_parser, main
from allocmoe.core.config import checked_config
from allocmoe.measure.bench import BenchConfig
from allocmoe.pipelines.sweep import SweepConfig
from allocmoe.scoring.perplexity import PerplexityConfig

RENAMED = [  # (config class, old name, new name, a value the field takes)
    (ProfileConfig, "max_tokens", "calib_tokens", 512),
    (ProfileConfig, "batch_size", "windows_per_pass", 2),
    (AllocateConfig, "calib_max_tokens", "calib_tokens", 512),
    (AllocateConfig, "batch_size", "windows_per_pass", 2),
    (DistinctConfig, "calib_max_tokens", "calib_tokens", 512),
    (PerplexityConfig, "max_tokens", "eval_tokens", 512),
    (PerplexityConfig, "batch_size", "windows_per_pass", 2),
    (SweepConfig, "eval_max_tokens", "eval_tokens", 512),
    (SweepConfig, "batch_size", "windows_per_pass", 2),
    (BenchConfig, "batch_size", "sequences", 2),
]


@pytest.mark.parametrize("cls,old,new,value", RENAMED, ids=lambda x: getattr(x, "__name__", str(x)))
def test_an_old_field_name_still_works_and_warns_naming_the_new_one(cls, old, new, value):
    with pytest.warns(DeprecationWarning, match=re.escape(f"{cls.__name__}({old}=...) is deprecated; use {new}=")):
        config = cls(**{old: value})
    assert getattr(config, new) == value and config == cls(**{new: value})
    with pytest.warns(DeprecationWarning, match=re.escape(f"use {cls.__name__}.{new}")):
        assert getattr(config, old) == value                      # read under the old name, warned
    with pytest.warns(DeprecationWarning):
        assert checked_config(cls, {old: value}) == config       # a dict with the old key, as allocate(config=) takes
    with pytest.raises(AllocMoeError, match=f"got both {old} and {new}"):
        cls(**{old: value, new: value})
    assert old not in cls.model_fields and new in cls.model_fields   # one field, under the new name


def test_every_config_is_a_strict_pydantic_model_that_forbids_extra_fields():
    from pydantic import BaseModel

    for cls in (ProfileConfig, AllocateConfig, DistinctConfig, PerplexityConfig, SweepConfig, BenchConfig):
        assert issubclass(cls, BaseModel) and cls.model_config["extra"] == "forbid" and cls.model_config["strict"]
        assert cls().model_dump() == cls(**cls().model_dump()).model_dump()        # a dump makes the same config


def test_the_new_names_are_checked_with_the_cli_flag_in_the_message():
    cases = [(lambda: ProfileConfig(calib_tokens=1), "calib_tokens (--calib-tokens) must be a whole number >= 2"),
             (lambda: PerplexityConfig(eval_tokens=0), "eval_tokens (--eval-tokens) must be a whole number >= 1"),
             (lambda: AllocateConfig(windows_per_pass=0), "windows_per_pass (--windows-per-pass) must be a whole number"),
             (lambda: BenchConfig(sequences=0), "sequences (--sequences) must be a whole number >= 1"),
             (lambda: BenchConfig(warmup=-1), "warmup (--warmup) must be a whole number >= 0"),
             (lambda: BenchConfig(repeats="5"), "repeats (--repeats) must be a whole number"),
             (lambda: BenchConfig(colour=1), "unknown BenchConfig field(s) ['colour']")]
    for make, message in cases:
        with pytest.raises(AllocMoeError, match=re.escape(message)):
            make()


def _help(command: str) -> str:
    sub = next(a for a in build_parser()._actions if hasattr(a, "choices") and isinstance(a.choices, dict))
    return sub.choices[command].format_help()


@pytest.mark.parametrize("command,new", [("profile", "--windows-per-pass"), ("allocate", "--windows-per-pass"),
                                         ("eval", "--windows-per-pass"), ("sweep", "--windows-per-pass"),
                                         ("analyze", "--windows-per-pass"), ("bench", "--sequences")])
def test_batch_size_is_a_deprecated_alias_that_says_so_in_help(command, new):
    text = " ".join(_help(command).split())
    assert new in text
    assert f"--batch-size N deprecated; use {new}" in text


def test_the_old_flag_sets_the_new_one_with_a_warning_line(capsys):
    parser = build_parser()
    args = parser.parse_args(["bench", "--budget", "0.5", "--batch-size", "3"])
    assert args.sequences == 3
    args = parser.parse_args(["profile", "--output", "p.json", "--batch-size", "2"])
    assert args.windows_per_pass == 2
    assert "--batch-size is deprecated; use --windows-per-pass" in capsys.readouterr().err


def test_a_config_the_cli_builds_is_refused_in_one_line_with_exit_2(capsys, tmp_path):
    """ProfileConfig's own rule (no --ray with --max-memory), reached through the command line."""
    with pytest.raises(SystemExit) as exc:
        main(["profile", "--output", str(tmp_path / "p.json"), "--ray", "--max-memory", "1GiB"])
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--ray and --max-memory cannot be combined" in err[0], err


def test_evaluate_model_takes_its_scoring_settings_as_one_config_or_as_keywords(tiny_folder):
    from allocmoe import evaluate_model

    with pytest.raises(AllocMoeError, match=re.escape("eval_tokens (--eval-tokens) must be a whole number >= 1")):
        evaluate_model(tiny_folder, config={"eval_tokens": 0})
    with pytest.raises(AllocMoeError, match=re.escape("got config= and ['windows_per_pass']")):
        evaluate_model(tiny_folder, config=PerplexityConfig(), windows_per_pass=2)
    with pytest.raises(AllocMoeError, match="under the old and the new name"):
        evaluate_model(tiny_folder, eval_tokens=64, max_tokens=64)
    with pytest.raises(AllocMoeError, match=re.escape("unexpected keyword(s) ['colour']")):
        evaluate_model(tiny_folder, colour=1)
    with pytest.warns(DeprecationWarning, match="use eval_tokens="), \
            pytest.raises(AllocMoeError, match=re.escape("eval_tokens (--eval-tokens)")):
        evaluate_model(tiny_folder, max_tokens=-3, progress=False)
