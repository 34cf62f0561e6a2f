"""A second text, from another register than the built-in Brown + KJV split: Debian's fortune cookies.

The granitemoe and mixtral families (scripts/train_family.py --text fortunes) train on its train part
and are evaluated on its held-out calibration and test parts, which they never see in training.

Source: the Debian packages `fortunes` and `fortunes-min` (1:1.99.1-7.3; BSD fortune data, see
/usr/share/doc/fortunes/copyright), as installed under /usr/share/games/fortunes: one file per topic,
fortunes separated by lines holding only "%". `ascii-art` is left out (drawings, not prose).
Overstrikes (x BACKSPACE y, the old underlining) keep the second character; other control characters
but tab and newline are dropped; trailing spaces and blank edge lines are trimmed. A fortune that
recurs (the same words in another file or twice in one) is kept once.

Split by fortune, never by line: a fortune goes to `test` when the SHA-1 of its words is 0 mod 20, to
`calibration` when 1 mod 20, else to `train` (the rule scripts/prepare_data.py uses for the built-in
split), so the parts are disjoint and a fortune's part does not depend on its file or position.
Fortunes that share a paragraph (40 characters or more, compared in lower case, letters and digits
only: the same quote under two attributions) go together, by the hash of the least of them. Within
each part the fortunes are ordered by that hash, so any prefix of a part (the first tokens a sweep
evaluates; the last ones training validates on) mixes all the topics. Fortunes are separated by a
blank line.

Written to examples/texts/fortunes/: train.txt.xz (only the training script reads it), and
calibration.txt and test.txt as plain UTF-8, the form allocmoe's --calib-text and --text take:

    python scripts/fortunes.py                     # needs: apt-get install fortunes fortunes-min
    allocmoe sweep --model examples/models/granitemoe \\
        --calib-text examples/texts/fortunes/calibration.txt --text examples/texts/fortunes/test.txt
"""

from __future__ import annotations

import argparse
import hashlib
import lzma
import re
from pathlib import Path

SOURCE = Path("/usr/share/games/fortunes")
OUT_DIR = Path(__file__).resolve().parents[1] / "examples" / "texts" / "fortunes"
LEFT_OUT = {"ascii-art"}
SPLIT_OF_BUCKET = {0: "test", 1: "calibration"}      # of 20 hash buckets; the other 18 train
SPLITS = ("train", "calibration", "test")


def clean(fortune: str) -> str:
    """One fortune as plain text: overstrikes resolved, control characters dropped, edges trimmed."""
    fortune = re.sub(r".\x08", "", fortune)
    fortune = re.sub(r"[\x00-\x08\x0b-\x1f\x7f]", "", fortune)
    return "\n".join(line.rstrip() for line in fortune.splitlines()).strip("\n")


def fortunes(source: Path = SOURCE) -> list[str]:
    """Every fortune of every data file in `source` (sorted by file name), each once."""
    files = sorted(p for p in source.iterdir() if p.is_file() and not p.is_symlink() and p.suffix != ".dat"
                   and p.name not in LEFT_OUT)
    if not files:
        raise SystemExit(f"no fortune files in {source}; install them: apt-get install -y fortunes fortunes-min")
    seen, found = set(), []
    for path in files:
        for chunk in re.split(r"(?m)^%\n", path.read_text(encoding="utf-8") + "\n"):
            text = clean(chunk)
            key = " ".join(text.split())
            if key and key not in seen:
                seen.add(key)
                found.append(text)
    return found


def key_of(fortune: str) -> int:
    return int(hashlib.sha1(" ".join(fortune.split()).encode()).hexdigest(), 16)


def paragraph_keys(fortune: str) -> set[str]:
    """Its paragraphs of 40 or more characters, lower-cased, as words of letters and digits only."""
    keys = {" ".join(re.findall(r"[a-z0-9]+", p.lower())) for p in re.split(r"\n\s*\n", fortune)}
    return {key for key in keys if len(key) >= 40}


def group_keys(all_fortunes: list[str]) -> list[int]:
    """Each fortune's group key: fortunes that share a paragraph (the same quote under two
    attributions, a story told twice with a different ending) form a group, whose key is its least
    member's `key_of`, so a group falls in one part and no held-out paragraph is trained on."""
    parent = list(range(len(all_fortunes)))

    def root(i: int) -> int:
        while parent[i] != i:
            parent[i] = parent[parent[i]]
            i = parent[i]
        return i

    first: dict[str, int] = {}
    for i, fortune in enumerate(all_fortunes):
        for key in sorted(paragraph_keys(fortune)):
            parent[root(i)] = root(first.setdefault(key, i))
    least: dict[int, int] = {}
    for i, fortune in enumerate(all_fortunes):
        least[root(i)] = min(least.get(root(i), key_of(fortune)), key_of(fortune))
    return [least[root(i)] for i in range(len(all_fortunes))]


def split(all_fortunes: list[str]) -> dict[str, list[str]]:
    """split name -> the fortunes of that part, in hash order."""
    parts: dict[str, list[str]] = {name: [] for name in SPLITS}
    for group, fortune in sorted(zip(group_keys(all_fortunes), all_fortunes), key=lambda pair: key_of(pair[1])):
        parts[SPLIT_OF_BUCKET.get(group % 20, "train")].append(fortune)
    return parts


def write(out_dir: Path = OUT_DIR, source: Path = SOURCE) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    for name, part in split(fortunes(source)).items():
        text = "\n\n".join(part) + "\n"
        if name == "train":
            with lzma.open(out_dir / "train.txt.xz", "wt", encoding="utf-8", preset=9) as f:
                f.write(text)
        else:
            (out_dir / f"{name}.txt").write_text(text, encoding="utf-8")
        print(f"{name}: {len(part):,} fortunes, {len(text.encode()) / 1e6:.2f} MB")


def train_text(out_dir: Path = OUT_DIR) -> str:
    """The train part, written first from the installed fortune files if it is not there yet."""
    path = out_dir / "train.txt.xz"
    if not path.exists():
        write(out_dir)
    return lzma.open(path, "rt", encoding="utf-8").read()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--source", type=Path, default=SOURCE, help="folder of fortune data files")
    parser.add_argument("--out", type=Path, default=OUT_DIR)
    args = parser.parse_args()
    write(args.out, args.source)


if __name__ == "__main__":
    main()
