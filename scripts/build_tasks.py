"""Build the offline lm-evaluation-harness task suite from the built-in test split.

Deterministic (fixed seed, sorted inputs, stable JSON): rerunning writes the same bytes. Tasks:

  allocmoe_lastword  LAMBADA-style: a passage of 40-120 words whose final word also occurs earlier
                     in it; choose that word among 4, the 3 distractors being other words of the
                     same passage (so copying from the context alone does not tell). Chance: 25%.
  allocmoe_cloze     a 30-80 word context from a document; choose its true next sentence among 4
                     (3 distractors are sentences drawn from other documents of similar length).
                     Chance: 25%.
  allocmoe_style     a 30-80 word context; choose its true next sentence among 4, the 3 distractors
                     drawn from the *other* source (Bible vs 1961 American prose). Chance: 25%.
  allocmoe_nextword  a 40-120 word passage; predict its next word with no choices given, scored as
                     lm-eval scores LAMBADA: acc = the greedy continuation is exactly the word, plus
                     word perplexity. Open vocabulary, so more items and a finer measure than the
                     4-way tasks. Chance: always answering the commonest target word (the YAML's
                     metadata.chance, 6.65%: "the").

    python scripts/build_tasks.py [--out DIR]

A development copy (tasks allocmoe_dev_*, same recipes) from the calibration split, for trying
allocation settings without looking at the test items; its YAML names the folder it was written to:

    python scripts/build_tasks.py --split calibration --out dev_tasks
    allocmoe eval --include-path dev_tasks --tasks allocmoe_dev_cloze,allocmoe_dev_nextword ...
"""

from __future__ import annotations

import argparse
import json
import lzma
import random
import re
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT / "src" / "allocmoe" / "builtin" / "data"
OUT = ROOT / "src" / "allocmoe" / "builtin" / "tasks"
SEED = 1234
PER_TASK = 800
NEXTWORD_ITEMS = 2000            # open-vocabulary items are cheap to score: more of them, smaller error

MULTIPLE_CHOICE_YAML = """task: {name}
dataset_path: json
dataset_kwargs:
  data_files:
    test: {{dir}}/{name}.jsonl
test_split: test
output_type: multiple_choice
doc_to_text: context
doc_to_choice: choices
doc_to_target: label
target_delimiter: " "
metric_list:
  - metric: acc
    aggregation: mean
    higher_is_better: true
  - metric: acc_norm
    aggregation: mean
    higher_is_better: true
  - metric: brier_score
    aggregation: brier_score
    higher_is_better: false
metadata:
  version: 1.0
  chance: 0.25
"""

# lm-eval joins a loglikelihood task's context and target with no delimiter, so the target carries
# its space (as in lm-eval's LAMBADA); otherwise "seeds" + "and" would be scored as "seedsand".
NEXTWORD_YAML = """task: {name}
dataset_path: json
dataset_kwargs:
  data_files:
    test: {dir}/{name}.jsonl
test_split: test
output_type: loglikelihood
doc_to_text: context
doc_to_target: "{{{{' ' + target}}}}"
metric_list:
  - metric: acc
    aggregation: mean
    higher_is_better: true
  - metric: perplexity
    aggregation: perplexity
    higher_is_better: false
metadata:
  version: 1.0
  chance: {chance}
"""


def documents(split: str = "test") -> list[str]:
    text = lzma.open(DATA / f"{split}.txt.xz", "rt", encoding="utf-8").read()
    return [d.strip() for d in text.split("\n\n") if d.strip()]


def sentences(doc: str) -> list[str]:
    return [s.strip() for s in re.split(r"(?<=[.!?])\s+", doc.replace("\n", " ")) if s.strip()]


def is_bible(doc: str) -> bool:
    return bool(re.search(r"\b(LORD|unto|thee|thou|hath)\b", doc[:2000]))


def passages(docs: list[str], rng: random.Random, stride: int):
    """(context, final word without trailing punctuation) of 40-120 word passages, one every `stride` words."""
    for doc in docs:
        words = doc.replace("\n", " ").split()
        for start in range(0, max(0, len(words) - 130), stride):
            n = rng.randint(40, 120)
            span = words[start:start + n]
            if len(span) == n:
                yield " ".join(span[:-1]), re.sub(r"[^\w'-]+$", "", span[-1])      # "earth." -> "earth"


def lastword(docs: list[str], rng: random.Random) -> list[dict]:
    items = []
    word = re.compile(r"[A-Za-z][A-Za-z'-]{2,}")
    for earlier, target in passages(docs, rng, 50):
        if not word.fullmatch(target):
            continue
        if not re.search(rf"\b{re.escape(target)}\b", earlier):     # as in LAMBADA: context tells
            continue
        others = sorted({w.lower(): w for w in word.findall(earlier) if w.lower() != target.lower()}.values())
        if len(others) < 3:
            continue
        choices = rng.sample(others, 3) + [target]
        rng.shuffle(choices)
        items.append({"context": earlier, "choices": choices, "label": choices.index(target)})
    rng.shuffle(items)
    return items[:PER_TASK]


def cloze(docs: list[str], rng: random.Random) -> list[dict]:
    pool = [(i, s) for i, d in enumerate(docs) for s in sentences(d) if 6 <= len(s.split()) <= 40]
    items = []
    for i, doc in enumerate(docs):
        sents = sentences(doc)
        for j in range(3, len(sents) - 1, 2):
            context = " ".join(sents[max(0, j - 4):j])
            true = sents[j]
            if not (30 <= len(context.split()) <= 80 and 6 <= len(true.split()) <= 40):
                continue
            others = [s for d, s in rng.sample(pool, 40) if d != i and abs(len(s.split()) - len(true.split())) <= 6][:3]
            if len(others) < 3:
                continue
            choices = others + [true]
            rng.shuffle(choices)
            items.append({"context": context, "choices": choices, "label": choices.index(true)})
    rng.shuffle(items)
    return items[:PER_TASK]


def style(docs: list[str], rng: random.Random) -> list[dict]:
    """Context from one source; the true next sentence against 3 from documents of the other source."""
    pools = {flag: [s for d in docs if is_bible(d) == flag for s in sentences(d) if 6 <= len(s.split()) <= 40]
             for flag in (True, False)}
    items = []
    for doc in docs:
        sents = sentences(doc)
        for j in range(3, len(sents) - 1, 3):
            context, true = " ".join(sents[max(0, j - 4):j]), sents[j]
            if not (30 <= len(context.split()) <= 80 and 6 <= len(true.split()) <= 40):
                continue
            choices = rng.sample(pools[not is_bible(doc)], 3) + [true]
            rng.shuffle(choices)
            items.append({"context": context, "choices": choices, "label": choices.index(true)})
    rng.shuffle(items)
    return items[:PER_TASK]


def nextword(docs: list[str], rng: random.Random) -> list[dict]:
    word = re.compile(r"[A-Za-z][A-Za-z'-]*")
    items = [{"context": context, "target": target} for context, target in passages(docs, rng, 25)
             if word.fullmatch(target)]
    rng.shuffle(items)
    return items[:NEXTWORD_ITEMS]


def commonest_target_rate(items: list[dict]) -> float:
    """The accuracy of always answering the commonest target word: this task's chance rate."""
    return round(Counter(i["target"] for i in items).most_common(1)[0][1] / len(items), 4)


def build(out: Path, split: str = "test") -> dict[str, int]:
    """Write the suite from `split`: the shipped tasks from "test", allocmoe_dev_* from "calibration"."""
    docs = documents(split)
    out.mkdir(parents=True, exist_ok=True)
    # the shipped YAML's ${TASK_DIR} is filled in by allocmoe's harness; a dev copy names its folder
    data_dir = "${TASK_DIR}" if split == "test" else str(out.resolve())
    counts = {}
    for recipe, maker in (("allocmoe_lastword", lastword), ("allocmoe_cloze", cloze), ("allocmoe_style", style),
                          ("allocmoe_nextword", nextword)):
        name = recipe if split == "test" else recipe.replace("allocmoe_", "allocmoe_dev_")
        items = maker(docs, random.Random(f"{SEED}:{recipe}"))
        lines = "".join(json.dumps(item, ensure_ascii=False, sort_keys=True) + "\n" for item in items)
        (out / f"{name}.jsonl").write_text(lines, encoding="utf-8")
        yaml = (NEXTWORD_YAML.format(name=name, dir=data_dir, chance=commonest_target_rate(items))
                if maker is nextword else MULTIPLE_CHOICE_YAML.format(name=name).format(dir=data_dir))
        (out / f"{name}.yaml").write_text(yaml, encoding="utf-8")
        counts[name] = len(items)
    return counts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--split", choices=("test", "calibration"), default="test",
                        help="test: the shipped suite; calibration: a development copy (needs --out)")
    parser.add_argument("--out", type=Path, default=None, help=f"default (test split only): {OUT}")
    args = parser.parse_args()
    if args.out is None and args.split != "test":
        parser.error("--split calibration needs --out DIR (the shipped folder holds the test tasks only)")
    for name, n in build(args.out or OUT, args.split).items():
        print(f"{name}: {n} items")


if __name__ == "__main__":
    main()
